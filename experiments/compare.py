"""``pdlab run`` and ``pdlab compare``: placements x arrival rates on one workload.

An experiment:

1. Build one workload per seed (ShareGPT, HumanEval or synthetic; seeds ``seed``,
   ``seed + 1``, ... for ``seeds`` repeats) with the model's tokenizer, and check that every
   request fits the model's context (clipped or refused here, with one message, before
   anything starts). The same requests and arrival seeds go to every placement.
2. For each placement: deploy it on the device set once (Ray actors), warm it up with two
   discarded requests, then for each rate and each seed replay that seed's workload
   open-loop (arrivals at their Poisson/Gamma times) through the router, collecting request
   records, worker step records and KV transfer records of that run only.
3. Derive the metrics (``engine.metrics`` via ``experiments.analysis``: means over seeds with
   95% bootstrap intervals), print the side-by-side table and write the results directory:
   requests.jsonl (first line: everything needed to rerun), summary.csv (intervals),
   summary_seeds.csv (one row per seed), goodput.csv, steps.csv and transfers.csv (every
   row tagged placement, rate, seed), report.md and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig,
                           TransferConfig, check_fields, parse_devices)
from engine import metrics
from engine.metrics import SLO, RequestRecord
from engine.model import TINY_NAMES, load_tokenizer, model_context_len, tiny_llama_config
from engine.request import Request, SamplingParams
from experiments import analysis, hindsight, plots, report, workloads
from experiments.placement import Deployment, worker_layout

DATASETS = ("sharegpt", "humaneval", "synthetic")
LENGTHS = r"\d+(-\d+)?"  # synthetic lengths: N or lo-hi tokens


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay: dataset, size, lengths, and the arrival process (DESIGN §6).

    Attributes:
        dataset: ``sharegpt``, ``humaneval`` or ``synthetic``.
        num_requests: requests per (placement, rate, seed) run.
        seed: the first workload and arrival seed (the same for every placement).
        seeds: repeats of every (placement, rate): seeds ``seed .. seed + seeds - 1``, each
            drawing its own requests and arrival times.
        arrival: ``poisson``, ``gamma`` or ``burst``; burstiness: Gamma shape (1 = Poisson).
        min_prompt_len, max_prompt_len: ShareGPT prompt-length filter in tokens (the default
            keeps prompts long enough that a prefill visibly stalls colocated decodes).
        max_output_len: ShareGPT/HumanEval output cap in tokens.
        calibrate: pick the rates from a short calibration (``calibrated_rates``) instead
            of the given ones.
        prompt_len, output_len: synthetic lengths, ``N`` or ``lo-hi`` (uniform).
    """

    dataset: str = field(default="sharegpt", metadata={"choices": DATASETS})
    num_requests: int = field(default=24, metadata={"help": "requests per rate", "min": 1})
    seed: int = field(default=0, metadata={"help": "workload and arrival seed", "min": 0})
    seeds: int = field(default=2, metadata={
        "help": "repeats per (placement, rate), seeds seed, seed+1, ...; the summary reports "
                "means and 95%% bootstrap intervals over them", "min": 1})
    arrival: str = field(default="poisson", metadata={"choices": workloads.PROCESSES})
    burstiness: float = field(default=1.0, metadata={"help": "Gamma shape; 1 = Poisson", "gt": 0})
    min_prompt_len: int = field(default=128, metadata={"help": "sharegpt: shortest prompt kept",
                                                       "min": 1})
    max_prompt_len: int = field(default=1024, metadata={"help": "sharegpt: longest prompt kept",
                                                        "min": 1})
    max_output_len: int = field(default=48, metadata={
        "help": "sharegpt/humaneval: output length cap (tokens)", "min": 1})
    calibrate: bool = field(default=False, metadata={
        "help": "replace --rates by a ladder around the capacity measured on the first "
                "placement (a burst of the seed's requests): 0.5x, 1.5x and 4x of it; and "
                "loosen an SLO that even a lone request misses on this machine "
                "(to 4x its TTFT, 2x its TPOT)"})
    prompt_len: str = field(default="32-512", metadata={
        "help": "synthetic only: N or lo-hi tokens", "pattern": LENGTHS, "hint": "N or lo-hi"})
    output_len: str = field(default="16-64", metadata={
        "help": "synthetic only: N or lo-hi tokens", "pattern": LENGTHS, "hint": "N or lo-hi"})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_prompt_len < self.min_prompt_len:
            raise ValueError(f"max_prompt_len must be >= min_prompt_len ({self.min_prompt_len}), "
                             f"got {self.max_prompt_len}")
        for name in ("prompt_len", "output_len"):
            lo, hi = _bounds(getattr(self, name))
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be N or lo-hi with 1 <= lo <= hi, "
                                 f"got {getattr(self, name)!r}")

    def max_request_len(self) -> int | None:
        """The longest prompt + output this workload can ask for (None: humaneval, unknown)."""
        if self.dataset == "synthetic":
            return _bounds(self.prompt_len)[1] + _bounds(self.output_len)[1]
        if self.dataset == "sharegpt":
            return self.max_prompt_len + self.max_output_len
        return None

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def options(self) -> dict:
        """The options that apply to this dataset and arrival process (for the config row)."""
        keys = ["dataset", "num_requests", "seed", "seeds", "arrival", "calibrate"]
        keys += ["burstiness"] if self.arrival == "gamma" else []
        keys += {"sharegpt": ["min_prompt_len", "max_prompt_len", "max_output_len"],
                 "humaneval": ["max_output_len"],
                 "synthetic": ["prompt_len", "output_len"]}[self.dataset]
        return {k: getattr(self, k) for k in keys}


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _length_range(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


def context_len(model: ModelConfig, engine: EngineConfig) -> int:
    """Tokens one request may use (prompt + output), known before any model loads: the
    engine's ``max_model_len``, capped by the model's context where a config file tells it
    (``engine.model.model_context_len``; otherwise the workers' own limit is checked once
    they are deployed)."""
    model_len = model_context_len(model)
    return engine.max_model_len if model_len is None else min(engine.max_model_len, model_len)


def build_workload(spec: WorkloadSpec, model: ModelConfig, seed: int | None = None,
                   max_len: int | None = None) -> list[workloads.WorkloadRequest]:
    """The requests of ``spec`` drawn with ``seed`` (default ``spec.seed``), each fitting
    ``max_len`` tokens (prompt + output) when given: ShareGPT and HumanEval outputs are
    clipped to fit (see ``fit_workload``); synthetic lengths are refused up front. Arrival
    times are set per rate later.

    Raises:
        ValueError: a synthetic length range or a prompt that cannot fit ``max_len``.
    """
    seed = spec.seed if seed is None else seed
    if spec.dataset == "synthetic":
        prompt, output = _length_range(spec.prompt_len), _length_range(spec.output_len)
        if max_len is not None:
            check_synthetic_fits(prompt, output, max_len, model.model)
        vocab = tiny_llama_config().vocab_size if model.model in TINY_NAMES else 49152
        return workloads.synthetic(spec.num_requests, seed, prompt, output, vocab_size=vocab,
                                   token_range=(3, vocab))
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model.model} has no tokenizer: use --dataset synthetic")
    if spec.dataset == "sharegpt":
        return workloads.sharegpt(tokenizer, spec.num_requests, seed,
                                  min_prompt_len=spec.min_prompt_len,
                                  max_prompt_len=min(spec.max_prompt_len, max_len - 1)
                                  if max_len else spec.max_prompt_len,
                                  max_output_len=spec.max_output_len, max_total_len=max_len)
    items = workloads.humaneval(tokenizer, spec.num_requests, seed,
                                max_output_len=spec.max_output_len)
    return fit_workload(items, max_len, model.model) if max_len else items


