"""Device selection, binding and recording on CUDA, against a fake device table
(``engine.device.CUDA`` is the seam every CUDA call goes through), so the CUDA paths are
tested on a machine without a GPU. Also the Ray GPU resources a placement asks for."""

from __future__ import annotations

import threading

import pytest
from fake_cuda import FakeCuda

from engine import device as dev
from deployment import ray_actors


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(dev, "CUDA", fake)
    monkeypatch.delenv(dev.VISIBLE_ENV, raising=False)
    monkeypatch.delenv(dev.PIN_ENV, raising=False)
    return fake


def test_pinned_cuda_worker_makes_its_gpu_current(cuda):
    assert dev.bind_device("cuda:1") == "cuda:1"
    assert cuda.current == {threading.get_ident(): 1}


def test_placed_cuda_worker_runs_on_its_gpu_and_changes_nothing_process_wide(cuda):
    """Local mode: several workers in one process, each on its own torch device."""
    assert [dev.bind_device(d, pin=False) for d in ("cuda:0", "cuda:1")] == ["cuda:0", "cuda:1"]
    assert cuda.current == {}


def test_cuda_device_errors(cuda):
    with pytest.raises(ValueError, match=r"device cuda:2 does not exist \(2 GPUs\)"):
        dev.bind_device("cuda:2", pin=False)
    cuda.gpus = []
    with pytest.raises(ValueError, match="needs CUDA, which this machine does not have"):
        dev.bind_device("cuda:0")


def test_inside_ray_the_worker_sees_one_gpu_and_applies_its_pin(cuda, monkeypatch):
    monkeypatch.setenv(dev.VISIBLE_ENV, "0,1,2,3")  # inherited from the raylet
    monkeypatch.setenv(dev.PIN_ENV, "3")
    assert dev.bind_device("cuda:3", inside_ray=True) == "cuda:0"
    assert dev.gpu_identity("cuda:0")["cuda_visible_devices"] == "3"


def test_a_pin_after_cuda_started_with_another_view_is_refused(cuda, monkeypatch):
    cuda.initialized = True
    monkeypatch.setenv(dev.VISIBLE_ENV, "0")
    monkeypatch.setenv(dev.PIN_ENV, "3")
    with pytest.raises(ValueError, match="pinned to GPU 3.*CUDA already started"):
        dev.bind_device("cuda:3", inside_ray=True)


def test_gpu_identity_names_the_physical_gpu(cuda, monkeypatch):
    monkeypatch.setenv(dev.VISIBLE_ENV, "4,5")
    assert dev.gpu_identity("cuda:1") == {"index": 1, "name": "Fake H200 #1",
                                          "uuid": "GPU-fake-1",
                                          "total_memory_bytes": 142 * 2**30,
                                          "cuda_visible_devices": "4,5"}
    assert dev.gpu_identity("cpu") is None


def test_use_on_this_thread_sets_the_calling_threads_device_only(cuda):
    thread = threading.Thread(target=dev.use_on_this_thread, args=("cuda:1",))
    thread.start()
    thread.join()
    dev.use_on_this_thread("cpu")
    assert cuda.current == {thread.ident: 1}


# ---- what a placement asks Ray for -----------------------------------------------------
def test_physical_gpu_follows_the_drivers_visible_devices(monkeypatch):
    monkeypatch.delenv(dev.VISIBLE_ENV, raising=False)
    assert ray_actors.physical_gpu("cuda:3") == "3"
    monkeypatch.setenv(dev.VISIBLE_ENV, "4,5,GPU-abc")
    assert [ray_actors.physical_gpu(f"cuda:{i}") for i in range(3)] == ["4", "5", "GPU-abc"]
    with pytest.raises(ValueError, match="cuda:3 does not exist"):
        ray_actors.physical_gpu("cuda:3")


