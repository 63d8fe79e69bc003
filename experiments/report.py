"""report.md for a placement comparison, and the console table the CLI prints.

Numbers are formatted one way in both: seconds (``*_s`` columns) and rates to 4 significant
digits, SLO attainment as a percentage, counts as integers, missing values as ``NaN``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from engine.metrics import SLO
from experiments.analysis import ATTAINMENT_TARGET

CONFIG_KEYS = ("model", "placements", "devices", "workload", "rates", "seed")
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
        if column == "slo_attainment":
            return f"{100 * v:.1f}%"
        if column in _INT_COLUMNS or (column not in ("rate",) and v.is_integer()
                                      and not column.endswith("_s")):
            return f"{int(v)}"
        return f"{v:.4g}"
    return str(value)


def _cells(df: pd.DataFrame) -> list[list[str]]:
    return [[format_value(c, v) for c, v in zip(df.columns, row)]
            for row in df.itertuples(index=False, name=None)]


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a GitHub markdown table (no index), cells through ``format_value``."""
    cols = [str(c) for c in df.columns]
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(c) for c in cols) + " |",
             "|" + "|".join("---" if c in ("placement",) else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(esc(x) for x in row) + " |" for row in _cells(df)]
    return "\n".join(lines)


def format_table(df: pd.DataFrame) -> str:
    """Console table with the runs side by side: one row per metric, one column per run
    (``placement @ rate``), aligned for a terminal."""
    if df.empty:
        return "(no runs)"
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
                 config: Mapping[str, Any], goodput: Mapping[str, float] | None = None,
                 title: str = "pdlab placement comparison") -> Path:
    """Write ``out_dir/report.md`` and return its path.

    Sections: title; run config (``CONFIG_KEYS`` first, missing ones shown as "(not given)",
    then any other keys); SLOs; the summary table (markdown); optional goodput per device
    (``analysis.goodput_per_device``); the verdict; the plots as relative image links
    (``plot_paths``: a list, or a mapping caption -> path).
    """
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
              "- A request attains the SLO when it meets both (failed requests miss); goodput is "
              f"the highest swept rate with >= {100 * ATTAINMENT_TARGET:.0f}% attainment.",
              "", "## Summary", "",
              "Seconds (`*_s`) to 4 significant digits; latencies over completed requests; "
              "NaN where no request had the value.", "",
              markdown_table(summary_df), ""]
    if goodput:
        lines += ["## Goodput per device", "",
                  markdown_table(pd.DataFrame({"placement": list(goodput),
                                               "goodput_req_s_per_device": list(goodput.values())})),
                  ""]
    lines += ["## Verdict", "", verdict_text.strip() or "(none)", "", "## Plots", ""]
    items = (list(plot_paths.items()) if isinstance(plot_paths, Mapping)
             else [(Path(p).stem.replace("_", " "), p) for p in plot_paths])
    for caption, p in items:
        rel = Path(os.path.relpath(Path(p).resolve(), out_dir.resolve())).as_posix()
        lines += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    path.write_text("\n".join(lines))
    return path
