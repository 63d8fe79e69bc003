"""experiments.plots write real PNGs; experiments.report writes report.md with the table,
the verdict and relative plot links; all-failed runs render as NaN instead of crashing."""

import math
import re

import pandas as pd

from engine.metrics import SLO, RequestRecord
from experiments import analysis as a
from experiments import plots, report

T0 = 1000.0
SLO_ = SLO(ttft_s=0.5, tpot_s=0.15)
COLO, DIS = "colocated:2", "disagg:1p1d"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rec(rid, placement, arrived, tokens, error=None, workers=(None, None), **events):
    tl = {"arrived": T0 + arrived}
    tl.update({k: T0 + v for k, v in events.items()})
    return RequestRecord(request_id=rid, placement=placement, prefill_worker=workers[0],
                         decode_worker=workers[1], output_token_ids=list(range(len(tokens))),
                         error=error, kv_transfer_s=0.05 if "kv_put" in events else None,
                         timeline=tl, token_times_s=[T0 + t for t in tokens])


def records():
    colo = [rec(f"c{i}", COLO, 0.2 * i, [0.2 * i + 0.2 + 0.1 * k + (0.6 if i == 1 and k >= 2 else 0)
                                          for k in range(6)],
                prefill_started=0.2 * i, prefill_finished=0.2 * i + 0.2,
                workers=(f"engine{i % 2}",) * 2) for i in range(15)]
    dis = [rec(f"d{i}", DIS, 0.2 * i, [0.2 * i + 0.2 + 0.1 * k for k in range(6)],
               prefill_started=0.2 * i, prefill_finished=0.2 * i + 0.2, kv_put=0.2 * i + 0.2,
               kv_got=0.2 * i + 0.25, decode_admitted=0.2 * i + 0.26,
               workers=("prefill0", "decode0")) for i in range(15)]
    return {COLO: colo, DIS: dis}


def steps():
    colo = [{"worker": f"engine{i % 2}", "start_s": T0 + 0.2 * i, "duration_s": 0.2,
             "num_requests": 2, "num_prefill_tokens": 16, "num_decode_tokens": 1} for i in range(15)]
    colo += [{"worker": "engine0", "start_s": T0 + 3.2 + 0.1 * k, "duration_s": 0.1,
              "num_requests": 1, "num_prefill_tokens": 0, "num_decode_tokens": 1} for k in range(5)]
    dis = [{"worker": "prefill0", "start_s": T0 + 0.2 * i, "duration_s": 0.2, "num_requests": 1,
            "num_prefill_tokens": 16, "num_decode_tokens": 0} for i in range(15)]
    dis += [{"worker": "decode0", "start_s": T0 + 0.3 + 0.1 * k, "duration_s": 0.1,
             "num_requests": 3, "num_prefill_tokens": 0, "num_decode_tokens": 3} for k in range(30)]
    return {COLO: colo, DIS: dis}


def failed():
    return [rec(f"f{i}", COLO, 0.1 * i, [], error="boom") for i in range(3)]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 1024, f"{path} is only {len(data)} bytes"


def all_plots(tmp_path, by_placement, step_map, runs):
    summary = a.summary_table(runs, SLO_, num_boot=100)
    curve = a.attainment_curve(summary)
    bd = a.latency_breakdown(by_placement)
    return {
        "Latency CDFs": plots.plot_cdfs(by_placement, tmp_path / "plots" / "cdfs.png"),
        "SLO attainment": plots.plot_attainment(curve, tmp_path / "plots" / "attainment.png"),
        "p99 bars": plots.plot_p99_bars(summary, tmp_path / "plots" / "p99.png"),
        "Token timeline": plots.plot_token_timeline(by_placement, step_map,
                                                    tmp_path / "plots" / "timeline.png"),
        "Latency breakdown": plots.plot_breakdown(bd, tmp_path / "plots" / "breakdown.png"),
    }


def test_every_plot_writes_a_png(tmp_path):
    recs = records()
    runs = [(p, rate, rs) for p, rs in recs.items() for rate in (1.0, 2.0)]
    paths = all_plots(tmp_path, recs, steps(), runs)
    assert len({str(p) for p in paths.values()}) == 5
    for p in paths.values():
        assert p.exists() and p.parent == tmp_path / "plots"
        assert_png(p)


def test_token_timeline_caps_requests_and_accepts_step_objects(tmp_path):
    from engine.metrics import StepRecord  # steps may be StepRecord objects without a worker

    recs = records()
    objs = {COLO: [StepRecord(T0 + 0.2 * i, 0.2, 2, 16, 1) for i in range(15)], DIS: []}
    p = plots.plot_token_timeline(recs, objs, tmp_path / "t.png", max_requests=5)
    assert_png(p)
    shown = plots._pick_requests(recs[COLO], 12)
    assert len(shown) == 12 and shown[0].request_id == "c0" and shown[-1].request_id == "c14"


