"""Ray at the edge: the only module that imports Ray, loaded only when a deployment runs its
workers as Ray actors (local placements run where Ray is not installed, ``make gpu-check``).

``RayWorkers`` starts a private Ray instance sized to this machine (``local_cluster_kwargs``) or
joins ``--address``; reserves one placement-group bundle per worker (``gpu_actor_resources``;
``STRICT_PACK`` for shm, whose KV moves through one node's shared memory) and starts each worker
as a threaded actor in its bundle; ``watch(on_death)`` tells ``on_death(name, handle, cause)``
at once when an actor dies (each actor holds one call that never returns; an error in the
watch is logged and the watch goes on); ``close`` kills the
actors and releases the group. ``RayCalls`` is how the router calls them (``router.calls``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import cpu_cores_of, device_index
from engine.device import PIN_ENV, VISIBLE_ENV
from engine.errors import describe_error, without_traceback
from kv_transfer.link import LinkPeak, ProbeSource, ProbeTicket, memcpy_peak, probe_peak
from router.calls import WorkerDied

REPO_ROOT = Path(__file__).resolve().parent.parent
PEAK_TIMEOUT_S = 60.0  # one link-peak measurement (a 32 MiB copy or probe, 4 runs)
# Ray's exceptions for an actor that died (the set differs between Ray versions)
_LOG = logging.getLogger(__name__)
WATCH_RETRY_S = 0.2  # pause of the actor watch after an error, before it watches again
ACTOR_DEATH = (RayActorError,) + tuple(
    getattr(ray.exceptions, name) for name in ("ActorDiedError", "ActorUnavailableError")
    if hasattr(ray.exceptions, name))


class RayCalls:
    """``router.calls.Calls`` over Ray actor handles (lifecycle calls and reads; what a
    worker holds changes only through its channel, in order)."""

    def call(self, handle: Any, method: str, *args: Any) -> Any:
        """Start ``handle.method(*args)``; returns its ``ray.ObjectRef``."""
        return getattr(handle, method).remote(*args)

    def ready(self, pending: list, timeout_s: float) -> list:
        first, _ = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not first:
            return []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        return ready

    def result(self, pending: Any) -> Any:
        try:
            return ray.get(pending, timeout=0)
        # Every Ray error is kept without its traceback (engine.errors.without_traceback): it
        # would keep this call's callers alive, the router loop's calls in flight among them.
        except ACTOR_DEATH as err:  # keep the root cause: Ray's first line only says "died"
            raise WorkerDied(f"{type(err).__name__}: {describe_error(err)}"
                             ) from without_traceback(err)
        except RayTaskError as err:  # the method raised: its own error, not Ray's wrapper
            error = err.cause if isinstance(err.cause, Exception) else err
            without_traceback(err)
        # Raised here, not in the except, where its __context__ would be Ray's error, which
        # holds it; and dropped from this frame, which its traceback holds: no cycle either.
        try:
            raise error
        finally:
            del error


def physical_gpu(device: str) -> str:
    """The GPU id that ``cuda:i`` names for this (driver) process: entry i of its
    ``CUDA_VISIBLE_DEVICES`` where that is set (an index, a UUID or a MIG id), else ``i``."""
    index = device_index(device)
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
    return f"pdlab_cuda_{device_index(device)}"


EMULATED_CPUS = 0.1  # Ray CPUs of an emulated worker (engine.emulated: it mostly waits)


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
    if device.startswith("emu"):  # an emulated device computes nothing: 8 fit on 2 cores
        return {"CPU": EMULATED_CPUS}, {"num_cpus": EMULATED_CPUS, "num_gpus": 0}
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


def instance_actor_resources(devices: tuple[str, ...], pinned: bool
                             ) -> tuple[dict[str, float], dict[str, Any]]:
    """``(bundle, actor options)`` of one worker over an instance's ``devices``: the sum of
    their ``gpu_actor_resources`` (rank 0's actor spawns the other ranks in its bundle); its
    CUDA rank ``r`` sees its GPU as ``cuda:r``."""
    parts = [gpu_actor_resources(d, pinned) for d in devices]
    if len(parts) == 1:
        return parts[0]
    bundle: dict[str, float] = {}
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0}
    for part_bundle, part_options in parts:
        for key, value in part_bundle.items():
            bundle[key] = bundle.get(key, 0) + value
        options["num_cpus"] += part_options["num_cpus"]
        options["num_gpus"] += part_options["num_gpus"]
        for key, value in part_options.get("resources", {}).items():
            options.setdefault("resources", {})[key] = value
    pins = [o["runtime_env"]["env_vars"][PIN_ENV] for _, o in parts if "runtime_env" in o]
    if pins:
        env = {**ray_init_kwargs()["runtime_env"]["env_vars"], PIN_ENV: ",".join(pins)}
        options["runtime_env"] = {"env_vars": env}
    return bundle, options


def local_cluster_kwargs(devices: tuple[str, ...]) -> dict[str, Any]:
    """``ray.init`` arguments of the private cluster pdlab starts for ``devices``: this
    machine's cores (more where core groups overlap: oversubscribed), no Ray ``GPU``
    resource, one ``gpu_resource`` per CUDA device."""
    named = sum(len(cpu_cores_of(d)) for d in devices if d.startswith("cpu"))
    return {"address": "local",  # never join a stray cluster
            "num_cpus": max(len(os.sched_getaffinity(0)), named), "num_gpus": 0,
            "resources": {gpu_resource(d): 1.0 for d in devices if d.startswith("cuda")}}


def ray_init_kwargs() -> dict[str, Any]:
    """How pdlab starts or joins Ray (tests that start Ray themselves use the same)."""
    return {"address": "local", "include_dashboard": False, "log_to_driver": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": _pythonpath()}}}


def _pythonpath() -> str:
    """Actors import pdlab from this checkout even when it is not installed."""
    return os.pathsep.join([str(REPO_ROOT)] + [p for p in sys.path if p])


class RayWorkers:
    """The Ray side of a ``Deployment`` (module docstring): ``start`` the actors, ``kill``
    one, ``close`` everything. ``handles`` maps worker name -> actor handle.

    Args:
        devices: each worker's devices (an instance's, rank 0's first), in layout order.
        address: a Ray cluster to join, or None (a private local one is started).
        transport: the KV transport's name (``shm`` packs every worker on one node).
    """

    def __init__(self, devices: tuple[tuple[str, ...], ...], address: str | None,
                 transport: str) -> None:
        self.devices, self.address, self.transport = devices, address, transport
        self.handles: dict[str, Any] = {}
        self._pg = None
        self._started_ray = False
        self._watched: dict[Any, tuple[str, Any]] = {}  # never-ending call -> (name, handle)
        self._watch_lock = threading.Lock()
        self._on_death: Callable[[str, Any, str], None] | None = None
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.watch_errors = 0  # exceptions the actor watch survived (each logged)

    def connect(self) -> dict | None:
        """Start or join Ray; returns the cluster's resources when joined (only totals can
        be checked there), None for the cluster started here."""
        if not ray.is_initialized():
            init = ray_init_kwargs()
            if self.address:
                init["address"] = self.address
            else:
                init.update(local_cluster_kwargs(tuple(d for ds in self.devices for d in ds)))
            try:
                ray.init(**init)
            except Exception as err:  # e.g. its GCS did not come up on a busy host: one line
                where = f"joining {self.address}" if self.address else "a local cluster"
                raise RuntimeError(f"Ray did not start ({where}): {describe_error(err)}") from err
            self._started_ray = True
        return ray.cluster_resources() if self.address else None

    def node_ip(self) -> str:
        """This (driver) node's address, where a torchdist rendezvous store is bound."""
        return ray.util.get_node_ip_address()

    def reserve(self) -> list[dict[str, Any]]:
        """One placement-group bundle per device; returns each worker's actor options.

        Raises:
            ValueError: the cluster cannot hold the bundles (within 60 s).
        """
        # cuda:i is honoured exactly only on a cluster started here (its resources are ours)
        pinned = self._started_ray and not self.address
        resources = [instance_actor_resources(devices, pinned) for devices in self.devices]
        bundles = [bundle for bundle, _ in resources]
        # shm moves KV through one node's shared memory: every worker must be on that node
        strategy = "STRICT_PACK" if self.transport == "shm" else "PACK"
        self._pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=60)
        except GetTimeoutError as err:
            raise ValueError(f"the Ray cluster cannot hold {bundles} "
                             f"(it has {ray.cluster_resources()})") from err
        return [options for _, options in resources]

    def start(self, name: str, rank: int, cls: type, options: dict[str, Any],
              kwargs: dict[str, Any]) -> None:
        """Start worker ``name`` (class ``cls``) as a threaded actor in bundle ``rank``."""
        actor_cls = ray.remote(cls).options(
            name=None, max_concurrency=16, max_restarts=0, **options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=rank))
        handle = self.handles[name] = actor_cls.remote(**kwargs, inside_ray=True)
        with self._watch_lock:
            self._watched[handle.__ray_call__.remote(_until_killed)] = (name, handle)

    def watch(self, on_death: Callable[[str, Any, str], None]) -> None:
        """From now on call ``on_death(name, handle, cause)`` (on a thread of its own) when
        an actor started here dies (module docstring)."""
        self._on_death = on_death
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="ray-actor-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Until ``close``: a failed turn is logged, counted, retried after a pause."""
        while not self._closing.is_set():
            try:
                self._watch_turn()
            except Exception:
                self.watch_errors += 1
                _LOG.exception("Ray actor watch: a turn failed; watching again")
                self._closing.wait(WATCH_RETRY_S)

    def _watch_turn(self) -> None:
        with self._watch_lock:
            refs = list(self._watched)
        if not refs:
            self._closing.wait(0.2)
            return
        # the timeout only bounds how late an actor started meanwhile joins the wait
        ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
        for ref in ready:
            with self._watch_lock:
                name, handle = self._watched.pop(ref)
            try:
                ray.get(ref, timeout=0)
                cause = "its actor's watch call returned"
            except Exception as err:  # ActorDiedError and kin: keep Ray's root cause
                cause = f"{type(err).__name__}: {describe_error(err)}"
                without_traceback(err)
            if not self._closing.is_set() and self._on_death is not None:
                try:
                    self._on_death(name, handle, cause)
                except Exception:  # this death is lost to its listener; the others are not
                    self.watch_errors += 1
                    _LOG.exception("Ray actor watch: telling of %s's death (%s) failed",
                                   name, cause)

    def link_peaks(self, decode: list[str], prefill: list[str]) -> dict[str, LinkPeak]:
        """The link each decode worker's transfers run on, measured inside the actors and set
        on its transport (``placement.Deployment`` step 4): a memcpy on its node when every
        prefill worker shares it, else a probe from a prefill worker on another node."""
        nodes = dict(zip(self.handles, ray.get(
            [h.__ray_call__.remote(_node_of) for h in self.handles.values()],
            timeout=PEAK_TIMEOUT_S)))
        peaks = {}
        for name in decode:
            remote = [p for p in prefill if nodes[p] != nodes[name]]
            target = self.handles[name]
            if not remote:
                peaks[name] = ray.get(target.__ray_call__.remote(_memcpy_peak_here),
                                      timeout=PEAK_TIMEOUT_S)
                continue
            source = self.handles[remote[0]]
            ticket = ray.get(source.__ray_call__.remote(_open_probe), timeout=PEAK_TIMEOUT_S)
            try:
                peaks[name] = ray.get(target.__ray_call__.remote(_probe_here, ticket),
                                      timeout=PEAK_TIMEOUT_S)
            finally:
                ray.get(source.__ray_call__.remote(_close_probe), timeout=PEAK_TIMEOUT_S)
        return peaks

    def kill(self, name: str) -> None:
        """Kill one worker (failure tests); Ray never restarts it (pdlab's ``Restarts`` may)."""
        ray.kill(self.handles[name], no_restart=True)

    def restart(self, name: str, rank: int, cls: type, options: dict[str, Any],
                kwargs: dict[str, Any]) -> Any:
        """Start worker ``name`` again in its bundle (the dead actor is killed first, so its
        bundle's resources come back); returns the new handle."""
        self.stop(self.handles[name])
        self.start(name, rank, cls, options, kwargs)
        return self.handles[name]

    @staticmethod
    def stop(handle: Any) -> None:
        """Kill one actor, best effort (it may be dead already)."""
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass

    def close(self) -> None:
        """Kill every actor, release the placement group and Ray if started here; twice is fine."""
        self._closing.set()  # no death is reported from here on
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self._watched = {}
        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already dead
                pass
        self.handles = {}
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _until_killed(worker) -> None:
    """Run inside an actor (``__ray_call__``), holding one of its threads: returns never,
    fails when the actor dies (``RayWorkers.watch``)."""
    threading.Event().wait()


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


@contextlib.contextmanager
def driver_ray(needed: bool = True) -> Iterator[None]:
    """A private one-CPU Ray instance in this process while the block runs (``needed``), for
    measurements that put and get through the driver's own object store (``pdlab kv-cost``,
    ``pdlab profile``'s transfer models); shut down after, unless it was running before."""
    started = needed and not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
