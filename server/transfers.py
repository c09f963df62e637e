"""Per-request transfer tasks: match chunks, plan with ``plan_chunk``, run the executor on the peer's lane.

A chunk moves as one job of KV segments (MHA rows cut to this rank's heads when the TP
sizes differ). After the request's last KV chunk come the state and the aux slot, each as
its own job (so their bytes and descriptors are counted per kind), and the request is
SUCCESS only when they landed. The chunk notice rides on the last job of the chunk.
Engine calls run on the peer's lane (``server/lanes.py``), with the engine deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np

from pdproto.dcp import plan_chunk
from pdproto.dcp import runs as run_arith
from pdproto.dcp.layers import EntryRole
from pdproto.errors import InvalidFieldError, PdprotoError, Reason
from pdproto.slots import SlotCopy, aux_copies, state_copies
from pdproto.transfer import LayerSpan, Segment, TransferExecutor, TransferJob, TransferResult
from pdproto.transfer.notice import ChunkNotice, encode_chunk_notice
from pdproto.v1 import common_pb2

from .engine import Chunk, FinalState, KvSource, PrefillEngine, RoomLog
from .metrics import ServiceMetrics
from .registry import Limits, Peer, Request

log = logging.getLogger("pdproto_server.transfers")


def _kv_layer(source: KvSource, peer: Peer, index: int) -> LayerSpan | None:
    """The span of KV pairing ``index``: whole rows, this rank's heads, or None (another rank writes them)."""
    d = peer.decision
    p = d.pairings[index]
    cut = d.tp.row_slices[index] if d.tp is not None else None
    src, dst = source.buffers[p.src_entry].addr, peer.registration.kv_buffers[p.dst_entry].ptr
    if cut is None:
        return LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=p.src_token_bytes)
    if cut.length == 0:
        return None
    return LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=p.src_token_bytes, dst_row_bytes=p.dst_token_bytes,
                     src_offset=cut.src_offset, dst_offset=cut.dst_offset, width=cut.length)


def build_job(source: KvSource, peer: Peer, request: Request, chunk: Chunk, *,
              notify: bool = True) -> TransferJob:
    """The executor job that moves ``chunk`` into ``request``'s pages: one segment per entry role.

    The negotiated layouts go to the planner as they are, and its runs go to the
    executor as they are: nothing here is per token. The job carries the chunk's
    completion notice unless ``notify`` is False (the extras that follow carry it); a
    rank that owns no rows of the chunk still gets a row-less job, so an engine with
    notifications (NIXL) tells the decode the chunk finished.
    """
    d = peer.decision
    has_draft = any(p.role is EntryRole.DRAFT for p in d.pairings)
    plan = plan_chunk(
        d.src, d.dst, chunk.src_pages, request.dst_pages,
        src_page_offset=chunk.page_offset, decode_prefix_len=request.prefix_len,
        num_kv_tokens=chunk.num_tokens, include_draft=has_draft,
    )
    segments = []
    for role, runs in ((EntryRole.TARGET, plan.target_runs), (EntryRole.DRAFT, plan.draft_runs)):
        layers = tuple(layer for i, p in enumerate(d.pairings) if p.role is role
                       if (layer := _kv_layer(source, peer, i)) is not None)
        if layers and runs.shape[0]:
            segments.append(Segment(runs, layers))
    return TransferJob(segments=tuple(segments), pack=True,
                       notification=chunk_notice(request, chunk) if notify else None)


def chunk_notice(request: Request, chunk: Chunk) -> bytes:
    """The engine notice that tells the decode this chunk of the request landed."""
    return encode_chunk_notice(ChunkNotice(request.room, request.generation, chunk.index, chunk.last))


def slot_copies(source: KvSource, peer: Peer, request: Request, chunk: Chunk) -> tuple[list[SlotCopy], list[SlotCopy]]:
    """(state, aux) copies of the request's last chunk: what this rank writes, item by item."""
    tp = peer.decision.tp
    if tp is None or request.transfer.is_dummy or not (tp.state or tp.aux):
        return [], []
    t = request.transfer
    state: list[SlotCopy] = []
    if any(p.writes for p in tp.state):
        if chunk.state_slots is None:
            raise InvalidFieldError("state_slots", f"room {request.room}: the prefill engine's last chunk"
                                    " named no state slots, and this rank writes state")
        state = state_copies(tp.state, src_slots=chunk.state_slots,
                             dst_slots=[list(s.indices) for s in t.dst_state_indices])
    aux: list[SlotCopy] = []
    if tp.aux:
        if chunk.aux_slot is None:
            raise InvalidFieldError("aux_slot", f"room {request.room}: the prefill engine's last chunk"
                                    " named no aux slot, and this rank writes aux")
        aux = aux_copies(tp.aux, src_slot=chunk.aux_slot, dst_slot=t.dst_aux_index)
    return state, aux


