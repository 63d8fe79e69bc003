"""``pdlab bench``: the workloads of ``pdlab run`` (``compare.build_workload``) sent to any
OpenAI-compatible server, at their scheduled times (open loop) after two discarded warm-ups:
``POST /v1/completions`` with token ids, ``max_tokens``, ``ignore_eos``, ``temperature`` 0,
streamed with usage. Each response becomes a ``RequestRecord`` from client-side stamps
(``arrived`` = scheduled send, ``dispatched`` = actual send, one ``token_times_s`` per chunk
carrying a choice, ``finished`` after ``[DONE]``); a ``usage.completion_tokens`` other than asked
is an error, fewer chunks than tokens are counted. TTFT and E2E include HTTP, JSON and
detokenization; ITL and TPOT use the client clock. Labels are ``NAME@PLACEMENT``: the placement
gives goodput per device its device count. ``merge`` joins several results directories."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from dataclasses import dataclass, field

import httpx
import pandas as pd

from engine.config import ModelConfig, add_dataclass_args, check_fields, dataclass_from_args
from engine.placement import Placement
from engine.metrics import ARRIVED, DISPATCHED, ERROR, FINISHED, SLO, RequestRecord
from engine.model import TINY_NAMES
from experiments import workloads
from experiments.cli import Parser
from experiments.options import (CPU_ENGINE_DEFAULTS, add_model_args, add_slo_args, check_model,
                                 check_out, context_limit, option_error, rate_list)
from experiments.replay import RunResult
from experiments.report import format_table
from experiments.results import environment, print_outcome, write_results
from experiments.workload_spec import WorkloadSpec, build_workload

HELP = "the workloads of run/compare against any OpenAI-compatible server (streaming HTTP)"

LABEL_PATTERN = r"[A-Za-z0-9_.\-]+@[A-Za-z0-9:\-]+"


@dataclass(frozen=True)
class BenchConfig:
    """Which server ``pdlab bench`` drives (each field's help says what it is)."""

    base_url: str = field(default="http://127.0.0.1:8000", metadata={
        "help": "OpenAI-compatible server to drive", "pattern": r"https?://[^\s/]+(/\S*)?",
        "hint": "http://host:port"})
    label: str = field(default="server@colocated:1", metadata={
        "help": "NAME@PLACEMENT recorded for this server (e.g. vllm@colocated:1)",
        "pattern": LABEL_PATTERN, "hint": "NAME@PLACEMENT"})
    served_model: str | None = field(default=None, metadata={
        "help": "model id to send (default: the first of GET /v1/models)", "pattern": r"[A-Za-z0-9_./:\-]+",
        "hint": "letters, digits and _./:-"})
    request_timeout_s: float = field(default=600.0, metadata={
        "help": "longest wait for one response, seconds", "gt": 0})

    def __post_init__(self) -> None:
        check_fields(self)
        try:
            Placement.parse(self.label.rsplit("@", 1)[1])
        except ValueError as err:
            raise ValueError(f"label must be NAME@PLACEMENT with a placement such as "
                             f"colocated:1: {err}") from None


MISCOUNTED: list[str] = []  # requests whose chunks were not one per token


def served_model(base_url: str, name: str | None = None,
                 timeout_s: float = 30.0) -> tuple[str, dict]:
    """The model to send and what the server says of itself: ``GET /v1/models``'s first model
    (or ``name``) and a dict with its ``owned_by`` as ``server`` (vLLM: ``vllm``, pdlab:
    ``pdlab``; the verdict compares placements of one server, ``results.serving_systems``) and
    its ``emulated`` / ``emulation`` keys, each only where the card has it. With ``name``, a
    server that does not answer or list it still gets ``name`` (and ``{}``).

    Raises:
        RuntimeError: no ``name`` and the server did not answer or lists no model."""
    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s)
        reply.raise_for_status()
        cards = reply.json()["data"]
        card = cards[0] if name is None else next(c for c in cards if c["id"] == name)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError, StopIteration) as err:
        if name is not None:
            return name, {}
        raise RuntimeError(f"{base_url}/v1/models: {type(err).__name__}: {err}") from None
    about = {"server": card["owned_by"]} if isinstance(card.get("owned_by"), str) else {}
    return card["id"], {**about, **{k: card[k] for k in ("emulated", "emulation") if k in card}}


