"""Step and transfer latency models fitted on one device, and the device profile file (no torch).
All times are seconds.

``fit_step_models`` fits ``pdlab profile``'s prefill, decode and mixed steps by least squares on
relative error (as DistServe's simulator: short and long steps weigh alike), slopes non-negative:
  prefill ``t = a + b·Σn + c·Σn(k+n)`` (n new prompt tokens over k cached; for whole prompts
          DistServe's ``a + b·Σl + c·Σl²``);
  decode  ``t = a + b·B + c·Σctx`` (B decodes, ctx = KV tokens each attends to);
  mixed   ``t = a_mix + (prefill terms) + (decode terms)``, only the intercept refitted.
``fit_transfer`` fits ``t = latency_s + bytes / bandwidth_bytes_s`` per transport. A profile can
also come from NVIDIA's GPU database (``planner.silicon``) with the links' models (``LINKS``).
``DeviceProfile.step_s`` is what the simulator asks for every step.

A profile is one instance of TP ``tp``, PP ``pp``; its fits are the TP instance's steps ``t``.
PP as DistServe's simulator (``simdistserve/estimators/time_estimator.py``: a stage takes
``t / pp`` plus an overhead; a batch crosses the stages in turn), one batch in flight (one
scheduler; stages idle ``(pp - 1) / pp``): ``t + (pp - 1) * stage_link.seconds(tokens *
stage_bytes_per_token)``, ``tokens`` = prefill tokens + decodes. PP buys memory, not speed."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig, kv_budget_bytes_for
from engine.scheduler import StepFeatures  # noqa: F401 - counted by ScheduledBatch.step_features

PROFILE_VERSION = 1
PREFILL_FEATURES = ("1", "prefill_tokens", "prefill_attention")
DECODE_FEATURES = ("1", "batch_size", "sum_context")


@dataclass(frozen=True)
class Fit:
    """A least-squares fit ``y ≈ coef · x`` over ``features`` (``"1"`` = intercept); ``coef`` in
    seconds per unit; ``r2`` on seconds (1.0 for a constant y fitted exactly); ``*_rel_err``:
    of |fit - y| / y over the points."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float
    mean_rel_err: float
    max_rel_err: float
    num_points: int

    def predict(self, x: Sequence[float]) -> float:
        return float(sum(c * v for c, v in zip(self.coef, x)))

    def to_dict(self) -> dict:
        return {"features": list(self.features), "coef": list(self.coef), "r2": self.r2,
                "mean_rel_err": self.mean_rel_err, "max_rel_err": self.max_rel_err,
                "num_points": self.num_points}

    @classmethod
    def from_dict(cls, d: dict) -> Fit:
        return cls(tuple(d["features"]), tuple(float(c) for c in d["coef"]), float(d["r2"]),
                   float(d["mean_rel_err"]), float(d["max_rel_err"]), int(d["num_points"]))


def _stats(features: Sequence[str], coef: np.ndarray, x: np.ndarray, y: np.ndarray) -> Fit:
    pred = x @ coef
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = (1.0 if ss_res <= 1e-30 else 0.0) if ss_tot == 0.0 else 1.0 - ss_res / ss_tot
    rel = np.abs(pred - y) / y
    return Fit(tuple(features), tuple(float(c) for c in coef), float(r2), float(rel.mean()),
               float(rel.max()), int(y.size))


