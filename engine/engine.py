"""One engine per device: schedule -> run -> sample -> update. An Engine alone is a colocated
instance; the prefill and decode workers wrap the same class.

A step (``Engine.step`` -> ``StepOutput``): the scheduler picks decodes, prompt chunks and newly
admitted requests (``ScheduledBatch``; remote requests only get blocks reserved, and their worker
fetches the KV into them: ``finish_remote``); the runner (``engine.runner.Runner``) runs one
forward (``on_layer_done`` hears of each layer's K/V) and gives the tokens of the requests whose
known tokens are all computed; the scheduler advances counters and frees finished requests'
blocks (``start_step``; ``finish_step`` waits for the device). The KV cache is paged
(``engine.kv_cache``), sized by the runner's budget and printed at start-up as
``KV cache: N blocks = T tokens = X GiB``. Bad input is refused in ``add_request`` /
``add_remote`` with ``ValueError``; a failing forward turns that step's requests into errors
(``StepOutput.failed``) and the engine keeps serving."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.config import EngineConfig
from engine.emulated import Emulation
from engine.limits import Limits
from engine.metrics import BatchEntry, StepRecord
from engine.kv_blocks import block_hashes
from engine.kv_cache import GIB, KVStore
from engine.model import LoadedModel
from engine.request import Request, RequestState, RequestStatus, TokenOutput
from engine.runner import OnWeights, Runner, RunnerChoice
from engine.scheduler import ScheduledBatch, Scheduler

class FailedRequest(NamedTuple):
    """A request a step failed (it left the engine; its KV is freed)."""

    request_id: str
    error: str  # one line: the forward's exception, or why its row could not be sampled


@dataclass(frozen=True)
class StepOutput:
    """Everything one ``Engine.step`` did (vLLM v1's ``EngineCoreOutputs``); iterating, ``len``
    and indexing go over ``tokens`` (batch order).

    ``finished``: requests that ended with this step's token; they left the engine (a
    prefill-only one at PREFILLED holds its KV for ``export_kv``). ``failed``: requests the step
    failed (they left, no token). ``kv_reserved``: remote requests whose blocks this step
    reserved, in order: fetch their KV now into ``finish_remote``. ``kv_dropped``: remote requests
    turned into local recomputes: free their handles, unfetched. ``record``: the step's
    ``StepRecord``, None when no forward ran or it failed (or before ``finish_step``)."""

    tokens: tuple[TokenOutput, ...] = ()
    finished: tuple[str, ...] = ()
    failed: tuple[FailedRequest, ...] = ()
    kv_reserved: tuple[str, ...] = ()
    record: StepRecord | None = None
    kv_dropped: tuple[str, ...] = ()

    def __iter__(self):
        return iter(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i]


class _InFlight(NamedTuple):  # a started step's record, but its lateness
    start_s: float
    end_s: float
    entries: tuple[BatchEntry, ...]
    num_prefill_tokens: int
    num_decode_tokens: int


class LaunchedStep(NamedTuple):
    """A step ``Engine.launch_step`` began (``error``: its forward raised)."""

    batch: ScheduledBatch
    kv_reserved: tuple[str, ...]
    kv_dropped: tuple[str, ...]
    start_s: float = 0.0
    output: Any = None  # the runner's ``execute``
    error: Exception | None = None


class Engine:
    """Serves many requests at once on one device.

    Args:
        config: ``max_model_len`` is capped by the model's context.
    ``config.max_model_len`` is capped by the model's context. ``on_layer_done(layer_idx,
    batch)`` is called during the forward once a layer's K/V are in the store, so a layer range
    can be read (``read_kv_layers``) and put while later layers compute. ``emulation``: an
    emulated device (an ``engine.runner.RunnerChoice``; None: ``OnWeights``); ``loaded`` is
    then a geometry.
        ValueError: a profile of another geometry (emulation); a KV budget that holds no block."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 quiet: bool = False,
                 on_layer_done: Callable[[int, ScheduledBatch], None] | None = None,
                 emulation: Emulation | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.max_model_len = min(self.config.max_model_len, loaded.max_context_len)
        self.vocab_size = loaded.vocab_size
        choice: RunnerChoice = emulation if emulation is not None else OnWeights()
        self.kv_spec, num_blocks, budget_bytes = choice.kv_layout(loaded, self.config,
                                                                  self.max_model_len)
        block_bytes = self.config.block_size * self.kv_spec.bytes_per_token
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes / GIB:.3g} GiB holds no block of "
                f"{self.config.block_size} tokens ({block_bytes} bytes): raise "
                "kv_cache_memory_gb (or gpu_memory_utilization)")
        self.kv_store = KVStore(self.kv_spec, num_blocks, self.config.block_size,
                                self.config.device)
        self.scheduler = Scheduler(self.config, loaded.eos_token_ids, num_kv_blocks=num_blocks)
        self.limits = Limits(self.max_model_len, self.vocab_size, num_blocks,
                             self.config.block_size, "this engine's",
                             None if self.config.enable_chunked_prefill
                             else self.config.max_num_batched_tokens)
        if not quiet:
            print(f"pdlab: KV cache: {num_blocks} blocks = {self.kv_store.num_tokens} tokens = "
                  f"{self.kv_store.num_bytes / GIB:.3g} GiB (budget "
                  f"{budget_bytes / GIB:.3g} GiB, block {self.config.block_size} tokens)",
                  file=sys.stderr)
        self.runner: Runner = choice.runner(loaded, self.kv_store, self.config)
        self.states: dict[str, RequestState] = {}
        self.step_records: list[StepRecord] = []
        self._on_layer_done = on_layer_done
        self._in_flight: _InFlight | None = None  # started, not finished (``start_step``)

    def validate(self, request: Request, prefill_only: bool = False) -> None:
        """``ValueError`` naming the field and range if ``request`` can never run here: a duplicate
        id, or past one of ``self.limits`` (context, vocabulary, the whole KV cache, and without
        chunked prefill the step budget), so it never queues behind others."""
        rid = request.request_id
        if rid in self.states:
            raise ValueError(f"request_id {rid!r} is already in this engine")
        self.limits.check(request.num_prompt_tokens, request.sampling.max_tokens,
                          request.prompt_token_ids, request.sampling.stop_token_ids,
                          prefill_only, subject=f"request {rid}: ")

    def add_request(self, request: Request, prefill_only: bool = False) -> None:
        """Queue a request. ``prefill_only``: stop after the first token and hold the prompt's
        KV for ``export_kv`` (prefill worker). Raises ValueError (see ``validate``)."""
        self.validate(request, prefill_only)
        state = RequestState(request, prefill_only=prefill_only)
        self.states[request.request_id] = state
        self.scheduler.add(state)

    def add_remote(self, request: Request, first_token: int, kv_token_start: int = 0) -> None:
        """Queue a request prefilled elsewhere in ``WAITING_FOR_REMOTE_KVS``: its KV blocks are
        reserved first (``StepOutput.kv_reserved``), sharing cached prompt blocks; the caller
        fetches the KV into ``finish_remote``, then it decodes from its second token.
        ``kv_token_start``: the received KV starts at this prompt token (a multiple of
        ``block_size`` below the prompt length: the prefix cached here). If the cached prefix is
        shorter at reservation, it recomputes here, unfetched (``StepOutput.kv_dropped``).

        Raises:
            ValueError: invalid request, ``first_token`` outside the vocabulary, a bad
                ``kv_token_start``, or nothing left to decode (EOS, stop token, max_tokens=1)."""
        self.validate(request)
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"request {request.request_id}: first_token must be in "
                             f"[0, {self.vocab_size}), got {first_token}")
        block_size = self.config.block_size
        if not (isinstance(kv_token_start, int) and 0 <= kv_token_start < request.num_prompt_tokens
                and kv_token_start % block_size == 0):
            raise ValueError(f"request {request.request_id}: kv_token_start must be a multiple "
                             f"of {block_size} in [0, {request.num_prompt_tokens}), got "
                             f"{kv_token_start!r}")
        state = RequestState(request)
        state.token_ids.append(first_token)
        state.num_computed_tokens = request.num_prompt_tokens
        state.first_output_index = 1
        state.kv_token_start = kv_token_start
        self.scheduler.check_stop(state, first_token)  # EOS / max_tokens=1: nothing to decode
        if state.status.is_finished:
            raise ValueError(f"request {request.request_id}: finished with its first token "
                             f"({state.finish_reason.value}); nothing to decode")
        state.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.states[request.request_id] = state
        self.scheduler.add(state)

    def finish_remote(self, request_id: str, kv: torch.Tensor) -> None:
        """Copy a fetched prompt KV ``[L, 2, H_kv, T - s, D]`` (tokens ``[s, T)``, s =
        ``kv_token_start``, this engine's dtype) into the reserved blocks past the shared prefix;
        the request joins the next step.

        Raises:
            KeyError: the request is not waiting for its KV here (aborted or unknown).
            ValueError: KV shape/dtype not this engine's (the request stays reserved)."""
        block_ids, skip = self.remote_kv_target(request_id)
        state = self.states[request_id]
        expected = self.kv_spec.kv_shape(state.num_prompt_tokens - state.kv_token_start)
        if tuple(kv.shape) != expected or kv.dtype != self.kv_spec.torch_dtype:
            raise ValueError(f"request {request_id}: KV expected shape {expected} "
                             f"dtype {self.kv_spec.torch_dtype}, got {tuple(kv.shape)} {kv.dtype}")
        if block_ids:
            self.kv_store.write(block_ids, kv[:, :, :, skip:])
        self.remote_kv_written(request_id)

    def remote_kv_target(self, request_id: str) -> tuple[list[int], int]:
        """``(block ids, skip)``: a fetched KV's tokens from ``skip`` on fill those reserved
        blocks (a prefix cached here meanwhile is skipped). KeyError as ``finish_remote``."""
        state = self.states.get(request_id)
        if state is None or state.status != RequestStatus.WAITING_FOR_REMOTE_KVS \
                or state.block_ids is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV in this engine")
        start = state.kv_token_start
        first = max(state.num_cached_tokens or 0, start)  # a multiple of block_size
        if first >= state.num_prompt_tokens:
            return [], first - start
        return list(state.block_ids[first // self.config.block_size:]), first - start

    def remote_kv_written(self, request_id: str) -> None:
        """A request's fetched KV is in its ``remote_kv_target`` blocks: it joins the next step.
        Raises KeyError as ``remote_kv_target``."""
        self.remote_kv_target(request_id)
        self.scheduler.kv_arrived(self.states[request_id])

    def is_waiting_for_kv(self, request_id: str) -> bool:
        """True while ``request_id`` is queued for KV blocks or its KV fetch is in flight."""
        state = self.states.get(request_id)
        return state is not None and state.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def export_kv(self, request_id: str, token_start: int = 0) -> tuple[torch.Tensor, int]:
        """Hand over a prefilled request: (its prompt KV ``[L, 2, H_kv, T - s, D]``, contiguous,
        tokens ``[s, T)`` with s = ``token_start`` a multiple of ``block_size``: the wire format;
        its first token); frees its blocks (full ones stay cached).

        Raises:
            KeyError: the request is not held here in PREFILLED state."""
        kv = self.prefilled_kv(request_id, token_start)
        return kv, self.finish_prefilled(request_id)

    def prefilled_kv(self, request_id: str, token_start: int = 0,
                     may_view: bool = False) -> torch.Tensor:
        """``export_kv``'s KV without freeing it (``finish_prefilled`` does, after);
        ``may_view``: ``KVStore.read``'s (a view of the KV cache, valid until that free).

        Raises:
            KeyError: the request is not held here in PREFILLED state."""
        state = self.states.get(request_id)
        if state is None or state.status != RequestStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} has no prefilled KV in this engine")
        return self._read_prompt(state, slice(None), token_start, may_view)

    def _read_prompt(self, state: RequestState, layers: slice, token_start: int,
                     may_view: bool = False) -> torch.Tensor:
        return self.kv_store.read(*self.prompt_kv_blocks(state.request_id, token_start),
                                  layers, may_view)

    def prompt_kv_blocks(self, request_id: str, token_start: int = 0) -> tuple[list[int], int]:
        """``(block ids, token count)`` of a request's prompt KV from ``token_start`` on;
        KeyError (unknown request), ValueError (``token_start`` off a block boundary)."""
        block_size = self.config.block_size
        if token_start % block_size:
            raise ValueError(f"token_start must be a multiple of {block_size}, got {token_start}")
        state = self.states[request_id]
        return list(state.block_ids[token_start // block_size:]), state.num_prompt_tokens - token_start

    def finish_prefilled(self, request_id: str) -> int:
        """Free a prefilled request's blocks without copying its KV (its layers were already
        streamed out); returns its first token. Raises KeyError as ``export_kv``."""
        state = self.states.get(request_id)
        if state is None or state.status != RequestStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} has no prefilled KV in this engine")
        self.release(request_id, RequestStatus.FINISHED_LENGTH)
        return state.token_ids[-1]

    def read_kv_layers(self, request_id: str, layers: slice, token_start: int = 0,
                       may_view: bool = False) -> torch.Tensor:
        """Copy of a running prefill's prompt KV for ``layers``, ``[L', 2, H_kv, T - s, D]``
        (``may_view``: ``KVStore.read``'s)."""
        return self._read_prompt(self.states[request_id], layers, token_start, may_view)

    def cached_prefix_tokens(self, token_ids) -> int:
        """Tokens of the longest prefix of ``token_ids`` whose full blocks are cached here now."""
        blocks = self.scheduler.capacity
        return len(blocks.lookup(block_hashes(list(token_ids), blocks.block_size),
                                 len(token_ids) // blocks.block_size)) * blocks.block_size

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Drop a request wherever it is and free its KV (no-op if unknown)."""
        if request_id in self.states:
            status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
            self.release(request_id, status, error)

    def release(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        state = self.states.pop(request_id)
        state.status, state.error = status, error
        self.scheduler.release(state)
        self.runner.forget(request_id)

    def step(self) -> StepOutput:
        """Run one step: schedule, reserve, forward, sample, update. A step with nothing to
        compute runs no forward and records nothing, but still reports its reservations.
        ``finish_step(start_step())``."""
        return self.finish_step(self.start_step())

    def start_step(self, on_launch: Callable[[], None] | None = None) -> StepOutput:
        """``step`` while the device may still run it (an emulated hold): its tokens (stamped
        at its end) leave after ``finish_step``, which sets ``record``. ``on_launch()``: called
        once a step has begun. ``complete_step(launch_step())``."""
        return self.complete_step(self.launch_step(on_launch))

    def launch_step(self, on_launch: Callable[[], None] | None = None) -> LaunchedStep:
        """``start_step`` up to the forward's start; ``complete_step`` must come next."""
        self.finish_step(StepOutput())  # one step in flight at a time
        batch = self.scheduler.schedule()
        kv_reserved = tuple(state.request_id for state in batch.kv_reserved)
        kv_dropped = tuple(state.request_id for state in batch.kv_dropped)
        if batch.is_empty:
            return LaunchedStep(batch, kv_reserved, kv_dropped)
        start_s = self.runner.begin()
        if on_launch is not None:
            on_launch()
        for state in batch.requests:
            if state.first_scheduled_time_s is None:  # prefill started / remote KV decodes
                state.first_scheduled_time_s = start_s
        try:
            listener = self._on_layer_done
            output = self.runner.execute(
                batch, listener and (lambda layer: listener(layer, batch)))
        except Exception as err:  # its requests fail in ``complete_step``
            return LaunchedStep(batch, kv_reserved, kv_dropped, start_s, error=err)
        return LaunchedStep(batch, kv_reserved, kv_dropped, start_s, output)

    def complete_step(self, launched: LaunchedStep) -> StepOutput:
        """``start_step``'s rest: sample ``launched``'s tokens, update its requests."""
        batch, kv_reserved, kv_dropped = launched.batch, launched.kv_reserved, launched.kv_dropped
        if batch.is_empty:
            return StepOutput(kv_reserved=kv_reserved, kv_dropped=kv_dropped)
        num_prefill_tokens = batch.num_prefill_tokens  # before update() advances the counters
        entries = batch.entries()  # (and before a failed row's abort)
        err = launched.error
        if err is None:
            try:
                sample_rows = [i for i in range(len(batch.requests)) if batch.completes(i)]
                states = [batch.requests[i] for i in sample_rows]
                tokens, errors, logprobs = self.runner.tokens(states, launched.output)
            except Exception as sampling_err:
                err = sampling_err
        if err is not None:  # a failed forward fails its requests, not the engine
            self.runner.finish()
            self.scheduler.step_failed()  # the blocks it was to fill leave the prefix cache
            failed = tuple(FailedRequest(state.request_id, f"{type(err).__name__}: {err}")
                           for state in batch.requests)
            for state in batch.requests:
                self.abort(state.request_id, str(err))
            return StepOutput(failed=failed, kv_reserved=kv_reserved, kv_dropped=kv_dropped)
        failed = []
        for row, error in errors.items():  # a row that cannot be sampled fails alone
            state = states[row]
            failed.append(FailedRequest(state.request_id, error))
            self.abort(state.request_id, error)
        sampled = {i: t for i, t in zip(sample_rows, tokens) if t is not None}
        produced = self.scheduler.update(batch, sampled)
        start_s = launched.start_s
        end_s = self.runner.end_s(start_s)
        self._in_flight = _InFlight(start_s, end_s, entries, num_prefill_tokens,
                                    batch.num_tokens - num_prefill_tokens)
        outputs = tuple(self._token_output(state, end_s, logprobs.get(state.request_id))
                        for state in produced)
        return StepOutput(outputs, tuple(o.request_id for o in outputs if o.finished),
                          tuple(failed), kv_reserved, None, kv_dropped)

    def finish_step(self, started: StepOutput, idle: Callable[[float], None] | None = None,
                    lead_s: float = 0.0) -> StepOutput:
        """Wait for the step in flight (``idle(s)``: work while an emulated device holds,
        ``RealClock.wait_until``), record it; ``started`` with its ``record`` (as is: none).
        ``lead_s``: an emulated step may run that long after (``device_busy``): the next
        ``start_step`` begins at its end; ``wait_step_end`` waits for it."""
        flight = self._in_flight
        if flight is None:
            return started
        self._in_flight = None
        lateness = self.runner.finish(idle, lead_s)
        record = StepRecord(flight.start_s, flight.end_s - flight.start_s, len(flight.entries),
                            flight.num_prefill_tokens, flight.num_decode_tokens,
                            flight.entries, lateness)
        self.step_records.append(record)
        return dataclasses.replace(started, record=record)

    @property
    def device_busy(self) -> bool:
        """The step ``finish_step`` returned from early still runs on the device."""
        return self.runner.busy

    def wait_step_end(self, idle: Callable[[float], None] | None = None) -> None:
        """Wait until the device's step has ended (``finish_step``'s ``lead_s``; ``idle``
        as there); at once when it has."""
        self.runner.wait_end(idle)

    def _token_output(self, state: RequestState, time_s: float,
                      logprobs: tuple[float, tuple] | None = None) -> TokenOutput:
        index = state.num_output_tokens - 1
        first_here = index == state.first_output_index  # first token this engine produced
        if state.status.is_finished:
            self.states.pop(state.request_id, None)
            self.runner.forget(state.request_id)
        return TokenOutput(state.request_id, state.token_ids[-1], index, time_s,
                           state.finish_reason,
                           state.first_scheduled_time_s if first_here else None,
                           logprobs[0] if logprobs else None,
                           logprobs[1] if logprobs else (),
                           num_cached_tokens=state.num_cached_tokens if first_here else None,
                           num_preemptions=state.num_preemptions)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed (waiting or part-way): prefill load."""
        return sum(s.num_prompt_tokens - min(s.num_computed_tokens, s.num_prompt_tokens)
                   for s in self.states.values())

    @property
    def num_resident_kv_tokens(self) -> int:
        """Tokens of the KV blocks in use (whole blocks): decode load."""
        return self.scheduler.capacity.num_used_blocks * self.config.block_size

    @property
    def num_used_kv_blocks(self) -> int:
        return self.scheduler.capacity.num_used_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds: ``num_blocks * block_size``."""
        return self.kv_store.num_tokens

    def is_empty(self) -> bool:
        """Nothing queued, running, held or reserved, and no KV block referenced."""
        blocks = self.scheduler.capacity
        return (not self.states and not self.scheduler.waiting and not self.scheduler.running
                and not self.scheduler.receiving and self.scheduler.num_used_seqs == 0
                and blocks.num_free_blocks == blocks.num_blocks
                and all(n == 0 for n in blocks.ref_cnt))

    def generate(self, requests: list[Request]) -> dict[str, list[int]]:
        """Run ``requests`` to completion; output token ids per request (a failed one keeps what
        it produced)."""
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].append(out.token_id)
        return outputs
