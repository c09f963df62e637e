"""Session streams against a real ``pdproto serve``: cut links, a restarted server, a flooding peer.

What a decode relies on: every request it submitted ends with exactly one terminal status,
whatever happens to the stream in between (a link cut and resumed, a server drained and
restarted), and one peer that floods its session cannot hold back another peer.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import threading
import time

import grpc
import grpc.aio
import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.session import is_terminal
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc
from pdproto.v1 import session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._flood import check_held_back, flood, flooding
from ._proxy import CuttableProxy
from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS


def _terminal_counts(statuses: list[transfer_pb2.TransferStatus]) -> collections.Counter[int]:
    return collections.Counter(s.room for s in statuses if is_terminal(s))


def _watch_all(client: HandshakeClient, peer_id: str, rooms: set[int], timeout: float,
               out: list[transfer_pb2.TransferStatus]) -> None:
    """Collect every status of ``rooms`` until the watch ends or reaches its deadline.

    A unary watch cut after the peer was deregistered re-opens onto PEER_NOT_FOUND: also its end.
    """
    try:
        for status in client.watch_status(peer_id, rooms, timeout=timeout):
            out.append(status)
    except E.DeadlineExceededError:
        pass
    except E.NotFoundError as exc:
        assert exc.reason is Reason.PEER_NOT_FOUND, exc


@pytest.mark.parametrize("mode", ["session", "unary-watch"])
def test_cut_links_lose_no_terminal_status_and_repeat_none(mode: str) -> None:
    """The link is cut again and again while requests run; each still ends exactly once, bytes intact."""
    session = mode != "unary-watch"
    peer = DecodeRank.for_spec(SPEC, pages=128)
    rooms = list(range(1, 25))
    placed = {room: peer.pages_for(SPEC.prompt_tokens, first_page=(i % 8) * 16) for i, room in enumerate(rooms)}
    proxy = CuttableProxy(0)
    stop = threading.Event()
    cuts: threading.Thread | None = None
    try:
        with running_server(*SERVE_ARGS) as srv:
            proxy.upstream = srv.port
            with HandshakeClient(proxy.target, timeout=20, session=session) as client, \
                    HandshakeClient(srv.target, session=False) as direct:
                peer_id = client.register(peer.registration()).peer_id
                seen: list[transfer_pb2.TransferStatus] = []
                # The watch ends when the peer is deregistered below; its deadline only bounds a hang.
                watcher = threading.Thread(target=_watch_all, args=(client, peer_id, set(rooms), 90, seen))
                if session:  # submits ride the session too, so cut while they go out
                    cuts = proxy.cut_repeatedly(stop)
                    watcher.start()
                for i, room in enumerate(rooms):
                    # Rooms share pages in groups of 8: the next group waits until the last is done.
                    if i and i % 8 == 0:
                        client.wait_for(peer_id, rooms[i - 8:i], timeout=20)
                    client.submit_transfer(peer_id, peer.transfer_info(room, placed[room]))
                if not session:  # unary submits are done: now cut the status streams
                    watcher.start()
                    cuts = proxy.cut_repeatedly(stop)
                done = client.wait_for(peer_id, rooms, timeout=20)
                time.sleep(1.0)
                stop.set()
                assert cuts is not None
                cuts.join()
                assert proxy.cuts >= 3 and proxy.connections >= 3, (proxy.cuts, proxy.connections)
                assert proxy.dropped > 0
                assert all(s.state == SUCCESS for s in done.values()), done
                # Every reconnect resumed the one session: none was started over.
                view = direct.describe(peer_id=peer_id, include_finished=True, request_limit=100,
                                       credential=client.credential(peer_id)).peers[0]
                if session:
                    assert view.sessions_connected + view.sessions_detached == 1, view
                assert view.finished_kept == len(rooms) and view.open_requests == 0
                assert sorted(s.room for s in view.finished if s.state == SUCCESS) == rooms
                # The watch has every terminal status before the peer goes (a watch cut later
                # would re-open onto PEER_NOT_FOUND); a repeat would still arrive before its end.
                waited = time.monotonic()
                while set(_terminal_counts(list(seen))) != set(rooms) and time.monotonic() - waited < 30:
                    time.sleep(0.05)
                client.deregister(peer_id)
                watcher.join()
                counts = _terminal_counts(seen)
                assert counts == {room: 1 for room in rooms}, counts
        last = {room: placed[room] for room in rooms[-8:]}  # the last room on each page range
        peer.verify(last, SPEC.prompt_tokens)
    finally:
        stop.set()  # a failed check above must not leave the cutting thread on a closed proxy
        if cuts is not None:
            cuts.join()
        proxy.close()
        peer.close()


def test_restarted_server_loses_no_terminal_status_and_repeats_none() -> None:
    """SIGTERM mid-transfer: every request ends once before the stream closes; the decode re-registers."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    args = (*SERVE_ARGS[:-4], "--chunk-delay-ms", "150", "--match-timeout", "10")
    try:
        with running_server(*args) as first, HandshakeClient(first.target, timeout=10) as client:
            port = first.port
            peer_id = client.register(peer.registration()).peer_id
            placed = {room: peer.pages_for(SPEC.prompt_tokens, first_page=i * 16) for i, room in enumerate((1, 2, 3))}
            for room, pages in placed.items():
                client.submit_transfer(peer_id, peer.transfer_info(room, pages))
            seen: list[transfer_pb2.TransferStatus] = []
            for status in client.watch_status(peer_id, placed, timeout=20):
                seen.append(status)
                if status.state == common_pb2.TRANSFER_STATE_TRANSFERRING:
                    break
            first.proc.send_signal(signal.SIGTERM)
            for status in client.watch_status(peer_id, placed, timeout=20):
                seen.append(status)
            assert first.proc.wait(timeout=20) == 0
            counts = _terminal_counts(seen)
            assert counts == {1: 1, 2: 1, 3: 1}, counts
            final = {s.room: s for s in seen if is_terminal(s)}
            assert all(s.state == SUCCESS or s.failure_code == "SHUTTING_DOWN" for s in final.values()), final
            # The same client reaches the restarted server on the same port; the old peer is gone there.
            with running_server(*args, "--listen", f"127.0.0.1:{port}") as second:
                with pytest.raises(E.NotFoundError) as gone:
                    client.submit_transfer(peer_id, peer.transfer_info(9, placed[1]))
                assert gone.value.reason is Reason.PEER_NOT_FOUND
                again = client.register(peer.registration()).peer_id
                later = {room: placed[room - 3] for room in (4, 5, 6)}
                for room, pages in later.items():
                    client.submit_transfer(again, peer.transfer_info(room, pages))
                more: list[transfer_pb2.TransferStatus] = []
                watcher = threading.Thread(target=_watch_all, args=(client, again, set(later), 4, more))
                watcher.start()
                done = client.wait_for(again, later, timeout=20)
                watcher.join()
                assert all(s.state == SUCCESS for s in done.values()), done
                assert _terminal_counts(more) == {4: 1, 5: 1, 6: 1}
                peer.verify(later, SPEC.prompt_tokens)
                assert client.describe(peer_id=again).peers[0].sessions_connected == 1
                client.deregister(again)
    finally:
        peer.close()


