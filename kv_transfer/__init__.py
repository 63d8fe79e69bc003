"""KV transfer between prefill and decode workers: wire format, protocol, transports, faults.

``RayObjectStoreTransport`` (needs ray), ``TorchDistributedTransport`` and ``SharedMemoryTransport``
(``kv_transfer.shm``) are imported from their modules, so importing this package needs neither Ray
nor a process group."""

from kv_transfer.faults import FaultyTransport
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.payload import (WIRE_VERSION, KVChecksumError, KVHeader, KVSpecMismatch, pack,
                                 unpack)
from kv_transfer.transport import (KVHandle, TransferError, TransferFailed, TransferRecord,
                                   TransferTimeout, Transport)

__all__ = [
    "WIRE_VERSION", "KVChecksumError", "KVHeader", "KVSpecMismatch", "pack", "unpack",
    "KVHandle", "TransferError", "TransferFailed", "TransferRecord", "TransferTimeout",
    "Transport", "InProcessTransport", "FaultyTransport",
]
