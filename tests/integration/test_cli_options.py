"""Every option of every ``pdlab`` command refuses a bad value before anything starts.

Each row runs ``experiments.cli.main(argv)`` in this process with Ray, the deployment and
every model/tokenizer load replaced by tripwires, and asserts exit code 2, exactly one line
on stderr naming the option and what it allows, and that no tripwire fired. Options derived
from config dataclasses get their bad value from the field's rule; the others are listed by
hand; ``test_every_option_has_a_bad_value`` fails for an option that has neither, so a new
option cannot skip validation.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import experiments.commands.bench
import experiments.commands.compare
import experiments.commands.profile
import experiments.commands.serve
import experiments.measure
import experiments.replay
import experiments.workload_spec
from engine.config import ConditionalConfig, EngineConfig, ModelConfig, RULE_KEYS, TransferConfig, field_type
from experiments import cli
from experiments.workload_spec import WorkloadSpec
from experiments.commands.bench import BenchConfig
from server.config import ServeConfig
from experiments.commands.interference import InterferenceConfig
from experiments.commands.plan import PlanConfig
from experiments.commands.map import MapConfig, _SPEC_SKIP as MAP_SPEC_SKIP

ROOT = Path(__file__).resolve().parents[2]
TINY_PROFILE = str(ROOT / "tests" / "data" / "tiny_device_profile.json")
LLAMA_PROFILE = str(ROOT / "tests" / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json")
EMULATION_ROWS = [  # run, compare and serve: emulated devices (engine/emulated.py)
    ("--device-profile", ["--device-profile", TINY_PROFILE], ("only emulated devices",)),
    ("--device-profile", ["--devices", "emu:0"], ("emulated devices (emu:0) need a device profile",)),
    ("--device-profile", ["--devices", "emu:0", "--device-profile", "/nonexistent/p.json"],
     ("cannot read device profile",)),
    ("--device-profile", ["--devices", "emu:0", "--device-profile", LLAMA_PROFILE],
     ("has no model tiny-random-llama", "it profiles engine/configs/llama-3.1-8b")),
    ("--model", ["--devices", "emu:0", "--device-profile", TINY_PROFILE],
     ("emulated model 'tiny-random-llama' is not a directory with a config.json",)),
    ("--emu-kv-scale", ["--emu-kv-scale", "2"], ("<= 1",)),
    ("--devices", ["--devices", "emu:3-1"], ("low-high",)),
]
KV_COST_EMULATION_ROWS = [  # kv-cost on one emulated device: the same owners' refusals
    ("--device-profile", ["--device-profile", LLAMA_PROFILE], ("only emulated devices",)),
    ("--device-profile", ["--device", "emu:0"], ("emulated devices (emu:0) need a device profile",)),
    ("--device-profile", ["--device", "emu:0", "--device-profile", "/nonexistent/p.json"],
     ("cannot read device profile",)),
    ("--device-profile", ["--device", "emu:0", "--device-profile", "p.txt"], (".json file",)),
    ("--device-profile", ["--device", "emu:0", "--device-profile", LLAMA_PROFILE],
     ("has no model tiny-random-llama", "it profiles engine/configs/llama-3.1-8b")),
    ("--model", ["--device", "emu:0", "--device-profile", TINY_PROFILE],
     ("emulated model 'tiny-random-llama' is not a directory with a config.json",)),
    ("--dtype", ["--device", "emu:0", "--device-profile", LLAMA_PROFILE, "--model",
                 "engine/configs/llama-3.1-8b"], ("is bfloat16, not float32", "--dtype bfloat16")),
    ("--emu-kv-scale", ["--emu-kv-scale", "2"], ("<= 1",)),
    ("--emu-kv-scale", ["--device", "emu:0", "--device-profile", LLAMA_PROFILE, "--model",
                        "engine/configs/llama-3.1-8b", "--dtype", "bfloat16", "--emu-kv-scale",
                        "0"], ("> 0",)),
    ("--device", ["--device", "emu:0-1"], ("'emu:i'",)),
]
NUM_CORES = len(os.sched_getaffinity(0))
TINY_RUN = ["--model", "tiny-random-llama", "--dataset", "synthetic", "--prompt-len", "4-30",
            "--output-len", "3-8", "--devices", "cpu:0"]
BASE = {"run": TINY_RUN + ["--placement", "colocated:1"],
        "compare": TINY_RUN + ["--placements", "colocated:1"],
        "profile": ["--model", "tiny-random-llama"],
        "kv-cost": ["--model", "tiny-random-llama"],
        "interference": ["--model", "tiny-random-llama", "--batch-sizes", "1,2", "--prompt-lens",
                         "0,16", "--context-len", "16", "--chunk-budgets", "12"],
        "serve": ["--model", "tiny-random-llama", "--devices", "cpu:0", "--placement",
                  "colocated:1", "--local"],
        "bench": ["--model", "tiny-random-llama", "--dataset", "synthetic", "--prompt-len", "4-30",
                  "--output-len", "3-8"],
        "plan": ["--model", "tiny-random-llama", "--dataset", "synthetic", "--prompt-len", "4-30",
                 "--output-len", "3-8", "--profile", TINY_PROFILE, "--transport", "inprocess"],
        "map": ["--model", "tiny-random-llama", "--device-profile", TINY_PROFILE, "--transport",
                "inprocess", "--ttft-slo", "0.1:1:2", "--tpot-slo", "0.01:0.1:2", "--io-ratio", "1",
                "--request-tokens", "32"]}
DERIVED = {"run": (WorkloadSpec, EngineConfig, TransferConfig, ConditionalConfig),
           "compare": (WorkloadSpec, EngineConfig, TransferConfig, ConditionalConfig),
           "interference": (InterferenceConfig,),
           "serve": (ServeConfig, EngineConfig, TransferConfig, ConditionalConfig),
           "bench": (BenchConfig, WorkloadSpec),
           "plan": (PlanConfig, WorkloadSpec, EngineConfig, TransferConfig),
           "map": (MapConfig, WorkloadSpec, EngineConfig, TransferConfig)}
# dataclass fields the CLI leaves out (each worker binds its own device; the deployment sets
# an instance's TP/PP from its placement)
SKIPPED = {(EngineConfig, "device")} | {(cls, f.name) for cls in (EngineConfig,)
                                       for f in dataclasses.fields(cls)
                                       if not f.metadata.get("cli", True)}
SKIPPED_BY_COMMAND = {"bench": {(WorkloadSpec, "calibrate")},  # bench has no calibration
                      # map draws one synthetic workload per --io-ratio itself
                      "map": {(WorkloadSpec, name) for name in MAP_SPEC_SKIP}
                      | {(EngineConfig, "device_profile")}}  # map's own --device-profile


def _derived_rows(command: str) -> list[tuple[str, list[str], tuple[str, ...]]]:
    """(option, argv tail, words the message must hold) per rule of each derived field."""
    rows = []
    for cls in DERIVED.get(command, ()):
        for f in dataclasses.fields(cls):
            if (cls, f.name) in SKIPPED | SKIPPED_BY_COMMAND.get(command, set()):
                continue
            flag = "--" + f.name.replace("_", "-")
            rule = f.metadata
            if field_type(f) is bool:
                rows.append((flag, [f"{flag}=maybe"], ()))
            if "min" in rule:
                rows.append((flag, [flag, str(rule["min"] - 1)], (f">= {rule['min']}",)))
            if "gt" in rule:
                rows.append((flag, [flag, str(rule["gt"])], (f"> {rule['gt']}",)))
            if "choices" in rule:
                rows.append((flag, [flag, "no-such-choice"], tuple(rule["choices"])))
            if "pattern" in rule:
                rows.append((flag, [flag, "!bad!"], (rule["hint"],)))
    return rows


def _a_file(tmp: Path) -> str:
    path = tmp / "a-file"
    path.write_text("not a directory")
    return str(path)


# (command, option, argv tail, words the message must hold); FILE is replaced by a file path
EXPERIMENT_ROWS = [
    ("--placement", ["--placement", "disagg:0p1d"], ("disagg:xPyD needs x, y >= 1",)),
    ("--placement", ["--placement", "disagg:1p1d"], ("needs 2 devices", "has 1")),
    ("--devices", ["--devices", f"cpu:{NUM_CORES + 5}"], ("does not exist", "offers cores")),
    ("--devices", ["--devices", "gpu:0"], ("'cuda:0' or 'cpu:0'",)),
    ("--devices", ["--devices", "cpu:0,cpu:0"], ("must not repeat",)),
    ("--address", ["--address", "nowhere"], ("'auto'", "'host:port'")),
    ("--policy", ["--policy", "random"], ("least_loaded", "round_robin")),
    ("--max-worker-restarts", ["--max-worker-restarts", "-1"], (">= 0",)),
    ("--model", ["--model", "/nonexistent/dir"], ("model directory /nonexistent/dir does not exist",)),
    ("--model", ["--model", "no-such-model"], ("unknown model", "tiny-random-llama")),
    ("--dtype", ["--dtype", "float64"], ("float32", "bfloat16")),
    ("--rates", ["--rates", "-1"], ("> 0",)),
    ("--rates", ["--rates", "1,nan"], ("> 0",)),
    ("--slo-ttft-s", ["--slo-ttft-s", "-1"], ("> 0",)),
    ("--slo-tpot-s", ["--slo-tpot-s", "0"], ("> 0",)),
    ("--out", ["--out", "FILE"], ("is a file",)),
    ("--max-model-len", ["--max-model-len", "100000"], ("context of model tiny-random-llama",
                                                        "256 tokens", "100000")),
    ("--prompt-len", ["--prompt-len", "4-300"], ("--max-model-len 256", "would fail")),
    ("--prompt-len", ["--prompt-len", "30-4"], ("lo <= hi",)),
    ("--max-prompt-len", ["--dataset", "sharegpt", "--min-prompt-len", "64", "--max-prompt-len",
                          "32"], (">= min_prompt_len (64)",)),
    ("--max-num-batched-tokens", ["--max-num-seqs", "16", "--max-num-batched-tokens", "8"],
     (">= max_num_seqs (16)",)),
    ("--kv-capacity-tokens", ["--kv-capacity-tokens", "20"], ("longest request (38 tokens)",)),
]
COMMON_ROWS = [  # profile and kv-cost
    ("--model", ["--model", "/nonexistent/dir"], ("model directory /nonexistent/dir does not exist",)),
    ("--dtype", ["--dtype", "float64"], ("float32",)),
    ("--device", ["--device", "tpu"], ("'cpu' or 'cuda:i'",)),
    ("--device", ["--device", "cuda:99"], ("cuda:99 does not exist",)),
    ("--repeats", ["--repeats", "0"], (">= 1",)),
    ("--seed", ["--seed", "one"], ("invalid int value",)),
    ("--threads", ["--threads", "0"], (">= 1",)),
    ("--out", ["--out", "FILE"], ("is a file",)),
    ("--prompt-lens", ["--prompt-lens", "0,4"], ("positive integers",)),
]
WORKLOAD_ROWS = [  # run, compare and plan share WorkloadSpec (bench too)
    ("--trace", ["--dataset", "mooncake"], ("argument --trace", "must be given with --dataset mooncake")),
    ("--trace", ["--trace", "FILE"], ("must be given with --dataset mooncake", "'synthetic'")),
    ("--trace", ["--dataset", "mooncake", "--trace", "FILE"],
     ("argument --trace", "a-file:1: not a JSON object")),
    ("--trace", ["--dataset", "mooncake", "--trace", "/nonexistent.jsonl"],
     ("must be an existing file",)),
    ("--num-prefixes", ["--dataset", "prefix_repetition", "--num-requests", "2", "--num-prefixes",
                        "3"], ("<= num_requests (2)",)),
]
PLAN_ROWS = [
    ("--model", ["--model", "no-such-model"], ("unknown model",)),
    ("--dtype", ["--dtype", "float64"], ("float32", "bfloat16")),
    ("--rates", ["--rates", "0"], ("> 0",)),
    ("--slo-ttft-s", ["--slo-ttft-s", "0"], ("> 0",)),
    ("--slo-tpot-s", ["--slo-tpot-s", "-2"], ("> 0",)),
    ("--policy", ["--policy", "random"], ("least_loaded",)),
    ("--out", ["--out", "FILE"], ("is a file",)),
    ("--profile", ["--profile", "/nonexistent/profile.json"], ("cannot read device profile",)),
    ("--profile", ["--model", "smollm2-135m", "--dataset", "synthetic"],
     ("measured on tiny-random-llama (float32), not smollm2-135m",)),
    ("--chunk-budgets", ["--max-num-seqs", "16", "--chunk-budgets", "8"], (">= --max-num-seqs (16)",)),
    ("--transport", ["--transport", "ray"], ("no transfer model for transport 'ray'",
                                             "--transports ray")),
    ("--max-model-len", ["--max-model-len", "100000"], ("context of model tiny-random-llama",)),
    ("--prompt-len", ["--prompt-len", "4-300"], ("--max-model-len 256",)),
    ("--calibrate", ["--calibrate"], ("sweeps its own rates",)),
    ("--rates", ["--dataset", "mooncake", "--trace", str(ROOT / "tests/data/mooncake_example.jsonl"),
                 "--trace-block-tokens", "16", "--rates", "1"],
     ("replayed at its own timestamps", "--rates do not apply")),
    ("--granularity", ["--granularity", "layer"], ("whole-request KV transfers only",)),
    ("--speed-spread", ["--speed-spread", "1.5"], ("< 1",)),
    ("--transport", ["--validate", "--transport", "inprocess"], ("one process per worker",
                                                                 "use 'ray'")),
]
MAP_ROWS = [
    ("--ttft-slo", ["--ttft-slo", "2:1:4"], ("MIN must be <= MAX",)),
    ("--ttft-slo", ["--ttft-slo=-1:1:4"], ("> 0",)),
    ("--tpot-slo", ["--tpot-slo", "0.01:0.1:0"], ("STEPS must be >= 1",)),
    ("--io-ratio", ["--io-ratio", "0"], ("ratio",)),
    ("--validate-rates", ["--validate", "1", "--validate-rates", "-1"], ("> 0",)),
    ("--rates", ["--rates", "0"], ("> 0",)),
    ("--policy", ["--policy", "random"], ("least_loaded",)),
    ("--out", ["--out", "FILE"], ("is a file",)),
    ("--model", ["--model", "no-such-model"], ("unknown model",)),
    ("--dtype", ["--dtype", "float64"], ("float32",)),
    ("--transport", ["--transport", "ray"], ("no transfer model for transport 'ray'",)),
    ("--granularity", ["--granularity", "layer"], ("whole-request KV transfers only",)),
    ("--request-tokens", ["--request-tokens", "1000"], ("--max-model-len",)),
    ("--validate-on", ["--validate-on", "emu"], ("give --validate K too",)),
    ("--emu-kv-scale", ["--emu-kv-scale", "0.5"], ("only with --validate K --validate-on emu",)),
    ("--model", ["--validate", "1", "--validate-on", "emu"],
     ("emulated model 'tiny-random-llama' is not a directory with a config.json",)),
    ("--validate", ["--model", "engine/configs/llama-3.1-8b", "--dtype", "bfloat16",
                    "--device-profile", LLAMA_PROFILE, "--transport", "shm", "--validate", "1"],
     ("the profile describes cuda devices (h100_sxm)", "--validate-on emu")),
]
ROWS = ([("run", *r) for r in EXPERIMENT_ROWS]
        + [(cmd, *r) for cmd in ("run", "compare", "serve") for r in EMULATION_ROWS]
        + [(cmd, "--emu-time-scale", ["--emu-time-scale", "2"], ("only emulated devices",))
           for cmd in ("run", "compare")]
        + [(cmd, "--emu-time-scale", ["--model", "engine/configs/llama-3.1-8b", "--dtype",
                                      "bfloat16", "--devices", "emu:0", "--device-profile",
                                      LLAMA_PROFILE, "--dataset", "multiturn",
                                      "--emu-kv-scale", "0.00390625",
                                      "--emu-time-scale", "2"], ("not to multi-turn conversations (--dataset multiturn)",))
           for cmd in ("run", "compare")]
        + [("plan", "--emu-time-scale", ["--model", "engine/configs/llama-3.1-8b", "--dtype",
                                         "bfloat16", "--profile", LLAMA_PROFILE,
                                         "--device-profile", LLAMA_PROFILE,
                                         "--emu-kv-scale", "0.00390625",
                                         "--emu-time-scale", "2"], ("--validate",))]
        + [("plan", "--emu-time-scale", ["--model", "engine/configs/llama-3.1-8b", "--dtype",
                                         "bfloat16", "--profile", LLAMA_PROFILE,
                                         "--device-profile", LLAMA_PROFILE, "--transport", "shm",
                                         "--validate", "--dataset", "multiturn",
                                         "--emu-kv-scale", "0.00390625",
                                         "--emu-time-scale", "2"], ("not to multi-turn conversations (--dataset multiturn)",))]
        + [("serve", "--emu-time-scale", ["--devices", "emu:0", "--device-profile",
                                          LLAMA_PROFILE, "--emu-time-scale", "2"],
            ("not a server's clients",))]
        + [("compare", *r) for r in EXPERIMENT_ROWS if r[0] != "--placement"]
        + [("compare", "--placements", ["--placements", "disagg:1p1d,disagg:1p1d"],
            ("each placement may appear once", "disagg:1p1d"))]
        + [("compare", "--placements", ["--placements", "colocated:2,disagg:1p1d"],
            ("needs 2 devices",))]
        + [("compare", "--simulate", ["--simulate", "/nonexistent/profile.json"],
            ("cannot read device profile",)),
           ("compare", "--simulate", ["--simulate", TINY_PROFILE, "--model", "tiny-random-llama",
                                      "--dtype", "bfloat16"],
            ("measured on tiny-random-llama (float32), not tiny-random-llama (bfloat16)",))]
        + [(cmd, *row) for cmd in ("run", "compare") for row in _derived_rows(cmd)]
        + [(cmd, *r) for cmd in ("profile", "kv-cost") for r in COMMON_ROWS]
        + [("kv-cost", *r) for r in KV_COST_EMULATION_ROWS]
        + [("profile", "--prompt-lens", ["--prompt-lens", "300,1000"],
            ("no length fits", "256 tokens")),
           ("profile", "--contexts", ["--contexts", "16"], ("at least 2 distinct",)),
           ("profile", "--contexts", ["--contexts", "250,300"], ("fewer than 2 contexts",)),
           ("profile", "--batch-sizes", ["--batch-sizes", "4,4"], ("at least 2 distinct",)),
           ("profile", "--batch-context", ["--batch-context", "0"], (">= 1",)),
           ("profile", "--batch-context", ["--batch-context", "300"], ("must be <= 248",)),
           ("profile", "--pg-prompts", ["--pg-prompts", "x"], ("positive integers",)),
           ("profile", "--pg-outputs", ["--pg-outputs", "-1"], ("positive integers",)),
           ("profile", "--prompt-lens", ["--prompt-lens", "16,16"], ("at least 2 distinct",)),
           ("profile", "--mixed-prompts", ["--mixed-prompts", "0"], ("positive integers",)),
           ("profile", "--mixed-prompts", ["--mixed-prompts", "300"], ("no length fits",)),
           ("profile", "--mixed-batch-sizes", ["--mixed-batch-sizes", "x"], ("positive integers",)),
           ("profile", "--transports", ["--transports", "pigeon"], ("shm", "torchdist")),
           ("profile", "--devices", ["--devices", f"cpu:{NUM_CORES + 5}"], ("does not exist",)),
           ("profile", "--context-batch-sizes", ["--context-batch-sizes", "0"], ("positive integers",)),
           ("profile", "--devices", ["--devices", "cpu:0,cpu:0"], ("must not repeat",)),
           ("profile", "--from-silicon-db", ["--from-silicon-db", "H100 SXM"], ("h100_sxm",)),
           ("profile", "--backend", ["--backend", "tgi"], ("vllm", "sglang", "trtllm")),
           ("profile", "--link", ["--link", "nvlink6"], ("nvlink", "ib400", "tcp25")),
           ("profile", "--tp", ["--tp", "2"], ("sizes a --from-silicon-db profile",)),
           ("profile", "--pp", ["--pp", "0"], ("--pp",)),
           ("kv-cost", "--prompt-lens", ["--prompt-lens", "255,300"], ("no length fits",)),
           ("kv-cost", "--transports", ["--transports", "carrier-pigeon"], ("shm", "torchdist")),
           ("kv-cost", "--transports", ["--transports", "ray,ray"], ("distinct",)),
           ("kv-cost", "--layers-per-chunk", ["--layers-per-chunk", "0"], (">= 1",)),
           ("kv-cost", "--checksum", ["--checksum=maybe"], ())]
        + [("serve", "--placement", ["--placement", "disagg:1p1d"], ("needs 2 devices", "has 1")),
           ("serve", "--placement", ["--placement", "colocated:1,colocated:2"], ("one placement",)),
           ("serve", "--devices", ["--devices", f"cpu:{NUM_CORES + 5}"], ("does not exist",)),
           ("serve", "--address", ["--address", "nowhere"], ("'auto'",)),
           ("serve", "--policy", ["--policy", "random"], ("least_loaded",)),
           ("serve", "--max-worker-restarts", ["--max-worker-restarts", "two"], ("invalid",)),
           ("serve", "--model", ["--model", "no-such-model"], ("unknown model",)),
           ("serve", "--dtype", ["--dtype", "float64"], ("float32",)),
           ("serve", "--max-model-len", ["--max-model-len", "100000"], ("256 tokens",)),
           ("serve", "--port", ["--port", "70000"], ("[0, 65535]",)),
           ("serve", "--local", ["--transport", "shm"], ("needs --transport inprocess",)),
           ("serve", "--transport", ["--no-local", "--transport", "inprocess"], ("needs --local",)),
           ("bench", "--base-url", ["--base-url", "localhost:8000"], ("http://host:port",)),
           ("bench", "--label", ["--label", "vllm@nowhere:1"], ("NAME@PLACEMENT", "colocated:1")),
           ("bench", "--model", ["--model", "no-such-model"], ("unknown model",)),
           ("bench", "--dtype", ["--dtype", "float64"], ("float32",)),
           ("bench", "--max-model-len", ["--max-model-len", "1"], (">= 2",)),
           ("bench", "--max-model-len", ["--max-model-len", "100000"], ("256 tokens",)),
           ("bench", "--rates", ["--rates", "-1"], ("> 0",)),
           ("bench", "--slo-ttft-s", ["--slo-ttft-s", "-1"], ("> 0",)),
           ("bench", "--slo-tpot-s", ["--slo-tpot-s", "0"], ("> 0",)),
           ("bench", "--out", ["--out", "FILE"], ("is a file",)),
           ("bench", "--prompt-len", ["--prompt-len", "4-300"], ("--max-model-len 256",)),
           ("bench", "--dataset", ["--dataset", "sharegpt"], ("needs a tokenizer",))]
        + [(cmd, *row) for cmd in ("serve", "bench") for row in _derived_rows(cmd)]
        + [("interference", *r) for r in COMMON_ROWS if r[0] != "--prompt-lens"]
        + [("interference", *row) for row in _derived_rows("interference")]
        + [("interference", "--prompt-lens", ["--prompt-lens", "0"], ("must hold a length > 0",)),
           ("interference", "--prompt-lens", ["--prompt-lens", "0,300"],
            ("context of model tiny-random-llama", "256 tokens")),
           ("interference", "--chunk-budgets", ["--chunk-budgets", "2"],
            ("> the largest batch size (2)",))]
        + [("plan", *row) for row in _derived_rows("plan")]
        + [("plan", *r) for r in PLAN_ROWS]
        + [("plan", "--emu-time-scale", ["--emu-time-scale", "2"], ("emulated devices only",)),
           ("map", "--emu-time-scale", ["--emu-time-scale", "2"], ("--validate-on emu",))]
        + [(cmd, *r) for cmd in ("run", "compare", "plan") for r in WORKLOAD_ROWS]
        + [("map", *row) for row in _derived_rows("map")]
        + [("map", *r) for r in MAP_ROWS])


@pytest.fixture
def tripwires(monkeypatch):
    """Fail the test if anything past validation runs: Ray, a deployment, a model load."""
    import ray

    fired = []

    def trip(name):
        def _trip(*args, **kwargs):
            fired.append(name)
            raise AssertionError(f"{name} ran before the options were checked")
        return _trip

    monkeypatch.setattr(ray, "init", trip("ray.init"))
    monkeypatch.setattr(experiments.replay, "Deployment", trip("Deployment"))
    monkeypatch.setattr(experiments.commands.compare, "build_workload", trip("build_workload"))
    monkeypatch.setattr(experiments.workload_spec, "load_tokenizer", trip("load_tokenizer"))
    monkeypatch.setattr(experiments.commands.profile, "load_model", trip("load_model"))
    monkeypatch.setattr(experiments.measure, "load_model", trip("load_model"))
    monkeypatch.setattr(experiments.measure, "load_geometry", trip("load_geometry"))
    monkeypatch.setattr(experiments.commands.serve, "Deployment", trip("Deployment"))
    monkeypatch.setattr(experiments.commands.bench, "bench", trip("bench"))
    return fired


def _refuse(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def _options(parser) -> dict[str, set[str]]:
    """command -> its long options (but --help)."""
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: {a.option_strings[0] if len(a.option_strings) == 1 else
                   next(o for o in a.option_strings if o.startswith("--") and
                        not o.startswith("--no-"))
                   for a in command._actions if a.option_strings and a.dest != "help"}
            for name, command in sub.choices.items()}


def test_every_option_has_a_bad_value():
    covered: dict[str, set[str]] = {}
    for command, option, *_ in ROWS:
        covered.setdefault(command, set()).add(option)
    for command, options in _options(cli.build_parser()).items():
        assert options - covered.get(command, set()) == set(), command


def test_every_config_field_has_a_rule():
    for cls in (WorkloadSpec, EngineConfig, TransferConfig, ModelConfig, InterferenceConfig,
                ConditionalConfig, PlanConfig):
        for f in dataclasses.fields(cls):
            has_rule = field_type(f) is bool or any(k in f.metadata for k in RULE_KEYS)
            assert has_rule, f"{cls.__name__}.{f.name} has no rule in its metadata"


@pytest.mark.parametrize("command", sorted(BASE))
def test_base_arguments_pass_the_checks(command, tripwires):
    args = cli.build_parser().parse_args([command] + BASE[command])
    cli.check_options(args)
    assert tripwires == []


@pytest.mark.parametrize("command,option,tail,words", ROWS,
                         ids=[f"{c}{' '.join(t)}" for c, _, t, _ in ROWS])
def test_bad_value_is_refused_before_anything_starts(command, option, tail, words, tmp_path,
                                                      capsys, tripwires):
    tail = [_a_file(tmp_path) if t == "FILE" else t for t in tail]
    line = _refuse([command] + BASE[command] + tail, capsys)
    assert line.startswith(f"pdlab {command}: error: argument {option}")
    for word in words:
        assert word in line, line
    assert tripwires == []


def test_max_model_len_left_unset_is_the_models_context_and_is_recorded():
    args = cli.build_parser().parse_args(["run"] + BASE["run"])
    experiment = cli.check_options(args)
    assert experiment.engine.max_model_len == 256  # tiny model's context, not the 2048 default
    args = cli.build_parser().parse_args(["run"] + BASE["run"] + ["--max-model-len", "128"])
    assert cli.check_options(args).engine.max_model_len == 128


CONSOLE_REFUSALS = [
    (["run", "--slo-ttft-s", "-1"], ("--slo-ttft-s", "> 0")),
    (["compare", "--placements", "disagg:1p1d,disagg:1p1d"], ("--placements", "once")),
]


def test_console_refusal_is_one_line_without_traceback():
    """Each of ``CONSOLE_REFUSALS`` from a console: exit status 2 and one line on stderr,
    naming the option, no traceback."""
    # the processes run side by side: each spends its seconds importing, one core each
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.cli", *argv], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
             for argv, _ in CONSOLE_REFUSALS]
    try:
        for (argv, words), proc in zip(CONSOLE_REFUSALS, procs):
            _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 2, (argv, stderr)
            lines = [line for line in stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and "Traceback" not in stderr, stderr
            assert all(word in lines[0] for word in words), lines[0]
    finally:  # one past its timeout, or left when another failed
        for proc in procs:
            proc.terminate()
            proc.wait()
