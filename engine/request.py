"""The request vocabulary shared by every pdlab process (no torch): ``SamplingParams`` and
``Request`` (frozen, validated when built), the engine-side ``RequestState`` counters,
``RequestStatus`` and ``TokenOutput``. A request is counters, vLLM v1 style:
``num_computed_tokens`` grows as steps compute its KV; once every known token is computed a token
is sampled and appended. A request prefilled elsewhere starts as ``WAITING_FOR_REMOTE_KVS`` with
its prompt computed and first token appended. FINISHED_* statuses sort after every live one."""

from __future__ import annotations

import copy

import enum
import math
from dataclasses import dataclass, field


# Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``): smaller only overflows.
GREEDY_BELOW_TEMPERATURE = 1e-5

# Most top alternatives a request may ask for with each token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


class RequestStatus(enum.IntEnum):
    """Ordered status: everything ``>= FINISHED_STOPPED`` is finished."""

    WAITING = 0  # queued; holds no KV
    # prefilled elsewhere: queued for KV blocks, then its KV is fetched into them
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2  # holds KV blocks; prefilling or decoding (num_computed_tokens tells which)
    PREFILLED = 3  # prefill-only request: first token sampled, prompt KV held for export
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH = 5  # max_tokens reached
    FINISHED_ABORTED = 6  # aborted by the caller
    FINISHED_ERROR = 7  # failed (worker death, transfer error, ...)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """Why a request ended, as written into records ("stop" and "length" as in OpenAI/vLLM)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASON_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens (vLLM's meanings; each "off" value is the default).

    ``max_tokens`` (>= 1) counts the first token. ``temperature`` (>= 0): below
    ``GREEDY_BELOW_TEMPERATURE`` greedy, else logits are divided by it. ``top_k``: 0 or -1 = off.
    ``top_p`` in (0, 1]: nucleus (Holtzman et al. 2020); the most likely token stays. ``min_p`` in
    [0, 1]: drop tokens below ``min_p`` x the top probability (Nguyen et al. 2024), before top-k
    and top-p. ``seed``: of the request's own ``torch.Generator`` (None: random).
    ``stop_token_ids`` end the request (the token is kept). ``min_tokens`` (0 ..
    ``max_tokens``): outputs before which EOS and stop ids get -inf, even with ``ignore_eos``.
    ``repetition_penalty`` (> 0, finite): logits of prompt or output tokens divided by it when
    positive, else multiplied (CTRL, Keskar et al. 2019). ``presence_penalty`` /
    ``frequency_penalty`` in [-2, 2]: subtracted once / per occurrence in the output (OpenAI's).
    ``logprobs`` (0..``MAX_LOGPROBS``; None = off): each token's raw log-probability and those of
    the ``logprobs`` most likely.

    Raises:
        ValueError: a field is out of range; the message names the field and the range."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # one spelling of off from here on
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if (not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0.0):
            raise ValueError("repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if self.logprobs is not None and (
                not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when a penalty is on: the sampler then needs this request's token history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Request:
    """One generation request; immutable, so it crosses processes as is. ``prompt_token_ids``
    are tokenized (chat template applied); ``arrival_time_s``: ``time.time()`` (0.0 unknown). The
    prompt's block hashes are cached on it (``_prompt_hashes``: not a field; ``replace`` drops it).

    Raises:
        ValueError: empty prompt or a negative / non-integer token id."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time_s: float = 0.0
    _prompt_hashes: dict | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = tuple(self.prompt_token_ids)
        if len(ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt_token_ids must not be empty")
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(
                f"request {self.request_id}: prompt_token_ids must be non-negative integers"
            )
        object.__setattr__(self, "prompt_token_ids", ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def arrived_at(self, arrival_time_s: float) -> Request:
        """This request with ``arrival_time_s``; a copy that skips ``__post_init__``'s check
        of every token (done when this one was made) and keeps the cached block hashes."""
        arrived = copy.copy(self)
        object.__setattr__(arrived, "arrival_time_s", arrival_time_s)
        return arrived


class RequestState:
    """Engine-side counters for one request (mutable, never leaves its engine). ``token_ids`` is
    prompt + outputs; the KV of ``token_ids[:num_computed_tokens]`` is in ``block_ids`` (None while
    it holds none); ``num_cached_tokens``: prompt tokens its first admission found cached;
    ``kv_token_start``: the first prompt token whose KV a remote request receives."""

    __slots__ = (
        "request", "status", "token_ids", "num_computed_tokens", "block_ids",
        "prefill_only", "error", "first_scheduled_time_s", "first_output_index",
        "num_prompt_tokens", "block_hashes", "num_cached_blocks", "num_cached_tokens",
        "num_preemptions", "num_reserved_tokens", "kv_token_start",
    )

    def __init__(self, request: Request, prefill_only: bool = False) -> None:
        self.request = request
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] | None = None
        self.prefill_only = prefill_only
        self.error: str | None = None
        self.first_scheduled_time_s: float | None = None
        self.first_output_index = 0  # 1 when the first token came with imported KV
        # an attribute, not a property: the scheduler and simulator read it per step
        self.num_prompt_tokens: int = len(self.token_ids)
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.num_reserved_tokens = 0
        self.kv_token_start = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the one token a decode step computes is left (prompt, or a recompute)."""
        return self.num_computed_tokens < max(self.num_prompt_tokens, len(self.token_ids) - 1)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may ever hold in the KV store: prompt + max_tokens, or prompt + 1
        for a prefill-only request."""
        return self.num_prompt_tokens + (1 if self.prefill_only else self.sampling.max_tokens)

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASON_OF_STATUS.get(self.status)


@dataclass(frozen=True)
class TokenOutput:
    """One token leaving an engine.

    ``index``: 0 for the first output token. ``time_s``: ``time.time()`` when its step ended.
    ``first_scheduled_s`` / ``num_cached_tokens``: on this engine's first token of the request
    only (else None). ``logprob``: raw log-probability when asked, else None; ``top_logprobs``:
    most likely ``(token_id, logprob)`` pairs first."""

    request_id: str
    token_id: int
    index: int
    time_s: float
    finish_reason: FinishReason | None = None
    first_scheduled_s: float | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    num_cached_tokens: int | None = None
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
