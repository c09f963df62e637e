"""The ``local`` backend: a single-host executor that copies rows into a decode's shared arena.

The decode side allocates its KV buffers from an arena (a sealed memfd, ``arena.py``) and
advertises offsets into it (``LocalEndpoint``); the prefill side receives the arena's
descriptor over the decode's Unix socket, maps it and copies rows with numpy, one strided
copy per run. No engine is involved, so this backend is also the reference the engine
executors are tested against. Nothing is ever opened, created or deleted under /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproto.dcp.runs import count_segments
from pdproto.errors import (
    InvalidFieldError,
    NotFoundError,
    PdprotoError,
    Reason,
    RequestFailedError,
)
from pdproto.v1 import registration_pb2

from . import arena
from .base import (
    DRAM,
    PAGE,
    MemoryKind,
    Buffer,
    Endpoint,
    TransferJob,
    TransferResult,
    TransferStats,
    check_bounds,
    Regions,
    remote_regions,
    require_transport,
    validate_job,
)
from .memory import host_view
from .packing import copy_runs
from .worker import PeerCalls, PeerWorkers


@dataclass
class _Peer:
    """A connected peer: its handed-over arena and registered bounds."""

    lease: arena.Lease
    view: np.ndarray
    regions: Regions
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by a copy into the arena; unmapping waits for it."""

    def unmap(self) -> None:
        """Drop the mapping and the connection once no copy into it runs (the memory stays the decode's)."""
        with self.lock:
            self.view = np.zeros(0, dtype=np.uint8)
            self.lease.close()


