"""`pdlab interference` through the real Engine on the tiny model: every injection runs the
tokens its mode says, in the steps it says, and leaves the engine empty; the command writes
its files. (No timing is asserted: the stub-engine test checks the arithmetic.)"""

from __future__ import annotations

import pandas as pd

from experiments import cli
from experiments.commands import interference as itf

GRID = itf.InterferenceConfig(batch_sizes="1,3", prompt_lens="0,9,30", context_len=12,
                              chunk_budgets="10")


def test_injections_run_the_tokens_of_their_mode(tiny):
    steps, imports = itf.run_interference(tiny, GRID, repeats=1, show_progress=False)
    inj = steps[steps["kind"] == "injection"]
    for (mode, budget, b, p), group in inj.fillna({"budget": -1}).groupby(
            ["mode", "budget", "batch_size", "prompt_len"]):
        assert (group["num_decode_tokens"] == (b + 1 if mode == itf.DISAGG else b)).all()
        prefill = group["num_prefill_tokens"].tolist()
        if mode == itf.NOCHUNK:
            assert prefill == [p]
        elif mode == itf.CHUNKED:  # chunks of K - B, the last one the rest
            chunk = int(budget) - b
            assert prefill == [chunk] * (p // chunk) + ([p % chunk] if p % chunk else [])
        else:
            assert prefill == [0] and group["num_import_tokens"].tolist() == [p]
    base = steps[steps["kind"] == "baseline"]
    assert (base["num_prefill_tokens"] == 0).all()
    assert (base["num_decode_tokens"] == base["batch_size"]).all()
    assert sorted(imports["prompt_len"]) == [9, 9, 30, 30]  # B = 1, 3
    summary = itf.summarize(steps, imports)
    assert len(summary) == 3 * 2 * 3  # modes x B x P
    assert set(itf.fit_step_model(steps)) == {"colocated-nochunk", "chunked-K10", "disagg"}


def test_command_writes_csv_heatmap_and_sentence(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["interference", "--model", "tiny-random-llama", "--quick", "--repeats", "1",
                     "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "On this device (cpu, tiny-random-llama float32), a 48-token prefill stalls a " \
           "2-request decode batch by" in printed
    summary = pd.read_csv(out / "interference.csv")
    assert set(summary["mode"]) == {"colocated-nochunk", "chunked", "disagg"}
    assert set(pd.read_csv(out / "fits.csv")["mode"]) == {"colocated-nochunk", "chunked-K12",
                                                           "disagg"}
    assert (out / "interference.png").read_bytes()[:4] == b"\x89PNG"
    assert "a 48-token prefill stalls" in (out / "summary.md").read_text()
