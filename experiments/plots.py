"""Figures of a placement comparison (matplotlib, Agg backend; no display needed). Each function
writes one PNG and returns its path; inputs are ``experiments.analysis`` tables, records, or worker
step records (dicts or ``StepRecord``s with worker, start_s, duration_s, num_requests,
num_prefill_tokens, num_decode_tokens)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from engine import metrics as m  # noqa: E402
from engine.metrics import RequestRecord  # noqa: E402
from experiments.analysis import (  # noqa: E402
    ATTAINMENT_TARGET, BREAKDOWN_STAGES, requests_frame,
)

DPI = 110
_STAGE_LABELS = {
    "prefill_queue_s": "prefill queue", "prefill_s": "prefill", "transfer_s": "KV transfer",
    "decode_queue_s": "decode queue", "decode_s": "decode",
}


def _save(fig: plt.Figure, path: str | Path, **savefig) -> Path:
    """Write ``fig`` (tight layout, ``DPI``) to ``path``, creating its folder, and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not savefig:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI, **savefig)
    plt.close(fig)
    return path


def _cdf(ax: plt.Axes, values: np.ndarray, label: str) -> bool:
    v = np.sort(values[~np.isnan(values)])
    if v.size == 0:
        return False
    y = np.arange(1, v.size + 1) / v.size
    ax.step(np.concatenate([[v[0]], v]), np.concatenate([[0.0], y]), where="post", label=label)
    return True


def plot_cdfs(records_by_placement: Mapping[str, Sequence[RequestRecord]],
              path: str | Path) -> Path:
    """TTFT and TPOT CDFs (completed requests), one line per placement, two subplots."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, col, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for placement, recs in records_by_placement.items():
            df = requests_frame(recs)
            vals = df.loc[~df["failed"], col].to_numpy(dtype=float)
            n = int(np.sum(~np.isnan(vals)))
            if not _cdf(ax, vals, f"{placement} (n={n})"):
                ax.plot([], [], label=f"{placement} (no data)")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_attainment(curve_df: pd.DataFrame, path: str | Path,
                    simulated: pd.DataFrame | None = None) -> Path:
    """SLO attainment (%) vs arrival rate per placement (``analysis.attainment_curve``): the mean
    over seeds as a line, its 95% interval as a shaded band (when the curve has
    ``slo_attainment_ci_lo/hi``), and the 90% goodput line. ``simulated``: the same curve from
    ``pdlab plan``'s simulator, drawn dashed in each placement's colour over the measured points."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colour = {}
    for i, (placement, g) in enumerate(curve_df.groupby("placement", sort=False)):
        g = g.sort_values("rate")
        colour[placement] = f"C{i}"
        ax.plot(g["rate"], 100 * g["slo_attainment"].astype(float), marker="o", color=f"C{i}",
                label=placement + (" (measured)" if simulated is not None else ""))
        if "slo_attainment_ci_lo" in g:
            ax.fill_between(g["rate"], 100 * g["slo_attainment_ci_lo"].astype(float),
                            100 * g["slo_attainment_ci_hi"].astype(float), color=f"C{i}",
                            alpha=0.2, linewidth=0)
    if simulated is not None:
        for j, (placement, g) in enumerate(simulated.groupby("placement", sort=False)):
            g = g.sort_values("rate")
            ax.plot(g["rate"], 100 * g["slo_attainment"].astype(float), linestyle="--",
                    marker="x", color=colour.get(placement, f"C{len(colour) + j}"),
                    label=f"{placement} (simulated)")
    ax.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle=":",
               label=f"{100 * ATTAINMENT_TARGET:.0f}% target")
    ax.set_title("SLO attainment vs arrival rate (mean over seeds, 95% bootstrap band)")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


P99_METRICS = ("ttft_p99_s", "tpot_p99_s", "itl_p99_s")


