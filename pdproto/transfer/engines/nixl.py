"""NIXL executor: one ``nixl_agent`` with the UCX backend per process, DRAM or VRAM.

The peer is loaded from ``NixlEndpoint.agent_metadata``, and its identity is the agent
name NIXL reads from that metadata: it must equal the registered ``agent_name``
(otherwise the registration is refused and the agent unloaded again, unless another
peer uses it). Several peers may reach one agent; it is unloaded when the last of them
disconnects, so one peer's Deregister never cuts off another's transfers. Descriptor
lists are built from N×3 numpy arrays, because a tuple list costs 170 ms or more per
58k descriptors. Notifications, and handles NIXL will not release yet: the package README.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np

from pdproto.errors import (
    DeadlineExceededError,
    DestinationOutOfBoundsError,
    EngineUnavailableError,
    InvalidFieldError,
    PdprotoError,
    Reason,
    RequestFailedError,
    TransferError,
)
from pdproto.negotiation.reach import ADVERTISE_ENV
from pdproto.v1 import common_pb2, registration_pb2

from ._engine import EngineExecutor, PeerState, rdma_present
from ._paths import INLINE_BYTES
from ..address import interface_of
from ..base import VRAM, Buffer, Endpoint, MemoryKind, Notification, decode_notification, require_transport
from ..packing import Descs

_AGENT_LOCK = threading.Lock()
PROGRESS_DELAY_US = 1000
"""Progress-thread delay: the wrapper hard-codes 0, so an idle agent spins a core."""


def _import_api() -> Any:
    # UCX logs to stdout unless told otherwise, and reads that when its library loads.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    # nixl-cu12 imports as nixl_cu12; other builds (nixl, nixl-cu13) as nixl.
    for module in ("nixl_cu12._api", "nixl._api"):
        try:
            api = importlib.import_module(module)
        except ImportError as exc:
            error = exc
        else:
            _logs_to_stderr()
            return api
    raise EngineUnavailableError("NIXL is not installed: pip install nixl-cu12 (needs torch)",
                                 metadata={"package": "nixl-cu12", "error": error}) from error


def _logs_to_stderr() -> None:
    """Point NIXL's Python log handlers at stderr: the wrapper logs INFO lines to stdout.

    (UCX's own log goes to stderr through ``UCX_LOG_FILE``, set before the import.)

    A process whose stdout is a protocol (``pdproto serve`` prints its JSON ``listening``
    line there; the demo's child processes answer on it) must not get engine chatter in it.
    """
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)


def _skip_verbs_modules() -> None:
    """Keep UCX from loading its InfiniBand modules on a host without RDMA devices.

    nixl-cu12 bundles its own libibverbs and libnl. Its ib_efa module also pulls in the
    system libefa, which loads the system libibverbs and libnl. Two copies of libnl-route
    then crash the process at exit (SIGSEGV in ``rtnl_tc_unregister``), after every test
    has passed. With no RDMA device the modules are useless anyway. An explicit
    ``UCX_MODULES`` is left alone.
    """
    if "UCX_MODULES" not in os.environ and not rdma_present():
        os.environ["UCX_MODULES"] = "^ib,ib_efa,ib_mlx5,ib_mlx5_ext,rdmacm"


def _make_agent(api: Any, name: str, delay_us: int, net_device: str | None = None) -> Any:
    """Build a UCX agent whose progress thread sleeps ``delay_us`` between polls.

    ``net_device``, unless ``UCX_NET_DEVICES`` is set, keeps the agent's UCX context to
    that interface; UCX reads the variable when the agent creates its backend, and the
    environment is restored right after.

    ``nixl_agent.__init__`` sets ``pthrDelay = 0`` on a fresh native config. A
    config subclass turns that 0 into ``delay_us``, and it is swapped in for the
    duration of the constructor only.
    """
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    prop = base.__dict__.get("pthrDelay")

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - native field name
            """The native field."""
            return int(prop.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            """Store ``delay_us`` where the wrapper asks for 0."""
            prop.__set__(self, value or delay_us)

    class _Bind:
        nixlAgentConfig = _Config  # noqa: N815

        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

    with _AGENT_LOCK:
        _skip_verbs_modules()  # UCX reads it when the agent creates its backend
        if prop is not None and delay_us > 0:
            api.nixlBind = _Bind()
        scoped = None if "UCX_NET_DEVICES" in os.environ else net_device
        if scoped is not None:
            os.environ["UCX_NET_DEVICES"] = scoped
        try:
            # RW sync: the server runs jobs for different peers on several threads at once;
            # transfers may proceed together, metadata changes (add/remove peer) are exclusive.
            conf = api.nixl_agent_config(backends=["UCX"],
                                         sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind = bind
            if scoped is not None:
                os.environ.pop("UCX_NET_DEVICES", None)


class NixlExecutor(EngineExecutor):
    """Transfers through a NIXL agent (UCX); also receives notifications on the decode side."""

    backend = "nixl"
    # UCX's shared-memory transport (cma) copies inside postXferReq, so packing the next
    # layer is overlapped with the submit call itself.
    submit_blocks = True
    # Unloading an agent under an in-flight request frees the request inside NIXL.
    disconnect_waits = True

    def __init__(self, *, name: str | None = None, staging_bytes: int = 0, device: str = "cpu",
                 transfer_timeout_s: float = 30.0, progress_delay_us: int = PROGRESS_DELAY_US,
                 host: str | None = None, inline_bytes: int = INLINE_BYTES, **_: Any) -> None:
        """Create the agent ``name`` (a uuid when omitted) with the UCX backend.

        UCX advertises every usable interface itself. When an address is set (``host``, or
        ``PDPROTO_ADVERTISE_HOST``), UCX's network transports are kept to the interface that
        holds it (``UCX_NET_DEVICES``, unless set), for this agent only: the variable is
        set while UCX reads its configuration and restored after, so processes this one
        starts later still see every interface.
        """
        super().__init__(staging_bytes=staging_bytes, device=device, transfer_timeout_s=transfer_timeout_s,
                         inline_bytes=inline_bytes)
        advertised = host or os.environ.get(ADVERTISE_ENV, "").strip()
        device_name = interface_of(advertised) if advertised else None
        self._api = _import_api()
        self._name = name or f"pdproto-{uuid.uuid4()}"
        try:
            self._agent = _make_agent(self._api, self._name, progress_delay_us, device_name)
        except Exception as exc:  # noqa: BLE001 - the binding raises bare RuntimeErrors
            raise TransferError("NIXL agent failed to start", reason=Reason.TRANSFER_FAILED,
                                metadata={"name": self._name, "error": exc}) from exc
        self._reg: dict[int, Any] = {}
        self._agents: dict[str, set[int]] = {}
        """Loaded remote agent -> the connections (one per ``connect``) that reach it; unloaded when none is left."""
        self._agent_lock = threading.Lock()
        self._connections = 0
        self._unreleased: list[tuple[Any, PeerState]] = []
        """Transfer handles NIXL would not release yet (still cancelling), with their peer; retried later."""
        self._release_lock = threading.Lock()
        """One release pass at a time, so a peer is never called settled while another pass retries its handle."""
        self._inbox_lock = threading.Lock()
        self._init_staging()

    @staticmethod
    def _mem(kind: MemoryKind) -> str:
        return "VRAM" if kind == VRAM else "DRAM"

    def _register(self, buffer: Buffer) -> None:
        dev = buffer.device if buffer.kind == VRAM else 0
        try:
            descs = self._agent.register_memory([(buffer.addr, max(buffer.length, 1), dev, "")],
                                                self._mem(buffer.kind))
        except Exception as exc:  # noqa: BLE001
            raise TransferError("NIXL refused to register memory", reason=Reason.TRANSFER_FAILED,
                                metadata={"addr": hex(buffer.addr), "error": exc}) from exc
        self._reg[buffer.addr] = descs

    def _deregister(self, buffer: Buffer) -> None:
        descs = self._reg.pop(buffer.addr, None)
        if descs is not None:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

    def endpoint(self) -> Endpoint:
        """The ``NixlEndpoint``: agent name and metadata (call after ``register_memory``)."""
        return registration_pb2.NixlEndpoint(agent_name=self._name,
                                             agent_metadata=self._agent.get_agent_metadata())

    def _connect(self, peer_id: str, registration: registration_pb2.KvRegistration) -> PeerState:
        require_transport(registration, "nixl", "NIXL")
        with self._agent_lock:  # loading, checking and counting one agent is one step
            name = self._load_agent(peer_id, registration.nixl)
            self._connections += 1
            conn = self._connections
            self._agents.setdefault(name, set()).add(conn)
        kinds = {b.memory_kind for b in registration.kv_buffers}
        # An unset kind reads as VRAM, as legacy SGLang does.
        kind = common_pb2.MEMORY_KIND_DRAM if kinds == {common_pb2.MEMORY_KIND_DRAM} else VRAM
        state = PeerState(peer_id=peer_id, remote=name, device=registration.gpu_id)
        state.extra["mem"] = self._mem(kind)
        state.extra["conn"] = conn
        return state

    def _load_agent(self, peer_id: str, endpoint: registration_pb2.NixlEndpoint) -> str:
        """Load the peer's metadata; the agent name inside it, which must be the one registered."""
        try:
            loaded = self._agent.add_remote_agent(endpoint.agent_metadata)
        except Exception as exc:  # noqa: BLE001
            raise InvalidFieldError("registration.nixl.agent_metadata",
                                    "NIXL could not load the peer's agent metadata: a malformed blob, or no "
                                    "transport this host shares with the peer (a decode on another host whose "
                                    "UCX is kept to loopback by PDPROTO_ADVERTISE_HOST or UCX_NET_DEVICES)",
                                    metadata={"peer": peer_id, "error": exc}) from exc
        raw = loaded if isinstance(loaded, bytes) else str(loaded).encode()
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            self._unload_unless_used(raw)
            raise InvalidFieldError("registration.nixl.agent_metadata",
                                    "the agent name inside the metadata is not UTF-8",
                                    metadata={"peer": peer_id, "agent_hex": raw[:64].hex()}) from None
        if name != endpoint.agent_name:
            self._unload_unless_used(raw)
            raise InvalidFieldError("registration.nixl.agent_name",
                                    f"the metadata describes agent {name[:80]!r}, not {endpoint.agent_name[:80]!r}; "
                                    "a peer is the agent its metadata loads",
                                    metadata={"peer": peer_id, "agent_name": endpoint.agent_name[:80],
                                              "metadata_agent": name[:80]})
        return name

    def _unload_unless_used(self, agent: bytes) -> None:
        """Unload an agent a refused registration loaded, unless a connected peer reaches it (lock held)."""
        if self._agents.get(agent.decode("utf-8", "replace")):
            return
        try:
            self._agent.remove_remote_agent(agent)
        except Exception:  # noqa: BLE001 - not loaded is fine
            pass

    def _disconnect(self, peer: PeerState) -> None:
        settled = self._settle(peer, time.monotonic() + self.settle_wait_s)
        with self._agent_lock:
            holders = self._agents.get(peer.remote, set())
            holders.discard(peer.extra["conn"])
            # Unloading the agent under a transfer NIXL still holds frees it inside NIXL: leave it
            # loaded (the handle is still retried); it costs a metadata entry, not a crash.
            if holders or not settled:
                return  # another peer still reaches this agent, or NIXL still holds a transfer to it
            self._agents.pop(peer.remote, None)
            try:
                self._agent.remove_remote_agent(peer.remote)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass

    def _submit(self, peer: PeerState, descs: Descs, kind: MemoryKind, device: int) -> Any:
        n = len(descs)
        local = np.empty((n, 3), dtype=np.int64)
        local[:, 0], local[:, 1] = descs[:, 0], descs[:, 2]
        local[:, 2] = device if kind == VRAM else 0
        remote = np.empty((n, 3), dtype=np.int64)
        remote[:, 0], remote[:, 1] = descs[:, 1], descs[:, 2]
        remote[:, 2] = peer.device if peer.extra["mem"] == "VRAM" else 0
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local, self._mem(kind)),
                self._agent.get_xfer_descs(remote, peer.extra["mem"]), peer.remote)
        except Exception as exc:  # noqa: BLE001
            raise self._refused(peer, exc) from exc
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            self._release(peer, handle)
            raise RequestFailedError("NIXL could not post the transfer", reason=Reason.PEER_GONE,
                                     metadata={"peer": peer.peer_id, "error": exc}) from exc
        if state == "ERR":
            self._release(peer, handle)
            raise RequestFailedError("NIXL rejected the transfer", reason=Reason.PEER_GONE,
                                     metadata={"peer": peer.peer_id})
        return handle

    def _refused(self, peer: PeerState, exc: Exception) -> PdprotoError:
        """Why NIXL would not build a transfer: the peer's agent is gone, or the rows lie outside its memory.

        NIXL says NOT_FOUND in both cases. With the agent still loaded, the descriptors
        fall outside every region the peer registered with NIXL (its ``KvBuffer.length``
        said more, or 0): that request is refused and the peer stays connected.
        """
        if self._agent.check_remote_metadata(peer.remote):
            return DestinationOutOfBoundsError(
                "destination rows fall outside the memory the peer registered with NIXL",
                reason=Reason.DESTINATION_OUT_OF_BOUNDS, metadata={"peer": peer.peer_id, "error": exc})
        return RequestFailedError("NIXL no longer knows the peer's agent", reason=Reason.PEER_GONE,
                                  metadata={"peer": peer.peer_id, "error": exc})

    def _wait(self, peer: PeerState, handle: Any) -> None:
        deadline = peer.deadline or time.monotonic() + self.transfer_timeout_s
        spins = 0
        try:
            while True:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as exc:  # noqa: BLE001
                    raise RequestFailedError("NIXL transfer failed", reason=Reason.PEER_GONE,
                                             metadata={"peer": peer.peer_id, "error": exc}) from exc
                if state == "DONE":
                    return
                if state == "ERR":
                    # UCX reports a vanished peer (closed endpoint, dead process) as a failed request.
                    raise RequestFailedError("NIXL transfer failed; the peer is unreachable",
                                             reason=Reason.PEER_GONE, metadata={"peer": peer.peer_id})
                if time.monotonic() > deadline:
                    raise DeadlineExceededError("NIXL transfer did not complete in time",
                                                reason=Reason.DEADLINE_EXCEEDED,
                                                metadata={"peer": peer.peer_id, "timeout_s": self.transfer_timeout_s})
                spins += 1
                # Spin briefly for short transfers, then yield the core to the progress thread.
                if spins > 50:
                    time.sleep(0.0002 if spins < 2000 else 0.002)
        finally:
            self._release(peer, handle)

    def _release(self, peer: PeerState, handle: Any = None) -> None:
        """Release (and so cancel) ``handle`` and retry every handle kept earlier.

        A handle NIXL cannot release yet is kept, and its peer is unsettled until it can be.
        """
        with self._release_lock:
            with self._lock:
                pending = [*self._unreleased, *([(handle, peer)] if handle is not None else [])]
            kept = []
            for h, p in pending:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception:  # noqa: BLE001 - NIXL_ERR_REPOST_ACTIVE: the cancel is still under way
                    kept.append((h, p))
            with self._lock:
                self._unreleased = kept
            holding = {id(p) for _, p in kept}
            seen = {id(p): p for _, p in pending}
            seen.setdefault(id(peer), peer)
            for p in seen.values():
                if id(p) in holding:
                    self._hold(p)
                else:
                    self._let_go(p)

    def _settle(self, peer: PeerState, until: float) -> bool:
        """Retry the kept handles (with a growing pause) until none is ``peer``'s or ``until`` passed."""
        pause = 0.001
        while True:
            with self._lock:
                if peer.unsettled is None:
                    return True
            if self._agent is None:
                return False  # closed with the engine kept for exit: nothing to retry with
            self._release(peer)
            with self._lock:
                if peer.unsettled is None:
                    return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def held(self) -> tuple[int, int]:
        """As ``EngineExecutor.held``, counting handles NIXL has not released yet (cancels under way)."""
        handles, staging = super().held()
        with self._lock:
            return handles + len(self._unreleased), staging

    def _send_notification(self, peer: PeerState, data: bytes) -> bool:
        try:
            self._agent.send_notif(peer.remote, data)
        except Exception as exc:  # noqa: BLE001
            raise RequestFailedError("NIXL could not send the notification", reason=Reason.PEER_GONE,
                                     metadata={"peer": peer.peer_id, "error": exc}) from exc
        return True

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call, decoded (foreign frames are skipped)."""
        with self._inbox_lock:
            raw = self._agent.get_new_notifs()
        out: list[Notification] = []
        for agent, msgs in raw.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            for m in msgs:
                n = decode_notification(name, bytes(m))
                if n is not None:
                    out.append(n)
        return out

    def _close_engine(self) -> None:
        # Dropping the agent tears down UCX; its destructor releases what is left.
        self._agent = None


__all__ = ["NixlExecutor", "PROGRESS_DELAY_US"]
