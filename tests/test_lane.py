"""The session lane against a real ``pdproto serve --session-lane``: what a decode relies on,
and what an attacker tries.

A client that reaches the gRPC port moves its session to the lane on its own; a lane
that cannot be reached leaves the session on gRPC, and a lane over TLS takes no
plaintext. A flooding peer is held back by TCP flow control. A lane connection is
refused its session without the bearer token or the peer's credential; one that says
nothing, something else, or a huge length is closed without holding the server. (Cut
lane connections and a restarted server are in ``tests/test_session.py``, beside the
same cases on gRPC.)
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from pdproto.client import HandshakeClient
from pdproto.client_lane import HEADER, PREFACE
from pdproto.v1 import common_pb2, describe_pb2, handshake_service_pb2 as hs, session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._flood import check_held_back, flood, flooding
from ._raw_lane import Raw, ended, open_request
from ._server_harness import SERVE_ARGS, SPEC, running_server, self_signed

pytestmark = pytest.mark.process

SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS
LANE = ("--session-lane", "127.0.0.1:0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _view(client: HandshakeClient, peer_id: str) -> describe_pb2.PeerView:
    return client.describe(peer_id=peer_id, include_finished=True, request_limit=100).peers[0]


def _reset_each(listener: socket.socket) -> None:
    """Accept each connection, read its first bytes and reset it, as a middlebox that kills unknown
    protocols does (after the first bytes: a reset before them can fail the connect itself)."""
    while True:
        try:
            conn, _ = listener.accept()
            conn.recv(len(PREFACE))
        except OSError:
            return  # the test closed the listener
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()


@pytest.mark.parametrize("lane", ["refused", "silent", "resetting"])
def test_an_unreachable_lane_leaves_the_sessions_on_grpc(lane: str, caplog: pytest.LogCaptureFixture) -> None:
    """A lane port that refuses connections, or takes them and never answers (another service, a firewall,
    a wrong forward): the requests complete over gRPC, and the client's second session does not try again.

    ``resetting``: the lane takes each connection and resets it before the session opens. Each session
    goes back through gRPC after each break, and after three in a row stays there.
    """
    peers = [DecodeRank.for_spec(SPEC, pages=64) for _ in range(2)]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: connections complete in the kernel and hear nothing
    port = silent.getsockname()[1] if lane != "refused" else _free_port()
    if lane == "resetting":
        threading.Thread(target=_reset_each, args=(silent,), daemon=True).start()
    try:
        with running_server(*SERVE_ARGS, *LANE, "--lane-advertise-port", str(port), "--metrics-port", "0") as srv, \
                HandshakeClient(srv.target, timeout=20) as client, caplog.at_level("WARNING", "pdproto.client"):
            for peer in peers:
                peer_id = client.register(peer.registration()).peer_id
                placed = {room: peer.pages_for(SPEC.prompt_tokens, first_page=i * 16) for i, room in enumerate((1, 2))}
                for room, pages in placed.items():
                    client.submit_transfer(peer_id, peer.transfer_info(room, pages))
                done = client.wait_for(peer_id, placed, timeout=20)
                assert all(s.state == SUCCESS for s in done.values()), done
                view = _view(client, peer_id)
                assert (view.sessions_connected, view.sessions_on_lane) == (1, 0), view
                peer.verify(placed, SPEC.prompt_tokens)
            # What an operator sees: both sessions served over gRPC (the streams a client left
            # for the lane end on the server a moment later: wait for that, bounded).
            waited = time.monotonic()
            while (streams := srv.metrics())['pdproto_session_streams{transport="grpc"}'] != 2 \
                    and time.monotonic() - waited < 10:
                time.sleep(0.1)
            assert streams['pdproto_session_streams{transport="grpc"}'] == 2, streams
            assert streams.get('pdproto_session_streams{transport="lane"}', 0) == 0, streams
            if lane == "resetting":
                warned = [r.getMessage() for r in caplog.records if "broke 3 times before opening" in r.getMessage()]
                assert len(warned) == 2 and all(f"port {port} " in w for w in warned), warned
            else:
                warned = [r.getMessage() for r in caplog.records if "staying on gRPC" in r.getMessage()]
                assert len(warned) == 1 and f":{port} " in warned[0], warned
    finally:
        if lane == "resetting":
            silent.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        silent.close()
        for peer in peers:
            peer.close()


# -- raw lane connections ---------------------------------------------------------------


def test_hostile_lane_connections_get_nothing_and_hold_nothing() -> None:
    """Wrong protocol, no token, a wrong token or credential, a huge length, silence, a crowd of idlers."""
    peer, other = DecodeRank.for_spec(SPEC, pages=64), DecodeRank.for_spec(SPEC, pages=64)
    token = "s3cret"
    try:
        with running_server(*SERVE_ARGS, *LANE, "--lane-open-timeout", "1", "--lane-max-unopened", "4",
                            "--metrics-port", "0", token=token) as srv, \
                HandshakeClient(srv.target, token=token, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            other_id = client.register(other.registration()).peer_id
            cred, other_cred = client.credential(peer_id), client.credential(other_id)
            port = srv.lane_port

            raw = Raw(port)  # an HTTP (or gRPC) client on the lane port: closed, told nothing
            raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert raw.read() is None
            raw.close()

            for presented, why in (("", "missing bearer token"), ("s3cre7", "invalid bearer token")):
                raw = Raw.opening(port, open_request(peer_id, cred, presented))
                end = ended(raw)
                assert end.reason == "UNAUTHENTICATED" and end.message.startswith(why), end
                raw.close()

            raw = Raw(port)  # bytes that are no SessionRequest cannot carry a token
            raw.send(PREFACE + HEADER.pack(5) + b"\xff\xff\xff\xff\xff")
            assert ended(raw).reason == "UNAUTHENTICATED"
            raw.close()

            raw = Raw(port)  # a length that would make the server allocate 4 GiB: refused unread
            raw.send(PREFACE + HEADER.pack(0xFFFF_FFFF))
            end = ended(raw)
            assert end.reason == "MESSAGE_TOO_LARGE" and end.metadata["bytes"] == str(0xFFFF_FFFF), end
            raw.close()
            raw = Raw(port)  # before the session is open, 64 KiB is the most a frame may have
            raw.send(PREFACE + HEADER.pack((64 << 10) + 1))
            assert ended(raw).metadata["limit"] == str(64 << 10)
            raw.close()

            # The token is not enough: the peer's credential is checked, and another peer's does not do.
            raw = Raw.opening(port, open_request(peer_id, other_cred, token))
            assert ended(raw).reason == "PEER_NOT_FOUND"
            raw.close()
            # A session id is no capability: another peer cannot resume it.
            raw = Raw.opening(port, open_request(other_id, other_cred, token))
            opened = raw.read()
            assert opened is not None and opened.opened.session_id and opened.opened.lane_port == port
            raw.close()
            raw = Raw.opening(port, open_request(peer_id, cred, token, resume=opened.opened.session_id))
            assert ended(raw).reason == "SESSION_NOT_FOUND"
            raw.close()

            # Silence: the preface, then nothing. Closed at the open deadline, with why.
            raw = Raw(port)
            raw.send(PREFACE)
            t0 = time.monotonic()
            assert ended(raw).reason == "DEADLINE_EXCEEDED"
            assert time.monotonic() - t0 < 8  # the open deadline (1 s), not the socket's 10 s timeout
            raw.close()

            # Idlers fill the unopened slots: the next connection is closed at once; once their
            # deadline passed they are gone, and the lane serves sessions again.
            idlers = [Raw(port) for _ in range(4)]
            time.sleep(0.3)
            extra = Raw(port)
            extra.send(PREFACE)
            assert extra.read() is None
            extra.close()
            for idler in idlers:  # no preface, so no frame: closed at the deadline
                assert idler.read() is None
                idler.close()
            placed = {1: peer.pages_for(SPEC.prompt_tokens)}
            client.submit_transfer(peer_id, peer.transfer_info(1, placed[1]))
            assert client.wait_for(peer_id, [1], timeout=20)[1].state == SUCCESS
            assert _view(client, peer_id).sessions_on_lane == 1
            peer.verify(placed, SPEC.prompt_tokens)
            # An operator sees each of them: one wrong protocol, seven refused opens (token, bytes,
            # sizes, credential, session id), five silent (one after its preface, four idlers), one crowded.
            metrics = srv.metrics()
            turned = {why: metrics.get(f'pdproto_lane_turned_away_total{{why="{why}"}}')
                      for why in ("preface", "refused", "silent", "crowded")}
            assert turned == {"preface": 1, "refused": 7, "silent": 5, "crowded": 1}, turned
            assert metrics['pdproto_session_streams{transport="lane"}'] == 1, metrics
            assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
    finally:
        peer.close()
        other.close()


def _rss_bytes(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def _aborts(first_seq: int, n: int) -> list[session_pb2.SessionCommand]:
    """Aborts of rooms nobody submitted: each is answered at once (REQUEST_NOT_FOUND)."""
    return [session_pb2.SessionCommand(seq=first_seq + i, abort=transfer_pb2.AbortNotification(room=10**9 + i))
            for i in range(n)]


def test_resuming_again_and_again_with_frames_of_commands_holds_one_frame_at_most() -> None:
    """A peer spends its command window and never acknowledges, then resumes its session over and
    over, each time with an opening frame full of commands (64 KiB: about 5,000). Before, every resume
    added its frame's commands to the session for good (about 1.6 MB each); then each resume replaced
    what the last stream held. Now a message with more commands than the window is refused outright
    (``INVALID_FIELD``; ``test_a_message_with_more_commands_than_the_window_is_refused_unread``)."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            cred = client.credential(peer_id)
            window = 256  # DEFAULT_COMMAND_WINDOW: every abort is applied, none acknowledged
            first = open_request(peer_id, cred)
            first.commands.extend(_aborts(1, window))
            raw = Raw.opening(srv.lane_port, first)
            opened = raw.read()
            assert opened is not None and opened.opened.command_window == window, opened
            session_id = opened.opened.session_id
            results = len(opened.events)
            while results < window:  # every result comes back unacknowledged: the credit is spent
                frame = raw.read()
                assert frame is not None
                results += sum(1 for e in frame.events if e.HasField("result"))
            raw.close()
            frame_commands = _aborts(window + 1, 5000)
            request = open_request(peer_id, cred, resume=session_id)
            request.commands.extend(frame_commands)
            assert len(request.SerializeToString()) < 64 << 10  # the opening frame's limit
            before = _rss_bytes(srv.proc.pid)
            for _ in range(60):
                raw = Raw.opening(srv.lane_port, request)
                resumed = raw.read()
                assert resumed is not None and resumed.opened.resumed, resumed
                assert resumed.opened.applied_command_seq == window  # nothing beyond the credit applied
                assert ended(raw).reason == "INVALID_FIELD"
                raw.close()
            grown = _rss_bytes(srv.proc.pid) - before
            assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB over 60 resumes"
            assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
    finally:
        peer.close()