def plot_p99_bars(summary_df: pd.DataFrame, path: str | Path, rate: float | None = None) -> Path:
    """Grouped bars of TTFT / TPOT / ITL p99 per placement at ``rate`` (default: the highest
    rate every placement ran, else each one's highest), error bars = the 95% intervals of
    ``analysis.summary_table``. One panel per metric (their scales differ)."""
    df = summary_df
    if rate is None:
        common = set.intersection(*(set(g["rate"]) for _, g in df.groupby("placement"))) \
            if len(df) else set()
        rate = max(common) if common else None
    at = (df[df["rate"] == rate] if rate is not None
          else df.loc[df.groupby("placement", sort=False)["rate"].idxmax()]) if len(df) else df
    fig, axes = plt.subplots(1, len(P99_METRICS), figsize=(10, 3.8))
    for ax, col in zip(axes, P99_METRICS):
        vals = at[col].astype(float).to_numpy() if len(at) else np.zeros(0)
        if col + "_ci_lo" in at:
            lo = np.clip(vals - at[col + "_ci_lo"].astype(float).to_numpy(), 0, None)
            hi = np.clip(at[col + "_ci_hi"].astype(float).to_numpy() - vals, 0, None)
            err = np.nan_to_num(np.vstack([lo, hi]))
        else:
            err = None
        ax.bar(range(len(at)), np.nan_to_num(vals), yerr=err, capsize=4,
               color=[f"C{i}" for i in range(len(at))])
        ax.set_xticks(range(len(at)))
        ax.set_xticklabels(list(at["placement"]) if len(at) else [], rotation=20, fontsize=8)
        ax.set_title(col.replace("_p99_s", " p99").upper().replace(" P99", " p99"))
        ax.set_ylabel("seconds")
        ax.grid(axis="y", alpha=0.3)
    where = f"at {rate:g} req/s" if rate is not None else "at each placement's top rate"
    fig.suptitle(f"p99 latencies {where} (mean over seeds, 95% bootstrap error bars)", fontsize=10)
    return _save(fig, path)


def _step_get(step: Any, key: str) -> Any:
    return step[key] if isinstance(step, Mapping) else getattr(step, key, None)


def _pick_requests(records: Sequence[RequestRecord], k: int) -> list[RequestRecord]:
    """Up to ``k`` requests with tokens, evenly spread over the run by arrival time."""
    have = [r for r in records if r.token_times_s]
    have.sort(key=lambda r: r.timeline.get(m.ARRIVED, r.token_times_s[0]))
    if len(have) <= k:
        return have
    idx = np.unique(np.linspace(0, len(have) - 1, k).round().astype(int))
    return [have[i] for i in idx]