def check_synthetic_fits(prompt: int | tuple[int, int], output: int | tuple[int, int],
                         max_len: int, model_name: str) -> None:
    """Refuse synthetic lengths whose longest prompt + output exceeds ``max_len`` tokens.

    Raises:
        ValueError: naming the options, the model's context and lengths that would fit.
    """
    p_hi = prompt[1] if isinstance(prompt, tuple) else prompt
    o_hi = output[1] if isinstance(output, tuple) else output
    if p_hi + o_hi > max_len:
        raise ValueError(
            f"prompt_len up to {p_hi} + output_len up to {o_hi} = {p_hi + o_hi} tokens does not "
            f"fit {model_name}'s context of {max_len} tokens (max_model_len); choose e.g. "
            f"--prompt-len 8-{max(1, max_len - o_hi)} or a shorter --output-len")


def fit_workload(items: list[workloads.WorkloadRequest], max_len: int, model_name: str
                 ) -> list[workloads.WorkloadRequest]:
    """Clip each output so prompt + output fits ``max_len`` tokens; prints one line saying
    how many were clipped.

    Raises:
        ValueError: a prompt alone leaves no room for one output token.
    """
    too_long = [it for it in items if it.num_prompt_tokens >= max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} prompt(s) of up to "
                         f"{max(it.num_prompt_tokens for it in too_long)} tokens do not fit "
                         f"{model_name}'s context of {max_len} tokens (max_model_len)")
    out = [dataclasses.replace(it, output_len=min(it.output_len, max_len - it.num_prompt_tokens))
           for it in items]
    clipped = sum(a.output_len != b.output_len for a, b in zip(items, out))
    if clipped:
        print(f"pdlab: clipped the output of {clipped} request(s) to fit {model_name}'s "
              f"context of {max_len} tokens", file=sys.stderr)
    return out


