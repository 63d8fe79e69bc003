"""Which workers serve a request and what each is charged: the one owner of the assignment
rules, used alike by the router (``router.router.Router``) and the planner's simulator
(``planner.simulate.Simulator``), so a plan and a real run pick the same workers from the
same loads. No I/O, no clock, no torch. (The whole request's life: docs/architecture.md, "A
request's life".)

1. ``assign`` by placement kind: ``colocated``, one colocated worker; ``disagg``, a prefill
   and a decode worker; ``conditional``, Dynamo's rule (``ConditionalConfig.remote``: prompt
   length minus its prefix hit on the decode worker, and the prefill queue) picks local or
   remote prefill. Each worker is picked by the policy over its pool's live workers
   (``router.policy.pick``) and charged at once: a prefill worker its prompt tokens, a decode
   or colocated worker ``prompt + max_tokens`` rounded up to whole KV blocks.
2. ``prefilled``: its first token came back; the prefill charge is released.
3. ``release``: it ended, whichever way; every charge is released exactly once.

Prefixes: ``assign`` may be given the prompt's block hashes; the picked workers are credited
with them in a ``PrefixIndex`` (``cache_aware`` picks by longest match). Without hashes every
match is 0. The KV sent to a decode worker (``Assignment.kv_token_start``) skips only the
prefix it holds for sure: a second index, ``landed``, credits it once the KV arrived
(``kv_landed``), not blocks still in flight.

A dead worker leaves its pool (``mark_dead``); ``requests_needing`` names the requests that
needed it, and ``reassign_decode`` gives a remote request another decode worker. ``mark_live``
brings a restarted one back. A pool with no live worker makes ``assign`` raise
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
    """Where a request runs: ``first`` computes its prompt (a prefill worker, or the worker
    that also decodes it), ``decode`` produces its other tokens. ``kv_token_start`` (remote
    only): the prompt tokens its decode worker holds for sure, in whole blocks
    (``Assigner.kv_token_start``): only the KV of the tokens from there on is sent."""

    first: str
    decode: str
    kv_token_start: int = 0

    @property
    def remote(self) -> bool:
        """The prompt runs on a prefill worker and its KV moves to the decode worker."""
        return self.first != self.decode


class Assigner:
    """Pools, loads and charges of one placement (module docstring).

    Args:
        workers: ``(name, role)`` of every worker, role ``colocated``, ``prefill`` or
            ``decode``; a pool keeps this order (ties of ``least_loaded`` go to the first).
        kind: the placement kind (``engine.config.parse_placement``): ``colocated``,
            ``disagg`` or ``conditional``.
        policy: ``round_robin``, ``least_loaded`` or ``cache_aware``
            (``router.policy.POLICIES``).
        kv_block_size: tokens per KV block; decode and colocated charges count whole blocks
            (the blocks the worker reserves; 1 = tokens as they are).
        conditional: the rule of a ``conditional`` placement (default ``ConditionalConfig()``).

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
        """The assignment reads prompt block hashes (``cache_aware``, or a ``conditional``
        placement's rule): worth computing them for ``assign``."""
        return self.policy == "cache_aware" or self.kind == "conditional"

    def prefix_hit_tokens(self, worker: str, block_hashes: Sequence[bytes]) -> int:
        """Prompt tokens ``worker`` is credited with caching: matched blocks x block size."""
        return self.prefixes.match(worker, block_hashes) * self.kv_block_size

    def reset_prefixes(self) -> None:
        """Forget every worker's prefixes (their caches were reset between runs)."""
        self.prefixes.reset()
        self.landed.reset()

    def kv_landed(self, request_id: str, worker: str) -> None:
        """A remote request's prompt KV reached its decode worker ``worker`` (``kv_got``):
        the worker caches its prompt's full blocks now (``Scheduler.kv_arrived``)."""
        self.landed.insert(worker, self._hashes.get(request_id, ()))

    def kv_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """A decode (or colocated) worker's charge: ``prompt + max_tokens`` rounded up to
        whole KV blocks."""
        blocks = -(-(num_prompt_tokens + max_tokens) // self.kv_block_size)
        return blocks * self.kv_block_size

    @property
    def num_queued_prefills(self) -> int:
        """Requests assigned to a prefill worker and not yet prefilled (Dynamo's prefill
        queue, which ``conditional`` placements read)."""
        return len(self._queued)

    def assign(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
               block_hashes: Sequence[bytes] = ()) -> Assignment:
        """Pick the request's workers and charge them (step 1). ``block_hashes``: the prompt's
        chained block hashes (module docstring; empty: no prefix is known).

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
        """The first prompt token whose KV a remote request's decode worker ``decode``
        needs sent: the prefix of the prompts whose KV reached it (``kv_landed``; whole
        blocks), at most the whole blocks before the prompt's last token (the KV sent is
        never empty, as ``Engine.add_remote`` requires). If the prefix was evicted
        meanwhile, the decode worker recomputes the prompt instead (``engine.scheduler``)."""
        if not block_hashes:
            return 0
        whole = (num_prompt_tokens - 1) // self.kv_block_size * self.kv_block_size
        return min(self.landed.match(decode, block_hashes) * self.kv_block_size, whole)

    def _decode_hit_tokens(self, hashes: tuple[bytes, ...]) -> int:
        """The prefix hit on the decode worker the policy would pick now (nothing picked,
        nothing charged; 0 with no live decode worker: ``assign`` raises as before)."""
        if not hashes:
            return 0
        live = self._live("decode")
        if not live:
            return 0
        return self.prefix_hit_tokens(self._choose("decode", live, hashes), hashes)

    def prefilled(self, request_id: str, worker: str) -> None:
        """``worker`` (its prefill worker) produced the request's first token: release that
        charge and take the request out of the prefill queue (step 2; no-op when done)."""
        self._discharge(request_id, worker)
        self._queued.discard(request_id)

    def release(self, request_id: str) -> None:
        """The request ended: release every charge it still holds (step 3; each once)."""
        for name in list(self._charges.get(request_id, ())):
            self._discharge(request_id, name)
        self._charges.pop(request_id, None)
        self._queued.discard(request_id)
        self._hashes.pop(request_id, None)

    def reassign_decode(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> str:
        """Move a remote request's decode charge to a live decode worker, picked by the policy (its
        own died before the request reached it); returns the new one.

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
        """Nothing new goes to ``worker``; its charges stay until their requests release.
        Its prefixes are forgotten (a replacement starts with an empty cache)."""
        self._dead.add(worker)
        self.prefixes.forget(worker)
        self.landed.forget(worker)

    def mark_live(self, worker: str) -> None:
        """``worker`` (restarted) is back in its pool: new requests may go to it again."""
        self._dead.discard(worker)

    def is_live(self, worker: str) -> bool:
        return worker not in self._dead

    def requests_needing(self, worker: str) -> list[str]:
        """Requests still charged to ``worker`` (they need it), in assignment order."""
        return [rid for rid, charges in self._charges.items() if worker in charges]

    def _live(self, role: str) -> list[str]:
        return [name for name in self.pools[role] if name not in self._dead]

    def _choose(self, role: str, live: list[str], hashes: tuple[bytes, ...]) -> str:
        """The policy's choice among ``live`` (state unchanged)."""
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