def fit_least_squares(features: Sequence[str], x: Sequence[Sequence[float]], y: Sequence[float],
                      relative: bool = True) -> Fit:
    """Least squares ``y ≈ x · coef`` (numpy ``lstsq``) with every coefficient but the intercept
    kept >= 0: a slope fitted negative is set to 0 and the rest refitted (an active set), so more
    work never predicts a shorter step. ``x``: ``[num_points, num_features]``; ``y``: seconds,
    > 0; ``relative``: minimise Σ((fit - y)/y)².

    Raises:
        ValueError: shapes disagree, fewer points than features, or a y that is not > 0."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.ndim != 2 or xs.shape != (ys.size, len(features)):
        raise ValueError(f"x must be [{ys.size}, {len(features)}], got {list(xs.shape)}")
    if ys.size < len(features):
        raise ValueError(f"fitting {len(features)} coefficients needs >= {len(features)} "
                         f"points, got {ys.size}")
    if not np.all(ys > 0):
        raise ValueError("every measured time must be > 0 seconds")
    weight = 1.0 / ys if relative else np.ones_like(ys)
    active = list(range(len(features)))
    coef = np.zeros(len(features))
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active] * weight[:, None], ys * weight, rcond=None)
        negative = [j for j, c in zip(active, sol) if c < 0 and features[j] != "1"]
        if not negative:
            coef[:] = 0.0
            coef[active] = sol
            break
        worst = min(negative, key=lambda j: sol[active.index(j)])
        active.remove(worst)
    return _stats(features, coef, xs, ys)


def fit_step_models(prefill: Sequence[tuple[StepFeatures, float]],
                    decode: Sequence[tuple[StepFeatures, float]],
                    mixed: Sequence[tuple[StepFeatures, float]] = ()) -> tuple[Fit, Fit, Fit]:
    """The step models (module docstring) from ``(features, seconds)`` pairs. Without mixed points
    the mixed intercept is the larger intercept (one forward, one fixed cost); with fewer points
    than three, a model's last terms stay 0.

    Raises:
        ValueError: too few points (see ``fit_least_squares``)."""
    pre = _fit_first(PREFILL_FEATURES, [_prefill_x(f) for f, _ in prefill], [t for _, t in prefill])
    dec = _fit_first(DECODE_FEATURES, [_decode_x(f) for f, _ in decode], [t for _, t in decode])
    if mixed:
        # only the intercept is free: y - slopes·x = a, least squares on relative error
        ys = np.array([t for _, t in mixed], dtype=float)
        rest = np.array([_slopes(pre, dec, f) for f, _ in mixed])
        w = 1.0 / ys
        a = float(np.sum(w * w * (ys - rest)) / np.sum(w * w))
        x = np.column_stack([np.ones_like(ys), rest])
        mix = _stats(("1", "slopes"), np.array([a, 1.0]), x, ys)
    else:
        mix = Fit(("1", "slopes"), (max(pre.coef[0], dec.coef[0]), 1.0), math.nan, math.nan,
                  math.nan, 0)
    return pre, dec, mix


def _fit_first(features: Sequence[str], x: list[list[float]], y: list[float]) -> Fit:
    """``fit_least_squares`` on as many leading features as points, padded with zero coefficients."""
    k = max(1, min(len(features), len(y)))
    fit = fit_least_squares(features[:k], [row[:k] for row in x], y)
    pad = (0.0,) * (len(features) - k)
    return dataclasses.replace(fit, features=tuple(features), coef=fit.coef + pad)


def _prefill_x(f: StepFeatures) -> list[float]:
    return [1.0, f.prefill_tokens, f.prefill_attention]


def _decode_x(f: StepFeatures) -> list[float]:
    return [1.0, f.batch_size, f.sum_context]


def _slopes(pre: Fit, dec: Fit, f: StepFeatures) -> float:
    return (pre.coef[1] * f.prefill_tokens + pre.coef[2] * f.prefill_attention
            + dec.coef[1] * f.batch_size + dec.coef[2] * f.sum_context)


@dataclass(frozen=True)
class TransferModel:
    """KV transfer time ``latency_s + num_bytes / bandwidth_bytes_s`` (put + get together);
    ``bandwidth_bytes_s`` > 0 (``inf`` = free bytes); ``put_share``: the share spent in ``put`` on
    the prefill worker (it shows in TTFT), the rest in the decode worker's ``get``."""

    latency_s: float
    bandwidth_bytes_s: float
    put_share: float = 0.5
    fit: Fit | None = None

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"transfer latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not self.bandwidth_bytes_s > 0:
            raise ValueError(f"transfer bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_s!r}")
        if not 0.0 <= self.put_share <= 1.0:
            raise ValueError(f"put_share must be in [0, 1], got {self.put_share!r}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_s

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bandwidth_bytes_s": self.bandwidth_bytes_s,
                "put_share": self.put_share, "fit": self.fit.to_dict() if self.fit else None}

    @classmethod
    def from_dict(cls, d: dict) -> TransferModel:
        return cls(float(d["latency_s"]), float(d["bandwidth_bytes_s"]),
                   float(d.get("put_share", 0.5)),
                   Fit.from_dict(d["fit"]) if d.get("fit") else None)


