"""Time dilation of emulated devices (experiments/dilation.py): stamps, durations and
bandwidths undilated by hand-computed values; a dilated replay sends arrivals S x apart and
reads back the undilated workload's times; an emulated step is held S x its modelled time;
bad scales and uses are refused."""

from __future__ import annotations


import pytest

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.emulated import Emulation
from engine.metrics import RequestRecord, ttft_s
from experiments import dilation, replay, workloads
from experiments.workload_spec import MultiTurn, WorkloadSpec, router_workload
from test_emulated import ENGINE, LLAMA, STEP_S, FakeClock, constant_profile, emulated_engine, requests

from engine.engine import Engine
from engine.model import load_geometry
from deployment.placement import emulation_for


def test_undilate_record_hand_computed():
    r = RequestRecord("r0", timeline={"arrived": 104.0, "finished": 112.0},
                      token_times_s=[108.0, 110.0], token_worker_times_s=[107.0, 109.0],
                      kv_put_s=0.4, kv_get_s=None, kv_transfer_s=0.8, kv_bytes=64)
    u = dilation.undilate_record(r, 4.0, origin_s=100.0)
    assert u.timeline == {"arrived": 101.0, "finished": 103.0}
    assert u.token_times_s == [102.0, 102.5] and u.token_worker_times_s == [101.75, 102.25]
    assert (u.kv_put_s, u.kv_get_s, u.kv_transfer_s, u.kv_bytes) == (0.1, None, 0.2, 64)
    assert ttft_s(u) == ttft_s(r) / 4 == 1.0
    assert r.timeline["arrived"] == 104.0  # the measured record is left as it was


def test_undilate_step_and_transfer_rows():
    step = {"worker": "w0", "start_s": 110.0, "duration_s": 0.08, "lateness": 1.25,
            "num_requests": 2}
    assert dilation.undilate_step(step, 8.0, 100.0) == {
        "worker": "w0", "start_s": 101.25, "duration_s": 0.01, "lateness": 1.25,
        "num_requests": 2}
    row = {"request_id": "r0", "num_bytes": 1000, "put_s": 0.02, "get_s": 0.06,
           "put_time_s": 102.0, "get_time_s": 104.0, "achieved_gbps": 1.25e-5,
           "efficiency": None, "exposed_s": 0.04, "overlapped_s": None}
    assert dilation.undilate_transfer(row, 2.0, 100.0) == {
        "request_id": "r0", "num_bytes": 1000, "put_s": 0.01, "get_s": 0.03,
        "put_time_s": 101.0, "get_time_s": 102.0, "achieved_gbps": 2.5e-5,
        "efficiency": None, "exposed_s": 0.02, "overlapped_s": None}


def test_undilated_transfer_keeps_its_efficiency():
    # 0.5 of the link's peak, measured; the link reads S x as fast as the transfer does
    row = {"request_id": "r0", "num_bytes": 10**9, "put_s": 0.5, "get_s": 0.5,
           "put_time_s": 100.0, "get_time_s": 100.5, "achieved_gbps": 1.0, "peak_gbps": 2.0,
           "efficiency": 0.5}
    u = dilation.undilate_transfer(row, 4.0, 100.0)
    assert (u["achieved_gbps"], u["peak_gbps"], u["efficiency"]) == (4.0, 8.0, 0.5)
    assert u["efficiency"] == u["achieved_gbps"] / u["peak_gbps"]


def test_dilated_workload_stretches_each_gap_and_refuses_multi_turn():
    spec = WorkloadSpec(dataset="synthetic", num_requests=5)
    items = workloads.synthetic(5, 0, 4, 2)
    plain = router_workload(items, 10.0, spec, tag="t", seed=3)
    stretched = dilation.dilated_workload(plain, 4.0)
    assert [t for _, t in stretched] == [4.0 * t for _, t in plain]
    assert [r for r, _ in stretched] == [r for r, _ in plain]
    assert dilation.dilated_workload(plain, 1.0) is plain
    with pytest.raises(ValueError, match="--emu-time-scale: applies to open-loop workloads"):
        dilation.check_dilatable(MultiTurn([]), 2.0)
    dilation.check_dilatable(MultiTurn([]), 1.0)  # undilated: anything goes


class Clock:
    """The replay's ``time`` in this test: ``time()`` reads ``now``, which only a run moves."""

    now = 1.7e9

    @classmethod
    def time(cls) -> float:
        return cls.now


