"""Which workers serve a request and what each is charged: the one owner of the assignment rules,
used alike by the router and the planner's simulator, so a plan and a real run pick the same
workers from the same loads. No I/O, no clock, no torch.

``assign`` by placement kind: ``colocated``, one worker; ``disagg``, a prefill and a decode
worker; ``conditional``, Dynamo's rule (``ConditionalConfig.remote``) picks local or remote
prefill. The policy picks each worker from its pool's live workers, charged at once: a prefill
worker the prompt tokens, a decode or colocated one ``prompt + max_tokens`` in whole KV blocks.
``prefilled`` releases the prefill charge; ``release`` every charge, exactly once. The KV sent to
a decode worker skips only the prefix whose KV landed there (``kv_landed``). A dead worker leaves
its pool (``mark_dead``) until ``mark_live``; a pool with no live worker makes ``assign`` raise
``NoLiveWorker`` naming the role."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import ConditionalConfig
from router.policy import pick
from router.prefix_index import PrefixIndex

ROLES = {"colocated": ("colocated",), "disagg": ("prefill", "decode"),
         "conditional": ("prefill", "decode")}


class NoLiveWorker(ValueError):
    """``assign`` found no live worker in the pool of ``role`` (nothing was charged)."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no live worker to route to (no live {role} worker)")
        self.role = role


@dataclass(frozen=True)
class Assignment:
    """Where a request runs: ``first`` computes its prompt, ``decode`` its other tokens;
    ``kv_token_start`` (remote only): the whole-block prefix its decode worker holds for sure, so
    only the KV from there on is sent."""

    first: str
    decode: str
    kv_token_start: int = 0

    @property
    def remote(self) -> bool:
        """The prompt runs on a prefill worker and its KV moves to the decode worker."""
        return self.first != self.decode


