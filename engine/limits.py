"""The limits a request must fit, checked in one place with one message each (``Limits.check``,
called by the engine, the router, the planner's simulator, the HTTP server and the CLI). No torch.

A request fits when:

1. its prompt is not empty and ``prompt + max_tokens <= max_model_len`` (the context);
2. every prompt and stop token id is in ``[0, vocab_size)``;
3. the KV tokens it will hold fit the whole KV cache: ``prompt + max_tokens`` on a decode
   or colocated worker, ``prompt + 1`` on a prefill worker, in whole blocks of ``block_size``;
4. with chunked prefill off, its prompt fits one step's token budget whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class LimitError(ValueError):
    """A request past a limit. ``field`` names the request field at fault: ``prompt``
    (its token ids or its length), ``max_tokens`` or ``stop_token_ids``."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Limits:
    """What one worker can ever serve (module docstring).

    ``max_model_len``: tokens per request, prompt + output. ``vocab_size``, ``kv_blocks`` (of the
    whole cache; ``block_size`` tokens each): None is not checked. ``whose``: whose cache the KV
    message names. ``prompt_budget``: with chunked prefill off, the most prompt tokens one step
    runs (``max_num_batched_tokens``); None: chunked (any prompt fits)."""

    max_model_len: int
    vocab_size: int | None = None
    kv_blocks: int | None = None
    block_size: int = 1
    whose: str = "this engine's"
    prompt_budget: int | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the whole KV cache holds: ``kv_blocks * block_size``."""
        return None if self.kv_blocks is None else self.kv_blocks * self.block_size

    def check(self, num_prompt_tokens: int, max_tokens: int,
              prompt_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
              prefill_only: bool = False, subject: str = "") -> None:
        """Raise ``LimitError`` for the first limit the request passes (``subject``, e.g.
        ``request r1: ``, starts the message); ``prefill_only``: it holds prompt + 1 KV
        tokens here (a prefill worker)."""
        if num_prompt_tokens < 1:
            raise LimitError(f"{subject}prompt must not be empty (no tokens)", "prompt")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            field = "prompt" if num_prompt_tokens >= self.max_model_len else "max_tokens"
            raise LimitError(f"{subject}prompt ({num_prompt_tokens} tokens) + max_tokens "
                             f"({max_tokens}) = {total} exceeds the context length "
                             f"{self.max_model_len} (max_model_len)", field)
        if self.vocab_size is not None:
            for field, ids in (("prompt", prompt_token_ids), ("stop_token_ids", stop_token_ids)):
                if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
                    continue  # min/max in C: a router checks every prompt of a run
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    name = "prompt_token_ids" if field == "prompt" else field
                    raise LimitError(f"{subject}{name} must be in [0, {self.vocab_size}), got "
                                     f"{bad}", field)
        kv_tokens = num_prompt_tokens + 1 if prefill_only else total
        if self.kv_blocks is not None:
            blocks = -(-kv_tokens // self.block_size)
            if blocks > self.kv_blocks:
                capacity = self.kv_capacity_tokens
                field = "prompt" if num_prompt_tokens >= capacity else "max_tokens"
                raise LimitError(
                    f"{subject}prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                    f"in whole blocks ({blocks} blocks of {self.block_size}) against the "
                    f"cache's {self.kv_blocks} blocks = {capacity} tokens: needs {kv_tokens} KV "
                    f"tokens, more than {self.whose} whole KV cache ({capacity} tokens; raise "
                    "kv_cache_memory_gb or kv_capacity_tokens)", field)
        if self.prompt_budget is not None and num_prompt_tokens > self.prompt_budget:
            raise LimitError(
                f"{subject}prompt of {num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.prompt_budget} with chunked prefill off; enable chunked prefill or "
                "raise the budget", "prompt")
