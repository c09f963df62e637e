"""A pdproto decode rank pulling from an unmodified SGLang 0.5.23 Mooncake prefill: SGLang's own protocol.

A prefill rank whose bootstrap record has no ``pdproto_port`` (bootstrap.py) runs SGLang's
Mooncake backend. For a request whose prefill ranks are such ranks, the receiver keeps SGLang's
own ``CommonKVReceiver`` logic and only the frames and sockets are pdproto's: frames built by
``pdproto.legacy.mooncake`` from the same ``KVArgs`` SGLang's Mooncake decode reads, sent on this
module's PUSH sockets, and the prefill's answers read on the decode rank's own PULL socket
(``rank_port``, which ``CommonKVManager`` binds and the pdproto path leaves idle). Inventory
numbers (M1...) and lines are SGLang 0.5.23's (``sglang/srt/disaggregation/``):

========================  =======================================================================
sent: M1 registration     ``KVArgsRegisterInfo`` once per prefill rank and connection-pool key
                          (``mooncake/conn.py:3215-3279``; the prefill parses it at ``:2979-3013``);
                          its session id names the Mooncake engine holding this rank's pools
sent: M2 TransferInfo     per request and prefill rank, dummies as SGLang marks them
                          (``mooncake/conn.py:3281-3308``; parsed ``:3014-3034``)
sent: M4 ABORT            on abort or timeout, with the return address and the deferred-release
                          generation (``common/conn.py:223-234, 2977-3012``)
followed: M3 status       ``[room, KVPoll, prefill_rank]`` (``common/conn.py:739-808``): Success
                          is counted per prefill rank by SGLang's ``apply_prefill_status``
                          (``:921-977``); Failed fails the room (Mooncake sends no reason)
followed: M5 ABORT_ACK    counted for SGLang's deferred page release (``common/conn.py:997-1013``;
                          the 2-frame legacy ack, ``mooncake/conn.py:2943-2947``, is ignored as
                          SGLang ignores it)
followed: M11 AUX_DATA    aux rows sent over TCP (``SGLANG_MOONCAKE_SEND_AUX_TCP``, NVLink pools;
                          ``mooncake/conn.py:1830-1871``), written after a bounds check
========================  =======================================================================

A prefill rank that goes away is noticed on its PUSH socket: ZMQ reports the TCP connection
closed (or never made), and after ``LOST_AFTER_S`` without a reconnect (``CONNECT_WITHIN_S`` for a
socket that never connected) the requests in flight
to it fail with ``PEER_GONE``; SGLang's own decode would wait for its heartbeat or timeouts.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdproto import legacy
from pdproto.errors import DestinationOutOfBoundsError, PdprotoError, Reason, TopologyError
from pdproto.legacy import LegacyBackend, LegacyKind, mooncake
from pdproto.v1 import (
    AbortAck,
    AbortNotification,
    AuxData,
    Endpoint,
    KvRegistration,
    MooncakeEndpoint,
    TransferInfo,
    TransferStatus,
)

from . import layout

log = logging.getLogger(__name__)

LOST_AFTER_S = 1.0
"""How long a prefill rank's dropped connection may stay down before its requests fail."""
CONNECT_WITHIN_S = 5.0
"""How long a new socket may take to connect before its prefill rank counts as gone: longer, as a
busy host may schedule the connect late, while a drop means the peer closed its end."""
_MONITORS = itertools.count()  # names every monitor apart (LegacyPrefills.socket)
PROTOCOL = "sglang-mooncake"
"""How ``PdprotoKVManager.peer_protocols`` names a prefill rank that speaks SGLang's Mooncake protocol."""


def rank_endpoint(info: Mapping[str, Any]) -> str:
    """``tcp://host:port`` of the rank a ``/route`` record names (SGLang's ``NetworkAddress.to_tcp``)."""
    return "tcp://" + layout.host_port(str(info["rank_ip"]), int(info["rank_port"]))