def slot_job(source: KvSource, peer: Peer, copies: list[SlotCopy], notification: bytes | None) -> TransferJob:
    """One job for aux or state copies: a segment per tensor byte range, rows = items.

    Every layer's destination is the base of the entry's registered region, so the
    executor bounds each write by that entry's own length.
    """
    reg = peer.registration
    segments = []
    for c in copies:
        if c.kind == "aux":
            src, dst = source.aux[c.src_entry].addr, reg.aux_ptrs[c.dst_entry]
        else:
            src = source.state[c.src_entry][c.src_tensor].addr
            dst = reg.state_buffers[c.dst_entry].data_ptrs[c.dst_tensor]
        runs = run_arith.from_rows(np.array([i for i, _ in c.items], dtype=np.int64),
                                   np.array([j for _, j in c.items], dtype=np.int64))
        segments += [Segment(runs, (LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=c.src_item_len,
                                              dst_row_bytes=c.dst_item_len, src_offset=g.src_offset,
                                              dst_offset=g.dst_offset, width=g.length),))
                     for g in c.segments]
    return TransferJob(segments=tuple(segments), pack=False, notification=notification)


async def drained(peer: Peer, room: int, generation: int, timeout: float) -> bool:
    """True once no engine call for this request generation is out (waits up to ``timeout``, not when stuck)."""
    lane = peer.lane
    if not lane.busy or lane.tag != (room, generation):
        return True
    if lane.stuck:
        return False
    return await lane.wait_idle(timeout) or lane.tag != (room, generation)


def run_jobs(executor: TransferExecutor, peer_id: str, jobs: list[TransferJob]) -> list[TransferResult]:
    """Blocking: execute jobs in order (a chunk's KV, then state, then aux) in one worker hop."""
    return [executor.execute(peer_id, job) for job in jobs]


