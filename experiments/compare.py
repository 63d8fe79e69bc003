"""``pdlab run`` and ``pdlab compare``: placements x arrival rates on one workload.

An experiment:

1. Build the workload once (ShareGPT, HumanEval or synthetic; seeded) with the model's
   tokenizer; the same requests and the same arrival seed go to every placement.
2. For each placement: deploy it on the device set (Ray actors), then for each rate replay
   the workload open-loop (arrivals at their Poisson/Gamma times) through the router,
   collecting request records, worker step records and KV transfer records.
3. Derive the metrics (``engine.metrics`` via ``experiments.analysis``), print the
   side-by-side table and write the results directory: requests.jsonl, summary.csv,
   steps.csv, transfers.csv, report.md and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig,
                           check_fields, parse_devices, parse_placement)
from engine.metrics import SLO, RequestRecord
from engine.model import TINY_NAME, load_tokenizer, tiny_llama_config
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
        num_requests: requests per rate.
        seed: sampling and arrival seed (the same for every placement).
        arrival: ``poisson``, ``gamma`` or ``burst``; burstiness: Gamma shape (1 = Poisson).
        min_prompt_len, max_prompt_len: ShareGPT prompt-length filter in tokens (the default
            keeps prompts long enough that a prefill visibly stalls colocated decodes).
        max_output_len: ShareGPT/HumanEval output cap in tokens.
        prompt_len, output_len: synthetic lengths, ``N`` or ``lo-hi`` (uniform).
    """

    dataset: str = field(default="sharegpt", metadata={"choices": DATASETS})
    num_requests: int = field(default=24, metadata={"help": "requests per rate", "min": 1})
    seed: int = field(default=0, metadata={"help": "workload and arrival seed", "min": 0})
    arrival: str = field(default="poisson", metadata={"choices": workloads.PROCESSES})
    burstiness: float = field(default=1.0, metadata={"help": "Gamma shape; 1 = Poisson", "gt": 0})
    min_prompt_len: int = field(default=128, metadata={"help": "sharegpt: shortest prompt kept",
                                                       "min": 1})
    max_prompt_len: int = field(default=1024, metadata={"help": "sharegpt: longest prompt kept",
                                                        "min": 1})
    max_output_len: int = field(default=48, metadata={
        "help": "sharegpt/humaneval: output length cap (tokens)", "min": 1})
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


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _length_range(text: str) -> int | tuple[int, int]:
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


def build_workload(spec: WorkloadSpec, model: ModelConfig) -> list[workloads.WorkloadRequest]:
    """The requests of ``spec`` (arrival times are set per rate later)."""
    if spec.dataset == "synthetic":
        vocab = tiny_llama_config().vocab_size if model.model == TINY_NAME else 49152
        return workloads.synthetic(spec.num_requests, spec.seed, _length_range(spec.prompt_len),
                                   _length_range(spec.output_len), vocab_size=vocab,
                                   token_range=(3, vocab))
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model.model} has no tokenizer: use --dataset synthetic")
    if spec.dataset == "sharegpt":
        return workloads.sharegpt(tokenizer, spec.num_requests, spec.seed,
                                  min_prompt_len=spec.min_prompt_len,
                                  max_prompt_len=spec.max_prompt_len,
                                  max_output_len=spec.max_output_len)
    return workloads.humaneval(tokenizer, spec.num_requests, spec.seed,
                               max_output_len=spec.max_output_len)


def router_workload(items: list[workloads.WorkloadRequest], rate: float, spec: WorkloadSpec,
                    tag: str) -> list[tuple[Request, float]]:
    """Requests with arrival offsets at ``rate`` req/s; ``ignore_eos`` so each produces
    exactly its reference output length."""
    timed = workloads.with_arrivals(items, rate, spec.seed, spec.arrival, spec.burstiness)
    return [(Request(f"{tag}-{i}", item.prompt_token_ids,
                     SamplingParams(max_tokens=item.output_len, ignore_eos=True)), item.arrival_s)
            for i, item in enumerate(timed)]


def default_placements(num_devices: int) -> list[str]:
    """``colocated:N`` and every ``disagg:xPyD`` with x + y = N."""
    return [f"colocated:{num_devices}"] + [f"disagg:{x}p{num_devices - x}d"
                                           for x in range(1, num_devices)]


@dataclass
class RunResult:
    placement: str
    rate: float
    records: list[RequestRecord]
    steps: list[dict]
    transfers: list[dict]
    duration_s: float


def run_placement(placement: str, rates: list[float], items, spec: WorkloadSpec,
                  model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                  devices: str | None, address: str | None,
                  policy: str = "least_loaded",
                  conditional: ConditionalConfig | None = None) -> list[RunResult]:
    """Deploy one placement and replay the workload at each rate."""
    results = []
    with Deployment(PlacementConfig(placement, devices, address), model, engine, transfer,
                    policy=policy, conditional=conditional) as dep:
        for rate in rates:
            workload = router_workload(items, rate, spec, tag=f"{placement}@{rate}")
            bar = tqdm(total=len(workload), desc=f"{placement} @ {rate:g} req/s", unit="req")
            start_s = time.time()
            records = dep.run(workload, on_finish=lambda _record: bar.update())
            duration_s = time.time() - start_s
            bar.close()
            steps = [s for s in dep.step_records() if s["start_s"] >= start_s]
            transfers = dep.transfer_records()
            results.append(RunResult(placement, rate, records, steps, transfers, duration_s))
    return results