def router_workload(items: list[workloads.WorkloadRequest], rate: float, spec: WorkloadSpec,
                    tag: str, seed: int | None = None) -> list[tuple[Request, float]]:
    """Requests with arrival offsets at ``rate`` req/s drawn with ``seed`` (default
    ``spec.seed``); ``ignore_eos`` so each produces exactly its reference output length."""
    seed = spec.seed if seed is None else seed
    timed = workloads.with_arrivals(items, rate, seed, spec.arrival, spec.burstiness)
    return [(Request(f"{tag}-{i}", item.prompt_token_ids,
                     SamplingParams(max_tokens=item.output_len, ignore_eos=True)), item.arrival_s)
            for i, item in enumerate(timed)]


def default_placements(num_devices: int) -> list[str]:
    """``colocated:N`` and every ``disagg:xPyD`` with x + y = N."""
    return [f"colocated:{num_devices}"] + [f"disagg:{x}p{num_devices - x}d"
                                           for x in range(1, num_devices)]


@dataclass
class RunResult:
    """One (placement, rate, seed) run: its records, and the step and transfer records of
    that run only."""

    placement: str
    rate: float
    records: list[RequestRecord]
    steps: list[dict]
    transfers: list[dict]
    duration_s: float
    seed: int = 0


CALIBRATION_FACTORS = (0.5, 1.5, 4.0)  # x the measured capacity: under, near, past saturation


def calibrated_rates(capacity_req_s: float, factors=CALIBRATION_FACTORS) -> list[float]:
    """The rate ladder ``factor * capacity`` (req/s), each rounded to 2 significant digits.

    The capacity is the completed-request throughput of a burst (every request at t = 0) on
    the deployed placement: the rate it can sustain. Below it queues stay short, above it
    they grow with every request, so SLO attainment bends inside the ladder on any machine.

    Raises:
        ValueError: capacity not > 0.
    """
    if not capacity_req_s > 0:
        raise ValueError(f"calibration measured no capacity ({capacity_req_s!r} req/s)")
    return [float(f"{f * capacity_req_s:.2g}") for f in factors]


SLO_TTFT_SCALE, SLO_TPOT_SCALE = 4.0, 2.0  # x a lone request's latency: the tightest SLO used


def calibrated_slo(slo: SLO, lone_ttft_s: float, lone_tpot_s: float | None) -> SLO:
    """The SLO a calibrated run judges by: each target no tighter than ``SLO_TTFT_SCALE`` x
    (``SLO_TPOT_SCALE`` x) what a lone request achieved on this machine, else as given.

    DistServe states SLOs relative to the model's unloaded latency on the hardware (its "SLO
    scale"); a target that a request alone misses makes attainment 0 at every rate, and the
    sweep then shows nothing. On a fast machine the given SLO stands.
    """
    def loosen(given: float, measured: float) -> float:  # 3 significant digits when loosened
        return given if measured <= given else float(f"{measured:.3g}")

    tpot = slo.tpot_s if lone_tpot_s is None else loosen(slo.tpot_s, SLO_TPOT_SCALE * lone_tpot_s)
    return SLO(loosen(slo.ttft_s, SLO_TTFT_SCALE * lone_ttft_s), tpot)


def _lone_latency(dep, items, spec: WorkloadSpec, placement: str) -> tuple[float, float | None]:
    """Mean TTFT and TPOT of two requests each served alone (seconds)."""
    ttfts, tpots = [], []
    for i, item in enumerate(items[:2]):
        (record,) = dep.run(router_workload([item], math.inf, spec, tag=f"{placement}-lone{i}"))
        if metrics.ttft_s(record) is not None:
            ttfts.append(metrics.ttft_s(record))
        if metrics.tpot_s(record) is not None:
            tpots.append(metrics.tpot_s(record))
    if not ttfts:
        raise RuntimeError("calibration: a lone request produced no token")
    return sum(ttfts) / len(ttfts), (sum(tpots) / len(tpots) if tpots else None)