def test_an_ended_session_whose_client_takes_nothing_is_cut_after_the_grace() -> None:
    """A peer opens a session with an event window of one, never acknowledges, and deregisters: its
    session ends with events still queued. The server gives the stream ``--grace`` seconds to take them,
    then closes it with why (its peer no longer counts toward any limit, so nothing else would)."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE, "--grace", "2", "--metrics-port", "0") as srv, \
                HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            opening = open_request(peer_id, client.credential(peer_id))
            opening.open.event_window = 1
            opening.commands.extend(_aborts(1, 4))
            raw = Raw.opening(srv.lane_port, opening)
            opened = raw.read()
            assert opened is not None and len(opened.events) <= 1, opened
            client.deregister(peer_id)
            t0 = time.monotonic()
            frames = []
            while (frame := raw.read()) is not None:  # the socket's own timeout is 10 s
                frames.append(frame)
            assert frames and frames[-1].HasField("end"), frames
            assert frames[-1].end.reason == "PEER_NOT_FOUND", frames[-1]
            assert time.monotonic() - t0 < 9
            assert srv.metrics().get('pdproto_session_streams{transport="lane"}', 0) == 0
            raw.close()
    finally:
        peer.close()


def test_a_message_with_more_commands_than_the_window_is_refused_unread() -> None:
    """No more commands than the command window may be outstanding, so a message with more is a
    protocol violation: refused, typed, before any is touched. Before, the server took them all:
    a 4 MB frame of two million empty commands held its event loop for 10 to 25 s (a review
    measured it), and empty ones (seq 0) were skipped as already applied, with no error."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            raw = Raw.opening(srv.lane_port, open_request(peer_id, client.credential(peer_id)))
            opened = raw.read()
            assert opened is not None and opened.HasField("opened"), opened
            flood = hs.SessionRequest()
            flood.commands.extend(session_pb2.SessionCommand() for _ in range(100_000))
            raw.frame(flood)
            end = ended(raw)
            assert end.reason == "INVALID_FIELD" and end.field_violations[0].field == "commands", end
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
        with running_server(*SERVE_ARGS, *LANE, "--chunk-delay-ms", "0", "--max-inflight", "8",
                            "--max-finished", "8") as srv, \
                HandshakeClient(srv.target, timeout=20, session=False) as client:
            peer_id = client.register(peer.registration()).peer_id
            credential = client.credential(peer_id)
            opening = open_request(peer_id, credential)
            opening.open.event_window = 1
            raw = Raw.opening(srv.lane_port, opening)
            first = raw.read()
            assert first is not None and first.HasField("opened"), first
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
            frames = []
            while (frame := raw.read()) is not None:
                frames.append(frame)
            assert frames and frames[-1].HasField("end"), frames
            assert frames[-1].end.reason == "SESSION_NOT_FOUND" and "acknowledged no event" in frames[-1].end.message
            raw.close()
            again = Raw.opening(srv.lane_port, open_request(peer_id, credential, resume=first.opened.session_id))
            assert ended(again).reason == "SESSION_NOT_FOUND"
            again.close()
            client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=1000, dst_kv_pages=[0], is_dummy=True))
            assert client.wait_for(peer_id, [1000], timeout=20)[1000].state == common_pb2.TRANSFER_STATE_SUCCESS
    finally:
        peer.close()


