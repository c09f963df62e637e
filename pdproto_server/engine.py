"""The prefill engine's in-process API: hand over the pools once, then report chunks and poll rooms.

How a prefill scheduler uses it: ``pdproto_server/README.md``, "The prefill engine API". The
service matches each room's chunks with the decode peers' ``SubmitTransfer``; whichever side
arrives first waits, with a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from pdproto.errors import (
    InvalidFieldError,
    PlanError,
    Reason,
    ShuttingDownError,
)
from pdproto.transfer import Buffer, TransferExecutor
from pdproto.v1 import common_pb2, server_info_pb2

I64 = npt.NDArray[np.int64]
T = TypeVar("T")


StateSlots = tuple[tuple[int, ...], ...]
"""Per state entry (in ``info.state_entries`` order), the slot (recurrent) or pages (sliding window)."""

_STATE = (common_pb2.TRANSFER_STATE_BOOTSTRAPPING, common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT,
          common_pb2.TRANSFER_STATE_TRANSFERRING, common_pb2.TRANSFER_STATE_SUCCESS)
TERMINAL = frozenset({common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED})


NUMPY_FROM = 256
"""Page lists at least this long are bounded with numpy; shorter ones (most) in plain Python, which is cheaper."""


def page_extent(pages: Sequence[int] | I64) -> tuple[int, int]:
    """The smallest and largest page of a list or array ((0, 0) when empty)."""
    if len(pages) >= NUMPY_FROM:
        array = np.asarray(pages)
        return int(array.min()), int(array.max())
    listed = pages.tolist() if isinstance(pages, np.ndarray) else pages
    return (min(listed), max(listed)) if len(listed) else (0, 0)


class Deadlines(Generic[T]):
    """Things to look at again at a given time, so that housekeeping costs what falls due, not what is kept.

    The service keeps finished rooms, final statuses, gone peers and detached sessions for a
    while; a tick that walked all of them would cost in proportion to everything retained (at
    180,000 retained requests a tick took about 200 ms of the event loop). Instead each thing is
    entered once, with its due time, and a tick takes only the entries due (``take_due``); it then
    looks at each one again (a room may have been replaced, a session resumed) and drops it or
    enters it again for later. ``work`` counts the entries taken, so tests can check that a tick's
    cost follows what expired.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._order = itertools.count()
        self.work = 0
        """Entries taken so far (each taken once)."""

    def add(self, due: float, item: T) -> None:
        """Look at ``item`` again at ``due`` (monotonic seconds)."""
        heapq.heappush(self._heap, (due, next(self._order), item))

    def take_due(self, now: float) -> list[T]:
        """Every item due at or before ``now``, oldest first, removed from the heap."""
        out: list[T] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        self.work += len(out)
        return out

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class KvSource:
    """The prefill pools: one registered buffer per KV entry, aux buffer and state tensor, and the topology."""

    buffers: tuple[Buffer, ...]
    """KV source buffers, in entry order, already registered with the executor."""
    info: server_info_pb2.PrefillServerInfo
    """Published topology; ``page_size`` and ``kv_entries`` describe ``buffers``, ``aux_entries``
    and ``state_entries`` describe ``aux`` and ``state``."""
    aux: tuple[Buffer, ...] = ()
    """One registered buffer per ``info.aux_entries`` entry."""
    state: tuple[tuple[Buffer, ...], ...] = ()
    """Per ``info.state_entries`` entry, one registered buffer per tensor."""

    def __post_init__(self) -> None:
        info = self.info
        if info.page_size <= 0:
            raise InvalidFieldError("info.page_size", "page_size must be > 0")
        if len(info.kv_entries) != len(self.buffers) or not self.buffers:
            raise InvalidFieldError("buffers", f"{len(self.buffers)} buffers for {len(info.kv_entries)} KV entries",
                                    metadata={"buffers": len(self.buffers), "entries": len(info.kv_entries)})
        if len(self.aux) != len(info.aux_entries):
            raise InvalidFieldError("aux", f"{len(self.aux)} buffers for {len(info.aux_entries)} aux entries")
        if len(self.state) != len(info.state_entries):
            raise InvalidFieldError("state", f"{len(self.state)} buffer lists for"
                                    f" {len(info.state_entries)} state entries")
        for e, (entry, bufs) in enumerate(zip(info.state_entries, self.state, strict=True)):
            if len(bufs) != len(entry.tensors):
                raise InvalidFieldError(f"state[{e}]", f"{len(bufs)} buffers for {len(entry.tensors)} tensors")
        # (field, its description with an item_len, its buffer) of every KV entry, aux entry and state tensor
        described: list[tuple[str, Any, Buffer]] = [
            *((f"info.kv_entries[{i}]", k, b) for i, (k, b) in enumerate(zip(info.kv_entries, self.buffers))),
            *((f"info.aux_entries[{i}]", a, b) for i, (a, b) in enumerate(zip(info.aux_entries, self.aux))),
            *((f"info.state_entries[{e}].tensors[{t}]", tensor, buf)
              for e, (entry, bufs) in enumerate(zip(info.state_entries, self.state))
              for t, (tensor, buf) in enumerate(zip(entry.tensors, bufs)))]
        for field, item, buf in described:
            if item.item_len == 0 or buf.length < item.item_len:
                raise InvalidFieldError(f"{field}.item_len", "item_len must be > 0 and fit in the buffer",
                                        metadata={"itemLen": item.item_len, "bufferBytes": buf.length})

    def aux_slots(self) -> int:
        """Aux slots every aux buffer holds (the smallest decides)."""
        return min(b.length // a.item_len for b, a in zip(self.aux, self.info.aux_entries, strict=True))

    def state_items(self, entry: int) -> int:
        """Slots (or pages) every tensor of state ``entry`` holds (the smallest decides)."""
        return min(b.length // t.item_len
                   for b, t in zip(self.state[entry], self.info.state_entries[entry].tensors, strict=True))

    @functools.cached_property
    def virtual_page(self) -> int:
        """Global tokens per source page index (``page_size * dcp.size``; dense: the page size)."""
        return int(self.info.page_size) * max(int(self.info.dcp.size), 1)

    @functools.cached_property
    def num_pages(self) -> int:
        """Pages every entry holds (the smallest buffer decides; computed once, every chunk is checked with it)."""
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
    state_slots: StateSlots | None = None
    """Last chunk only: the room's state slots, per state entry."""
    aux_slot: int | None = None
    """Last chunk only: the room's aux slot."""
    positions: I64 | None = None
    """Each source page's page of the request, increasing (a KV-shard rank's scattered pages);
    None: consecutive from ``page_offset``."""


@dataclass(frozen=True)
class RoomStatus:
    """A room over every decode request for it: its state, the first failure's reason, the bytes moved."""

    state: int
    """``TransferState`` value, as ``PrefillEngine.poll`` returns it."""
    failure_code: str = ""
    """Reason code of the failure (``ABORTED`` for an engine abort); empty unless FAILED."""
    failure_reason: str = ""
    """Reason text a person can act on; empty unless FAILED."""
    kv_bytes: int = 0
    """KV bytes written into every decode so far."""
    aux_bytes: int = 0
    """Aux bytes written so far."""
    state_bytes: int = 0
    """State bytes written so far."""
    requests: int = 0
    """Decode requests for the room (fan-out: one per decode rank the room feeds)."""


@dataclass
class Outcome:
    """What a room knows of a decode's request for it: its state, why it failed, the bytes it moved.

    A request (``registry.Request``) is one while it runs; a finished one leaves just this (not its pages).
    """

    state: int = common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT
    """``TransferState`` value."""
    failure_code: str = ""
    """Reason code (``pdproto.errors.Reason`` name) once FAILED; empty otherwise."""
    failure_reason: str = ""
    """Reason text once FAILED; empty otherwise."""
    bytes: int = 0
    """KV bytes written so far."""
    aux_bytes: int = 0
    """Aux bytes written so far."""
    state_bytes: int = 0
    """State bytes written so far."""

    @property
    def terminal(self) -> bool:
        """SUCCESS or FAILED."""
        return self.state in TERMINAL


@dataclass
class RoomLog:
    """The chunks of one room so far; requests wait for the next one in ``waiters``."""

    room: int
    chunks: list[Chunk] = field(default_factory=list)
    tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    claimed: bool = False
    """A decode peer has submitted for this room (so it is not an orphan)."""
    waiters: list[Callable[[], None]] = field(default_factory=list)
    """Requests waiting for the next chunk (``pdproto_server/runner.py``), called once on the next change."""
    prefix_len: int | None = None
    """The decode's prefix (tokens it already holds), from the first request for the room."""
    expected: int = 1
    """Decode ranks that submit for the room on this prefill rank (SGLang required_dst_info_num)."""
    requests: dict[str, Outcome] = field(default_factory=dict)
    """The decodes' requests for the room, by peer id."""
    aborted: str = ""
    """Why the engine aborted the room; empty unless it did."""

    def status(self) -> RoomStatus:
        """The room's state, the first failed request's reason and the bytes moved, over every request."""
        # One C-level copy: the engine's thread reads while the loop adds requests.
        requests = list(self.requests.values())
        failed = common_pb2.TRANSFER_STATE_FAILED
        code = reason = ""
        state: int
        if self.aborted:
            state, code = failed, Reason.ABORTED.name
            reason = f"the prefill aborted room {self.room}: {self.aborted}"
        elif any(r.state == failed for r in requests):
            first = next(r for r in requests if r.state == failed)
            state, code, reason = failed, first.failure_code, first.failure_reason
        elif len(requests) < self.expected:
            state = common_pb2.TRANSFER_STATE_BOOTSTRAPPING
        else:
            state = min((r.state for r in requests), key=lambda s: _STATE.index(s) if s in _STATE else 0)
        return RoomStatus(state, code, reason, kv_bytes=sum(r.bytes for r in requests),
                          aux_bytes=sum(r.aux_bytes for r in requests),
                          state_bytes=sum(r.state_bytes for r in requests), requests=len(requests))

    @property
    def finished(self) -> bool:
        """The last chunk has arrived."""
        return self.finished_at is not None

    def _notify(self) -> None:
        """A chunk arrived or the room was aborted: call (once) each request waiting on the room."""
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            waiter()


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
        self.on_abort: Callable[[RoomLog], None] | None = None
        """Called (loop thread) when the engine aborts a room; the service fails its requests."""
        self._aborted: dict[int, str] = {}
        """Rooms the engine aborted, readable at once from any thread (the loop applies them later)."""
        self.orphan_after = 30.0
        """Seconds an unclaimed room (or a claimed one nobody finishes) is kept (the service sets it)."""
        self.keep_finished = 60.0
        """Seconds a finished room is kept (the service sets it)."""
        self.deadlines: Deadlines[RoomLog] = Deadlines()
        """When to look at each room again: ``expire`` takes only what is due."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the service's event loop (called by the service)."""
        self._loop = loop

    def room(self, room: int) -> RoomLog:
        """The room's log, created on first use (loop thread only)."""
        log = self.rooms.get(room)
        if log is None:
            log = self._new_log(RoomLog(room))
        return log

    def _new_log(self, log: RoomLog) -> RoomLog:
        """Keep ``log`` as its room's log, and look at it again once it could be an orphan."""
        self.rooms[log.room] = log
        self.deadlines.add(log.created + self.orphan_after, log)
        return log

    def _finished(self, log: RoomLog) -> None:
        log.finished_at = time.monotonic()
        self.deadlines.add(log.finished_at + self.keep_finished, log)

    def claim(self, room: int, *, peer_id: str = "", request: Outcome | None = None,
              prefix_len: int | None = None, expected: int = 1) -> RoomLog:
        """The room's log, marked as wanted by a decode and tracking its request (loop thread only)."""
        log = self.room(room)
        if request is not None:
            log.requests[peer_id] = request
        if log.prefix_len is None:
            log.prefix_len = prefix_len
        log.expected = max(log.expected, expected)
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
        low, high = page_extent(pages)
        if pages.size and (low < 0 or high >= self.source.num_pages):
            raise PlanError(f"room {room}: source page out of range 0..{self.source.num_pages - 1}",
                            reason=Reason.PLAN_BAD_OFFSET,
                            metadata={"room": room, "numPages": self.source.num_pages})

    def _validate_slots(self, room: int, state_slots: Sequence[Sequence[int]] | None,
                        aux_slot: int | None) -> tuple[StateSlots | None, int | None]:
        """Check the last chunk's aux and state slots against the prefill's own buffers."""
        src = self.source
        if aux_slot is not None and src.aux and not 0 <= aux_slot < src.aux_slots():
            raise InvalidFieldError("aux_slot", f"room {room}: aux slot {aux_slot} is outside the prefill's"
                                    f" aux buffers (0..{src.aux_slots() - 1})", metadata={"room": room})
        if state_slots is None:
            return None, aux_slot
        slots = tuple(tuple(int(i) for i in entry) for entry in state_slots)
        if len(slots) != len(src.state):
            raise InvalidFieldError("state_slots", f"room {room}: {len(slots)} slot lists for"
                                    f" {len(src.state)} state entries", metadata={"room": room})
        for e, items in enumerate(slots):
            recurrent = src.info.state_entries[e].kind == common_pb2.STATE_KIND_RECURRENT
            n = src.state_items(e)
            if (recurrent and len(items) != 1) or any(not 0 <= i < n for i in items):
                raise InvalidFieldError(
                    f"state_slots[{e}]", f"room {room}: state entry {e} takes "
                    f"{'one slot' if recurrent else 'pages'} in 0..{n - 1}, got {list(items)}",
                    metadata={"room": room, "entry": e})
        return slots, aux_slot

    def submit_chunk(self, room: int, src_pages: Sequence[int] | I64, num_tokens: int, last_chunk: bool, *,
                     state_slots: Sequence[Sequence[int]] | None = None, aux_slot: int | None = None,
                     page_offset: int | Sequence[int] | None = None) -> None:
        """Report a computed chunk of ``room``; thread-safe; non-last chunks must fill their pages.

        The last chunk carries the room's ``state_slots`` (per state entry: one slot, or the
        window's pages) and ``aux_slot``; they move after the room's last KV byte.
        ``page_offset`` places the chunk at that page of the request, for a rank that sends only
        some of its pages (a CP rank's share), or each page at its own page of the request, in
        increasing order (a KV-shard rank's every N-th page); default: after the chunks before it.
        """
        pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        self._validate(room, pages, num_tokens)
        at = None if page_offset is None else np.asarray(page_offset, dtype=np.int64).reshape(-1)
        if at is not None and (at.size not in (1, pages.size) or (at.size and int(at.min()) < 0)
                               or bool(np.any(np.diff(at) <= 0))):
            raise InvalidFieldError("page_offset", f"room {room}: page positions {at.tolist()} must be one "
                                    f"non-negative offset or {pages.size} increasing positions",
                                    metadata={"room": room})
        if not last_chunk and num_tokens != pages.size * self.source.virtual_page:
            raise PlanError(f"room {room}: a non-last chunk must fill its pages ({num_tokens} tokens, "
                            f"{pages.size} pages of {self.source.virtual_page})",
                            reason=Reason.PLAN_BAD_OFFSET, metadata={"room": room, "numTokens": num_tokens})
        if not last_chunk and (state_slots is not None or aux_slot is not None):
            raise InvalidFieldError("state_slots" if state_slots is not None else "aux_slot",
                                    f"room {room}: aux and state slots travel with the last chunk only")
        extras = self._validate_slots(room, state_slots, aux_slot)
        loop = self._loop
        if loop is None:
            raise ShuttingDownError("prefill engine is not attached to a running service",
                                    reason=Reason.SHUTTING_DOWN)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._append(room, pages, num_tokens, last_chunk, extras, at)
        else:
            loop.call_soon_threadsafe(self._append, room, pages, num_tokens, last_chunk, extras, at)

    def _append(self, room: int, pages: I64, num_tokens: int, last: bool,
                extras: tuple[StateSlots | None, int | None] = (None, None), at: I64 | None = None) -> None:
        """Loop-thread half of ``submit_chunk``."""
        log = self.room(room)
        if log.finished:
            # A new prefill of a finished room starts a new generation of its chunks.
            log = self._new_log(RoomLog(room, claimed=log.claimed))
        page_offset = log.tokens // self.source.virtual_page if at is None or not at.size else int(at[0])
        scattered = at is not None and at.size > 1 and int(at[-1] - at[0]) != at.size - 1
        log.chunks.append(Chunk(len(log.chunks), pages, num_tokens, page_offset, last, *extras,
                                positions=at if scattered else None))
        log.tokens += num_tokens
        if last:
            self._finished(log)
        log._notify()

    def decode_prefix_len(self, room: int) -> int | None:
        """Tokens the decode already holds for ``room`` (allocate only the rest); None until a decode submitted."""
        log = self.rooms.get(room)
        return None if log is None else log.prefix_len

    def poll(self, room: int) -> int:
        """The room's ``TransferState``: BOOTSTRAPPING until every expected decode submitted, then
        WAITING_FOR_INPUT, TRANSFERRING, and SUCCESS or FAILED over all of its requests."""
        return self.status(room).state

    def status(self, room: int) -> RoomStatus:
        """``poll`` with why the room failed (the first failed request's reason, or the engine's abort)
        and the bytes moved so far; thread-safe."""
        aborted = self._aborted.get(room)
        if aborted is not None:
            return RoomStatus(common_pb2.TRANSFER_STATE_FAILED, Reason.ABORTED.name,
                              f"the prefill aborted room {room}: {aborted}")
        log = self.rooms.get(room)
        return RoomStatus(common_pb2.TRANSFER_STATE_BOOTSTRAPPING) if log is None else log.status()

    def abort(self, room: int, reason: str) -> None:
        """Fail every decode request of ``room`` (now and later ones) with ABORTED and ``reason``."""
        loop = self._loop
        if loop is None:
            raise ShuttingDownError("prefill engine is not attached to a running service")
        self._aborted[room] = reason or "no reason given"
        loop.call_soon_threadsafe(self._abort, room, self._aborted[room])

    def _abort(self, room: int, reason: str) -> None:
        log = self.room(room)
        log.aborted = reason
        if log.finished_at is None:
            self._finished(log)  # expires like a finished room
        log._notify()
        if self.on_abort is not None:
            self.on_abort(log)

    def release_room(self, room: int) -> None:
        """Forget a room's chunks (the engine freed its pages), and an abort of it; thread-safe."""
        self._aborted.pop(room, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.rooms.pop, room, None)

    def expire(self, now: float | None = None) -> list[int]:
        """Drop rooms no decode claimed within ``orphan_after`` s, rooms finished ``keep_finished`` s ago,
        and claimed rooms the prefill never finished whose every request is over (they waited
        ``orphan_after`` for chunks): a decode naming rooms nobody computes must not grow the map.

        Only rooms that fall due now are looked at (``deadlines``), not every room kept. Returns
        the rooms dropped because no decode claimed them or the prefill never finished them
        (worth a warning); finished rooms that aged out are dropped without one.
        """
        now = time.monotonic() if now is None else now
        dropped = []
        for log in self.deadlines.take_due(now):
            if self.rooms.get(log.room) is not log:
                continue  # released, or replaced by a new prefill of the room
            orphan = not log.claimed and now - log.created >= self.orphan_after
            stale = log.finished_at is not None and now - log.finished_at >= self.keep_finished
            over = all(r.terminal for r in log.requests.values())
            abandoned = log.claimed and now - log.created >= self.orphan_after + self.keep_finished and over
            if orphan or stale or abandoned:
                if not stale:
                    dropped.append(log.room)
                del self.rooms[log.room]
                self._aborted.pop(log.room, None)
            elif log.finished_at is None:
                # Claimed and unfinished: look again once it could count as abandoned.
                self.deadlines.add(max(log.created + self.orphan_after + self.keep_finished, now + 1.0), log)
        return dropped


__all__ = ["TERMINAL", "Chunk", "Deadlines", "KvSource", "Outcome", "PrefillEngine", "RoomLog", "RoomStatus", "StateSlots"]
