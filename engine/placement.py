"""The typed placement: which instances run, in which role, each over ``tp * pp`` devices
(tensor- and pipeline-parallel sizes), parsed and checked here only.

Spelling (case-insensitive, surrounding spaces ignored)::

    colocated:N             N colocated instances (chunked prefill on)
    colocated-nochunk:N     the same with chunked prefill off
    disagg:XpYd             X prefill instances, Y decode instances
    conditional:XpYd        disagg:XpYd's instances; decode prefills short prompts itself

each optionally followed by ``+``-joined sizes (``+`` needs no shell quoting, ``,`` separates
placements): ``+tpT +ppP`` for every instance, ``+ptpT +dtpT +pppP +dppP`` for prefill or
decode only. ``disagg:1p1d+ptp2`` is a TP-2 prefill and a TP-1 decode instance on 3 devices,
``colocated:2+tp2`` two TP-2 instances on 4. ``str(placement)`` writes the canonical spelling
(sizes of 1 left out, a size both phases share written once).

Devices are taken in order, prefill instances first, each the next ``tp * pp`` (in rank
order); extra devices stay unused; a core group (``cpu:0-3``) is one device. A TP size must
divide the attention heads and divide or be a multiple of the KV heads (``check_tp``); a PP
size must not exceed the layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

KINDS = ("colocated", "disagg", "conditional")
ROLES = ("colocated", "prefill", "decode")
NOCHUNK = "colocated-nochunk"

_HEAD_RE = re.compile(r"(colocated(?:-nochunk)?):(\d+)|(disagg|conditional):(\d+)p(\d+)d")
_SIZE_RE = re.compile(r"([pd]?)(tp|pp)(\d+)")
_USAGE = ("placement must be 'colocated:N', 'colocated-nochunk:N', 'disagg:xPyD' or "
          "'conditional:xPyD' (e.g. disagg:1p1d), optionally with '+tpT', '+ppP' or, per "
          "phase, '+ptpT', '+dtpT', '+pppP', '+dppP' (e.g. disagg:1p1d+ptp2)")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class Instance:
    """One instance: ``tp * pp`` devices running one model copy with one scheduler; ``role``
    ``colocated``, ``prefill`` or ``decode``, ``index`` 0-based within its role, ``devices``
    in rank order (rank = stage * tp + tp_rank), ``()`` until bound."""

    role: str
    index: int
    tp: int = 1
    pp: int = 1
    devices: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ``colocated-0``: the worker name of this instance."""
        return f"{self.role}-{self.index}"

    @property
    def num_devices(self) -> int:
        """Devices (ranks) it spans: ``tp * pp``."""
        return self.tp * self.pp

    @property
    def device(self) -> str:
        """Its first device (rank 0, its scheduler's); ValueError when not bound to devices."""
        _check(bool(self.devices), f"instance {self.name} has no devices: bind the placement "
                                   "to a device set first (Placement.bind)")
        return self.devices[0]


