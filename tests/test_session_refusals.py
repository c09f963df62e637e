"""What a session peer that breaks the rules gets, on hand-driven Session calls against a real server.

A decode's own client never does any of this; a hostile or broken one may: resume again and
again with messages full of commands, never acknowledge, send more commands than its window,
or acknowledge events it never got. Each is refused typed, and none leaves the server holding
what the peer sent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import InvalidFieldError
from pdproto.session import DEFAULT_COMMAND_WINDOW
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._raw_session import RawSession, ended, open_request
from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process


def _rss_bytes(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def _aborts(first_seq: int, n: int) -> list[session_pb2.SessionCommand]:
    """Aborts of rooms nobody submitted: each is answered at once (REQUEST_NOT_FOUND)."""
    return [session_pb2.SessionCommand(seq=first_seq + i, abort=transfer_pb2.AbortNotification(room=10**9 + i))
            for i in range(n)]


def test_resuming_again_and_again_with_messages_of_commands_holds_one_message_at_most() -> None:
    """A peer spends its command window and never acknowledges, then resumes its session over and
    over, each time with an opening message of 5,000 commands. Before, every resume added its
    message's commands to the session for good (about 1.6 MB each); then each resume replaced what
    the last stream held. Now a message with more commands than the window is refused outright
    (``INVALID_FIELD``; ``test_a_message_with_more_commands_than_the_window_is_refused_unread``)."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            cred = client.credential(peer_id)
            window = DEFAULT_COMMAND_WINDOW  # every abort is applied, none acknowledged
            first = open_request(peer_id, cred)
            first.commands.extend(_aborts(1, window))
            raw = RawSession.opening(srv.target, first)
            opened = raw.read()
            assert opened is not None and opened.opened.command_window == window, opened
            session_id = opened.opened.session_id
            results = len(opened.events)
            while results < window:  # every result comes back unacknowledged: the credit is spent
                frame = raw.read()
                assert frame is not None, raw.error
                results += sum(1 for e in frame.events if e.HasField("result"))
            raw.close()
            request = open_request(peer_id, cred, resume=session_id)
            request.commands.extend(_aborts(window + 1, 5000))
            before = _rss_bytes(srv.proc.pid)
            for _ in range(60):
                raw = RawSession.opening(srv.target, request)
                resumed = raw.read()
                assert resumed is not None and resumed.opened.resumed, raw.error
                assert resumed.opened.applied_command_seq == window  # nothing beyond the credit applied
                assert ended(raw).reason.name == "INVALID_FIELD"
                raw.close()
            grown = _rss_bytes(srv.proc.pid) - before
            assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB over 60 resumes"
            assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
    finally:
        peer.close()


def test_an_ended_session_whose_client_takes_nothing_is_cut_after_the_grace() -> None:
    """A peer opens a session with an event window of one, never acknowledges, and deregisters: its
    session ends with events still queued. The server gives the stream ``--grace`` seconds to take them,
    then ends it with why (its peer no longer counts toward any limit, so nothing else would); the
    call's own deadline (30 s) would end it as DEADLINE_EXCEEDED instead."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--grace", "2", "--metrics-port", "0") as srv, \
                HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            opening = open_request(peer_id, client.credential(peer_id))
            opening.open.event_window = 1
            opening.commands.extend(_aborts(1, 4))
            raw = RawSession.opening(srv.target, opening)
            opened = raw.read()
            assert opened is not None and len(opened.events) <= 1, opened
            client.deregister(peer_id)
            assert ended(raw).reason.name == "PEER_NOT_FOUND", raw.error
            assert srv.metrics().get("pdproto_session_streams", 0) == 0
            raw.close()
    finally:
        peer.close()


def test_a_message_with_more_commands_than_the_window_is_refused_unread() -> None:
    """No more commands than the command window may be outstanding, so a message with more is a
    protocol violation: refused, typed, before any is touched. Before, the server took them all: a
    4 MB message of two million empty commands held its event loop for 10 to 25 s (a review measured
    it), and empty ones (seq 0) were skipped as already applied, with no error."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            raw = RawSession.opening(srv.target, open_request(peer_id, client.credential(peer_id)))
            opened = raw.read()
            assert opened is not None and opened.HasField("opened"), raw.error
            flood = hs.SessionRequest()
            flood.commands.extend(session_pb2.SessionCommand() for _ in range(100_000))
            raw.send(flood)
            end = ended(raw)
            assert isinstance(end, InvalidFieldError) and end.field == "commands", end
            assert "100000 commands in one message" in end.message, end
            raw.close()
    finally:
        peer.close()


def test_a_session_that_acknowledges_nothing_while_its_peer_finishes_requests_is_ended_not_kept() -> None:
    """A client opens a session with an event window of one and never acknowledges, while its peer's
    unary submits finish request after request: each terminal status queues in the session. Past twice
    what the peer can have open and kept (``--max-inflight`` + ``--max-finished``, 16 here: 32) the
    session ends ``SESSION_NOT_FOUND`` and is forgotten, so a resume is refused (a new session starts
    from a snapshot). Before, it queued every status for good."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--chunk-delay-ms", "0", "--max-inflight", "8",
                            "--max-finished", "8") as srv, \
                HandshakeClient(srv.target, timeout=20, session=False) as client:
            peer_id = client.register(peer.registration()).peer_id
            credential = client.credential(peer_id)
            opening = open_request(peer_id, credential)
            opening.open.event_window = 1
            raw = RawSession.opening(srv.target, opening)
            first = raw.read()
            assert first is not None and first.HasField("opened"), raw.error
            kept = 1
            for start in range(1, 400, 8):
                rooms = range(start, start + 8)
                for room in rooms:
                    client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0],
                                                                              is_dummy=True))
                client.wait_for(peer_id, rooms, timeout=20)
                view = client.describe(peer_id=peer_id).peers[0]
                kept = view.sessions_connected + view.sessions_detached
                if not kept:
                    break
            assert kept == 0, view
            end = ended(raw)
            assert end.reason.name == "SESSION_NOT_FOUND" and "acknowledged no event" in end.message, end
            raw.close()
            again = RawSession.opening(srv.target, open_request(peer_id, credential,
                                                                resume=first.opened.session_id))
            assert ended(again).reason.name == "SESSION_NOT_FOUND"
            again.close()
            client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=1000, dst_kv_pages=[0], is_dummy=True))
            assert client.wait_for(peer_id, [1000], timeout=20)[1000].state == common_pb2.TRANSFER_STATE_SUCCESS
    finally:
        peer.close()


def test_a_new_session_acknowledging_events_it_never_got_is_refused_and_not_kept() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            opening = open_request(peer_id, client.credential(peer_id))
            opening.event_ack = 5
            raw = RawSession.opening(srv.target, opening)
            end = ended(raw)
            assert isinstance(end, InvalidFieldError) and end.field == "event_ack", end
            raw.close()
            view = client.describe(peer_id=peer_id).peers[0]
            # Before, the refused session stayed subscribed to the peer's statuses, detached and
            # never expired.
            assert (view.sessions_connected, view.sessions_detached) == (0, 0), view
    finally:
        peer.close()
