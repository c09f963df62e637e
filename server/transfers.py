"""Per-request transfer tasks: match chunks, plan with ``plan_chunk``, run the executor off-loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdproto.dcp import plan_chunk
from pdproto.dcp.layers import EntryRole
from pdproto.errors import PdprotoError, Reason
from pdproto.transfer import LayerSpan, Segment, TransferExecutor, TransferJob, TransferResult
from pdproto.transfer.notice import ChunkNotice, encode_chunk_notice
from pdproto.v1 import common_pb2

from .engine import Chunk, KvSource, PrefillEngine
from .metrics import ServiceMetrics
from .registry import Limits, Peer, Request

log = logging.getLogger("pdproto_server.transfers")

_T = TypeVar("_T")


def build_job(source: KvSource, peer: Peer, request: Request, chunk: Chunk) -> TransferJob:
    """The executor job that moves ``chunk`` into ``request``'s pages: one segment per entry role.

    The negotiated layouts go to the planner as they are, and its runs go to the
    executor as they are: nothing here is per token. The job carries the chunk's
    completion notice; a rank that owns no rows of the chunk still gets a row-less job,
    so an engine with notifications (NIXL) tells the decode the chunk finished.
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
        layers = tuple(
            LayerSpan(src_ptr=source.buffers[p.src_entry].addr,
                      dst_ptr=peer.registration.kv_buffers[p.dst_entry].ptr,
                      row_bytes=p.src_token_bytes)
            for p in d.pairings if p.role is role
        )
        if layers and runs.shape[0]:
            segments.append(Segment(runs, layers))
    notice = encode_chunk_notice(ChunkNotice(request.room, request.generation, chunk.index, chunk.last))
    return TransferJob(segments=tuple(segments), pack=True, notification=notice)


def run_job(executor: TransferExecutor, peer_id: str, job: TransferJob) -> TransferResult:
    """Blocking: execute a chunk's job (runs on the worker pool, never on the loop)."""
    return executor.execute(peer_id, job)


class TransferRunner:
    """Owns request tasks: starts them, finishes every one in SUCCESS or FAILED with a reason."""

    def __init__(self, engine: PrefillEngine, metrics: ServiceMetrics, limits: Limits,
                 pool: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits
        self.pool = pool
        self.on_peer_gone: Callable[[Peer], None] | None = None
        """Called when the executor reports the peer dead, so its other requests fail now."""

    async def blocking(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a blocking call on the pool; on cancellation, let it finish before re-raising."""
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # A copy in progress cannot be interrupted; wait so the peer's memory
            # is not disconnected (or reused by the next generation) under it.
            await asyncio.wait([fut], timeout=self.limits.drain_timeout)
            raise

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
        """Move a request to a terminal state once, publish it and count the outcome."""
        if request.terminal:
            return
        request.state = state
        if reason is not None:
            request.failure_code = reason.code
            request.failure_reason = message or reason.code
        request.finished_at = time.monotonic()
        if peer.open.get(request.room) is request:
            del peer.open[request.room]
        self.metrics.inflight.dec()
        self.metrics.requests.labels(outcome=reason.code if reason is not None else "SUCCESS").inc()
        peer.publish(request)

    async def _run(self, peer: Peer, request: Request) -> None:
        """The request's life: wait for each chunk, plan, transfer, report."""
        room_log = self.engine.claim(request.room)
        index = 0
        try:
            while True:
                chunk = await room_log.wait_chunk(index, time.monotonic() + self.limits.match_timeout)
                if not request.transfer.is_dummy:
                    job = build_job(self.engine.source, peer, request, chunk)
                    if request.state != common_pb2.TRANSFER_STATE_TRANSFERRING:
                        request.state = common_pb2.TRANSFER_STATE_TRANSFERRING
                        peer.publish(request)
                    result = await self.blocking(run_job, self.engine.executor, peer.peer_id, job)
                    request.bytes += result.bytes
                    request.descriptors += result.descriptors
                    self.metrics.bytes_moved.inc(result.bytes)
                    self.metrics.descriptors.inc(result.descriptors)
                    self.metrics.chunks.inc()
                    self.metrics.pack_fallbacks.inc(int(result.fallback))
                    self.metrics.notifications.inc(int(result.notified))
                request.chunks_done += 1
                if chunk.last:
                    self.finish(peer, request, common_pb2.TRANSFER_STATE_SUCCESS)
                    return
                peer.publish(request)
                index += 1
        except asyncio.CancelledError:
            reason, message = request.cancel_reason or (Reason.ABORTED, "request cancelled")
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, reason, message)
            raise
        except PdprotoError as exc:
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, exc.reason, exc.message)
            if exc.reason is Reason.PEER_GONE and self.on_peer_gone is not None:
                self.on_peer_gone(peer)
        except Exception as exc:  # noqa: BLE001 - a request must never end silently
            log.exception("request room=%s peer=%s failed unexpectedly", request.room, peer.peer_id)
            self.finish(peer, request, common_pb2.TRANSFER_STATE_FAILED, Reason.INTERNAL,
                        f"internal error: {type(exc).__name__}")

    async def stop(self, request: Request, reason: Reason, message: str) -> None:
        """Cancel an open request with ``reason`` and wait until its in-flight chunk drained."""
        task = request.task
        if request.terminal or task is None:
            return
        if request.cancel_reason is None:
            request.cancel_reason = (reason, message)
        task.cancel()
        await asyncio.wait([task], timeout=self.limits.drain_timeout + 1.0)


__all__ = ["TransferRunner", "build_job", "run_job"]