@dataclass(frozen=True)
class Placement:
    """A parsed placement: ``kind`` ``colocated``, ``disagg`` or ``conditional``; ``chunked``
    False for ``colocated-nochunk``; ``instances`` prefill then decode (or colocated)."""

    kind: str
    chunked: bool
    instances: tuple[Instance, ...]

    @classmethod
    def parse(cls, text: str) -> Placement:
        """Parse a spelling; ValueError, one line naming the text, on anything else, a zero
        count or size, a size given twice, or a per-phase size on a colocated placement."""
        raw = text
        head, *sizes = text.strip().lower().split("+")
        m = _HEAD_RE.fullmatch(head)
        if m is None:
            raise ValueError(f"{_USAGE}, got {raw!r}")
        if m.group(1) is not None:
            kind, chunked, counts = "colocated", m.group(1) != NOCHUNK, {"colocated": int(m.group(2))}
            _check(counts["colocated"] >= 1, f"colocated:N needs N >= 1, got {raw!r}")
        else:
            kind, chunked = m.group(3), True
            counts = {"prefill": int(m.group(4)), "decode": int(m.group(5))}
            _check(min(counts.values()) >= 1, f"{kind}:xPyD needs x, y >= 1, got {raw!r}")
        roles = tuple(counts)
        given: dict[tuple[str, str], int] = {}
        for size in sizes:
            s = _SIZE_RE.fullmatch(size)
            _check(s is not None, f"{_USAGE}, got {raw!r} (bad size {size!r})")
            phase, what, value = s.group(1), s.group(2), int(s.group(3))
            _check(value >= 1, f"a {what.upper()} size must be >= 1, got {raw!r}")
            _check(not (phase and kind == "colocated"),
                   f"a colocated placement has no phases: write '+{what}{value}', got {raw!r}")
            targets = roles if not phase else ({"p": "prefill", "d": "decode"}[phase],)
            for role in targets:
                _check((role, what) not in given,
                       f"the {role} {what.upper()} size is given twice in {raw!r}")
                given[role, what] = value
        return cls(kind, chunked, tuple(
            Instance(role, i, given.get((role, "tp"), 1), given.get((role, "pp"), 1))
            for role in roles for i in range(counts[role])))


    def of_role(self, role: str) -> tuple[Instance, ...]:
        """Its instances of ``role`` (``colocated``, ``prefill`` or ``decode``), in order."""
        return tuple(i for i in self.instances if i.role == role)

    @property
    def roles(self) -> tuple[str, ...]:
        """``("colocated",)`` or ``("prefill", "decode")``."""
        return ("colocated",) if self.kind == "colocated" else ("prefill", "decode")

    @property
    def counts(self) -> tuple[int, int]:
        """``(N, 0)`` for colocated, ``(x, y)`` for ``disagg``/``conditional:xPyD``."""
        if self.kind == "colocated":
            return len(self.instances), 0
        return len(self.of_role("prefill")), len(self.of_role("decode"))

    @property
    def num_devices(self) -> int:
        """Devices the placement needs: the sum of its instances' ``tp * pp``."""
        return sum(i.num_devices for i in self.instances)

    @property
    def needs_transfer(self) -> bool:
        """True where KV moves between instances (``disagg``, ``conditional``)."""
        return self.kind != "colocated"

    @property
    def is_parallel(self) -> bool:
        """True if any instance spans more than one device."""
        return any(i.num_devices > 1 for i in self.instances)

    def size_of(self, role: str) -> tuple[int, int]:
        """``(tp, pp)`` of ``role``'s instances (the same for all); ValueError when the
        placement has none."""
        found = self.of_role(role)
        _check(bool(found), f"placement {self} has no {role} instance")
        return found[0].tp, found[0].pp

    def __str__(self) -> str:
        """The canonical spelling (module docstring); ``Placement.parse(str(p)) == p`` for an
        unbound placement."""
        first, second = self.counts
        if self.kind == "colocated":
            head = f"{'colocated' if self.chunked else NOCHUNK}:{first}"
        else:
            head = f"{self.kind}:{first}p{second}d"
        suffix = []
        for what in ("tp", "pp"):
            values = {role: getattr(self.of_role(role)[0], what) for role in self.roles}
            if len(set(values.values())) == 1:
                value = next(iter(values.values()))
                suffix += [f"{what}{value}"] if value != 1 else []
            else:
                suffix += [f"{role[0]}{what}{v}" for role, v in values.items() if v != 1]
        return "+".join([head] + suffix)


    def bind(self, devices: tuple[str, ...]) -> Placement:
        """This placement with each instance's devices taken in order from ``devices``;
        ValueError when it needs more devices than the set has."""
        _check(self.num_devices <= len(devices),
               f"placement {self} needs {self.num_devices} devices, the device set "
               f"{','.join(devices)} has {len(devices)}")
        bound, at = [], 0
        for inst in self.instances:
            bound.append(replace(inst, devices=tuple(devices[at:at + inst.num_devices])))
            at += inst.num_devices
        return replace(self, instances=tuple(bound))

    def check_model(self, num_heads: int, num_kv_heads: int, num_layers: int,
                    model: str = "the model") -> None:
        """Refuse sizes the model cannot be split by (``check_tp``; a PP over ``num_layers``)
        with a ValueError naming the role, the size and the model's counts."""
        for role in self.roles:
            tp, pp = self.size_of(role)
            check_tp(tp, num_heads, num_kv_heads, f"{role} TP {tp}", model)
            _check(pp <= num_layers, f"{role} PP {pp} exceeds {model}'s {num_layers} layers")


def check_tp(tp: int, num_heads: int, num_kv_heads: int, what: str = "",
             model: str = "the model") -> None:
    """``tp`` suits a model if it divides ``num_heads`` and divides ``num_kv_heads`` or is a
    multiple of it (each KV head then on ``tp / num_kv_heads`` ranks): vLLM's rule.

    Raises:
        ValueError: one line, e.g. ``decode TP 3 does not suit tiny-random-llama: TP must
            divide its 4 attention heads and divide or be a multiple of its 2 KV heads``.
    """
    ok = (tp >= 1 and num_heads % tp == 0
          and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0))
    _check(ok, f"{what or f'TP {tp}'} does not suit {model}: TP must divide its {num_heads} "
               f"attention heads and divide or be a multiple of its {num_kv_heads} KV heads")


def parse(text: str) -> Placement:
    """``Placement.parse(text)``."""
    return Placement.parse(text)