class LocalExecutor(PeerCalls[_Peer]):
    """Copies rows between processes of one host through a decode's sealed memfd arena."""

    backend = "local"

    def __init__(self, *, arena_bytes: int = 1 << 30, name: str | None = None,
                 connect_timeout_s: float = 5.0, transfer_timeout_s: float = 30.0, **_: Any) -> None:
        """Create an executor; the arena (sparse, so only touched pages cost memory) is made lazily.

        ``connect_timeout_s`` bounds how long ``connect`` waits for a decode to hand its arena over;
        ``transfer_timeout_s`` bounds each call submitted to a peer's worker.
        """
        self.stats = TransferStats()
        self.transfer_timeout_s = transfer_timeout_s
        self._workers = PeerWorkers(transfer_timeout_s)
        self._arena_bytes = arena_bytes
        self._name = name or f"pdproto-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._connect_timeout = connect_timeout_s
        self._arena: mmap.mmap | None = None
        self._arena_fd = -1
        self._server: arena.ArenaServer | None = None
        self._arena_view: np.ndarray | None = None
        self._next = 0
        self._local: list[tuple[int, int]] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _ensure_arena(self) -> np.ndarray:
        if self._arena_view is None:
            fd = arena.create(self._name, self._arena_bytes)
            try:
                self._arena = mmap.mmap(fd, self._arena_bytes)
                self._server = arena.ArenaServer(fd, self._arena_bytes)
            except BaseException:
                os.close(fd)
                raise
            self._arena_fd = fd
            self._arena_view = np.frombuffer(self._arena, dtype=np.uint8)
        return self._arena_view

    def allocate(self, nbytes: int, *, kind: MemoryKind = DRAM, device: int = 0) -> Buffer:
        """Carve a zeroed, page-aligned buffer out of the shared arena; ``ptr`` is its offset."""
        if kind != DRAM:
            raise InvalidFieldError("kind", "the local backend supports host memory only",
                                    metadata={"kind": kind})
        with self._lock:
            view = self._ensure_arena()
            offset = self._next
            end = offset + nbytes
            if end > self._arena_bytes:
                raise InvalidFieldError("nbytes", "local arena exhausted; raise arena_bytes",
                                        metadata={"arena_bytes": self._arena_bytes, "wanted": end})
            self._next = (end + PAGE - 1) // PAGE * PAGE
            array = view[offset:end]
            addr = int(view.ctypes.data) + offset
            self._local.append((addr, nbytes))
        return Buffer(addr=addr, length=nbytes, ptr=offset, kind=DRAM, array=array)

    def register_memory(self, buffers: Sequence[Buffer]) -> None:
        """Record host buffers as valid sources (arena buffers are registered already)."""
        with self._lock:
            for b in buffers:
                if b.kind != DRAM:
                    raise InvalidFieldError("buffers.kind", "the local backend supports host memory only",
                                            metadata={"kind": b.kind})
                self._local.append((b.addr, b.length))

    def endpoint(self) -> Endpoint:
        """The ``LocalEndpoint``: this process's arena, and the socket that hands it over."""
        with self._lock:
            self._ensure_arena()
        assert self._server is not None
        return registration_pb2.LocalEndpoint(arena_name=self._name, size=self._arena_bytes, pid=os.getpid(),
                                              socket=self._server.name, secret=self._server.secret)

    def connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> None:
        """Receive the peer's arena from the peer and map it; a typed error when it is unusable or its
        owner is gone (blocks for at most ``connect_timeout_s``).

        Every KV buffer must lie inside the arena (a length of 0 means "to the arena's end").
        """
        declared, need = _declared(registration)
        lease = arena.fetch(registration.local, need, timeout=self._connect_timeout)
        outside = [ptr for ptr in declared if ptr >= lease.size]
        if outside:
            lease.close()
            ptr = min(outside)
            raise InvalidFieldError(_field_at(registration, ptr), f"offset {ptr} is outside the {lease.size}-byte arena",
                                    metadata={"ptr": ptr, "arena": lease.size})
        regions = {ptr: length or lease.size - ptr for ptr, length in declared.items()}
        peer = _Peer(lease=lease, view=np.frombuffer(lease.mapping, dtype=np.uint8), regions=regions)
        with self._lock:
            old = self._peers.pop(peer_id, None)
            self._peers[peer_id] = peer
        if old is not None:
            old.unmap()  # after a copy into the old arena that may still run

    def execute(self, peer_id: str, job: TransferJob) -> TransferResult:
        """Copy every layer's rows into the peer's arena, one strided copy per run.

        PEER_GONE when the decode closed its arena socket (it exited or closed its
        executor), checked before and after the copy. The copy itself cannot fault: the
        arena is sealed against shrinking and the mapping lies inside its sealed size.
        PEER_NOT_FOUND when the peer was disconnected while the call waited for it.
        """
        t0 = time.perf_counter()
        validate_job(job)
        peer = self._peer(peer_id)
        counts: list[int] = []
        with peer.lock:
            try:
                with self._lock:
                    current = self._peers.get(peer_id) is peer
                if not current:
                    # Disconnected (or connected anew) while this call waited: its arena is unmapped.
                    raise NotFoundError("peer is not connected: it was disconnected while this transfer waited",
                                        reason=Reason.PEER_NOT_FOUND, metadata={"peer": peer_id})
                _check_alive(peer_id, peer, "the decode closed its arena (it exited or closed its executor)")
                with self._lock:
                    local = list(self._local)
                check_bounds(job, local=local, remote=peer.regions)
                for seg, layer in job.units():
                    _, smax, _, dmax = seg.extents
                    src = host_view(layer.src_ptr + layer.src_offset, smax * layer.row_bytes + layer.nbytes)
                    start = layer.dst_ptr + layer.dst_offset
                    dst = peer.view[start:start + dmax * layer.dst_pitch + layer.nbytes]
                    copy_runs(src, layer.row_bytes, dst, layer.dst_pitch, seg.runs, layer.nbytes)
                    # What an engine would need: one descriptor per stretch adjacent on both sides.
                    counts.append(count_segments(seg.runs) if layer.whole_rows else seg.num_rows)
                _check_alive(peer_id, peer, "the decode closed its arena during the transfer")
            except PdprotoError:
                with self._lock:
                    self.stats.failures += 1
                raise
        nbytes, ndesc = job.nbytes, sum(counts)
        with self._lock:  # jobs for different peers finish concurrently
            self.stats.jobs += 1
            self.stats.bytes += nbytes
            self.stats.descriptors += ndesc
        return TransferResult(bytes=nbytes, descriptors=ndesc, seconds=time.perf_counter() - t0, packed=False,
                              fallback=False, segment_descriptors=job.by_segment(counts))

    def drained(self, peer_id: str) -> Future[Any] | None:
        """A marker done once the calls on the peer's worker so far returned; None when none is there.

        A disconnected peer's copies are over (``disconnect`` waits for the one in progress).
        """
        worker = self._workers.get(peer_id)
        if worker is None or not worker.busy:
            return None
        return worker.idle()

    def notify(self, peer_id: str, room: int, payload: bytes) -> bool:
        """The local backend has no notification channel; always False."""
        self._peer(peer_id)
        return False

    def disconnect(self, peer_id: str) -> None:
        """Unmap the peer's arena and close its socket; the memory stays the decode's."""
        self._workers.retire(peer_id)
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            peer.unmap()

    def close(self) -> None:
        """Disconnect every peer, stop handing this arena out, and drop it (prefills see the hang-up)."""
        if self._closed:
            return
        self._closed = True
        for peer_id in list(self._peers):
            self.disconnect(peer_id)
        self._workers.retire()
        if self._server is not None:
            self._server.close()
        if self._arena is not None:
            self._arena_view = None
            try:
                self._arena.close()
            except BufferError:
                # Buffers handed out still reference the map; the OS frees it at exit.
                pass
        if self._arena_fd >= 0:
            os.close(self._arena_fd)
            self._arena_fd = -1


def _declared(registration: registration_pb2.KvRegistration) -> tuple[Regions, int]:
    """The registration's buffers (offset: length) and how much of the arena they need mapped."""
    require_transport(registration, "local", "local")
    declared = remote_regions(registration)
    # Map what the buffers cover; a buffer of unknown length (0) reaches the arena's end.
    need = 0
    for ptr, length in declared.items():
        if not length:
            return declared, 0
        need = max(need, ptr + length)
    return declared, need


def _field_at(registration: registration_pb2.KvRegistration, ptr: int) -> str:
    """The field that names offset ``ptr`` (for the error that refuses it)."""
    for i, b in enumerate(registration.kv_buffers):
        if b.ptr == ptr:
            return f"registration.kv_buffers[{i}].ptr"
    if ptr in registration.aux_ptrs:
        return f"registration.aux_ptrs[{list(registration.aux_ptrs).index(ptr)}]"
    for i, s in enumerate(registration.state_buffers):
        if ptr in s.data_ptrs:
            return f"registration.state_buffers[{i}].data_ptrs[{list(s.data_ptrs).index(ptr)}]"
    return "registration"


def _check_alive(peer_id: str, peer: _Peer, message: str) -> None:
    if not peer.lease.alive():
        raise RequestFailedError(message, reason=Reason.PEER_GONE,
                                 metadata={"peer": peer_id, "pid": peer.lease.pid})


__all__ = ["LocalExecutor"]