def plot_token_timeline(records_by_placement: Mapping[str, Sequence[RequestRecord]],
                        steps_by_placement: Mapping[str, Sequence[Any]], path: str | Path,
                        max_requests: int = 12) -> Path:
    """Per placement, one panel, x = seconds since the placement's first arrival: a row per
    request (at most ``max_requests``, spread by arrival; a dot per output token) over shaded
    spans of its decoding worker's prefill steps (a stall under one is prefill-decode
    interference), and above the rows a lane per worker with its prefill and decode-only steps.
    Steps without a ``worker`` go in one lane named "worker"."""
    placements = list(records_by_placement) or [""]
    lanes_max = max([len({str(_step_get(s, "worker") or "worker") for s in steps})
                     for steps in steps_by_placement.values()] + [0])
    height = 1.6 + 0.3 * (max_requests + lanes_max + 1)
    fig, axes = plt.subplots(len(placements), 1, figsize=(11, height * len(placements)),
                             squeeze=False)
    colors = plt.cm.tab10.colors
    for ax, placement in zip(axes[:, 0], placements):
        recs = list(records_by_placement.get(placement, []))
        shown = _pick_requests(recs, max_requests)
        starts = [r.timeline[m.ARRIVED] for r in recs if m.ARRIVED in r.timeline]
        starts += [r.token_times_s[0] for r in recs if r.token_times_s]
        t0 = min(starts) if starts else 0.0
        steps = list(steps_by_placement.get(placement, []))
        by_worker: dict[str, list[tuple[float, float, bool]]] = {}
        for st in steps:
            w = str(_step_get(st, "worker") or "worker")
            by_worker.setdefault(w, []).append((float(_step_get(st, "start_s")) - t0,
                                                float(_step_get(st, "duration_s")),
                                                (_step_get(st, "num_prefill_tokens") or 0) > 0))
        workers = list(by_worker)
        wcolor = {w: colors[(i + 3) % 10] for i, w in enumerate(workers)}
        labelled: set[str] = set()
        for i, r in enumerate(shown):
            w = r.decode_worker or r.prefill_worker
            if w in by_worker:
                born = r.timeline.get(m.ARRIVED, r.token_times_s[0]) - t0
                done = r.token_times_s[-1] - t0
                spans = [(x, d) for x, d, pre in by_worker[w]
                         if pre and x < done and x + d > born]  # within its lifetime
                if spans:
                    lab = f"prefill step on {w}" if w not in labelled else None
                    labelled.add(w)
                    ax.broken_barh(spans, (i - 0.45, 0.9), facecolors=wcolor[w], alpha=0.3,
                                   label=lab)
            t = np.asarray(r.token_times_s) - t0
            ax.plot(t, np.full(t.shape, i), "o", ms=3, color="C0",
                    label="output token" if i == 0 else None)
            if m.ARRIVED in r.timeline:
                ax.plot([r.timeline[m.ARRIVED] - t0], [i], "|", ms=10, color="k",
                        label="arrival" if i == 0 else None)
        base = len(shown) + 0.5
        for j, w in enumerate(workers):
            y = base + j
            pre = [(x, d) for x, d, p in by_worker[w] if p]
            dec = [(x, d) for x, d, p in by_worker[w] if not p]
            if dec:
                ax.broken_barh(dec, (y - 0.35, 0.7), facecolors="0.75",
                               label="decode-only step" if "_dec" not in labelled else None)
                labelled.add("_dec")
            if pre:
                ax.broken_barh(pre, (y - 0.35, 0.7), facecolors=wcolor[w], alpha=0.9,
                               label=f"prefill step on {w}" if w not in labelled else None)
                labelled.add(w)
        ax.set_yticks(list(range(len(shown))) + [base + j for j in range(len(workers))])
        ax.set_yticklabels([str(r.request_id) for r in shown] + [f"[{w}]" for w in workers],
                           fontsize=7)
        ax.set_ylim(-0.7, max(base + len(workers) - 0.3, 0.7))
        if shown:
            lo = min(r.timeline.get(m.ARRIVED, r.token_times_s[0]) for r in shown) - t0
            hi = max(r.token_times_s[-1] for r in shown) - t0
            pad = 0.02 * max(hi - lo, 1e-3)
            ax.set_xlim(lo - pad, hi + pad)
        else:
            ax.text(0.5, 0.5, "no request produced a token", transform=ax.transAxes,
                    ha="center", va="center")
        ax.set_title(f"{placement}: token emission ({len(shown)} of {len(recs)} requests) "
                     "and worker steps")
        ax.set_xlabel("time since first arrival (s)")
        ax.set_ylabel("request / [worker]")
        ax.grid(axis="x", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return _save(fig, path)


def plot_breakdown(breakdown_df: pd.DataFrame, path: str | Path) -> Path:
    """Stacked horizontal bars: mean seconds per stage (``analysis.latency_breakdown``) per
    placement. A NaN stage is drawn as 0 and named in the bar's label."""
    df = breakdown_df.reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.7 * max(len(df), 1)))
    left = np.zeros(len(df))
    labels = []
    for _, row in df.iterrows():
        missing = [_STAGE_LABELS[s] for s in BREAKDOWN_STAGES if math.isnan(float(row[s]))]
        labels.append(str(row["placement"]) + (f"\n(n/a: {', '.join(missing)})" if missing else ""))
    for i, stage in enumerate(BREAKDOWN_STAGES):
        vals = df[stage].astype(float).fillna(0.0).to_numpy() if len(df) else np.zeros(0)
        ax.barh(range(len(df)), vals, left=left, color=f"C{i}", label=_STAGE_LABELS[stage])
        left = left + vals
    counts = df["num_requests"].tolist() if "num_requests" in df else [None] * len(df)
    for y, (total, n) in enumerate(zip(left, counts)):
        txt = " no completed request" if n == 0 else f" {total:.3g} s"
        ax.text(total, y, txt, va="center", fontsize=8)
    ax.set_yticks(range(len(df)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title("Mean latency breakdown per request")
    ax.set_xlabel("mean time (s)")
    ax.set_ylabel("placement")
    ax.set_xlim(0, left.max() * 1.18 if len(df) and left.max() > 0 else 1.0)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_profile(result, path: Path, title: str) -> Path:
    """``pdlab profile``: decode step vs batch size with its fitted line, and prefill vs
    prompt length (log-log); ``result`` a ``commands.profile.ProfileResult``."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    db = result.decode_batch
    ax1.plot(db["batch_size"], db["step_s"] * 1e3, "o", label="measured (min)")
    xs = np.linspace(db["batch_size"].min(), db["batch_size"].max(), 100)
    f = result.batch_fit
    ax1.plot(xs, f(xs) * 1e3, "-", label=f"fit {f.a * 1e3:.3g} + {f.b * 1e3:.3g}·B ms, R²={f.r2:.3f}")
    ax1.set(xlabel="batch size B", ylabel="decode step (ms)",
            title=f"decode step vs B (context {int(db['context_len'].iloc[0])})")
    ax1.legend(fontsize=8)
    pf = result.prefill
    ax2.plot(pf["prompt_len"], pf["prefill_s"] * 1e3, "o-")
    ax2.set(xlabel="prompt length P (tokens)", ylabel="prefill (ms)", title="prefill vs P",
            xscale="log", yscale="log")
    fig.suptitle(f"{title} — {result.estimator}", fontsize=9)
    return _save(fig, path)


def plot_kv_cost(df: pd.DataFrame, path: Path, title: str) -> Path:
    """``pdlab kv-cost``: left, transfer seconds per transport and mode, prefill and the
    memcpy floor, against the prompt length (log-log); right, each transfer's efficiency
    (GB/s over the link peak); ``df`` is ``transfer_cost.kv_cost_table``'s."""
    fig, (ax, eff) = plt.subplots(1, 2, figsize=(12, 4.5))
    first = df.drop_duplicates("prompt_len")
    ax.plot(first["prompt_len"], first["prefill_s"], "k-o", label="prefill")
    ax.plot(first["prompt_len"], first["memcpy_s"], "k:", label="memcpy (floor)")
    for (transport, mode), group in df.groupby(["transport", "mode"], sort=False):
        ax.plot(group["prompt_len"], group["transfer_s"], "--" if mode == "layer" else "-",
                marker=".", label=f"{transport} ({mode})")
        eff.plot(group["prompt_len"], group["efficiency"], "--" if mode == "layer" else "-",
                 marker=".", label=f"{transport} ({mode})")
    ax.set(xscale="log", yscale="log", xlabel="prompt length T (tokens)", ylabel="seconds",
           title="KV transfer vs prefill")
    ax.legend(fontsize=8)
    eff.axhline(1.0, color="k", ls=":", lw=0.8)
    eff.set(xscale="log", xlabel="prompt length T (tokens)", ylim=(0, None),
            ylabel="transfer GB/s / link peak",
            title=f"efficiency (link peak {df['peak_GBps'].iloc[0]:.3g} GB/s, memcpy)")
    fig.suptitle(title, fontsize=8)
    return _save(fig, path)


def plot_heatmap(summary: pd.DataFrame, path: Path, title: str,
                 mode_label: Callable[[str, Any], str]) -> Path:
    """One panel per mode: ITL inflation (worst step / baseline step) over B (rows) and
    P > 0 (columns), one colour scale for all panels."""
    data = summary[summary["prompt_len"] > 0]
    labels = list(dict.fromkeys(mode_label(m, k) for m, k in zip(data["mode"], data["budget"])))
    bs, ps = sorted(data["batch_size"].unique()), sorted(data["prompt_len"].unique())
    vmax = float(data["inflation"].max())
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels) + 1, 3.2), squeeze=False)
    for ax, label in zip(axes[0], labels):
        sel = data[[mode_label(m, k) == label for m, k in zip(data["mode"], data["budget"])]]
        grid = sel.pivot_table(index="batch_size", columns="prompt_len", values="inflation")
        grid = grid.reindex(index=bs, columns=ps)
        image = ax.imshow(grid.to_numpy(float), cmap="magma_r", vmin=1.0, vmax=max(vmax, 1.01),
                          origin="lower", aspect="auto")
        for i, j in np.ndindex(grid.shape):
            ax.text(j, i, f"{grid.iat[i, j]:.2f}x", ha="center", va="center", fontsize=8,
                    color="white" if grid.iat[i, j] > (1 + vmax) / 2 else "black")
        ax.set(xticks=range(len(ps)), xticklabels=ps, yticks=range(len(bs)), yticklabels=bs,
               xlabel="prompt tokens P", title=label)
    axes[0][0].set_ylabel("decode batch B")
    fig.colorbar(image, ax=axes[0].tolist(), label="ITL inflation (worst step / no-prefill step)")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path, bbox_inches="tight")