def fit_transfer(num_bytes: Sequence[int], seconds: Sequence[float]) -> TransferModel:
    """``seconds ≈ latency + bytes / bandwidth``, least squares on relative error, both >= 0.

    Raises:
        ValueError: fewer than 2 points, or times not > 0."""
    fit = fit_least_squares(("1", "bytes"), [[1.0, b] for b in num_bytes], seconds)
    slope = fit.coef[1]
    return TransferModel(max(fit.coef[0], 0.0), 1.0 / slope if slope > 0 else math.inf, fit=fit)


@dataclass(frozen=True)
class Link:
    """A link KV crosses between a prefill and a decode GPU, one direction: ``latency_s`` (s) +
    bytes / ``bandwidth_bytes_s``. ``bandwidth_key``, ``latency_key``: keys of an AIConfigurator
    system spec's ``node`` section whose figures replace them there (None: the same everywhere)."""

    name: str
    latency_s: float
    bandwidth_bytes_s: float
    bandwidth_key: str | None
    latency_key: str | None
    source: str


# One direction each; bandwidths nominal (nccl-tests reach ~80-95%), latencies a GPU-to-GPU
# transfer's fixed cost. nvlink: NVLink 4 (H100/H200 SXM) 900 GB/s both ways = 450 GB/s one way,
# NVLink 5 (B200/GB200) 900 GB/s one way (NVIDIA datasheets); AIConfigurator's node.intra_node_bw,
# and node.p2p_latency = 10 us (aiconfigurator_core/systems/h100_sxm.yaml). pcie: PCIe 5.0 x16 =
# 63 GB/s one way, 64 as node.pcie_bw rounds it (A100: 4.0, 32); 10 us. ib400: 400 Gb/s NDR
# InfiniBand = 50 GB/s (node.inter_node_bw); 10 us. tcp25: 25 Gb/s = 3.125 GB/s; 50 us assumed.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink", 10e-6, 450e9, "intra_node_bw", "p2p_latency",
         "NVLink 4 (H100/H200 SXM); the system spec's node.intra_node_bw, node.p2p_latency"),
    Link("pcie", 10e-6, 64e9, "pcie_bw", "p2p_latency",
         "PCIe 5.0 x16; the system spec's node.pcie_bw, node.p2p_latency"),
    Link("ib400", 10e-6, 50e9, None, "p2p_latency",
         "400 Gb/s NDR InfiniBand, 1:1 per GPU; the system spec's node.p2p_latency"),
    Link("tcp25", 50e-6, 25e9 / 8, None, None, "25 Gb/s Ethernet line rate; 50 us assumed"),
)}