class TransferRunner:
    """Owns request tasks: starts them, finishes every one in SUCCESS or FAILED with a reason."""

    def __init__(self, engine: PrefillEngine, metrics: ServiceMetrics, limits: Limits,
                 peers: Mapping[str, Peer]) -> None:
        self.engine = engine
        self.peers = peers
        """The registered peers by id (the registry's own map), to find a room's requests' peers."""
        self.metrics = metrics
        self.limits = limits
        self.on_peer_gone: Callable[[Peer], None] | None = None
        """Called when the executor reports the peer dead, so its other requests fail now."""
        self._aborts: set[asyncio.Task[bool]] = set()
        engine.on_abort = self._room_aborted

    def _room_aborted(self, room: RoomLog) -> None:
        """The engine aborted a room: fail each decode's open request for it with the engine's reason."""
        for request in list(room.requests.values()):
            peer = self.peers.get(request.peer_id) if isinstance(request, Request) else None
            if peer is not None and isinstance(request, Request) and not request.terminal:
                task = asyncio.get_running_loop().create_task(self.stop(
                    peer, request, Reason.ABORTED, f"the prefill aborted room {room.room}: {room.aborted}"))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    def start(self, peer: Peer, request: Request) -> None:
        """Start the request's task; the room is claimed so the engine knows a decode wants it."""
        self.metrics.inflight.inc()
        peer.open[request.room] = request
        task = asyncio.get_running_loop().create_task(
            self._run(peer, request), name=f"room-{request.room}-{peer.peer_id}")
        request.task = task

        def settle(_: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never enters _run's handlers.
            reason, message = request.cancel_reason or (Reason.INTERNAL, "request task ended early")
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, reason, message)

        task.add_done_callback(settle)

    def finish(self, peer: Peer, request: Request, state: int, reason: Reason | None = None,
               message: str = "") -> None:
        """Move a request to a terminal state once, publish it, count it, and keep only its final status."""
        if request.terminal:
            return
        request.state = state
        if reason is not None:
            request.failure_code = reason.code
            request.failure_reason = message or reason.code
        request.finished_at = time.monotonic()
        if peer.open.get(request.room) is request:
            del peer.open[request.room]
        room_log = self.engine.rooms.get(request.room)
        if room_log is not None and room_log.requests.get(peer.peer_id) is request:
            # Not the request and its pages: its outcome, which PrefillEngine.status reports.
            room_log.requests[peer.peer_id] = FinalState(
                request.state, request.failure_code, request.failure_reason, request.bytes,
                request.aux_bytes, request.state_bytes)
        status = request.status()
        peer.record_finished(status, self.limits.max_finished_per_peer)
        self.metrics.inflight.dec()
        self.metrics.requests.labels(outcome=reason.code if reason is not None else "SUCCESS").inc()
        peer.publish(status)

    async def _run(self, peer: Peer, request: Request) -> None:
        """The request's life: wait for each chunk, plan, transfer, report."""
        tp = peer.decision.tp
        room_log = self.engine.claim(request.room, peer_id=peer.peer_id, request=request,
                                     prefix_len=request.prefix_len,
                                     expected=tp.senders.decode_ranks_per_prefill_rank if tp else 1)
        index = 0
        try:
            while True:
                chunk = await room_log.wait_chunk(index, time.monotonic() + self.limits.match_timeout)
                if not request.transfer.is_dummy:
                    await self._move(peer, request, chunk)
                request.chunks_done += 1
                if chunk.last:
                    self.finish(peer, request, common_pb2.TRANSFER_STATE_SUCCESS)
                    return
                peer.publish(request.status())
                index += 1
        except asyncio.CancelledError:
            reason, message = request.cancel_reason or (Reason.ABORTED, "request cancelled")
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, reason, message)
            raise
        except PdprotoError as exc:
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, exc.reason, exc.message)
            # A dead peer is written off whole; a stuck engine call fails only the requests it holds up.
            if exc.reason is Reason.PEER_GONE and self.on_peer_gone is not None:
                self.on_peer_gone(peer)
        except Exception as exc:  # noqa: BLE001 - a request must never end silently
            log.exception("request room=%s peer=%s failed unexpectedly", request.room, peer.peer_id)
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, Reason.INTERNAL,
                        f"internal error: {type(exc).__name__}")

    async def _move(self, peer: Peer, request: Request, chunk: Chunk) -> None:
        """Move one chunk's KV rows; after the last, the state and then the aux slot (one worker hop)."""
        source = self.engine.source
        state, aux = slot_copies(source, peer, request, chunk) if chunk.last else ([], [])
        notice = chunk_notice(request, chunk)
        jobs = [build_job(source, peer, request, chunk, notify=not (state or aux))]
        extras = [(kind, copies) for kind, copies in (("state", state), ("aux", aux)) if copies]
        jobs += [slot_job(source, peer, copies, notice if i == len(extras) - 1 else None)
                 for i, (_, copies) in enumerate(extras)]
        if request.state != common_pb2.TRANSFER_STATE_TRANSFERRING:
            request.state = common_pb2.TRANSFER_STATE_TRANSFERRING
            peer.publish(request.status())
        results = await peer.lane.run(run_jobs, self.engine.executor, peer.peer_id, jobs,
                                      timeout=self.limits.engine_timeout, what=f"room {request.room} chunk {chunk.index}",
                                      drain=self.limits.drain_timeout, tag=(request.room, request.generation))
        result = results[0]
        request.bytes += result.bytes
        request.descriptors += result.descriptors
        self.metrics.bytes_moved.inc(result.bytes)
        self.metrics.descriptors.inc(result.descriptors)
        self.metrics.chunks.inc()
        self.metrics.pack_fallbacks.inc(int(result.fallback))
        self.metrics.notifications.inc(int(any(r.notified for r in results)))
        for (kind, copies), done in zip(extras, results[1:], strict=True):
            self._count(request, kind, copies, done)

    def _count(self, request: Request, kind: str, copies: list[SlotCopy], result: TransferResult) -> None:
        """Per-kind bytes and descriptors of an aux or state job, on the request and in metrics."""
        self.metrics.extra_descriptors.labels(kind=kind).inc(result.descriptors)
        if kind == "aux":
            request.aux_bytes += result.bytes
            request.aux_descriptors += result.descriptors
            self.metrics.aux_bytes.inc(result.bytes)
            return
        request.state_bytes += result.bytes
        request.state_descriptors += result.descriptors
        self.metrics.state_bytes.inc(result.bytes)
        entries = self.engine.source.info.state_entries
        for c in copies:
            whole = len(c.segments) == 1 and c.segments[0].length == c.src_item_len == c.dst_item_len
            split = ("replicated" if entries[c.src_entry].tensors[c.src_tensor].dim == 0
                     else "whole" if whole else "sliced")
            self.metrics.state_items.labels(split=split).inc(len(c.items))

    async def stop(self, peer: Peer, request: Request, reason: Reason, message: str) -> bool:
        """Cancel an open request with ``reason``; True once no chunk of it is inside the engine.

        It waits up to ``drain_timeout`` for an in-flight chunk (not at all when the peer's
        lane is stuck), and then the request is terminal in any case: FAILED with ``reason``
        is published exactly once, before any stream of the peer is ended. A request that
        already failed while its chunk was still in the engine (DEADLINE_EXCEEDED) drains too.
        """
        task = request.task
        if task is not None and not request.terminal:
            if request.cancel_reason is None:
                request.cancel_reason = (reason, message)
            task.cancel()
            if not peer.lane.stuck:
                await asyncio.wait([task], timeout=self.limits.drain_timeout + 1.0)
        if not request.terminal:
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, reason, message)
        return await drained(peer, request.room, request.generation, self.limits.drain_timeout)


__all__ = ["TransferRunner", "build_job", "chunk_notice", "drained", "run_jobs", "slot_copies", "slot_job"]
