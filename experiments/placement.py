"""PlacementConfig -> workers on a device set, and a router over them: the one place that
creates Ray actors (the composition root).

Setting up a deployment:

1. Parse the placement (``colocated:N`` / ``disagg:xPyD``) and the device set; check that
   the set has enough devices and that each exists, before anything starts.
2. Ray mode: start a local Ray cluster (or join ``--address``), reserve one placement-group
   bundle per worker (its GPU, or the CPU cores of a ``cpu:`` device: ``gpu_actor_resources``)
   and start each worker as an actor in its bundle; the worker pins itself to its device
   (on a cluster started here ``cuda:i`` is GPU i exactly; joining one, Ray picks the GPU).
   ``torchdist``: the driver first binds the group's rendezvous store at port 0 and keeps it
   until ``close``, see ``kv_transfer.torchdist.open_rendezvous``. Local mode: build the
   workers as plain objects in this process (tests; the in-process transport), each on its
   own device without pinning the process (a ``cuda:i`` worker runs on ``cuda:i``).
3. Wait until every worker answers ``info`` (bounded), then build the ``Router``. A worker
   that fails to start is an error that keeps its root cause (exception type and message,
   ``engine.errors.describe_error``), not only Ray's "actor died" line.

``close()`` stops the workers and releases the placement group (and Ray, if it was started
here).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from decode_worker import DecodeWorker
from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig,
                           TransferConfig, cpu_cores_of, parse_devices, parse_placement,
                           placement_engine_overrides)
from engine.device import PIN_ENV, VISIBLE_ENV
from engine.errors import describe_error
from engine.model import check_model_name
from engine.serving import EngineLoop
from kv_transfer.faults import with_faults
from kv_transfer.inprocess import InProcessTransport
from prefill_worker import PrefillWorker
from router.calls import ORDERED, LocalCalls, WorkerDied
from router.router import Router, WorkerRef

REPO_ROOT = Path(__file__).resolve().parent.parent
# Ray is imported inside the functions that use it, never here: local mode (one process, the
# in-process transport) runs where Ray is not installed, e.g. `make gpu-check`.


def _actor_death() -> tuple[type, ...]:
    """Ray's exceptions for an actor that died (the set differs between Ray versions)."""
    import ray

    return (ray.exceptions.RayActorError,) + tuple(
        getattr(ray.exceptions, name) for name in ("ActorDiedError", "ActorUnavailableError")
        if hasattr(ray.exceptions, name))


class RayCalls:
    """``router.calls.Calls`` over Ray actor handles.

    A threaded actor (``max_concurrency > 1``) runs calls out of order, even within a
    concurrency group of size 1 (Ray forces ``allow_out_of_order_execution`` there). So the
    ``ORDERED`` methods are numbered per actor and sent as ``ordered(seq, method, ...)``:
    the worker applies them in that order, never holding a thread to wait for an earlier
    number (``engine.serving.InOrder``), while long polls and reads run beside them on the
    actor's other threads.
    """

    accepts_futures = True  # ready() also takes concurrent.futures.Futures (wake-ups)

    def __init__(self) -> None:
        self._seqs: dict[str, itertools.count] = {}

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        """Start ``handle.method(*args)``; returns its ``ray.ObjectRef``."""
        if method in ORDERED:
            seqs = self._seqs.setdefault(handle._actor_id.hex(), itertools.count())
            return handle.ordered.remote(next(seqs), method, *args)
        return getattr(handle, method).remote(*args)

    def ready(self, pending: list, timeout_s: float) -> list:
        import ray

        futures = [p for p in pending if isinstance(p, cf.Future)]
        if futures:  # ray.wait takes ObjectRefs only: wait in 5 ms slices, checking the futures
            refs = [p for p in pending if not isinstance(p, cf.Future)]
            end_s = time.monotonic() + timeout_s
            while True:
                done = [f for f in futures if f.done()]
                if refs:
                    done += self.ready(refs, 0.0 if done else
                                       max(0.0, min(0.005, end_s - time.monotonic())))
                elif not done:
                    cf.wait(futures, timeout=max(0.0, end_s - time.monotonic()),
                            return_when=cf.FIRST_COMPLETED)
                    done = [f for f in futures if f.done()]
                if done or time.monotonic() >= end_s:
                    return done
        first, _ = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not first:
            return []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        return ready

    def result(self, pending: Any) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        try:
            return ray.get(pending, timeout=0)
        except _actor_death() as err:  # keep the root cause: Ray's first line only says "died"
            raise WorkerDied(f"{type(err).__name__}: {describe_error(err)}") from err
        except RayTaskError as err:  # the method raised: its own error, not Ray's wrapper
            raise (err.cause if isinstance(err.cause, Exception) else err) from None


