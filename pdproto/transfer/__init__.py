"""Transfer executors: move KV rows into a peer's registered memory (see README.md here).

``create_executor(backend, ...)`` is the entry point; engine packages are
imported only when their backend is created, and a missing one raises
``EngineUnavailableError`` naming what to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdproto import backends

from .base import (
    DRAM,
    VRAM,
    Buffer,
    Endpoint,
    LayerSpan,
    Notification,
    Runs,
    Segment,
    TransferExecutor,
    TransferJob,
    TransferResult,
    TransferStats,
    decode_notification,
    encode_notification,
)
from .engines._paths import INLINE_BYTES
from .memory import CredentialSlot, allocate, at_address


def create_executor(backend: str, *, name: str | None = None, **options: Any) -> TransferExecutor:
    """Create the executor of a backend named in ``pdproto.backends`` ("local", "mooncake", "nixl").

    Options (each backend ignores those its executor does not take):
      name: engine identity (NIXL agent name; local arena (memfd) name).
      staging_bytes: size of the registered packing region (0 disables packing).
      inline_bytes: packed jobs up to this size are packed inline and sent as one
        engine call (default 4 MiB, measured in docs/transfer.md); 0 always pipelines.
      device: "cpu" or "cuda"; chooses DRAM or VRAM staging and torch packing on the GPU.
      host: the address the engine advertises to peers (Mooncake's session id; NIXL keeps UCX
        to that address's interface); default: ``PDPROTO_ADVERTISE_HOST``, else a routable
        address of this host (``pdproto.transfer.address``).
      protocol: Mooncake transport ("tcp", "rdma" or "auto").
      transfer_timeout_s, connect_timeout_s: deadlines of engine calls and of connecting a peer.
      arena_bytes: size of the local backend's shared-memory arena.

    An unknown name raises ``TopologyError`` (TOPOLOGY_BACKEND_UNSUPPORTED); the engine's
    package is imported only here, and a missing one raises ``EngineUnavailableError``.
    """
    module, _, cls_name = backends.by_name(backend).executor.partition(":")
    # Every executor takes ``**_`` and so ignores the options of other backends.
    executor: TransferExecutor = getattr(importlib.import_module(module), cls_name)(name=name, **options)
    return executor


__all__ = [
    "DRAM",
    "INLINE_BYTES",
    "CredentialSlot",
    "VRAM",
    "Buffer",
    "Endpoint",
    "LayerSpan",
    "Notification",
    "Runs",
    "Segment",
    "TransferExecutor",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "allocate",
    "at_address",
    "create_executor",
    "decode_notification",
    "encode_notification",
]