def plot_best(curve_df: pd.DataFrame, ranked: pd.DataFrame, path: str | Path, top: int = 3,
              title: str = "") -> Path:
    """SLO attainment (%) vs arrival rate per device of the ``top`` best candidates, with the
    90% goodput line and each one's goodput marked; shaded between ``slo_attainment_slow``
    and ``_fast`` where ``curve_df`` has them (``band.curve_band``)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, row in enumerate(ranked.head(top).itertuples()):
        g = curve_df[curve_df["candidate"] == row.candidate].sort_values("rate")
        ax.plot(g["rate_per_device"], 100 * g["slo_attainment"], marker="o", color=f"C{i}",
                label=f"#{row.rank} {row.candidate}: {row.goodput_per_device_req_s:.3g} req/s/device")
        if "slo_attainment_slow" in g and g["slo_attainment_slow"].notna().any():
            ax.fill_between(g["rate_per_device"], 100 * g["slo_attainment_slow"],
                            100 * g["slo_attainment_fast"], color=f"C{i}", alpha=0.15, linewidth=0)
        if row.goodput_per_device_req_s > 0:
            ax.axvline(row.goodput_per_device_req_s, color=f"C{i}", linestyle=":", alpha=0.6)
    ax.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle="--",
               label=f"{100 * ATTAINMENT_TARGET:.0f}% target")
    ax.set_xscale("log")
    ax.set_xlabel("arrival rate per device (req/s)")
    ax.set_ylabel("SLO attainment (%), simulated")
    ax.set_ylim(-2, 102)
    ax.set_title(title or "pdlab plan: simulated SLO attainment of the best placements", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


_FAMILY_COLOURS = {"colocated": "C0", "colocated chunked": "C2", "disagg": "C3",
                   "conditional": "C4"}


def _short(label: str) -> str:
    """A placement label short enough for a map cell (``disagg:1p3d`` -> ``1p3d``), its
    instance sizes on a second line (``disagg:2p1d+ptp2+dtp4`` -> ``2p1d`` / ``ptp2 dtp4``)."""
    budget = " b" + label.split("budget ")[1].rstrip(")") if "budget" in label else ""
    head, _, sizes = label.split(" (budget")[0].partition("+")
    sizes = "\n" + sizes.replace("+", " ") if sizes else ""
    if head.startswith("disagg:"):
        return head.split(":", 1)[1] + sizes
    if head.startswith("conditional:"):
        return "c" + head.split(":", 1)[1] + sizes
    if head.startswith("colocated-nochunk"):
        return "co-nc" + sizes
    return "co" + budget + sizes


def plot_slo_map(cells: pd.DataFrame, ttft_grid: Sequence[float], tpot_grid: Sequence[float],
                 path: str | Path, title: str, checked: pd.DataFrame | None = None) -> Path:
    """One ratio's map (``planner.slo_map.cells``): TTFT SLO across, TPOT SLO up, one square
    per cell coloured by the winner's family, paler for a smaller margin over the runner-up,
    hatched where there is no clear winner, grey where nothing meets the SLO; the winner's
    short label, "+" where it met the SLO at the top swept rate (goodput a lower bound).
    ``checked`` cells ran for real: outlined with "ok" (measured winner = mapped) or "x"."""
    sized = cells["winner"].astype(str).str.contains("+", regex=False).any()
    fig, ax = plt.subplots(figsize=(1.0 + (1.0 if sized else 0.75) * len(ttft_grid),
                                    1.2 + 0.6 * len(tpot_grid)))
    for row in cells.itertuples():
        x, y = row.ttft_index, row.tpot_index
        if row.verdict == "none":
            colour, alpha, hatch, text = "lightgray", 1.0, None, "-"
        else:
            colour = _FAMILY_COLOURS.get(row.winner_family, "C7")
            alpha = 0.25 + 0.75 * min(max(float(row.margin), 0.0), 1.0)
            hatch = None if row.clear else "///"
            text = (_short(row.winner) + ("" if row.clear else "?")
                    + ("+" if getattr(row, "at_sweep_top", False) else ""))
        ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=colour, alpha=alpha,
                                   hatch=hatch, edgecolor="white", linewidth=0.5))
        ax.text(x, y, text, ha="center", va="center", fontsize=7)
    for row in (checked.itertuples() if checked is not None else ()):
        ax.add_patch(plt.Rectangle((row.ttft_index - 0.45, row.tpot_index - 0.45), 0.9, 0.9,
                                   fill=False, edgecolor="black", linewidth=2))
        ax.text(row.ttft_index + 0.4, row.tpot_index + 0.4, "ok" if row.top1_agrees else "x",
                ha="right", va="top", fontsize=7, fontweight="bold")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _FAMILY_COLOURS.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="///", edgecolor="gray"),
                plt.Rectangle((0, 0), 1, 1, color="lightgray")]
    ax.legend(handles, [*_FAMILY_COLOURS, "no clear winner", "nothing meets the SLO"],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set(xlim=(-0.5, len(ttft_grid) - 0.5), ylim=(-0.5, len(tpot_grid) - 0.5),
           xticks=range(len(ttft_grid)), xticklabels=[f"{v:g}" for v in ttft_grid],
           yticks=range(len(tpot_grid)), yticklabels=[f"{v:g}" for v in tpot_grid],
           xlabel="TTFT SLO (s)", ylabel="TPOT SLO (s)")
    ax.set_title(title + "\n(shade = margin over the runner-up; ? / hatched = no clear winner;"
                 " + = met the top swept rate)", fontsize=8)
    return _save(fig, path, bbox_inches="tight")
