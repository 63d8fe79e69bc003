"""An emulated device: the model runner replaced by one that computes nothing.

An emulated worker (``--devices emu:0-7``) is the real ``EngineLoop``, workers, scheduler,
block allocator, router, transports and HTTP front; only the runner (``EmulatedRunner``)
differs:

1. Geometry without weights: the model is a ``config.json`` directory read by
   ``engine.model.load_geometry``; the KV cache has the blocks the emulated GPU would hold
   (``DeviceProfile.kv_budget_bytes`` over the true bytes per block).
2. Time: each step is held for ``device.step_s(batch.step_features())``, the function the
   simulator calls, times the dilation (``Emulation.time_scale``). The hold sleeps until
   ``SPIN_S`` before the deadline, then spins. Layer ``l`` is reported done at ``(l + 1) / L``
   of the step. ``StepRecord.lateness`` = actual / modelled.
3. Tokens: ``emulated_token`` hashes (prompt ids, output position) into the vocabulary, off
   EOS and stop ids, so output is the same in every placement and a request runs to its
   ``max_tokens``.
4. KV bytes: real tensors move through the real transports; ``kv_scale`` < 1
   (``--emu-kv-scale``) shrinks each token's KV (``scaled_spec``) when the host cannot hold
   the GPU's cache, block counts staying those of the true geometry.

The engine may not import the planner, so the device is any object with ``step_time()``,
``kv_budget_bytes(config)``, ``kv_bytes_per_token`` and ``dtype`` (the placement passes a
``planner.latency.DeviceProfile``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import EngineConfig
from engine.kv_cache import KVSpec, KVStore
from engine.request import RequestState
from engine.scheduler import ScheduledBatch

# sleep until this long before a deadline, then spin: a sleep overshoots by a fraction of a
# millisecond, and a longer spin holds the GIL and a core that the worker's Ray and
# transport threads need (benchmarks.control_plane shows the lateness either way)
SPIN_S = 0.00025
LATENESS_WARN = 1.02  # p99 lateness above this: the host is too busy to keep the device's time


class RealClock:
    """Wall time for stamps (``time.time``, as every record), ``perf_counter`` for holds."""

    def time(self) -> float:
        return time.time()

    def perf(self) -> float:
        return time.perf_counter()

    def wait_until(self, deadline: float) -> None:
        """Hold until ``perf() >= deadline`` (perf_counter seconds): sleep until ``SPIN_S``
        before it, then spin."""
        left = deadline - time.perf_counter()
        if left > SPIN_S:
            time.sleep(left - SPIN_S)
        while time.perf_counter() < deadline:
            pass


@dataclass(frozen=True)
class Emulation:
    """How an emulated worker runs (picklable: it travels to Ray actors).

    Attributes:
        device: the device profile (``planner.latency.DeviceProfile``; duck-typed, see the
            module docstring).
        kv_scale: KV bytes per token kept, a fraction in (0, 1] (1 = the true geometry).
        time_scale: time dilation ``S >= 1``: each step is held ``S`` x its modelled time
            (``experiments.dilation``: arrivals are spread and measured times divided by
            the same ``S``, so the host's own overhead counts ``1 / S`` as much).
        clock: ``RealClock`` or a test's fake (``time()``, ``perf()``, ``wait_until(t)``).

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
        """Refuse a profile measured for another geometry than ``spec``'s.

        Raises:
            ValueError: the profile's ``kv_bytes_per_token`` differs from ``spec``'s."""
        if self.device.kv_bytes_per_token != spec.bytes_per_token:
            raise ValueError(
                f"the device profile ({self.device.model}) has {self.device.kv_bytes_per_token} "
                f"KV bytes per token, model {model} {spec.bytes_per_token}: the profile is not "
                "this model's (build one with `pdlab profile --from-silicon-db ... --model "
                f"{model}`)")

    def scaled_spec(self, spec: KVSpec) -> KVSpec:
        """The KV geometry the store and the transports carry: ``spec`` itself at scale 1,
        else one KV head of ``max(1, round(H_kv * D * kv_scale))`` elements per layer."""
        if self.kv_scale == 1:
            return spec
        width = max(1, round(spec.num_kv_heads * spec.head_dim * self.kv_scale))
        return KVSpec(f"{spec.model_fingerprint}/emu-kv-scale={self.kv_scale:g}",
                      spec.num_layers, 1, width, spec.dtype)

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """The emulated GPU's KV budget (bytes, true geometry): the profile's rule."""
        return self.device.kv_budget_bytes(config)

    def describe(self) -> dict:
        """The emulation block of the config row: the profile's source, system and
        backend, its model and the KV scale."""
        source = getattr(self.device, "source", None) or {}
        return {"profile_model": self.device.model, "device_name": self.device.device_name,
                "source": source.get("kind", "measured"), "system": source.get("system"),
                "backend": source.get("backend"), "kv_scale": self.kv_scale,
                "time_scale": self.time_scale}


_MASK64 = (1 << 64) - 1


def emulated_token(prompt_digest: int, position: int, vocab_size: int,
                   banned: frozenset[int] | set[int] = frozenset()) -> int:
    """Output token ``position`` of a request whose prompt hashes to ``prompt_digest``
    (``prompt_hash``): splitmix64's finaliser of ``digest ^ position * golden ratio``, mod
    ``vocab_size``, stepped forward past ``banned`` (EOS and stop ids), so no request ends before
    its ``max_tokens``. (Integer arithmetic, not a blake2b per token: the emulated runner calls it
    for every token of every step, at GPU token rates.)

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
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _EmulatedOps:
    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation

    def describe(self) -> dict:
        return {"backend": "emulated", "emulation": self.emulation.describe()}


class EmulatedRunner:
    """Stands in for ``engine.runner.ModelRunner``: holds each step for its modelled time.

    Args:
        kv_store: the engine's store (its tensors stay as written by fetches: nothing here
            computes K/V).
        emulation: the device and clock.
        vocab_size, eos_token_ids: the emulated model's.

    ``execute`` returns None instead of logits; the engine asks ``sample`` for the tokens.
    ``last_modelled_s`` / ``last_lateness``: the latest step's modelled seconds (x the emulation's
    ``time_scale``: the time it is held for) and actual ÷ modelled."""

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
        self.last_lateness = 1.0
        self._digests: dict[str, tuple[int, frozenset[int]]] = {}  # request -> digest, banned

    def modelled_s(self, batch: ScheduledBatch) -> float:
        """The device's seconds for ``batch`` (counters not yet advanced), x the time dilation."""
        f = batch.step_features()
        return self.step_s(f.prefill_tokens, f.prefill_attention, f.batch_size,
                           f.sum_context) * self.time_scale

    def execute(self, batch: ScheduledBatch,
                on_layer_done: Callable[[int], None] | None = None) -> None:
        """Hold for the step's modelled time (layer ``l`` reported at ``(l+1)/L`` of it)."""
        modelled = self.modelled_s(batch)
        clock = self.clock
        start = clock.perf()
        if on_layer_done is not None:
            for layer in range(self.num_layers):
                clock.wait_until(start + modelled * (layer + 1) / self.num_layers)
                on_layer_done(layer)
        else:
            clock.wait_until(start + modelled)
        actual = clock.perf() - start
        self.last_modelled_s = modelled
        self.last_lateness = actual / modelled if modelled > 0 else 1.0
        return None

    def sample(self, states: list[RequestState]) -> list[int]:
        """The tokens of ``states`` (the step's sampled rows): ``emulated_token`` at each
        request's next output position."""
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
        return out

    def forget(self, request_id: str) -> None:
        self._digests.pop(request_id, None)


def lateness_p99(steps: list[dict]) -> float | None:
    """The p99 of the steps' ``lateness`` (actual ÷ modelled, numpy's linear percentile as
    every p99 in ``engine.metrics``); None when no step has one (real devices)."""
    values = [s["lateness"] for s in steps if s.get("lateness") is not None
              and s["lateness"] == s["lateness"]]
    return float(np.percentile(values, 99)) if values else None


def lateness_warning(steps: list[dict], host: str) -> str | None:
    """A one-line warning when the p99 of the steps' ``lateness`` (``lateness_p99``) passes
    ``LATENESS_WARN`` (an emulated device that did not keep its time), naming ``host``;
    None otherwise or when no step has a lateness."""
    p99 = lateness_p99(steps)
    if p99 is None or p99 <= LATENESS_WARN:
        return None
    return (f"warning: emulated steps ran late: p99 lateness {p99:.3f} (actual / modelled) > "
            f"{LATENESS_WARN} on host {host}, which is too busy to keep the emulated device's "
            "time; measured latencies include that lag")