async def _flood(target: str, peer_id: str, credential: bytes, written: list[int], stop: asyncio.Event) -> None:
    """A peer that writes submits as fast as it can and never reads or acknowledges anything."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = hs_grpc.HandshakeServiceStub(channel).Session()
        await call.write(hs.SessionRequest(open=session_pb2.SessionOpen(peer_id=peer_id, peer_credential=credential)))
        try:
            await flood(call.write, written, stop)
        finally:
            call.cancel()


async def _open_raw(target: str, peer_id: str, credential: bytes, resume: str) -> hs.SessionResponse:
    """Open (or resume) a session with a bare stream and return the server's first message."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = hs_grpc.HandshakeServiceStub(channel).Session()
        await call.write(hs.SessionRequest(open=session_pb2.SessionOpen(
            peer_id=peer_id, peer_credential=credential, resume_session_id=resume)))
        first = await call.read()
        if not isinstance(first, hs.SessionResponse):
            await call  # raises the stream's status
        call.cancel()
        assert isinstance(first, hs.SessionResponse)
        return first


def test_a_flooding_peer_is_held_back_while_another_peer_completes() -> None:
    flooder, good = DecodeRank.for_spec(SPEC, pages=64), DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--max-inflight", "100000") as srv, \
                HandshakeClient(srv.target, timeout=20) as client:
            bad_id = client.register(flooder.registration()).peer_id
            good_id = client.register(good.registration()).peer_id
            credential = client.credential(bad_id)
            with flooding(lambda written, stop: _flood(srv.target, bad_id, credential, written, stop)) as written:
                check_held_back(client, good, good_id, bad_id, written)
                # A session id is no capability: another peer's credential cannot resume it.
                opened = asyncio.run(_open_raw(srv.target, good_id, client.credential(good_id), ""))
                assert opened.opened.session_id
                with pytest.raises(grpc.RpcError) as stolen:
                    asyncio.run(_open_raw(srv.target, bad_id, client.credential(bad_id), opened.opened.session_id))
                assert stolen.value.code() is grpc.StatusCode.NOT_FOUND
                assert "SESSION_NOT_FOUND" in str(stolen.value.trailing_metadata())
    finally:
        flooder.close()
        good.close()


