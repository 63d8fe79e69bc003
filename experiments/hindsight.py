"""Hindsight scoring of a ``conditional:xPyD`` run: for each request, the prefill path it took,
whether it met the SLO, and whether the other path would have, estimated from the same run's
step times (optimistic: queueing on the other path is ignored), to tune
``max_local_prefill_length``:

1. A prompt token costs the seconds of the steps that computed prompt tokens over those tokens.
2. TTFT on the other path: prompt tokens x that cost.
3. TPOT on the other path: remote (it prefilled locally): the median decode-only step of the
   decode workers plus its KV transfer over its output gaps (the run's transfer s per prompt
   token x P / (n_out - 1)); local: the mean step of the decode workers, prefills included.
4. ``other_met_slo``: both estimates within the SLO; ``regret``: it missed the SLO on its path
   and the other path would have met it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from engine.metrics import SLO, RequestRecord, failed, meets_slo

OTHER = {"local": "remote", "remote": "local"}


def step_costs(steps: Sequence[dict], records: Sequence[RequestRecord]) -> dict[str, float]:
    """The measured costs of the module docstring (seconds; NaN where the run has none), from
    ``step_records`` rows (``worker, duration_s, num_prefill_tokens, num_decode_tokens``;
    decode workers are named ``decode-*``)."""
    df = pd.DataFrame(list(steps), columns=["worker", "duration_s", "num_prefill_tokens",
                                            "num_decode_tokens"])
    prefill = df[df["num_prefill_tokens"] > 0]
    decode = df[df["worker"].astype(str).str.startswith("decode") & (df["num_decode_tokens"] > 0)]
    decode_only = decode[decode["num_prefill_tokens"] == 0]
    remote = [r for r in records if r.prefill_path == "remote" and r.kv_transfer_s is not None]
    remote_tokens = sum(r.num_prompt_tokens for r in remote)
    nan = float("nan")
    return {
        "prompt_token_s": (float(prefill["duration_s"].sum() / prefill["num_prefill_tokens"].sum())
                           if len(prefill) else nan),
        "decode_only_step_s": float(decode_only["duration_s"].median()) if len(decode_only) else nan,
        "decode_mean_step_s": float(decode["duration_s"].mean()) if len(decode) else nan,
        "transfer_s_per_token": (sum(r.kv_transfer_s for r in remote) / remote_tokens
                                 if remote_tokens else 0.0),
    }


def hindsight(records: Sequence[RequestRecord], steps: Sequence[dict], slo: SLO) -> pd.DataFrame:
    """One row per request that has a ``prefill_path`` and did not fail.

    Returns:
        ``request_id, prefill_path, num_prompt_tokens, met_slo, other_path,
        other_ttft_est_s, other_tpot_est_s, other_met_slo, regret``."""
    costs = step_costs(steps, records)
    rows = []
    for r in records:
        if r.prefill_path not in OTHER or failed(r):
            continue
        n_gaps = len(r.token_times_s) - 1
        ttft = r.num_prompt_tokens * costs["prompt_token_s"]
        if r.prefill_path == "local":
            transfer = costs["transfer_s_per_token"] * r.num_prompt_tokens
            tpot = costs["decode_only_step_s"] + (transfer / n_gaps if n_gaps > 0 else 0.0)
        else:
            tpot = costs["decode_mean_step_s"]
        other_met = bool(ttft <= slo.ttft_s and (n_gaps < 1 or tpot <= slo.tpot_s))
        met = meets_slo(r, slo)
        rows.append({"request_id": r.request_id, "prefill_path": r.prefill_path,
                     "num_prompt_tokens": r.num_prompt_tokens, "met_slo": met,
                     "other_path": OTHER[r.prefill_path], "other_ttft_est_s": ttft,
                     "other_tpot_est_s": tpot if n_gaps > 0 else np.nan,
                     "other_met_slo": other_met, "regret": (not met) and other_met})
    return pd.DataFrame(rows, columns=["request_id", "prefill_path", "num_prompt_tokens",
                                       "met_slo", "other_path", "other_ttft_est_s",
                                       "other_tpot_est_s", "other_met_slo", "regret"])


def hindsight_text(table: pd.DataFrame) -> str:
    """One line: how many requests took each path, and how many regret it."""
    if table.empty:
        return "hindsight: no request with a prefill path"
    counts = table["prefill_path"].value_counts()
    return (f"hindsight: {int(counts.get('local', 0))} local and {int(counts.get('remote', 0))} "
            f"remote prefills; {int(table['regret'].sum())} missed the SLO where the other path "
            f"would have met it (estimate from measured step times, queueing ignored)")
