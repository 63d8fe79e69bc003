"""report.md for a placement comparison, and the console table the CLI prints.

Numbers are formatted one way in both: seconds (``*_s`` columns) and rates to 4 significant digits,
SLO attainment as a percentage, counts as integers, missing values as ``NaN``. A metric with
``<m>_ci_lo`` / ``<m>_ci_hi`` columns is shown as one cell, ``mean [lo, hi]``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from engine.metrics import SLO
from experiments.analysis import ATTAINMENT_TARGET

CONFIG_KEYS = ("command", "model", "placements", "devices", "workload", "rates", "seeds",
               "git_commit")
DEFINITIONS = [
    "`arrived` is each request's scheduled arrival (run start + its offset): TTFT and E2E "
    "count from it even when the router dispatched it late (no coordinated omission); "
    "`dispatch_lag_p99_s` shows how far the load generator fell behind.",
    "TTFT and E2E use the router clock (the token leaving the router). ITL and TPOT use the "
    "worker clock (when the worker's step produced each token), so the router's polling does "
    "not quantise them; `tpot_router_p99_s` / `itl_router_p99_s` are the router-clock values.",
    "Disaggregated TTFT excludes the KV transfer (the prefill worker sends the first token "
    "before its put, as vLLM's NIXL connector does); the put and the get show in the first "
    "inter-token gap. KV transfer = put + get (`kv_put_p50_s`, `kv_get_p50_s`, "
    "`kv_transfer_p50_s`); `kv_gb_s` = bytes / (put + get seconds).",
    "Each cell with an interval is the mean over seeds and a 95% hierarchical bootstrap "
    "interval (seeds and, inside each, requests resampled; 1000 replicates).",
    "`prefix_hit_rate` = prompt tokens found in the prefix cache / prompt tokens, over every "
    "request (vLLM's hit rate in tokens); `prefill_tokens_skipped` = those cached tokens (the "
    "prefill the cache saved, on the worker that prefilled each request); "
    "`kv_bytes_saved_total` = KV not shipped because the decode worker already held the "
    "prefix. Seed means.",
    "Goodput per device (DistServe): the highest swept rate whose attainment is >= "
    f"{100 * ATTAINMENT_TARGET:.0f}% and at which every lower swept rate also met it, over "
    "the placement's devices.",
]
_INT_COLUMNS = {"num_requests", "num_failed", "kv_bytes_total"}


def format_value(column: str, value: Any) -> str:
    """One cell as text (see the module docstring)."""
    if value is None:
        return "NaN"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)) or hasattr(value, "dtype"):
        try:
            v = float(value)
        except (TypeError, ValueError):
            return str(value)
        if math.isnan(v):
            return "NaN"
        if column in ("slo_attainment", "prefix_hit_rate"):
            return f"{100 * v:.1f}%"
        if column in _INT_COLUMNS or (column not in ("rate",) and v.is_integer()
                                      and not column.endswith("_s")):
            return f"{int(v)}"
        return f"{v:.4g}"
    return str(value)


def collapse_intervals(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with each ``<m>, <m>_ci_lo, <m>_ci_hi`` triple replaced by one text column
    ``<m>`` = ``"mean [lo, hi]"`` (cells through ``format_value``); other columns unchanged."""
    out = df.copy()
    for col in [c for c in df.columns if f"{c}_ci_lo" in df.columns and f"{c}_ci_hi" in df.columns]:
        out[col] = [f"{format_value(col, v)} [{format_value(col, lo)}, {format_value(col, hi)}]"
                    for v, lo, hi in zip(df[col], df[f"{col}_ci_lo"], df[f"{col}_ci_hi"])]
        out = out.drop(columns=[f"{col}_ci_lo", f"{col}_ci_hi"])
    return out


