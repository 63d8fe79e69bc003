"""Which tokens of which requests run in the next step (no torch).

A step, as the scheduler sees it:

1. Running decodes go first, one token each (their latency is what interference hurts).
2. Running prompts that are part-way through (chunked prefill) get the next chunk.
3. Waiting requests are admitted in arrival order while ``max_num_seqs`` and the KV blocks
   allow and the token budget lasts. A request prefilled elsewhere (``WAITING_FOR_REMOTE_KVS``,
   decode worker) only needs blocks: it gets its blocks reserved, moves to ``receiving``
   and is listed in ``batch.kv_reserved`` so its worker starts fetching the KV into those
   blocks; it runs no compute this step. When the fetch completes, ``kv_arrived`` makes it
   RUNNING and it joins the next step as a decode. (vLLM v1's WAITING_FOR_REMOTE_KVS,
   SGLang's pre-allocation queue: nothing is fetched before there is room for it.)
4. ``update`` applies the sampled tokens: counters advance, stop conditions are checked,
   finished requests give back their blocks.

KV blocks are reserved whole at admission (preemption-free): a request gets the blocks for
``RequestState.max_total_tokens`` (prompt + max_tokens; prompt + 1 for a prefill-only
request) before its first token is computed, so it never runs out of KV mid-decode and no
request is ever preempted or recomputed. The price against vLLM's grow-on-demand blocks
with preemption: blocks for output a request may never produce (it stops early at EOS) are
held until it ends. A request that needs more blocks than the whole cache is refused by
``Scheduler.add`` (the engine refuses it earlier, in ``Engine.validate``), so it never
blocks the queue behind it.

With chunked prefill on, a prompt takes what is left of the budget (Sarathi-Serve); off, a
prompt runs whole or waits for a step with room for it (no chunking, vLLM v1 style mixing).
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.metrics import DECODE, PREFILL, BatchEntry
from engine.request import RequestState, RequestStatus


_RUNNING, _FINISHED_STOPPED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED


class BlockAllocator:
    """Block accounting of a paged KV store (never touches a tensor): a free list of
    ``num_blocks`` blocks of ``block_size`` tokens, and at most ``max_num_seqs`` requests
    holding blocks at once (nano-vllm's ``BlockManager``, without prefix caching).

    ``allocate`` hands a request the lowest run of consecutive free blocks long enough
    (first fit), else (free list fragmented) the lowest free blocks: consecutive blocks
    are read in place by attention and export (``engine.runner``, ``KVStore.read``), a
    scattered table is gathered. Requests of equal size admitted one after another get
    equally spaced runs, which decode attention reads as one strided view.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        if num_blocks < 1 or block_size < 1 or max_num_seqs < 1:
            raise ValueError(f"need num_blocks, block_size, max_num_seqs >= 1, got "
                             f"{num_blocks}, {block_size}, {max_num_seqs}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self._free = list(range(num_blocks))  # ascending
        self._reserved: dict[int, tuple[int, int]] = {}  # first block -> (blocks, tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_used_seqs(self) -> int:
        """Requests holding blocks."""
        return len(self._reserved)

    @property
    def reserved_tokens(self) -> int:
        """Tokens the holders asked for (<= ``num_used_blocks * block_size``)."""
        return sum(tokens for _, tokens in self._reserved.values())

    def blocks_needed(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """True if ``num_tokens`` fit the whole cache (else they can never be admitted)."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return (len(self._reserved) < self.max_num_seqs
                and self.blocks_needed(num_tokens) <= len(self._free))

    def allocate(self, num_tokens: int) -> list[int]:
        """Reserve blocks for ``num_tokens`` (>= 1) tokens; returns their ids in token order.
        Caller checks ``can_allocate``."""
        n = self.blocks_needed(num_tokens)
        if n < 1 or not self.can_allocate(num_tokens):
            raise ValueError(f"cannot allocate {n} blocks for {num_tokens} tokens: "
                             f"{len(self._free)} free, {len(self._reserved)} requests held")
        free = self._free
        start = next((i for i in range(len(free) - n + 1) if free[i + n - 1] - free[i] == n - 1),
                     0)  # free is ascending and distinct: a span of n - 1 is a run
        block_ids = free[start:start + n]
        del free[start:start + n]
        self._reserved[block_ids[0]] = (n, num_tokens)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Give back a request's blocks (the list ``allocate`` returned).

        Raises:
            ValueError: ``block_ids`` is not a table this allocator handed out (double free).
        """
        held = self._reserved.get(block_ids[0]) if block_ids else None
        if held is None or held[0] != len(block_ids):
            raise ValueError(f"blocks {block_ids[:4]}... are not allocated here")
        del self._reserved[block_ids[0]]
        free, first, last = self._free, block_ids[0], block_ids[-1]
        if last - first == len(block_ids) - 1 and block_ids == list(range(first, last + 1)):
            # one run (the usual table): insert it where it goes, no sort of the whole list;
            # the same list as extend + sort when no free block lies inside the run
            i = bisect.bisect_left(free, first)
            if i == len(free) or free[i] > last:
                free[i:i] = block_ids
                return
        free.extend(block_ids)
        free.sort()  # lowest first again (timsort: two sorted runs, linear)


@dataclass
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``requests[i]``, starting at its
    ``num_computed_tokens``. ``newly_admitted`` lists requests that got their KV blocks this
    step; ``kv_reserved`` the WAITING_FOR_REMOTE_KVS requests whose blocks were reserved this step
    (their KV fetch may start now; they are not in ``requests``)."""

    requests: list[RequestState] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    newly_admitted: list[RequestState] = field(default_factory=list)
    kv_reserved: list[RequestState] = field(default_factory=list)

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
        """The batch as ``StepRecord.batch`` entries, taken before ``update`` advances the
        counters; ``steps_ahead``: of the same decode batch that many steps later (the
        planner's fast-forward records steps it does not schedule)."""
        return tuple(BatchEntry(s.request_id, n, PREFILL if s.is_prefilling else DECODE,
                                s.num_computed_tokens + steps_ahead)
                     for s, n in zip(self.requests, self.num_new_tokens))

    def completes(self, i: int) -> bool:
        """True when entry i computes the request's last known token, so a token is sampled."""
        state = self.requests[i]
        return state.num_computed_tokens + self.num_new_tokens[i] == state.num_tokens


class Scheduler:
    """Waiting and running queues under a token budget and KV blocks.

    Args:
        config: budget, ``max_num_seqs``, ``block_size``.
        eos_token_ids: tokens that stop a request (unless ``ignore_eos``).
        num_kv_blocks: blocks of the KV cache; None = ``config.max_kv_blocks`` (what the
            config alone allows; the engine passes its budget-derived count,
            ``engine.kv_cache.kv_cache_num_blocks``).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 num_kv_blocks: int | None = None) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        blocks = config.max_kv_blocks if num_kv_blocks is None else num_kv_blocks
        self.capacity = BlockAllocator(blocks, config.block_size, config.max_num_seqs)
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.receiving: list[RequestState] = []  # blocks reserved, KV fetch in flight

    def add(self, state: RequestState) -> None:
        """Queue a request.

        Raises:
            ValueError: it needs more KV blocks than the whole cache (it could never run).
        """
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

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # hot path (the planner's simulator calls it per simulated step): the fields read
        # directly, decodes appended inline (batch.add), prompts set aside in one pass
        requests, counts, prompts = batch.requests, batch.num_new_tokens, []
        for state in self.running:
            if state.status != _RUNNING:
                continue
            if state.num_computed_tokens < state.num_prompt_tokens:  # is_prefilling
                prompts.append(state)
            elif budget > 0:  # 1. decodes
                requests.append(state)
                counts.append(1)
                budget -= 1
        for state in prompts:  # 2. part-way prompts
            if budget > 0:
                budget -= self._add_prompt_chunk(batch, state, budget)
        while self.waiting:  # 3. admission, FCFS
            state = self.waiting[0]
            if not self.capacity.can_allocate(state.max_total_tokens):
                break
            if state.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.popleft()  # reserve now, compute once the KV is in its blocks
                state.block_ids = self.capacity.allocate(state.max_total_tokens)
                self.receiving.append(state)
                batch.kv_reserved.append(state)
                continue
            if budget <= 0:
                break
            needed = 1 if not state.is_prefilling else state.num_prompt_tokens - state.num_computed_tokens
            if not self.config.enable_chunked_prefill and needed > budget:
                break
            self.waiting.popleft()
            state.block_ids = self.capacity.allocate(state.max_total_tokens)
            state.status = RequestStatus.RUNNING
            self.running.append(state)
            batch.newly_admitted.append(state)
            budget -= self._add_prompt_chunk(batch, state, budget) if state.is_prefilling else 1
            if not state.is_prefilling:
                batch.add(state, 1)
        return batch

    def kv_arrived(self, state: RequestState) -> None:
        """A receiving request's KV is in its blocks: it decodes from the next step on.

        Raises:
            ValueError: ``state`` is not receiving (never reserved, or already released).
        """
        if state not in self.receiving:
            raise ValueError(f"request {state.request_id} has no KV blocks reserved for a fetch")
        self.receiving.remove(state)
        state.status = RequestStatus.RUNNING
        self.running.append(state)

    def _add_prompt_chunk(self, batch: ScheduledBatch, state: RequestState, budget: int) -> int:
        remaining = state.num_prompt_tokens - state.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        num_tokens = min(remaining, budget)
        batch.add(state, num_tokens)
        return num_tokens

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[RequestState]:
        """Advance counters; ``sampled`` maps batch entry index -> token id. Returns the
        requests that produced a token this step (finished ones have a FINISHED_* or
        PREFILLED status)."""
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
        """Give back a request's blocks and drop it from the queues (idempotent)."""
        held = state.block_ids is not None
        if held:
            self.capacity.free(state.block_ids)
            state.block_ids = None
        try:
            self.running.remove(state)
        except ValueError:
            pass
        # a state holding blocks has left ``waiting`` (blocks are allocated only as it is
        # popped): skip the scan of what may be a long queue
        if not held and state in self.waiting:
            self.waiting.remove(state)
        if state in self.receiving:
            self.receiving.remove(state)
