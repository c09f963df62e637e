"""Shared machinery of the engine executors: registration bookkeeping, staging, the pipeline, deadlines.

Subclasses supply the engine calls (``_submit``, ``_wait``, ``_send_notification``
and the registration hooks); this class turns a ``TransferJob``'s runs into
per-layer descriptor batches, packing through staging where it can. Every engine call
for a peer runs on that peer's own worker; what a call past its deadline keeps (its
staging extent, its engine handles, an *unsettled* peer) is in this package's README.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdproto.errors import DeadlineExceededError, PdprotoError, Reason, ShuttingDownError
from pdproto.v1 import registration_pb2

from ..base import (
    DRAM,
    VRAM,
    Buffer,
    MemoryKind,
    TransferJob,
    TransferResult,
    TransferStats,
    check_bounds,
    encode_notification,
    Regions,
    remote_regions,
    validate_job,
)
from ._paths import INLINE_BYTES, JobPaths
from ._settle import Settling, all_done
from ..memory import allocate, host_view
from ..packing import Gatherer, StagingExtents
from ..worker import PeerCalls, PeerWorker, PeerWorkers

_T = TypeVar("_T")


def rdma_present() -> bool:
    """True when the kernel lists an RDMA device (Mooncake "rdma", UCX's ib transports)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


@dataclass
class PeerState:
    """What an engine executor keeps per connected peer."""

    peer_id: str
    remote: str
    """Engine handle of the peer: Mooncake session id or NIXL agent name."""
    regions: Regions = field(default_factory=dict)
    """The peer's registered destination regions (``remote_regions``), bounds for every job."""
    device: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    worker: PeerWorker | None = None
    """The peer's own worker: every engine call for this peer runs there, one at a time."""
    deadline: float = 0.0
    """``time.monotonic()`` by which the call running on the worker must finish (engine waits read it)."""
    retired: Future[None] | None = None
    """Done once the disconnect queued on the worker (so every earlier call there) has returned."""
    unsettled: Future[None] | None = None
    """Done once the engine let go of every transfer of this peer that outlived its call (NIXL:
    a handle it would not release yet); None while there is none."""


class EngineExecutor(JobPaths, Settling, PeerCalls[PeerState]):
    """Base class of the Mooncake and NIXL executors (not a backend on its own)."""

    backend = "engine"

    disconnect_waits = False
    """True when ``_disconnect`` must not run before the peer's in-flight call ended (NIXL)."""

    settle_wait_s = 2.0
    """How long a call keeps asking the engine to let go of a transfer it would not release yet
    (NIXL, cancel under way) before it returns and leaves the retries to later calls."""

    def __init__(self, *, staging_bytes: int = 0, device: str = "cpu", transfer_timeout_s: float = 30.0,
                 inline_bytes: int = INLINE_BYTES) -> None:
        """Set up bookkeeping; subclasses start their engine, then call ``_init_staging``."""
        self.inline_bytes = inline_bytes
        """Packed jobs of at most this many bytes are packed on the worker and sent as one engine call."""
        self.transfer_timeout_s = transfer_timeout_s
        """Longest one ``execute`` or ``notify`` may take, waiting behind the peer's earlier calls included."""
        self.stats = TransferStats()
        self._device = device
        self._buffers: list[Buffer] = []
        self._peers: dict[str, PeerState] = {}
        self._lock = threading.Lock()
        self._staging: Buffer | None = None
        self._extents: StagingExtents | None = None
        self.staging_wait_s = 2.0
        """How long a job waits for free staging before it runs per-row (counted as a fallback)."""
        self._staging_bytes = staging_bytes
        self._gatherer = Gatherer()
        self._pool: ThreadPoolExecutor | None = None
        self._handles = 0
        self._workers = PeerWorkers(transfer_timeout_s, self._count)
        self._retiring: dict[str, PeerState] = {}
        """Disconnected peers whose worker still runs (a stuck call, then the disconnect) or that are unsettled."""
        self._winding: dict[int, PeerState] = {}
        """Every retiring peer by identity: ``_retiring`` keeps the latest per peer id, and a peer id
        that connected again may have an older state still stuck (``close`` waits for all)."""
        self._settler: threading.Thread | None = None
        """Retries, while some peer is unsettled, to make the engine let go (``_settle_later``)."""
        self._closed = False

    # ---- hooks for subclasses ----------------------------------------------------------
    def _register(self, buffer: Buffer) -> None:
        raise NotImplementedError

    def _deregister(self, buffer: Buffer) -> None:
        raise NotImplementedError

    def _connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> PeerState:
        raise NotImplementedError

    def _disconnect(self, peer: PeerState) -> None:
        raise NotImplementedError

    def _send_notification(self, peer: PeerState, data: bytes) -> bool:
        return False

    def _close_engine(self) -> None:
        raise NotImplementedError

    # ---- memory -----------------------------------------------------------------------
    def _init_staging(self) -> None:
        if self._staging_bytes > 0:
            kind = VRAM if self._device.startswith("cuda") else DRAM
            dev = int(self._device.split(":")[1]) if ":" in self._device else 0
            self._staging = allocate(self._staging_bytes, kind=kind, device=dev)
            if kind == DRAM:
                # Fault its pages in now: the first request's pack otherwise pays for them
                # (30 ms against 4-7 ms for a later 8K chunk, docs/transfer.md).
                self._staging.array.fill(0)
            self.register_memory([self._staging])
            self._extents = StagingExtents(self._staging.length)

    def allocate(self, nbytes: int, *, kind: MemoryKind = DRAM, device: int = 0) -> Buffer:
        """Allocate zeroed page-aligned memory (not yet registered; pass it to ``register_memory``)."""
        return allocate(nbytes, kind=kind, device=device)

    def register_memory(self, buffers: Sequence[Buffer]) -> None:
        """Register buffers with the engine; TRANSFER_FAILED if the engine refuses."""
        for b in buffers:
            self._register(b)
            with self._lock:
                self._buffers.append(b)

    def _local_regions(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(b.addr, b.length) for b in self._buffers]

    def _view(self, addr: int, nbytes: int) -> Any:
        """A uint8 view (numpy or torch) of registered memory at ``addr``."""
        with self._lock:
            owner = next((b for b in self._buffers
                          if b.addr <= addr and addr + nbytes <= b.addr + b.length), None)
        if owner is None or owner.array is None:
            return host_view(addr, nbytes)
        off = addr - owner.addr
        return owner.array[off:off + nbytes]

    def _kind_of(self, addr: int) -> tuple[MemoryKind, int]:
        """Memory kind and device of the registered buffer holding ``addr``."""
        with self._lock:
            for b in self._buffers:
                if b.addr <= addr < b.addr + max(b.length, 1):
                    return b.kind, b.device
        return DRAM, 0

    # ---- peers ------------------------------------------------------------------------
    def _count(self, error: BaseException | None) -> None:
        """A call on a worker completed: count a failure, and a timeout, once per call (the worker's
        deadline or the engine's own wait at the same deadline: NIXL releases the transfer there)."""
        if isinstance(error, PdprotoError):
            with self._lock:
                self.stats.failures += 1
                self.stats.timeouts += isinstance(error, DeadlineExceededError)

    def connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> None:
        """Load the peer's transport from its registration (on its worker); replaces an earlier connection."""
        self.worker(peer_id).submit(self._connect_now, peer_id, registration, what="the connect").result()

    def _connect_now(self, peer_id: str, registration: registration_pb2.KvRegistration) -> None:
        state = self._connect(peer_id, registration)
        state.regions = remote_regions(registration)
        state.worker = self.worker(peer_id)
        with self._lock:
            old = self._peers.pop(peer_id, None)
            self._peers[peer_id] = state
        if old is not None:
            self._retire(old, last=False)

    def disconnect(self, peer_id: str) -> None:
        """Forget the peer and drop its engine connection; unknown peers are ignored.

        Never waits for a stuck call: the connection is dropped on the peer's worker, after
        whatever it is running (NIXL waits for that up to ``transfer_timeout_s``, so a
        restarted decode's agent is unloaded before its new metadata arrives).
        """
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            self._retire(peer, last=True)
        else:
            self._workers.retire(peer_id)

    def drained(self, peer_id: str) -> Future[Any] | None:
        """A future done once every call queued on the peer's worker so far has returned (None: no worker).

        The worker runs one call at a time, in order, so a marker queued now finishes after all
        of them; a call the engine still holds past its deadline holds it too. A disconnected
        peer counts until its worker finished; an unknown one is quiet.
        A transfer the engine has not let go of yet (``PeerState.unsettled``) holds it too.
        """
        with self._lock:
            peer = self._peers.get(peer_id) or self._retiring.get(peer_id)
        if peer is None or peer.worker is None:
            return None
        marker: Future[Any]
        try:
            marker = peer.worker.idle()
        except PdprotoError:
            if peer.retired is None:
                # A worker takes no work once the interpreter exits, and says nothing of what runs.
                raise ShuttingDownError(f"peer {peer_id}: the process is exiting; whether an engine call for this "
                                        "peer is still running cannot be known; keep its pages until the process "
                                        "is gone", reason=Reason.SHUTTING_DOWN, metadata={"peer": peer_id}) from None
            marker = peer.retired  # retired: the queued disconnect is its worker's last call
        unsettled = self._unsettled(peer)
        return marker if unsettled is None else all_done([marker, unsettled])

    def _retire(self, peer: PeerState, *, last: bool) -> None:
        """Drop ``peer``'s engine connection on its worker; ``last``: then let the worker's thread end."""
        worker = peer.worker
        if worker is None:
            self._disconnect(peer)
            return
        try:
            call = worker.submit(self._disconnect, peer, what="the disconnect", cleanup=True)
        except PdprotoError:
            return  # already retired
        done = peer.retired = call.returned
        if last:
            self._workers.retire(peer.peer_id)
        with self._lock:
            self._retiring[peer.peer_id] = peer
            self._winding[id(peer)] = peer

        def forget(_: Future[Any]) -> None:
            unsettled = peer.unsettled
            if unsettled is not None and not unsettled.done():
                unsettled.add_done_callback(forget)  # still counted until the engine let go
                return
            with self._lock:
                self._winding.pop(id(peer), None)
                if self._retiring.get(peer.peer_id) is peer:
                    del self._retiring[peer.peer_id]

        done.add_done_callback(forget)
        if self.disconnect_waits:
            try:
                done.result(timeout=self.transfer_timeout_s + 1.0)
            except FutureTimeout:
                pass

    def notify(self, peer_id: str, room: int, payload: bytes) -> bool:
        """Send a standalone notification (NIXL); False where the backend has none."""
        peer = self._peer(peer_id)
        return self._on_peer(peer, "notification", self._send_notification, peer,
                             encode_notification(room, payload))

    def _on_peer(self, peer: PeerState, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the peer's worker (in place when already there) and wait for it or its deadline;
        refused while a transfer the engine has not let go of holds the peer."""
        if self._unsettled(peer) is not None:
            raise DeadlineExceededError(
                f"an earlier transfer to this peer ran past its deadline and the engine has not let go of it yet "
                f"(its cancel is under way; the peer is frozen or not answering); its {what}s fail until it does",
                reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": peer.peer_id, "timeout_s": self.transfer_timeout_s})
        worker = peer.worker
        assert worker is not None

        def run() -> _T:
            peer.deadline = worker.deadline  # what the engine's own waits inside the call read
            return fn(*args)

        return worker.submit(run, what=f"the {what}").result()

    # ---- execution --------------------------------------------------------------------
    def execute(self, peer_id: str, job: TransferJob) -> TransferResult:
        """Run the job layer by layer (pack the next while one is in flight); raises a ``PdprotoError``.

        The job runs on the peer's worker; a job that has not finished within
        ``transfer_timeout_s`` raises ``DeadlineExceededError`` (see the module doc).
        """
        t0 = time.perf_counter()
        validate_job(job)
        peer = self._peer(peer_id)
        return self._on_peer(peer, "transfer", self._execute, peer, job, t0)

    def _execute(self, peer: PeerState, job: TransferJob, t0: float) -> TransferResult:
        """The job itself, on the peer's worker."""
        units = job.units()
        check_bounds(job, local=self._local_regions(), remote=peer.regions)
        staging = self._staging
        want = job.pack and bool(units)
        widest = max((seg.num_rows * layer.nbytes for seg, layer in units), default=0)
        # Packing needs staging on the same side (host or device) as every source layer.
        fits = (want and staging is not None and widest <= staging.length
                and all(self._kind_of(layer.src_ptr)[0] == staging.kind for _, layer in units))
        extent = None
        total = 0
        if want and fits and self._extents is not None:
            total = sum(seg.num_rows * layer.nbytes for seg, layer in units)
            wait = max(0.0, min(self.staging_wait_s, peer.deadline - time.monotonic()))
            extent = self._extents.acquire(widest, total, wait)
            fits = extent is not None
        inline = False
        try:
            if extent is not None:
                counts, pack_s, inline = self._run_packed(peer, units, extent)
            else:
                counts, pack_s = self._run_rows(peer, units), 0.0
        finally:
            # A transfer the engine would not let go of yet may still read the extent and
            # write the peer's pages: the worker waits a little for it, then leaves it held.
            settled = self._settle(peer, time.monotonic() + self.settle_wait_s)
            if extent is not None:
                self._give_back(peer, extent, settled)
        notes = job.notifications
        notified = bool(notes) and all([self._send_notification(peer, n) for n in notes])
        nbytes = job.nbytes
        fallback = want and not fits
        ndesc = sum(counts)
        with self._lock:  # jobs for different peers finish concurrently
            self.stats.jobs += 1
            self.stats.bytes += nbytes
            self.stats.descriptors += ndesc
            self.stats.packed_jobs += int(want and fits)
            self.stats.pack_fallbacks += int(fallback)
            self.stats.inline_jobs += int(inline)
        return TransferResult(bytes=nbytes, descriptors=ndesc, seconds=time.perf_counter() - t0,
                              packed=bool(want and fits), fallback=bool(fallback),
                              pack_seconds=pack_s, notified=notified, inline=inline,
                              segment_descriptors=job.by_segment(counts))

    def held(self) -> tuple[int, int]:
        """(engine batches submitted and not yet waited out, staging bytes reserved by jobs).

        Both are 0 once every call, stuck ones included, has left the engine (and the engine
        let go of every transfer it ran).
        """
        with self._lock:
            handles = self._handles
        free = self._extents.free_bytes() if self._extents is not None else 0
        return handles, (self._extents.length - free) if self._extents is not None else 0

    # ---- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        """Disconnect peers, deregister memory and stop the engine; safe to call twice.

        Waits (at most ``transfer_timeout_s`` + 5 s) for every peer's worker, those disconnected
        earlier included; while one is still inside the engine, memory and engine stay.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            try:
                self.disconnect(peer.peer_id)
            except PdprotoError:
                pass
        self._workers.retire()  # workers of peers whose connect never completed
        # Every peer is retiring now; those a disconnect() retired earlier (all of them under
        # `pdproto serve`, whose core disconnects every peer first) may still be stuck.
        with self._lock:
            retiring = list(self._winding.values())
        if not self._workers_idle(retiring, self.transfer_timeout_s + 5.0):
            # A call is still inside the engine and may read our buffers: deregistering
            # or stopping the engine under it could crash the process. Leave both to exit.
            return
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for b in buffers:
            try:
                self._deregister(b)
            except PdprotoError:
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._close_engine()

    def _workers_idle(self, peers: list[PeerState], timeout: float) -> bool:
        """Wait up to ``timeout`` for every retired peer's worker to finish and the engine to let go of
        its transfers; False if one is still busy."""
        end = time.monotonic() + timeout
        for peer in peers:
            if peer.retired is not None:
                try:
                    peer.retired.result(timeout=max(0.0, end - time.monotonic()))
                except FutureTimeout:
                    return False
                except PdprotoError:
                    pass
            if not self._settle(peer, end):
                return False
        return True


__all__ = ["EngineExecutor", "PeerState", "rdma_present"]
