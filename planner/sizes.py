"""The per-phase sizes the planner searches and their profiles (no torch). ``ProfileSet``
holds one PP-1 profile per TP size and derives PP sizes (``pipelined``). A size is offered when
its TP suits the model and has a profile, its PP divides the layers (DistServe's
``get_model_possible_pp``) up to ``max_pp``, it fits the device (``engine.memory_fit``: weights
plus one ``max_model_len`` request's KV; else ``refused``), and no size on as many devices is
faster in both phases at a reference prefill and decode step (else ``dominated``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from engine.memory_fit import Geometry, check_fits
from engine.placement import Placement
from planner.latency import DeviceProfile, StepFeatures, TransferModel

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_PP = 4  # the default cap on PP sizes: deeper pipelines only add hand-overs here


def stage_link(profile: DeviceProfile) -> TransferModel:
    """The link between PP stages: the profile's KV link, else its first; free without any."""
    link = (profile.source or {}).get("link") or profile.notes.get("link")
    if link in profile.transfers:
        return profile.transfers[link]
    if profile.transfers:
        return next(iter(profile.transfers.values()))
    return TransferModel(0.0, float("inf"))


def pipelined(profile: DeviceProfile, geometry: Geometry, pp: int) -> DeviceProfile:
    """``profile`` (PP 1) at PP ``pp``: the fullest stage's weights and KV, ``hidden *
    itemsize`` activation bytes per token between stages; ValueError for a PP over the layers."""
    if pp == 1:
        return profile
    itemsize = _itemsize(profile)
    weights = geometry.device_params(profile.tp, pp, vocab_parallel(profile)) * itemsize
    return profile.with_pp(pp, geometry.kv_bytes_per_token(itemsize, profile.tp, pp),
                           weights if profile.weight_bytes is not None else None,
                           geometry.hidden * itemsize, stage_link(profile))


def vocab_parallel(profile: DeviceProfile) -> bool:
    """A silicon-database profile's instances split embedding and head, as its memory model."""
    return (profile.source or {}).get("kind") == "aiconfigurator"


def _itemsize(profile: DeviceProfile) -> int:
    if profile.dtype not in ITEMSIZE:
        raise ValueError(f"the profile's dtype {profile.dtype} has no known item size "
                         f"({', '.join(ITEMSIZE)})")
    return ITEMSIZE[profile.dtype]


def pp_sizes(num_layers: int, max_pp: int = MAX_PP) -> tuple[int, ...]:
    """The divisors of ``num_layers`` up to ``max_pp``, ascending."""
    return tuple(p for p in range(1, max(1, max_pp) + 1) if num_layers % p == 0)