def link_transfer(name: str, node: dict | None = None) -> TransferModel:
    """The model of link ``name`` (``LINKS``), with ``node``'s figures where it has them (an
    AIConfigurator spec's ``node``: ``p2p_latency`` s, bandwidths bytes/s); ``put_share`` 0.5.

    Raises:
        ValueError: an unknown link, naming the known ones; ``nvlink`` on a system whose
            spec shows none (its intra-node rate no higher than its PCIe rate)."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}: use one of {', '.join(LINKS)}")
    link, node = LINKS[name], node or {}
    if name == "nvlink" and "intra_node_bw" in node and \
            float(node["intra_node_bw"]) <= float(node.get("pcie_bw", 0.0)):
        raise ValueError("this system has no NVLink: its GPUs talk over PCIe (the system "
                         f"spec's node.intra_node_bw {float(node['intra_node_bw']) / 1e9:g} GB/s"
                         " is its PCIe rate); use --link pcie")
    bandwidth = float(node.get(link.bandwidth_key, link.bandwidth_bytes_s))
    latency = float(node.get(link.latency_key, link.latency_s))
    return TransferModel(latency, bandwidth)


@dataclass(frozen=True)
class DeviceProfile:
    """The fitted models of one model on one device, and what they were measured on.

    ``kv_bytes_per_token``: ``KVSpec.bytes_per_token``; ``max_prefill_tokens``: the longest
    prompt measured (None: unknown); ``device_memory_bytes``, ``weight_bytes``: what
    ``kv_budget_bytes`` needs on CUDA (None on CPU); ``source``: where step times came from when
    not measured here, e.g. ``{"kind": "aiconfigurator", "system", "backend", ...}``."""

    model: str
    dtype: str
    device_kind: str
    device_name: str
    num_threads: int
    kv_bytes_per_token: int
    prefill: Fit
    decode: Fit
    mixed: Fit
    transfers: dict[str, TransferModel] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    max_prefill_tokens: int | None = None
    device_memory_bytes: int | None = None
    weight_bytes: int | None = None
    source: dict | None = None
    tp: int = 1
    pp: int = 1
    device_kv_bytes_per_token: int | None = None
    stage_bytes_per_token: int = 0
    stage_link: TransferModel | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"a profile's TP and PP must be >= 1, got tp {self.tp}, pp {self.pp}")
        if self.pp > 1 and self.stage_link is None:
            raise ValueError(f"a PP {self.pp} profile needs the link between its stages "
                             "(stage_link)")

    @property
    def size(self) -> tuple[int, int]:
        return self.tp, self.pp

    @property
    def kv_bytes_per_device_token(self) -> int:
        return self.device_kv_bytes_per_token or self.kv_bytes_per_token

    def with_pp(self, pp: int, device_kv_bytes_per_token: int, weight_bytes: int | None,
                stage_bytes_per_token: int, stage_link: TransferModel) -> DeviceProfile:
        """This PP-1 profile at PP ``pp``; ValueError when it is already pipelined."""
        if self.pp != 1:
            raise ValueError(f"the profile is already at PP {self.pp}: derive PP sizes from "
                             "a PP 1 profile")
        return dataclasses.replace(self, pp=pp, device_kv_bytes_per_token=device_kv_bytes_per_token,
                                   weight_bytes=weight_bytes, stage_bytes_per_token=stage_bytes_per_token,
                                   stage_link=stage_link)

    def kv_budget_bytes(self, config: EngineConfig) -> int:
        """KV budget (bytes) of one engine of ``config`` here, by ``engine.config.
        kv_budget_bytes_for``: on CUDA without ``kv_cache_memory_gb``, ``gpu_memory_utilization *
        device_memory_bytes - weight_bytes`` (a real engine may get less: CUDA context).

        Raises:
            ValueError: a CUDA profile without ``device_memory_bytes`` or ``weight_bytes`` while
                ``config`` sets no ``kv_cache_memory_gb``."""
        if (self.device_kind == "cuda" and config.kv_cache_memory_gb is None
                and (self.device_memory_bytes is None or self.weight_bytes is None)):
            raise ValueError(f"the device profile ({self.device_kind}, {self.device_name}) "
                             "records no device_memory_bytes / weight_bytes, which the KV "
                             "budget under --gpu-memory-utilization needs: profile again on "
                             "the GPU (`pdlab profile`) or pass --kv-cache-memory-gb")
        return kv_budget_bytes_for(config, self.device_kind, self.device_memory_bytes,
                                   self.weight_bytes)

    def step_s(self, f: StepFeatures) -> float:
        """Predicted step seconds: the prefill, decode or mixed model by the mix; 0 for nothing."""
        return self.step_time()(f.prefill_tokens, f.prefill_attention, f.batch_size, f.sum_context)

    def step_time(self):
        """``step_s`` of ``(prefill_tokens, prefill_attention, batch_size, sum_context)`` with the
        coefficients bound once (the simulator calls it per step)."""
        pa, pb, pc = self.prefill.coef
        da, db, dc = self.decode.coef
        ma = self.mixed.coef[0]

        def step_s(n_pre: int, q_pre: int, num_decode: int, sum_ctx: int) -> float:
            if num_decode == 0:
                return pa + pb * n_pre + pc * q_pre if n_pre else 0.0
            decode = db * num_decode + dc * sum_ctx
            return da + decode if n_pre == 0 else ma + pb * n_pre + pc * q_pre + decode
        if self.pp == 1:
            return step_s
        hops, link, per_token = self.pp - 1, self.stage_link, self.stage_bytes_per_token
        per_token_s = per_token / link.bandwidth_bytes_s

        def pipelined_s(n_pre: int, q_pre: int, num_decode: int, sum_ctx: int) -> float:
            t = step_s(n_pre, q_pre, num_decode, sum_ctx)
            if t == 0.0:
                return 0.0
            return t + hops * (link.latency_s + (n_pre + num_decode) * per_token_s)
        return pipelined_s

    def transfer(self, transport: str) -> TransferModel:
        """Raises ValueError when the profile has none, naming those it has and how to measure."""
        if transport not in self.transfers:
            raise ValueError(f"the device profile has no transfer model for transport "
                             f"{transport!r} (it has {sorted(self.transfers) or 'none'}): run "
                             f"`pdlab profile --transports {transport}` or pass "
                             "--transfer-latency-s and --transfer-bandwidth-gbps")
        return self.transfers[transport]

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("model", "dtype", "device_kind", "device_name",
                                            "num_threads", "kv_bytes_per_token", "notes")}
        return {"version": PROFILE_VERSION, **d, "prefill": self.prefill.to_dict(),
                "decode": self.decode.to_dict(), "mixed": self.mixed.to_dict(),
                "transfers": {k: v.to_dict() for k, v in self.transfers.items()},
                **{k: getattr(self, k) for k in ("max_prefill_tokens", "device_memory_bytes",
                                                 "weight_bytes") if getattr(self, k) is not None},
                **({} if self.source is None else {"source": self.source}),
                **({} if self.size == (1, 1) else {"parallel": {
                    "tp": self.tp, "pp": self.pp,
                    "device_kv_bytes_per_token": self.device_kv_bytes_per_token,
                    "stage_bytes_per_token": self.stage_bytes_per_token,
                    "stage_link": self.stage_link.to_dict() if self.stage_link else None}})}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict) -> DeviceProfile:
        """Raises ValueError naming a missing key or another version."""
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"device profile version must be {PROFILE_VERSION}, "
                             f"got {d.get('version')!r}")
        try:
            return cls(str(d["model"]), str(d["dtype"]), str(d["device_kind"]),
                       str(d["device_name"]), int(d["num_threads"]), int(d["kv_bytes_per_token"]),
                       Fit.from_dict(d["prefill"]), Fit.from_dict(d["decode"]),
                       Fit.from_dict(d["mixed"]),
                       {k: TransferModel.from_dict(v) for k, v in d.get("transfers", {}).items()},
                       dict(d.get("notes", {})),
                       *(None if d.get(k) is None else int(d[k])
                         for k in ("max_prefill_tokens", "device_memory_bytes", "weight_bytes")),
                       None if d.get("source") is None else dict(d["source"]),
                       **_parallel_from_dict(d.get("parallel")))
        except KeyError as err:
            raise ValueError(f"not a device profile: key {err} missing") from None

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """Raises ValueError: not JSON, or not a profile (the message names the file)."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read device profile {path}: {err}") from None
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from None

    def scaled(self, factor: float) -> DeviceProfile:
        """Every step coefficient times ``factor`` (transfers and fit statistics unchanged);
        ``notes["step_scale"]`` holds the product applied.

        Raises:
            ValueError: ``factor`` is not a finite number > 0."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"step scale must be a finite number > 0, got {factor!r}")
        if factor == 1.0:
            return self

        def times(fit: Fit, n: int) -> Fit:  # the mixed fit's "slopes" weight stays 1
            return dataclasses.replace(fit, coef=tuple(c * factor if i < n else c
                                                       for i, c in enumerate(fit.coef)))
        return dataclasses.replace(
            self, prefill=times(self.prefill, 3), decode=times(self.decode, 3),
            mixed=times(self.mixed, 1),
            notes={**self.notes, "step_scale": self.notes.get("step_scale", 1.0) * factor})

    def replace(self, **changes) -> DeviceProfile:
        return dataclasses.replace(self, **changes)


def _parallel_from_dict(d: dict | None) -> dict:
    if not d:
        return {}
    link = d.get("stage_link")
    kv = d.get("device_kv_bytes_per_token")
    return {"tp": int(d["tp"]), "pp": int(d["pp"]),
            "device_kv_bytes_per_token": None if kv is None else int(kv),
            "stage_bytes_per_token": int(d.get("stage_bytes_per_token", 0)),
            "stage_link": TransferModel.from_dict(link) if link else None}


def step_correction(steps: Sequence[dict], profile: DeviceProfile) -> float:
    """Median of measured / modelled seconds over worker steps (``duration_s, num_prefill_tokens,
    num_decode_tokens``); steps from ``planner.diagnose.step_features`` are modelled on their
    batch's features (disagreeing ones skipped), bare ones on token counts (a lower bound). NaN
    without steps."""
    step_s = profile.step_time()
    ratios = []
    for st in steps:
        if "sum_context" in st:
            if not st.get("rebuilt", True):
                continue
            modelled = step_s(int(st["prefill_tokens"]), int(st["prefill_attention"]),
                              int(st["batch_size"]), int(st["sum_context"]))
        else:
            modelled = step_s(int(st["num_prefill_tokens"]), 0, int(st["num_decode_tokens"]), 0)
        if modelled > 0 and st["duration_s"] > 0:
            ratios.append(st["duration_s"] / modelled)
    return float(np.median(ratios)) if ratios else math.nan


def summary_lines(profile: DeviceProfile) -> list[str]:
    """One line per model: its formula, coefficients, R² and relative errors."""
    def stats(f: Fit) -> str:
        return (f"R² {f.r2:.4f}, rel. error mean {100 * f.mean_rel_err:.1f}% max "
                f"{100 * f.max_rel_err:.1f}%, {f.num_points} points")

    p, d, m = profile.prefill.coef, profile.decode.coef, profile.mixed
    lines = [f"prefill step_s = {p[0]:.4g} + {p[1]:.4g}·Σn + {p[2]:.4g}·Σn(k+n)   ({stats(profile.prefill)})",
             f"decode  step_s = {d[0]:.4g} + {d[1]:.4g}·B + {d[2]:.4g}·Σctx   ({stats(profile.decode)})",
             f"mixed   step_s = {m.coef[0]:.4g} + prefill and decode slopes   "
             f"({stats(m) if m.num_points else 'no mixed points: intercept = the larger one'})"]
    if profile.source is not None:
        src = profile.source
        lines.append(f"source: {src.get('package', src.get('kind'))} database "
                     f"{src.get('system')}/{src.get('backend')} {src.get('database_version')} "
                     "(no step ran on this machine)")
    if profile.size != (1, 1):
        lines.append(f"instance: TP {profile.tp}, PP {profile.pp}"
                     + (f"; each step plus {profile.pp - 1} stage hand-overs of "
                        f"{profile.stage_bytes_per_token} bytes/token" if profile.pp > 1 else ""))
    if profile.notes.get("step_scale", 1.0) != 1.0:
        lines.append(f"step times above scaled x{profile.notes['step_scale']:.4g} (--step-scale)")
    for name, t in profile.transfers.items():
        fit = f" ({stats(t.fit)})" if t.fit else ""
        lines.append(f"transfer {name}: {t.latency_s:.4g} s + bytes / {t.bandwidth_bytes_s / 1e9:.4g} "
                     f"GB/s{fit}")
    return lines
