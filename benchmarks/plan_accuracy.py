"""Where ``pdlab plan --validate``'s error comes from, from the files it wrote.

    python -m benchmarks.plan_accuracy PLAN_OUT [--profile device_profile.json] [--rescore DIR]

PLAN_OUT is a ``pdlab plan --validate`` (or ``pdlab compare --simulate``) output directory
with ``measured/`` and ``simulated/`` results. Printed, per (placement, rate):

1. the real steps against the step model on their own recorded batches
   (``planner.diagnose.step_table``): measured ÷ modelled per worker and step kind,
   and the loop gap between back-to-back steps (time no step model contains);
2. the median TTFT parts, measured beside simulated (``diagnose.ttft_parts``);
3. whether the simulated steps ran the same batches: steps, and the share of the real
   steps whose set of requests a simulated step of that worker ran too;
4. at the end, over all real runs: the median measured ÷ modelled per wall-clock minute,
   decode and prompt steps apart (a machine whose speed drifts shows here).

The profile defaults to the one the simulated run recorded (its config line).
``--rescore DIR``: ``experiments.validate.score`` again on the saved real runs, with
this checkout's simulator and the profile, into DIR (validation*.csv, measured/,
simulated/), without new real runs (the workload is rebuilt from the records). The rescore
includes the drift replay (``planner.drift``; ``--replay-window-s`` sets its window) beside
the open-loop figures; ``--speed-spread S`` adds the speed band (``planner.band``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from engine.config import EngineConfig, TransferConfig
from engine.metrics import ARRIVED, FINISHED, SLO, RequestRecord
from experiments import replay, workload_spec
from experiments import workloads
from planner import diagnose, drift, search
from experiments import validate
from planner.latency import DeviceProfile


def load_results(path: Path) -> tuple[dict, dict, pd.DataFrame]:
    """``(config, {(placement, rate, seed): [RequestRecord]}, steps table)`` of a results
    directory (``experiments.results.write_results``' requests.jsonl and steps.csv)."""
    config, runs = {}, {}
    with open(path / "requests.jsonl") as f:
        for line in f:
            d = json.loads(line)
            kind = d.pop("type")
            if kind == "config":
                config = d
                continue
            key = (d["placement"], float(d.pop("rate")), int(d.pop("seed")))
            runs.setdefault(key, []).append(RequestRecord.from_dict(d))
    steps = pd.read_csv(path / "steps.csv")
    return config, runs, steps


def _steps_of(steps: pd.DataFrame, key: tuple) -> list[dict]:
    p, rate, seed = key
    sel = steps[(steps["placement"] == p) & np.isclose(steps["rate"], rate) & (steps["seed"] == seed)]
    return sel.drop(columns=["placement", "rate", "seed"]).to_dict("records")


def rescore(out: Path, profile: DeviceProfile, dest: Path,
            replay_window_s: float = drift.DEFAULT_WINDOW_S, speed_spread: float = 0.0
            ) -> tuple[pd.DataFrame, dict]:
    """``validate.score`` on the real runs saved under ``out/measured`` (module docstring)
    and the reruns under ``out/measured_rerun<k>`` (``pdlab plan --validate-reruns``),
    the drift replay included (``replay_window_s``: its speed trace's window) and, with
    ``speed_spread`` > 0, the speed band (``pdlab plan --speed-spread``)."""
    config, measured, items = load_runs(out / "measured")
    reruns = [load_runs(path)[1] for path in sorted(out.glob("measured_rerun*"),
                                                     key=lambda p: int(p.name.removeprefix("measured_rerun")))]
    spec = workload_spec.WorkloadSpec(**config["workload"])
    cands = [search.Candidate(p, config.get("chunk_budgets", {}).get(p)) for p in config["placements"]]
    transfer = TransferConfig(**config["transfer"])
    transfer_model = profile.transfers.get(transfer.transport) if any(
        not p.startswith("colocated") for p in config["placements"]) else None
    return validate.score(measured, cands, config["rates"], items, spec,
                          EngineConfig(**config["engine"]), transfer, profile, transfer_model,
                          SLO(**config["slo"]), dest, config.get("policy", "least_loaded"),
                          {k: config[k] for k in ("command",) if k in config}, replay_window_s,
                          speed_spread, reruns)


def load_runs(path: Path) -> tuple[dict, list[replay.RunResult], dict]:
    """A saved results directory as ``(config, runs, items)``: its real runs as
    ``replay.RunResult``s (records, steps and transfers of each) and per seed the
    workload rebuilt from the records (prompt lengths and output lengths; the token ids
    are not saved: each rebuilt prompt starts with its own token, so the simulator's
    prefix cache finds no block shared, as on the synthetic workloads validated; a run
    whose records show prefix hits (``num_cached_prompt_tokens``) is not rescored faithfully)."""
    config, runs, steps = load_results(path)
    transfers = pd.read_csv(path / "transfers.csv")
    measured, items = [], {}
    for (placement, rate, seed), records in sorted(runs.items()):
        position = lambda r: int(r.request_id.rsplit("-", 1)[-1])  # noqa: E731
        records = sorted(records, key=position)
        items.setdefault(seed, [workloads.WorkloadRequest(
            (i + 1,) + (0,) * (r.num_prompt_tokens - 1), len(r.output_token_ids) or 1, "rescore")
            for i, r in enumerate(records)])
        moved = (transfers[transfers["request_id"].isin({r.request_id for r in records})]
                 if "request_id" in transfers else transfers)  # colocated runs move no KV
        measured.append(replay.RunResult(
            placement, rate, records, _steps_of(steps, (placement, rate, seed)),
            moved.drop(columns=["placement", "rate", "seed"]).to_dict("records"),
            max(r.timeline.get(FINISHED, 0.0) for r in records)
            - min(r.timeline[ARRIVED] for r in records), seed))
    return config, measured, items


def minute_trace(real: pd.DataFrame) -> pd.DataFrame:
    """Median measured ÷ modelled ratio and step count per wall-clock minute (UTC) of the
    real steps whose batch agrees with their counts, decode and prompt (prefill or mixed) steps apart."""
    t = real[real["rebuilt"] & real["model_s"].gt(0)].copy()
    t["minute"] = pd.to_datetime(t["start_s"], unit="s").dt.strftime("%H:%M")
    t["steps"] = np.where(t["kind"] == "decode", "decode", "prompt")
    return t.pivot_table(index="minute", columns="steps", values="ratio",
                         aggfunc=["median", "size"])


def batches_agree(real: pd.DataFrame, sim: pd.DataFrame) -> float:
    """Share of real steps whose set of entry request ids some simulated step of the same
    worker has too (request ids are the same on both sides)."""
    strip = lambda ids: frozenset(i.rsplit("-", 1)[-1] for i in ids)  # noqa: E731
    seen = {(w, strip(ids)) for w, ids in zip(sim["worker"], sim["request_ids"])}
    hits = [(w, strip(ids)) in seen for w, ids in zip(real["worker"], real["request_ids"])]
    return float(np.mean(hits)) if hits else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--csv", type=Path, default=None, help="write every real step here")
    parser.add_argument("--rescore", type=Path, default=None,
                        help="score the saved real runs again with this simulator into DIR")
    parser.add_argument("--step-scale", type=float, default=1.0,
                        help="with --rescore: the profile's step times x this (pdlab plan --step-scale)")
    parser.add_argument("--replay-window-s", type=float, default=drift.DEFAULT_WINDOW_S,
                        help="with --rescore: window of the drift replay's speed trace (s)")
    parser.add_argument("--speed-spread", type=float, default=0.0,
                        help="with --rescore: the speed band (pdlab plan --speed-spread)")
    args = parser.parse_args(argv)
    if args.rescore:
        profile = DeviceProfile.load(args.profile) if args.profile else DeviceProfile.from_dict(
            load_results(args.out / "simulated")[0]["device_profile"])
        profile = profile.scaled(args.step_scale)
        errors, summary = rescore(args.out, profile, args.rescore, args.replay_window_s,
                                  args.speed_spread)
        pd.set_option("display.width", 250)
        print(errors.to_string(index=False, float_format="{:.3g}".format))
        print("\n" + validate.summary_text(summary))
        return 0
    mconf, measured, msteps = load_results(args.out / "measured")
    sconf, simulated, ssteps = load_results(args.out / "simulated")
    profile = (DeviceProfile.load(args.profile) if args.profile
               else DeviceProfile.from_dict(sconf["device_profile"]))
    step_s = profile.step_time()
    pd.set_option("display.width", 200)
    all_real = []
    for key in sorted(measured):
        real = diagnose.step_table(_steps_of(msteps, key), step_s)
        sim = diagnose.step_table(_steps_of(ssteps, key), step_s)
        real.insert(0, "run", f"{key[0]}@{key[1]:g}/s{key[2]}")
        all_real.append(real)
        print(f"\n== {key[0]} @ {key[1]:g} req/s seed {key[2]}: {len(real)} real steps "
              f"({real['rebuilt'].mean():.0%} with consistent batches), {len(sim)} simulated; busy "
              f"{real['duration_s'].sum():.1f} s real, {sim['duration_s'].sum():.1f} s simulated; "
              f"same batches {batches_agree(real, sim):.0%}")
        print(diagnose.step_summary(real).to_string(index=False, float_format="%.3f"))
        parts = pd.DataFrame({"measured": diagnose.ttft_parts(measured[key]).median(numeric_only=True),
                              "simulated": diagnose.ttft_parts(simulated.get(key, [])).median(numeric_only=True)})
        print("median TTFT parts (s):\n" + parts.drop(index="num_prompt_tokens").T.to_string(float_format="%.4f"))
    if all_real:
        real = pd.concat(all_real)
        if args.csv:
            real.to_csv(args.csv, index=False)
        print("\nmeasured ÷ modelled per minute (median, steps):")
        print(minute_trace(real).to_string(float_format="%.3f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
