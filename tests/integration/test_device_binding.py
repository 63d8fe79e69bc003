"""Local mode (one process) builds each worker on its own CUDA device and records which GPU
it used, checked on a fake device table (``tests/fake_cuda.py``): the model load and the
engine see ``cuda:i``; the tensors themselves stay on the CPU, which has no GPU."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from fake_cuda import FakeCuda
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

from engine import device as dev
from engine import serving
from engine.config import ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment

TINY = ModelConfig("tiny-random-llama")


@pytest.fixture
def on_fake_gpus(monkeypatch):
    """Two fake GPUs; the devices the workers ask for are recorded, the work runs on CPU."""
    fake = FakeCuda(num_gpus=2)
    monkeypatch.setattr(dev, "CUDA", fake)
    monkeypatch.delenv(dev.VISIBLE_ENV, raising=False)
    asked: dict[str, list[str]] = {"load": [], "engine": []}
    real_load, real_engine = serving.load_model, serving.Engine

    def load_model(config, device="cpu"):
        asked["load"].append(device)
        return real_load(config, "cpu")

    class CpuEngine(real_engine):
        def __init__(self, loaded, config, **kwargs):
            asked["engine"].append(config.device)
            super().__init__(loaded, dataclasses.replace(config, device="cpu"), **kwargs)

    monkeypatch.setattr(serving, "load_model", load_model)
    monkeypatch.setattr(serving, "Engine", CpuEngine)
    return fake, asked


def _deploy(placement, devices, **kwargs):
    return Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                      TransferConfig(transport="inprocess"), local=True, **kwargs)


def test_local_workers_run_on_their_own_gpus_and_record_them(tiny, on_fake_gpus):
    fake, asked = on_fake_gpus
    workload, expected = mixed_workload(tiny, num_requests=4)
    with _deploy("disagg:1p1d", "cuda:0,cuda:1") as deployment:
        assert_outputs(deployment.run(workload), expected)
        assert_clean(deployment)
        infos = deployment.gather("info")
    assert asked == {"load": ["cuda:0", "cuda:1"], "engine": ["cuda:0", "cuda:1"]}
    assert [(i["device"], i["torch_device"], i["gpu"]["index"], i["gpu"]["uuid"],
             i["gpu"]["name"]) for i in infos] == [
        ("cuda:0", "cuda:0", 0, "GPU-fake-0", "Fake H200 #0"),
        ("cuda:1", "cuda:1", 1, "GPU-fake-1", "Fake H200 #1")]
    # nothing process-wide: only the two engine threads made their own GPU current
    assert threading.get_ident() not in fake.current
    assert sorted(fake.current.values()) == [0, 1]


def test_two_local_workers_can_share_one_gpu(tiny, on_fake_gpus):
    _, asked = on_fake_gpus
    workload, expected = mixed_workload(tiny, num_requests=3)
    with _deploy("disagg:1p1d", "cuda:0", worker_devices=("cuda:0", "cuda:0")) as deployment:
        assert_outputs(deployment.run(workload), expected)
        infos = deployment.gather("info")
    assert asked["load"] == ["cuda:0", "cuda:0"]
    assert {i["gpu"]["uuid"] for i in infos} == {"GPU-fake-0"}


def test_local_cuda_device_that_does_not_exist_is_refused_before_any_worker(on_fake_gpus):
    _, asked = on_fake_gpus
    with pytest.raises(ValueError, match="device cuda:2 does not exist: this machine has 2 GPUs"):
        _deploy("disagg:1p1d", "cuda:0,cuda:2")
    assert asked["load"] == []


def test_shared_devices_need_a_local_placement():
    with pytest.raises(ValueError, match="needs a local placement"):
        Deployment(PlacementConfig("disagg:1p1d", "cuda:0"), TINY, ENGINE,
                   TransferConfig(transport="ray"), worker_devices=("cuda:0", "cuda:0"))
