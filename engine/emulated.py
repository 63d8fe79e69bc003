"""An emulated device: the model runner replaced by one that computes nothing. An emulated worker
(``--devices emu:0-7``) runs the real engine loop, scheduler, allocator, router, transports and
HTTP front; only ``EmulatedRunner`` differs:

- Geometry without weights (``engine.model.load_geometry``); the KV cache has the blocks the
  emulated GPU would hold.
- Time: each step is held ``device.step_s(batch.step_features())`` x ``time_scale`` as a
  deadline: ``execute`` starts it, the host works meanwhile, ``finish`` waits out the rest
  (with a layer listener, ``execute`` holds, layer ``l`` done at ``(l + 1) / L``). Tokens are
  stamped at the modelled end; ``StepRecord.lateness`` = held / modelled (> 1: host overran).
  ``finish(lead_s=...)`` may return before the end: the next step, prepared meanwhile (a
  launch queued behind a GPU's running step), begins at that end; ``wait_end`` waits for it.
- Tokens: ``emulated_token``, the same in every placement, never EOS.
- KV bytes: real tensors through the real transports; ``kv_scale`` < 1 shrinks each token's KV
  when the host cannot hold the GPU's cache, block counts unchanged.

The device is any object with ``step_time()``, ``kv_budget_bytes(config)``,
``kv_bytes_per_token`` and ``dtype`` (a ``planner.latency.DeviceProfile``; no planner import)."""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.clock import wait_until
from engine.config import EngineConfig, kv_num_blocks_for
from engine.kv_cache import KVSpec, KVStore
from engine.request import RequestState
from engine.runner import KVLayout, StepTokens
from engine.scheduler import ScheduledBatch

LATENESS_WARN = 1.02  # p99 lateness above this: the host is too busy to keep the device's time


class RealClock:
    """Wall time for stamps (``time.time``, as every record), ``perf_counter`` for holds."""

    def time(self) -> float:
        return time.time()

    def perf(self) -> float:
        return time.perf_counter()

    def wait_until(self, deadline: float,
                   idle: Callable[[float], None] | None = None) -> None:
        """``engine.clock.wait_until``: nap (``idle``), then spin to ``deadline`` (perf s)."""
        wait_until(deadline, idle)


@dataclass(frozen=True)
class Emulation:
    """How an emulated worker runs (picklable: it travels to Ray actors).

    ``kv_scale``: KV bytes per token kept, in (0, 1]. ``time_scale``: dilation ``S >= 1``, each
    step held ``S`` x its modelled time (``experiments.dilation``). ``clock``: ``RealClock`` or a
    test's fake (``time()``, ``perf()``, ``wait_until(t[, idle])``). An ``engine.runner.RunnerChoice``.

    Raises:
        ValueError: ``kv_scale`` outside (0, 1], ``time_scale`` not a finite number >= 1."""

    device: Any
    kv_scale: float = 1.0
    clock: Any = field(default_factory=RealClock)
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.kv_scale, (int, float)) and 0 < self.kv_scale <= 1):
            raise ValueError(f"emu_kv_scale must be in (0, 1], got {self.kv_scale!r}")
        if not (isinstance(self.time_scale, (int, float)) and 1 <= self.time_scale < float("inf")):
            raise ValueError(f"emu_time_scale must be a finite number >= 1, "
                             f"got {self.time_scale!r}")

    def check(self, spec: KVSpec, model: str) -> None:
        """Raises ValueError when the profile's ``kv_bytes_per_token`` differs from ``spec``'s."""
        if self.device.kv_bytes_per_token != spec.bytes_per_token:
            raise ValueError(
                f"the device profile ({self.device.model}) has {self.device.kv_bytes_per_token} "
                f"KV bytes per token, model {model} {spec.bytes_per_token}: the profile is not "
                "this model's (build one with `pdlab profile --from-silicon-db ... --model "
                f"{model}`)")

    def scaled_spec(self, spec: KVSpec) -> KVSpec:
        """``spec`` at scale 1, else one KV head of ``max(1, round(H_kv * D * kv_scale))`` elements."""
        if self.kv_scale == 1:
            return spec
        width = max(1, round(spec.num_kv_heads * spec.head_dim * self.kv_scale))
        return KVSpec(f"{spec.model_fingerprint}/emu-kv-scale={self.kv_scale:g}",
                      spec.num_layers, 1, width, spec.dtype)

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """The emulated GPU's KV budget (bytes, true geometry)."""
        return self.device.kv_budget_bytes(config)

    def kv_layout(self, loaded, config: EngineConfig, max_model_len: int) -> KVLayout:
        """The emulated GPU's blocks (true geometry) in ``scaled_spec`` tensors; ``check``'s errors."""
        self.check(loaded.kv_spec, loaded.name)
        budget = self.kv_budget_bytes(config)
        return KVLayout(self.scaled_spec(loaded.kv_spec),
                        kv_num_blocks_for(config, loaded.kv_spec.bytes_per_token, budget,
                                          max_model_len), budget)

    def runner(self, loaded, kv_store: KVStore, config: EngineConfig) -> EmulatedRunner:
        return EmulatedRunner(kv_store, self, loaded.vocab_size, loaded.eos_token_ids)

    def describe(self) -> dict:
        """The emulation block of the config row."""
        source = getattr(self.device, "source", None) or {}
        return {"profile_model": self.device.model, "device_name": self.device.device_name,
                "source": source.get("kind", "measured"), "system": source.get("system"),
                "backend": source.get("backend"), "kv_scale": self.kv_scale,
                "time_scale": self.time_scale}


