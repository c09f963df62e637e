"""The legacy listener: unmodified SGLang 0.5.23 decodes, served by the same core as gRPC peers.

What it serves, sends and refuses: docs/migration.md, "Mixed fleets". One thread per prefill
rank reads the frames from a ZMQ PULL socket and parses them with ``pdproto.legacy`` (a NIXL
guard frame tells the layouts apart); the ``HandshakeCore`` does the rest on its loop, as for a
gRPC peer. Nothing here negotiates or moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import zmq

from pdproto.errors import DuplicateRequestError, NotFoundError, PdprotoError, Reason, error_for
from pdproto.legacy import LegacyBackend, LegacyKind, classify, mooncake, nixl, parse_any
from pdproto.negotiation.topology import legacy_defaults
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, transfer_pb2

from .core import HandshakeCore
from .engine import TERMINAL
from .registry import Peer, identity_of

log = logging.getLogger("pdproto_server.legacy")

PROTOCOL = "sglang-{}"
"""``Peer.protocol`` (and ``PeerView.protocol``) of a decode that speaks SGLang's frames, by layout."""
MAX_FRAME_BYTES = 16 << 20
"""ZMQ drops a larger frame before anything reads it (a 128K-token page list at page size 1 is 512 KiB)."""
MAX_BACKLOG = 4096
"""Messages parsed and not yet handled on the loop, and statuses not yet sent; more are dropped (logged)."""
MAX_KEPT = 1 << 16
"""Decode endpoints and room claims remembered; the oldest go first."""
OFF = ("CONFIG_INVALID: this pdproto prefill rank does not serve SGLang's own decodes; turn its "
       "legacy listener on (PDPROTO_LEGACY=1, or pdproto serve --legacy-port), or run the decode "
       "with --disaggregation-transfer-backend pdproto")
_REASON = 3  # the status frame SGLang's decode reads a failure reason from

Endpoint = tuple[str, int]
Codec = ModuleType
"""``pdproto.legacy.mooncake`` or ``pdproto.legacy.nixl``: the frame layout a decode speaks."""


def _url(host: str, port: int | None = None) -> str:
    """tcp://host[:port], an IPv6 host in brackets (the sockets set zmq.IPV6, which takes both families)."""
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}" if port is None else f"tcp://{host}:{port}"


def _trim(kept: OrderedDict[Any, Any]) -> None:
    while len(kept) > MAX_KEPT:
        kept.popitem(last=False)


class _Decode:
    """One legacy decode rank (by notify endpoint): its registration's outcome, then its peer's statuses."""

    def __init__(self, listener: LegacyListener, endpoint: Endpoint, codec: Codec) -> None:
        self.listener = listener
        self.endpoint = endpoint
        self.codec = codec
        """The decode's frame layout (``pdproto.legacy.mooncake`` or ``nixl``)."""
        self.peer: asyncio.Future[Peer] = asyncio.get_running_loop().create_future()
        self.silent: set[int] = set()
        """Rooms whose end the decode is not told: dummies (SGLang's prefill tells only real destinations)."""
        self.told: OrderedDict[int, int] = OrderedDict()
        """room -> generation whose end was sent (each end once, however it arrives)."""
        self.order = asyncio.Lock()
        """Held by each TransferInfo and ABORT of this decode in turn: they are handled in the order they
        came (one PUSH socket), so an ABORT never overtakes the TransferInfo it follows while that one
        waits for the registration."""

    @property
    def attached(self) -> bool:
        """A legacy decode reads no stream, so nothing proves it alive: its restart replaces it at once."""
        return False

    def push(self, status: transfer_pb2.TransferStatus) -> None:
        """Tell the decode a request's end, as SGLang's prefill does (no other state is sent)."""
        if status.state not in TERMINAL or self.told.get(status.room) == status.generation:
            return
        self.told[status.room] = status.generation
        _trim(self.told)
        if status.room in self.silent or status.room in self.listener.aborted:
            self.silent.discard(status.room)
            return
        self.listener.tell(self.endpoint, status.room, status.state,
                           f"{status.failure_code}: {status.failure_reason}", self.codec)

    def close(self) -> None:
        """The peer is over (deregistered, replaced, gone, drained): later frames find no registration."""
        if self.listener.decodes.get(self.endpoint) is self:
            del self.listener.decodes[self.endpoint]