def test_a_killed_server_fails_waits_and_aborts_as_unavailable_within_their_deadline() -> None:
    """SIGKILL the prefill mid-request: the waiting decode gets UNAVAILABLE with the cause by its deadline.

    Before, the wait and the abort that follows it each ended as a bare DEADLINE_EXCEEDED
    ("opening the session"), which does not tell a decode its prefill is gone.
    """
    peer = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, "--chunk-delay-ms", "2000") as srv:
            with HandshakeClient(srv.target, timeout=20) as client:
                peer_id = client.register(peer.registration()).peer_id
                client.submit_transfer(peer_id, peer.transfer_info(1, peer.pages_for(SPEC.prompt_tokens)))
                watch = client.watch_status(peer_id, [1], timeout=4)
                assert next(watch).room == 1  # watching, on an open stream
                srv.kill()
                with pytest.raises(E.UnavailableError, match="unreachable"):
                    for _ in watch:  # a watch that began on a live stream, too
                        pass
                with pytest.raises(E.UnavailableError, match="unreachable") as waited:
                    client.wait_for(peer_id, [1], timeout=3)
                assert waited.value.metadata["cause"] == "UNAVAILABLE"
                with pytest.raises(E.UnavailableError, match="unreachable"):
                    client.abort(peer_id, 1, 0, timeout=2)
    finally:
        peer.close()


def test_a_session_opened_for_a_gone_peer_delivers_its_final_statuses() -> None:
    """A peer written off as gone is still known until released: a new Session gets its final
    statuses, then ends with PEER_GONE (it refused at once with PEER_GONE before, losing them)."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--keep-finished", "60") as srv:
            with HandshakeClient(srv.target, timeout=20) as client:
                peer_id = client.register(peer.registration()).peer_id
                credential = client.credential(peer_id)
                pages = peer.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(peer_id, peer.transfer_info(1, pages))
                assert client.wait_for(peer_id, [1], timeout=20)[1].state == SUCCESS
                peer.executor.close()  # the decode drops its memory: the next transfer finds it gone
                client.submit_transfer(peer_id, peer.transfer_info(2, pages))
                assert client.wait_for(peer_id, [2], timeout=20)[2].failure_code == "PEER_GONE"
            with HandshakeClient(srv.target, timeout=20) as late:
                late.adopt(peer_id, credential)
                finals = late.wait_for(peer_id, [1, 2], timeout=20)
                assert (finals[1].state, finals[2].failure_code) == (SUCCESS, "PEER_GONE"), finals
                with pytest.raises(E.RequestFailedError) as ended:
                    late.submit_transfer(peer_id, peer.transfer_info(3, pages))
                assert ended.value.reason is Reason.PEER_GONE
    finally:
        peer.close()
