"""Status streams: WatchStatus, the subscription every stream (WatchStatus, Session) starts with, and the
snapshot allowance that bounds what asking for statuses costs the server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING

from pdproto.errors import (InvalidFieldError, NotFoundError, PdprotoError, Reason, RequestFailedError,
                            ResourceLimitError, ShuttingDownError)
from pdproto.v1 import handshake_service_pb2 as hs, transfer_pb2

from .feed import StatusFeed
from .registry import Allowance, Peer, Snapshot, StatusSink, retry_after_ms

if TYPE_CHECKING:
    from .core import HandshakeCore

log = logging.getLogger("pdproto_server.streams")


class Streams:
    """A peer's status streams: what each starts with, when they end and why, and what snapshots cost."""

    def __init__(self, core: HandshakeCore) -> None:
        self.core = core
        self.limits, self.metrics, self.registry = core.limits, core.metrics, core.registry
        self.anonymous = Allowance()
        """The snapshot allowance every ``Describe`` caller without a peer credential (nor the operator
        token) shares: one peer's, since no peer is named to charge."""

    def ended_reason(self, peer: Peer) -> PdprotoError:
        """Why ``peer``'s streams end: the server drains, the peer is gone, or it was removed."""
        if self.core.streams_closed or self.core.shutting_down:
            return ShuttingDownError("the prefill is shutting down; its streams have ended")
        if peer.gone_at is not None:
            return RequestFailedError(f"peer {peer.peer_id} is gone; re-register", reason=Reason.PEER_GONE,
                                      metadata={"peerId": peer.peer_id})
        return NotFoundError(f"peer {peer.peer_id!r} was deregistered or replaced by a new registration",
                             reason=Reason.PEER_NOT_FOUND, metadata={"peerId": peer.peer_id})

    def subscribe(self, peer: Peer, feed: StatusSink, rooms: Collection[int] = ()) -> tuple[Snapshot, bool]:
        """Add a status stream to ``peer``: its snapshot (of ``rooms``, if given), taken in the same step
        (nothing missed or sent twice), and whether the peer's streams have ended already (then it is not
        added).

        Raises TOO_MANY_STREAMS at ``max_streams_per_peer`` (WatchStatus and Session streams together).
        """
        if len(peer.feeds) >= self.limits.max_streams_per_peer:
            raise ResourceLimitError(
                f"peer {peer.peer_id} has {len(peer.feeds)} status streams open "
                f"(limit {self.limits.max_streams_per_peer})",
                reason=Reason.TOO_MANY_STREAMS,
                metadata={"limit": self.limits.max_streams_per_peer, "streams": len(peer.feeds)})
        ended = peer.streams_ended or self.core.streams_closed
        self.draw_snapshot(peer, peer.snapshot_size(rooms), "a new stream's snapshot")
        if not ended:
            peer.feeds.add(feed)
        return peer.snapshot(rooms), ended

    def draw_snapshot(self, peer: Peer | None, statuses: int, what: str) -> None:
        """Charge ``statuses`` about to be sent to the peer's allowance (``anonymous`` for None).

        Sending a snapshot costs the server far more than asking for one (4,096 statuses: 5 to
        15 ms of CPU), so a peer opening streams, or asking ``Describe`` for its statuses, in a
        loop would take the loop from everyone else. Raises TOO_MANY_STREAMS, with the seconds
        to wait, past ``Limits.snapshot_rate``.
        """
        if not statuses or self.limits.snapshot_rate <= 0:
            return
        capacity, rate = self.limits.snapshot_allowance
        allowance = self.anonymous if peer is None else peer.snapshots
        wait = allowance.take(statuses, capacity, rate, time.monotonic())
        if wait:
            self.metrics.snapshots_refused.inc()
            if peer is not None:
                peer.snapshots_refused += 1
            who, whom = ("callers without a peer credential", "they") if peer is None else \
                (f"peer {peer.peer_id}", "the peer")
            raise ResourceLimitError(
                f"{who} asked for statuses faster than the server sends them ({what}: {statuses} statuses); "
                f"{whom} may be sent {capacity:.0f} at once and {rate:.0f} per second "
                f"(--snapshot-rate {self.limits.snapshot_rate:g} full snapshots of {self.limits.kept_per_peer}); "
                f"retry in {wait:.2f} s",
                reason=Reason.TOO_MANY_STREAMS, metadata={"statuses": statuses, "retryAfterMs": retry_after_ms(wait)})

    async def watch(self, request: hs.WatchStatusRequest) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """Current statuses of the peer's (matching) requests, then every change until the peer goes.

        Each request's terminal status is sent exactly once per stream (``pdproto_server/feed.py``).
        """
        peer = self.registry.peer(request.peer_id, request.peer_credential)
        most = self.limits.kept_per_peer
        if len(request.rooms) > most:
            # More rooms than the peer can have open and kept: a filter that large only costs the loop
            # time and memory to build (1.3 million rooms: 0.2 s and 110 MB, for as long as the stream).
            raise InvalidFieldError("rooms", f"{len(request.rooms)} rooms, more than the {most} a peer can have "
                                    "open and kept (--max-inflight + --max-finished)",
                                    metadata={"rooms": len(request.rooms), "limit": most})
        task = asyncio.current_task()
        delivered = False

        def cut() -> None:
            # The peer is over and so counts toward no limit: a client that reads nothing
            # must not keep its stream (and its handler) after drain_timeout.
            if not delivered and task is not None and not task.done():
                log.info("a status stream of peer %s took nothing for %.0f s after the peer ended; cutting it",
                         peer.peer_id, self.limits.drain_timeout)
                task.cancel()

        def cut_later() -> None:
            asyncio.get_running_loop().call_later(self.limits.drain_timeout, cut)

        def cut_now() -> None:
            log.warning("a status stream of peer %s left more than %d statuses unread; ending it",
                        peer.peer_id, self.limits.max_unread)
            peer.feeds.discard(feed)
            # A stream waiting for a status ends with the feed's reason once woken; one stuck in a
            # write the client never takes is cancelled.
            if not feed.waiting and task is not None and task is not asyncio.current_task() and not task.done():
                task.cancel()

        feed = StatusFeed(request.rooms, on_close=cut_later, unread=self.limits.max_unread, on_behind=cut_now)
        snapshot, ended = self.subscribe(peer, feed, request.rooms)
        feed.finals(snapshot.finished)
        for status in snapshot.open:
            feed.push(status)
        if ended:
            feed.close()
        try:
            async for status in feed:
                yield status
            delivered = True
        finally:
            peer.feeds.discard(feed)


__all__ = ["Streams"]
