"""The prefill engine's in-process API: hand over the KV pool once, then report chunks.

The engine (the prefill scheduler) builds a ``KvSource`` from its registered KV
buffers and calls ``PrefillEngine.submit_chunk`` for every chunk it computes. The
service matches each room's chunks with the decode peers' ``SubmitTransfer``; whichever
side arrives first waits, with a deadline. ``submit_chunk`` is safe from any thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pdproto.errors import DeadlineExceededError, InvalidFieldError, PlanError, Reason, ShuttingDownError
from pdproto.transfer import Buffer, TransferExecutor
from pdproto.v1 import server_info_pb2

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class KvSource:
    """The prefill KV pool: one registered buffer per ``info.kv_entries`` entry, and the topology."""

    buffers: tuple[Buffer, ...]
    """Source buffers, in entry order, already registered with the executor."""
    info: server_info_pb2.PrefillServerInfo
    """Published topology; ``page_size`` and ``kv_entries`` describe ``buffers``."""

    def __post_init__(self) -> None:
        entries = self.info.kv_entries
        if self.info.page_size <= 0:
            raise InvalidFieldError("info.page_size", "page_size must be > 0")
        if len(entries) != len(self.buffers) or not entries:
            raise InvalidFieldError("buffers", f"{len(self.buffers)} buffers for {len(entries)} KV entries",
                                    metadata={"buffers": len(self.buffers), "entries": len(entries)})
        for i, (entry, buf) in enumerate(zip(entries, self.buffers, strict=True)):
            if entry.item_len == 0 or buf.length < entry.item_len:
                raise InvalidFieldError(f"info.kv_entries[{i}].item_len",
                                        "item_len must be > 0 and fit in the buffer",
                                        metadata={"itemLen": entry.item_len, "bufferBytes": buf.length})

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.info.page_size)

    @property
    def virtual_page(self) -> int:
        """Global tokens per source page index (``page_size * dcp.size``; dense: the page size)."""
        return self.page_size * max(int(self.info.dcp.size), 1)

    @property
    def num_pages(self) -> int:
        """Pages every entry holds (the smallest buffer decides)."""
        return min(b.length // e.item_len for b, e in zip(self.buffers, self.info.kv_entries, strict=True))


@dataclass(frozen=True)
class Chunk:
    """One computed chunk of a room: its source pages and where it sits in the request."""

    index: int
    """0-based chunk number within the room."""
    src_pages: I64
    """Source pages holding this chunk's tokens."""
    num_tokens: int
    """Tokens in this chunk."""
    page_offset: int
    """Pages of the request before this chunk (the planner's ``src_page_offset``)."""
    last: bool
    """No chunk follows."""


@dataclass
class RoomLog:
    """The chunks of one room so far; request tasks wait on ``changed``."""

    room: int
    chunks: list[Chunk] = field(default_factory=list)
    tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    claimed: bool = False
    """A decode peer has submitted for this room (so it is not an orphan)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        """The last chunk has arrived."""
        return self.finished_at is not None

    def _notify(self) -> None:
        # Wake every waiter, then arm a fresh event for the next change.
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_chunk(self, index: int, deadline: float) -> Chunk:
        """The chunk at ``index``; raises MATCH_TIMEOUT if it does not arrive by ``deadline`` (monotonic)."""
        while index >= len(self.chunks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"room {self.room}: chunk {index} did not arrive from the prefill engine in time",
                    reason=Reason.MATCH_TIMEOUT, metadata={"room": self.room, "chunk": index})
            event = self.changed
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                continue
        return self.chunks[index]


class PrefillEngine:
    """What the prefill scheduler talks to: KV pool once, then ``submit_chunk`` per chunk."""

    def __init__(self, source: KvSource, executor: TransferExecutor, *, prefill_rank: int = 0) -> None:
        self.source = source
        self.executor = executor
        self.prefill_rank = prefill_rank
        self.rooms: dict[int, RoomLog] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_claim: Callable[[int], None] | None = None
        """Called (loop thread) the first time a decode submits for a room; synthetic sources use it."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the service's event loop (called by the service)."""
        self._loop = loop

    def room(self, room: int) -> RoomLog:
        """The room's log, created on first use (loop thread only)."""
        log = self.rooms.get(room)
        if log is None:
            log = self.rooms[room] = RoomLog(room)
        return log

    def claim(self, room: int) -> RoomLog:
        """The room's log, marked as wanted by a decode (loop thread only)."""
        log = self.room(room)
        if not log.claimed:
            log.claimed = True
            if self.on_claim is not None:
                self.on_claim(room)
        return log

    def _validate(self, room: int, pages: I64, num_tokens: int) -> None:
        ps = self.source.virtual_page
        if room < 0:
            raise InvalidFieldError("room", "room must be >= 0", metadata={"room": room})
        if num_tokens < 0 or num_tokens > pages.size * ps:
            raise PlanError(f"room {room}: {num_tokens} tokens do not fit {pages.size} pages of {ps}",
                            reason=Reason.PLAN_TOKENS_BEYOND_SOURCE,
                            metadata={"room": room, "numTokens": num_tokens, "pages": pages.size})
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.source.num_pages):
            raise PlanError(f"room {room}: source page out of range 0..{self.source.num_pages - 1}",
                            reason=Reason.PLAN_BAD_OFFSET,
                            metadata={"room": room, "numPages": self.source.num_pages})

    def submit_chunk(self, room: int, src_pages: Sequence[int] | I64, num_tokens: int, last_chunk: bool) -> None:
        """Report a computed chunk of ``room``; thread-safe; non-last chunks must fill their pages."""
        pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        self._validate(room, pages, num_tokens)
        if not last_chunk and num_tokens != pages.size * self.source.virtual_page:
            raise PlanError(f"room {room}: a non-last chunk must fill its pages ({num_tokens} tokens, "
                            f"{pages.size} pages of {self.source.virtual_page})",
                            reason=Reason.PLAN_BAD_OFFSET, metadata={"room": room, "numTokens": num_tokens})
        loop = self._loop
        if loop is None:
            raise ShuttingDownError("prefill engine is not attached to a running service",
                                    reason=Reason.SHUTTING_DOWN)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._append(room, pages, num_tokens, last_chunk)
        else:
            loop.call_soon_threadsafe(self._append, room, pages, num_tokens, last_chunk)

    def _append(self, room: int, pages: I64, num_tokens: int, last: bool) -> None:
        """Loop-thread half of ``submit_chunk``."""
        log = self.room(room)
        if log.finished:
            # A new prefill of a finished room starts a new generation of its chunks.
            log = self.rooms[room] = RoomLog(room, claimed=log.claimed)
        page_offset = log.tokens // self.source.virtual_page
        log.chunks.append(Chunk(len(log.chunks), pages, num_tokens, page_offset, last))
        log.tokens += num_tokens
        if last:
            log.finished_at = time.monotonic()
        log._notify()

    def release_room(self, room: int) -> None:
        """Forget a room's chunks (the engine freed its pages); thread-safe."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.rooms.pop, room, None)

    def expire(self, *, orphan_after: float, keep_finished: float) -> list[int]:
        """Drop rooms no decode claimed within ``orphan_after`` s, or finished ``keep_finished`` s ago."""
        now = time.monotonic()
        dropped = []
        for room, log in list(self.rooms.items()):
            orphan = not log.claimed and now - log.created > orphan_after
            stale = log.finished_at is not None and now - log.finished_at > keep_finished
            if orphan or stale:
                dropped.append(room)
                del self.rooms[room]
        return dropped


__all__ = ["Chunk", "KvSource", "PrefillEngine", "RoomLog"]
