"""``pdlab map --validate K --validate-on emu``: the checked cells run on emulated devices
``emu:0`` .. ``emu:N-1`` whose engine carries the map's own ``--device-profile`` and
``--emu-kv-scale`` (default 1/256); bad combinations are refused by ``check`` before anything
runs (no run here: ``check`` reads only the profile and the model's config.json). The runs'
lateness line is hand-computed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from engine.config import emulated_devices
from engine.emulated import lateness_p99
from deployment import placement
from experiments import cli, map_validate
from experiments.commands import map as map_cmd

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA_PROFILE = str(DATA / "llama-3.1-8b_h100_sxm_vllm_profile.json")
LLAMA = ["map", "--model", "engine/configs/llama-3.1-8b", "--dtype", "bfloat16",
         "--device-profile", LLAMA_PROFILE, "--transport", "shm", "--io-ratio", "4",
         "--ttft-slo", "0.05:2:2", "--tpot-slo", "0.005:0.1:2", "--max-model-len", "512"]


def _check(argv: list[str], tmp_path: Path):
    args = cli.build_parser().parse_args(argv + ["--out", str(tmp_path / "map")])
    return map_cmd.check(args)


def test_emulated_devices_are_emu_0_to_n_minus_1():
    assert emulated_devices(1) == ("emu:0",)
    assert emulated_devices(4) == ("emu:0", "emu:1", "emu:2", "emu:3")
    with pytest.raises(ValueError, match="n >= 1"):
        emulated_devices(0)


def test_validate_on_emu_runs_on_emu_devices_with_the_maps_profile(tmp_path):
    job = _check(LLAMA + ["--devices", "4", "--validate", "2", "--validate-on", "emu"], tmp_path)
    assert job.validate_devices == ("emu:0", "emu:1", "emu:2", "emu:3")
    assert job.validate_engine.device_profile == LLAMA_PROFILE
    assert job.validate_engine.emu_kv_scale == 1 / 256
    # the simulator's engine stays without emulation; otherwise the two engines are one
    assert job.engine.device_profile is None
    assert job.validate_engine.max_num_seqs == job.engine.max_num_seqs == 256
    assert job.validate_engine.max_model_len == job.engine.max_model_len == 512
    job = _check(LLAMA + ["--devices", "8", "--validate", "1", "--validate-on", "emu",
                          "--emu-kv-scale", "0.001953125"], tmp_path)
    assert job.validate_devices == tuple(f"emu:{i}" for i in range(8))
    assert job.validate_engine.emu_kv_scale == 1 / 512


def test_kv_caches_the_host_cannot_hold_are_refused_with_a_scale_that_fits(tmp_path,
                                                                           monkeypatch):
    """8 emulated H100s keep 8 x 57.04 GiB (the profile's budget) x 1/256 = 1.78 GiB of KV
    on the host: refused where 1 GiB is available, before any worker starts, with the
    largest power of 2 under half of it (8 x 57.04 x 2^-10 = 0.45 GiB)."""
    monkeypatch.setattr(placement, "_host_available_bytes", lambda: 2 ** 30)
    with pytest.raises(ValueError) as err:
        _check(LLAMA + ["--devices", "8", "--validate", "1", "--validate-on", "emu"], tmp_path)
    assert str(err.value) == (
        "argument --emu-kv-scale: 8 emulated h100_sxm KV caches of 57.0 GiB each keep 1.8 GiB "
        "on this host at scale 0.00390625, and it has 1.0 GiB available: pass --emu-kv-scale "
        "0.000976562 (or less)")
    monkeypatch.setattr(placement, "_host_available_bytes", lambda: 2 * 2 ** 30)
    _check(LLAMA + ["--devices", "8", "--validate", "1", "--validate-on", "emu"], tmp_path)


def test_validate_here_keeps_this_machines_devices(tmp_path):
    tiny = ["map", "--model", "tiny-random-llama", "--device-profile",
            str(DATA / "tiny_device_profile.json"), "--transport", "inprocess", "--local",
            "--ttft-slo", "0.1:1:2", "--tpot-slo", "0.01:0.1:2", "--io-ratio", "1",
            "--request-tokens", "32", "--devices", "1", "--validate", "1"]
    job = _check(tiny, tmp_path)
    assert job.validate_devices[0].startswith("cpu:")
    assert job.validate_engine.device_profile is None


@pytest.mark.parametrize("tail, words", [
    (["--validate-on", "emu"], "argument --validate-on: emu says where --validate K runs"),
    (["--validate-placements", "contenders"], "argument --validate-placements: says which "
                                              "placements --validate K runs: give --validate K"),
    (["--validate-window-s", "2"], "argument --validate-window-s: sizes the runs of --validate "
                                   "K: give --validate K too"),
    (["--validate", "1", "--validate-window-s", "0"], "validate_window_s must be > 0"),
    (["--emu-kv-scale", "0.25"], "argument --emu-kv-scale: scales the emulated devices' KV: "
                                 "only with --validate K --validate-on emu"),
    (["--validate", "1", "--emu-kv-scale", "0.25"], "only with --validate K --validate-on emu"),
    # an H100 profile cannot be checked on this machine's CPU devices: the error says how
    (["--validate", "1"], "argument --validate: the profile describes cuda devices (h100_sxm) "
                          "but this machine's are cpu"),
])
def test_bad_combinations_are_refused(tmp_path, tail, words):
    with pytest.raises(ValueError) as err:
        _check(LLAMA + ["--devices", "2"] + tail, tmp_path)
    assert words in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "map").exists()


def test_a_profile_of_another_geometry_is_refused_by_emulation_for(tmp_path):
    """The map's profile names the model (load_profile_for accepts it) but its KV bytes per
    token are not the model's config.json geometry (131072 for Llama-3.1-8B)."""
    profile = json.loads(Path(LLAMA_PROFILE).read_text())
    profile["kv_bytes_per_token"] = 65536
    path = tmp_path / "half_kv.json"
    path.write_text(json.dumps(profile))
    argv = [path.as_posix() if a == LLAMA_PROFILE else a for a in LLAMA]
    with pytest.raises(ValueError) as err:
        _check(argv + ["--devices", "2", "--validate", "1", "--validate-on", "emu"], tmp_path)
    assert str(err.value).startswith("argument --device-profile: the device profile")
    assert "65536 KV bytes per token, model engine/configs/llama-3.1-8b 131072" in str(err.value)


def test_lateness_p99_and_line():
    # numpy's linear p99 of [1, 2]: 1 + 0.99 x (2 - 1)
    assert lateness_p99([{"lateness": 1.0}, {"lateness": 2.0}, {"other": 1}]) == pytest.approx(1.99)
    assert lateness_p99([{"start_s": 0.0}]) is None
    runs = pd.DataFrame({"candidate": ["colocated:2", "disagg:1p1d", "colocated:2"],
                         "rate": [10.0, 10.0, 40.0], "lateness_p99": [1.01, 1.5, 1.03]})
    line = map_validate.lateness_line(runs)
    assert line == ("emulated steps' lateness p99 (actual / modelled) per run: median 1.030, "
                    "worst 1.500 (disagg:1p1d @ 10 req/s); 2 of 3 run(s) above 1.02: their "
                    "latencies include this host's lag")
    assert map_validate.lateness_line(runs.assign(lateness_p99=np.nan)) is None
