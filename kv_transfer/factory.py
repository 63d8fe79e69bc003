"""Build the transport a ``TransferConfig`` names, optionally wrapped in fault injection."""

from __future__ import annotations

from engine.config import TransferConfig
from kv_transfer.faults import with_faults
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.nixl import NixlTransport
from kv_transfer.shm import SharedMemoryTransport
from kv_transfer.torchdist import TorchDistributedTransport
from kv_transfer.transport import Transport


# Seconds for a torch.distributed group to form (the router allows 300 s for start-up).
GROUP_INIT_TIMEOUT_S = 300.0


def make_transport(config: TransferConfig, faults: dict | list[dict] | None = None,
                   rank: int | None = None, world_size: int | None = None,
                   init_method: str | None = None, device: str = "cpu") -> Transport:
    """The transport of ``config.transport``; ``faults`` (FaultyTransport keyword arguments, or a
    list of them, stacked: ``faults.with_faults``) wraps it for tests and experiments.
    ``torchdist`` needs ``rank``, ``world_size`` and ``init_method`` (NCCL on a CUDA ``device``,
    gloo otherwise); ``shm`` and ``nixl`` need nothing (handles name the producer's arena);
    ``nixl``'s buffers live on ``device``.

    Raises:
        ValueError: torchdist without its rank set-up; nixl without NIXL installed
            (``kv_transfer.nixl.MISSING``, naming the extra)."""
    if config.transport == "inprocess":
        transport: Transport = InProcessTransport(checksum=config.checksum)
    elif config.transport == "ray":
        from kv_transfer.ray_store import RayObjectStoreTransport  # lazy: it imports ray

        transport = RayObjectStoreTransport(checksum=config.checksum)
    elif config.transport == "shm":
        transport = SharedMemoryTransport(checksum=config.checksum,
                                          alloc_timeout_s=config.timeout_s)
    elif config.transport == "nixl":
        try:
            transport = NixlTransport(checksum=config.checksum, alloc_timeout_s=config.timeout_s,
                                      device=device)
        except ImportError as err:
            raise ValueError(str(err)) from None
    else:
        if rank is None or world_size is None:
            raise ValueError("transport 'torchdist' needs rank and world_size (set by the placement)")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        # The group forms while the other ranks may still be loading their model: give it
        # the workers' start-up allowance, not one transfer's deadline.
        transport = TorchDistributedTransport(rank, world_size, backend, init_method, device,
                                              checksum=config.checksum,
                                              init_timeout_s=max(config.timeout_s,
                                                                 GROUP_INIT_TIMEOUT_S))
    return with_faults(transport, faults)
