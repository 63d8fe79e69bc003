"""The options of ``pdlab serve`` and ``pdlab bench`` as checked dataclasses (no heavy
imports: the CLI builds its parser from them without loading FastAPI or httpx)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import check_fields, parse_placement

LOOPBACK = "127.0.0.1"
LABEL_PATTERN = r"[A-Za-z0-9_.\-]+@[A-Za-z0-9:\-]+"


@dataclass(frozen=True)
class ServeConfig:
    """Where and how ``pdlab serve`` listens.

    Attributes:
        host: address to bind (default loopback only; ``0.0.0.0`` only when asked).
        port: TCP port (0 = any free port).
        max_body_bytes: largest request body accepted (bytes); larger gets 413.
        served_model_name: the model id clients send and ``/v1/models`` lists (default:
            the ``--model`` value).
        local: run the workers in this process (transport ``inprocess``) instead of Ray.
    """

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


@dataclass(frozen=True)
class BenchConfig:
    """Which server ``pdlab bench`` drives.

    Attributes:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is appended).
        label: ``NAME@PLACEMENT`` recorded as the placement of every request.
        served_model: model id to send (default: the first one ``/v1/models`` lists).
        request_timeout_s: longest wait for one response (seconds).
    """

    base_url: str = field(default="http://127.0.0.1:8000", metadata={
        "help": "OpenAI-compatible server to drive", "pattern": r"https?://[^\s/]+(/\S*)?",
        "hint": "http://host:port"})
    label: str = field(default="server@colocated:1", metadata={
        "help": "NAME@PLACEMENT recorded for this server (e.g. vllm@colocated:1)",
        "pattern": LABEL_PATTERN, "hint": "NAME@PLACEMENT"})
    served_model: str | None = field(default=None, metadata={
        "help": "model id to send (default: the first of GET /v1/models)", "pattern": r"[A-Za-z0-9_./:\-]+",
        "hint": "letters, digits and _./:-"})
    request_timeout_s: float = field(default=600.0, metadata={
        "help": "longest wait for one response, seconds", "gt": 0})

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            parse_placement(self.label.rsplit("@", 1)[1])
        except ValueError as err:
            raise ValueError(f"label must be NAME@PLACEMENT with a placement such as "
                             f"colocated:1: {err}") from None
