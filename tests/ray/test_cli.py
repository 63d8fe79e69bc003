"""`pdlab compare` / `pdlab run` end to end on the tiny model: the results directory, its
files and columns, and clear errors for bad options."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from experiments.analysis import SUMMARY_COLUMNS
from experiments.cli import main

pytestmark = pytest.mark.ray


# In the shared cluster, which pdlab joins; a run that starts its own (and shuts it down) is
# test_worker_that_fails_to_start_shows_the_root_cause's.
@pytest.mark.usefixtures("shared_ray")
def test_compare_writes_results_directory(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--model", "tiny-random-llama", "--dataset", "synthetic",
                 "--num-requests", "6", "--prompt-len", "4-30", "--output-len", "3-8",
                 "--rates", "20", "--seeds", "2", "--devices", "cpu:0,cpu:1",
                 "--max-model-len", "128",
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "colocated:2 @ 20" in printed and "disagg:1p1d @ 20" in printed
    assert "Verdict (" in printed and "At 20 req/s: " in printed
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns[:len(SUMMARY_COLUMNS)]) == SUMMARY_COLUMNS
    assert sorted(summary["placement"]) == ["colocated:2", "disagg:1p1d"]
    assert (summary["num_failed"] == 0).all() and (summary["num_requests"] == 12).all()
    assert (summary["num_seeds"] == 2).all()
    rows = [json.loads(line) for line in open(out / "requests.jsonl")]
    assert rows[0]["type"] == "config" and rows[0]["model"] == "tiny-random-llama"
    assert rows[0]["devices"] == ["cpu:0", "cpu:1"] and "torch" in rows[0]["versions"]
    requests = pd.DataFrame(rows[1:])
    assert len(requests) == 24 and requests["error"].isna().all()
    assert rows[0]["command"].startswith(sys.executable)  # main() ran inside pytest here
    assert [w["torch_num_threads"] for w in rows[0]["workers"]] == [1, 1, 1, 1]  # 1 core each
    # the same workload went to both placements: identical prompts and greedy outputs
    by_placement = {p: g.sort_values("request_id") for p, g in requests.groupby("placement")}
    colo, disagg = by_placement["colocated:2"], by_placement["disagg:1p1d"]
    assert list(colo["num_prompt_tokens"]) == list(disagg["num_prompt_tokens"])
    assert list(colo["output_token_ids"]) == list(disagg["output_token_ids"])
    for name in ("report.md", "steps.csv", "transfers.csv", "cdf_ttft_tpot.png",
                 "slo_attainment.png", "token_timeline.png", "latency_breakdown.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| placement |" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["run", "--placement", "disagg:0p1d"], "disagg:xPyD needs x, y >= 1"),
    (["compare", "--dataset", "wiki"], "invalid choice: 'wiki'"),
    (["compare", "--rates", "-1"], "rates must be > 0"),
    (["run", "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
    (["run", "--num-requests", "0"], "argument --num-requests: num_requests must be >= 1"),
])
def test_bad_options_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_placement_larger_than_device_set_fails_before_loading(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--placement", "disagg:2p1d", "--devices", "cpu:0,cpu:1",
              "--model", "tiny-random-llama", "--dataset", "synthetic", "--prompt-len", "4-30",
              "--output-len", "3-8", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "needs 3 devices, the device set cpu:0,cpu:1 has 2" in capsys.readouterr().err


def test_worker_that_fails_to_start_shows_the_root_cause(tmp_path, capsys):
    """A model directory with a config but no weights: the workers die in their creation
    task; the one line the user sees keeps the OSError, not only Ray's "actor died"."""
    from engine.model import tiny_llama_config

    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(tiny_llama_config().to_json_string())
    code = main(["run", "--model", str(model_dir), "--dataset", "synthetic", "--num-requests", "2",
                 "--prompt-len", "4-8", "--output-len", "2-3", "--devices", "cpu:0,cpu:1",
                 "--max-model-len", "64", "--out", str(tmp_path / "out")])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pdlab")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "worker" in line and "failed to start" in line and "creation task" in line
    assert "(cause: OSError:" in line and str(model_dir) in line
    assert "\x1b" not in line
