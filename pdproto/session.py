"""Session stream rules, for both ends: numbering, acknowledgements, windows and replay (pure).

The rules themselves (a session outlives its stream; commands and events numbered 1, 2,
3...; cumulative acknowledgements; the event and command windows; what coalesces): docs/protocol.md,
section 2b. The client's side is ``CommandOutbox``, ``EventInbox`` and ``StatusBook``; the
server's is ``EventLog``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pdproto.errors import InvalidFieldError
from pdproto.v1 import common_pb2, session_pb2, transfer_pb2

DEFAULT_EVENT_WINDOW = 1024
"""Events the server sends beyond the client's acknowledgement when the client asks for none."""
MAX_EVENT_WINDOW = 8192
"""The most a client may ask for (a session keeps up to this many events for a resume)."""
DEFAULT_COMMAND_WINDOW = 256
"""Commands a client may have out (sent, result not acknowledged)."""

TERMINAL_STATES = frozenset({common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED})
"""The states a request generation ends in."""


def is_terminal(status: transfer_pb2.TransferStatus) -> bool:
    """SUCCESS or FAILED."""
    return status.state in TERMINAL_STATES


class CommandOutbox:
    """The client's side of commands: numbers them, keeps each until its result arrives."""

    def __init__(self) -> None:
        self.last_seq = 0
        """Seq of the newest command."""
        self.unanswered: dict[int, session_pb2.SessionCommand] = {}
        """Commands without a result yet, by seq, oldest first."""
        self.unsent: deque[session_pb2.SessionCommand] = deque()
        """Commands to write on the stream, oldest first."""

    def add(self, command: session_pb2.SessionCommand) -> int:
        """Number ``command`` (sets its seq), queue it for sending; returns the seq."""
        self.last_seq += 1
        command.seq = self.last_seq
        self.unanswered[command.seq] = command
        self.unsent.append(command)
        return command.seq

    def take(self) -> list[session_pb2.SessionCommand]:
        """Every queued command, to write now."""
        out = list(self.unsent)
        self.unsent.clear()
        return out

    def answered(self, seq: int) -> session_pb2.SessionCommand | None:
        """A result for ``seq`` arrived: forget the command (None if it was already answered)."""
        return self.unanswered.pop(seq, None)

    def resume(self, applied_seq: int) -> None:
        """A new stream: queue again every unanswered command the server has not applied."""
        self.unsent = deque(c for s, c in self.unanswered.items() if s > applied_seq)

    def restart(self) -> dict[int, int]:
        """A new session (the old one is gone): renumber unanswered commands from 1 and queue them.

        Returns old seq -> new seq.
        """
        pending = list(self.unanswered.items())
        self.last_seq = 0
        self.unanswered.clear()
        self.unsent.clear()
        return {old: self.add(command) for old, command in pending}


class EventInbox:
    """The client's side of events: drops repeats, says when to acknowledge."""

    def __init__(self, window: int = DEFAULT_EVENT_WINDOW) -> None:
        self.window = window
        """The event window the server granted."""
        self.last_seq = 0
        """Highest event seq received."""
        self.acked = 0
        """Highest event seq acknowledged to the server."""
        self.results_unacked = 0
        """Results received but not yet acknowledged (they hold the server's command window)."""

    def accept(self, event: session_pb2.SessionEvent) -> bool:
        """True for a new event; False for one already received (sent again after a resume).

        Raises ``InvalidFieldError`` for a gap: the server skipped a number (a server bug),
        which would mean an event was lost.
        """
        if event.seq <= self.last_seq:
            return False
        if event.seq != self.last_seq + 1:
            raise InvalidFieldError("events[].seq", f"event {event.seq} after {self.last_seq}: an event is missing",
                                    metadata={"seq": event.seq, "expected": self.last_seq + 1})
        self.last_seq = event.seq
        if event.HasField("result"):
            self.results_unacked += 1
        return True

    def ack_due(self, command_window: int) -> bool:
        """Acknowledge now (even without a command to carry it): half the window is used."""
        unacked = self.last_seq - self.acked
        return unacked > 0 and (2 * unacked >= self.window or 2 * self.results_unacked >= command_window)

    def ack(self) -> int:
        """The acknowledgement to send (everything received so far)."""
        self.acked = self.last_seq
        self.results_unacked = 0
        return self.acked