class InstantDeployment:
    """Serves every request 0.04 s (dilated) after its arrival, its tokens 0.02 s apart; one
    step row per request at its arrival; the run lasts its workload + 0.1 s on ``Clock``.
    Records the offsets it was handed."""

    offsets: list[float] = []
    transfer: TransferConfig | None = None

    def __init__(self, placement, model, engine, transfer, *args, **kwargs):
        self.placement = placement.placement
        InstantDeployment.transfer = transfer
        self.router = type("R", (), {"max_model_len": 1000})()
        self.steps = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def gather(self, method):
        return []

    def reset_prefix_cache(self):
        pass

    def run(self, workload, on_finish=None):
        base = Clock.now
        InstantDeployment.offsets = [t for _, t in workload]
        records = []
        for request, offset in workload:
            at = base + offset
            records.append(RequestRecord(request.request_id, self.placement,
                                         timeline={"arrived": at},
                                         token_times_s=[at + 0.04, at + 0.06]))
            self.steps.append({"worker": "w0", "start_s": at, "duration_s": 0.04,
                               "num_requests": 1})
        Clock.now += max(offset for _, offset in workload) + 0.1  # the run lasts its workload
        return records

    def step_records(self):
        return list(self.steps)

    def transfer_records(self):
        return []


def test_dilated_replay_reads_back_the_undilated_workload(monkeypatch):
    monkeypatch.setattr(replay, "Deployment", InstantDeployment)
    monkeypatch.setattr(replay, "time", Clock)
    spec = WorkloadSpec(dataset="synthetic", num_requests=4)
    items = {0: workloads.synthetic(4, 0, 4, 2)}
    engine = EngineConfig(emu_time_scale=4.0)
    (result,) = replay.run_placement("colocated:1", [50.0], items, spec,
                                     ModelConfig("tiny-random-llama"), engine,
                                     TransferConfig(transport="inprocess"), "emu:0", None)
    undilated = [t for _, t in router_workload(items[0], 50.0, spec, tag="x", seed=0)]
    assert InstantDeployment.offsets == [4.0 * t for t in undilated]  # sent S x apart
    arrived = [r.timeline["arrived"] for r in result.records]
    assert [a - arrived[0] for a in arrived] == pytest.approx(
        [t - undilated[0] for t in undilated], abs=1e-6)
    # 0.04 s dilated x 1/4 (to the float precision of epoch stamps, ~2e-7 s)
    assert [ttft_s(r) for r in result.records] == pytest.approx([0.01] * 4, abs=1e-6)
    assert [s["duration_s"] for s in result.steps] == pytest.approx([0.01] * 4, abs=1e-6)
    assert result.duration_s == pytest.approx((max(undilated) * 4 + 0.1) / 4, abs=1e-6)
    # every wall-clock bound x S: each wait lasts S x as long
    assert InstantDeployment.transfer.timeout_s == 4.0 * TransferConfig().timeout_s


def test_emulated_step_held_s_times_its_modelled_time():
    clock = FakeClock()
    plain = emulated_engine(FakeClock())
    plain.generate(requests())
    dilated = Engine(load_geometry(ModelConfig(LLAMA, "bfloat16")), ENGINE, quiet=True,
                     emulation=Emulation(constant_profile(), 1 / 256, clock, time_scale=8.0))
    dilated.generate(requests())
    rows = [r.to_row() for r in dilated.step_records]
    assert len(rows) == len(plain.step_records)
    assert {row["duration_s"] for row in rows} == {8 * STEP_S}
    assert {row["lateness"] for row in rows} == {1.0}  # on time: actual / (S x modelled)
    assert Emulation(constant_profile(), time_scale=8.0).describe()["time_scale"] == 8.0


@pytest.mark.parametrize("scale", [0.5, float("inf")])
def test_bad_time_scale_is_refused(scale):
    with pytest.raises(ValueError, match="emu_time_scale must be"):
        Emulation(constant_profile(), time_scale=scale)
    with pytest.raises(ValueError, match="emu_time_scale must be"):
        EngineConfig(emu_time_scale=scale)


def test_time_scale_on_real_devices_is_refused():
    with pytest.raises(ValueError, match="argument --emu-time-scale: only emulated devices"):
        emulation_for(("cpu:0",), ModelConfig("tiny-random-llama"), EngineConfig(emu_time_scale=2))