def run_placement(placement: str, rates: list[float] | None, items, spec: WorkloadSpec,
                  model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                  devices: str | None, address: str | None,
                  policy: str = "least_loaded", worker_info: list | None = None,
                  local: bool = False, calibration: dict | None = None,
                  conditional: ConditionalConfig | None = None) -> list[RunResult]:
    """Deploy one placement once and replay the workload at each rate and seed.

    ``items`` is seed -> workload (or one workload for every seed). The deployment is
    warmed up with two discarded requests first. ``worker_info`` (a list) receives each
    worker's ``info()`` (device, torch threads). ``local``: workers in this process (tests;
    needs the in-process transport). ``rates=None``: calibrate first (after the warm-up, the
    first seed's requests as one burst; ``calibrated_rates``); the chosen rates are those of
    the results; ``calibration`` (a dict) receives ``capacity_req_s``, ``rates`` and the
    lone-request ``lone_ttft_s`` / ``lone_tpot_s`` (two requests, each served alone).
    ``conditional``: the thresholds of a ``conditional:xPyD`` placement.

    Raises:
        ValueError: a request does not fit the deployed workers' context.
    """
    by_seed = items if isinstance(items, dict) else {s: items for s in spec.seed_list}
    results = []
    with Deployment(PlacementConfig(placement, devices, address), model, engine, transfer,
                    policy=policy, local=local, conditional=conditional) as dep:
        longest = max(it.num_prompt_tokens + it.output_len for its in by_seed.values() for it in its)
        if longest > dep.router.max_model_len:
            raise ValueError(f"a request of {longest} tokens (prompt + output) does not fit the "
                             f"workers' context of {dep.router.max_model_len} tokens")
        if worker_info is not None:
            worker_info += [{"placement": placement, **i} for i in dep.gather("info")]
        first = next(iter(by_seed.values()))[:2]
        dep.run(router_workload(first, math.inf, spec, tag=f"{placement}-warmup"))
        if rates is None:
            seed, its = next(iter(by_seed.items()))
            lone_ttft_s, lone_tpot_s = _lone_latency(dep, its, spec, placement)
            start_s = time.time()
            burst = dep.run(router_workload(its, math.inf, spec, tag=f"{placement}-calibration"))
            capacity = sum(not r.error for r in burst) / (time.time() - start_s)
            rates = calibrated_rates(capacity)
            print(f"pdlab: calibration on {placement}: capacity {capacity:.3g} req/s -> rates "
                  f"{rates} req/s", file=sys.stderr)
            if calibration is not None:
                calibration.update(capacity_req_s=capacity, factors=list(CALIBRATION_FACTORS),
                                   rates=rates, placement=placement, lone_ttft_s=lone_ttft_s,
                                   lone_tpot_s=lone_tpot_s)
        for rate in rates:
            for seed, its in by_seed.items():
                workload = router_workload(its, rate, spec, tag=f"{placement}@{rate:g}/s{seed}",
                                           seed=seed)
                bar = tqdm(total=len(workload), desc=f"{placement} @ {rate:g} req/s seed {seed}",
                           unit="req")
                start_s = time.time()
                records = dep.run(workload, on_finish=lambda _record: bar.update())
                end_s = time.time()
                bar.close()
                ids = {r.request_id for r in records}
                steps = [s for s in dep.step_records() if start_s <= s["start_s"] <= end_s]
                transfers = [t for t in dep.transfer_records() if t["request_id"] in ids]
                results.append(RunResult(placement, rate, records, steps, transfers,
                                         end_s - start_s, seed))
    return results


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo, else ``platform.processor()``), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpu_names() -> list[str]:
    import torch  # local import: only to name the GPUs

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def environment(model: ModelConfig, devices: tuple[str, ...]) -> dict:
    """Run provenance: the exact command line, model, device set, git commit (and whether
    the tree had local changes), package versions, host, CPU model, GPU names."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True,
                                  cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
        except OSError:
            return None

    # this process's own command line, runnable as is (python, script, arguments)
    return {"command": shlex.join([sys.executable] + sys.argv),
            "model": model.model, "dtype": model.dtype, "devices": list(devices),
            "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "host": platform.node(), "cpu_model": cpu_model(), "num_cpus": os.cpu_count(),
            "gpus": _gpu_names(), "python": platform.python_version(),
            "versions": {p: version(p) for p in ("torch", "transformers", "ray", "numpy", "pdlab")}}


def _tagged(results: list[RunResult], attr: str) -> pd.DataFrame:
    """One row per step/transfer, tagged with its run; never column-less (a run without
    any still writes a header that ``pd.read_csv`` reads as an empty table)."""
    rows = [{"placement": r.placement, "rate": r.rate, "seed": r.seed, **row}
            for r in results for row in getattr(r, attr)]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["placement", "rate", "seed"])


def write_results(out_dir: Path, results: list[RunResult], config: dict, slo: SLO,
                  num_devices: int | None = None,
                  simulated: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """Write every output file (module docstring, step 3); returns the summary table (one
    row per placement and rate, with intervals) and the verdict. ``num_devices`` is unused
    (goodput divides by each placement's own devices) and kept for callers. ``simulated``:
    ``pdlab plan``'s simulated attainment curve (``analysis.attainment_curve``), drawn
    dashed over the measured one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        f.write(json.dumps({"type": "config", **config}) + "\n")
        for r in results:
            for record in r.records:
                f.write(json.dumps({"type": "request", "rate": r.rate, "seed": r.seed,
                                    **record.to_dict()}) + "\n")
    _tagged(results, "steps").to_csv(out_dir / "steps.csv", index=False)
    _tagged(results, "transfers").to_csv(out_dir / "transfers.csv", index=False)
    runs = [analysis.Run(r.placement, r.rate, r.records, r.seed, r.duration_s) for r in results]
    summary = analysis.summary_table(runs, slo)
    summary.to_csv(out_dir / "summary.csv", index=False)
    analysis.seed_table(runs, slo).to_csv(out_dir / "summary_seeds.csv", index=False)
    devices_of = {p: PlacementConfig(p.rsplit("@", 1)[-1]).num_devices_needed  # NAME@PLACEMENT: bench
                  for p in dict.fromkeys(summary["placement"])}
    goodput = None
    if summary["rate"].nunique() > 1:
        goodput = analysis.goodput_table(runs, slo, devices_of)
        goodput.to_csv(out_dir / "goodput.csv", index=False)
    top_rate = {p: max(r.rate for r in results if r.placement == p) for p in devices_of}
    at_top = [r for r in results if r.rate == top_rate[r.placement]]
    by_placement = {p: [x for r in at_top if r.placement == p for x in r.records] for p in devices_of}
    first_seed = {}
    for r in at_top:  # the token timeline shows one run: the first seed at the top rate
        first_seed.setdefault(r.placement, r)
    plot_paths = {
        "SLO attainment vs rate (95% intervals)": plots.plot_attainment(
            analysis.attainment_curve(summary), out_dir / "slo_attainment.png", simulated),
        "p99 latencies at the top rate (95% intervals)": plots.plot_p99_bars(
            summary, out_dir / "p99_latency.png"),
        "TTFT and TPOT CDFs (top rate, all seeds)": plots.plot_cdfs(
            by_placement, out_dir / "cdf_ttft_tpot.png"),
        "Token timeline (decode stalls during prefills)": plots.plot_token_timeline(
            {p: r.records for p, r in first_seed.items()},
            {p: r.steps for p, r in first_seed.items()}, out_dir / "token_timeline.png"),
        "Latency breakdown": plots.plot_breakdown(analysis.latency_breakdown(by_placement),
                                                  out_dir / "latency_breakdown.png"),
    }
    verdict_text = analysis.verdict(summary, slo, goodput=goodput)
    verdict_text += _write_hindsight(out_dir, results, slo)
    report.write_report(out_dir, summary, slo, verdict_text, plot_paths, config, goodput=goodput)
    return summary, verdict_text


def _write_hindsight(out_dir: Path, results: list[RunResult], slo: SLO) -> str:
    """hindsight.csv for the ``conditional:xPyD`` runs (``experiments.hindsight``); returns
    their one-line summaries for the verdict ("" when there are none)."""
    runs = [r for r in results if analysis.placement_kind(r.placement) == "conditional"]
    if not runs:
        return ""
    tables = [(r, hindsight.hindsight(r.records, r.steps, slo)) for r in runs]
    pd.concat([t.assign(placement=r.placement, rate=r.rate, seed=r.seed) for r, t in tables]).to_csv(
        out_dir / "hindsight.csv", index=False)
    return "".join(f"\n{r.placement} @ {r.rate:g} req/s {hindsight.hindsight_text(t)}."
                   for r, t in tables)


def run_experiment(placements: list[str], rates: list[float], spec: WorkloadSpec,
                   model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                   devices: str | None, address: str | None, slo: SLO, out_dir: Path,
                   policy: str = "least_loaded", local: bool = False,
                   conditional: ConditionalConfig | None = None,
                   simulate=None) -> tuple[pd.DataFrame, str]:
    """Steps 1-3 of the module docstring; returns (summary table, verdict text). ``local``:
    workers in this process (tests; transport ``inprocess``). ``simulate``: a
    ``experiments.plan.latency.DeviceProfile``; the same runs are then simulated too
    (``pdlab plan``'s simulator), the attainment plot overlays the simulated curve (dashed)
    and validation.csv holds the per-point errors (``experiments.plan.validate``).

    With ``spec.calibrate`` the rates come from ``calibrated_rates`` and the SLO from
    ``calibrated_slo`` (both measured on the first placement, recorded under
    ``calibration`` in the config row).

    Raises:
        ValueError: a bad placement, device set or workload option, or a workload that does
            not fit the model (before anything runs).
    """
    device_set = parse_devices(devices)
    for placement in placements:  # fail fast, before any model loads
        worker_layout(placement, device_set)
    max_len = context_len(model, engine)
    items = {seed: build_workload(spec, model, seed, max_len) for seed in spec.seed_list}
    results: list[RunResult] = []
    worker_info: list[dict] = []
    calibration: dict = {}
    sweep: list[float] | None = None if spec.calibrate else list(rates)
    for placement in placements:
        results += run_placement(placement, sweep, items, spec, model, engine, transfer,
                                 ",".join(device_set), address, policy, worker_info, local,
                                 calibration, conditional)
        sweep = sorted({r.rate for r in results})  # calibrated once, on the first placement
    if calibration:
        given, slo = slo, calibrated_slo(slo, calibration["lone_ttft_s"], calibration["lone_tpot_s"])
        calibration["slo_given"] = dataclasses.asdict(given)
        if slo != given:
            print(f"pdlab: a lone request takes TTFT {calibration['lone_ttft_s']:.3g} s, TPOT "
                  f"{calibration['lone_tpot_s'] or math.nan:.3g} s here: judging by SLO TTFT <= "
                  f"{slo.ttft_s:.3g} s, TPOT <= {slo.tpot_s:.3g} s instead of {given.ttft_s:g} s, "
                  f"{given.tpot_s:g} s", file=sys.stderr)
    config = {**environment(model, device_set), "placements": placements, "rates": sweep,
              **({"calibration": calibration} if calibration else {}),
              "workload": spec.options(), "seeds": spec.seed_list,
              "engine": dataclasses.asdict(engine), "transfer": dataclasses.asdict(transfer),
              "slo": dataclasses.asdict(slo), "policy": policy,
              "conditional": dataclasses.asdict(conditional or ConditionalConfig()),
              "workers": [{k: w.get(k) for k in ("placement", "name", "role", "device",
                                                 "torch_device", "gpu", "torch_num_threads",
                                                 "torch_num_interop_threads")}
                          for w in worker_info]}
    if simulate is None:
        return write_results(out_dir, results, config, slo)
    from experiments.plan import validate as plan_validate

    twins = plan_validate.simulate_like(results, items, spec, engine, transfer.transport, simulate,
                                        simulate.transfers.get(transfer.transport), policy)
    simulated = analysis.summary_table([analysis.Run(r.placement, r.rate, r.records, r.seed,
                                                     r.duration_s) for r in twins], slo, num_boot=100)
    summary, verdict_text = write_results(out_dir, results, config, slo,
                                          simulated=analysis.attainment_curve(simulated))
    factors, by_worker, factor, _ = plan_validate.step_factors(results, simulate)
    errors = plan_validate.with_outcomes(plan_validate.error_table(summary, simulated), results,
                                         twins, slo, lambda key: factors.get(key, math.nan))
    errors.to_csv(out_dir / "validation.csv", index=False)
    check = plan_validate.validation_summary(errors, plan_validate._goodput(summary),
                                             plan_validate._goodput(simulated))
    check.update(step_correction=factor, step_correction_by_worker=by_worker)
    text = plan_validate.summary_text(check)
    return summary, verdict_text + "\nSimulated twin (pdlab plan's simulator): " + text