@dataclass
class _Pending:
    """An event not yet numbered; a status one may be superseded (coalesced) before it is sent."""

    event: session_pb2.SessionEvent
    key: tuple[int, int] | None = None
    """(room, generation) of a coalescible (non-terminal) status."""
    superseded: bool = False


class EventLog:
    """The server's side of one session: numbers events, keeps them until acknowledged, counts credit."""

    def __init__(self, event_window: int = DEFAULT_EVENT_WINDOW,
                 command_window: int = DEFAULT_COMMAND_WINDOW, *, backlog: int = 1024) -> None:
        self.event_window = max(1, min(event_window or DEFAULT_EVENT_WINDOW, MAX_EVENT_WINDOW))
        self.command_window = max(1, command_window)
        self.applied_command_seq = 0
        """Highest command seq applied (its result may still be in progress)."""
        self.acked = 0
        """Highest event seq the client acknowledged."""
        self.last_seq = 0
        """Highest event seq given out."""
        self._sent: deque[session_pb2.SessionEvent] = deque()
        """Numbered events after ``acked``, oldest first."""
        self._cursor = 0
        """Index in ``_sent`` of the first event the current stream has not written."""
        self._finals: deque[bytes] = deque()
        """A new session's kept final statuses, serialized, sent before anything in ``_pending``."""
        self._pending: deque[_Pending] = deque()
        self._newest: dict[tuple[int, int], _Pending] = {}
        """The queued, coalescible status of each (room, generation)."""
        self._backlog = backlog
        self._in_progress = 0
        """Commands applied whose result is not yet an event (an abort waiting for a drain)."""
        self._results_out = 0
        """Results queued or sent and not acknowledged."""

    # -- commands ------------------------------------------------------------

    @property
    def credit(self) -> int:
        """Commands the client may still have applied before acknowledging results."""
        return self.command_window - self._in_progress - self._results_out

    def admit(self, command: session_pb2.SessionCommand) -> bool:
        """True: apply the command now (its result must follow, ``result``); False: already applied.

        Raises ``InvalidFieldError`` for a seq that skips ahead (a command would be lost).
        """
        if command.seq <= self.applied_command_seq:
            return False
        if command.seq != self.applied_command_seq + 1:
            raise InvalidFieldError("commands[].seq", f"command {command.seq} after {self.applied_command_seq}: "
                                    "commands are numbered 1, 2, 3... without gaps",
                                    metadata={"seq": command.seq, "expected": self.applied_command_seq + 1})
        self.applied_command_seq = command.seq
        self._in_progress += 1
        return True

    def result(self, result: session_pb2.CommandResult) -> None:
        """Queue the result of an admitted command."""
        self._in_progress -= 1
        self._results_out += 1
        self._pending.append(_Pending(session_pb2.SessionEvent(result=result)))

    # -- statuses ------------------------------------------------------------

    def status(self, status: transfer_pb2.TransferStatus) -> None:
        """Queue a status change; under backlog an older queued status of the same generation is dropped."""
        key = (status.room, status.generation)
        item = _Pending(session_pb2.SessionEvent(status=status), None if is_terminal(status) else key)
        if len(self._pending) >= self._backlog:
            older = self._newest.get(key)
            if older is not None:
                older.superseded = True
        if item.key is not None:
            self._newest[key] = item
        else:
            self._newest.pop(key, None)
        self._pending.append(item)
        if len(self._pending) > 2 * self._backlog:
            self._compact()

    def finals(self, blobs: Iterable[bytes]) -> None:
        """Queue a new session's kept final statuses as the server stores them (serialized); they go
        out before every other event, so this comes before any is queued. A snapshot holds thousands:
        each is parsed only once it is sent, and a session opened and dropped at once costs next to
        nothing for them."""
        self._finals.extend(blobs)

    def _compact(self) -> None:
        """Drop superseded entries; the bound follows when every queued status is distinct."""
        self._pending = deque(p for p in self._pending if not p.superseded)
        self._backlog = max(self._backlog, len(self._pending))

    # -- sending and acknowledgements ------------------------------------------

    @property
    def sendable(self) -> bool:
        """Something is waiting and the window has room for it."""
        if self._cursor < len(self._sent):
            return True
        return bool(self._finals or self._pending) and len(self._sent) < self.event_window

    @property
    def queued(self) -> int:
        """Events waiting to be numbered (results and statuses)."""
        return len(self._finals) + len(self._pending)

    @property
    def unacknowledged(self) -> int:
        """Numbered events the client has not acknowledged."""
        return len(self._sent)

    def take(self) -> list[session_pb2.SessionEvent]:
        """The events to write now: unwritten ones first, then new ones while the window allows."""
        out = list(self._sent)[self._cursor:] if self._cursor < len(self._sent) else []
        while self._finals and len(self._sent) < self.event_window:
            self._number(session_pb2.SessionEvent(status=transfer_pb2.TransferStatus.FromString(
                self._finals.popleft())), out)
        while self._pending and len(self._sent) < self.event_window:
            item = self._pending.popleft()
            if item.superseded:
                continue
            if item.key is not None and self._newest.get(item.key) is item:
                del self._newest[item.key]
            self._number(item.event, out)
        self._cursor = len(self._sent)
        return out

    def _number(self, event: session_pb2.SessionEvent, out: list[session_pb2.SessionEvent]) -> None:
        self.last_seq += 1
        event.seq = self.last_seq
        self._sent.append(event)
        out.append(event)

    def ack(self, seq: int) -> None:
        """The client received every event up to ``seq``: forget them, free window and credit.

        An old acknowledgement (below one already seen) is ignored. Raises ``InvalidFieldError``
        for one beyond what was sent.
        """
        if seq <= self.acked:
            return
        if seq > self.last_seq:
            raise InvalidFieldError("event_ack", f"acknowledges event {seq}, but only {self.last_seq} were sent",
                                    metadata={"eventAck": seq, "sent": self.last_seq})
        while self._sent and self._sent[0].seq <= seq:
            event = self._sent.popleft()
            self._cursor -= 1
            if event.HasField("result"):
                self._results_out -= 1
        self._cursor = max(self._cursor, 0)
        self.acked = seq

    def rewind(self) -> None:
        """A new stream: every unacknowledged event is written again, with its number."""
        self._cursor = 0

    def discard(self) -> None:
        """Forget every event, sent or queued: the session is over and nothing more is written."""
        self._sent.clear()
        self._pending.clear()
        self._newest.clear()
        self._cursor = 0