def test_pinned_gpu_actor_gets_its_own_resource_and_pin(monkeypatch):
    """A cluster pdlab starts: cuda:i takes resource pdlab_cuda_i, never Ray's GPU, and the
    actor is told which physical GPU to make visible (PYTHONPATH kept beside it)."""
    monkeypatch.setenv(dev.VISIBLE_ENV, "6,7")
    bundle, options = ray_actors.gpu_actor_resources("cuda:1", pinned=True)
    assert bundle == {"pdlab_cuda_1": 1.0, "CPU": 1.0}
    assert options["num_gpus"] == 0 and options["resources"] == {"pdlab_cuda_1": 1.0}
    env = options["runtime_env"]["env_vars"]
    assert env[dev.PIN_ENV] == "7" and "PYTHONPATH" in env


def test_unpinned_gpu_actor_takes_any_gpu_ray_gives():
    assert ray_actors.gpu_actor_resources("cuda:1", pinned=False) == (
        {"GPU": 1.0, "CPU": 1.0}, {"num_cpus": 1, "num_gpus": 1})
    assert ray_actors.gpu_actor_resources("cpu:0-2", pinned=True) == (
        {"CPU": 3}, {"num_cpus": 3, "num_gpus": 0})


def test_a_tp_instance_actor_holds_all_its_devices_its_ranks_see_them_in_rank_order(monkeypatch):
    """One actor per instance: its bundle sums its devices'; pinned GPUs are made visible in
    rank order (rank r is cuda:r inside the actor); overlapping core groups oversubscribe."""
    monkeypatch.setenv(dev.VISIBLE_ENV, "4,5,6,7")
    bundle, options = ray_actors.instance_actor_resources(("cuda:3", "cuda:1"), pinned=True)
    assert bundle == {"pdlab_cuda_3": 1.0, "pdlab_cuda_1": 1.0, "CPU": 2.0}
    assert options["resources"] == {"pdlab_cuda_3": 1.0, "pdlab_cuda_1": 1.0}
    assert options["runtime_env"]["env_vars"][dev.PIN_ENV] == "7,5" and options["num_gpus"] == 0
    assert ray_actors.instance_actor_resources(("cuda:0", "cuda:1"), pinned=False) == (
        {"GPU": 2.0, "CPU": 2.0}, {"num_cpus": 2, "num_gpus": 2})
    assert ray_actors.instance_actor_resources(("cpu:0", "cpu:1"), pinned=True) == (
        {"CPU": 2}, {"num_cpus": 2, "num_gpus": 0})
    assert ray_actors.local_cluster_kwargs(("cpu:0", "cpu:1", "cpu:0-1"))["num_cpus"] >= 4


def test_a_ray_that_does_not_start_is_one_runtime_error_naming_the_cause(monkeypatch):
    """ray.init failing (a GCS that did not come up on a busy host) reaches the CLI as one
    RuntimeError line with the root cause, not a traceback; Ray is not marked started."""
    import ray

    def fail(**kwargs):
        raise ConnectionError("GCS did not answer within 30 s")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fail)
    workers = ray_actors.RayWorkers((("cpu:0",), ("cpu:1",)), None, "ray")
    with pytest.raises(RuntimeError, match=r"^Ray did not start \(a local cluster\): GCS did not "
                                           r"answer within 30 s$"):
        workers.connect()
    assert not workers._started_ray
    joining = ray_actors.RayWorkers((("cpu:0",),), "10.0.0.1:6379", "ray")
    with pytest.raises(RuntimeError, match=r"joining 10.0.0.1:6379"):
        joining.connect()


def test_an_emulated_worker_binds_no_core_and_runs_one_torch_thread(monkeypatch):
    import torch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(dev.os, "sched_setaffinity", lambda *a: pytest.fail("pinned a core"))
    assert dev.bind_device("emu:3") == "cpu" and threads == [1]
    assert dev.bind_device("emu:3", pin=False) == "cpu" and threads == [1]  # shared process
