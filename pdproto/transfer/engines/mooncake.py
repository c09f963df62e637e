"""Mooncake executor: ``mooncake.engine.TransferEngine`` in P2P handshake mode (TCP or RDMA).

Writes go out as async batches. A stock TCP transport fails a batch of 4,096 descriptors
with "lane queue-full" (and 2,100 at times), so at most ``QUEUE_DESCS`` (2,048) descriptors,
sentinels (below) included, are queued per job.

Mooncake's one wait that covers a whole batch, ``get_batch_transfer_status``, spins a core
until the batch is done; on a host with few cores that spin takes the CPU the engine's own
threads (and, on one host, the decode's) need, and a batch of scattered pages took twice
as long. ``transfer_check_status`` does not spin, but it looks only at a batch's first
descriptor (and frees the batch once that one is done). So each batch of ``SENTINEL_FROM``
bytes or more is followed by a *sentinel*: a batch of one descriptor that writes the first bytes of the batch's last
descriptor again (the same source bytes to the same place, so the write changes nothing).
The wait sleeps between checks of the sentinel, which the engine finishes after the batch
in practice, and then asks ``get_batch_transfer_status``, which alone says whether the
batch is done: if the sentinel ever finishes first, that call spins for the rest, and no
byte is reported before it landed.

Mooncake's calls block in native code for as long as a peer does not answer: a
frozen decode holds a batch until the TCP transport's progress timeout (30 s by
default) and then a probe for up to 60 s more; a session that accepts connections
and never answers holds the first submit, under a lock every other peer's submit
needs, for 60 s. So the executor (1) runs every call on the peer's own worker with a
deadline (``_engine.py``), (2) starts the engine with its progress and transfer
timeouts set to ``transfer_timeout_s`` (``MC_TCP_PROGRESS_TIMEOUT_SEC``,
``MC_TRANSFER_TIMEOUT``, and the TCP lanes' admission wait ``MC_TCP_ADMISSION_TIMEOUT_MS``;
an operator's own values win), so a stuck call ends soon after its deadline and a slow
one, on a loaded host, is not failed before it, and (3) probes a session and fetches its segment descriptor before
accepting it (``connect``), on a helper thread it waits for at most
``connect_timeout_s`` and off the engine's shared lock: a black-holed session is
refused at registration, and a peer that stops answering later stalls only its own
worker (measured: with the descriptor fetched at connect, a second peer's transfer took
4 ms while the first, frozen, held its own; without it, the second peer timed out too).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from typing import Any

from pdproto.errors import (
    DeadlineExceededError,
    EngineUnavailableError,
    InvalidFieldError,
    PdprotoError,
    Reason,
    RequestFailedError,
    TransferError,
    UnavailableError,
    error_for,
)
from pdproto.v1 import registration_pb2

from ._engine import EngineExecutor, PeerState, rdma_present
from ._paths import INLINE_BYTES
from ..address import advertise_host
from ..base import VRAM, Buffer, Endpoint, MemoryKind, require_transport
from ..packing import Descs

log = logging.getLogger(__name__)
_INIT_LOCK = threading.Lock()
INIT_TRIES = 4
"""Engine starts tried when the port it drew is taken (each draws a new one)."""
MAX_PENDING_PROBES = 16
"""Probes that may wait on silent sessions at once; past that, registrations are refused at once."""
QUEUE_DESCS = 2048
"""Most descriptors, sentinels included, a job queues in the engine at once."""
SENTINEL_BYTES = 4096
"""Most bytes a batch's sentinel writes again."""
SENTINEL_FROM = 1 << 20
"""Batches this large get a sentinel; a smaller one is done sooner than a sleep between checks."""
CHECK_S = 0.0005
"""Sleep between checks of a sentinel."""


def _gets_sentinel(descs: Descs) -> bool:
    """Whether a batch of ``descs`` is followed by a sentinel (``SENTINEL_FROM`` bytes or more)."""
    return int(descs[:, 2].sum()) >= SENTINEL_FROM


class Probe(enum.Enum):
    """What a probe of a session found."""

    ANSWERED = "answered"
    """The session answered (and, when asked, handed over its segment)."""
    REFUSED = "refused"
    """The session definitely does not answer: the probe failed (refused, reset, no engine)."""
    SILENT = "silent"
    """No answer within the time given: frozen, black-holed or slow. Unknown, not gone."""
    BUSY = "busy"
    """Not probed: ``MAX_PENDING_PROBES`` probes still wait on silent sessions. Unknown, not gone."""


def _import_engine() -> Any:
    # Mooncake logs every completed batch at INFO (hundreds of lines per request) and
    # reads the level when its library loads; keep warnings unless the operator chose.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise EngineUnavailableError(
            "Mooncake is not installed: pip install mooncake-transfer-engine-non-cuda (CPU, needs "
            "Debian libibverbs1) or mooncake-transfer-engine (CUDA)",
            metadata={"package": "mooncake-transfer-engine", "error": exc}) from exc
    return TransferEngine


