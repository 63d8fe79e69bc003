"""``pdlab plan`` end to end (the CLI) on the prefix-sharing workloads:
``--dataset prefix_repetition`` and ``mooncake`` on the tiny model, ``multiturn`` on
SmolLM2's tokenizer (the tiny model has none and is refused in one line). The simulator's
prefix-cache hit rate in plan_runs.csv is the hand-counted one; caching off, it is 0."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from engine.config import ModelConfig
from experiments import cli
from experiments.workload_spec import WorkloadSpec, build_workload

DATA = Path(__file__).resolve().parents[1] / "data"
TINY_PROFILE = DATA / "tiny_device_profile.json"
TRACE = DATA / "mooncake_example.jsonl"


def _plan(tmp_path: Path, *options: str, model: str = "tiny-random-llama",
          profile: Path = TINY_PROFILE, name: str = "plan") -> pd.DataFrame:
    out = tmp_path / name
    code = cli.main(["plan", "--model", model, "--profile", str(profile), "--devices", "1",
                     "--seeds", "1", "--jobs", "1", "--out", str(out), *options])
    assert code == 0
    return pd.read_csv(out / "plan_runs.csv")


def test_prefix_repetition_hits_every_later_question_of_a_prefix(tmp_path):
    """2 system prompts of 32 tokens (2 blocks of 16) x 4 questions of 8 tokens, 4 output
    tokens, one request at a time (1 req/s, steps of ~1.5 ms): each prefix's first question
    finds nothing, the other 3 find both prefix blocks: 6 x 32 = 192 of 8 x 40 = 320 prompt
    tokens = 0.6. Caching off: 0."""
    workload = ["--dataset", "prefix_repetition", "--num-requests", "8", "--num-prefixes", "2",
                "--prefix-len", "32", "--suffix-len", "8", "--max-output-len", "4",
                "--rates", "1", "--transport", "inprocess"]
    runs = _plan(tmp_path, *workload)
    assert set(runs["placement"]) == {"colocated:1", "colocated-nochunk:1"}
    assert (runs["num_requests"] == 8).all() and (runs["num_failed"] == 0).all()
    assert runs["prefix_hit_rate"].tolist() == pytest.approx([192 / 320] * len(runs))
    off = _plan(tmp_path, *workload, "--no-enable-prefix-caching", name="off")
    assert (off["prefix_hit_rate"] == 0).all()


def test_mooncake_trace_runs_once_at_its_own_times_with_the_hand_counted_hits(tmp_path, capsys):
    """tests/data/mooncake_example.jsonl at 16 tokens per hash id (= one KV block each):
    cached prompt tokens per line (full blocks of earlier prompts whose hash ids lead this
    one's) 0, 32, 0, 32, 0, 32, 16, 0, 64, 32, 0, 32 = 240 of 529 prompt tokens. One run per
    placement, labelled with the trace's mean rate, 11 gaps over 1.637 s = 6.72 req/s;
    ``--rates`` is refused."""
    runs = _plan(tmp_path, "--dataset", "mooncake", "--trace", str(TRACE),
                 "--trace-block-tokens", "16", "--transport", "inprocess")
    assert runs["rate"].tolist() == [6.72] * len(runs) and (runs["num_requests"] == 12).all()
    assert runs["prefix_hit_rate"].tolist() == pytest.approx([240 / 529] * len(runs))
    out = capsys.readouterr().out
    assert "replayed at its own timestamps (mean 6.72 req/s)" in out
    assert "rerun with higher --rates" not in out
    with pytest.raises(SystemExit) as err:
        cli.main(["plan", "--model", "tiny-random-llama", "--profile", str(TINY_PROFILE),
                  "--dataset", "mooncake", "--trace", str(TRACE), "--trace-block-tokens", "16",
                  "--rates", "1", "--out", str(tmp_path / "refused")])
    assert err.value.code == 2
    assert "--rates: a mooncake trace is replayed at its own timestamps" in capsys.readouterr().err


def test_multiturn_plans_every_turn_and_needs_a_tokenizer(tmp_path, capsys):
    """3 SmolLM2-tokenized ShareGPT conversations of 2-3 turns, on the built-in SmolLM2
    profile: every planned turn is simulated (closed loop), later turns hit their own
    history (and the chat template's system prompt), caching off hits nothing. The tiny
    model is refused naming the datasets that need no tokenizer."""
    from benchmarks import plan_speed

    profile, _ = plan_speed.load_profile(None, ModelConfig("smollm2-135m"))
    path = profile.save(tmp_path / "smollm2.json")
    spec = WorkloadSpec(dataset="multiturn", num_requests=3, max_turns=3, max_output_len=8,
                        seeds=1)
    turns = len(build_workload(spec, ModelConfig("smollm2-135m"), 0, 2048))
    assert 6 <= turns <= 9
    workload = ["--dataset", "multiturn", "--num-requests", "3", "--max-turns", "3",
                "--max-output-len", "8", "--think-time-s", "0", "--rates", "0.2",
                "--transport", "ray"]
    runs = _plan(tmp_path, *workload, model="smollm2-135m", profile=path)
    assert (runs["num_requests"] == turns).all() and (runs["num_failed"] == 0).all()
    assert (runs["prefix_hit_rate"] > 0.3).all() and (runs["prefix_hit_rate"] < 1).all()
    assert f"rates [0.2] conversations/s x 1 seeds x {turns} requests" in capsys.readouterr().out
    off = _plan(tmp_path, *workload, "--no-enable-prefix-caching", model="smollm2-135m",
                profile=path, name="off")
    assert (off["prefix_hit_rate"] == 0).all()
    assert cli.main(["plan", "--model", "tiny-random-llama", "--profile", str(TINY_PROFILE),
                     "--dataset", "multiturn", "--transport", "inprocess",
                     "--out", str(tmp_path / "tiny")]) == 2
    assert "has no tokenizer: use --dataset synthetic, prefix_repetition or mooncake" in (
        capsys.readouterr().err)
