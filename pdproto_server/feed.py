"""What one status stream still has to send: every change once, each request's terminal status exactly once.

A stream starts with a snapshot of the peer's requests, taken in the same step that
subscribes it (no await in between), so every later change is after the snapshot and
none is missed. A request that was terminal in the snapshot never changes again, and one
that was open sends its terminal status through the feed once: ``RequestRunner.finish``
publishes it once. ``close`` marks the end, and the stream still sends everything queued
before it: a peer deregistered while its stream is sending the snapshot still delivers
every FAILED.

A reader that falls behind does not make the feed grow with every progress update:
above ``limit`` queued statuses the feed keeps only the newest status of each request
generation, in the order of their last change. A terminal status is always the newest of
its generation, so it is never dropped; the queue then holds at most one status per
request generation the peer has (open or finished). Finished generations keep coming while
the peer's own submits (on other calls) finish, so a reader that takes nothing would grow
it for good: past ``unread`` queued statuses the feed is ended with ``UNAVAILABLE`` (watch
again: a new stream starts from a snapshot).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterable

from pdproto.errors import PdprotoError, Reason, UnavailableError
from pdproto.v1 import transfer_pb2

Status = transfer_pb2.TransferStatus


class StatusFeed:
    """One subscriber's queue of statuses: in order, coalesced per request generation under backlog."""

    def __init__(self, rooms: Collection[int] = (), *, limit: int = 1024, unread: int = 0,
                 on_close: Callable[[], None] | None = None,
                 on_behind: Callable[[], None] | None = None) -> None:
        self._rooms = frozenset(rooms)
        self._finals: deque[bytes] = deque()
        """The snapshot's kept final statuses, serialized, sent before anything in ``_items``."""
        self._items: deque[Status] = deque()
        self._limit = max(1, min(limit, unread) if unread else limit)
        self._unread = unread
        self._closed = False
        self._wake = asyncio.Event()
        self._on_close = on_close
        self._on_behind = on_behind
        self.behind: PdprotoError | None = None
        """Why the feed was ended unread (``unread`` exceeded); its stream ends with it."""
        self.waiting = False
        """Its stream waits for a status (not in a write): waking it is enough to end it."""

    def finals(self, blobs: Iterable[bytes]) -> None:
        """Queue the snapshot's kept final statuses as the peer keeps them (serialized, of this
        stream's rooms); they go out first, so this comes before any ``push``. Each is parsed only
        once it is sent: a stream opened and dropped at once costs next to nothing for them."""
        self._finals.extend(blobs)
        self._wake.set()

    def push(self, status: Status) -> None:
        """Queue a status (ignored when it is for a room this stream did not ask for)."""
        if self._closed or (self._rooms and status.room not in self._rooms):
            return
        self._items.append(status)
        if len(self._items) > self._limit or (self._unread and self.pending > self._unread):
            self._compact()
            if self._unread and self.pending > self._unread:
                self._fell_behind()
                return
        self._wake.set()

    def _fell_behind(self) -> None:
        self.behind = UnavailableError(
            f"this status stream was ended: its reader took none of more than {self._unread} queued statuses "
            "(twice what the peer can have open and kept). Watch again: a new stream starts from the "
            "current statuses", reason=Reason.UNAVAILABLE, metadata={"limit": self._unread})
        self._items.clear()
        self._finals.clear()
        self._closed = True
        self._wake.set()
        if self._on_behind is not None:
            self._on_behind()

    def _compact(self) -> None:
        """Keep the newest status per (room, generation), ordered by when each last changed."""
        newest: dict[tuple[int, int], Status] = {}
        for status in self._items:
            key = (status.room, status.generation)
            newest.pop(key, None)
            newest[key] = status
        self._items = deque(newest.values())
        # Still above the limit: every queued status is a distinct request; let the bound follow.
        self._limit = max(self._limit, 2 * len(self._items))

    def close(self) -> None:
        """No more statuses: the stream ends after sending what is queued."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._on_close is not None:
            self._on_close()

    @property
    def attached(self) -> bool:
        """Its WatchStatus stream runs (the feed leaves the peer's set when that stream ends)."""
        return not self._closed

    @property
    def pending(self) -> int:
        """Statuses queued and not yet sent."""
        return len(self._finals) + len(self._items)

    async def __aiter__(self) -> AsyncIterator[Status]:
        """Every queued status, then each new one, until ``close`` and the queue is empty."""
        while True:
            while self._finals:
                yield Status.FromString(self._finals.popleft())
            while self._items:
                yield self._items.popleft()
            if self.behind is not None:
                raise self.behind
            if self._closed:
                return
            self._wake.clear()
            self.waiting = True
            try:
                await self._wake.wait()
            finally:
                self.waiting = False


__all__ = ["StatusFeed"]
