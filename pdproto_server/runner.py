"""Requests from admission to their terminal status, with no task per request.

How a request waits for chunks (a callback and a MATCH_TIMEOUT timer), moves them (one task
per peer with work, on the peer's worker) and ends (``finish``, exactly once; FAILED only once
no chunk of it is inside the engine, so the decode may reuse its pages when it sees it):
``pdproto_server/README.md``, reading order 5.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping

from pdproto.errors import DeadlineExceededError, PdprotoError, Reason, RequestFailedError
from pdproto.negotiation.slots import SlotCopy
from pdproto.v1 import common_pb2

from .engine import Chunk, Outcome, PrefillEngine, RoomLog
from .metrics import ServiceMetrics
from .registry import Limits, Peer, Request
from .transfers import build_job, slot_copies

log = logging.getLogger("pdproto_server.runner")

COALESCE = 4
"""Most arrived chunks of one request moved as one job: it bounds the job's time under the executor's deadline."""

SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS
FAILED = common_pb2.TRANSFER_STATE_FAILED
TRANSFERRING = common_pb2.TRANSFER_STATE_TRANSFERRING


async def drained(peer: Peer, room: int, generation: int, timeout: float) -> bool:
    """True once no engine call for this request generation is out (waits up to ``timeout``, not when stuck)."""
    moving = peer.moving
    if moving is None or moving[:2] != (room, generation) or moving[2].returned.done():
        return True
    if peer.worker.stuck:
        return False
    done, _ = await asyncio.wait([asyncio.wrap_future(moving[2].returned)], timeout=timeout)
    return bool(done)


class TransferRunner:
    """Owns requests from ``start`` to ``finish``: every one ends in SUCCESS or FAILED with a reason."""

    def __init__(self, engine: PrefillEngine, metrics: ServiceMetrics, limits: Limits,
                 peers: Mapping[str, Peer]) -> None:
        self.engine = engine
        self.peers = peers
        """The registered peers by id (the registry's own map), to find a room's requests' peers."""
        self.metrics = metrics
        self.limits = limits
        self.on_peer_gone: Callable[[Peer], None] | None = None
        """Called when the executor reports the peer dead, so its other requests fail now."""
        self.on_kept: Callable[[Peer], None] | None = None
        """Called when a peer keeps a final status and kept none before (its expiry starts)."""
        self.open = 0
        """Requests started and not finished, over every peer."""
        metrics.open_requests = lambda: self.open
        self._idle: list[asyncio.Future[None]] = []
        self._queues: dict[str, deque[tuple[Request, list[Chunk]]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._aborts: set[asyncio.Task[bool]] = set()
        engine.on_abort = self._room_aborted

    # -- life of a request ---------------------------------------------------------

    def start(self, peer: Peer, request: Request) -> None:
        """Admit the request: claim its room and take whatever chunks are there already."""
        self.open += 1
        peer.open[request.room] = request
        tp = peer.decision.tp
        request.room_log = self.engine.claim(request.room, peer_id=peer.peer_id, request=request,
                                             prefix_len=request.prefix_len,
                                             expected=tp.senders.decode_ranks_per_prefill_rank if tp else 1)
        self._advance(peer, request)

    def _advance(self, peer: Peer, request: Request) -> None:
        """Take every chunk that has arrived; then wait for the next (callback and deadline), or queue a move."""
        room_log = request.room_log
        assert room_log is not None
        while not request.terminal and not request.moving:
            if room_log.aborted:
                self.finish(peer, request, FAILED, Reason.ABORTED,
                            f"the prefill aborted room {room_log.room}: {room_log.aborted}")
                return
            index = request.chunks_done
            if index >= len(room_log.chunks):
                self._wait(peer, request, room_log, index)
                return
            self._stop_timer(request)
            chunk = room_log.chunks[index]
            if not request.transfer.is_dummy:
                request.moving = True
                self._queue(peer, request, self._arrived_run(room_log, index))
                return
            request.chunks_done += 1
            if chunk.last:
                self.finish(peer, request, SUCCESS)
                return
            peer.publish(request.status())

    @staticmethod
    def _arrived_run(room_log: RoomLog, index: int) -> list[Chunk]:
        """The chunks from ``index`` that have arrived, up to the last and at most ``COALESCE``: one job.

        Chunks that waited while the link was busy with earlier ones move together: one engine
        call pipelines them with no drain, hop or exposed pack between them. Chunks that arrive
        spaced out (the prefill's forward passes slower than the link) move one by one as before.
        """
        run = [room_log.chunks[index]]
        while not run[-1].last and len(run) < COALESCE and index + len(run) < len(room_log.chunks):
            run.append(room_log.chunks[index + len(run)])
        return run

    def _wait(self, peer: Peer, request: Request, room_log: RoomLog, index: int) -> None:
        if request.waiter is None:
            request.waiter = lambda: self._arrived(peer, request)
            room_log.waiters.append(request.waiter)
        if request.timer is None:
            request.timer = asyncio.get_running_loop().call_later(
                self.limits.match_timeout, self._timed_out, peer, request, index)

    def _arrived(self, peer: Peer, request: Request) -> None:
        """The room log changed (a chunk, or an abort)."""
        request.waiter = None
        if not request.terminal:
            self._advance(peer, request)

    def _timed_out(self, peer: Peer, request: Request, index: int) -> None:
        request.timer = None
        if request.terminal or request.moving or request.chunks_done != index:
            return
        error = DeadlineExceededError(
            f"room {request.room}: chunk {index} did not arrive from the prefill engine in time",
            reason=Reason.MATCH_TIMEOUT, metadata={"room": request.room, "chunk": index})
        self.finish(peer, request, FAILED, error.reason, error.message)

    @staticmethod
    def _stop_timer(request: Request) -> None:
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None

    def finish(self, peer: Peer, request: Request, state: int, reason: Reason | None = None,
               message: str = "") -> None:
        """Move a request to a terminal state once, publish it, count it, and keep only its final status."""
        if request.terminal:
            return
        self._stop_timer(request)
        request.state = state
        if reason is not None:
            request.failure_code = reason.code
            request.failure_reason = message or reason.code
        if peer.open.get(request.room) is request:
            del peer.open[request.room]
        room_log = self.engine.rooms.get(request.room)
        if room_log is not None and room_log.requests.get(peer.peer_id) is request:
            # Not the request and its pages: its outcome, which PrefillEngine.status reports.
            room_log.requests[peer.peer_id] = Outcome(
                request.state, request.failure_code, request.failure_reason, request.bytes,
                request.aux_bytes, request.state_bytes)
        if request.waiter is not None and request.room_log is not None:
            # A request superseded or aborted while its room waits for a chunk: the room may live on.
            with contextlib.suppress(ValueError):
                request.room_log.waiters.remove(request.waiter)
        request.waiter = None
        request.room_log = None
        status = request.final = request.status()  # built once: kept serialized, sent to every stream
        if peer.record_finished(status, self.limits.max_finished_per_peer) and self.on_kept is not None:
            self.on_kept(peer)
        self.metrics.finished(reason.code if reason is not None else "SUCCESS")
        peer.publish(status)
        self.open -= 1
        if not self.open:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    # -- moving bytes: one task per peer with work ---------------------------------------

    def _queue(self, peer: Peer, request: Request, chunks: list[Chunk]) -> None:
        queue = self._queues.setdefault(peer.peer_id, deque())
        queue.append((request, chunks))
        # A worker cancelled before its first step never ran its finally: listed, but done.
        worker = self._workers.get(peer.peer_id)
        if worker is None or worker.done():
            self._workers[peer.peer_id] = asyncio.get_running_loop().create_task(
                self._work(peer, queue), name=f"moves-{peer.peer_id}")

    async def _work(self, peer: Peer, queue: deque[tuple[Request, list[Chunk]]]) -> None:
        """Move the peer's queued chunks in order; return when the queue is empty."""
        try:
            while queue:
                request, chunks = queue.popleft()
                if request.terminal:
                    continue
                try:
                    await self._move(peer, request, chunks)
                except PdprotoError as exc:
                    request.moving = False
                    # A stopped request ends with why it was stopped, not with how its engine call ended.
                    self.finish(peer, request, FAILED, *(request.cancel_reason or (exc.reason, exc.message)))
                    # A dead peer is written off whole; a stuck engine call fails only the requests it holds up.
                    if exc.reason is Reason.PEER_GONE and self.on_peer_gone is not None:
                        self.on_peer_gone(peer)
                    continue
                except Exception as exc:  # noqa: BLE001 - a request must never end silently
                    log.exception("request room=%s peer=%s failed unexpectedly", request.room, peer.peer_id)
                    request.moving = False
                    self.finish(peer, request, FAILED, Reason.INTERNAL, f"internal error: {type(exc).__name__}")
                    continue
                request.moving = False
                if request.cancel_reason is not None:  # stopped while its chunk was in the engine
                    self.finish(peer, request, FAILED, *request.cancel_reason)
                    continue
                request.chunks_done += len(chunks)
                if chunks[-1].last:
                    self.finish(peer, request, SUCCESS)
                    continue
                peer.publish(request.status())
                self._advance(peer, request)
        finally:
            # Both maps let go in this same step, not in a done callback: a chunk that arrives
            # between this task's end and its callbacks would otherwise join a queue nobody takes.
            if self._queues.get(peer.peer_id) is queue and not queue:
                del self._queues[peer.peer_id]
            if self._workers.get(peer.peer_id) is asyncio.current_task():
                del self._workers[peer.peer_id]

    async def _move(self, peer: Peer, request: Request, chunks: list[Chunk]) -> None:
        """Move a run of chunks' KV rows as one job; the last chunk's state and aux slot ride in it too."""
        source = self.engine.source
        last = chunks[-1]
        state, aux = slot_copies(source, peer, request, last) if last.last else ([], [])
        extras = [(kind, copies) for kind, copies in (("state", state), ("aux", aux)) if copies]
        job, kinds = build_job(source, peer, request, chunks, extras)
        if request.state != TRANSFERRING:
            request.state = TRANSFERRING
            peer.publish(request.status())
        what = f"room {request.room} chunk {chunks[0].index}" + (f"-{last.index}" if len(chunks) > 1 else "")
        call = peer.worker.submit(self.engine.executor.execute, peer.peer_id, job, what=what)
        peer.moving = (request.room, request.generation, call)
        try:
            result = await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and task is not None and not task.cancelling():
                # ``stop`` cancelled it while it waited behind the peer's earlier calls: it never ran.
                raise RequestFailedError(f"{what}: not run, its request ended while it waited for the peer's worker",
                                         reason=Reason.ABORTED, metadata={"peer": peer.peer_id}) from None
            # This task is stopped (close): a copy in progress is waited for, as an Abort promises.
            await asyncio.wait([asyncio.wrap_future(call.returned)], timeout=self.limits.drain_timeout)
            raise
        finally:
            if call.returned.done() and peer.moving is not None and peer.moving[2] is call:
                peer.moving = None
        moved = {kind: [0, 0] for kind in ("kv", *(k for k, _ in extras))}  # bytes, descriptors
        for seg, kind, n in zip(job.segments, kinds, result.segment_descriptors, strict=True):
            moved[kind][0] += seg.nbytes
            moved[kind][1] += n
        nbytes, ndesc = moved["kv"]
        request.bytes += nbytes
        request.descriptors += ndesc
        self.metrics.bytes_moved.inc(nbytes)
        self.metrics.descriptors.inc(ndesc)
        self.metrics.chunks.inc(len(chunks))
        self.metrics.pack_fallbacks.inc(int(result.fallback))
        self.metrics.inline_jobs.inc(int(result.inline))
        self.metrics.notifications.inc(int(result.notified))
        for kind, copies in extras:
            self._count(request, kind, copies, *moved[kind])

    def _count(self, request: Request, kind: str, copies: list[SlotCopy], nbytes: int, ndesc: int) -> None:
        """Per-kind bytes and descriptors of the aux or state copies, on the request and in metrics."""
        self.metrics.extra_descriptors.labels(kind=kind).inc(ndesc)
        if kind == "aux":
            request.aux_bytes += nbytes
            request.aux_descriptors += ndesc
            self.metrics.aux_bytes.inc(nbytes)
            return
        request.state_bytes += nbytes
        request.state_descriptors += ndesc
        self.metrics.state_bytes.inc(nbytes)
        entries = self.engine.source.info.state_entries
        for c in copies:
            whole = len(c.segments) == 1 and c.segments[0].length == c.src_item_len == c.dst_item_len
            split = ("replicated" if entries[c.src_entry].tensors[c.src_tensor].dim == 0
                     else "whole" if whole else "sliced")
            self.metrics.state_items.labels(split=split).inc(len(c.items))

    # -- stopping ------------------------------------------------------------------------

    async def stop(self, peer: Peer, request: Request, reason: Reason, message: str) -> bool:
        """End an open request FAILED with ``reason``; True once no chunk of it is inside the engine.

        A chunk in the engine is waited for up to ``drain_timeout`` (not at all when the peer's
        worker is stuck; one still queued there is cancelled) before FAILED is published, exactly once, before any stream of the peer
        is ended. A request that already failed while its chunk was still in the engine
        (DEADLINE_EXCEEDED) drains too.
        """
        if not request.terminal:
            if request.cancel_reason is None:
                request.cancel_reason = (reason, message)
            moving = peer.moving
            if moving is not None and moving[:2] == (request.room, request.generation):
                moving[2].cancel()  # still queued behind the peer's earlier calls: it never runs
            if request.moving and not peer.worker.stuck:
                await drained(peer, request.room, request.generation, self.limits.drain_timeout + 1.0)
            self.finish(peer, request, FAILED, *request.cancel_reason)
        return await drained(peer, request.room, request.generation, self.limits.drain_timeout)

    def _room_aborted(self, room: RoomLog) -> None:
        """The engine aborted a room: fail each decode's open request for it with the engine's reason."""
        for request in list(room.requests.values()):
            peer = self.peers.get(request.peer_id) if isinstance(request, Request) else None
            if peer is not None and isinstance(request, Request) and not request.terminal:
                task = asyncio.get_running_loop().create_task(self.stop(
                    peer, request, Reason.ABORTED, f"the prefill aborted room {room.room}: {room.aborted}"))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no request is open; True when none is."""
        if not self.open:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        done, _ = await asyncio.wait([waiter], timeout=timeout)
        return bool(done)

    async def close(self) -> None:
        """Stop the peers' move tasks (their engine calls drain, as on a cancelled Abort)."""
        for worker in list(self._workers.values()):
            worker.cancel()
        tasks: list[asyncio.Future[object]] = [*self._workers.values(), *self._aborts]  # type: ignore[list-item]
        if tasks:
            # Their requests are failed already; what is left is their engine calls' drain.
            await asyncio.wait(tasks, timeout=self.limits.drain_timeout + 1.0)


__all__ = ["TransferRunner", "drained"]