def worker_layout(placement: str, devices: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(name, role, device)`` per worker, devices taken in order.

    Raises:
        ValueError: the placement needs more devices than the set has.
    """
    kind, first, second = parse_placement(placement)
    roles = ["colocated"] * first if kind == "colocated" else ["prefill"] * first + ["decode"] * second
    if len(roles) > len(devices):
        raise ValueError(f"placement {placement} needs {len(roles)} devices, the device set "
                         f"{','.join(devices)} has {len(devices)}")
    counts: dict[str, int] = {}
    layout = []
    for role, device in zip(roles, devices):
        layout.append((f"{role}-{counts.get(role, 0)}", role, device))
        counts[role] = counts.get(role, 0) + 1
    return layout


def check_devices_exist(devices: tuple[str, ...], cluster_resources: dict | None = None) -> None:
    """Each device must exist here (or, joining a cluster, fit its resources).

    Raises:
        ValueError: naming the device and what exists.
    """
    gpus = [d for d in devices if d.startswith("cuda")]
    if cluster_resources is not None:  # remote nodes: only totals can be checked
        need_cpu = sum(len(cpu_cores_of(d)) for d in devices if d.startswith("cpu"))
        if gpus and len(gpus) > cluster_resources.get("GPU", 0):
            raise ValueError(f"{len(gpus)} GPUs asked for, the Ray cluster has "
                             f"{cluster_resources.get('GPU', 0)}")
        if need_cpu > cluster_resources.get("CPU", 0):
            raise ValueError(f"{need_cpu} CPU cores asked for, the Ray cluster has "
                             f"{cluster_resources.get('CPU', 0)}")
        return
    if gpus:
        from engine.device import CUDA  # the CUDA seam (tests fake the device table)

        count = CUDA.device_count() if CUDA.is_available() else 0
        for device in gpus:
            if int(device.split(":")[1]) >= count:
                raise ValueError(f"device {device} does not exist: this machine has {count} GPUs")
    cores = os.sched_getaffinity(0)
    for device in devices:
        if device.startswith("cpu") and not set(cpu_cores_of(device)) <= cores:
            raise ValueError(f"device {device} does not exist: this machine offers cores "
                             f"{sorted(cores)}")


class Deployment:
    """The workers of one placement on a device set, and a router over them.

    Args:
        placement: placement, device set and Ray address.
        model, engine, transfer: as every worker gets them.
        local: build workers in this process instead of as Ray actors.
        faults: worker name -> FaultyTransport arguments (or a list of them, stacked:
            ``kv_transfer.faults.with_faults``), plus ``step_delay_s`` for a straggler
            worker (tests and fault experiments).
        policy: router policy.
        deadline_s: router deadline; default: the transfer timeout plus 5 s, so a
            transfer's own timeout error arrives first.
        conditional: the local/remote prefill rule of ``conditional:xPyD`` (router).
        worker_devices: local mode only: each worker's device, in layout order, instead of
            one device of the set each; devices may repeat (e.g. both workers of
            ``disagg:1p1d`` on ``cuda:0``, which only one process can share).

    Devices: in local mode a ``cuda:i`` worker runs on GPU i of this process as the torch
    device ``cuda:i`` (``engine.device``: several workers, several GPUs, one process). Under
    Ray each worker sees only its GPU; on a cluster pdlab starts, ``cuda:i`` is exactly GPU i
    of the driver's numbering (``gpu_actor_resources``), on a cluster it joins (``--address``)
    Ray picks a free GPU. Either way ``info()["gpu"]`` records the GPU used (UUID, name).

    Raises:
        ValueError: bad placement or device set, not enough devices, a transport that
            cannot work in this mode.
    """

    def __init__(self, placement: PlacementConfig, model: ModelConfig,
                 engine: EngineConfig | None = None, transfer: TransferConfig | None = None,
                 local: bool = False, faults: dict[str, dict | list[dict]] | None = None,
                 policy: str = "least_loaded", deadline_s: float | None = None,
                 conditional: ConditionalConfig | None = None,
                 worker_devices: tuple[str, ...] | None = None) -> None:
        self.placement = placement
        self.model = model
        self.engine = placement_engine_overrides(placement.placement, engine or EngineConfig())
        self.transfer = transfer or TransferConfig()
        self.local = local
        if worker_devices is not None:
            if not local:
                raise ValueError("worker_devices (workers sharing a device) needs a local placement")
            parse_devices(",".join(dict.fromkeys(worker_devices)))  # each must be a device
            self.devices = tuple(worker_devices)
        else:
            self.devices = parse_devices(placement.devices)
        self.layout = worker_layout(placement.placement, self.devices)
        if local and self.transfer.transport != "inprocess":
            raise ValueError("a local placement (one process) needs transport 'inprocess'")
        if not local and self.transfer.transport == "inprocess":
            raise ValueError("transport 'inprocess' needs a local placement; use 'ray', "
                             "'shm' or 'torchdist' across processes")
        check_model_name(model)
        self._started_ray = False
        self._pg = None
        self._rendezvous = None  # the torchdist group's TCPStore, held while workers live
        self.handles: dict[str, Any] = {}
        self.calls: Any = LocalCalls() if local else RayCalls()
        try:  # a worker that fails to start must not leave the others (or Ray) behind
            if local:
                check_devices_exist(self.devices)
                self._start_local(faults or {})
            else:
                self._start_ray(faults or {})
            self.workers = [WorkerRef(name, role, self.handles[name], rank)
                            for rank, (name, role, _) in enumerate(self.layout)]
            self.router = Router(self.workers, self.calls, placement.placement, policy,
                                 deadline_s or self.transfer.timeout_s + 5.0,
                                 conditional=conditional)
        except BaseException:
            self.close()
            raise

    # ---- construction -----------------------------------------------------------------
    def _worker_args(self, name: str, role: str, device: str, faults: dict, rank: int,
                     init_method: str | None) -> tuple[type, dict]:
        worker_faults = faults.get(name) or []
        layers = [dict(f) for f in ([worker_faults] if isinstance(worker_faults, dict)
                                    else worker_faults)]
        step_delay_s = sum(f.pop("step_delay_s", 0.0) for f in layers)
        worker_faults = [f for f in layers if f]
        common = {"name": name, "model_config": self.model, "engine_config": self.engine,
                  "device": device, "step_delay_s": step_delay_s}
        if role == "colocated":
            return EngineLoop, common
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        return cls, {**common, "transfer_config": self.transfer, "faults": worker_faults or None,
                     "rank": rank, "world_size": len(self.layout), "init_method": init_method}

    def _start_local(self, faults: dict) -> None:
        shared = InProcessTransport(checksum=self.transfer.checksum)
        for rank, (name, role, device) in enumerate(self.layout):
            cls, kwargs = self._worker_args(name, role, device, faults, rank, None)
            if cls is not EngineLoop:  # P and D share one in-process transport
                kwargs["transport"] = with_faults(shared, kwargs.pop("faults"))
            self.handles[name] = cls(**kwargs, bind=False)

    def _start_ray(self, faults: dict) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            init = ray_init_kwargs()
            if self.placement.address:
                init["address"] = self.placement.address
            else:
                init.update(local_cluster_kwargs(self.devices))
            ray.init(**init)
            self._started_ray = True
        check_devices_exist(self.devices, ray.cluster_resources() if self.placement.address else None)
        # cuda:i is honoured exactly only on a cluster started here (its resources are ours)
        pinned = self._started_ray and not self.placement.address
        resources = [gpu_actor_resources(device, pinned) for _, _, device in self.layout]
        bundles = [bundle for bundle, _ in resources]
        # shm moves KV through one node's shared memory: every worker must be on that node
        strategy = "STRICT_PACK" if self.transfer.transport == "shm" else "PACK"
        self._pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=60)
        except GetTimeoutError as err:
            raise ValueError(f"the Ray cluster cannot hold {bundles} "
                             f"(it has {ray.cluster_resources()})") from err
        init_method = None
        if self.transfer.transport == "torchdist":
            # bound here, at port 0, and held until close(): no port can be taken in between
            from kv_transfer.torchdist import open_rendezvous

            self._rendezvous, init_method = open_rendezvous(ray.util.get_node_ip_address(),
                                                            self.transfer.timeout_s)
        for rank, (name, role, device) in enumerate(self.layout):
            cls, kwargs = self._worker_args(name, role, device, faults, rank, init_method)
            actor_cls = ray.remote(cls).options(
                name=None, max_concurrency=16, max_restarts=0, **resources[rank][1],
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank))
            self.handles[name] = actor_cls.remote(**kwargs, inside_ray=True)

    # ---- use ----------------------------------------------------------------------------
    def run(self, workload, on_finish=None):
        """``Router.run`` on this deployment."""
        return self.router.run(workload, on_finish)

    def gather(self, method: str) -> list:
        """Call ``method`` on every live worker and collect the results (bounded wait)."""
        results = []
        for worker in self.workers:
            if worker.alive:
                results.append(self.router.call_now(worker, method))
        return results

    def step_records(self) -> list[dict]:
        return [r for records in self.gather("step_records") for r in records]

    def transfer_records(self) -> list[dict]:
        if self.placement.kind == "colocated":
            return []
        decode = [w for w in self.workers if w.role == "decode" and w.alive]
        return [r for w in decode for r in self.router.call_now(w, "transfer_records")]

    def statuses(self) -> list[dict]:
        return self.gather("status")

    def kill(self, name: str) -> None:
        """Kill one worker (failure tests)."""
        if self.local:
            self.calls.kill(self.handles[name])
        else:
            import ray

            ray.kill(self.handles[name], no_restart=True)

    def close(self) -> None:
        """Stop every worker, release the placement group (and Ray if started here); twice is fine."""
        for name, handle in self.handles.items():
            try:
                if self.local:
                    handle.shutdown()
                else:
                    import ray

                    ray.kill(handle, no_restart=True)
            except Exception:  # already dead
                pass
        if self.local:
            self.calls.shutdown()
        self.handles = {}
        self._rendezvous = None
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def physical_gpu(device: str) -> str:
    """The GPU id that ``cuda:i`` names for this (driver) process: entry i of its
    ``CUDA_VISIBLE_DEVICES`` where that is set (an index, a UUID or a MIG id), else ``i``."""
    index = int(device.split(":")[1])
    visible = os.environ.get(VISIBLE_ENV)
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(f"device {device} does not exist: {VISIBLE_ENV}={visible!r} shows "
                         f"{len(ids)} GPUs")
    return ids[index]


def gpu_resource(device: str) -> str:
    """The Ray custom resource that stands for GPU ``cuda:i`` on a cluster pdlab starts."""
    return f"pdlab_cuda_{device.split(':')[1]}"


def gpu_actor_resources(device: str, pinned: bool) -> tuple[dict[str, float], dict[str, Any]]:
    """``(bundle, actor options)`` of a worker on ``device`` under Ray.

    A CPU device: its cores. A CUDA device, ``pinned`` (a cluster pdlab started, so its
    resources are all pdlab's): one ``gpu_resource`` unit instead of Ray's ``GPU``, and the
    actor gets ``PDLAB_CUDA_VISIBLE_DEVICES`` = ``physical_gpu(device)``, which
    ``engine.device.bind_device`` makes its ``CUDA_VISIBLE_DEVICES`` before CUDA starts: so
    ``cuda:i`` is exactly GPU i. Not pinned (``--address``: a shared cluster whose GPU indices
    are per node): ``num_gpus=1``, Ray picks the GPU and sets ``CUDA_VISIBLE_DEVICES``; the
    index is then only a label, and ``info()["gpu"]`` says which GPU it was.
    """
    if device.startswith("cpu"):
        cores = len(cpu_cores_of(device))
        return {"CPU": cores}, {"num_cpus": cores, "num_gpus": 0}
    if not pinned:
        return {"GPU": 1.0, "CPU": 1.0}, {"num_cpus": 1, "num_gpus": 1}
    resource = gpu_resource(device)
    env = {**ray_init_kwargs()["runtime_env"]["env_vars"], PIN_ENV: physical_gpu(device)}
    return ({resource: 1.0, "CPU": 1.0},
            {"num_cpus": 1, "num_gpus": 0, "resources": {resource: 1.0},
             "runtime_env": {"env_vars": env}})


def local_cluster_kwargs(devices: tuple[str, ...]) -> dict[str, Any]:
    """``ray.init`` arguments of the private cluster pdlab starts for ``devices``: this
    machine's cores, no Ray ``GPU`` resource, one ``gpu_resource`` per CUDA device."""
    return {"address": "local",  # never join a stray cluster
            "num_cpus": len(os.sched_getaffinity(0)), "num_gpus": 0,
            "resources": {gpu_resource(d): 1.0 for d in devices if d.startswith("cuda")}}


def ray_init_kwargs() -> dict[str, Any]:
    """How pdlab starts or joins Ray (tests that start Ray themselves use the same)."""
    return {"address": "local", "include_dashboard": False, "log_to_driver": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": _pythonpath()}}}


def _pythonpath() -> str:
    """Actors import pdlab from this checkout even when it is not installed."""
    return os.pathsep.join([str(REPO_ROOT)] + [p for p in sys.path if p])

