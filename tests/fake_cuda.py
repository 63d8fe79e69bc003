"""A fake CUDA device table for ``engine.device.CUDA`` (the seam every CUDA call of device
binding and recording goes through), so the CUDA paths run in tests without a GPU."""

from __future__ import annotations

import threading


class FakeCuda:
    """A device table: GPUs with names and UUIDs, the current device per host thread (as
    CUDA keeps it), and whether CUDA has started in the process."""

    def __init__(self, num_gpus: int = 2, initialized: bool = False):
        self.gpus = [{"name": f"Fake H200 #{i}", "uuid": f"GPU-fake-{i}",
                      "total_memory_bytes": (141 + i) * 2**30} for i in range(num_gpus)]
        self.initialized = initialized
        self.current: dict[int, int] = {}  # thread id -> device index

    def is_available(self) -> bool:
        return bool(self.gpus)

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.gpus)

    def set_device(self, index: int) -> None:
        assert 0 <= index < len(self.gpus)
        self.initialized = True
        self.current[threading.get_ident()] = index

    def properties(self, index: int) -> dict:
        return dict(self.gpus[index])