async def _one(client: httpx.AsyncClient, url: str, model: str, request_id: str, label: str,
               item: workloads.WorkloadRequest, send_at_s: float) -> RequestRecord:
    """Send one request at ``send_at_s`` (``time.time()``) and time its stream."""
    record = RequestRecord(request_id=request_id, placement=label,
                           num_prompt_tokens=item.num_prompt_tokens)
    record.timeline[ARRIVED] = send_at_s
    await asyncio.sleep(max(0.0, send_at_s - time.time()))
    body = {"model": model, "prompt": list(item.prompt_token_ids), "max_tokens": item.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    record.timeline[DISPATCHED] = time.time()
    usage = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                if chunk.get("choices"):
                    record.token_times_s.append(time.time())
                    reason = chunk["choices"][0].get("finish_reason")
                    record.finish_reason = reason or record.finish_reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
        got = None if usage is None else usage.get("completion_tokens")
        if got != item.output_len:
            raise RuntimeError(f"asked for {item.output_len} tokens (ignore_eos), usage says {got}")
        if got != len(record.token_times_s):  # timed per chunk; the report says how often
            MISCOUNTED.append(request_id)
    except Exception as err:  # this request fails; the others go on
        record.error = f"{type(err).__name__}: {err}"
        record.finish_reason = "error"
        record.timeline[ERROR] = time.time()
    record.timeline[FINISHED] = time.time()
    return record


async def _replay(base_url: str, model: str, label: str, tag: str,
                  timed: list[workloads.WorkloadRequest], timeout_s: float
                  ) -> tuple[list[RequestRecord], float]:
    """Every request of ``timed`` at its arrival offset; (records, duration in seconds)."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start_s = time.time() + 0.05  # room to create the tasks before the first arrival
        records = await asyncio.gather(*(
            _one(client, url, model, f"{tag}-{i}", label, item, start_s + item.arrival_s)
            for i, item in enumerate(timed)))
    return list(records), time.time() - start_s


def bench(config: BenchConfig, spec: WorkloadSpec, model: ModelConfig, max_len: int,
          rates: list[float], slo: SLO, out_dir: Path) -> tuple[pd.DataFrame, str]:
    """Steps 1-3 of the module docstring; returns (summary table, verdict).

    Raises:
        ValueError: a workload that does not fit ``max_len``. RuntimeError: no server."""
    items = {seed: build_workload(spec, model, seed, max_len) for seed in spec.seed_list}
    name, about = served_model(config.base_url, config.served_model)
    label = config.label
    first = next(iter(items.values()))
    warm, _ = asyncio.run(_replay(config.base_url, name, label, f"{label}-warmup",
                                  first[:2], config.request_timeout_s))
    if all(r.error for r in warm):
        raise RuntimeError(f"every warm-up request to {config.base_url} failed: {warm[0].error}")
    results = []
    for rate in rates:
        for seed, its in items.items():
            timed = workloads.with_arrivals(its, rate, seed, spec.arrival, spec.burstiness)
            tag = f"{label}@{rate:g}/s{seed}"
            print(f"pdlab bench: {label} @ {rate:g} req/s seed {seed}: {len(timed)} requests",
                  file=sys.stderr)
            records, duration_s = asyncio.run(_replay(config.base_url, name, label, tag, timed,
                                                      config.request_timeout_s))
            results.append(RunResult(label, rate, records, [], [], duration_s, seed))
    if MISCOUNTED:
        print(f"pdlab bench: {len(MISCOUNTED)} response(s) streamed fewer chunks than tokens: "
              "their ITL/TPOT are per chunk", file=sys.stderr)
    env = environment(model, ())
    run_config = {**env, **about, "bench": dataclasses.asdict(config), "served_model": name,
                  "placements": [label], "rates": list(rates), "workload": spec.options(),
                  "seeds": spec.seed_list, "max_model_len": max_len,
                  "slo": dataclasses.asdict(slo), "timing": "client-side (experiments/commands/bench.py)",
                  "responses_with_fewer_chunks_than_tokens": len(MISCOUNTED)}
    return write_results(out_dir, results, run_config, slo)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab bench``."""
    add_dataclass_args(parser.add_argument_group("server"), BenchConfig)
    add_model_args(parser)  # its tokenizer builds the prompts (the server's own model)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens a request may use, prompt + output (>= 2; default: "
                             f"{CPU_ENGINE_DEFAULTS['max_model_len']}, capped by the model's "
                             "context): longer outputs are clipped as in pdlab run")
    parser.add_argument("--rates", type=rate_list, default=[0.5],
                        help="arrival rates in req/s, comma-separated")
    add_slo_args(parser)
    parser.add_argument("--out", default=None, help="results directory (default: results/bench-<time>)")
    add_dataclass_args(parser.add_argument_group("workload"), WorkloadSpec, skip=("calibrate",))


@dataclass(frozen=True)
class Benching:
    """Everything ``pdlab bench`` needs, checked (``check``)."""

    config: BenchConfig
    spec: WorkloadSpec
    model: ModelConfig
    max_len: int
    slo: SLO
    out: Path