_MASK64 = (1 << 64) - 1


def emulated_token(prompt_digest: int, position: int, vocab_size: int,
                   banned: frozenset[int] | set[int] = frozenset()) -> int:
    """Output token ``position`` of a prompt hashing to ``prompt_digest``: splitmix64's finaliser
    of ``digest ^ position * golden ratio`` mod ``vocab_size``, stepped past ``banned`` (EOS and
    stop ids). Integer arithmetic: it runs for every token at GPU token rates.

    Raises:
        ValueError: every token of the vocabulary is banned."""
    if len(banned) >= vocab_size:
        raise ValueError(f"all {vocab_size} tokens are EOS or stop ids")
    x = (prompt_digest ^ (position * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    token = (x ^ (x >> 31)) % vocab_size
    while token in banned:
        token = (token + 1) % vocab_size
    return token


def prompt_hash(token_ids) -> int:
    """64-bit blake2b digest of a prompt's token ids (int32 little-endian each)."""
    data = struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _EmulatedOps:
    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation

    def describe(self) -> dict:
        return {"backend": "emulated", "emulation": self.emulation.describe()}


class EmulatedRunner:
    """An ``engine.runner.Runner`` that holds each step for its modelled time (module
    docstring); nothing computes K/V (the store holds what fetches wrote); ``tokens`` are
    ``emulated_token``s. ``last_modelled_s`` (x ``time_scale``): of the latest step."""

    emulated = True

    def __init__(self, kv_store: KVStore, emulation: Emulation, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.kv_store = kv_store
        self.emulation = emulation
        self.clock = emulation.clock
        self.step_s: Callable[[int, int, int, int], float] = emulation.device.step_time()
        self.time_scale = emulation.time_scale
        self.num_layers = kv_store.spec.num_layers
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self.ops = _EmulatedOps(emulation)
        self.last_modelled_s = 0.0
        self._begun = None  # perf() at ``begin``, for the next ``execute``
        self._start = None  # perf() at the start of the step in flight
        self._held_s = None  # held in ``execute`` (layer listener)
        self._busy: float | None = None  # perf() end of a step ``finish`` left early
        self._digests: dict[str, tuple[int, frozenset[int]]] = {}  # request -> digest, banned

    def begin(self) -> float:
        """The next step's start (wall s): now, or the end of a step ``finish`` left early."""
        now = self.clock.perf()
        busy = self._busy
        self._begun = busy if busy is not None and busy > now else now
        return self.clock.time() + (self._begun - now)  # wall time read anew: it may be set

    def modelled_s(self, batch: ScheduledBatch) -> float:
        """The device's seconds for ``batch`` x the time dilation."""
        f = batch.step_features()
        return self.step_s(f.prefill_tokens, f.prefill_attention, f.batch_size,
                           f.sum_context) * self.time_scale

    def execute(self, batch: ScheduledBatch,
                on_layer_done: Callable[[int], None] | None = None) -> None:
        """Start the step's hold from ``begin`` (``finish`` ends it; a listener: held here)."""
        modelled = self.modelled_s(batch)
        for state in batch.requests:  # a prompt's blocks, which a KV put reads: their first
            if state.is_prefilling:  # use zeroes them, as the real runner's does, in the hold
                self.kv_store.claim(max(state.block_ids) + 1)
        clock = self.clock
        start, self._begun = self._begun, None
        self.last_modelled_s, self._held_s = modelled, None
        self._start = clock.perf() if start is None else start
        if on_layer_done is not None:
            for layer in range(self.num_layers):
                clock.wait_until(self._start + modelled * (layer + 1) / self.num_layers)
                on_layer_done(layer)
            self._held_s = clock.perf() - self._start
        return None

    def end_s(self, start_s: float) -> float:
        """The modelled end: ``start_s + last_modelled_s``."""
        return start_s + self.last_modelled_s

    def finish(self, idle: Callable[[float], None] | None = None,
               lead_s: float = 0.0) -> float | None:
        """Wait out the step in flight (``idle``: ``RealClock.wait_until``'s) -> held / modelled
        (1.0 for a step of no time); None when none is in flight. ``lead_s``: return up to that
        long (half the step) before the end, which ``wait_end`` waits for."""
        start, modelled = self._start, self.last_modelled_s
        if start is None:
            return None
        self._start = None
        held = self._held_s
        if held is None:
            end = start + modelled
            self._wait_until(end - min(max(lead_s, 0.0), modelled / 2), idle)
            now = self.clock.perf()
            if now < end:
                self._busy = end
            held = max(now - start, modelled)
        return held / modelled if modelled > 0 else 1.0

    @property
    def busy(self) -> bool:
        """A step ``finish`` left early is still held (``wait_end`` waits it out)."""
        return self._busy is not None

    def wait_end(self, idle: Callable[[float], None] | None = None) -> None:
        """Wait until the step ``finish`` left early has ended (at once when none has)."""
        busy, self._busy = self._busy, None
        if busy is not None:
            self._wait_until(busy, idle)

    def _wait_until(self, deadline: float, idle: Callable[[float], None] | None) -> None:
        if idle is None:  # ``Emulation.clock``: wait_until(t[, idle])
            self.clock.wait_until(deadline)
        else:
            self.clock.wait_until(deadline, idle)

    def tokens(self, states: list[RequestState], output: None = None) -> StepTokens:
        """``emulated_token`` at each sampled row's next output position."""
        out, digests, vocab = [], self._digests, self.vocab_size
        for state in states:
            request = state.request
            known = digests.get(request.request_id)
            if known is None:  # once per request: its prompt's digest and banned tokens
                known = digests[request.request_id] = (
                    prompt_hash(request.prompt_token_ids),
                    self.eos | frozenset(request.sampling.stop_token_ids))
            out.append(emulated_token(known[0], len(state.token_ids) - state.num_prompt_tokens,
                                      vocab, known[1]))
        return StepTokens(out, {}, {})

    def forget(self, request_id: str) -> None:
        self._digests.pop(request_id, None)


def lateness_p99(steps: list[dict]) -> float | None:
    """p99 (numpy linear) of the steps' ``lateness``; None when no step has one."""
    values = [s["lateness"] for s in steps if s.get("lateness") is not None
              and s["lateness"] == s["lateness"]]
    return float(np.percentile(values, 99)) if values else None


def lateness_warning(steps: list[dict], host: str) -> str | None:
    """A one-line warning naming ``host`` when ``lateness_p99`` passes ``LATENESS_WARN``, else None."""
    p99 = lateness_p99(steps)
    if p99 is None or p99 <= LATENESS_WARN:
        return None
    return (f"warning: emulated steps ran late: p99 lateness {p99:.3f} (actual / modelled) > "
            f"{LATENESS_WARN} on host {host}, which is too busy to keep the emulated device's "
            "time; measured latencies include that lag")
