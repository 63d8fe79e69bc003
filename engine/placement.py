"""The typed placement: which instances run, in which role, each over how many devices (its
tensor-parallel size TP times its pipeline-parallel size PP), parsed and checked here only.

Spelling (case-insensitive, surrounding spaces ignored)::

    colocated:N             N colocated instances (chunked prefill on)
    colocated-nochunk:N     the same with chunked prefill off (``engine.config.
                            placement_engine_overrides``)
    disagg:XpYd             X prefill instances, Y decode instances
    conditional:XpYd        the instances of disagg:XpYd; decode instances prefill short
                            prompts themselves (``engine.config.ConditionalConfig``)

each optionally followed by parallel sizes, ``+`` joined (``,`` already separates placements
in a list, and ``+`` needs no quoting in a shell)::

    +tpT  +ppP              every instance at TP T / PP P
    +ptpT +dtpT             prefill / decode instances only (disagg, conditional)
    +pppP +dppP

so ``disagg:1p1d+ptp2`` is one prefill instance at TP 2 and one decode instance at TP 1 on 3
devices, ``disagg:2p1d+tp2`` three instances at TP 2 on 6 devices, and
``colocated:2+tp2`` two colocated instances at TP 2 on 4 devices. A size of 1 is the default;
``str(placement)`` writes the canonical spelling (sizes of 1 left out, a size shared by both
phases written once), so today's spellings read back unchanged.

Devices are taken in order, prefill instances first, then decode, each instance the next
``tp * pp`` devices (its ranks in rank order); a set with more devices than needed leaves
the rest unused. A CPU core group (``cpu:0-3``) is one device.

A TP size must suit the model (``check_tp``): it divides the attention heads, and divides
the KV heads or is a multiple of them (then each KV head is replicated on ``tp / kv_heads``
ranks, as vLLM does); a PP size must not exceed the layers.
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
    """One instance of a placement: ``tp * pp`` devices running one model copy with one
    scheduler.

    Attributes:
        role: ``colocated``, ``prefill`` or ``decode``.
        index: its number among the instances of its role (0-based).
        tp: tensor-parallel size (ranks that split each layer's heads), >= 1.
        pp: pipeline-parallel size (stages that split the layers), >= 1.
        devices: its ``tp * pp`` devices in rank order (rank = stage * tp + tp_rank), or
            ``()`` for a placement not bound to a device set.
    """

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
        """Its first device (rank 0, where its scheduler runs).

        Raises:
            ValueError: the placement is not bound to devices.
        """
        _check(bool(self.devices), f"instance {self.name} has no devices: bind the placement "
                                   "to a device set first (Placement.bind)")
        return self.devices[0]


@dataclass(frozen=True)
class Placement:
    """A parsed placement (see the module docstring for the spelling).

    Attributes:
        kind: ``colocated``, ``disagg`` or ``conditional``.
        chunked: False for ``colocated-nochunk`` (chunked prefill off), else True.
        instances: prefill instances then decode instances (or the colocated ones), each
            with its sizes and, once bound, its devices.
    """

    kind: str
    chunked: bool
    instances: tuple[Instance, ...]

    @classmethod
    def parse(cls, text: str) -> Placement:
        """Parse a placement spelling (module docstring).

        Raises:
            ValueError: anything else, a zero count or size, a size given twice, a per-phase
                size on a colocated placement; one line naming the text.
        """
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

    # ---- reading ---------------------------------------------------------------------------

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
        """``(tp, pp)`` of ``role``'s instances (every instance of a role has the same).

        Raises:
            ValueError: the placement has no instance of ``role``.
        """
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

    # ---- binding and checking --------------------------------------------------------------

    def bind(self, devices: tuple[str, ...]) -> Placement:
        """This placement with each instance's devices taken in order from ``devices``
        (``engine.config.parse_devices``' result).

        Raises:
            ValueError: the placement needs more devices than the set has.
        """
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
        """Refuse sizes the model cannot be split by (``check_tp`` for each role's TP; a PP
        larger than ``num_layers``).

        Raises:
            ValueError: one line naming the role, the size and the model's counts.
        """
        for role in self.roles:
            tp, pp = self.size_of(role)
            check_tp(tp, num_heads, num_kv_heads, f"{role} TP {tp}", model)
            _check(pp <= num_layers, f"{role} PP {pp} exceeds {model}'s {num_layers} layers")


def check_tp(tp: int, num_heads: int, num_kv_heads: int, what: str = "",
             model: str = "the model") -> None:
    """A TP size ``tp`` suits a model of ``num_heads`` attention heads and ``num_kv_heads``
    KV heads if it divides the attention heads and either divides the KV heads (each rank
    holds ``num_kv_heads / tp`` of them) or is a multiple of them (each KV head replicated on
    ``tp / num_kv_heads`` ranks): vLLM's rule (``QKVParallelLinear``).

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
