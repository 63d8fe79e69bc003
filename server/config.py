"""The options of ``pdlab serve`` and ``pdlab bench`` as checked dataclasses (no heavy
imports: the CLI builds its parser from them without loading FastAPI or httpx)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import check_fields

LOOPBACK = "127.0.0.1"
@dataclass(frozen=True)
class ServeConfig:
    """Where and how ``pdlab serve`` listens.

    ``host`` defaults to loopback only; ``port`` 0 is any free port; ``max_body_bytes`` beyond
    which a body gets 413; ``served_model_name`` defaults to ``--model``; ``local`` runs the
    workers in this process (transport ``inprocess``) instead of Ray."""

    host: str = field(default=LOOPBACK, metadata={
        "help": "address to bind", "pattern": r"[A-Za-z0-9_.:\-]+", "hint": "a host name or IP"})
    port: int = field(default=8000, metadata={"help": "TCP port (0 = any free one)", "min": 0})
    max_body_bytes: int = field(default=1 << 20, metadata={
        "help": "largest request body in bytes (larger: HTTP 413)", "min": 1024})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model id clients use (default: the --model value)", "pattern": r"[A-Za-z0-9_./:\-]+",
        "hint": "letters, digits and _./:-"})
    local: bool = field(default=False, metadata={
        "help": "workers in this process (transport inprocess) instead of Ray actors"})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.port > 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


