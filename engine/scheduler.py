"""Which tokens of which requests run in the next step, and which KV blocks hold them (no torch).

Running decodes go first, one token each; then running requests with more than one token left
get the next chunk (prompts part-way, preempted requests recomputing). Unless this step preempted
(vLLM v1's rule), waiting requests are admitted in arrival order while ``max_num_seqs``, the KV
blocks and the token budget allow; a prompt first shares its cached full blocks, leaving its last
token to compute. A request prefilled elsewhere (``WAITING_FOR_REMOTE_KVS``) only reserves blocks
for prompt + 1, is listed in ``batch.kv_reserved`` for its worker to fetch into, and runs from
``kv_arrived``. ``update`` applies sampled tokens, checks stops and frees finished requests' blocks.

``kv_reservation``: ``on_demand`` (vLLM v1) allocates blocks as tokens are scheduled and, with
none free, preempts the newest running request (freed, requeued first, recomputed; never a
PREFILLED or receiving one); ``add`` refuses one that could not fit alone. ``full`` reserves
prompt + max_tokens at admission and never preempts. Blocks join the prefix cache as allocated;
``step_failed`` unregisters them, so a cached block holds the KV its hash names. Chunked prefill
gives a prompt what is left of the budget (Sarathi-Serve); off, it runs whole."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.metrics import DECODE, PREFILL, BatchEntry
from engine.kv_blocks import BlockAllocator, PrefixCacheStats, block_hashes, prompt_block_hashes
from engine.request import RequestState, RequestStatus

__all__ = ["BlockAllocator", "ScheduledBatch", "Scheduler", "StepFeatures"]

_RUNNING, _FINISHED_STOPPED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
_WAITING, _REMOTE = RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass(frozen=True)
class StepFeatures:
    """What a step's duration depends on (``planner.latency`` reads these; counted only in
    ``ScheduledBatch.step_features``): ``prefill_tokens`` Σn, new prompt tokens;
    ``prefill_attention`` Σn(k+n), query-key pairs of prompt entries; ``batch_size`` B, decode
    entries; ``sum_context`` Σctx, KV tokens the decodes attend to (with the new one)."""

    prefill_tokens: int = 0
    prefill_attention: int = 0
    batch_size: int = 0
    sum_context: int = 0


@dataclass
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``requests[i]`` from its
    ``num_computed_tokens``. ``newly_admitted``: got their KV blocks this step; ``kv_reserved``:
    remote requests whose blocks were reserved (fetch may start; not in ``requests``);
    ``kv_dropped``: remote requests recomputing locally instead (their skipped prefix is no longer
    cached; free their KV handles); ``preempted``: back in ``waiting``, holding no blocks."""

    requests: list[RequestState] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    newly_admitted: list[RequestState] = field(default_factory=list)
    kv_reserved: list[RequestState] = field(default_factory=list)
    kv_dropped: list[RequestState] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)

    def add(self, state: RequestState, num_tokens: int) -> None:
        self.requests.append(state)
        self.num_new_tokens.append(num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for s, n in zip(self.requests, self.num_new_tokens) if s.is_prefilling)

    def entries(self, steps_ahead: int = 0) -> tuple[BatchEntry, ...]:
        """The batch as ``StepRecord.batch`` entries, before ``update``; ``steps_ahead``: the same
        decode batch that many steps later (the planner's fast-forward)."""
        return tuple(BatchEntry(s.request_id, n, PREFILL if s.is_prefilling else DECODE,
                                s.num_computed_tokens + steps_ahead)
                     for s, n in zip(self.requests, self.num_new_tokens))

    def step_features(self) -> StepFeatures:
        """The batch's ``StepFeatures``, before ``update``: an entry of n tokens at k computed is a
        prefill entry (a prompt chunk or recompute: Σn += n, pairs += n(k+n)), else a decode (B +=
        1, Σctx += k + 1). The simulator and the emulated runner time a step from these."""
        n_pre = q_pre = num_decode = sum_ctx = 0
        for state, n in zip(self.requests, self.num_new_tokens):
            k = state.num_computed_tokens
            if k < state.num_prompt_tokens or len(state.token_ids) - k > 1:  # is_prefilling
                n_pre += n
                q_pre += n * (k + n)
            else:
                num_decode += 1
                sum_ctx += k + 1
        return StepFeatures(n_pre, q_pre, num_decode, sum_ctx)

    def completes(self, i: int) -> bool:
        """True when entry i computes the request's last known token, so a token is sampled."""
        state = self.requests[i]
        return state.num_computed_tokens + self.num_new_tokens[i] == state.num_tokens


