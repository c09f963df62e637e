"""Executor interface and value types shared by every transfer backend.

An executor moves KV rows from memory this process registered into memory a peer
registered. Which addresses are local pointers and which the peer's, and how rows and
their byte ranges are laid out: this package's README, "Addresses". A job says which
rows move as the planner's runs (``pdproto.dcp.runs``), never as one index per row.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdproto.backends import Endpoint
from pdproto.dcp import runs as run_arith
from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError, Reason, TopologyError
from pdproto.v1 import common_pb2, registration_pb2

from .worker import PeerWorker

Runs = npt.NDArray[np.int64]
"""(R, 5) int64 row runs: src_start, src_stride, dst_start, dst_stride, count (``pdproto.dcp.runs``)."""

Regions: TypeAlias = dict[int, int]
"""A peer's registered destination regions: base address -> bytes that bound writes from it (0: unknown)."""

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
    """One entry (layer) of a segment: where row 0 lies on each side, the row pitches, and the bytes moved.

    By default a whole row moves and both sides use ``row_bytes``. A byte sub-range of
    each row (a KV head slice, one head group of a recurrent state slot) sets
    ``src_offset``/``dst_offset``/``width``, and ``dst_row_bytes`` when the destination
    rows are laid out with another pitch.
    """

    src_ptr: int
    """Local address of source row 0 (must lie in registered memory)."""
    dst_ptr: int
    """Peer address of destination row 0 (``KvBuffer.ptr`` of the peer's entry)."""
    row_bytes: int
    """Bytes from one source row to the next, and on the destination unless ``dst_row_bytes`` is set."""
    dst_row_bytes: int = 0
    """Destination row pitch when it differs from the source's (0: ``row_bytes``)."""
    src_offset: int = 0
    """First byte moved within each source row."""
    dst_offset: int = 0
    """Where the moved bytes start within each destination row."""
    width: int = 0
    """Bytes moved per row (0: the whole row)."""

    @property
    def dst_pitch(self) -> int:
        """Bytes from one destination row to the next."""
        return self.dst_row_bytes or self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes moved per row."""
        return self.width or self.row_bytes

    @property
    def whole_rows(self) -> bool:
        """True when consecutive rows are adjacent bytes on both sides, so one descriptor may span them."""
        return self.nbytes == self.row_bytes == self.dst_pitch


@dataclass(frozen=True, eq=False)
class Segment:
    """One row set, as runs, moved for each of its layers (target KV, draft KV; later aux or state slots)."""

    runs: Runs
    """(R, 5) int64 runs; every layer of the segment moves the same row pairs."""
    layers: tuple[LayerSpan, ...]
    """The entries that move these rows."""

    @cached_property
    def num_rows(self) -> int:
        """Row pairs per layer."""
        return run_arith.num_rows(self.runs)

    @cached_property
    def extents(self) -> tuple[int, int, int, int]:
        """(lowest src row, highest src row, lowest dst row, highest dst row); O(runs), runs non-empty."""
        return run_arith.extents(self.runs)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the segment, all layers."""
        return self.num_rows * sum(layer.nbytes for layer in self.layers)


@dataclass(frozen=True, eq=False)
class TransferJob:
    """Move every segment's rows for each of its layers, then notify the peer (if asked)."""

    segments: tuple[Segment, ...]
    """Row sets with their layers; a packed job gathers them all through one staging extent."""
    pack: bool = True
    """Gather source rows into the staging region first (falls back to per-row if it cannot)."""
    notification: bytes | tuple[bytes, ...] | None = None
    """Sent to the peer after the last byte lands (NIXL), each of a tuple in order; sent even when there
    are no rows."""

    @classmethod
    def of_runs(cls, layers: Sequence[LayerSpan], runs: Runs, **options: Any) -> TransferJob:
        """A one-segment job: these runs for these layers (``options``: pack, notification)."""
        return cls(segments=(Segment(runs, tuple(layers)),), **options)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the whole job."""
        return sum(seg.nbytes for seg in self.segments)

    def units(self) -> list[tuple[Segment, LayerSpan]]:
        """Every (segment, layer) pair with rows, in the order they move."""
        return [(seg, layer) for seg in self.segments if seg.num_rows for layer in seg.layers]

    @property
    def notifications(self) -> tuple[bytes, ...]:
        """``notification`` as a tuple (empty: none)."""
        n = self.notification
        return (n,) if isinstance(n, bytes) else n or ()

    def by_segment(self, per_unit: Sequence[int]) -> tuple[int, ...]:
        """Per-unit counts (in ``units()`` order) summed per segment, in the job's segment order."""
        out, it = [], iter(per_unit)
        for seg in self.segments:
            out.append(sum(next(it) for _ in seg.layers) if seg.num_rows else 0)
        return tuple(out)


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
    """True when ``job.notification`` (each of them) was delivered through the engine."""
    inline: bool = False
    """True when a packed job was small enough to pack on the calling thread and go out as one engine call."""
    segment_descriptors: tuple[int, ...] = ()
    """Descriptors per segment of the job, in its order (a job of several kinds counts each kind)."""


