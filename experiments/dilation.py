"""Time dilation of emulated devices (``--emu-time-scale S``), after time-warped emulation
(Gupta et al., "To Infinity and Beyond: Time-Warped Network Emulation", NSDI 2006): the host's
own cost (router, Ray calls, transports, the engine's Python) is separated from the exact
emulated step times.

- every emulated step lasts ``S`` x its modelled time (``Emulation.time_scale``) and every gap
  between arrivals ``S`` x its drawn value (``dilated_workload``);
- every time measured in the run is divided by ``S`` before anything reads it (``undilate_*``:
  stamps about the run's start, durations, bandwidths x S); wall-clock bounds on waits x S.

The host's seconds per event then count ``1 / S`` as much; ``S = 1`` is real time. Results record
the scale. Multi-turn workloads are refused (``check_dilatable``): their arrival times are drawn
inside the replay."""

from __future__ import annotations

import dataclasses

from engine.config import TransferConfig
from engine.metrics import RequestRecord
from experiments.workload_spec import ClosedLoop, MultiTurn

# TransferRecord fields: wall-clock stamps and durations (achieved_gbps: bytes per duration)
_TRANSFER_STAMPS = ("put_time_s", "get_time_s")
_TRANSFER_DURATIONS = ("put_s", "get_s", "exposed_s", "overlapped_s")


_OPEN_LOOP_ONLY = ("argument --emu-time-scale: applies to open-loop workloads only (requests "
                   "at drawn arrival times, or a trace), not to multi-turn conversations "
                   "(--dataset multiturn)")


def check_dataset(dataset: str, scale: float) -> None:
    """``check_dilatable`` for the options check (``--dataset multiturn``), before anything runs.

    Raises:
        ValueError: ``scale`` != 1 and ``dataset`` is ``"multiturn"``."""
    if scale != 1 and dataset == "multiturn":
        raise ValueError(_OPEN_LOOP_ONLY)


def check_dilatable(items, scale: float) -> None:
    """Refuse a dilation of a multi-turn workload (``workload_spec.MultiTurn``), before anything is
    deployed: its turns' arrival times are drawn inside the closed-loop replay.

    Raises:
        ValueError: ``scale`` != 1 and ``items`` is a ``MultiTurn``."""
    if scale != 1 and isinstance(items, MultiTurn):
        raise ValueError(_OPEN_LOOP_ONLY)


def dilated_workload(workload: list, scale: float) -> list:
    """``workload`` (``[(request, arrival offset s), ...]``) with every offset x ``scale``: the
    same workload at ``1 / scale`` of the rate."""
    if scale == 1:
        return workload
    assert not isinstance(workload, ClosedLoop), "check_dilatable refuses multi-turn workloads"
    return [(request, offset * scale) for request, offset in workload]


def dilated_transfer(transfer: TransferConfig, scale: float) -> TransferConfig:
    """``transfer`` with ``timeout_s`` x ``scale``: every remote wait (a KV fetch, the router's
    deadline) is a wall-clock bound on a run ``scale`` x as long."""
    if scale == 1:
        return transfer
    return dataclasses.replace(transfer, timeout_s=transfer.timeout_s * scale)


def label(scale: float) -> str:
    """``"time dilated x S"``: how a report names a dilated run (titles, headers)."""
    return f"time dilated x {scale:g}"


def _at(t: float, scale: float, origin_s: float) -> float:
    """A wall-clock stamp ``t`` of a dilated run, undilated about the run's start."""
    return origin_s + (t - origin_s) / scale


def undilate_record(record: RequestRecord, scale: float, origin_s: float) -> RequestRecord:
    """``record`` as if its run had taken ``1 / scale`` of its time: every stamp ``t`` ->
    ``origin_s + (t - origin_s) / scale`` (``origin_s``: the run's start, ``time.time()``
    seconds), every duration / ``scale``."""
    def at(t: float) -> float:
        return _at(t, scale, origin_s)

    def over(d: float | None) -> float | None:
        return None if d is None else d / scale

    return dataclasses.replace(
        record, timeline={k: at(t) for k, t in record.timeline.items()},
        token_times_s=[at(t) for t in record.token_times_s],
        token_worker_times_s=[at(t) for t in record.token_worker_times_s],
        kv_put_s=over(record.kv_put_s), kv_get_s=over(record.kv_get_s),
        kv_transfer_s=over(record.kv_transfer_s))


def undilate_step(row: dict, scale: float, origin_s: float) -> dict:
    """A step row (``StepRecord.to_row`` and the worker) undilated as ``undilate_record``:
    ``start_s`` a stamp, ``duration_s`` a duration, ``lateness`` (a ratio) unchanged."""
    return {**row, "start_s": _at(row["start_s"], scale, origin_s),
            "duration_s": row["duration_s"] / scale}


def undilate_transfer(row: dict, scale: float, origin_s: float) -> dict:
    """A transfer row (``TransferRecord.__dict__``) undilated as ``undilate_record``; its
    ``achieved_gbps`` and ``peak_gbps`` x ``scale`` (the link as fast as its transfers
    read), so ``efficiency`` (their ratio) is unchanged: never above the peak it was."""
    out = dict(row)
    for key in _TRANSFER_STAMPS:
        if out.get(key):
            out[key] = _at(out[key], scale, origin_s)
    for key in _TRANSFER_DURATIONS:
        if out.get(key) is not None:
            out[key] = out[key] / scale
    for key in ("achieved_gbps", "peak_gbps"):
        if out.get(key) is not None:
            out[key] = out[key] * scale
    return out
