"""Emulated instances that span several emulated devices: each is one emulated runner timed by
the profile of its TP size (one ``--device-profile`` per TP size) and holding the KV budget of
all its devices; an instance whose TP has no profile is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployment.placement import Deployment
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.emulated import EmulatedRunner
from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledBatch
from planner.latency import DeviceProfile

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA = ModelConfig("engine/configs/llama-3.1-8b", "bfloat16")


def profile_path(tp: int) -> str:
    return str(DATA / f"llama-3.1-8b_h100_sxm_vllm{'' if tp == 1 else f'_tp{tp}'}_profile.json")


def engine_config(*tps: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512,
                        device_profile=",".join(profile_path(tp) for tp in tps),
                        emu_kv_scale=1 / 256)


def deploy(placement: str, devices: str, *tps: int) -> Deployment:
    return Deployment(PlacementConfig(placement, devices), LLAMA, engine_config(*tps),
                      TransferConfig(transport="inprocess", timeout_s=20.0), local=True)


def test_a_per_phase_tp_run_finishes_on_each_instances_profile(monkeypatch):
    """prefill at TP 2, decode at TP 4 (6 emulated H100s): every request ends at its length,
    each runner held every step for its own profile's modelled time, and each instance's KV
    budget is its devices' together (4 x one H100's at TP 4: Llama-3.1-8B's 8 KV heads, 2 a
    device)."""
    held: list[tuple[EmulatedRunner, ScheduledBatch, float]] = []
    execute = EmulatedRunner.execute

    def recording(self, batch, on_layer_done=None):
        held.append((self, batch.step_features(), self.modelled_s(batch)))
        return execute(self, batch, on_layer_done)

    monkeypatch.setattr(EmulatedRunner, "execute", recording)
    workload = [(Request(f"r{i}", tuple(range(7 + i, 7 + i + n)), SamplingParams(max_tokens=12)),
                 0.01 * i) for i, n in enumerate((40, 130, 64, 250, 17, 96))]
    profiles = {tp: DeviceProfile.load(profile_path(tp)) for tp in (2, 4)}
    with deploy("disagg:1p1d+ptp2+dtp4", "emu:0-5", 1, 2, 4) as deployment:
        records = deployment.run(workload)
        engines = {name: deployment.handles[name].engine for name in ("prefill-0", "decode-0")}
    assert [(r.request_id, r.error, len(r.output_token_ids)) for r in records] == [
        (f"r{i}", None, 12) for i in range(6)]
    runner_tp = {id(engines["prefill-0"].runner): 2, id(engines["decode-0"].runner): 4}
    tokens = {2: 0, 4: 0}  # prompt tokens prefilled at TP 2, tokens decoded at TP 4
    for runner, f, modelled in held:
        tp = runner_tp[id(runner)]
        tokens[tp] += f.prefill_tokens + f.batch_size
        assert modelled == profiles[tp].step_s(f)
        assert modelled != profiles[6 - tp].step_s(f)  # the other size's time differs
    assert tokens == {2: 40 + 130 + 64 + 250 + 17 + 96, 4: 6 * 11}
    for name, tp in (("prefill-0", 2), ("decode-0", 4)):
        engine = engines[name]
        per_device = profiles[tp].kv_budget_bytes(engine.config)
        assert engine.runner.emulation.kv_budget_bytes(engine.config) == tp * per_device
        assert engine.runner.emulation.device.size == (tp, 1)


def test_an_instance_whose_tp_has_no_profile_is_refused():
    with pytest.raises(ValueError, match=r"^argument --device-profile: the decode instances of "
                                         r"disagg:1p1d\+ptp2\+dtp4 run at TP 4 PP 1, the "
                                         r"profiles given are TP 1, TP 2: no instance of TP 4, "
                                         r"PP 1: no profile of that TP given \(pdlab profile "
                                         r"--from-silicon-db --tp 4\)$"):
        deploy("disagg:1p1d+ptp2+dtp4", "emu:0-5", 1, 2)
    with pytest.raises(ValueError, match=r"^argument --device-profile: two device profiles of "
                                         r"TP 2: give one per TP size$"):
        deploy("colocated:1+tp2", "emu:0-1", 2, 2)


def test_validation_runs_tp_placements_and_models_each_worker_on_its_size(tmp_path):
    """``validate.validate`` (plan --validate's) on emulated TP placements: the placements run,
    and every real step of validation_steps.csv is modelled on its own instance's profile."""
    import pandas as pd

    from engine.metrics import SLO
    from experiments import validate
    from experiments.options import load_profiles_for
    from experiments.workload_spec import WorkloadSpec
    from planner import search

    engine = engine_config(1, 2, 4)
    _, profiles = load_profiles_for(engine.device_profile, LLAMA, "--device-profile", 6, engine, 1)
    spec = WorkloadSpec(dataset="synthetic", num_requests=6, seeds=1, prompt_len="64-300",
                        output_len="8-16")
    cands = [search.Candidate("disagg:1p1d+ptp2+dtp4"), search.Candidate("colocated:1+tp2")]
    errors, summary = validate.validate(
        cands, [20.0], spec, LLAMA, engine, TransferConfig(transport="inprocess"), profiles,
        profiles.base.transfer("inprocess"), SLO(ttft_s=0.5, tpot_s=0.05), tmp_path,
        devices="emu:0-5", local=True)
    assert sorted(errors["placement"]) == ["colocated:1+tp2", "disagg:1p1d+ptp2+dtp4"]
    steps = pd.read_csv(tmp_path / "validation_steps.csv")
    size = {("disagg:1p1d+ptp2+dtp4", "prefill-0"): 2, ("disagg:1p1d+ptp2+dtp4", "decode-0"): 4,
            ("colocated:1+tp2", "colocated-0"): 2}
    assert set(zip(steps["placement"], steps["worker"])) == set(size)
    for row in steps.itertuples():
        step_s = DeviceProfile.load(profile_path(size[row.placement, row.worker])).step_time()
        assert row.model_s == step_s(row.prefill_tokens, row.prefill_attention,
                                     row.batch_size, row.sum_context)
    assert set(summary["step_correction_by_worker"]) == {f"{p} {w}" for p, w in size}


def test_an_instance_that_does_not_fit_its_devices_memory_is_refused():
    """Llama-3.1-70B at TP 2: 65.7 GiB of weights per H100 leave no room for a 131072-token
    request's KV (the planner's memory-fit rule, ``engine.memory_fit``)."""
    tp2 = str(DATA / "llama-3.1-70b_h100_sxm_vllm_tp2_profile.json")
    engine = EngineConfig(max_num_seqs=1, max_model_len=131072, max_num_batched_tokens=2048,
                          device_profile=tp2, emu_kv_scale=1 / 256)
    with pytest.raises(ValueError, match=r"^argument --device-profile: the colocated instances "
                                         r"of colocated:1\+tp2 run at TP 2 PP 1, the profiles "
                                         r"given are TP 2: no instance of TP 2, PP 1: "
                                         r"engine/configs/llama-3.1-70b at TP 2, PP 1 does not "
                                         r"fit an h100_sxm GPU: 65.7 GiB of weights \+ 20 GiB "
                                         r"of KV for 131072 tokens > 72 GiB \(0.9 of 80 "
                                         r"GiB\)$"):
        Deployment(PlacementConfig("colocated:1+tp2", "emu:0-1"),
                   ModelConfig("engine/configs/llama-3.1-70b", "bfloat16"), engine,
                   TransferConfig(transport="inprocess"), local=True)