class MooncakeExecutor(EngineExecutor):
    """Transfers through one Mooncake ``TransferEngine`` (one per process is the norm)."""

    backend = "mooncake"
    max_batch = QUEUE_DESCS - 1  # and its sentinel

    def __init__(self, *, host: str | None = None, protocol: str = "tcp", device_name: str = "",
                 staging_bytes: int = 0, device: str = "cpu", transfer_timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, engine: Any = None, session_id: str = "",
                 inline_bytes: int = INLINE_BYTES, **_: Any) -> None:
        """Start the engine on ``host`` with ``protocol`` ("tcp", "rdma" or "auto") and P2P handshakes.

        ``host`` is the address the session id advertises; by default ``address.advertise_host()``
        (``PDPROTO_ADVERTISE_HOST``, else a routable address of this host, not 127.0.0.1).
        ``transfer_timeout_s`` bounds every ``execute``; ``connect_timeout_s`` bounds the
        probe of a new peer's session in ``connect``.

        ``engine`` adopts a ``mooncake.engine.TransferEngine`` that something else in the
        process already initialized (an inference engine's shared one), so the process runs
        one engine, not two; ``session_id`` is its "host:rpc_port". Its transport timeouts are
        its owner's (the deadlines here still bound every call), and ``close`` leaves it
        running for its owner.
        """
        host = host or advertise_host()
        super().__init__(staging_bytes=staging_bytes, device=device, transfer_timeout_s=transfer_timeout_s,
                         inline_bytes=inline_bytes)
        self.connect_timeout_s = connect_timeout_s
        self._probing = 0
        self.adopted = engine is not None
        """The engine belongs to someone else in this process (``engine`` was given)."""
        if engine is not None:
            if not session_id or ":" not in session_id:
                raise InvalidFieldError("session_id", "an adopted Mooncake engine needs its session id (host:port)",
                                        metadata={"session_id": session_id})
            self._engine = engine
            self._session = session_id
            self._init_staging()
            return
        engine_cls = _import_engine()
        if protocol == "auto":
            protocol = "rdma" if rdma_present() else "tcp"
        # The engine reads these once, when it starts; the first executor of a process sets them.
        seconds = max(1, math.ceil(transfer_timeout_s))
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(seconds))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(seconds))
        # A slice waits for admission to a peer's TCP lanes; past this the engine fails its whole
        # batch, and the peer's queue then stays full, failing its next batches too. On a loaded
        # host a 2,048-descriptor batch waits longer than the engine's default: only our deadline
        # should end it.
        os.environ.setdefault("MC_TCP_ADMISSION_TIMEOUT_MS", str(seconds * 1000))
        with _INIT_LOCK:
            for attempt in range(INIT_TRIES):
                self._engine = engine_cls()
                try:
                    rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
                    break
                except RuntimeError as exc:
                    # The engine draws its RPC port at random and its TCP transport then binds the port after
                    # it (Mooncake issue 601): another engine on this host may hold that one. A new engine
                    # draws again.
                    if "Address already in use" not in str(exc) or attempt == INIT_TRIES - 1:
                        raise TransferError("Mooncake engine failed to initialize", reason=Reason.TRANSFER_FAILED,
                                            metadata={"host": host, "protocol": protocol, "tries": attempt + 1,
                                                      "error": exc}) from exc
                    log.warning("Mooncake engine could not bind its port (%s); starting it again", exc)
        if rc != 0:
            raise TransferError("Mooncake engine failed to initialize", reason=Reason.TRANSFER_FAILED,
                                metadata={"rc": rc, "host": host, "protocol": protocol})
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._init_staging()

    def _register(self, buffer: Buffer) -> None:
        # "*" lets the engine find the NUMA node or GPU that holds the memory (for NIC choice);
        # VRAM names its device, since only the CUDA build can probe device pointers.
        location = f"cuda:{buffer.device}" if buffer.kind == VRAM else "*"
        rc = self._engine.register_memory(buffer.addr, max(buffer.length, 1), location)
        if rc != 0:
            raise TransferError("Mooncake refused to register memory", reason=Reason.TRANSFER_FAILED,
                                metadata={"rc": rc, "addr": hex(buffer.addr), "length": buffer.length})

    def _deregister(self, buffer: Buffer) -> None:
        self._engine.unregister_memory(buffer.addr)

    def endpoint(self) -> Endpoint:
        """The ``MooncakeEndpoint`` (session id "host:rpc_port") of this engine."""
        return registration_pb2.MooncakeEndpoint(session_id=self._session)

    def _connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> PeerState:
        require_transport(registration, "mooncake", "Mooncake")
        session = registration.mooncake.session_id
        if not session or ":" not in session:
            raise InvalidFieldError("registration.mooncake.session_id", "bad Mooncake session id",
                                    metadata={"session_id": session})
        # Probe the session, then fetch its segment descriptor: the engine's first submit
        # would fetch it under a lock every peer's submit takes, and block them all while
        # a silent session does not answer. Fetched here, off that lock and bounded.
        answered = self._probe(session, self.connect_timeout_s, warm=True)
        if answered is Probe.BUSY:
            raise UnavailableError(
                f"the decode's Mooncake session {session} was not probed: {MAX_PENDING_PROBES} earlier probes "
                "are still waiting on sessions that do not answer (each gives up within about a minute); "
                "retry the registration later", reason=Reason.UNAVAILABLE,
                metadata={"peer": peer_id, "session_id": session, "pending_probes": MAX_PENDING_PROBES})
        if answered is Probe.SILENT:
            raise DeadlineExceededError(
                f"the decode's Mooncake session {session} did not complete a handshake within "
                f"{self.connect_timeout_s:g} s (frozen, or not a Mooncake engine)",
                reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": peer_id, "session_id": session})
        if answered is Probe.REFUSED:
            raise RequestFailedError(f"the decode's Mooncake session {session} does not answer its handshake port",
                                     reason=Reason.PEER_GONE, metadata={"peer": peer_id, "session_id": session})
        return PeerState(peer_id=peer_id, remote=session)

    def _probe(self, session: str, timeout: float, *, warm: bool = False) -> Probe:
        """Whether ``session`` answers Mooncake's probe (and, with ``warm``, hands over its segment).

        SILENT if it did not within ``timeout``. Both calls block in native code for up to
        a minute on a silent session, so they run on a daemon thread of their own; at most
        ``MAX_PENDING_PROBES`` may be waiting at once (past that, BUSY at once).
        """
        with self._lock:
            if self._probing >= MAX_PENDING_PROBES:
                return Probe.BUSY
            self._probing += 1
        result: list[bool] = []

        def probe() -> None:
            try:
                ok = self._engine.send_probe(session) == 0
                # A live engine has registered memory, so its first buffer is not at 0.
                result.append(ok and (not warm or self._engine.get_first_buffer_address(session) != 0))
            except Exception:  # noqa: BLE001 - a probe that raises means the same as one that fails
                result.append(False)
            finally:
                with self._lock:
                    self._probing -= 1

        thread = threading.Thread(target=probe, name="pdproto-mooncake-probe", daemon=True)
        thread.start()
        thread.join(max(0.0, timeout))
        if not result:
            return Probe.SILENT
        return Probe.ANSWERED if result[0] else Probe.REFUSED

    def _disconnect(self, peer: PeerState) -> None:
        # The engine pools endpoints itself and has no per-session teardown call.
        return None

    def _submit(self, peer: PeerState, descs: Descs, kind: MemoryKind, device: int) -> Any:
        bid = self._engine.batch_transfer_async_write(peer.remote, descs[:, 0].tolist(), descs[:, 1].tolist(),
                                                      descs[:, 2].tolist())
        if bid is None or bid <= 0:
            raise self._failure(peer, "Mooncake refused the batch", bid)
        if not _gets_sentinel(descs):
            return bid, None
        src, dst, size = (int(v) for v in descs[-1])
        sentinel = self._engine.batch_transfer_async_write(peer.remote, [src], [dst], [min(size, SENTINEL_BYTES)])
        return bid, sentinel if sentinel and sentinel > 0 else None

    def _wait(self, peer: PeerState, handle: Any) -> None:
        bid, sentinel = handle
        batches = [bid]
        if sentinel is not None:
            # 1: done and freed by the check; -1: failed and freed; -2: timed out, still held.
            while (state := self._engine.transfer_check_status(sentinel)) == 0 and time.monotonic() < peer.deadline:
                time.sleep(CHECK_S)
            if state not in (1, -1):
                batches.append(sentinel)  # so that the wait below frees it
        rc = self._engine.get_batch_transfer_status(batches)
        if rc != 0:
            raise self._failure(peer, "Mooncake batch failed", rc)

    def _failure(self, peer: PeerState, message: str, rc: object) -> PdprotoError:
        """Map a bare engine rc to a reason: PEER_GONE only when a probe says the peer does not answer.

        A probe that could not say (no answer in the time left, or too many probes pending)
        gives TRANSFER_FAILED: the peer stays connected, since the server writes off a peer
        for PEER_GONE.
        """
        found = self._probe(peer.remote, min(self.connect_timeout_s, peer.deadline - time.monotonic()))
        metadata = {"peer": peer.peer_id, "session_id": peer.remote, "rc": rc, "probe": found.value}
        if found is Probe.REFUSED:
            return error_for(Reason.PEER_GONE, f"{message}: peer unreachable", metadata=metadata)
        return error_for(Reason.TRANSFER_FAILED, message, metadata=metadata)

    def _max_inflight_descs(self) -> int:
        return self.max_batch + 1  # a full batch and its sentinel

    def _queued(self, descs: Descs) -> int:
        return len(descs) + int(_gets_sentinel(descs))

    def _close_engine(self) -> None:
        # Dropping the last reference stops the engine's threads and closes its sockets; an
        # adopted engine keeps running, its owner holds another reference.
        self._engine = None


__all__ = ["MAX_PENDING_PROBES", "MooncakeExecutor", "Probe", "rdma_present"]
