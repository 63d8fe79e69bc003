"""Bind the current process to one device of a device set (DESIGN §5)."""

from __future__ import annotations

import os

import torch

from engine.config import cpu_cores_of


def bind_device(device: str, inside_ray: bool = False) -> str:
    """Pin this process to ``device`` and return the torch device its engine should use.

    ``cpu:i`` / ``cpu:a-b``: ``os.sched_setaffinity`` to those cores and
    ``torch.set_num_threads`` to their count. ``cuda:i``: that GPU; inside a Ray actor that
    was given ``num_gpus=1``, Ray has already narrowed ``CUDA_VISIBLE_DEVICES`` to it, so it
    is ``cuda:0`` there.

    Raises:
        ValueError: a core this process may not use, or a GPU that does not exist.
    """
    kind = device.split(":")[0]
    if kind == "cpu":
        cores = cpu_cores_of(device)
        allowed = os.sched_getaffinity(0)
        if not set(cores) <= allowed:
            raise ValueError(f"device {device} names cores {cores}, but this machine offers "
                             f"{sorted(allowed)}")
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} needs CUDA, which this machine does not have")
    if inside_ray:
        return "cuda:0"
    index = int(device.split(":")[1])
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device} does not exist ({torch.cuda.device_count()} GPUs)")
    torch.cuda.set_device(index)
    return device