class LegacyListener:
    """A ZMQ PULL port speaking SGLang 0.5.23's frames, one thread, driving ``core`` on ``loop``."""

    def __init__(self, core: HandshakeCore, loop: asyncio.AbstractEventLoop, host: str, port: int = 0, *,
                 serve: bool = True) -> None:
        self.core = core
        self.loop = loop
        self.serve = serve
        self.decodes: OrderedDict[Endpoint, _Decode] = OrderedDict()
        """Registered (or refused) decodes by notify endpoint; read and written on the loop only."""
        self._rooms: OrderedDict[int, dict[str, tuple[int, int, int]]] = OrderedDict()
        """room -> {peer id: its (TP, DCP, PP) ranks}: the legacy peers bound to the room (loop only)."""
        self.aborted: OrderedDict[int, None] = OrderedDict()
        """Rooms a legacy decode bound to them aborted (loop only)."""
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.IPV6, 1)
        if port:
            self._pull.bind(_url(host, port))
        else:
            port = self._pull.bind_to_random_port(_url(host))
        self.port = port
        self._out: deque[tuple[Endpoint, list[bytes]]] = deque()
        self._push: OrderedDict[Endpoint, zmq.Socket[bytes]] = OrderedDict()
        self._backlog = threading.BoundedSemaphore(MAX_BACKLOG)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._dropped, self._warned_at = 0, 0.0
        self._handlers: dict[LegacyKind, Callable[[Any, Codec], Coroutine[Any, Any, None]]] = {
            LegacyKind.REGISTRATION: self._register, LegacyKind.TRANSFER_INFO: self._submit,
            LegacyKind.ABORT: self._abort, LegacyKind.BOOTSTRAP: self._bootstrap}
        """What a decode sends a prefill; the other kinds travel the other way (or are not served)."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pdproto-legacy-{port}", daemon=True)
        self._thread.start()
        log.info("legacy listener for SGLang's own decodes on %s:%d (%s)", host, port,
                 "serving" if serve else "off: every request is answered Failed")

    # -- the listener thread ------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stopped.is_set():
            try:
                ready = dict(poller.poll(500))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                while self._pull in ready:
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frames)
                self._flush()
            except Exception:  # noqa: BLE001 - the thread serves every legacy decode: it never dies
                log.exception("legacy listener: unexpected error; continuing")
        self._flush()

    def _receive(self, frames: list[bytes]) -> None:
        """Parse one message here (off the loop); hand what it asks for to the loop."""
        kind = "unknown"
        try:
            kind = classify(frames).kind.value
            found, parsed = parse_any(frames)
            handler = self._handlers.get(found.kind)
            if handler is None:
                raise error_for(Reason.LEGACY_UNKNOWN_KIND,
                                f"a {kind} message is not one a decode sends a prefill (or not served here)")
        except PdprotoError as exc:
            self._count(kind, exc.reason.name)
            self._warn(f"legacy listener: refused a {kind} message ({len(frames)} frames): "
                       f"{exc.reason.name}: {exc.message}")
            return
        if not self._backlog.acquire(blocking=False):
            self._count(kind, "BACKLOG")
            self._warn(f"legacy listener: {MAX_BACKLOG} messages wait for the service loop; dropped a {kind}")
            return
        codec = nixl if found.backend is LegacyBackend.NIXL else mooncake
        handling = self._guarded(kind, handler(parsed.message, codec))
        try:
            future = asyncio.run_coroutine_threadsafe(handling, self.loop)
        except RuntimeError:  # the loop is closed: the service is shutting down
            self._backlog.release()
            handling.close()
            return
        future.add_done_callback(lambda _: self._backlog.release())

    def _flush(self) -> None:
        """Send queued statuses; a decode that does not take them loses them (never blocks the thread)."""
        while self._out:
            endpoint, frames = self._out.popleft()
            sock = self._push.pop(endpoint, None)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 1024)
                sock.setsockopt(zmq.IPV6, 1)
                sock.connect(_url(*endpoint))
            self._push[endpoint] = sock  # most recently used last
            while len(self._push) > 1024:
                self._push.popitem(last=False)[1].close(linger=0)
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._warn(f"legacy listener: a status for {endpoint[0]}:{endpoint[1]} was not sent: {exc}")

    def _warn(self, text: str) -> None:
        """Log a refusal; a flood of them logs one a second with a count of the rest."""
        now = time.monotonic()
        if now - self._warned_at < 1.0:
            self._dropped += 1
            return
        self._warned_at = now
        if self._dropped:
            text += f" ({self._dropped} more refusals not logged)"
        self._dropped = 0
        log.warning("%s", text)

    def _count(self, kind: str, outcome: str) -> None:
        self.core.metrics.legacy_frames.labels(kind, outcome).inc()

    # -- on the service loop ------------------------------------------------------------

    def tell(self, endpoint: Endpoint, room: int, state: int, reason: str = "", codec: Codec = mooncake) -> None:
        """Queue the status message SGLang's decode waits for, in its backend's layout (any thread)."""
        if len(self._out) >= MAX_BACKLOG:
            self._warn(f"legacy listener: {MAX_BACKLOG} statuses wait to be sent; dropped one for room {room}")
            return
        failed = state == common_pb2.TRANSFER_STATE_FAILED
        frames = codec.build_status(transfer_pb2.TransferStatus(
            room=room, state=state, prefill_rank=self.core.engine.prefill_rank,  # type: ignore[arg-type]
            failure_reason=reason if failed else ""))
        if failed and codec is mooncake:  # Mooncake's layout has no reason frame; its decode reads one
            frames.insert(_REASON, reason.encode("utf-8", "replace"))
        self._queue(endpoint, frames)

    def _queue(self, endpoint: Endpoint, frames: list[bytes]) -> None:
        self._out.append((endpoint, frames))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # a wake-up is pending already

    async def _guarded(self, kind: str, handling: Coroutine[Any, Any, None]) -> None:
        try:
            await handling
        except PdprotoError as exc:
            self._count(kind, exc.reason.name)
            self._warn(f"legacy listener: {kind} refused: {exc.reason.name}: {exc.message}")
        except Exception:  # noqa: BLE001 - one decode's message must not end the others' service
            self._count(kind, "INTERNAL")
            log.exception("legacy listener: handling a %s failed", kind)
        else:
            self._count(kind, "ACCEPTED")

    async def _register(self, reg: Any, codec: Codec) -> None:
        """M1 (``KVArgsRegisterInfo``): Register the decode rank as a peer of its own."""
        endpoint = (reg.notify_endpoint.host, reg.notify_endpoint.port)
        decode = self.decodes[endpoint] = _Decode(self, endpoint, codec)
        self.decodes.move_to_end(endpoint)
        _trim(self.decodes)
        decode.peer.add_done_callback(lambda f: f.exception())  # a refusal no TransferInfo asked for yet
        reg = legacy_defaults(self.core.info, reg)  # page size, layer ids, head splits: as SGLang means them
        try:
            if not self.serve:
                raise error_for(Reason.CONFIG_INVALID, OFF.partition(": ")[2])
            if reg.HasField("staging") and reg.attn_tp.size != self.core.info.attn_tp.size:
                # That decode waits for SGLang's STAGING_REQ/CHUNK_READY (staging_handler.py); pdproto writes
                # each rank's heads into place instead, and sends neither.
                raise error_for(Reason.CONFIG_INVALID, "the decode uses SGLang's staging buffer for another "
                                "attention TP size than this prefill's, which pdproto does not serve: run it with "
                                "SGLANG_DISAGG_STAGING_BUFFER=0")
            if any(not p.protocol for p in self.core.registry.stale_for(identity_of(reg))):
                # Unauthenticated frames never replace a gRPC peer (a restart of one registers over gRPC).
                raise error_for(Reason.IDENTITY_IN_USE,
                                "a pdproto decode registered over gRPC holds this notify endpoint or engine")
            answer = await self.core.register(hs.RegisterRequest(registration=reg))
        except PdprotoError as exc:
            decode.peer.set_exception(exc)
            raise
        peer = self.core.registry.peers[answer.result.peer_id]
        peer.protocol = PROTOCOL.format(codec.__name__.rpartition(".")[2])
        peer.feeds.add(decode)
        decode.peer.set_result(peer)
        log.info("legacy decode %s:%d (%s) registered as %s", *endpoint, peer.identity[-1], peer.peer_id)

    async def _submit(self, info: transfer_pb2.TransferInfo, codec: Codec) -> None:
        """M2 (``TransferInfo``): SubmitTransfer for the decode's peer; a refusal answers Failed with why."""
        endpoint = (info.notify_endpoint.host, info.notify_endpoint.port)
        async with self._in_order(endpoint):
            try:
                decode, peer = await self._peer(endpoint)
                self._claim(info, peer)
                info.generation = (peer.generation_of(info.room) or 0) + 1
                if info.is_dummy:
                    decode.silent.add(info.room)
                status = await self.core.submit_to(peer, info)
            except PdprotoError as exc:
                if info.room not in self.aborted:
                    self.tell(endpoint, info.room, common_pb2.TRANSFER_STATE_FAILED,
                              f"{exc.reason.name}: {exc.message}", codec)
                raise
            decode.push(status)  # over already (the room's chunks were all there): its end, once

    def _in_order(self, endpoint: Endpoint) -> contextlib.AbstractAsyncContextManager[object]:
        """Held while a TransferInfo or ABORT of the decode at ``endpoint`` is handled (``_Decode.order``)."""
        known = self.decodes.get(endpoint)
        return known.order if known is not None else contextlib.nullcontext()

    async def _peer(self, endpoint: Endpoint) -> tuple[_Decode, Peer]:
        decode = self.decodes.get(endpoint)
        if decode is None:
            if not self.serve:
                raise error_for(Reason.CONFIG_INVALID, OFF.partition(": ")[2])
            raise NotFoundError(f"no registration from the decode at {endpoint[0]}:{endpoint[1]} (this prefill "
                                "restarted, or dropped it); restart the decode so it registers again",
                                reason=Reason.PEER_NOT_FOUND)
        peer = await asyncio.shield(decode.peer)
        return decode, peer

    def _claim(self, info: transfer_pb2.TransferInfo, peer: Peer) -> None:
        """Bind the room to the legacy peers that claim it first: at most ``required_dst_info_num``, one per
        decode rank. The room id is the only key SGLang's frames carry (issue 37: a second claim is refused)."""
        bound = self._rooms.get(info.room)
        reg = peer.registration
        ranks = (reg.attn_tp.rank, reg.dcp.rank, reg.pp.rank)
        if bound is None:
            bound = self._rooms[info.room] = {}
            _trim(self._rooms)
        if peer.peer_id in bound:
            return
        live = {p: r for p, r in bound.items() if p in self.core.registry.peers}
        if ranks in live.values() or len(live) >= max(1, info.required_dst_info_num):
            raise DuplicateRequestError(
                f"room {info.room} is claimed by {len(live)} other decode rank(s) already; a room is bound "
                "to the legacy decodes that claimed it first", reason=Reason.DUPLICATE_REQUEST)
        bound.clear()
        bound.update(live)
        bound[peer.peer_id] = ranks

    async def _abort(self, note: transfer_pb2.AbortNotification, codec: Codec) -> None:
        """M4 (``ABORT``): Abort the room for the decode its return address names, then ABORT_ACK it.

        The acknowledgement says nothing of this prefill's writes that decode's pages any more: also
        true of a decode or room it holds nothing for. Only a chunk still inside the engine after the
        drain timeout withholds it (the decode then keeps the pages until its own release timeout).
        """
        if not note.HasField("reply_endpoint"):
            raise error_for(Reason.INVALID_FIELD, "an ABORT without a return address names no decode",
                            violations=[("decode_ip", "required")])
        endpoint = (note.reply_endpoint.host, note.reply_endpoint.port)
        async with self._in_order(endpoint):
            decode = self.decodes.get(endpoint)
            peer = decode.peer.result() if decode is not None and decode.peer.done() and \
                not decode.peer.exception() else None
            if decode is not None and peer is not None and peer.peer_id in self._rooms.get(note.room, {}):
                # Every rank of that decode aborts the room and records its own reason: none is told the room's
                # end, also when this abort failed the room's other ranks first (SGLang's prefill tells none).
                self.aborted[note.room] = None
                _trim(self.aborted)
                try:
                    await self.core.abort_for(peer, transfer_pb2.AbortNotification(room=note.room))
                except NotFoundError:
                    pass  # nothing of the room is left to write its pages
            ack = transfer_pb2.AbortAck(room=note.room)
            if note.HasField("generation"):  # the decode's deferred release waits for this one
                ack.prefill_rank, ack.generation = self.core.engine.prefill_rank, note.generation
            elif decode is not None and decode.codec is nixl:
                return  # SGLang's NIXL prefill acknowledges only a deferred release (nixl/conn.py:3340-3346)
            self._queue(endpoint, mooncake.build_abort_ack(ack))

    async def _bootstrap(self, note: transfer_pb2.PrefillCompleteBootstrap, codec: Codec) -> None:
        """M6 (``BOOTSTRAP``, decode allocation policy ``prefill_complete``): not served; answered Failed."""
        error = error_for(Reason.CONFIG_INVALID, "pdproto's legacy listener does not serve the decode allocation "
                          "policy prefill_complete; run the decode with the default policy")
        ep = note.decode_endpoint
        self.tell((ep.host, ep.port), note.room, common_pb2.TRANSFER_STATE_FAILED, f"{error.reason.name}: {error}")
        raise error

    def stop(self) -> None:
        """Send what is queued, close the port and the thread (after the core drained)."""
        self._stopped.set()
        self._wake()
        self._thread.join(5)
        for sock in self._push.values():
            sock.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


__all__ = ["MAX_FRAME_BYTES", "OFF", "PROTOCOL", "LegacyListener"]