@dataclass
class TransferStats:
    """Cumulative counters an executor keeps; the server exports them as metrics."""

    jobs: int = 0
    bytes: int = 0
    descriptors: int = 0
    packed_jobs: int = 0
    pack_fallbacks: int = 0
    inline_jobs: int = 0
    """Packed jobs (also counted in ``packed_jobs``) packed inline and sent as one engine call."""
    failures: int = 0
    timeouts: int = 0
    """Calls that ran past the executor's ``transfer_timeout_s`` (also counted in ``failures``)."""


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

    def worker(self, peer_id: str) -> PeerWorker:
        """The peer's own worker (``pdproto/transfer/worker.py``), started on first use: a caller that must
        not block (the prefill service) submits its calls for the peer there and awaits the ``Call``, which
        fails with DEADLINE_EXCEEDED at the executor's ``transfer_timeout_s``; ``disconnect`` retires it."""
        ...

    def notify(self, peer_id: str, room: int, payload: bytes) -> bool:
        """Send a standalone notification; False when the backend has none."""
        ...

    def quiesce(self, peer_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` until no engine call for the peer (a timed-out one included) runs."""
        ...

    def drained(self, peer_id: str) -> Future[Any] | None:
        """``quiesce`` without a waiting thread: a future done once every engine call for the peer made
        so far has left the engine, or None when none can be inside it; never cancel it.

        Raises ``ShuttingDownError`` when the process is exiting and that cannot be known.
        """
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


def validate_job(job: TransferJob) -> None:
    """Check every segment's runs and every layer's byte range in O(runs); INVALID_FIELD otherwise."""
    for i, seg in enumerate(job.segments):
        runs = seg.runs
        if not isinstance(runs, np.ndarray) or runs.dtype != np.int64 or runs.ndim != 2 or runs.shape[1] != 5:
            raise InvalidFieldError(f"job.segments[{i}].runs",
                                    "segment runs must be an (R, 5) int64 array (pdproto.dcp.runs)",
                                    metadata={"shape": getattr(runs, "shape", None),
                                              "dtype": getattr(runs, "dtype", None)})
        bad = run_arith.bad_run(runs)
        if bad is not None:
            raise InvalidFieldError(f"job.segments[{i}].runs",
                                    "runs need non-negative starts and strides and counts of at least 1",
                                    metadata={"run": bad, "value": runs[bad].tolist()})
        wide = run_arith.overflowing_run(runs)
        if wide is not None:
            raise InvalidFieldError(f"job.segments[{i}].runs",
                                    "a run's last row (start + (count-1)*stride) does not fit in int64; "
                                    "no registered buffer has that many rows",
                                    metadata={"run": wide, "value": runs[wide].tolist()})
        for j, layer in enumerate(seg.layers):
            fields = (layer.row_bytes, layer.dst_row_bytes, layer.src_offset, layer.dst_offset, layer.width)
            if (layer.row_bytes <= 0 or min(fields) < 0 or layer.src_offset + layer.nbytes > layer.row_bytes
                    or layer.dst_offset + layer.nbytes > layer.dst_pitch):
                raise InvalidFieldError(f"job.segments[{i}].layers[{j}]",
                                        "a layer's bytes must fit its rows: positive row_bytes, and "
                                        "offset + width within the row pitch on each side",
                                        metadata={"row_bytes": layer.row_bytes,
                                                  "dst_row_bytes": layer.dst_row_bytes,
                                                  "src_offset": layer.src_offset,
                                                  "dst_offset": layer.dst_offset, "width": layer.width})


_ADDRESS_END = (1 << 63) - 1
"""Largest byte end a descriptor (an int64 address) can hold."""


def _span_inside(start: int, end: int, regions: Sequence[tuple[int, int]]) -> bool:
    return any(base <= start and end <= base + length for base, length in regions)


def byte_span(ptr: int, lo_row: int, hi_row: int, pitch: int, offset: int, nbytes: int) -> tuple[int, int]:
    """[first, end) bytes touched by rows lo_row..hi_row of ``nbytes`` at ``offset`` in rows ``pitch`` apart."""
    return ptr + lo_row * pitch + offset, ptr + hi_row * pitch + offset + nbytes


def check_bounds(job: TransferJob, *, local: Sequence[tuple[int, int]], remote: Regions) -> None:
    """Raise unless every layer's rows lie inside its own registered region on each side; O(runs) per segment.

    Each segment's runs give its lowest and highest row on each side (strides are positive),
    so one span per layer and side covers every row; the rule itself is the README's
    ("Addresses": ``dst_ptr`` the base of a region in ``remote``, 0 is unbounded).
    """
    for i, (seg, layer) in enumerate(job.units()):
        smin, smax, dmin, dmax = seg.extents
        if not _span_inside(*byte_span(layer.src_ptr, smin, smax, layer.row_bytes, layer.src_offset,
                                       layer.nbytes), local):
            raise InvalidFieldError("job.segments.layers.src_ptr", "source rows fall outside registered local memory",
                                    metadata={"layer": i, "src_ptr": hex(layer.src_ptr), "max_row": smax})
        length = remote.get(layer.dst_ptr)
        if length is None:
            raise DestinationOutOfBoundsError(
                "destination names no buffer the peer registered",
                metadata={"layer": i, "dst_ptr": hex(layer.dst_ptr)})
        span = byte_span(layer.dst_ptr, dmin, dmax, layer.dst_pitch, layer.dst_offset, layer.nbytes)
        if length and not _span_inside(*span, [(layer.dst_ptr, length)]):
            raise DestinationOutOfBoundsError(
                "destination rows fall outside the buffer the peer registered for that entry",
                metadata={"layer": i, "dst_ptr": hex(layer.dst_ptr), "max_row": dmax, "registered": length})
        if span[1] > _ADDRESS_END:
            # A region of unknown length bounds nothing, but descriptors are int64 addresses.
            raise DestinationOutOfBoundsError(
                "destination rows reach past the largest address a descriptor can hold",
                metadata={"layer": i, "dst_ptr": hex(layer.dst_ptr), "max_row": dmax})


def require_transport(registration: registration_pb2.KvRegistration, transport: str, engine: str) -> None:
    """TOPOLOGY_BACKEND_UNSUPPORTED unless the registration's transport is ``transport`` (``engine``'s)."""
    found = registration.WhichOneof("transport")
    if found != transport:
        raise TopologyError(f"registration carries no {engine} endpoint", reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
                            metadata={"transport": found})


def remote_regions(registration: registration_pb2.KvRegistration) -> Regions:
    """Every base a peer registered for KV, aux, state and its credential, with the length that bounds writes from it.

    Built once per connection, not per job: a registration may list tens of thousands of
    state tensors. Two regions at one base: the looser bound wins (0, unknown, is the loosest).
    """
    bases: list[int] = []
    lengths: list[int] = []
    for b in registration.kv_buffers:  # one pass: each step through a repeated message costs a microsecond
        bases.append(b.ptr)
        lengths.append(b.length)
    if registration.HasField("credential_buffer"):
        bases.append(registration.credential_buffer.ptr)
        lengths.append(registration.credential_buffer.length)
    # Scalar lists convert through numpy at once; indexing them one by one costs a microsecond each.
    for ptrs, lens in ((registration.aux_ptrs, registration.aux_data_lens),
                       *((s.data_ptrs, s.data_lens) for s in registration.state_buffers)):
        if not len(ptrs):
            continue
        given = np.asarray(lens, dtype=np.uint64)[:len(ptrs)]
        bases += np.asarray(ptrs, dtype=np.uint64).tolist()
        lengths += given.tolist() + [0] * (len(ptrs) - len(given))
    regions: Regions = {}
    for base, n in zip(bases, lengths):
        old = regions.get(base)
        regions[base] = n if old is None else (0 if 0 in (old, n) else max(old, n))
    return regions


__all__ = [
    "DRAM",
    "PAGE",
    "VRAM",
    "Buffer",
    "Endpoint",
    "LayerSpan",
    "MemoryKind",
    "Notification",
    "Regions",
    "Runs",
    "Segment",
    "TransferExecutor",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "byte_span",
    "check_bounds",
    "decode_notification",
    "encode_notification",
    "remote_regions",
    "require_transport",
    "validate_job",
]
