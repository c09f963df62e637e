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

    ``options`` are the table "Options of ``create_executor``" in this package's README (each
    backend ignores those its executor does not take).

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