def session_id(endpoint: object, engine: str) -> str:
    """The session id M1 and M2 carry: the Mooncake engine holding this rank's pools, which SGLang's
    Mooncake prefill writes into; ``TopologyError`` when the pools are in another engine (``engine``)."""
    if not isinstance(endpoint, MooncakeEndpoint):
        raise TopologyError(
            f"the prefill runs SGLang's own Mooncake backend, which writes only into a Mooncake engine, and this "
            f"decode's pools are in a {engine} engine: run this decode with PDPROTO_ENGINE=mooncake, or the prefill "
            "with --disaggregation-transfer-backend pdproto", reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
            metadata={"engine": engine})
    return endpoint.session_id


def registration(kv_args: Any, *, host: str, port: int, session_id: str, attn_tp_size: int,
                 dcp: tuple[int, int]) -> KvRegistration:
    """M1 as a message: what SGLang's Mooncake decode sends for ``kv_args`` (mooncake/conn.py:3215-3279)."""
    lens = [int(n) for n in kv_args.kv_item_lens]
    msg = KvRegistration(kv_item_len=lens[0] if lens else 0,
                         notify_endpoint=Endpoint(host=host, port=port),
                         aux_ptrs=[int(p) for p in kv_args.aux_data_ptrs])
    msg.mooncake.session_id = session_id
    msg.attn_tp.rank, msg.attn_tp.size = int(kv_args.engine_rank), attn_tp_size
    ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    for i, (ptr, item_len) in enumerate(zip(kv_args.kv_data_ptrs, lens, strict=True)):
        entry = msg.kv_buffers.add(ptr=int(ptr), item_len=item_len)
        if ids:
            entry.layer_id = int(ids[i])
    columns = {s.slot: list(getattr(kv_args, s.name.removeprefix("dst_"), None) or []) for s in mooncake.STATE_SLOTS}
    count = max(len(c) for c in columns.values())
    states = [msg.state_buffers.add() for _ in range(count)]
    for s in mooncake.STATE_SLOTS:
        if len(columns[s.slot]) < count:  # SGLang packs each list as it is: keep the shorter ones short
            msg.legacy.list_lengths[s.slot] = len(columns[s.slot])
        for state, values in zip(states, columns[s.slot]):
            getattr(state, s.attr).extend(int(v) for v in values)
    msg.dcp.size, msg.dcp.rank = dcp
    return msg


def transfer_info(*, room: int, host: str, port: int, session_id: str, required_dst_info_num: int,
                  kv_indices: Any, aux_index: int | None, state_indices: Sequence[Any] | None,
                  decode_prefix_len: int | None, is_dummy: bool, device_kv_indices: Any = None) -> TransferInfo:
    """M2 as a message: what SGLang's Mooncake decode sends to one prefill rank (mooncake/conn.py:3281-3308)."""
    msg = TransferInfo(room=room, peer_name=session_id, notify_endpoint=Endpoint(host=host, port=port),
                       required_dst_info_num=required_dst_info_num, decode_prefix_len=int(decode_prefix_len or 0),
                       is_dummy=is_dummy)
    if is_dummy:  # two empty slots, no state (SGLang's sentinel)
        return msg
    msg.dst_kv_pages.extend(np.asarray(kv_indices).reshape(-1).tolist())
    if aux_index is not None:  # unset, build_transfer_info refuses it: SGLang would send "None"
        msg.dst_aux_index = int(aux_index)
    for s in state_indices or ():
        msg.dst_state_indices.add(indices=[] if s is None else np.asarray(s).reshape(-1).tolist())
    if device_kv_indices is not None:
        msg.dst_device_kv_pages.pages.extend(np.asarray(device_kv_indices).reshape(-1).tolist())
    return msg


def abort(*, room: int, host: str, port: int, generation: int | None) -> AbortNotification:
    """M4 as a message: SGLang's ``AbortNotification`` with the return address (common/conn.py:223-234)."""
    msg = AbortNotification(room=room, reply_endpoint=Endpoint(host=host, port=port))
    if generation is not None:
        msg.generation = generation
    return msg