def test_a_new_session_acknowledging_events_it_never_got_is_refused_and_not_kept() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE) as srv, HandshakeClient(srv.target, timeout=20) as client:
            peer_id = client.register(peer.registration()).peer_id
            opening = open_request(peer_id, client.credential(peer_id))
            opening.event_ack = 5
            raw = Raw.opening(srv.lane_port, opening)
            end = ended(raw)
            assert end.reason == "INVALID_FIELD" and end.field_violations[0].field == "event_ack", end
            raw.close()
            view = client.describe(peer_id=peer_id).peers[0]
            # Before, the refused session stayed subscribed to the peer's statuses, detached and
            # never expired.
            assert (view.sessions_connected, view.sessions_detached) == (0, 0), view
    finally:
        peer.close()


async def _flood(port: int, peer_id: str, credential: bytes, written: list[int], stop: asyncio.Event) -> None:
    """A peer that writes submits on its lane as fast as TCP lets it, and never reads or acknowledges."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = open_request(peer_id, credential).SerializeToString()
    writer.write(PREFACE + HEADER.pack(len(body)) + body)

    async def send(request: hs.SessionRequest) -> None:
        data = request.SerializeToString()
        writer.write(HEADER.pack(len(data)) + data)
        await writer.drain()

    try:
        await flood(send, written, stop)
    finally:
        writer.transport.abort()


def test_a_flooding_lane_peer_is_held_back_while_another_peer_completes() -> None:
    flooder, good = DecodeRank.for_spec(SPEC, pages=64), DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE, "--max-inflight", "100000") as srv, \
                HandshakeClient(srv.target, timeout=20) as client:
            bad_id = client.register(flooder.registration()).peer_id
            good_id = client.register(good.registration()).peer_id
            credential = client.credential(bad_id)
            with flooding(lambda written, stop: _flood(srv.lane_port, bad_id, credential, written, stop)) as written:
                views = check_held_back(client, good, good_id, bad_id, written)
                assert views[bad_id].sessions_on_lane == 1 and views[good_id].sessions_on_lane == 1
    finally:
        flooder.close()
        good.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_connections_in_their_tls_handshake_count_as_unopened(tmp_path: Path) -> None:
    """On a TLS lane, connections that never finish (or start) the handshake hold unopened slots and
    meet the open deadline like any other: the next one past the cap is closed at once. Before, the
    listener ran the handshake before the lane counted the connection, so any number could wait."""
    key, cert = self_signed(tmp_path)
    with running_server(*SERVE_ARGS, *LANE, "--tls-cert", str(cert), "--tls-key", str(key), "--lane-max-unopened",
                        "2", "--lane-open-timeout", "2", "--metrics-port", "0") as srv:
        idlers = [Raw(srv.lane_port) for _ in range(2)]  # TCP only: no ClientHello ever comes
        time.sleep(0.3)
        extra = Raw(srv.lane_port)
        assert extra.read() is None
        extra.close()
        for idler in idlers:
            assert idler.read() is None  # closed at the open deadline
            idler.close()
        metrics = srv.metrics()
        turned = {why: metrics.get(f'pdproto_lane_turned_away_total{{why="{why}"}}') for why in ("crowded", "silent")}
        assert turned == {"crowded": 1, "silent": 2}, turned


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_the_lane_speaks_tls_when_the_server_does(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, *LANE, "--tls-cert", str(cert), "--tls-key", str(key)) as srv:
            raw = Raw(srv.lane_port)  # plaintext on a TLS lane: nothing comes back
            raw.send(PREFACE)
            assert raw.read() is None
            raw.close()
            with HandshakeClient(srv.target, root_cert=cert, timeout=20) as client:
                peer_id = client.register(peer.registration()).peer_id
                placed = {1: peer.pages_for(SPEC.prompt_tokens)}
                client.submit_transfer(peer_id, peer.transfer_info(1, placed[1]))
                assert client.wait_for(peer_id, [1], timeout=20)[1].state == SUCCESS
                assert _view(client, peer_id).sessions_on_lane == 1
                peer.verify(placed, SPEC.prompt_tokens)
    finally:
        peer.close()
