"""The session stream's numbering, acknowledgement and replay rules (pdproto.session), without a network.

The property test runs a client and a server over a simulated stream that can be cut at
any point (everything in flight is lost) and resumed, and checks what a decode relies on:
every command is applied once, every result and every terminal status arrives once, in
order, and neither window is exceeded.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings, strategies as st

from pdproto.errors import InvalidFieldError
from pdproto.session import CommandOutbox, EventInbox, EventLog, is_terminal
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, session_pb2, transfer_pb2

WAITING = common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT
MOVING = common_pb2.TRANSFER_STATE_TRANSFERRING
SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS


def _submit(room: int) -> session_pb2.SessionCommand:
    return session_pb2.SessionCommand(submit=transfer_pb2.TransferInfo(room=room))


def _status(room: int, state: int, chunks: int = 0) -> transfer_pb2.TransferStatus:
    return transfer_pb2.TransferStatus(room=room, state=state, chunks_done=chunks)  # type: ignore[arg-type]


class Server:
    """One session's server side: applies submits, reports progress and a terminal status per room."""

    def __init__(self, event_window: int, command_window: int, backlog: int) -> None:
        self.log = EventLog(event_window, command_window, backlog=backlog)
        self.applied: list[int] = []
        self.open: dict[int, int] = {}  # room -> chunks done
        self.held: deque[session_pb2.SessionCommand] = deque()

    def receive(self, message: hs.SessionRequest) -> None:
        self.log.ack(message.event_ack)
        self.held.extend(message.commands)
        self.apply_held()

    def apply_held(self) -> None:
        # Commands beyond the credit wait, unapplied, until acknowledgements free it.
        while self.held and self.log.credit > 0:
            command = self.held.popleft()
            if self.log.admit(command):
                self.applied.append(command.submit.room)
                self.open[command.submit.room] = 0
                self.log.result(session_pb2.CommandResult(command_seq=command.seq,
                                                          submitted=_status(command.submit.room, WAITING)))

    def progress(self, pick: int, finish: bool) -> None:
        if not self.open:
            return
        room = sorted(self.open)[pick % len(self.open)]
        if finish:
            del self.open[room]
            self.log.status(_status(room, SUCCESS, 99))
        else:
            self.open[room] += 1
            self.log.status(_status(room, MOVING, self.open[room]))

    def send(self) -> hs.SessionResponse | None:
        events = self.log.take()
        assert self.log.unacknowledged <= self.log.event_window
        return hs.SessionResponse(events=events) if events else None

    def resume(self, ack: int) -> int:
        self.held.clear()  # unread commands died with the stream
        self.log.ack(ack)
        self.log.rewind()
        return self.log.applied_command_seq


class Client:
    """One session's client side: numbers commands, drops repeated events, acknowledges."""

    def __init__(self, command_window: int, event_window: int) -> None:
        self.outbox = CommandOutbox()
        self.inbox = EventInbox(event_window)
        self.command_window = command_window
        self.results: list[int] = []
        self.statuses: list[transfer_pb2.TransferStatus] = []
        self.next_room = 1

    def can_submit(self) -> bool:
        outstanding = len(self.outbox.unanswered) + self.inbox.results_unacked
        return outstanding < self.command_window

    def submit(self) -> None:
        self.outbox.add(_submit(self.next_room))
        self.next_room += 1

    def message(self, force_ack: bool) -> hs.SessionRequest | None:
        commands = self.outbox.take()
        if not commands and not (force_ack or self.inbox.ack_due(self.command_window)):
            return None
        return hs.SessionRequest(commands=commands, event_ack=self.inbox.ack())

    def receive(self, message: hs.SessionResponse) -> None:
        for event in message.events:
            if not self.inbox.accept(event):
                continue
            if event.HasField("result"):
                assert self.outbox.answered(event.result.command_seq) is not None
                self.results.append(event.result.command_seq)
            else:
                self.statuses.append(event.status)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from("scpdrkxa"), st.integers(0, 1000)), min_size=20, max_size=300),
    event_window=st.integers(1, 12),
    command_window=st.integers(1, 6),
    backlog=st.integers(1, 8),
)
def test_cut_streams_lose_nothing_and_repeat_nothing(steps: list[tuple[str, int]], event_window: int,
                                                     command_window: int, backlog: int) -> None:
    server, client = Server(event_window, command_window, backlog), Client(command_window, event_window)
    up: deque[hs.SessionRequest] = deque()
    down: deque[hs.SessionResponse] = deque()

    def cut(stale_ack: bool = False) -> None:
        # A resume acknowledges what the client received, or only what it acknowledged
        # before (then the server sends some events again, and the client drops them).
        up.clear()
        down.clear()
        applied = server.resume(client.inbox.acked if stale_ack else client.inbox.ack())
        client.outbox.resume(applied)

    for action, n in steps:
        if action == "s" and client.can_submit():
            client.submit()
        elif action == "c":
            message = client.message(force_ack=n % 2 == 0)
            if message is not None:
                up.append(message)
        elif action == "r" and up:
            server.receive(up.popleft())
        elif action == "p":
            server.progress(n, finish=n % 3 == 0)
        elif action == "d":
            message = server.send()
            if message is not None:
                down.append(message)
        elif action == "k" and down:
            client.receive(down.popleft())
        elif action == "x":
            cut(stale_ack=n % 2 == 1)
        elif action == "a":
            server.apply_held()
    # Finish every request, then run the stream without cuts until it is quiet.
    cut()
    for _ in range(10_000):
        message = client.message(force_ack=True)
        if message is not None:
            server.receive(message)
        while server.open:
            server.progress(0, finish=True)
        response = server.send()
        if response is not None:
            client.receive(response)
        if not client.outbox.unanswered and not server.log.queued and response is None and not server.held:
            break
    submitted = client.next_room - 1
    assert sorted(server.applied) == list(range(1, submitted + 1)), "each command applied exactly once"
    assert client.results == list(range(1, submitted + 1)), "each result delivered once, in order"
    terminal = [s.room for s in client.statuses if is_terminal(s)]
    assert sorted(terminal) == list(range(1, submitted + 1)), "each terminal status delivered exactly once"
    for room in range(1, submitted + 1):
        chunks = [s.chunks_done for s in client.statuses if s.room == room]
        assert chunks == sorted(chunks) and chunks[-1] == 99, "a room's statuses arrive in order, terminal last"


