"""``benchmarks.multiturn_placements`` is a thin driver of ``pdlab compare``: its command line
parses with compare's own options, and its table reads compare's summary (hit rate and
skipped prefill from ``engine.metrics.summarize``)."""

from __future__ import annotations

import argparse

from benchmarks import multiturn_placements as mp
from engine.metrics import SLO, RequestRecord
from experiments import analysis, cli


def test_its_command_line_is_compares_own():
    args = argparse.Namespace(model="smollm2-135m", num_conversations=6, max_turns=3,
                              think_time_s=0.5, max_output_len=16, max_model_len=1024,
                              rates="0.5,2", seeds=3)
    argv = mp.compare_argv(args, "out", ["--slo-ttft-s", "4"])
    parsed = cli.build_parser(loaded=["compare"]).parse_args(argv)
    assert parsed.placements == ["colocated:2", "disagg:1p1d", "conditional:1p1d"]
    assert (parsed.policy, parsed.dataset, parsed.num_requests, parsed.max_turns) == (
        "cache_aware", "multiturn", 6, 3)
    assert (parsed.rates, parsed.seeds, parsed.slo_ttft_s) == ([0.5, 2.0], 3, 4.0)


def test_its_table_shows_the_hit_rate_and_the_prefill_skipped():
    """Two turns of 40 and 56 prompt tokens, 0 and 32 cached: 32 of 96 skipped = 33.3%."""
    recs = []
    for i, (n, hit) in enumerate([(40, 0), (56, 32)]):
        recs.append(RequestRecord(f"t{i}", "colocated:2", num_prompt_tokens=n,
                                  num_cached_prompt_tokens=hit, output_token_ids=[1, 2],
                                  timeline={"arrived": 10.0 + i}, token_times_s=[10.5 + i, 10.6 + i]))
    summary = analysis.summary_table([("colocated:2", 0.5, recs)], SLO(2.0, 0.1), num_boot=10)
    lines = mp.table(summary).splitlines()
    assert lines[0].split(" | ")[-3:] == ["prefix_hit_rate", "prefill_tokens_skipped",
                                          "kv_bytes_saved_total |"]
    assert lines[2].endswith("| 33.3% | 32 | 0 |") and lines[2].startswith("| colocated:2 | 0.5 | 2 | 0 |")