@dataclass
class _Rank:
    """One prefill rank's PUSH socket and what its monitor said."""

    socket: zmq.Socket[bytes]
    lock: threading.Lock
    monitor: zmq.Socket[bytes]
    down_since: float | None
    """When the connection went down (or the socket was made); None while connected."""
    grace: float
    """How long it may stay down: ``CONNECT_WITHIN_S`` until it first connects, then ``LOST_AFTER_S``."""

    def close(self) -> None:
        # The monitor stops first: closing a monitored socket whose monitor still holds events
        # can wedge the context's I/O thread (libzmq), and no later socket would connect.
        with self.lock:
            self.socket.disable_monitor()
            self.socket.close(linger=0)
        self.monitor.close(linger=0)


class LegacyPrefills:
    """A decode rank's sockets to SGLang Mooncake prefill ranks, and the listener for their answers."""

    def __init__(self, pull: zmq.Socket[bytes], *, aux: Sequence[tuple[int, int, int]],
                 on_status: Callable[[TransferStatus], None], on_ack: Callable[[AbortAck], None],
                 on_lost: Callable[[str, set[int]], None], send_timeout_s: float,
                 lost_after_s: float = LOST_AFTER_S, connect_within_s: float = CONNECT_WITHIN_S) -> None:
        self._pull = pull
        self._aux = list(aux)
        """(address, bytes, bytes per row) of every aux buffer, in KVArgs order."""
        self._on_status, self._on_ack, self._on_lost = on_status, on_ack, on_lost
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._lost_after_s, self._connect_within_s = lost_after_s, connect_within_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        self._ranks: dict[str, _Rank] = {}
        self._new: list[str] = []
        """Ranks whose monitors the listener has not polled yet."""
        self._rooms: dict[int, set[str]] = {}
        """Room -> the prefill ranks holding its TransferInfo."""
        self.seen: dict[str, str] = {}
        """Every prefill rank this decode spoke SGLang's protocol to -> its bootstrap server."""
        self.counts = {"statuses": 0, "aux_rows": 0, "malformed": 0, "lost": 0}
        """What the listener handled: statuses followed, aux rows written, frame lists dropped, ranks lost."""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, endpoint: str, bootstrap_addr: str) -> None:
        """Record the per-peer decision for ``endpoint``; logged once per prefill rank."""
        with self._lock:
            if endpoint in self.seen:
                return
            self.seen[endpoint] = bootstrap_addr
        log.info("pdproto: prefill rank %s (bootstrap %s) publishes no pdproto_port: it runs SGLang's own "
                 "Mooncake backend; this decode speaks SGLang's Mooncake protocol to it", endpoint, bootstrap_addr)

    def socket(self, endpoint: str) -> tuple[zmq.Socket[bytes], threading.Lock]:
        """The PUSH socket to one prefill rank (``tcp://host:port``), made and watched on first use."""
        with self._lock:
            rank = self._ranks.get(endpoint)
            if rank is None:
                sock = self._ctx.socket(zmq.PUSH)
                if endpoint.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)  # SGLang's receiver options (common/conn.py:2738)
                # A name of its own: pyzmq's default names the socket's fd, which a closed socket's
                # monitor may still hold, and the new monitor would then hear nothing.
                monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED,
                                                  addr=f"inproc://pdproto-legacy-decode-{next(_MONITORS)}")
                sock.connect(endpoint)
                rank = self._ranks[endpoint] = _Rank(sock, threading.Lock(), monitor, time.monotonic(),
                                                     self._connect_within_s)
                self._new.append(endpoint)
            if self._thread is None:
                self._thread = threading.Thread(target=self._listen, name="pdproto-legacy-decode", daemon=True)
                self._thread.start()
            return rank.socket, rank.lock

    def track(self, room: int, endpoints: Sequence[str]) -> None:
        """``room``'s TransferInfo went to ``endpoints``: it fails if one of them is lost."""
        with self._lock:
            self._rooms[room] = set(endpoints)

    def forget(self, room: int) -> None:
        """``room`` is cleared."""
        with self._lock:
            self._rooms.pop(room, None)

    def connected(self, endpoint: str) -> bool:
        """Whether the socket to ``endpoint`` is up now."""
        with self._lock:
            rank = self._ranks.get(endpoint)
            return rank is not None and rank.down_since is None

    # -- listener thread -----------------------------------------------------------------

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        monitors: dict[zmq.Socket[bytes], str] = {}
        while not self._stopped.is_set():
            with self._lock:
                for endpoint in self._new:
                    monitors[self._ranks[endpoint].monitor] = endpoint
                    poller.register(self._ranks[endpoint].monitor, zmq.POLLIN)
                self._new.clear()
            ready = dict(poller.poll(100))
            if self._pull in ready:
                self._drain()
            for monitor, endpoint in list(monitors.items()):
                if monitor in ready:
                    self._monitor_event(endpoint, recv_monitor_message(monitor)["event"])
            for endpoint in self._overdue():
                monitor = self._ranks[endpoint].monitor
                poller.unregister(monitor)
                del monitors[monitor]
                self._drop(endpoint)

    def _drain(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._dispatch(frames)
            except PdprotoError as exc:  # the port is unauthenticated: bad input is dropped, never fatal
                self.counts["malformed"] += 1
                log.warning("pdproto: dropped a frame list on the decode's rank port: %s", exc)
            except Exception:  # noqa: BLE001 - one message must not end the listener of every room
                log.exception("pdproto: handling an SGLang message on the decode's rank port failed")

    def _dispatch(self, frames: list[bytes]) -> None:
        found, result = legacy.parse_any(frames, LegacyBackend.MOONCAKE)
        message = result.message
        if found.kind is LegacyKind.STATUS and isinstance(message, TransferStatus):
            self.counts["statuses"] += 1
            self._on_status(message)
        elif found.kind is LegacyKind.ABORT_ACK and isinstance(message, AbortAck):
            self._on_ack(message)
        elif found.kind is LegacyKind.AUX_DATA and isinstance(message, AuxData):
            self._write_aux(message)
        else:  # staging messages: this decode registers no staging region, so none is meant for it
            self.counts["malformed"] += 1
            log.warning("pdproto: ignored an SGLang %s message on the decode's rank port", found.kind.value)

    def _write_aux(self, msg: AuxData) -> None:
        """One aux row the prefill sent over TCP (``_handle_aux_data``), within its buffer only."""
        ptr, length, row = self._aux[msg.buffer_index] if msg.buffer_index < len(self._aux) else (0, 0, 0)
        start = row * msg.aux_index
        if len(msg.data) > row or start + len(msg.data) > length:
            raise DestinationOutOfBoundsError(
                f"AUX_DATA of {len(msg.data)} bytes for row {msg.aux_index} of aux buffer {msg.buffer_index} falls "
                f"outside it (this decode has {len(self._aux)} aux buffers)",
                metadata={"bufferIndex": msg.buffer_index, "auxIndex": msg.aux_index, "bytes": len(msg.data)})
        ctypes.memmove(ptr + start, msg.data, len(msg.data))
        self.counts["aux_rows"] += 1

    def _monitor_event(self, endpoint: str, event: int) -> None:
        with self._lock:
            rank = self._ranks.get(endpoint)
            if rank is None:
                return
            if event == zmq.EVENT_CONNECTED:
                rank.down_since, rank.grace = None, self._lost_after_s
            elif event == zmq.EVENT_DISCONNECTED and rank.down_since is None:
                rank.down_since = time.monotonic()

    def _overdue(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [e for e, r in self._ranks.items() if r.down_since is not None and now - r.down_since > r.grace]

    def _drop(self, endpoint: str) -> None:
        """Close a lost rank's socket (a later request opens a new one) and fail its rooms."""
        with self._lock:
            rank = self._ranks.pop(endpoint)
            rooms = {room for room, ends in self._rooms.items() if endpoint in ends}
        rank.close()
        self.counts["lost"] += 1
        self._on_lost(endpoint, rooms)

    def close(self) -> None:
        """Stop the listener and close every socket (the manager closes)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
        for rank in ranks:
            rank.close()
        self._ctx.destroy(linger=0)


__all__ = ["CONNECT_WITHIN_S", "LOST_AFTER_S", "PROTOCOL", "LegacyPrefills", "abort", "rank_endpoint", "registration", "session_id",
           "transfer_info"]
