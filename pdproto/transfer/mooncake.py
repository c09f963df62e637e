"""Mooncake executor: ``mooncake.engine.TransferEngine`` in P2P handshake mode (TCP or RDMA).

Writes go out as async batches of at most ``max_batch`` descriptors, and
``get_batch_transfer_status`` waits on them. (``transfer_check_status`` looks
only at a batch's first descriptor, so it cannot tell that a batch is done.)
A stock TCP transport fails a batch of 4,096 descriptors with "lane
queue-full". So batches stay at 2,048, and at most that many descriptors are
queued per job.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from pdproto.errors import (
    EngineUnavailableError,
    InvalidFieldError,
    PdprotoError,
    Reason,
    TopologyError,
    TransferError,
    error_for,
)
from pdproto.v1 import registration_pb2

from ._engine import EngineExecutor, PeerState, rdma_present
from .base import VRAM, Buffer, Endpoint, MemoryKind
from .packing import Descs

_INIT_LOCK = threading.Lock()


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
    max_batch = 2048

    def __init__(self, *, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 staging_bytes: int = 0, device: str = "cpu",
                 transfer_timeout_s: float | None = None, **_: Any) -> None:
        """Start the engine on ``host`` with ``protocol`` ("tcp", "rdma" or "auto") and P2P handshakes."""
        super().__init__(staging_bytes=staging_bytes, device=device)
        engine_cls = _import_engine()
        if protocol == "auto":
            protocol = "rdma" if rdma_present() else "tcp"
        if transfer_timeout_s is not None:
            # The engine reads its per-transfer timeout from the environment at start-up.
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, int(transfer_timeout_s)))
        with _INIT_LOCK:
            self._engine = engine_cls()
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
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
        if registration.WhichOneof("transport") != "mooncake":
            raise TopologyError("registration carries no Mooncake endpoint",
                                reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
                                metadata={"transport": registration.WhichOneof("transport")})
        session = registration.mooncake.session_id
        if not session or ":" not in session:
            raise InvalidFieldError("registration.mooncake.session_id", "bad Mooncake session id",
                                    metadata={"session_id": session})
        return PeerState(peer_id=peer_id, remote=session, regions=[])

    def _disconnect(self, peer: PeerState) -> None:
        # The engine pools endpoints itself and has no per-session teardown call.
        return None

    def _submit(self, peer: PeerState, descs: Descs, kind: MemoryKind, device: int) -> Any:
        bid = self._engine.batch_transfer_async_write(
            peer.remote, descs[:, 0].tolist(), descs[:, 1].tolist(), descs[:, 2].tolist())
        if bid is None or bid <= 0:
            raise self._failure(peer, "Mooncake refused the batch", bid)
        return bid

    def _wait(self, peer: PeerState, handle: Any) -> None:
        rc = self._engine.get_batch_transfer_status([handle])
        if rc != 0:
            raise self._failure(peer, "Mooncake batch failed", rc)

    def _failure(self, peer: PeerState, message: str, rc: object) -> PdprotoError:
        """Map a bare engine rc to a reason: PEER_GONE when the peer no longer answers a probe."""
        try:
            alive = self._engine.send_probe(peer.remote) == 0
        except Exception:  # noqa: BLE001 - a probe that raises means the same as one that fails
            alive = False
        reason = Reason.TRANSFER_FAILED if alive else Reason.PEER_GONE
        return error_for(reason, message if alive else f"{message}: peer unreachable",
                         metadata={"peer": peer.peer_id, "session_id": peer.remote, "rc": rc})

    def _max_inflight_descs(self) -> int:
        return self.max_batch

    def _close_engine(self) -> None:
        # Dropping the last reference stops the engine's threads and closes its sockets.
        self._engine = None


__all__ = ["MooncakeExecutor", "rdma_present"]