def test_report_has_config_slo_table_verdict_and_plot_links(tmp_path):
    recs = records()
    runs = [(p, rate, rs) for p, rs in recs.items() for rate in (1.0, 2.0)]
    df = a.summary_table(runs, SLO_)
    gp = a.goodput_table(runs, SLO_, 2, num_boot=100)
    text = a.verdict(df, SLO_, goodput=gp)
    plot_paths = all_plots(tmp_path, recs, steps(), runs)
    config = {"model": "smollm2-135m", "placements": [COLO, DIS], "devices": "cpu x2",
              "workload": "synthetic", "rates": [1.0, 2.0], "seeds": [0, 1]}
    path = report.write_report(tmp_path / "out", df, SLO_, text, plot_paths, config, goodput=gp)
    assert path == tmp_path / "out" / "report.md"
    md = path.read_text()
    assert md.startswith("# ")
    header = "| " + " | ".join(report.collapse_intervals(df).columns) + " |"
    assert header in md and "_ci_lo" not in header
    assert md.index("| placement | rate | num_seeds | num_requests") < md.index("## Verdict")
    for key, val in (("model", "smollm2-135m"), ("placements", f"{COLO}, {DIS}"),
                     ("rates", "1.0, 2.0"), ("seeds", "0, 1"), ("devices", "cpu x2")):
        assert f"- **{key}**: {val}" in md
    assert "TTFT <= 0.5 s" in md and "TPOT <= 0.15 s" in md
    assert text.splitlines()[0] in md
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert links == ["../plots/cdfs.png", "../plots/attainment.png", "../plots/p99.png",
                     "../plots/timeline.png", "../plots/breakdown.png"]
    for link in links:
        assert_png((path.parent / link).resolve())
    # one data row per run, seconds to 4 significant digits, attainment as a percentage
    summary = md[md.index("## Summary"):md.index("## Goodput per device")]
    rows = [line for line in summary.splitlines() if line.startswith(f"| {COLO} |")]
    assert len(rows) == 2
    # colocated TPOT p99 at rate 1, 4 significant digits, then its interval
    assert re.search(r"\| 0\.2032 \[0\.\d+, 0\.\d+\] \|", rows[0])
    assert "| 93.3% [" in rows[0]
    assert "| placement | num_devices | num_seeds | goodput_per_device_req_s |" in md
    assert f"| {COLO} | 2 | 1 | 1 [" in md and f"| {DIS} | 2 | 1 | 1 [" in md  # 2 req/s / 2
    assert "## Definitions" in md and "excludes the KV transfer" in md


def test_format_value_rules():
    f = report.format_value
    assert f("ttft_p50_s", 0.123456) == "0.1235"
    assert f("ttft_p50_s", 12.34567) == "12.35"
    assert f("ttft_p50_s", float("nan")) == "NaN"
    assert f("ttft_p50_s", None) == "NaN"
    assert f("slo_attainment", 2 / 3) == "66.7%"
    assert f("num_requests", 3.0) == "3"
    assert f("rate", 2.0) == "2"
    assert f("placement", COLO) == COLO


def test_format_table_side_by_side():
    recs = records()
    df = a.summary_table([(COLO, 2.0, recs[COLO]), (DIS, 2.0, recs[DIS])], SLO_)
    out = report.format_table(df)
    lines = out.splitlines()
    assert f"{COLO} @ 2" in lines[0] and f"{DIS} @ 2" in lines[0]
    assert lines[0].index(COLO) < lines[0].index(DIS)
    metric_rows = [line.split()[0] for line in lines[2:]]
    assert metric_rows == list(report.collapse_intervals(df).columns[2:])
    assert metric_rows[:4] == ["num_seeds", "num_requests", "num_failed", "slo_attainment"]
    att = next(line for line in lines if line.startswith("slo_attainment"))
    assert re.search(r"\d+\.\d% \[\d+\.\d%, \d+\.\d%\]", att)  # mean [lo, hi]
    assert len({len(line) for line in lines}) == 1  # aligned
    assert report.format_table(df.iloc[0:0]) == "(no runs)"


def test_markdown_table_escapes_and_shape():
    df = pd.DataFrame({"placement": ["a|b"], "ttft_p50_s": [0.5]})
    md = report.markdown_table(df)
    assert md.splitlines() == ["| placement | ttft_p50_s |", "|---|---:|", "| a\\|b | 0.5 |"]


def test_all_failed_run_renders_nan_everywhere(tmp_path):
    by_placement = {COLO: failed()}
    runs = [(COLO, 1.0, failed())]
    df = a.summary_table(runs, SLO_)
    assert math.isnan(df.iloc[0]["ttft_p50_s"])
    text = a.verdict(df, SLO_)
    paths = all_plots(tmp_path, by_placement, {COLO: []}, runs)
    for p in paths.values():
        assert_png(p)
    md = report.write_report(tmp_path, df, SLO_, text, list(paths.values()), {"model": "m"}
                             ).read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {COLO} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    cols = list(report.collapse_intervals(df).columns)
    assert cells[cols.index("ttft_p50_s")] == "NaN [NaN, NaN]"
    assert cells[cols.index("num_failed")] == "3"
    assert cells[cols.index("slo_attainment")] == "0.0% [0.0%, 0.0%]"
    assert "- **seeds**: (not given)" in md
    assert "NaN" in report.format_table(df)
