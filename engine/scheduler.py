"""Which tokens of which requests run in the next step (no torch).

A step, as the scheduler sees it:

1. Running decodes go first, one token each (their latency is what interference hurts).
2. Running prompts that are part-way through (chunked prefill) get the next chunk.
3. Waiting requests are admitted in arrival order while a KV slot and KV capacity are free
   and the token budget lasts. A request prefilled elsewhere (``WAITING_FOR_REMOTE_KVS``,
   decode worker) only needs capacity: it gets its slot reserved, moves to ``receiving``
   and is listed in ``batch.kv_reserved`` so its worker starts fetching the KV into that
   slot; it runs no compute this step. When the fetch completes, ``kv_arrived`` makes it
   RUNNING and it joins the next step as a decode. (vLLM v1's WAITING_FOR_REMOTE_KVS,
   SGLang's pre-allocation queue: nothing is fetched before there is room for it.)
4. ``update`` applies the sampled tokens: counters advance, stop conditions are checked,
   finished requests give back their slot.

With chunked prefill on, a prompt takes what is left of the budget (Sarathi-Serve); off, a
prompt runs whole or waits for a step with room for it (no chunking, vLLM v1 style mixing).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.request import RequestState, RequestStatus


class KVCapacity:
    """Slot and token accounting for a KV store (never touches a tensor).

    A request reserves ``RequestState.max_total_tokens`` (prompt + max_tokens; prompt + 1 for
    a prefill-only request) when admitted, so it can never run out of KV mid-decode (no
    preemption needed).
    """

    def __init__(self, num_slots: int, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._reserved: dict[int, int] = {}

    @property
    def reserved_tokens(self) -> int:
        return sum(self._reserved.values())

    @property
    def num_used_slots(self) -> int:
        return len(self._reserved)

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self._free_slots) and self.reserved_tokens + num_tokens <= self.capacity_tokens

    def allocate(self, num_tokens: int) -> int:
        """Reserve ``num_tokens`` tokens; returns the slot. Caller checks ``can_allocate``."""
        self._free_slots.sort(reverse=True)  # keep used slots low: decode views stay short
        slot = self._free_slots.pop()
        self._reserved[slot] = num_tokens
        return slot

    def free(self, slot: int) -> None:
        del self._reserved[slot]
        self._free_slots.append(slot)


@dataclass
class ScheduledBatch:
    """One step's work: ``num_new_tokens[i]`` tokens of ``requests[i]``, starting at its
    ``num_computed_tokens``. ``newly_admitted`` lists requests that got a slot this step;
    ``kv_reserved`` the WAITING_FOR_REMOTE_KVS requests whose slot was reserved this step
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

    def completes(self, i: int) -> bool:
        """True when entry i computes the request's last known token, so a token is sampled."""
        state = self.requests[i]
        return state.num_computed_tokens + self.num_new_tokens[i] == state.num_tokens


class Scheduler:
    """Waiting and running queues under a token budget and KV capacity."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.capacity = KVCapacity(config.max_num_seqs, config.total_kv_capacity_tokens)
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.receiving: list[RequestState] = []  # slot reserved, KV fetch in flight

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.status == RequestStatus.RUNNING for s in self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        live = [s for s in self.running if s.status == RequestStatus.RUNNING]
        for state in live:  # 1. decodes
            if not state.is_prefilling and budget > 0:
                batch.add(state, 1)
                budget -= 1
        for state in live:  # 2. part-way prompts
            if state.is_prefilling and budget > 0:
                budget -= self._add_prompt_chunk(batch, state, budget)
        while self.waiting:  # 3. admission, FCFS
            state = self.waiting[0]
            if not self.capacity.can_allocate(state.max_total_tokens):
                break
            if state.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.popleft()  # reserve now, compute once the KV is in the slot
                state.slot = self.capacity.allocate(state.max_total_tokens)
                self.receiving.append(state)
                batch.kv_reserved.append(state)
                continue
            if budget <= 0:
                break
            needed = 1 if not state.is_prefilling else state.num_prompt_tokens - state.num_computed_tokens
            if not self.config.enable_chunked_prefill and needed > budget:
                break
            self.waiting.popleft()
            state.slot = self.capacity.allocate(state.max_total_tokens)
            state.status = RequestStatus.RUNNING
            self.running.append(state)
            batch.newly_admitted.append(state)
            budget -= self._add_prompt_chunk(batch, state, budget) if state.is_prefilling else 1
            if not state.is_prefilling:
                batch.add(state, 1)
        return batch

    def kv_arrived(self, state: RequestState) -> None:
        """A receiving request's KV is in its slot: it decodes from the next step on.

        Raises:
            ValueError: ``state`` is not receiving (never reserved, or already released).
        """
        if state not in self.receiving:
            raise ValueError(f"request {state.request_id} has no KV slot reserved for a fetch")
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
        for i, (state, num_tokens) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            state.num_computed_tokens += num_tokens
            if i not in sampled:
                continue
            token = sampled[i]
            state.token_ids.append(token)
            produced.append(state)
            self.check_stop(state, token)
        return produced

    def check_stop(self, state: RequestState, token: int) -> None:
        params = state.sampling
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            state.status = RequestStatus.FINISHED_STOPPED
        elif state.num_output_tokens >= params.max_tokens:
            state.status = RequestStatus.FINISHED_LENGTH
        elif state.prefill_only:
            state.status = RequestStatus.PREFILLED  # keeps its slot until the KV is exported
        if state.status.is_finished:
            self.release(state)

    def release(self, state: RequestState) -> None:
        """Give back a request's slot and drop it from the queues (idempotent)."""
        if state.slot is not None:
            self.capacity.free(state.slot)
            state.slot = None
        if state in self.running:
            self.running.remove(state)
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.receiving:
            self.receiving.remove(state)
