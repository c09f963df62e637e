"""The ``local`` backend: a single-host executor that copies rows through shared memory.

The decode side allocates its KV buffers from an arena file under /dev/shm and
advertises offsets into it (``LocalEndpoint``); the prefill side maps that file
and copies rows with numpy, one strided copy per run. No engine is involved, so
this backend is also the reference the engine executors are tested against.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdproto.dcp.runs import count_segments
from pdproto.errors import (
    InvalidFieldError,
    NotFoundError,
    PdprotoError,
    Reason,
    RequestFailedError,
    TopologyError,
)
from pdproto.v1 import registration_pb2

from .base import (
    DRAM,
    PAGE,
    MemoryKind,
    Buffer,
    Endpoint,
    Notification,
    TransferJob,
    TransferResult,
    TransferStats,
    check_bounds,
    remote_regions,
    validate_job,
)
from .memory import host_view
from .packing import copy_runs

SHM_DIR = "/dev/shm"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; an unreaped zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may hold spaces.
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


_ARENA_NAME = re.compile(r"pdproto-(\d+)-[0-9a-f]{12}")


def sweep_stale_arenas() -> int:
    """Delete default-named arenas whose owner process is gone; returns how many.

    A SIGKILLed decode cannot unlink its arena, and its prefill may be gone as well.
    Only names this module generates (``pdproto-<pid>-<hex>``) are considered, so
    arenas named by the caller are never touched.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _ARENA_NAME.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


@dataclass
class _Peer:
    """A connected peer: its mapped arena and registered bounds."""

    endpoint: registration_pb2.LocalEndpoint
    mapping: mmap.mmap
    view: np.ndarray
    regions: list[tuple[int, int]]
    lock: threading.Lock


class LocalExecutor:
    """Copies rows between processes of one host through a /dev/shm arena."""

    backend = "local"

    def __init__(self, *, arena_bytes: int = 1 << 30, name: str | None = None) -> None:
        """Create an executor; the arena (sparse, so only touched pages cost memory) is made lazily."""
        self.stats = TransferStats()
        self._arena_bytes = arena_bytes
        self._name = name or f"pdproto-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._arena: mmap.mmap | None = None
        self._arena_view: np.ndarray | None = None
        self._next = 0
        self._local: list[tuple[int, int]] = []
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _ensure_arena(self) -> np.ndarray:
        if self._arena_view is None:
            sweep_stale_arenas()
            path = os.path.join(SHM_DIR, self._name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self._arena_bytes)
                self._arena = mmap.mmap(fd, self._arena_bytes)
            finally:
                os.close(fd)
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
        """The ``LocalEndpoint`` naming this process's arena."""
        with self._lock:
            self._ensure_arena()
        return registration_pb2.LocalEndpoint(shm_name=self._name, size=self._arena_bytes,
                                              pid=os.getpid())

    def connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> None:
        """Map the peer's arena; raises PEER_GONE when the arena or its owner is gone."""
        if registration.WhichOneof("transport") != "local":
            raise TopologyError("registration carries no local endpoint",
                                reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
                                metadata={"transport": registration.WhichOneof("transport")})
        ep = registration.local
        if "/" in ep.shm_name or not ep.shm_name:
            raise InvalidFieldError("registration.local.shm_name", "bad arena name",
                                    metadata={"shm_name": ep.shm_name})
        try:
            fd = os.open(os.path.join(SHM_DIR, ep.shm_name), os.O_RDWR)
        except OSError as exc:
            raise RequestFailedError("peer arena not found", reason=Reason.PEER_GONE,
                                     metadata={"peer": peer_id, "shm_name": ep.shm_name}) from exc
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        regions = [(p, n) for p, n in remote_regions(registration)]
        peer = _Peer(endpoint=ep, mapping=mapping, view=np.frombuffer(mapping, dtype=np.uint8),
                     regions=[(p, n if n > 0 else size - p) for p, n in regions if p < size],
                     lock=threading.Lock())
        with self._lock:
            old = self._peers.pop(peer_id, None)
            self._peers[peer_id] = peer
        if old is not None:
            _unmap(old)

    def _peer(self, peer_id: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise NotFoundError("peer is not connected", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peer": peer_id})
        return peer

    def execute(self, peer_id: str, job: TransferJob) -> TransferResult:
        """Copy every layer's rows into the peer's arena, one strided copy per run; PEER_GONE if its owner died."""
        t0 = time.perf_counter()
        validate_job(job)
        peer = self._peer(peer_id)
        ndesc = 0
        with peer.lock:
            try:
                if not pid_alive(peer.endpoint.pid):
                    raise RequestFailedError("peer process is gone", reason=Reason.PEER_GONE,
                                             metadata={"peer": peer_id, "pid": peer.endpoint.pid})
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
                    ndesc += count_segments(seg.runs) if layer.whole_rows else seg.num_rows
                if not pid_alive(peer.endpoint.pid):
                    raise RequestFailedError("peer process died during the transfer",
                                             reason=Reason.PEER_GONE,
                                             metadata={"peer": peer_id, "pid": peer.endpoint.pid})
            except PdprotoError:
                with self._lock:
                    self.stats.failures += 1
                raise
        nbytes = job.nbytes
        with self._lock:  # jobs for different peers finish concurrently
            self.stats.jobs += 1
            self.stats.bytes += nbytes
            self.stats.descriptors += ndesc
        return TransferResult(bytes=nbytes, descriptors=ndesc,
                              seconds=time.perf_counter() - t0, packed=False, fallback=False)

    def notify(self, peer_id: str, room: int, payload: bytes) -> bool:
        """The local backend has no notification channel; always False."""
        self._peer(peer_id)
        return False

    def notifications(self) -> list[Notification]:
        """Always empty: completion travels over the control plane."""
        return []

    def disconnect(self, peer_id: str) -> None:
        """Unmap the peer's arena, and delete it if its owner died without doing so."""
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        with peer.lock:
            _unmap(peer)
            if not pid_alive(peer.endpoint.pid):
                try:
                    os.unlink(os.path.join(SHM_DIR, peer.endpoint.shm_name))
                except OSError:
                    pass

    def close(self) -> None:
        """Disconnect every peer, then unmap and delete this process's arena."""
        if self._closed:
            return
        self._closed = True
        for peer_id in list(self._peers):
            self.disconnect(peer_id)
        if self._arena is not None:
            self._arena_view = None
            try:
                self._arena.close()
            except BufferError:
                # Buffers handed out still reference the map; the OS frees it at exit.
                pass
            try:
                os.unlink(os.path.join(SHM_DIR, self._name))
            except OSError:
                pass


def _unmap(peer: _Peer) -> None:
    peer.view = np.zeros(0, dtype=np.uint8)
    try:
        peer.mapping.close()
    except BufferError:
        pass


__all__ = ["LocalExecutor", "pid_alive", "sweep_stale_arenas"]