class StatusBook:
    """The client's view of a peer's statuses: the latest of each open request, recent terminal ones.

    A terminal status is let through once per request generation, even when a new
    session's snapshot repeats it, as long as its room is among the ``keep`` most recently
    finished (generations only grow, so the newest terminal status of a room is enough).
    """

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self.latest: dict[int, transfer_pb2.TransferStatus] = {}
        """Latest status of each room whose current generation is not terminal (yet)."""
        self.finished: dict[int, transfer_pb2.TransferStatus] = {}
        """Newest terminal status of each room, least recently finished first, at most ``keep``."""

    def update(self, status: transfer_pb2.TransferStatus) -> bool:
        """Record a status; False when it is old news (a repeated or superseded status): drop it."""
        done = self.finished.get(status.room)
        if done is not None and done.generation >= status.generation:
            return False
        current = self.latest.get(status.room)
        if current is not None and (current.generation > status.generation or current == status):
            return False
        if not is_terminal(status):
            self.latest[status.room] = status
            return True
        self.latest.pop(status.room, None)
        self.finished.pop(status.room, None)
        self.finished[status.room] = status
        if len(self.finished) > self.keep:
            del self.finished[next(iter(self.finished))]
        return True

    def current(self, rooms: frozenset[int] = frozenset()) -> list[transfer_pb2.TransferStatus]:
        """What is known now of ``rooms`` (every room when empty): terminal statuses first."""
        out = [s for room, s in self.finished.items() if not rooms or room in rooms]
        out += [s for room, s in self.latest.items() if not rooms or room in rooms]
        return out

    def terminal(self, room: int) -> transfer_pb2.TransferStatus | None:
        """The room's terminal status, unless a newer generation of it is open."""
        return None if room in self.latest else self.finished.get(room)


__all__ = [
    "CommandOutbox",
    "DEFAULT_COMMAND_WINDOW",
    "DEFAULT_EVENT_WINDOW",
    "EventInbox",
    "EventLog",
    "MAX_EVENT_WINDOW",
    "StatusBook",
    "TERMINAL_STATES",
    "is_terminal",
]