@dataclass
class ProfileSet:
    """Profiles by ``(tp, pp)`` (module docstring). ``sizes``: the offered sizes, ascending by
    devices then TP; ``refused``: ``{(tp, pp): one-line reason}``; ``dominated``: ``{(tp, pp):
    the size that beats it}``."""

    profiles: dict[tuple[int, int], DeviceProfile]
    geometry: Geometry | None = None
    refused: dict[tuple[int, int], str] = field(default_factory=dict)
    dominated: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, tp_profiles: list[DeviceProfile], geometry: Geometry | None,
              num_devices: int, max_model_len: int, utilization: float = 0.9,
              max_pp: int = MAX_PP, reference_prompt: int = 512,
              reference_batch: int = 16, prune: bool = True) -> ProfileSet:
        """The sizes of at most ``num_devices`` devices from PP-1 profiles of distinct TP
        (without ``geometry``: no PP, no memory check; ``prune=False``: dominated sizes kept, as
        a deployment runs the size it is given); ValueError for profiles not a set."""
        if not tp_profiles:
            raise ValueError("the planner needs at least one device profile")
        seen: dict[int, DeviceProfile] = {}
        first = tp_profiles[0]
        for p in tp_profiles:
            if p.pp != 1:
                raise ValueError(f"give PP 1 profiles (one per TP): the planner derives PP "
                                 f"sizes itself, got a PP {p.pp} profile")
            if p.tp in seen:
                raise ValueError(f"two device profiles of TP {p.tp}: give one per TP size")
            if (p.model, p.device_name, p.dtype) != (first.model, first.device_name, first.dtype):
                raise ValueError(f"the device profiles must share one model and device: "
                                 f"{first.model} on {first.device_name} ({first.dtype}) vs "
                                 f"{p.model} on {p.device_name} ({p.dtype})")
            seen[p.tp] = p
        out = cls({}, geometry)
        pps = pp_sizes(geometry.num_layers, max_pp) if geometry else (1,)
        for tp in sorted(seen):
            for pp in pps:
                if tp * pp > num_devices:
                    continue
                try:
                    profile = pipelined(seen[tp], geometry, pp) if geometry else seen[tp]
                    if geometry is not None and profile.device_memory_bytes:
                        check_fits(geometry, _itemsize(profile), tp, pp,
                                   profile.device_memory_bytes, max_model_len, utilization,
                                   vocab_parallel(profile), what=f"{profile.model}",
                                   device=f"an {profile.device_name} GPU")
                except ValueError as err:
                    out.refused[tp, pp] = str(err)
                    continue
                out.profiles[tp, pp] = profile
        if prune:
            out.prune(reference_prompt, reference_batch)
        return out

    def prune(self, reference_prompt: int = 512, reference_batch: int = 16) -> None:
        """Move each size another on as many devices beats in both phases to ``dominated``."""
        def times(size: tuple[int, int]) -> tuple[float, float]:
            p = self.profiles[size]
            return (p.step_s(StepFeatures(reference_prompt, reference_prompt ** 2)),
                    p.step_s(StepFeatures(batch_size=reference_batch,
                                          sum_context=reference_batch * (reference_prompt + 1))))
        for size in sorted(self.profiles):
            mine = times(size)
            for other in sorted(self.profiles):
                theirs = times(other)
                if (other != size and other[0] * other[1] == size[0] * size[1]
                        and theirs[0] < mine[0] and theirs[1] < mine[1]):
                    self.dominated[size] = other
                    break
        for size in self.dominated:
            del self.profiles[size]

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self.profiles, key=lambda s: (s[0] * s[1], s[0])))

    def get(self, tp: int, pp: int) -> DeviceProfile:
        """The profile of size ``(tp, pp)``; ValueError naming why it is not offered."""
        if (tp, pp) in self.profiles:
            return self.profiles[tp, pp]
        why = self.refused.get((tp, pp))
        if why is None and (tp, pp) in self.dominated:
            why = f"TP {self.dominated[tp, pp][0]}, PP {self.dominated[tp, pp][1]} is faster in both phases"
        raise ValueError(f"no instance of TP {tp}, PP {pp}: {why or 'no profile of that TP given'}")

    @property
    def base(self) -> DeviceProfile:
        """The smallest offered size's profile; ValueError naming the refusals when none."""
        if not self.profiles:
            raise ValueError("no instance size fits: " + "; ".join(self.refused.values()))
        return self.profiles[self.sizes[0]]

    def of_role(self, placement: Placement, role: str) -> DeviceProfile:
        """The profile of ``role``'s instances (plan, map, validation and deployment alike)."""
        return self.get(*placement.size_of(role))

    def of_worker(self, placement: Placement, worker: str) -> DeviceProfile:
        """The profile of instance ``worker`` (``Instance.name``, e.g. ``decode-0``);
        ValueError for a name of no role of ``placement``."""
        role = worker.rsplit("-", 1)[0]
        if role not in placement.roles:
            raise ValueError(f"placement {placement} has no instance {worker!r}")
        return self.of_role(placement, role)

    def scaled(self, factor: float) -> ProfileSet:
        return ProfileSet({s: p.scaled(factor) for s, p in self.profiles.items()}, self.geometry,
                          dict(self.refused), dict(self.dominated))

    def refusal_lines(self) -> list[str]:
        lines = [f"TP {tp}, PP {pp}: refused: {why}" for (tp, pp), why in sorted(self.refused.items())]
        lines += [f"TP {tp}, PP {pp}: pruned: TP {o[0]}, PP {o[1]} on as many devices is faster "
                  "in both phases" for (tp, pp), o in sorted(self.dominated.items())]
        return lines


@dataclass(frozen=True)
class InstanceProfile(DeviceProfile):
    """A profile as one emulated instance runs it: its step times, and the KV budget of all its
    ``tp * pp`` devices (``kv_budget_bytes``: the profile's per-device budget x
    ``kv_bytes_per_token / kv_bytes_per_device_token``, so that the whole instance's KV at
    full geometry holds as many tokens as each device's slice does; the simulator's rule)."""

    @classmethod
    def of(cls, profile: DeviceProfile) -> InstanceProfile:
        return cls(**{f.name: getattr(profile, f.name) for f in fields(DeviceProfile)})

    def kv_budget_bytes(self, config) -> int:
        per_device = super().kv_budget_bytes(config)
        return per_device * self.kv_bytes_per_token // self.kv_bytes_per_device_token


def geometry_of(profile: DeviceProfile, model_dir: str | None = None) -> Geometry | None:
    """The geometry in ``model_dir``'s, the profile's source's or model's config.json; None."""
    for where in (model_dir, (profile.source or {}).get("model_config"), profile.model):
        if where and (Path(where) / "config.json").is_file():
            return Geometry.from_config(json.loads((Path(where) / "config.json").read_text()))
    return None
