"""Transfer executors: move KV rows into a peer's registered memory (see README.md here).

``create_executor(backend, ...)`` is the entry point; engine packages are
imported only when their backend is created, and a missing one raises
``EngineUnavailableError`` naming what to install.
"""

from __future__ import annotations

from typing import Any

from pdproto.errors import Reason, TransferError

from .base import (
    DRAM,
    VRAM,
    Buffer,
    Endpoint,
    LayerSpan,
    Notification,
    TransferExecutor,
    TransferJob,
    TransferResult,
    TransferStats,
    decode_notification,
    encode_notification,
    set_endpoint,
)
from .memory import aligned_dram, allocate, external

BACKENDS = ("local", "mooncake", "nixl")


def create_executor(backend: str, *, name: str | None = None, **options: Any) -> TransferExecutor:
    """Create the executor for ``backend`` ("local", "mooncake" or "nixl").

    Options (each backend ignores those it does not know):
      name: engine identity (NIXL agent name; local arena file name).
      staging_bytes: size of the registered packing region (0 disables packing).
      device: "cpu" or "cuda"; chooses DRAM or VRAM staging and torch packing on the GPU.
      host, protocol: Mooncake local hostname and transport ("tcp" or "rdma").
      arena_bytes: size of the local backend's shared-memory arena.
    """
    if backend == "local":
        from .local import LocalExecutor

        return LocalExecutor(name=name, arena_bytes=int(options.get("arena_bytes", 1 << 30)))
    if backend == "mooncake":
        from .mooncake import MooncakeExecutor

        return MooncakeExecutor(**options)
    if backend == "nixl":
        from .nixl import NixlExecutor

        return NixlExecutor(name=name, **options)
    raise TransferError(f"unknown transfer backend {backend!r}; expected one of {BACKENDS}",
                        reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED, metadata={"backend": backend})


__all__ = [
    "BACKENDS",
    "DRAM",
    "VRAM",
    "Buffer",
    "Endpoint",
    "LayerSpan",
    "Notification",
    "TransferExecutor",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "aligned_dram",
    "allocate",
    "create_executor",
    "decode_notification",
    "encode_notification",
    "external",
    "set_endpoint",
]