def environment(model: ModelConfig, devices: tuple[str, ...]) -> dict:
    """Run provenance: model, device set, git commit, package versions, host."""
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except OSError:
        commit = None
    return {"model": model.model, "dtype": model.dtype, "devices": list(devices),
            "git_commit": commit, "host": platform.node(), "python": platform.python_version(),
            "versions": {p: version(p) for p in ("torch", "transformers", "ray", "numpy", "pdlab")}}


def write_results(out_dir: Path, results: list[RunResult], config: dict, slo: SLO,
                  num_devices: int) -> tuple[pd.DataFrame, str]:
    """Write every output file; returns the summary table and the verdict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        f.write(json.dumps({"type": "config", **config}) + "\n")
        for r in results:
            for record in r.records:
                f.write(json.dumps({"type": "request", "rate": r.rate, **record.to_dict()}) + "\n")
    pd.DataFrame([{"placement": r.placement, "rate": r.rate, **s} for r in results for s in r.steps]
                 ).to_csv(out_dir / "steps.csv", index=False)
    pd.DataFrame([{"placement": r.placement, "rate": r.rate, **t}
                  for r in results for t in r.transfers]).to_csv(out_dir / "transfers.csv", index=False)
    runs = [(r.placement, r.rate, r.records, r.duration_s) for r in results]
    summary = analysis.summary_table(runs, slo)
    summary.to_csv(out_dir / "summary.csv", index=False)
    top_rate = {}
    for r in results:  # plots of one rate per placement: the highest
        if r.rate >= top_rate.get(r.placement, r).rate:
            top_rate[r.placement] = r
    by_placement = {p: r.records for p, r in top_rate.items()}
    curve = analysis.attainment_curve([(r.placement, r.rate, r.records) for r in results], slo)
    plot_paths = {
        "TTFT and TPOT CDFs": plots.plot_cdfs(by_placement, out_dir / "cdf_ttft_tpot.png"),
        "SLO attainment vs rate": plots.plot_attainment(curve, out_dir / "slo_attainment.png"),
        "Token timeline (decode stalls during prefills)": plots.plot_token_timeline(
            by_placement, {p: r.steps for p, r in top_rate.items()}, out_dir / "token_timeline.png"),
        "Latency breakdown": plots.plot_breakdown(analysis.latency_breakdown(by_placement),
                                                  out_dir / "latency_breakdown.png"),
    }
    devices_of = {p: PlacementConfig(p).num_devices_needed for p in by_placement}
    verdict_text = analysis.verdict(summary, slo, num_devices=num_devices)
    verdict_text += _write_hindsight(out_dir, results, slo)
    goodput = analysis.goodput_per_device(curve, devices_of) if len(set(curve["rate"])) > 1 else None
    report.write_report(out_dir, summary, slo, verdict_text, plot_paths, config, goodput=goodput)
    return summary, verdict_text


def _write_hindsight(out_dir: Path, results: list[RunResult], slo: SLO) -> str:
    """hindsight.csv for the ``conditional:xPyD`` runs (``experiments.hindsight``); returns
    their one-line summaries for the verdict ("" when there are none)."""
    runs = [r for r in results if parse_placement(r.placement)[0] == "conditional"]
    if not runs:
        return ""
    tables = [(r, hindsight.hindsight(r.records, r.steps, slo)) for r in runs]
    pd.concat([t.assign(placement=r.placement, rate=r.rate) for r, t in tables]).to_csv(
        out_dir / "hindsight.csv", index=False)
    return "".join(f"\n{r.placement} @ {r.rate:g} req/s {hindsight.hindsight_text(t)}."
                   for r, t in tables)


def run_experiment(placements: list[str], rates: list[float], spec: WorkloadSpec,
                   model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                   devices: str | None, address: str | None, slo: SLO, out_dir: Path,
                   policy: str = "least_loaded",
                   conditional: ConditionalConfig | None = None) -> tuple[pd.DataFrame, str]:
    """Steps 1-3 of the module docstring; returns (summary table, verdict text).

    Raises:
        ValueError: a bad placement, device set or workload option (before anything runs).
    """
    device_set = parse_devices(devices)
    for placement in placements:  # fail fast, before any model loads
        worker_layout(placement, device_set)
    items = build_workload(spec, model)
    results = []
    for placement in placements:
        results += run_placement(placement, rates, items, spec, model, engine, transfer,
                                 ",".join(device_set), address, policy, conditional)
    config = {**environment(model, device_set), "placements": placements, "rates": rates,
              "workload": dataclasses.asdict(spec), "engine": dataclasses.asdict(engine),
              "transfer": dataclasses.asdict(transfer), "slo": dataclasses.asdict(slo),
              "policy": policy,
              "conditional": dataclasses.asdict(conditional or ConditionalConfig()),
              "seed": spec.seed}
    return write_results(out_dir, results, config, slo, len(device_set))