def check(args: argparse.Namespace) -> Benching:
    """Every ``bench`` option; the server is not contacted and no tokenizer is loaded.

    Raises:
        ValueError: the first bad option."""
    config = dataclass_from_args(BenchConfig, args)
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    spec = dataclass_from_args(WorkloadSpec, args)
    if spec.dataset != "synthetic" and model.model in TINY_NAMES:
        raise option_error("--dataset", f"{spec.dataset} needs a tokenizer; model {model.model} "
                                        "has none: use --dataset synthetic")
    max_len = context_limit(model, args.max_model_len)
    longest = spec.max_request_len()
    if spec.dataset == "synthetic" and longest is not None and longest > max_len:
        raise option_error("--prompt-len", f"--prompt-len and --output-len allow requests of "
                                           f"{longest} tokens, more than --max-model-len {max_len}")
    check_out(args.out)
    out = Path(args.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    return Benching(config, spec, model, int(max_len), SLO(args.slo_ttft_s, args.slo_tpot_s), out)


def run(args: argparse.Namespace, x: Benching) -> int:
    """Drive the server at every rate and seed, write and print the results."""
    print(f"pdlab bench: {x.config.label} at {x.config.base_url}, {x.spec.dataset} x "
          f"{x.spec.num_requests}, rates {args.rates} req/s, seeds {x.spec.seed_list}")
    summary, verdict = bench(x.config, x.spec, x.model, x.max_len, args.rates, x.slo, x.out)
    print_outcome(summary, verdict, x.out, "requests.jsonl, summary.csv, report.md, *.png")
    return 0


def merge(dirs: list[Path], out_dir: Path, slo: SLO) -> tuple[pd.DataFrame, str]:
    """One comparison report from several results directories (bench or run): their records, grouped
    by (placement, rate, seed), with each run's duration from its summary_seeds.csv.

    Raises:
        ValueError: a directory without requests.jsonl, a line of it that is not JSON, or two
        directories with the same placement; nothing is written then."""
    for d in dirs:
        if not (Path(d) / "requests.jsonl").is_file():
            raise ValueError(f"{d} has no requests.jsonl: not a results directory of pdlab "
                             "run, compare or bench")
    results, configs, seen = [], [], set()
    for d in dirs:
        path = Path(d) / "requests.jsonl"
        durations = {}
        seeds_csv = Path(d) / "summary_seeds.csv"
        if seeds_csv.exists():
            for _, row in pd.read_csv(seeds_csv).iterrows():
                durations[(row["placement"], float(row["rate"]), int(row["seed"]))] = float(row["duration_s"])
        runs: dict[tuple, list[RequestRecord]] = {}
        with open(path) as f:
            for number, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {number}: not JSON ({err})") from None
                if row.pop("type") == "config":
                    configs.append(row)
                    continue
                rate, seed = float(row.pop("rate")), int(row.pop("seed"))
                record = RequestRecord.from_dict(row)
                runs.setdefault((record.placement, rate, seed), []).append(record)
        placements = {p for p, _, _ in runs}
        if placements & seen:
            raise ValueError(f"placement {sorted(placements & seen)} appears in two directories")
        seen |= placements
        for key, records in runs.items():
            results.append(RunResult(key[0], key[1], records, [], [], durations.get(key), key[2]))
    config = {"merged_from": [str(d) for d in dirs], "configs": configs,
              "placements": sorted(seen), "slo": dataclasses.asdict(slo)}
    return write_results(out_dir, results, config, slo)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.commands.bench merge --out DIR DIR1 DIR2 ...`` (``make
    vllm-baseline`` calls ``merge`` the same way).

    Returns:
        0; a bad option or directory exits 2 with one line naming it (``cli.Parser``)."""
    parser = Parser(prog="python -m experiments.commands.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("merge", help="one comparison report from several results directories")
    cmd.add_argument("dirs", nargs="+", type=Path)
    cmd.add_argument("--out", type=Path, required=True)
    cmd.add_argument("--slo-ttft-s", type=float, default=2.0)
    cmd.add_argument("--slo-tpot-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    if not (math.isfinite(args.slo_ttft_s) and args.slo_ttft_s > 0 and
            math.isfinite(args.slo_tpot_s) and args.slo_tpot_s > 0):
        cmd.error("--slo-ttft-s and --slo-tpot-s must be > 0")
    try:
        summary, verdict = merge(args.dirs, args.out, SLO(args.slo_ttft_s, args.slo_tpot_s))
    except ValueError as err:
        cmd.error(f"argument dirs: {err}")
    print(format_table(summary))
    print()
    print(verdict)
    print(f"\nResults: {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