def test_backlog_coalesces_progress_but_keeps_results_and_terminal_statuses() -> None:
    log = EventLog(event_window=1, command_window=4, backlog=2)
    assert log.admit(session_pb2.SessionCommand(seq=1, submit=transfer_pb2.TransferInfo(room=7)))
    log.result(session_pb2.CommandResult(command_seq=1, submitted=_status(7, WAITING)))
    for chunk in range(1, 50):
        log.status(_status(7, MOVING, chunk))
    log.status(_status(7, SUCCESS, 50))
    seen: list[session_pb2.SessionEvent] = []
    while True:
        events = log.take()
        if not events:
            break
        seen += events
        log.ack(events[-1].seq)
    assert seen[0].HasField("result")
    statuses = [e.status.chunks_done for e in seen[1:]]
    assert statuses[-1] == 50 and is_terminal(seen[-1].status)
    assert len(statuses) < 10, f"progress statuses were not coalesced: {statuses}"
    assert statuses == sorted(statuses)
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))


def test_event_window_and_command_credit() -> None:
    log = EventLog(event_window=2, command_window=2)
    for seq in (1, 2):
        assert log.admit(session_pb2.SessionCommand(seq=seq, submit=transfer_pb2.TransferInfo(room=seq)))
    assert log.credit == 0
    for seq in (1, 2):
        log.result(session_pb2.CommandResult(command_seq=seq, submitted=_status(seq, WAITING)))
    log.status(_status(1, SUCCESS))
    assert [e.seq for e in log.take()] == [1, 2]  # the window holds two
    assert not log.sendable and log.credit == 0
    log.ack(1)
    assert log.credit == 1 and log.sendable
    assert [e.seq for e in log.take()] == [3]
    log.rewind()  # a new stream: the unacknowledged events 2 and 3 go again, same numbers
    assert [e.seq for e in log.take()] == [2, 3]
    assert not log.admit(session_pb2.SessionCommand(seq=2)), "an applied command is not applied twice"


@pytest.mark.parametrize("bad", ["gap", "ack"])
def test_protocol_violations_are_typed_errors(bad: str) -> None:
    log = EventLog()
    with pytest.raises(InvalidFieldError) as info:
        if bad == "gap":
            log.admit(session_pb2.SessionCommand(seq=2))
        else:
            log.ack(1)
    assert info.value.field == ("commands[].seq" if bad == "gap" else "event_ack")
    inbox = EventInbox()
    assert inbox.accept(session_pb2.SessionEvent(seq=1))
    assert not inbox.accept(session_pb2.SessionEvent(seq=1))
    with pytest.raises(InvalidFieldError):
        inbox.accept(session_pb2.SessionEvent(seq=3))


def test_outbox_resends_only_what_the_server_did_not_apply() -> None:
    box = CommandOutbox()
    for room in (1, 2, 3):
        box.add(_submit(room))
    assert [c.seq for c in box.take()] == [1, 2, 3]
    box.answered(1)
    box.resume(applied_seq=2)
    assert [c.seq for c in box.take()] == [3]
    box.restart()  # the session is gone: its unanswered commands start a new one
    assert [(c.seq, c.submit.room) for c in box.take()] == [(1, 2), (2, 3)]


def test_kept_final_statuses_queue_serialized_and_go_out_in_order() -> None:
    """A new session's snapshot queues the peer's kept final statuses as the server stores them
    (serialized); each becomes an event, numbered in queue order, only when the window lets it out."""
    log = EventLog(event_window=2)
    finals = [transfer_pb2.TransferStatus(room=r, generation=1, state=common_pb2.TRANSFER_STATE_SUCCESS)
              for r in range(3)]
    log.finals(status.SerializeToString() for status in finals)
    log.status(transfer_pb2.TransferStatus(room=9, generation=1, state=common_pb2.TRANSFER_STATE_TRANSFERRING))
    first = log.take()
    assert [(e.seq, e.status) for e in first] == [(1, finals[0]), (2, finals[1])]
    log.ack(2)
    rest = log.take()
    assert [(e.seq, e.status.room) for e in rest] == [(3, 2), (4, 9)]
