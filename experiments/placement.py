"""PlacementConfig -> workers on a device set, and a router over them: the one place that
creates Ray actors (the composition root).

Setting up a deployment:

1. Parse the placement (``colocated:N`` / ``disagg:xPyD``) and the device set; check that
   the set has enough devices and that each exists, before anything starts.
2. Ray mode: start a local Ray cluster (or join ``--address``), reserve one placement-group
   bundle per worker (one GPU, or the CPU cores of a ``cpu:`` device) and start each worker
   as an actor in its bundle; the worker pins itself to its device (``torchdist``: the
   driver first binds the group's rendezvous store at port 0 and keeps it until ``close``,
   see ``kv_transfer.torchdist.open_rendezvous``). Local mode: build the
   workers as plain objects in this process (tests; the in-process transport).
3. Wait until every worker answers ``info`` (bounded), then build the ``Router``. A worker
   that fails to start is an error that keeps its root cause (exception type and message,
   ``engine.errors.describe_error``), not only Ray's "actor died" line.
4. Measure the link peak each decode worker's transfers run on (``kv_transfer.link``,
   issue 29) and set it on that worker's transport, so every ``TransferRecord`` carries
   ``efficiency``: a memcpy on its node when every prefill worker shares the node, else a
   short probe from a prefill worker on another node (NIXL READ, or TCP without NIXL).
   ``link_peaks`` keeps them (decode worker name -> ``LinkPeak``).

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

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode_worker import DecodeWorker
from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig,
                           TransferConfig, cpu_cores_of, parse_devices, parse_placement,
                           placement_engine_overrides)
from engine.errors import describe_error
from engine.model import check_model_name
from engine.serving import EngineLoop
from kv_transfer.faults import with_faults
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.link import LinkPeak, ProbeSource, ProbeTicket, memcpy_peak, probe_peak
from prefill_worker import PrefillWorker
from router.calls import ORDERED, LocalCalls, WorkerDied
from router.router import Router, WorkerRef

REPO_ROOT = Path(__file__).resolve().parent.parent
PEAK_TIMEOUT_S = 60.0  # one link-peak measurement (a 32 MiB copy or probe, 4 runs)
ACTOR_DEATH = (RayActorError,) + tuple(
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

    def call(self, handle: Any, method: str, *args: Any) -> ray.ObjectRef:
        if method in ORDERED:
            seqs = self._seqs.setdefault(handle._actor_id.hex(), itertools.count())
            return handle.ordered.remote(next(seqs), method, *args)
        return getattr(handle, method).remote(*args)

    def ready(self, pending: list, timeout_s: float) -> list:
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

    def result(self, pending: ray.ObjectRef) -> Any:
        try:
            return ray.get(pending, timeout=0)
        except ACTOR_DEATH as err:  # keep the root cause: Ray's first line only says "died"
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
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
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

    Raises:
        ValueError: bad placement or device set, not enough devices, a transport that
            cannot work in this mode.
    """

    def __init__(self, placement: PlacementConfig, model: ModelConfig,
                 engine: EngineConfig | None = None, transfer: TransferConfig | None = None,
                 local: bool = False, faults: dict[str, dict | list[dict]] | None = None,
                 policy: str = "least_loaded", deadline_s: float | None = None,
                 conditional: ConditionalConfig | None = None) -> None:
        self.placement = placement
        self.model = model
        self.engine = placement_engine_overrides(placement.placement, engine or EngineConfig())
        self.transfer = transfer or TransferConfig()
        self.local = local
        self.devices = parse_devices(placement.devices)
        self.layout = worker_layout(placement.placement, self.devices)
        if local and self.transfer.transport != "inprocess":
            raise ValueError("a local placement (one process) needs transport 'inprocess'")
        if not local and self.transfer.transport == "inprocess":
            raise ValueError("transport 'inprocess' needs a local placement; use 'ray', "
                             "'shm', 'nixl' or 'torchdist' across processes")
        if self.transfer.transport == "nixl":  # refused here, not in each worker's start-up
            from kv_transfer.nixl import MISSING, nixl_available

            if not nixl_available():
                raise ValueError(MISSING)
        check_model_name(model)
        self._started_ray = False
        self._pg = None
        self._rendezvous = None  # the torchdist group's TCPStore, held while workers live
        self.handles: dict[str, Any] = {}
        self.calls: Any = LocalCalls() if local else RayCalls()
        self.link_peaks: dict[str, LinkPeak] = {}
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
            self.link_peaks = self._measure_link_peaks()
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
        if not ray.is_initialized():
            init = ray_init_kwargs()
            init["address"] = self.placement.address or "local"  # never join a stray cluster
            if not self.placement.address:
                init["num_cpus"] = len(os.sched_getaffinity(0))
                init["num_gpus"] = sum(d.startswith("cuda") for d in self.devices)
            ray.init(**init)
            self._started_ray = True
        check_devices_exist(self.devices, ray.cluster_resources() if self.placement.address else None)
        bundles = [({"GPU": 1, "CPU": 1} if device.startswith("cuda")
                    else {"CPU": len(cpu_cores_of(device))}) for _, _, device in self.layout]
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
            bundle = bundles[rank]
            actor_cls = ray.remote(cls).options(
                name=None, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                max_concurrency=16, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank))
            self.handles[name] = actor_cls.remote(**kwargs, inside_ray=True)

    def _measure_link_peaks(self) -> dict[str, LinkPeak]:
        """Step 4 of the module docstring; {} for a colocated placement, or when the
        measurement fails (said on stderr: the records then have no efficiency, the run
        goes on)."""
        try:
            return self._link_peaks()
        except Exception as err:  # noqa: BLE001 - a missing peak must not stop a run
            print(f"pdlab: link peak not measured ({type(err).__name__}: {err}); transfer "
                  "records carry no efficiency", file=sys.stderr)
            return {}

    def _link_peaks(self) -> dict[str, LinkPeak]:
        decode = [w for w in self.workers if w.role == "decode"]
        prefill = [w for w in self.workers if w.role == "prefill"]
        if not decode or not prefill:
            return {}
        if self.local:  # one process: P and D share one transport
            peak = memcpy_peak()
            self.handles[decode[0].name].transport.peak_gbps = peak.gbps
            return {w.name: peak for w in decode}
        nodes = dict(zip(self.handles, ray.get(
            [h.__ray_call__.remote(_node_of) for h in self.handles.values()],
            timeout=PEAK_TIMEOUT_S)))
        peaks = {}
        for worker in decode:
            remote = [p for p in prefill if nodes[p.name] != nodes[worker.name]]
            target = self.handles[worker.name]
            if not remote:
                peaks[worker.name] = ray.get(target.__ray_call__.remote(_memcpy_peak_here),
                                             timeout=PEAK_TIMEOUT_S)
                continue
            source = self.handles[remote[0].name]
            ticket = ray.get(source.__ray_call__.remote(_open_probe), timeout=PEAK_TIMEOUT_S)
            try:
                peaks[worker.name] = ray.get(target.__ray_call__.remote(_probe_here, ticket),
                                             timeout=PEAK_TIMEOUT_S)
            finally:
                ray.get(source.__ray_call__.remote(_close_probe), timeout=PEAK_TIMEOUT_S)
        return peaks

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
            ray.kill(self.handles[name], no_restart=True)

    def close(self) -> None:
        """Stop every worker, release the placement group (and Ray if started here); twice is fine."""
        for name, handle in self.handles.items():
            try:
                if self.local:
                    handle.shutdown()
                else:
                    ray.kill(handle, no_restart=True)
            except Exception:  # already dead
                pass
        if self.local:
            self.calls.shutdown()
        self.handles = {}
        self._rendezvous = None
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- link peaks, run inside the worker actors (``__ray_call__``: fn(worker, *args)) ----------
def _node_of(worker) -> str:
    return ray.get_runtime_context().get_node_id()


def _memcpy_peak_here(worker) -> LinkPeak:
    peak = memcpy_peak()
    worker.transport.peak_gbps = peak.gbps
    return peak


def _open_probe(worker) -> ProbeTicket:
    worker._link_probe = ProbeSource(host=ray.util.get_node_ip_address())
    return worker._link_probe.ticket


def _probe_here(worker, ticket: ProbeTicket) -> LinkPeak:
    peak = probe_peak(ticket)
    worker.transport.peak_gbps = peak.gbps
    return peak


def _close_probe(worker) -> None:
    worker._link_probe.close()
    del worker._link_probe


def ray_init_kwargs() -> dict[str, Any]:
    """How pdlab starts or joins Ray (tests that start Ray themselves use the same)."""
    return {"address": "local", "include_dashboard": False, "log_to_driver": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": _pythonpath()}}}


def _pythonpath() -> str:
    """Actors import pdlab from this checkout even when it is not installed."""
    return os.pathsep.join([str(REPO_ROOT)] + [p for p in sys.path if p])

