"""The handshake service's state machine, free of gRPC: peers, requests, aborts, draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pdproto.errors import (
    DuplicateRequestError,
    NotFoundError,
    PdprotoError,
    Reason,
    RequestFailedError,
    ResourceLimitError,
    ShuttingDownError,
)
from pdproto.topology import Rejection, negotiate
from pdproto.v1 import (
    handshake_service_pb2 as hs,
    server_info_pb2,
    transfer_pb2,
)

from .engine import PrefillEngine
from .metrics import ServiceMetrics
from .registry import Limits, Peer, PeerRegistry, Request, identity_of
from .transfers import TransferRunner
from .validate import check_registration, check_transfer

log = logging.getLogger("pdproto_server.core")


class HandshakeCore:
    """Everything the servicer does, as plain async methods raising ``PdprotoError``."""

    def __init__(self, engine: PrefillEngine, *, limits: Limits | None = None,
                 metrics: ServiceMetrics | None = None, workers: int = 4) -> None:
        self.engine = engine
        self.limits = limits or Limits()
        self.metrics = metrics or ServiceMetrics()
        self.registry = PeerRegistry(self.limits)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdproto-xfer")
        self.runner = TransferRunner(engine, self.metrics, self.limits, self.pool)
        self.runner.on_peer_gone = self._peer_gone
        self._background: set[asyncio.Task[int]] = set()
        self.shutting_down = False
        self._streams_closed = False
        self._registering = 0
        self._janitor: asyncio.Task[None] | None = None

    @property
    def info(self) -> server_info_pb2.PrefillServerInfo:
        """The published topology."""
        return self.engine.source.info

    async def start(self) -> None:
        """Attach the engine to this loop and start housekeeping."""
        self.engine.attach(asyncio.get_running_loop())
        self._janitor = asyncio.get_running_loop().create_task(self._housekeeping(), name="janitor")

    def _accepting(self) -> None:
        if self.shutting_down:
            raise ShuttingDownError("the prefill is shutting down and takes no new work")

    def peer(self, peer_id: str, credential: bytes) -> Peer:
        """The registered peer whose credential this is; NOT_FOUND otherwise.

        An unknown id, a missing credential and another peer's credential get one answer, so a
        caller learns nothing about peers it did not register.
        """
        peer = self.registry.authorized(peer_id, credential)
        if peer is None:
            raise NotFoundError(f"peer {peer_id!r} is not registered, or the call does not carry its "
                                "credential (RegisterResponse.peer_credential)",
                                reason=Reason.PEER_NOT_FOUND, metadata={"peerId": peer_id})
        return peer

    # -- Register / Deregister -------------------------------------------------

    async def register(self, request: hs.RegisterRequest) -> hs.RegisterResponse:
        """Negotiate, replace a restarted peer's stale state, connect the executor, admit.

        The response carries the new peer's credential, which every later call for it must present.
        """
        try:
            result = await self._register(request)
        except PdprotoError as exc:
            self.metrics.registrations.labels(outcome=exc.reason.code).inc()
            raise
        self.metrics.registrations.labels(outcome="ACCEPTED").inc()
        return result

    async def _register(self, request: hs.RegisterRequest) -> hs.RegisterResponse:
        self._accepting()
        reg = check_registration(request)
        started = time.perf_counter()
        verdict = negotiate(self.info, reg)
        self.metrics.negotiation_seconds.observe(time.perf_counter() - started)
        if isinstance(verdict, Rejection):
            raise verdict.to_error()
        identity = identity_of(reg)
        stale = self.registry.stale_for(identity)
        self.registry.check_capacity(sum(1 for p in stale if p.gone_at is None) - self._registering)
        self._registering += 1
        try:
            for old in stale:
                # Same notify endpoint or engine identity: the decode restarted. Its old
                # requests can never complete; fail them and drop its engine connection.
                log.info("peer %s re-registered as a new peer; dropping stale state", old.peer_id)
                await self._drop(old, Reason.PEER_GONE, "the decode re-registered (restart)")
            peer_id = self.registry.new_id()
            await self.runner.blocking(self.engine.executor.connect, peer_id, reg)
        finally:
            self._registering -= 1
        result = verdict.to_proto(peer_id)
        credential = self.registry.new_credential()
        self.registry.add(Peer(peer_id=peer_id, registration=reg, decision=verdict, result=result,
                               identity=identity, credential=credential))
        self.metrics.peers.set(self.registry.live())
        return hs.RegisterResponse(result=result, peer_credential=credential)

    async def deregister(self, request: hs.DeregisterRequest) -> int:
        """Fail the peer's open requests with PEER_GONE, cancel them, disconnect, forget it."""
        peer = self.peer(request.peer_id, request.peer_credential)
        return await self._drop(peer, Reason.PEER_GONE, "the decode deregistered")

    async def _drop(self, peer: Peer, reason: Reason, message: str) -> int:
        """Remove a peer and free everything it held; returns how many requests were failed."""
        if peer.closed:
            return 0
        self.registry.remove(peer.peer_id)
        peer.closed = True
        open_requests = peer.open_requests()
        await asyncio.gather(*(self.runner.stop(r, reason, message) for r in open_requests))
        peer.close_watchers()
        try:
            await self.runner.blocking(self.engine.executor.disconnect, peer.peer_id)
        except PdprotoError as exc:
            log.warning("disconnect of %s failed: %s", peer.peer_id, exc)
        self.metrics.peers.set(self.registry.live())
        return len(open_requests)

    def _peer_gone(self, peer: Peer) -> None:
        """The executor found the peer dead: free it in the background (once)."""
        if peer.closed or peer.gone_at is not None:
            return
        peer.gone_at = time.monotonic()
        log.warning("peer %s is gone (engine reported PEER_GONE); freeing its state", peer.peer_id)
        task = asyncio.get_running_loop().create_task(self._release_gone(peer), name=f"gone-{peer.peer_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_gone(self, peer: Peer) -> int:
        """Fail a dead peer's open requests and drop its engine connection, but keep its record.

        The record (requests with their final statuses) stays visible until the decode
        re-registers (which replaces it) or ``keep_finished`` passes; it admits no new work.
        """
        open_requests = peer.open_requests()
        await asyncio.gather(*(self.runner.stop(r, Reason.PEER_GONE, "the decode process is gone")
                               for r in open_requests))
        peer.close_watchers()
        try:
            await self.runner.blocking(self.engine.executor.disconnect, peer.peer_id)
        except PdprotoError as exc:
            log.warning("disconnect of %s failed: %s", peer.peer_id, exc)
        self.metrics.peers.set(self.registry.live())
        return len(open_requests)

    # -- SubmitTransfer / Abort --------------------------------------------------

    async def submit(self, request: hs.SubmitTransferRequest) -> transfer_pb2.TransferStatus:
        """Admit one request generation and start moving its chunks as they arrive."""
        self._accepting()
        peer = self.peer(request.peer_id, request.peer_credential)
        _check_alive(peer)
        info, pages = check_transfer(request, peer)
        old = peer.requests.get(info.room)
        if old is not None:
            if info.generation == old.generation:
                raise DuplicateRequestError(
                    f"room {info.room} generation {info.generation} was already submitted",
                    reason=Reason.DUPLICATE_REQUEST, metadata={"room": info.room, "generation": info.generation})
            if info.generation < old.generation:
                raise _stale(info.room, info.generation, old.generation)
            # A newer generation supersedes the old one (retraction, retry).
            await self.runner.stop(old, Reason.ABORTED, f"superseded by generation {info.generation}")
        open_count = len(peer.open)
        if open_count >= self.limits.max_inflight_per_peer:
            raise ResourceLimitError(
                f"peer {peer.peer_id} has {open_count} requests in flight (limit {self.limits.max_inflight_per_peer})",
                reason=Reason.TOO_MANY_REQUESTS,
                metadata={"limit": self.limits.max_inflight_per_peer, "inflight": open_count})
        if peer.closed or self.registry.peers.get(peer.peer_id) is not peer:
            raise NotFoundError(f"peer {peer.peer_id!r} went away", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peerId": peer.peer_id})
        _check_alive(peer)
        req = Request(peer_id=peer.peer_id, room=info.room, generation=info.generation, transfer=info,
                      dst_pages=pages, prefix_len=info.decode_prefix_len,
                      prefill_rank=self.engine.prefill_rank)
        peer.requests[info.room] = req
        self.runner.start(peer, req)
        # WAITING_FOR_INPUT travels in this response; streams report changes from here on.
        return req.status()

    async def abort(self, request: hs.AbortRequest) -> transfer_pb2.AbortAck:
        """Abort a request generation; answers once its in-flight chunk has drained."""
        peer = self.peer(request.peer_id, request.peer_credential)
        note = request.abort
        req = peer.requests.get(note.room)
        if req is None:
            raise NotFoundError(f"room {note.room} is unknown for peer {peer.peer_id}",
                                reason=Reason.REQUEST_NOT_FOUND, metadata={"room": note.room})
        if note.HasField("generation") and note.generation != req.generation:
            if note.generation < req.generation:
                raise _stale(note.room, note.generation, req.generation)
            raise NotFoundError(f"room {note.room} generation {note.generation} was never submitted",
                                reason=Reason.REQUEST_NOT_FOUND,
                                metadata={"room": note.room, "generation": note.generation})
        await self.runner.stop(req, Reason.ABORTED, "aborted by the decode")
        return transfer_pb2.AbortAck(room=req.room, prefill_rank=req.prefill_rank, generation=req.generation)

    # -- WatchStatus ------------------------------------------------------------

    async def watch(self, request: hs.WatchStatusRequest) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """Current statuses of the peer's (matching) requests, then every change until the peer goes."""
        peer = self.peer(request.peer_id, request.peer_credential)
        wanted = set(request.rooms)
        queue: asyncio.Queue[transfer_pb2.TransferStatus | None] = asyncio.Queue()
        # Subscribe before the snapshot, with no await in between, so no change is missed.
        peer.watchers.add(queue)
        try:
            for req in list(peer.requests.values()):
                if not wanted or req.room in wanted:
                    yield req.status()
            if peer.closed or peer.gone_at is not None or self._streams_closed:
                return
            while True:
                item = await queue.get()
                if item is None:
                    return
                if not wanted or item.room in wanted:
                    yield item
        finally:
            peer.watchers.discard(queue)

    # -- housekeeping and shutdown ---------------------------------------------

    async def _housekeeping(self) -> None:
        """Expire orphan rooms and old finished requests, once a second."""
        while True:
            await asyncio.sleep(1.0)
            dropped = self.engine.expire(orphan_after=self.limits.match_timeout,
                                         keep_finished=self.limits.keep_finished)
            if dropped:
                log.warning("dropped %d prefill rooms no decode claimed in time: %s", len(dropped), dropped[:8])
            now = time.monotonic()
            for peer in list(self.registry.peers.values()):
                if peer.gone_at is not None and now - peer.gone_at > self.limits.keep_finished and not peer.open:
                    await self._drop(peer, Reason.PEER_GONE, "the decode process is gone")
                    continue
                for room, req in list(peer.requests.items()):
                    if req.finished_at is not None and now - req.finished_at > self.limits.keep_finished:
                        del peer.requests[room]

    def open_requests(self) -> list[tuple[Peer, Request]]:
        """Every open request of every peer."""
        return [(p, r) for p in self.registry.peers.values() for r in p.open_requests()]

    async def drain(self, timeout: float) -> None:
        """Stop admitting work, let open requests finish (up to ``timeout``), fail the rest."""
        self.shutting_down = True
        tasks = [r.task for _, r in self.open_requests() if r.task is not None]
        if tasks:
            log.info("draining %d in-flight requests (up to %.1fs)", len(tasks), timeout)
            await asyncio.wait(tasks, timeout=timeout)
        leftovers = self.open_requests()
        await asyncio.gather(*(self.runner.stop(r, Reason.SHUTTING_DOWN, "the prefill shut down")
                               for _, r in leftovers))
        self._streams_closed = True
        for peer in self.registry.peers.values():
            peer.close_watchers()

    async def close(self) -> None:
        """Drop every peer and release the executor and worker pool."""
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.limits.drain_timeout)
        for peer in list(self.registry.peers.values()):
            await self._drop(peer, Reason.SHUTTING_DOWN, "the prefill shut down")
        self.pool.shutdown(wait=True)


def _check_alive(peer: Peer) -> None:
    """A peer whose process is gone admits no new work (it must re-register)."""
    if peer.gone_at is not None:
        raise RequestFailedError(f"peer {peer.peer_id} is gone; re-register", reason=Reason.PEER_GONE,
                                 metadata={"peerId": peer.peer_id})


def _stale(room: int, got: int, current: int) -> RequestFailedError:
    return RequestFailedError(f"room {room}: generation {got} is older than the current {current}",
                              reason=Reason.STALE_GENERATION,
                              metadata={"room": room, "generation": got, "currentGeneration": current})


__all__ = ["HandshakeCore"]
