"""PlacementConfig -> workers on a device set, the router over them and the hub of their
channels: the one place that creates Ray actors (the composition root).

1. Parse the placement and the device set; check that the set has enough devices and that each
   exists, before anything starts.
2. Ray mode: start workers as actors in their placement-group bundles (``deployment.ray_actors``);
   ``torchdist``: the driver binds the group's rendezvous store first and keeps it until
   ``close``. Local mode: plain worker objects in this process, each on its own device.
3. Wait until every worker answers ``info`` (bounded; a failure keeps its root cause), then
   build the ``Router`` over a ``channel.local.LocalHub`` (local mode), a
   ``channel.unix.UnixHub`` (a cluster started here) or a ``channel.sockets.SocketHub``
   (``tcp``, when joining one).
   Ray's actor deaths and a local ``kill`` reach the router at once, and every incarnation the
   router declares dead is stopped (``_stop_incarnation``).
4. Measure the link peak of each decode worker's transfers (``kv_transfer.link``) and set it on
   its transport, so every ``TransferRecord`` carries ``efficiency`` (``link_peaks``: decode
   worker name -> ``LinkPeak``).

A dead worker is started again as it was, under ``max_worker_restarts`` attempts per worker
(``deployment.restarts``); ``torchdist`` cannot restart one (its process group takes no new
member). ``close()`` stops the workers, the hub, the placement group and Ray if started here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any

from decode_worker import DecodeWorker
from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig,
                           TransferConfig, cpu_cores_of, device_index, parse_devices,
                           is_emulated, placement_engine_overrides)
from engine.placement import Instance, Placement
from engine import device as engine_device  # .CUDA: the seam tests fake
from engine.emulated import Emulation
from engine.model import ModelLoadError, check_model_name, load_geometry
from deployment.restarts import Restarts
from engine.serving import EngineLoop
from kv_transfer.faults import with_faults
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.link import LinkPeak, memcpy_peak
from kv_transfer.nixl import MISSING, nixl_available
from kv_transfer.torchdist import open_rendezvous
from channel.local import LocalHub
from channel.sockets import SocketHub
from channel.unix import UnixHub
from engine.clock import freeze_heap
from prefill_worker import PrefillWorker
from router.calls import LocalCalls
from router.router import Router, WorkerRef
from planner.latency import DeviceProfile
from planner.sizes import InstanceProfile, ProfileSet, geometry_of



def worker_layout(placement: str | Placement, devices: tuple[str, ...]) -> tuple[Instance, ...]:
    """The placement's instances bound to ``devices`` (``engine.placement.Placement.bind``):
    one worker each, named ``Instance.name``, on its ``tp * pp`` devices (rank 0's first).

    Raises:
        ValueError: a bad placement, one needing more devices than the set has, or a PP size
            over 1 on real devices (pipeline parallelism is emulated only).
    """
    parsed = placement if isinstance(placement, Placement) else Placement.parse(placement)
    bound = parsed.bind(devices)
    if not is_emulated(devices):
        _check_no_real_pp(bound)
    return bound.instances


def _check_no_real_pp(placement: Placement) -> None:
    for role in placement.roles:
        pp = placement.size_of(role)[1]
        if pp > 1:
            raise ValueError(f"placement {placement}: the {role} PP {pp} runs on emulated "
                             "devices only (--devices emu:0-7); real instances are TP only")


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
        cuda = engine_device.CUDA
        count = cuda.device_count() if cuda.is_available() else 0
        for device in gpus:
            if device_index(device) >= count:
                raise ValueError(f"device {device} does not exist: this machine has {count} GPUs")
    cores = os.sched_getaffinity(0)
    for device in devices:
        if device.startswith("cpu") and not set(cpu_cores_of(device)) <= cores:
            raise ValueError(f"device {device} does not exist: this machine offers cores "
                             f"{sorted(cores)}")


def _same_model(a: str, b: str) -> bool:
    """Two model names, directories compared by their resolved paths."""
    try:
        return a == b or os.path.realpath(os.path.expanduser(a)) == os.path.realpath(
            os.path.expanduser(b))
    except (OSError, ValueError):
        return False


def emulation_for(devices: tuple[str, ...], model: ModelConfig, engine: EngineConfig,
                  whole_kv_caches: bool = True) -> Emulation | None:
    """The ``Emulation`` of an emulated device set (``emu:i``, ``engine.emulated``) on the
    first ``--device-profile`` (its dtype and description; ``instance_emulations`` gives each
    instance the profile of its size), or None for real devices.

    The emulated model is ``model.model``, a directory with a ``config.json``
    (``engine/configs/llama-3.1-8b``); it runs in the profile's dtype. ``whole_kv_caches``:
    the devices' engines each allocate the emulated GPU's whole KV budget (every command
    but ``kv-cost``, which allocates only the blocks it measures), so this host must hold
    them (``_check_host_holds_kv``).

    Raises:
        ValueError: ``--device-profile`` or ``--emu-time-scale`` without emulated devices,
            emulated devices without a profile, an unreadable profile, a profile of another
            model or geometry, profiles of several dtypes, a model that is not a config
            directory, or KV caches this host cannot hold (each message names the option).
    """
    if not is_emulated(devices):
        if engine.device_profile is not None:
            raise ValueError(f"argument --device-profile: only emulated devices (--devices "
                             f"emu:0-7) run from a device profile; got devices {','.join(devices)}")
        if engine.emu_time_scale != 1:
            raise ValueError(f"argument --emu-time-scale: only emulated devices (--devices "
                             f"emu:0-7) run dilated; got devices {','.join(devices)}")
        return None
    if engine.device_profile is None:
        raise ValueError(f"argument --device-profile: emulated devices ({','.join(devices)}) "
                         "need a device profile (pdlab profile, e.g. --from-silicon-db "
                         "h100_sxm --backend vllm --model engine/configs/llama-3.1-8b)")
    profiles = device_profiles(engine, model)
    try:
        geometry = load_geometry(ModelConfig(model.model, profiles[0].dtype)).kv_spec
    except ModelLoadError as err:
        raise ValueError(f"argument --model: {err}") from None
    emulation = Emulation(profiles[0], engine.emu_kv_scale, time_scale=engine.emu_time_scale)
    try:
        for profile in profiles:
            dataclasses.replace(emulation, device=profile).check(geometry, model.model)
    except ValueError as err:
        raise ValueError(f"argument --device-profile: {err}") from None
    if whole_kv_caches:  # the largest per-device budget of the sizes given, on every device
        widest = max(profiles, key=lambda p: _budget_or_zero(p, engine))
        _check_host_holds_kv(dataclasses.replace(emulation, device=widest), geometry, engine,
                             len(devices))
    return emulation


def device_profiles(engine: EngineConfig, model: ModelConfig) -> list[DeviceProfile]:
    """``--device-profile``: one path, or comma-separated paths of one profile per TP size
    (``pdlab profile --from-silicon-db --tp T``), each of ``model`` and one dtype.

    Raises:
        ValueError: ``argument --device-profile: ...``: an unreadable profile, one of another
            model, or profiles of different dtypes."""
    paths = [p.strip() for p in engine.device_profile.split(",") if p.strip()]
    out = []
    for path in paths:
        try:
            profile = DeviceProfile.load(path)
        except ValueError as err:
            raise ValueError(f"argument --device-profile: {err}") from None
        if not _same_model(profile.model, model.model):
            raise ValueError(f"argument --device-profile: {path} has no model "
                             f"{model.model}: it profiles {profile.model}")
        if out and profile.dtype != out[0].dtype:
            raise ValueError(f"argument --device-profile: {path} is {profile.dtype}, "
                             f"{paths[0]} {out[0].dtype}: give profiles of one dtype")
        out.append(profile)
    return out


def instance_emulations(emulation: Emulation, placement: Placement, model: ModelConfig,
                        engine: EngineConfig, num_devices: int) -> dict[str, Emulation]:
    """Each emulated instance's ``Emulation`` (by ``Instance.name``): ONE emulated runner over
    its ``tp * pp`` emulated devices (no rank processes; nothing is computed), timed by the
    profile of its size (``planner.sizes.ProfileSet.of_role``, the planner's own choice: a
    PP size is derived from the TP's PP-1 profile) and holding the KV budget of all its
    devices (``planner.sizes.InstanceProfile``). Emulated KV between instances of different
    TP moves as one whole-instance slice (the emulated decode worker takes it whole).

    Raises:
        ValueError: ``argument --device-profile: ...``, one line naming the role and its size:
            no profile of that TP given, profiles that do not form a set, or a size that does
            not fit the device's memory (weights plus one ``max_model_len`` request's KV)."""
    profiles = device_profiles(engine, model)
    max_pp = max(placement.size_of(role)[1] for role in placement.roles)
    try:
        found = ProfileSet.build(profiles, geometry_of(profiles[0], model.model), num_devices,
                                 engine.max_model_len, engine.gpu_memory_utilization, max_pp,
                                 prune=False)
    except ValueError as err:
        raise ValueError(f"argument --device-profile: {err}") from None
    out = {}
    for role in placement.roles:
        tp, pp = placement.size_of(role)
        try:
            profile = InstanceProfile.of(found.of_role(placement, role))
        except ValueError as err:
            given = ", ".join(f"TP {p.tp}" for p in profiles)
            hint = ("" if any(p.tp == tp for p in profiles)
                    else f" (pdlab profile --from-silicon-db --tp {tp})")
            raise ValueError(f"argument --device-profile: the {role} instances of {placement} "
                             f"run at TP {tp} PP {pp}, the profiles given are {given}: "
                             f"{err}{hint}") from None
        for inst in placement.of_role(role):
            out[inst.name] = dataclasses.replace(emulation, device=profile)
    return out


def _budget_or_zero(profile: DeviceProfile, engine: EngineConfig) -> int:
    try:
        return profile.kv_budget_bytes(engine)
    except ValueError:
        return 0


def _host_available_bytes() -> int | None:
    """This host's MemAvailable (bytes, /proc/meminfo), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_host_holds_kv(emulation: Emulation, geometry, engine: EngineConfig,
                         num_devices: int) -> None:
    """Refuse, before any worker starts, emulated devices whose KV stores (each the emulated
    GPU's budget, ``Emulation.kv_budget_bytes``, at ``--emu-kv-scale``'s bytes per token)
    together exceed this host's available memory: the workers would fail one by one on
    allocation, far from the option that fixes it. The message gives a scale that fits
    (a power of 2 keeping them under half the available memory).

    Raises:
        ValueError: naming ``--emu-kv-scale``.
    """
    free = _host_available_bytes()
    try:
        budget = emulation.kv_budget_bytes(engine)
    except ValueError:  # a profile without memory figures: the engine says why itself
        return
    per_token = emulation.scaled_spec(geometry).bytes_per_token / geometry.bytes_per_token
    need = num_devices * budget * per_token
    if free is None or need <= free:
        return
    scale = emulation.kv_scale
    while num_devices * budget * scale > free / 2 and scale > 2 ** -20:
        scale /= 2
    raise ValueError(f"argument --emu-kv-scale: {num_devices} emulated "
                     f"{emulation.device.device_name} KV caches of {budget / 2**30:.1f} GiB "
                     f"each keep {need / 2**30:.1f} GiB on this host at scale "
                     f"{emulation.kv_scale:g}, and it has {free / 2**30:.1f} GiB available: "
                     f"pass --emu-kv-scale {scale:g} (or less)")


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
        max_worker_restarts: attempts to restart each worker that dies (0: a dead worker
            stays dead); ``restarts`` counts them.
        startup_timeout_s: how long a (re)started worker may take to answer ``info``.

    Devices: in local mode ``cuda:i`` is GPU i of this process (``engine.device``); under Ray
    each worker sees only its GPU (``gpu_actor_resources`` says which); ``info()["gpu"]``
    records the GPU used (UUID, name).

    Raises:
        ValueError: bad placement or device set, not enough devices, a transport that
            cannot work in this mode.
    """

    def __init__(self, placement: PlacementConfig, model: ModelConfig,
                 engine: EngineConfig | None = None, transfer: TransferConfig | None = None,
                 local: bool = False, faults: dict[str, dict | list[dict]] | None = None,
                 policy: str = "least_loaded", deadline_s: float | None = None,
                 conditional: ConditionalConfig | None = None,
                 worker_devices: tuple[str, ...] | None = None,
                 max_worker_restarts: int = 0, startup_timeout_s: float = 300.0) -> None:
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
        self.layout = worker_layout(placement.parsed, self.devices)
        if local and self.transfer.transport != "inprocess":
            raise ValueError("a local placement (one process) needs transport 'inprocess'")
        if not local and self.transfer.transport == "inprocess":
            raise ValueError("transport 'inprocess' needs a local placement; use 'ray', "
                             "'shm', 'nixl' or 'torchdist' across processes")
        if self.transfer.transport == "nixl" and not nixl_available():
            raise ValueError(MISSING)  # here, not in each worker's start-up
        self.emulation = emulation_for(self.devices, model, self.engine)
        self.emulations: dict[str, Emulation] = {}  # instance name -> its emulated device
        if self.emulation is None:
            check_model_name(model)
        else:
            self.emulations = instance_emulations(self.emulation, placement.parsed, model,
                                                  self.engine, len(self.devices))
        self.hub: Any = None  # the router's end of the workers' channels
        self._rendezvous = None  # the torchdist group's TCPStore, held while workers live
        self._ray = None  # deployment.ray_actors.RayWorkers of a Ray deployment
        self.transport = None  # local: the in-process transport every worker shares
        self.handles: dict[str, Any] = {}
        self.calls: Any = LocalCalls()
        self.link_peaks: dict[str, LinkPeak] = {}
        self.startup_timeout_s = startup_timeout_s
        self._specs: dict[str, tuple[int, type, dict, dict | None]] = {}  # name -> how to start it
        self.restarts = Restarts(
            max_worker_restarts, self._spawn, self._ready, self._stop_worker,
            disabled=("torchdist's process group cannot take a new member"
                      if self.transfer.transport == "torchdist" else None))
        try:  # a worker that fails to start must not leave the others (or Ray) behind
            if local:
                check_devices_exist(self.devices)
                self._start_local(faults or {})
            else:
                self._start_ray(faults or {})
            self.workers = [WorkerRef(inst.name, inst.role, self.handles[inst.name], rank)
                            for rank, inst in enumerate(self.layout)]
            self.hub = self._open_hub()
            self.router = Router(self.workers, self.calls, placement.placement, policy,
                                 deadline_s or self.transfer.timeout_s + 5.0,
                                 startup_timeout_s=startup_timeout_s, conditional=conditional,
                                 on_worker_died=self.restarts.on_died, hub=self.hub,
                                 stop_worker=self._stop_incarnation)
            self.restarts.router = self.router
            if self._ray is not None:  # Ray's actor death, beside the channel's heartbeat
                self._ray.watch(self.router.worker_died)
            self.link_peaks = self._measure_link_peaks()
            freeze_heap()  # the router's process: no full collection stalls its loop on these
        except BaseException:
            self.close()
            raise

    # ---- construction -----------------------------------------------------------------
    def _open_hub(self) -> Any:
        """Step 3's hub: in-process; Unix-domain sockets on one node (a hop wakes one
        thread, not pyzmq ipc's three: ``channel.unix``); pyzmq ``tcp`` across nodes."""
        if self.local:
            return LocalHub()
        if self.placement.address:  # workers may be on other nodes
            return SocketHub("tcp", host=self._ray.node_ip())
        return UnixHub()

    def _worker_args(self, inst: Instance, faults: dict, rank: int,
                     init_method: str | None) -> tuple[type, dict]:
        """``inst``'s worker class and arguments: on its first device, starting its other ranks
        on the rest (real devices) or emulated at its ``EngineConfig.tp``/``pp``."""
        name, role = inst.name, inst.role
        worker_faults = faults.get(name) or []
        layers = [dict(f) for f in ([worker_faults] if isinstance(worker_faults, dict)
                                    else worker_faults)]
        step_delay_s = sum(f.pop("step_delay_s", 0.0) for f in layers)
        worker_faults = [f for f in layers if f]
        engine = dataclasses.replace(self.engine, tp=inst.tp, pp=inst.pp)
        rank_devices = () if self.emulation is not None else inst.devices[1:]
        common = {"name": name, "model_config": self.model, "engine_config": engine,
                  "device": inst.device, "step_delay_s": step_delay_s,
                  "emulation": self.emulations.get(name), "rank_devices": rank_devices}
        if role == "colocated":
            return EngineLoop, common
        if role == "prefill":  # its KV goes out as the decode instances' ranks take it
            common["decode_tp"] = 1 if self.emulation else self.placement.parsed.size_of("decode")[0]
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        return cls, {**common, "transfer_config": self.transfer, "faults": worker_faults or None,
                     "rank": rank, "world_size": len(self.layout), "init_method": init_method}

    def _start_local(self, faults: dict) -> None:
        shared = InProcessTransport(checksum=self.transfer.checksum)
        for rank, inst in enumerate(self.layout):
            cls, kwargs = self._worker_args(inst, faults, rank, None)
            if cls is not EngineLoop:  # P and D share one in-process transport
                kwargs["transport"] = with_faults(shared, kwargs.pop("faults"))
            self._specs[inst.name] = (rank, cls, kwargs, None)
            self.handles[inst.name] = cls(**kwargs, bind=False)
        self.transport = shared  # tests read what it holds

    def _start_ray(self, faults: dict) -> None:
        # Ray only here: a local placement runs where Ray is not installed (make gpu-check)
        from deployment import ray_actors

        self._ray = ray_actors.RayWorkers(tuple(inst.devices for inst in self.layout),
                                          self.placement.address, self.transfer.transport)
        self.calls = ray_actors.RayCalls()
        check_devices_exist(self.devices, self._ray.connect())
        options = self._ray.reserve()
        init_method = None
        if self.transfer.transport == "torchdist":
            # bound here, at port 0, and held until close(): no port can be taken in between
            self._rendezvous, init_method = open_rendezvous(self._ray.node_ip(),
                                                            self.transfer.timeout_s)
        for rank, inst in enumerate(self.layout):
            cls, kwargs = self._worker_args(inst, faults, rank, init_method)
            self._specs[inst.name] = (rank, cls, kwargs, options[rank])
            self._ray.start(inst.name, rank, cls, options[rank], kwargs)
        self.handles = self._ray.handles

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
        decode = [w.name for w in self.workers if w.role == "decode"]
        prefill = [w.name for w in self.workers if w.role == "prefill"]
        if not decode or not prefill:
            return {}
        if self.local:  # one process: P and D share one transport
            peak = memcpy_peak()
            self.handles[decode[0]].transport.peak_gbps = peak.gbps
            return dict.fromkeys(decode, peak)
        return self._ray.link_peaks(decode, prefill)
    # ---- restarts (deployment.restarts calls these on its threads) ---------------------
    def _spawn(self, name: str) -> Any:
        """Start worker ``name`` again as it was started (the dead one is stopped first)."""
        rank, cls, kwargs, options = self._specs[name]
        if self._ray is not None:
            return self._ray.restart(name, rank, cls, options, kwargs)
        self._stop_worker(self.handles[name])  # an engine loop that died is still an object
        self.handles[name] = cls(**kwargs, bind=False)
        return self.handles[name]

    def _ready(self, name: str, handle: Any, should_stop) -> dict:
        """The new worker's ``info()`` once it answers (``startup_timeout_s``, in slices so
        that ``close`` never waits for it); a decode worker then gets its link peak again
        (``link_peaks``, measured at start: the new transport has none)."""
        pending = self.calls.call(handle, "info")
        end_s = time.monotonic() + self.startup_timeout_s
        while not self.calls.ready([pending], 0.2):
            if should_stop():
                raise RuntimeError(f"{name}: the deployment closed while it started")
            if time.monotonic() > end_s:
                raise TimeoutError(f"{name} did not answer info within "
                                   f"{self.startup_timeout_s} s of its restart")
        info = self.calls.result(pending)
        if name in self.link_peaks:
            peak = self.calls.call(handle, "set_link_peak", self.link_peaks[name].gbps)
            if self.calls.ready([peak], self.startup_timeout_s):
                self.calls.result(peak)
            else:  # a missing peak must not fail the restart (as in _measure_link_peaks)
                print(f"pdlab: {name}'s link peak not set again after its restart; its "
                      "transfer records carry no efficiency", file=sys.stderr)
        return info

    def _stop_worker(self, handle: Any) -> None:
        if self._ray is not None:
            self._ray.stop(handle)
            return
        try:
            handle.shutdown()
        except Exception:  # already dead
            pass

    def _stop_incarnation(self, name: str, handle: Any) -> None:
        """``Router(stop_worker=)``: kill an incarnation declared dead (alive, it would hold
        KV for nobody), on a thread: its actor (Ray), or locally ``LocalCalls.kill``: its
        calls fail from now on and its ``shutdown`` stops its loop (a prefill worker frees
        the KV it put)."""
        stop = self._stop_worker if self._ray is not None else self.calls.kill
        threading.Thread(target=self._stop_quietly, args=(stop, handle), daemon=True,
                         name=f"stop-{name}").start()

    @staticmethod
    def _stop_quietly(stop, handle: Any) -> None:
        try:
            stop(handle)
        except Exception:  # already gone
            pass

    # ---- use ----------------------------------------------------------------------------
    def run(self, workload, on_finish=None):
        """``Router.run`` on this deployment."""
        return self.router.run(workload, on_finish)

    def reset_prefix_cache(self) -> int:
        """Start the next run cold: every live worker forgets its unheld cached blocks
        (``reset_prefix_cache``) and the router its prefix index; returns the blocks
        forgotten. Called between runs, so one run (or placement) never inherits another's
        hits."""
        self.router.assigner.reset_prefixes()
        return sum(self.gather("reset_prefix_cache"))

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

    def kill(self, name: str, handle: Any = None) -> None:
        """Kill one worker (failure tests): locally ``handle``, one incarnation of it, when
        given (a replacement that joined meanwhile lives on), else the current one. The
        router hears of it as of a Ray actor's death (``Router.worker_died``, at once); a
        local worker's death is the deployment's own news, its silence on the channel aside."""
        if self.local:
            handle = self.handles[name] if handle is None else handle
            # gone from this instant, as a killed process is:
            self.router.worker_died(name, handle, "killed")  # nothing it sends counts
            self.calls.kill(handle)
        else:
            self._ray.kill(name)

    def close(self) -> None:
        """Stop every worker, release the placement group (and Ray if started here); twice is fine."""
        self.restarts.close()  # no replacement starts after this
        if self._ray is not None:
            self._ray.close()
        else:
            for handle in self.handles.values():
                try:
                    handle.shutdown()
                except Exception:  # already dead
                    pass
            self.calls.shutdown()
        self.handles = {}
        self._rendezvous = None
        if self.hub is not None:
            self.hub.close()
            self.hub = None

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