def _cells(df: pd.DataFrame) -> list[list[str]]:
    return [[format_value(c, v) for c, v in zip(df.columns, row)]
            for row in df.itertuples(index=False, name=None)]


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a GitHub markdown table (no index), cells through ``format_value``,
    intervals collapsed (``collapse_intervals``)."""
    df = collapse_intervals(df)
    cols = [str(c) for c in df.columns]
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(c) for c in cols) + " |",
             "|" + "|".join("---" if c in ("placement",) else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(esc(x) for x in row) + " |" for row in _cells(df)]
    return "\n".join(lines)


def format_table(df: pd.DataFrame) -> str:
    """Console table with the runs side by side: one row per metric, one column per run
    (``placement @ rate``), aligned for a terminal; intervals as ``mean [lo, hi]``."""
    if df.empty:
        return "(no runs)"
    df = collapse_intervals(df)
    heads = [f"{p} @ {format_value('rate', r)}" for p, r in zip(df["placement"], df["rate"])]
    metrics = [c for c in df.columns if c not in ("placement", "rate")]
    body = [[c] + [format_value(c, v) for v in df[c]] for c in metrics]
    table = [["metric"] + heads] + body
    widths = [max(len(row[j]) for row in table) for j in range(len(table[0]))]
    out = []
    for i, row in enumerate(table):
        out.append("  ".join(row[0].ljust(widths[0]) if j == 0 else cell.rjust(widths[j])
                             for j, cell in enumerate(row)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _config_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    return str(v)


def write_report(out_dir: str | Path, summary_df: pd.DataFrame, slo: SLO, verdict_text: str,
                 plot_paths: Sequence[str | Path] | Mapping[str, str | Path],
                 config: Mapping[str, Any],
                 goodput: pd.DataFrame | Mapping[str, float] | None = None,
                 title: str = "pdlab placement comparison",
                 transfer_efficiency: pd.DataFrame | None = None) -> Path:
    """Write ``out_dir/report.md`` and return its path.

    Sections: title; run config (``CONFIG_KEYS`` first, missing ones shown as "(not given)",
    then any other keys); SLOs; definitions (clocks, put in TTFT, intervals, goodput); the
    summary table (markdown, intervals as ``mean [lo, hi]``); optional goodput per device
    (``analysis.goodput_table`` or a mapping placement -> value); optional KV transfer
    efficiency per placement (``analysis.transfer_efficiency``); the verdict; the plots as
    relative image links (``plot_paths``: a list, or a mapping caption -> path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.md"
    lines = [f"# {title}", "", "## Run config", ""]
    keys = list(CONFIG_KEYS) + [k for k in config if k not in CONFIG_KEYS]
    for k in keys:
        lines.append(f"- **{k}**: {_config_value(config[k]) if k in config else '(not given)'}")
    lines += ["", "## SLOs", "",
              f"- TTFT <= {slo.ttft_s:g} s",
              f"- TPOT <= {slo.tpot_s:g} s",
              "- A request attains the SLO when it meets both (failed requests miss).",
              "", "## Definitions", ""] + [f"- {d}" for d in DEFINITIONS] + [
              "", "## Summary", "",
              "Seconds (`*_s`) to 4 significant digits; latencies over completed requests; "
              "NaN where no request had the value.", "",
              markdown_table(summary_df), ""]
    if goodput is not None and len(goodput):
        table = goodput if isinstance(goodput, pd.DataFrame) else pd.DataFrame(
            {"placement": list(goodput), "goodput_per_device_req_s": list(goodput.values())})
        lines += ["## Goodput per device", "",
                  "DistServe's definition: the highest swept rate with >= "
                  f"{100 * ATTAINMENT_TARGET:.0f}% SLO attainment there and at every lower swept "
                  "rate, divided by the placement's devices; mean over seeds (one sweep per "
                  "seed) with a 95% bootstrap interval.", "", markdown_table(table), ""]
    if transfer_efficiency is not None and len(transfer_efficiency):
        lines += ["## KV transfer efficiency", "",
                  "Each transfer (one chunk) against the link peak its deployment measured at "
                  "start (`kv_transfer.link`: a memcpy within a node, a probe between nodes); "
                  "medians over chunks, all rates and seeds; `exposed_share` = exposed / "
                  "(put + get) seconds (layer-wise streaming hides the rest behind prefill).",
                  "", markdown_table(transfer_efficiency), ""]
    lines += ["## Verdict", "", verdict_text.strip() or "(none)", "", "## Plots", ""]
    items = (list(plot_paths.items()) if isinstance(plot_paths, Mapping)
             else [(Path(p).stem.replace("_", " "), p) for p in plot_paths])
    for caption, p in items:
        rel = Path(os.path.relpath(Path(p).resolve(), out_dir.resolve())).as_posix()
        lines += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    path.write_text("\n".join(lines))
    return path


def append_section(out_dir: str | Path, title: str, lines: Sequence[str],
                   image: str | Path | None = None) -> Path:
    """Append a section to ``out_dir/report.md`` (written by ``write_report``): ``## title``,
    ``lines`` as a code block (they are aligned text), and ``image`` as a relative image link when
    given. Returns the report's path.

    Raises:
        FileNotFoundError: no report.md there yet."""
    path = Path(out_dir) / "report.md"
    text = path.read_text()
    extra = ["", f"## {title}", "", "```", *lines, "```", ""]
    if image is not None:
        rel = Path(os.path.relpath(Path(image).resolve(), Path(out_dir).resolve())).as_posix()
        extra += [f"![{title}]({rel})", ""]
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(extra))
    return path
