"""The results directory every experiment writes, and the config row that heads it.

``write_results`` writes, from ``RunResult``s: requests.jsonl (first line: the config row; then
one row per request with its timeline), summary.csv, summary_seeds.csv, goodput.csv, steps.csv
and transfers.csv (rows tagged placement, rate, seed), transfer_efficiency.csv, hindsight.csv
(conditional placements), report.md and the plots. ``environment``: the config row's provenance
(command line, git commit, package versions, CPU, GPUs)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pandas as pd
import torch

from engine.config import ConditionalConfig, ModelConfig, PlacementConfig
from engine.emulated import Emulation, lateness_warning
from engine.metrics import SLO
from experiments import analysis, dilation, hindsight, plots, report
from experiments.report import format_table
from experiments.replay import RunResult
from planner.latency import DeviceProfile


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


def serving_systems(config: dict) -> dict[str, str]:
    """Placement -> the system that produced its records, from a results directory's config
    row: ``pdlab in process`` for ``run``/``compare`` (no ``bench`` key); for ``bench``, the
    server's ``owned_by`` from ``GET /v1/models`` (vLLM: ``vllm``, pdlab: ``pdlab``) over HTTP,
    or, where it was not recorded, the NAME of the ``NAME@PLACEMENT`` label; for ``bench merge``,
    each merged directory's (its ``configs``). Placements the row does not list are left out."""
    if "configs" in config:
        systems: dict[str, str] = {}
        for row in config["configs"]:
            systems.update(serving_systems(row))
        return systems
    placements = config.get("placements", [])
    if "bench" not in config:
        return {p: "pdlab in process" for p in placements}
    server = config.get("server")
    return {p: f"{server or p.rsplit('@', 1)[0]} server over HTTP" for p in placements}


def write_results(out_dir: Path, results: list[RunResult], config: dict, slo: SLO,
                  num_devices: int | None = None,
                  simulated: pd.DataFrame | None = None) -> tuple[pd.DataFrame, str]:
    """Write every output file (module docstring, step 3); returns the summary table (one row per
    placement and rate, with intervals) and the verdict. ``num_devices`` is unused (goodput divides
    by each placement's own devices) and kept for callers. ``simulated``: ``pdlab plan``'s simulated
    attainment curve (``analysis.attainment_curve``), drawn dashed over the measured one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        f.write(json.dumps({"type": "config", **config}) + "\n")
        for r in results:
            for record in r.records:
                f.write(json.dumps({"type": "request", "rate": r.rate, "seed": r.seed,
                                    **record.to_dict()}) + "\n")
    steps = _tagged(results, "steps")
    steps.to_csv(out_dir / "steps.csv", index=False)
    if config.get("emulated") and "lateness" in steps:
        warning = lateness_warning(steps.to_dict("records"), platform.node())
        if warning:
            print(warning, file=sys.stderr)
    transfers = _tagged(results, "transfers")
    transfers.to_csv(out_dir / "transfers.csv", index=False)
    efficiency = analysis.transfer_efficiency(transfers)
    efficiency.to_csv(out_dir / "transfer_efficiency.csv", index=False)
    runs = [analysis.as_run(r) for r in results]
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
    verdict_text = analysis.verdict(summary, slo, goodput=goodput, systems=serving_systems(config))
    verdict_text += _write_hindsight(out_dir, results, slo)
    if not efficiency.empty:
        verdict_text += "\n" + analysis.transfer_efficiency_text(efficiency)
    scale = config.get("emulation", {}).get("time_scale", 1)
    title = "pdlab placement comparison" + (
        "" if not config.get("emulated") else " (emulated devices)" if scale == 1
        else f" (emulated devices, {dilation.label(scale)})")
    report.write_report(out_dir, summary, slo, verdict_text, plot_paths, config, goodput=goodput,
                        transfer_efficiency=efficiency, title=title)
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


def print_outcome(summary, verdict: str, out: Path, files: str) -> None:
    """The side-by-side table, the verdict, a warning naming failed requests, and where
    the results went (``run``/``compare`` and ``bench`` alike)."""
    print()
    print(format_table(summary))
    print()
    print(verdict)
    failed = int(summary["num_failed"].sum())
    if failed:
        print(f"\nWarning: {failed} request(s) failed; their errors are in requests.jsonl "
              "(column 'error').", file=sys.stderr)
    print(f"\nResults: {out}/ ({files})")


def emulation_row(engine) -> dict:
    """``{"emulated": True, "emulation": {...}}`` for a run on emulated devices
    (``engine.emulated``: the profile file, its source, system and backend, its model and
    device, the KV and time scales), else ``{}``; results on emulated devices say so in their config
    row and report title, so no one mistakes them for a GPU measurement."""
    if getattr(engine, "device_profile", None) is None:
        return {}

    first = engine.device_profile.split(",")[0].strip()  # one per TP size: one model, device
    emulation = Emulation(DeviceProfile.load(first), engine.emu_kv_scale,
                          time_scale=engine.emu_time_scale)
    return {"emulated": True, "emulation": {"device_profile": engine.device_profile,
                                            **emulation.describe()}}


def experiment_config(model: ModelConfig, devices: tuple[str, ...], placements: list[str],
                      rates: list[float], calibration: dict, spec, engine, transfer, slo: SLO,
                      policy: str, conditional, worker_info: list[dict]) -> dict:
    """The config row of a ``run``/``compare`` results directory: ``environment`` and every
    option that shaped the runs (the calibration, when there was one, and each worker's
    device and torch threads)."""
    return {**environment(model, devices), **emulation_row(engine),
            "placements": placements, "rates": rates,
            **({"calibration": calibration} if calibration else {}),
            "workload": spec.options(), "seeds": spec.seed_list,
            "engine": dataclasses.asdict(engine), "transfer": dataclasses.asdict(transfer),
            "slo": dataclasses.asdict(slo), "policy": policy,
            "conditional": dataclasses.asdict(conditional or ConditionalConfig()),
            "workers": [{k: w.get(k) for k in ("placement", "name", "role", "device",
                                               "torch_device", "gpu", "torch_num_threads",
                                               "torch_num_interop_threads", "kernels")}
                        for w in worker_info]}
