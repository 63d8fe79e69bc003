"""Per-phase instance sizes in the planner: the PP step model, the sizes enumerated and
refused, the simulator's TP/PP step times against each role's profile, and the search's
winner on a case small enough to check by hand (planner.sizes, planner.latency,
planner.simulate, planner.search)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.memory_fit import Geometry
from engine.metrics import SLO
from engine.request import Request, SamplingParams
from planner import search
from planner.latency import (DECODE_FEATURES, PREFILL_FEATURES, DeviceProfile, Fit,
                             TransferModel)
from planner.sizes import ProfileSet, pipelined, pp_sizes

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
LINK = TransferModel(1e-3, 1e6)  # a stage hand-over: 1 ms + bytes / 1 MB/s


def _profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 0.0, 0.0), tp=1, device_kind="cpu",
             memory=None, weights=None, dtype="bfloat16") -> DeviceProfile:
    fit = lambda features, coef: Fit(features, coef, 1.0, 0.0, 0.0, 3)  # noqa: E731
    return DeviceProfile(
        model="m", dtype=dtype, device_kind=device_kind, device_name="gpu", num_threads=0,
        kv_bytes_per_token=1024, prefill=fit(PREFILL_FEATURES, prefill),
        decode=fit(DECODE_FEATURES, decode), mixed=fit(("1", "slopes"), (prefill[0], 1.0)),
        transfers={"nvlink": LINK, "shm": TransferModel(0.5, float("inf"))},
        notes={"link": "nvlink"}, device_memory_bytes=memory, weight_bytes=weights, tp=tp)


def _req(name: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(name, tuple(range(3, 3 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _geometry(model: str) -> Geometry:
    return Geometry.from_config(json.loads((ROOT / "engine/configs" / model / "config.json")
                                           .read_text()))


def test_a_pp_step_is_the_tp_step_plus_a_hand_over_per_stage_boundary():
    tp2 = _profile(prefill=(0.01, 1e-3, 1e-6), decode=(0.02, 1e-4, 1e-7), tp=2)
    pp2 = tp2.with_pp(2, 512, None, 100, LINK)
    pp4 = tp2.with_pp(4, 256, None, 100, LINK)
    # prefill of 10 tokens (Σn(k+n) = 100): 0.01 + 0.01 + 1e-4 = 0.0201 s at PP 1;
    # one boundary at PP 2: 1 ms + 10 tokens x 100 bytes / 1 MB/s = 2 ms; three at PP 4
    assert tp2.step_time()(10, 100, 0, 0) == pytest.approx(0.0201, rel=1e-12)
    assert pp2.step_time()(10, 100, 0, 0) == pytest.approx(0.0201 + 0.002, rel=1e-12)
    assert pp4.step_time()(10, 100, 0, 0) == pytest.approx(0.0201 + 3 * 0.002, rel=1e-12)
    # decode of 4 at Σctx 400: 0.02 + 4e-4 + 4e-5 = 0.02044; a boundary hands 4 tokens on
    assert pp2.step_time()(0, 0, 4, 400) == pytest.approx(0.02044 + 0.001 + 4e-4, rel=1e-12)
    assert pp2.step_time()(0, 0, 0, 0) == 0.0  # nothing scheduled: no step
    assert (pp2.size, pp2.kv_bytes_per_device_token, tp2.kv_bytes_per_device_token) == \
        ((2, 2), 512, 1024)
    assert DeviceProfile.from_dict(pp2.to_dict()) == pp2
    assert "parallel" not in _profile().to_dict()  # a one-device file is as before
    with pytest.raises(ValueError, match="already at PP 2"):
        pp2.with_pp(2, 512, None, 100, LINK)
    with pytest.raises(ValueError, match="needs the link between its stages"):
        tp2.replace(pp=2)


def test_pipelined_takes_the_fullest_stage_from_the_geometry():
    g = _geometry("llama-3.1-70b")
    pp2 = pipelined(_profile(tp=2, memory=80 * GIB, weights=1), g, 2)
    # 40 layers x 1 of 8 KV heads... at TP 2: 4 KV heads x 128 x 2 (K, V) x 2 bytes x 40 layers
    assert pp2.kv_bytes_per_device_token == 2 * 40 * 4 * 128 * 2
    assert pp2.weight_bytes == g.device_params(2, 2) * 2
    assert (pp2.stage_bytes_per_token, pp2.stage_link) == (8192 * 2, LINK)
    assert pp_sizes(80, 4) == (1, 2, 4) and pp_sizes(28, 8) == (1, 2, 4, 7)


def test_sizes_that_do_not_fit_are_refused_and_slower_ones_pruned():
    g = _geometry("llama-3.1-70b")
    fast = dict(prefill=(0.005, 5e-4, 0.0), decode=(0.01, 0.0, 0.0))
    profiles = [_profile(tp=1, device_kind="cuda", memory=80 * GIB, weights=131 * GIB),
                _profile(tp=2, device_kind="cuda", memory=80 * GIB, weights=66 * GIB),
                _profile(tp=4, device_kind="cuda", memory=80 * GIB, weights=33 * GIB, **fast)]
    found = ProfileSet.build(profiles, g, 4, 4096, 0.9, max_pp=4)
    assert found.sizes == ((2, 1), (4, 1))
    assert found.refused == {(1, 1): "m at TP 1, PP 1 does not fit an gpu GPU: 131 GiB of "
                             "weights + 1.25 GiB of KV for 4096 tokens > 72 GiB (0.9 of 80 GiB)"}
    # same devices, slower in both phases (equal fits plus the stage hand-overs, or TP 4's
    # faster fits): the PP sizes lose to the TP sizes of as many devices
    assert found.dominated == {(1, 2): (2, 1), (1, 4): (2, 2), (2, 2): (4, 1)}
    with pytest.raises(ValueError, match="no instance of TP 1, PP 1: m at TP 1, PP 1 does not fit"):
        found.get(1, 1)
    with pytest.raises(ValueError, match="TP 2, PP 1 is faster in both phases"):
        found.get(1, 2)
    assert found.base is found.get(2, 1)
    with pytest.raises(ValueError, match="no instance size fits: .*TP 1, PP 1 does not fit"):
        ProfileSet.build(profiles[:1], g, 1, 4096, 0.9).base
    with pytest.raises(ValueError, match="two device profiles of TP 2"):
        ProfileSet.build(profiles[1:2] * 2, g, 4, 4096)


def test_candidates_enumerate_each_phase_size_within_the_devices():
    labels = [c.label for c in search.candidates(4, sizes=((1, 1), (2, 1)))]
    assert labels == [
        "colocated:4", "colocated-nochunk:4", "colocated:2+tp2", "colocated-nochunk:2+tp2",
        "disagg:1p1d",  # by devices, then instances, then prefill instances
        "disagg:1p1d+dtp2", "disagg:1p1d+ptp2", "disagg:1p2d", "disagg:2p1d",  # 3 devices
        "disagg:1p1d+tp2", "disagg:1p2d+ptp2", "disagg:2p1d+dtp2",  # 4
        "disagg:1p3d", "disagg:2p2d", "disagg:3p1d"]
    assert [c.num_devices for c in search.candidates(4, sizes=((1, 1), (2, 1)))][-3:] == [4, 4, 4]
    assert search.sized("disagg:2p1d", (2, 1), (4, 1)) == "disagg:2p1d+ptp2+dtp4"


def test_the_simulator_times_each_role_by_its_own_size_profile():
    tp1 = _profile(prefill=(0.1, 0.0, 0.0), decode=(0.05, 0.0, 0.0), tp=1)
    tp2 = _profile(prefill=(0.04, 0.0, 0.0), decode=(0.02, 0.0, 0.0), tp=2)
    sizes = ProfileSet({(1, 1): tp1, (2, 1): tp2, (2, 2): tp2.with_pp(2, 256, None, 1000, LINK)})
    sim = search.simulator(search.Candidate("disagg:1p1d+ptp2+dtp2+dpp2"), ENGINE, sizes,
                           TransferModel(0.0, float("inf")))
    res = sim.run([(_req("r0", 10, 3), 0.0)], collect_steps=True)
    durations = {(s["worker"], s["num_prefill_tokens"], s["num_decode_tokens"]): s["duration_s"]
                 for s in res.steps}
    # prefill TP 2: 0.04 s; decode TP 2 PP 2: 0.02 + 1 ms + 1 token x 1000 B / 1 MB/s = 0.022 s
    assert durations == {("prefill-0", 10, 0): 0.04, ("decode-0", 0, 1): pytest.approx(0.022)}
    assert res.records[0].token_times_s == [0.04, pytest.approx(0.062), pytest.approx(0.084)]
    colocated = search.simulator(search.Candidate("colocated:1"), ENGINE, sizes, None)
    steps = colocated.run([(_req("r0", 10, 2), 0.0)], collect_steps=True).steps
    assert [s["duration_s"] for s in steps] == [0.1, 0.05]  # TP 1's own
    with pytest.raises(ValueError, match="no instance of TP 4, PP 1"):
        search.simulator(search.Candidate("colocated:1+tp4"), ENGINE, sizes, None)
    with pytest.raises(ValueError, match="the profile's \\(1, 1\\): give a profile of each size"):
        search.simulator(search.Candidate("colocated:1+tp2"), ENGINE, tp1, None)


def test_the_search_picks_the_tp_size_that_meets_a_tpot_only_it_can():
    # 2 devices; decode takes 50 ms at TP 1 and 20 ms at TP 2, the TPOT SLO is 30 ms: only
    # placements with TP-2 decode meet it, and on 2 devices that is colocated:1+tp2 alone.
    tp1 = _profile(prefill=(0.01, 0.0, 0.0), decode=(0.05, 0.0, 0.0), tp=1)
    tp2 = _profile(prefill=(0.005, 0.0, 0.0), decode=(0.02, 0.0, 0.0), tp=2)
    sizes = ProfileSet({(1, 1): tp1, (2, 1): tp2})
    cands = search.candidates(2, sizes=sizes.sizes)
    assert [c.label for c in cands] == ["colocated:2", "colocated-nochunk:2", "colocated:1+tp2",
                                        "colocated-nochunk:1+tp2", "disagg:1p1d"]
    requests = {0: [_req(f"r{i}", 8, 4) for i in range(20)]}
    runs = search.sweep(cands, [1.0, 2.0], requests, ENGINE, sizes,
                        TransferModel(0.0, float("inf")), SLO(1.0, 0.03))
    ranked = search.rank(runs).set_index("candidate")
    assert ranked.loc["colocated:1+tp2", "goodput_per_device_req_s"] == 1.0  # 2 req/s over 2
    assert ranked.loc["colocated:1+tp2", "rank"] == 1
    for label in ("colocated:2", "colocated-nochunk:2", "disagg:1p1d"):
        assert ranked.loc[label, "goodput_per_device_req_s"] == 0.0


# ---- pdlab map / plan: one profile per TP size -------------------------------------------------
DATA = ROOT / "tests" / "data"
L70 = ",".join(str(DATA / f"llama-3.1-70b_h100_sxm_vllm_tp{t}_profile.json") for t in (2, 4, 8))
MAP_70B = ["map", "--model", "engine/configs/llama-3.1-70b", "--dtype", "bfloat16",
           "--device-profile", L70, "--transport", "shm", "--io-ratio", "4",
           "--ttft-slo", "0.05:2:2", "--tpot-slo", "0.01:0.1:2", "--max-model-len", "4096",
           "--devices", "8", "--max-pp", "4"]


def _map(argv: list[str], tmp_path: Path):
    from experiments import cli
    from experiments.commands import map as map_cmd

    return map_cmd.check(cli.build_parser().parse_args(argv + ["--out", str(tmp_path / "m")]))


def test_the_70b_map_searches_the_tp_sizes_that_fit_eight_h100s(tmp_path):
    job = _map(MAP_70B, tmp_path)
    assert job.simulated.sizes == ((2, 1), (4, 1), (8, 1))
    assert set(job.simulated.dominated) == {(2, 2), (2, 4), (4, 2)}  # PP: TP of as many is faster
    labels = {c.label for c in job.candidates}
    assert {"colocated:4+tp2", "colocated:1+tp8", "disagg:2p1d+ptp2+dtp4",
            "conditional:1p1d+ptp4+dtp2", "disagg:3p1d+tp2"} <= labels
    assert all(c.num_devices <= 8 for c in job.candidates) and len(labels) == 28
    # a context the TP 2 instance's KV cannot hold beside its 65.7 GiB of weights
    small = _map([*MAP_70B[:-6], "--max-model-len", "131072", "--devices", "8"], tmp_path)
    assert small.simulated.sizes == ((4, 1), (8, 1))
    assert small.simulated.refused[2, 1].startswith(
        "engine/configs/llama-3.1-70b at TP 2, PP 1 does not fit an h100_sxm GPU: 65.7 GiB of "
        "weights + 20 GiB of KV for 131072 tokens > 72 GiB")


def test_map_validate_on_emu_deploys_the_tp_placements_with_each_size_s_profile(tmp_path):
    job = _map(MAP_70B + ["--validate", "1", "--validate-on", "emu"], tmp_path)
    assert job.validate_devices == tuple(f"emu:{i}" for i in range(8))
    assert job.validate_engine.device_profile == L70  # each instance takes its TP's profile
    assert {c.placement for c in job.candidates} >= {"colocated:1+tp8", "disagg:2p1d+ptp2+dtp4"}


def test_map_cells_show_the_winners_per_phase_sizes():
    from experiments.plots import _short

    assert _short("disagg:2p1d+ptp2+dtp4") == "2p1d\nptp2 dtp4"
    assert _short("conditional:1p1d+tp2") == "c1p1d\ntp2"
    assert _short("colocated:2+tp4 (budget 256)") == "co b256\ntp4"
    assert _short("colocated-nochunk:1+tp8") == "co-nc\ntp8"
    assert (_short("disagg:1p3d"), _short("colocated:2"), _short("colocated-nochunk:2")) == \
        ("1p3d", "co", "co-nc")


def test_plan_validate_on_emu_keeps_the_tp_sizes(tmp_path):
    from experiments import cli
    from experiments.commands import plan as plan_cmd

    job = plan_cmd.check(cli.build_parser().parse_args(
        ["plan", "--model", "engine/configs/llama-3.1-70b", "--dtype", "bfloat16",
         "--device-profile", L70, "--emu-kv-scale", "0.00390625", "--devices", "8",
         "--max-model-len", "4096", "--transport", "shm", "--validate",
         "--out", str(tmp_path / "p")]))
    assert job.simulated.sizes == ((2, 1), (4, 1), (8, 1))
    assert any(c.placement == "colocated:1+tp8" for c in job.candidates)
