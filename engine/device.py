"""Bind a worker to one device of a device set (``cpu:i`` / ``cpu:a-b`` cores, or ``cuda:i``), and
name the GPU it uses. Pinned (``pin=True``: a Ray actor, one worker per process), a CPU worker
pins the process to its cores and sets torch's threads to match, a CUDA worker makes its GPU
current; placed (``pin=False``: several workers per process), nothing process-wide changes. The
engine thread calls ``use_on_this_thread`` first (the CUDA current device is per thread). Inside
Ray a CUDA worker sees one GPU, ``cuda:0``: Ray's, or ``PDLAB_CUDA_VISIBLE_DEVICES`` (``PIN_ENV``),
copied into ``CUDA_VISIBLE_DEVICES`` before CUDA starts. Every CUDA call goes through ``CUDA`` (a
``CudaAPI``), which unit tests replace with a fake device table."""

from __future__ import annotations

import os

import torch

from engine.config import cpu_cores_of, device_index

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
PIN_ENV = "PDLAB_CUDA_VISIBLE_DEVICES"  # set by the placement on an actor it pins to a GPU


class CudaAPI:
    """The CUDA calls device binding and recording make (torch.cuda), in one replaceable place."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_initialized(self) -> bool:
        """Whether CUDA started here (then ``CUDA_VISIBLE_DEVICES`` no longer changes anything)."""
        return torch.cuda.is_initialized()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def properties(self, index: int) -> dict:
        """``{"name", "uuid", "total_memory_bytes"}`` of GPU ``index``; the UUID as ``nvidia-smi -L``
        prints it (``GPU-...``), None if torch lacks it."""
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        uuid = None if uuid is None else str(uuid)
        if uuid is not None and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        return {"name": props.name, "uuid": uuid, "total_memory_bytes": int(props.total_memory)}


CUDA = CudaAPI()


def bind_device(device: str, inside_ray: bool = False, pin: bool = True) -> str:
    """Bind this worker to ``device`` (``cpu:i``, ``cpu:a-b``, ``cuda:i``, or ``emu:i``: no core
    bound, tensors on CPU, one torch thread); returns ``"cpu"`` or ``"cuda:j"``. ``inside_ray``: the actor sees only
    its own GPU; ``pin``: change process-wide state (False where workers share the process).

    Raises:
        ValueError: a core this process may not use; no CUDA; a GPU that does not exist;
            a pinned GPU asked for after CUDA started here with another view."""
    kind = device.split(":")[0]
    if kind == "emu":  # computes nothing (engine.emulated): no pinning, and KV copies too
        if pin:  # small to gain from threads that spin between them
            torch.set_num_threads(1)
        return "cpu"
    if kind == "cpu":
        cores = cpu_cores_of(device)
        allowed = os.sched_getaffinity(0)
        if not set(cores) <= allowed:
            raise ValueError(f"device {device} names cores {cores}, but this machine offers "
                             f"{sorted(allowed)}")
        if pin:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        return "cpu"
    if inside_ray:
        _apply_pin()
    if not CUDA.is_available():
        raise ValueError(f"device {device} needs CUDA, which this machine does not have")
    index = 0 if inside_ray else device_index(device)
    count = CUDA.device_count()
    if index >= count:
        raise ValueError(f"device {device} does not exist ({count} GPUs"
                         f"{' visible to this Ray actor' if inside_ray else ''})")
    if pin:
        CUDA.set_device(index)
    return f"cuda:{index}"


def _apply_pin() -> None:
    """Copy ``PIN_ENV`` into ``CUDA_VISIBLE_DEVICES`` while CUDA has not started here.

    Raises:
        ValueError: CUDA already started in this process with another view."""
    pinned = os.environ.get(PIN_ENV)
    if pinned is None or os.environ.get(VISIBLE_ENV) == pinned:
        return
    if CUDA.is_initialized():
        raise ValueError(f"this worker is pinned to GPU {pinned} ({PIN_ENV}), but CUDA already "
                         f"started in its process with {VISIBLE_ENV}="
                         f"{os.environ.get(VISIBLE_ENV)!r}")
    os.environ[VISIBLE_ENV] = pinned


def use_on_this_thread(torch_device: str) -> None:
    """Make ``torch_device``'s GPU current on the calling thread (nothing for CPU)."""
    if torch_device.startswith("cuda"):
        CUDA.set_device(device_index(torch_device))


def gpu_identity(torch_device: str) -> dict | None:
    """The physical GPU behind ``torch_device`` (None for CPU): ``{"index", "name", "uuid",
    "total_memory_bytes", "cuda_visible_devices"}`` (None if unset)."""
    if not torch_device.startswith("cuda"):
        return None
    index = device_index(torch_device)
    return {"index": index, **CUDA.properties(index),
            "cuda_visible_devices": os.environ.get(VISIBLE_ENV)}
