"""``pdlab bench`` against ``pdlab serve`` (tiny model, in-process colocated:1): the results
directory holds the workload's requests with client-side timelines, and analysis reads it
back to the same summary; ``merge`` joins two such directories into one comparison."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from engine import metrics as m
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import ARRIVED, SLO, RequestRecord
from experiments import workload_spec
from experiments import analysis, cli, workloads
from experiments.commands import bench
from deployment.placement import Deployment
from server.app import OpenAIServer, ServerThread
from server.text import ByteText

TINY = ModelConfig("tiny-random-llama")
ARGS = ["--model", "tiny-random-llama", "--dataset", "synthetic", "--prompt-len", "4-20",
        "--output-len", "2-6", "--num-requests", "6", "--seeds", "1", "--rates", "20",
        "--max-model-len", "64"]


@pytest.fixture(scope="module")
def url():
    engine = EngineConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64)
    with Deployment(PlacementConfig("colocated:1", "cpu:0"), TINY, engine,
                    TransferConfig(transport="inprocess"), local=True) as dep:
        server = ServerThread(OpenAIServer(dep.router, ByteText(), "tiny").app).start()
        try:
            yield server.url
        finally:
            server.stop()


def read_records(path) -> list[tuple[float, int, RequestRecord]]:
    rows = [json.loads(line) for line in open(path / "requests.jsonl")]
    assert rows[0]["type"] == "config"
    return [(r.pop("rate"), r.pop("seed"), RequestRecord.from_dict(r))
            for r in rows[1:] if r.pop("type") == "request"]


def test_bench_writes_the_results_directory_that_analysis_reads(url, tmp_path):
    out = tmp_path / "pdlab"
    code = cli.main(["bench", "--base-url", url, "--label", "pdlab@colocated:1",
                     "--out", str(out)] + ARGS)
    assert code == 0
    for name in ("requests.jsonl", "summary.csv", "summary_seeds.csv", "report.md"):
        assert (out / name).exists(), name
    spec = workload_spec.WorkloadSpec(dataset="synthetic", prompt_len="4-20", output_len="2-6",
                                num_requests=6, seeds=1)
    items = workload_spec.build_workload(spec, TINY, 0, 64)
    timed = workloads.with_arrivals(items, 20.0, 0, "poisson")
    records = [r for _, _, r in read_records(out)]
    assert len(records) == 6
    for item, record in zip(timed, records):
        assert record.error is None, record.error
        assert record.placement == "pdlab@colocated:1"
        assert record.num_prompt_tokens == item.num_prompt_tokens
        assert len(record.token_times_s) == item.output_len  # one chunk per token
    # arrivals are the workload's schedule (open loop), whatever the server did
    offsets = np.array([r.timeline[ARRIVED] for r in records]) - records[0].timeline[ARRIVED]
    assert np.allclose(offsets, [t.arrival_s - timed[0].arrival_s for t in timed], atol=1e-6)
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["placement"]) == ["pdlab@colocated:1"]
    for name in ("steps.csv", "transfers.csv"):  # a client sees no worker steps: header only
        table = pd.read_csv(out / name)
        assert table.empty and list(table.columns) == ["placement", "rate", "seed"]
    assert summary["num_requests"][0] == 6 and summary["num_failed"][0] == 0
    # the same definitions: the summary is engine.metrics over the records read back
    seeds = pd.read_csv(out / "summary_seeds.csv")
    row = analysis.summary_row("pdlab@colocated:1", 20.0, records, SLO(2.0, 0.1),
                               duration_s=float(seeds["duration_s"][0]))
    assert row["ttft_p50_s"] == pytest.approx(float(seeds["ttft_p50_s"][0]))
    assert row["ttft_p50_s"] == pytest.approx(float(np.median([m.ttft_s(r) for r in records])))
    assert row["output_tok_s"] == pytest.approx(sum(t.output_len for t in timed) /
                                                float(seeds["duration_s"][0]))


def test_merge_joins_two_results_directories_into_one_comparison(url, tmp_path):
    spec = workload_spec.WorkloadSpec(dataset="synthetic", prompt_len="4-20", output_len="2-6",
                                num_requests=4, seeds=1)
    slo = SLO(2.0, 0.1)
    for label in ("a@colocated:1", "b@disagg:1p1d"):
        config = bench.BenchConfig(base_url=url, label=label)
        bench.bench(config, spec, TINY, 64, [20.0], slo, tmp_path / label.split("@")[0])
    summary, verdict = bench.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "both", slo)
    assert list(summary["placement"]) == ["a@colocated:1", "b@disagg:1p1d"]
    assert (summary["num_requests"] == 4).all() and (tmp_path / "both" / "report.md").exists()
    assert analysis.placement_kind("b@disagg:1p1d") == "disagg"
    # one pdlab server behind both labels (its /v1/models owned_by), no transfer a client sees
    lines = (tmp_path / "b" / "requests.jsonl").read_text().splitlines()
    config = json.loads(lines[0])
    assert config["server"] == "pdlab"
    assert "colocated/disagg = " in verdict and "different systems" not in verdict
    assert "KV transfer" not in verdict
    # the same records said to come from vLLM's server: no interference claim
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "requests.jsonl").write_text(
        "\n".join([json.dumps({**config, "server": "vllm"})] + lines[1:]) + "\n")
    _, verdict = bench.merge([tmp_path / "a", tmp_path / "v"], tmp_path / "other", slo)
    assert "(different systems, pdlab server over HTTP vs vllm server over HTTP: not a " \
           "measure of prefill-decode interference)" in verdict
    with pytest.raises(ValueError, match="two directories"):
        bench.merge([tmp_path / "a", tmp_path / "a"], tmp_path / "again", slo)


def test_merge_of_a_directory_without_requests_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "bench-vllm").mkdir()
    with pytest.raises(SystemExit) as exited:
        bench.main(["merge", "--out", str(tmp_path / "both"), str(tmp_path / "bench-vllm")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("python -m experiments.commands.bench merge: error: argument dirs: "
                          f"{tmp_path / 'bench-vllm'} has no requests.jsonl")
    assert not (tmp_path / "both").exists()  # nothing written


def test_bench_records_a_refusing_server_as_failures_not_a_crash(url, tmp_path):
    spec = workload_spec.WorkloadSpec(dataset="synthetic", prompt_len="4-20", output_len="2-6",
                                num_requests=2, seeds=1)
    config = bench.BenchConfig(base_url=url, served_model="no-such-model")
    with pytest.raises(RuntimeError, match="warm-up"):
        bench.bench(config, spec, TINY, 64, [20.0], SLO(2.0, 0.1), tmp_path / "x")
