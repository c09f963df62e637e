"""Executor interface and value types shared by every transfer backend.

An executor moves KV rows from memory this process registered into memory a
peer registered. Addresses follow one rule: a *local* address (``src_ptr``,
``Buffer.addr``, staging) is a real pointer in this process; a *peer* address
(``dst_ptr``, ``KvBuffer.ptr``) is whatever the peer advertised in its
registration (a real pointer for Mooncake and NIXL, an arena offset for the
local backend). ``Buffer.ptr`` is the value to advertise.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdproto.backends import Endpoint, set_endpoint
from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError
from pdproto.v1 import common_pb2, registration_pb2

Rows = npt.NDArray[np.int64]
"""Row indices, int64, one per token (from ``RelayoutPlan.expand()``)."""

MemoryKind: TypeAlias = common_pb2.MemoryKind.ValueType
"""A ``pdproto.v1.MemoryKind`` value."""

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
PAGE = 4096


@dataclass(frozen=True)
class Buffer:
    """A block of memory owned by an executor (or the caller) and usable in transfers."""

    addr: int
    """Real address in this process (a CUDA device pointer for VRAM)."""
    length: int
    """Size in bytes."""
    ptr: int
    """Value to advertise to peers in ``KvBuffer.ptr`` (an arena offset for ``local``)."""
    kind: MemoryKind = DRAM
    """``pdproto.v1.MemoryKind`` value."""
    device: int = 0
    """CUDA device index for VRAM."""
    array: Any = field(default=None, compare=False, repr=False)
    """The numpy uint8 array (DRAM) or torch uint8 tensor (VRAM) behind the memory; keeps it alive."""


@dataclass(frozen=True)
class LayerSpan:
    """One KV entry (layer) of a job: where its rows start on each side and how wide a row is."""

    src_ptr: int
    """Local address of source row 0 (must lie in registered memory)."""
    dst_ptr: int
    """Peer address of destination row 0 (``KvBuffer.ptr`` of the peer's entry)."""
    row_bytes: int
    """Bytes per row (token) of this entry; rows are packed back to back on both sides."""


@dataclass(frozen=True)
class TransferJob:
    """Copy rows ``src_rows[i]`` to ``dst_rows[i]`` of every layer in ``layers``."""

    layers: tuple[LayerSpan, ...]
    """The entries to move; every layer uses the same row pairs."""
    src_rows: Rows
    """Source row index per token, int64."""
    dst_rows: Rows
    """Destination row index per token, int64, same length as ``src_rows``."""
    pack: bool = True
    """Gather source rows into the staging region first (falls back to per-row if it cannot)."""
    notification: bytes | None = None
    """Sent to the peer after the last byte lands (NIXL); sent even when there are no rows."""


@dataclass(frozen=True)
class TransferResult:
    """What one ``execute`` did."""

    bytes: int
    """Payload bytes written to the peer."""
    descriptors: int
    """Transfer descriptors submitted to the engine."""
    seconds: float
    """Wall time of the whole call, packing included."""
    packed: bool
    """True when rows went through the staging region."""
    fallback: bool
    """True when packing was asked for but the job ran per-row (staging too small or absent)."""
    pack_seconds: float = 0.0
    """Time spent gathering rows into staging."""
    notified: bool = False
    """True when ``job.notification`` was delivered through the engine."""


@dataclass
class TransferStats:
    """Cumulative counters an executor keeps; the server exports them as metrics."""

    jobs: int = 0
    bytes: int = 0
    descriptors: int = 0
    packed_jobs: int = 0
    pack_fallbacks: int = 0
    failures: int = 0


@dataclass(frozen=True)
class Notification:
    """A notification received by the decode side: sender agent, room and payload."""

    peer: str
    room: int
    payload: bytes


@runtime_checkable
class TransferExecutor(Protocol):
    """A transfer backend; blocking calls, safe from many threads (one lock per peer)."""

    backend: str
    stats: TransferStats

    def allocate(self, nbytes: int, *, kind: MemoryKind = DRAM, device: int = 0) -> Buffer:
        """Allocate page-aligned zeroed memory usable as a source or destination."""
        ...

    def register_memory(self, buffers: Sequence[Buffer]) -> None:
        """Register memory with the engine so transfers may read or write it."""
        ...

    def endpoint(self) -> Endpoint:
        """The message that goes into ``KvRegistration.transport``."""
        ...

    def connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> None:
        """Remember a peer's transport and buffers; raises a ``PdprotoError`` when unusable."""
        ...

    def execute(self, peer_id: str, job: TransferJob) -> TransferResult:
        """Run a job to completion; raises a ``PdprotoError`` (class and ``Reason`` say why) on failure."""
        ...

    def notify(self, peer_id: str, room: int, payload: bytes) -> bool:
        """Send a standalone notification; False when the backend has none."""
        ...

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call (decode side)."""
        ...

    def disconnect(self, peer_id: str) -> None:
        """Forget a peer and free what was held for it; unknown peers are ignored."""
        ...

    def close(self) -> None:
        """Release every engine resource; the executor is unusable afterwards."""
        ...


def encode_notification(room: int, payload: bytes) -> bytes:
    """Frame a notification: 8-byte little-endian room, then the payload."""
    return struct.pack("<Q", room) + payload


def decode_notification(peer: str, data: bytes) -> Notification | None:
    """Parse ``encode_notification`` output; None for frames that are not ours."""
    if len(data) < 8:
        return None
    (room,) = struct.unpack_from("<Q", data)
    return Notification(peer=peer, room=room, payload=bytes(data[8:]))


def validate_job(job: TransferJob) -> tuple[Rows, Rows]:
    """Check row arrays are equal-length non-negative int64; return them as contiguous arrays."""
    src = np.ascontiguousarray(job.src_rows, dtype=np.int64)
    dst = np.ascontiguousarray(job.dst_rows, dtype=np.int64)
    if src.ndim != 1 or src.shape != dst.shape:
        raise InvalidFieldError("job.dst_rows", "src_rows and dst_rows must be 1-D and of equal length",
                                metadata={"src": src.shape, "dst": dst.shape})
    if src.size and (int(src.min()) < 0 or int(dst.min()) < 0):
        raise InvalidFieldError("job.src_rows", "row indices must be non-negative")
    for layer in job.layers:
        if layer.row_bytes <= 0:
            raise InvalidFieldError("job.layers.row_bytes", "row_bytes must be positive",
                                    metadata={"row_bytes": layer.row_bytes})
    return src, dst


def _span_inside(start: int, end: int, regions: Sequence[tuple[int, int]]) -> bool:
    return any(base <= start and end <= base + length for base, length in regions)


def check_bounds(job: TransferJob, src: Rows, dst: Rows, *, local: Sequence[tuple[int, int]],
                 remote: Sequence[tuple[int, int]]) -> None:
    """Raise unless every row of every layer lies inside one registered region on its side.

    ``remote`` regions with length 0 (unknown) are not bounded, as the schema allows.
    """
    if src.size == 0:
        return
    smin, smax, dmin, dmax = int(src.min()), int(src.max()), int(dst.min()), int(dst.max())
    bounded = [(b, n) for b, n in remote if n > 0]
    unbounded = {b for b, n in remote if n == 0}
    for i, layer in enumerate(job.layers):
        lo, hi = layer.src_ptr + smin * layer.row_bytes, layer.src_ptr + (smax + 1) * layer.row_bytes
        if not _span_inside(lo, hi, local):
            raise InvalidFieldError("job.layers.src_ptr", "source rows fall outside registered local memory",
                                    metadata={"layer": i, "src_ptr": hex(layer.src_ptr), "max_row": smax})
        lo, hi = layer.dst_ptr + dmin * layer.row_bytes, layer.dst_ptr + (dmax + 1) * layer.row_bytes
        if layer.dst_ptr in unbounded:
            continue
        if not _span_inside(lo, hi, bounded):
            raise DestinationOutOfBoundsError(
                "destination rows fall outside the memory the peer registered",
                metadata={"layer": i, "dst_ptr": hex(layer.dst_ptr), "max_row": dmax})


def contiguous_runs(src: Rows, dst: Rows) -> tuple[Rows, Rows, Rows]:
    """Group row pairs into maximal runs where both sides advance by one: (src starts, dst starts, lengths)."""
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk)).astype(np.int64)
    ends = np.concatenate((brk, [src.size])).astype(np.int64)
    return src[starts], dst[starts], ends - starts


def remote_regions(registration: registration_pb2.KvRegistration) -> list[tuple[int, int]]:
    """The (ptr, length) pairs a peer registered for KV, as bounds for destination writes."""
    return [(b.ptr, b.length) for b in registration.kv_buffers]


__all__ = [
    "DRAM",
    "PAGE",
    "VRAM",
    "Buffer",
    "Endpoint",
    "LayerSpan",
    "MemoryKind",
    "Notification",
    "Rows",
    "TransferExecutor",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "check_bounds",
    "contiguous_runs",
    "decode_notification",
    "encode_notification",
    "remote_regions",
    "set_endpoint",
    "validate_job",
]