class Scheduler:
    """Waiting and running queues under a token budget and KV blocks (module docstring).
    ``num_kv_blocks``: None = ``config.max_kv_blocks`` (the engine passes its budget-derived
    count). ``capacity``: the ``BlockAllocator``; ``prefix_cache_stats`` in tokens."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 num_kv_blocks: int | None = None) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        blocks = config.max_kv_blocks if num_kv_blocks is None else num_kv_blocks
        self.capacity = BlockAllocator(blocks, config.block_size, config.enable_prefix_caching)
        self.block_size = config.block_size
        self.on_demand = config.kv_reservation == "on_demand"
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.receiving: list[RequestState] = []  # blocks reserved, KV fetch in flight
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0
        # blocks registered by the current step's schedule(): their KV exists only once it ran
        self._step_cached: list[int] = []
        self._preempted_now = False

    def add(self, state: RequestState) -> None:
        """Queue a request.

        Raises:
            ValueError: it needs more KV blocks than the whole cache (it could never run)."""
        if not self.capacity.fits_ever(state.max_total_tokens):
            cap = self.capacity
            raise ValueError(
                f"request {state.request_id}: needs {state.max_total_tokens} KV tokens "
                f"({cap.blocks_needed(state.max_total_tokens)} blocks of {cap.block_size}), "
                f"more than the whole KV cache ({cap.num_blocks} blocks = "
                f"{cap.num_blocks * cap.block_size} tokens)")
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.status == RequestStatus.RUNNING for s in self.running)

    @property
    def num_used_seqs(self) -> int:
        """Requests holding KV blocks (running, prefilled, receiving)."""
        return len(self.running) + len(self.receiving)

    @property
    def reserved_tokens(self) -> int:
        """Tokens the holders' blocks were allocated for."""
        return sum(s.num_reserved_tokens for s in self.running) + sum(
            s.num_reserved_tokens for s in self.receiving)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._step_cached = []
        self._preempted_now = False
        budget = self.config.max_num_batched_tokens
        # hot path (the simulator calls it per step): fields read directly, decodes inline
        requests, counts, prompts = batch.requests, batch.num_new_tokens, []
        block_size, on_demand = self.block_size, self.on_demand
        caching = self.capacity.enable_caching
        for state in tuple(self.running):  # a preemption edits the list
            if state.status != _RUNNING:  # PREFILLED, or preempted earlier in this pass
                continue
            k = state.num_computed_tokens
            if k < state.num_prompt_tokens or len(state.token_ids) - k > 1:
                prompts.append(state)  # a prompt part-way (is_prefilling), or a recompute
                continue
            if budget <= 0:  # 1. decodes
                continue
            if on_demand and k >= len(state.block_ids) * block_size:
                freed = self._grow(state, k + 1, batch)
                if freed < 0:
                    continue
                budget += freed
            if caching and (k + 1) % block_size == 0:
                self._cache_blocks(state, k + 1)
            requests.append(state)
            counts.append(1)
            budget -= 1
        for state in prompts:  # 2. part-way prompts and recomputes
            if budget <= 0:
                break
            if state.status != _RUNNING:  # preempted by a request before it
                continue
            k = state.num_computed_tokens
            n = self._chunk(len(state.token_ids) - k, budget)
            if n == 0:
                continue
            if on_demand and k + n > len(state.block_ids) * block_size:
                freed = self._grow(state, k + n, batch)
                if freed < 0:
                    continue
                budget += freed
            if caching:
                self._cache_blocks(state, k + n)
            batch.add(state, n)
            budget -= n
        if not self._preempted_now:  # 3. admission, FCFS (none after a preemption: vLLM v1)
            self._admit(batch, budget)
        return batch

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of an entry with ``remaining`` tokens left this step (0: it waits)."""
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            return budget  # a recompute longer than the whole budget is chunked anyway
        return 0

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        cap, block_size = self.capacity, self.block_size
        while self.waiting:
            state = self.waiting[0]
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            if state.status == _REMOTE:
                if not self._reserve_remote(state, batch):
                    break
                if state.status == _REMOTE:  # reserved; else it recomputes: admit it below
                    self.waiting.popleft()
                    self.receiving.append(state)
                    batch.kv_reserved.append(state)
                    continue
            if budget <= 0:
                break
            hit = self._lookup(state)
            num_hit = len(hit) * block_size
            n = self._chunk(len(state.token_ids) - num_hit, budget)
            if n == 0:
                break
            target = num_hit + n if self.on_demand else state.max_total_tokens
            needed = cap.blocks_needed(target) - len(hit) + cap.num_evictable_in(hit)
            if needed > cap.num_free_blocks:
                break
            self.waiting.popleft()
            cap.touch(hit)
            state.block_ids = hit + cap.allocate(target - num_hit)
            state.num_computed_tokens = num_hit
            state.num_cached_blocks = len(hit)
            state.num_reserved_tokens = target
            if cap.enable_caching:
                self.prefix_cache_stats.record(len(state.token_ids), num_hit,
                                               state.num_preemptions > 0)
            if state.num_cached_tokens is None:  # the first admission's hit, for the record
                state.num_cached_tokens = min(num_hit, state.num_prompt_tokens)
            state.status = _RUNNING
            self.running.append(state)
            batch.newly_admitted.append(state)
            if cap.enable_caching:
                self._cache_blocks(state, num_hit + n)
            batch.add(state, n)
            budget -= n

    def _reserve_remote(self, state: RequestState, batch: ScheduledBatch) -> bool:
        """Blocks for a remote request: prompt + 1 tokens (``full``: + max_tokens), sharing the
        cached prompt blocks. False: no room yet. If its KV starts past the cached prefix (evicted
        since), it turns local, recomputing prompt + first token (``kv_dropped``); True."""
        cap, block_size = self.capacity, self.block_size
        num_prompt = state.num_prompt_tokens
        hit = []
        if cap.enable_caching:
            hit = cap.lookup(self._hashes(state), num_prompt // block_size,
                             exclude=set(self._step_cached))
        num_hit = len(hit) * block_size
        if num_hit < state.kv_token_start:
            state.status = _WAITING  # admitted as a local request from here on
            state.num_computed_tokens = 0
            state.kv_token_start = 0
            batch.kv_dropped.append(state)
            return True
        target = state.max_total_tokens if not self.on_demand else num_prompt + 1
        if cap.blocks_needed(target) - len(hit) + cap.num_evictable_in(hit) > cap.num_free_blocks:
            return False
        cap.touch(hit)
        state.block_ids = hit + cap.allocate(target - num_hit)
        state.num_cached_blocks = len(hit)
        state.num_cached_tokens = num_hit
        state.num_reserved_tokens = target
        if cap.enable_caching:
            self.prefix_cache_stats.transfer_queries += num_prompt
            self.prefix_cache_stats.transfer_hits += num_hit
        return True

    def _lookup(self, state: RequestState) -> list[int]:
        """Blocks of ``state``'s longest cached prefix, leaving its last token uncached (its
        logits are needed: vLLM's ``max_cache_hit_length = num_tokens - 1``)."""
        if not self.capacity.enable_caching:
            return []
        return self.capacity.lookup(self._hashes(state),
                                    (len(state.token_ids) - 1) // self.block_size)

    def _hashes(self, state: RequestState) -> list[bytes]:
        """Block hashes over all full blocks (the prompt's computed once per ``Request``)."""
        if not state.block_hashes and state.num_prompt_tokens >= self.block_size:
            state.block_hashes = list(prompt_block_hashes(state.request, self.block_size))
        return block_hashes(state.token_ids, self.block_size, state.block_hashes)

    def _cache_blocks(self, state: RequestState, num_tokens: int, this_step: bool = True) -> None:
        """Register the full blocks among the first ``num_tokens`` tokens (computed by now or by
        this step when ``this_step``)."""
        num_full = num_tokens // self.block_size
        if num_full <= state.num_cached_blocks:
            return
        hashes = state.block_hashes
        if len(hashes) < num_full:
            hashes = self._hashes(state)
        registered = self.capacity.cache_table(state.block_ids, hashes, state.num_cached_blocks,
                                               num_full)
        if this_step:
            self._step_cached.extend(registered)
        state.num_cached_blocks = num_full

    def _grow(self, state: RequestState, num_tokens: int, batch: ScheduledBatch) -> int:
        """Blocks for the first ``num_tokens`` tokens, preempting the newest running requests while
        none is free. Returns the tokens taken out of ``batch``, or -1 if ``state`` was preempted."""
        cap = self.capacity
        needed = cap.blocks_needed(num_tokens) - len(state.block_ids)
        freed = 0
        while cap.num_free_blocks < needed:
            victim = next(s for s in reversed(self.running) if s.status == _RUNNING)
            freed += self._preempt(victim, batch)
            if victim is state:
                return -1
        state.block_ids.extend(cap.allocate(num_tokens - len(state.block_ids) * self.block_size))
        state.num_reserved_tokens = num_tokens
        return freed

    def _preempt(self, state: RequestState, batch: ScheduledBatch) -> int:
        """Free a running request's blocks and queue it first; returns tokens taken out of batch."""
        taken = 0
        for i, s in enumerate(batch.requests):
            if s is state:
                taken = batch.num_new_tokens[i]
                del batch.requests[i], batch.num_new_tokens[i]
                break
        self._uncache_uncomputed(state)
        self.capacity.free(state.block_ids)
        state.block_ids = None
        state.num_computed_tokens = 0
        state.num_cached_blocks = 0
        state.num_reserved_tokens = 0
        state.num_preemptions += 1
        state.status = _WAITING
        self.running.remove(state)
        self.waiting.appendleft(state)
        self.num_preemptions += 1
        self._preempted_now = True
        batch.preempted.append(state)
        return taken

    def _uncache_uncomputed(self, state: RequestState) -> None:
        table, cap = state.block_ids, self.capacity
        for i in range(state.num_computed_tokens // self.block_size, state.num_cached_blocks):
            cap.uncache(table[i])

    def decode_steps_available(self, requests: list[RequestState], max_steps: int) -> int:
        """How many of the next ``max_steps`` unchanged decode steps of ``requests`` (a pure-decode
        batch) get their KV blocks without a preemption (the planner's fast-forward). ``full``: all."""
        if not self.on_demand or max_steps <= 0:
            return max(max_steps, 0)
        block_size, free = self.block_size, self.capacity.num_free_blocks
        # step j computes token k + j; a new block at j = cap - k, then every block_size steps
        firsts = [len(s.block_ids) * block_size - s.num_computed_tokens for s in requests]

        def needed(m: int) -> int:
            return sum(1 + (m - f) // block_size for f in firsts if m >= f)

        if needed(max_steps) <= free:
            return max_steps
        lo, hi = 0, max_steps  # needed(lo) <= free < needed(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if needed(mid) <= free else (lo, mid)
        return lo

    def catch_up_decodes(self, requests: list[RequestState], num_steps: int) -> None:
        """The KV side of ``num_steps`` decode steps that ran without ``schedule`` (the planner's
        fast-forward, at most ``decode_steps_available``): the blocks and prefix-cache entries
        ``schedule`` would have made, in its order."""
        block_size = self.block_size
        if self.on_demand and num_steps > 0:
            due = []  # (step, request index): when each new block was needed
            for i, state in enumerate(requests):
                k0 = state.num_computed_tokens - num_steps
                first = len(state.block_ids) * block_size - k0
                due.extend((j, i) for j in range(first, num_steps + 1, block_size))
            for j, i in sorted(due):
                state = requests[i]
                state.block_ids.extend(self.capacity.allocate(block_size))
                state.num_reserved_tokens = state.num_computed_tokens - num_steps + j + 1
        if self.capacity.enable_caching:
            for state in requests:
                self._cache_blocks(state, len(state.token_ids), this_step=False)

    def step_failed(self) -> None:
        """The last batch's forward failed: its registered blocks leave the prefix cache (call
        before releasing its requests)."""
        for block in self._step_cached:
            self.capacity.uncache(block)
        self._step_cached = []

    def kv_arrived(self, state: RequestState) -> None:
        """A receiving request's KV is in its blocks: it decodes from the next step, and its full
        prompt blocks join the prefix cache.

        Raises:
            ValueError: ``state`` is not receiving."""
        if state not in self.receiving:
            raise ValueError(f"request {state.request_id} has no KV blocks reserved for a fetch")
        self.receiving.remove(state)
        state.status = RequestStatus.RUNNING
        self.running.append(state)
        if self.capacity.enable_caching:
            self._cache_blocks(state, state.num_prompt_tokens, this_step=False)

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[RequestState]:
        """Advance counters; ``sampled`` maps batch entry index -> token id. Returns the requests
        that produced a token this step (finished ones have a FINISHED_* or PREFILLED status)."""
        produced = []
        counts, check_stop = batch.num_new_tokens, self.check_stop
        for i, state in enumerate(batch.requests):
            state.num_computed_tokens += counts[i]
            if i not in sampled:
                continue
            token = sampled[i]
            state.token_ids.append(token)
            produced.append(state)
            check_stop(state, token)
        return produced

    def check_stop(self, state: RequestState, token: int) -> None:
        params = state.request.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            state.status = RequestStatus.FINISHED_STOPPED
        elif len(state.token_ids) - state.num_prompt_tokens >= params.max_tokens:  # num_output_tokens
            state.status = RequestStatus.FINISHED_LENGTH
        elif state.prefill_only:
            state.status = RequestStatus.PREFILLED  # keeps its blocks until the KV is exported
        if state.status >= _FINISHED_STOPPED:  # is_finished
            self.release(state)

    def release(self, state: RequestState) -> None:
        """Give back a request's blocks (full ones stay cached), drop it from the queues (idempotent)."""
        held = state.block_ids is not None
        if held:
            self.capacity.free(state.block_ids)
            state.block_ids = None
        try:
            self.running.remove(state)
        except ValueError:
            pass
        # a state holding blocks has left ``waiting``: skip scanning a possibly long queue
        if not held and state in self.waiting:
            self.waiting.remove(state)
        if state in self.receiving:
            self.receiving.remove(state)