class Assigner:
    """Pools, loads and charges of one placement (module docstring).

    ``workers``: ``(name, role)`` per worker; a pool keeps this order (``least_loaded`` ties go
    to the first). ``kv_block_size``: tokens per KV block (decode charges count whole blocks).

    Raises:
        ValueError: an unknown kind or policy, or a role the kind needs has no worker."""

    def __init__(self, workers: Sequence[tuple[str, str]], kind: str, policy: str = "least_loaded",
                 kv_block_size: int = 1, conditional: ConditionalConfig | None = None) -> None:
        if kind not in ROLES:
            raise ValueError(f"placement kind must be one of {tuple(ROLES)}, got {kind!r}")
        pick(policy, ["w"], {}, 0)  # refuses an unknown policy now
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
        self.kind, self.policy, self.kv_block_size = kind, policy, kv_block_size
        self.conditional = (conditional or ConditionalConfig()) if kind == "conditional" else None
        self.pools = {role: [name for name, r in workers if r == role] for role in ROLES[kind]}
        for role, names in self.pools.items():
            if not names:
                raise ValueError(f"a {kind} placement needs a {role} worker, got none")
        self.loads = {name: 0 for name, _ in workers}  # tokens (module docstring)
        self._dead: set[str] = set()
        self._turns = dict.fromkeys(self.pools, 0)
        self._charges: dict[str, dict[str, int]] = {}  # request -> worker -> tokens charged
        self._queued: set[str] = set()  # remote requests not yet prefilled
        self.prefixes = PrefixIndex(self.loads)  # what each worker was sent (module docstring)
        self.landed = PrefixIndex(self.loads)  # prompts whose KV reached a decode worker
        self._hashes: dict[str, tuple[bytes, ...]] = {}  # request -> its prompt's block hashes
        self._counts = {name: 0 for name in self.loads}  # requests charged to each worker

    @property
    def uses_prefixes(self) -> bool:
        """Whether ``assign`` reads block hashes (``cache_aware`` or ``conditional``)."""
        return self.policy == "cache_aware" or self.kind == "conditional"

    def prefix_hit_tokens(self, worker: str, block_hashes: Sequence[bytes]) -> int:
        """Prompt tokens ``worker`` is credited with caching: matched blocks x block size."""
        return self.prefixes.match(worker, block_hashes) * self.kv_block_size

    def reset_prefixes(self) -> None:
        """Forget every worker's prefixes (their caches were reset between runs)."""
        self.prefixes.reset()
        self.landed.reset()

    def kv_landed(self, request_id: str, worker: str) -> None:
        """A remote request's prompt KV reached decode worker ``worker``: it caches those blocks."""
        self.landed.insert(worker, self._hashes.get(request_id, ()))

    def kv_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """A decode (or colocated) charge: ``prompt + max_tokens`` in whole KV blocks."""
        blocks = -(-(num_prompt_tokens + max_tokens) // self.kv_block_size)
        return blocks * self.kv_block_size

    @property
    def num_queued_prefills(self) -> int:
        """Requests at a prefill worker not yet prefilled (Dynamo's prefill queue)."""
        return len(self._queued)

    def assign(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
               block_hashes: Sequence[bytes] = ()) -> Assignment:
        """Pick the request's workers and charge them; ``block_hashes``: the prompt's (empty:
        no prefix known).

        Raises:
            NoLiveWorker: a pool it needs has no live worker; nothing is charged then.
            ValueError: ``request_id`` is already assigned."""
        if request_id in self._charges:
            raise ValueError(f"request_id {request_id} is already assigned")
        kv_tokens = self.kv_tokens(num_prompt_tokens, max_tokens)
        hashes = tuple(block_hashes)
        if self.kind == "colocated":
            first = decode = self._pick("colocated", hashes)
        elif self.conditional is not None and not self.conditional.remote(
                num_prompt_tokens - self._decode_hit_tokens(hashes), self.num_queued_prefills):
            first = decode = self._pick("decode", hashes)  # its decode worker prefills it
        else:
            first = self._pick("prefill", hashes)
            decode = self._pick("decode", hashes)
        kv_start = (self.kv_token_start(decode, hashes, num_prompt_tokens)
                    if first != decode else 0)  # before this prompt is credited to decode
        charges = {decode: kv_tokens}
        if first != decode:
            charges = {first: num_prompt_tokens, decode: kv_tokens}
            self._queued.add(request_id)
        self._charges[request_id] = charges
        for name, tokens in charges.items():
            self.loads[name] += tokens
            self._counts[name] += 1
            self.prefixes.insert(name, hashes)
        if hashes:
            self._hashes[request_id] = hashes
        return Assignment(first, decode, kv_start)

    def kv_token_start(self, decode: str, block_hashes: Sequence[bytes],
                       num_prompt_tokens: int) -> int:
        """The first prompt token whose KV ``decode`` needs sent: the landed prefix in whole
        blocks, at most the whole blocks before the last token (never empty, as
        ``Engine.add_remote`` requires). Evicted meanwhile: the decode worker recomputes."""
        if not block_hashes:
            return 0
        whole = (num_prompt_tokens - 1) // self.kv_block_size * self.kv_block_size
        return min(self.landed.match(decode, block_hashes) * self.kv_block_size, whole)

    def _decode_hit_tokens(self, hashes: tuple[bytes, ...]) -> int:
        """The prefix hit on the decode worker the policy would pick now (0 with none live)."""
        if not hashes:
            return 0
        live = self._live("decode")
        if not live:
            return 0
        return self.prefix_hit_tokens(self._choose("decode", live, hashes), hashes)

    def prefilled(self, request_id: str, worker: str) -> None:
        """Release the prefill charge and leave the prefill queue (no-op when done)."""
        self._discharge(request_id, worker)
        self._queued.discard(request_id)

    def release(self, request_id: str) -> None:
        """Release every charge the request still holds (each once)."""
        for name in list(self._charges.get(request_id, ())):
            self._discharge(request_id, name)
        self._charges.pop(request_id, None)
        self._queued.discard(request_id)
        self._hashes.pop(request_id, None)

    def reassign_decode(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> str:
        """Move a remote request's decode charge to a live decode worker (its own died first);
        returns the new one.

        Raises:
            NoLiveWorker: no decode worker is live (the old charge is released either way)."""
        charges = self._charges[request_id]
        for name in [n for n in charges if n in self.pools["decode"]]:
            self._discharge(request_id, name)
        hashes = self._hashes.get(request_id, ())
        decode = self._pick("decode", hashes)
        charges[decode] = self.kv_tokens(num_prompt_tokens, max_tokens)
        self.loads[decode] += charges[decode]
        self._counts[decode] += 1
        self.prefixes.insert(decode, hashes)
        return decode

    def mark_dead(self, worker: str) -> None:
        """Nothing new goes to ``worker``; its charges stay until released; its prefixes go."""
        self._dead.add(worker)
        self.prefixes.forget(worker)
        self.landed.forget(worker)

    def mark_live(self, worker: str) -> None:
        """``worker`` (restarted) is back in its pool."""
        self._dead.discard(worker)

    def is_live(self, worker: str) -> bool:
        return worker not in self._dead

    def requests_needing(self, worker: str) -> list[str]:
        """Requests still charged to ``worker`` (they need it), in assignment order."""
        return [rid for rid, charges in self._charges.items() if worker in charges]

    def _live(self, role: str) -> list[str]:
        return [name for name in self.pools[role] if name not in self._dead]

    def _choose(self, role: str, live: list[str], hashes: tuple[bytes, ...]) -> str:
        if self.policy != "cache_aware":
            return pick(self.policy, live, self.loads, self._turns[role])
        matches = {name: self.prefixes.match(name, hashes) for name in live} if hashes else {}
        return pick(self.policy, live, self.loads, self._turns[role], matches, self._counts)

    def _pick(self, role: str, hashes: tuple[bytes, ...] = ()) -> str:
        live = self._live(role)
        if not live:
            raise NoLiveWorker(role)
        name = self._choose(role, live, hashes)
        self._turns[role] += 1
        return name

    def _discharge(self, request_id: str, worker: str) -> None:
        charges = self._charges.get(request_id)
        if charges is not None and worker in charges:
            self.loads[worker] -= charges.pop(worker)
            self._counts[worker] -= 1
