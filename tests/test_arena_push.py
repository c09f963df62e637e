"""A decode pushes its local arena to the prefill's inbox before Register (``pdproto/transfer/inbox.py``).

Register then takes the waiting descriptor instead of waking the decode to ask for it. A
pushed arena gets every check a fetched one gets; a push that is missing, malformed, over
a bound or too old leaves Register to fetch as before; a decode pushes only to the process
the prefill published. Real processes: ``pdproto serve``, demo decode ranks, and a hostile
local peer (``tests._arena_peer``) that pushes whatever a test asks for.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import time
from collections.abc import Iterator

import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import InvalidFieldError, Reason, RequestFailedError
from pdproto.transfer import arena, inbox, offer
from pdproto.transfer.local import LocalExecutor
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.proc import Child

from ._arena_peer import spawned
from ._server_harness import SERVE_ARGS, SPEC, running_server
from .test_local_arena import REFUSED

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture
def hostile() -> Iterator[Child]:
    with spawned() as child:
        yield child


@pytest.fixture
def prefill() -> Iterator[LocalExecutor]:
    ex = LocalExecutor(arena_bytes=1 << 20, connect_timeout_s=2)
    ex.inbox()
    yield ex
    ex.close()


def _inbox(ex: LocalExecutor) -> str:
    return ex.inbox().socket


def _registration(reply: dict[str, object]) -> registration_pb2.KvRegistration:
    return registration_pb2.KvRegistration.FromString(bytes.fromhex(str(reply["registration"])))


def _server(rank: DecodeRank) -> arena.ArenaServer:
    server = rank.executor._server  # type: ignore[attr-defined]
    assert isinstance(server, arena.ArenaServer)
    return server


async def _finish_on_loop(ex: LocalExecutor, reg: registration_pb2.KvRegistration, peer: str = "p") -> None:
    """Register's path, on the running loop: ``start_connect``, then ``finish``."""
    pending = ex.start_connect(reg)
    assert pending is not None
    try:
        await pending.finish(peer, 5.0)
    finally:
        pending.close()


def _connect_on_loop(ex: LocalExecutor, reg: registration_pb2.KvRegistration, peer: str = "p") -> None:
    """``_finish_on_loop`` on a loop of its own."""
    asyncio.run(_finish_on_loop(ex, reg, peer))


def test_register_takes_the_pushed_arena_and_moves_bytes_without_asking_the_decode() -> None:
    pushed, asked = DecodeRank.for_spec(SPEC, pages=32), DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, "--metrics-port", "0") as srv, \
                HandshakeClient(srv.target, timeout=30) as client:
            info = client.get_server_info()
            assert arena.INBOX_NAME.fullmatch(info.local_inbox.socket), info.local_inbox
            assert info.local_inbox.pid == srv.proc.pid
            assert offer(pushed.executor, info)
            peer_id = client.register(pushed.registration()).peer_id
            # A decode that does not push is asked for its arena, as before.
            other = client.register(asked.registration()).peer_id
            for room, (rank, peer) in enumerate([(pushed, peer_id), (asked, other)], start=11):
                pages = rank.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(peer, rank.transfer_info(room, pages))
                done = client.wait_for(peer, [room], timeout=30)
                assert done[room].state == common_pb2.TRANSFER_STATE_SUCCESS, done[room]
                rank.verify({room: pages}, SPEC.prompt_tokens)
            samples = srv.metrics()
            assert samples['pdproto_local_arenas_total{how="pushed"}'] == 1
            assert samples['pdproto_local_arenas_total{how="fetched"}'] == 1
        assert (_server(pushed).pushed, _server(pushed).asked) == (1, 0)
        assert (_server(asked).pushed, _server(asked).asked) == (0, 1)
    finally:
        pushed.close()
        asked.close()


def test_register_refuses_a_bad_pushed_arena_with_its_reason_and_serves_the_next(hostile: Child) -> None:
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=30) as client:
            name = client.get_server_info().local_inbox.socket
            reg = rank.registration()
            # The rank's layout, with the hostile process's unsealed arena pushed in its place.
            reg.local.CopyFrom(_registration(hostile.call("push", kind="unsealed", inbox=name)).local)
            with pytest.raises(InvalidFieldError) as info:
                client.register(reg)
            assert "F_SEAL_SHRINK" in info.value.message, info.value
            assert hostile.call("hung_up")["hung_up"] == 1
            assert offer(rank.executor, client.get_server_info())
            client.register(rank.registration())
        assert (_server(rank).pushed, _server(rank).asked) == (1, 0)
    finally:
        rank.close()


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_pushed_arena_gets_every_check_a_fetched_one_gets(hostile: Child, prefill: LocalExecutor,
                                                            kind: str) -> None:
    reg = _registration(hostile.call("push", kind=kind, inbox=_inbox(prefill)))
    if kind in ("two_fds", "no_fd", "wrong_answer"):
        # Not a push at all: the inbox drops it, and Register asks the decode, which listens nowhere.
        with pytest.raises(RequestFailedError) as gone:
            _connect_on_loop(prefill, reg)
        assert gone.value.reason is Reason.PEER_GONE
        assert prefill.stats.arenas_pushed == 0
        return
    with pytest.raises(InvalidFieldError) as info:
        _connect_on_loop(prefill, reg)
    assert REFUSED[kind] in info.value.message, info.value.message
    assert hostile.call("hung_up")["hung_up"] == 1, "a refused push was not closed"


def test_a_pushed_arena_is_refused_for_a_registration_naming_another_process(hostile: Child,
                                                                             prefill: LocalExecutor) -> None:
    reg = _registration(hostile.call("push", kind="good", inbox=_inbox(prefill)))
    reg.local.pid = os.getpid()
    with pytest.raises(InvalidFieldError) as info:
        prefill.connect("p", reg)
    assert info.value.field == "registration.local.pid", info.value


def test_a_push_is_found_only_by_its_own_secret(hostile: Child, prefill: LocalExecutor) -> None:
    reg = _registration(hostile.call("push", kind="good", inbox=_inbox(prefill)))
    secret = reg.local.secret
    reg.local.secret = bytes(32)
    with pytest.raises(RequestFailedError):  # nothing pushed under that secret; nobody listens to ask
        prefill.connect("p", reg)
    reg.local.secret = secret
    prefill.connect("p", reg)
    assert prefill.stats.arenas_pushed == 1
    prefill.disconnect("p")


def test_one_process_flooding_the_inbox_keeps_a_few_places_and_others_still_push(
        hostile: Child, prefill: LocalExecutor) -> None:
    flood = hostile.call("push", kind="good", inbox=_inbox(prefill), count=3 * inbox.MAX_PUSHED_PER_PID)
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        info = server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox())
        assert offer(rank.executor, info)
        prefill.connect("mine", rank.registration())
        assert prefill.stats.arenas_pushed == 1 and _server(rank).asked == 0
        # The flood's connections beyond its share were closed at once; the rest wait for a Register.
        closed = hostile.call("hung_up")
        assert closed["held"] == flood["sent"] == 3 * inbox.MAX_PUSHED_PER_PID
        assert closed["hung_up"] == flood["sent"] - inbox.MAX_PUSHED_PER_PID
        # Its last push is one that was kept.
        prefill.connect("flood", _registration(flood))
        assert prefill.stats.arenas_pushed == 2
    finally:
        rank.close()


def test_an_unclaimed_push_is_closed_once_its_time_is_up(hostile: Child, prefill: LocalExecutor,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbox, "PUSH_TTL_S", 0.3)
    first = _registration(hostile.call("push", kind="good", inbox=_inbox(prefill)))
    stranger = registration_pb2.KvRegistration()
    stranger.CopyFrom(first)
    stranger.local.secret = bytes(32)
    with pytest.raises(RequestFailedError):  # no loop watches this inbox: a Register reads what waits
        prefill.connect("x", stranger)
    time.sleep(0.4)
    second = _registration(hostile.call("push", kind="good", inbox=_inbox(prefill)))
    prefill.connect("p", second)  # reading the second push closes the first, which waited too long
    assert hostile.call("hung_up")["hung_up"] == 1
    with pytest.raises(RequestFailedError):
        prefill.connect("q", first)
    assert prefill.stats.arenas_pushed == 1
    prefill.disconnect("p")


def test_a_push_sent_after_its_connection_is_read_when_it_comes(prefill: LocalExecutor) -> None:
    rank = DecodeRank.for_spec(SPEC, pages=8)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server = _server(rank)

        async def main() -> None:
            prefill.inbox(asyncio.get_running_loop())
            conn.connect("\0" + _inbox(prefill))
            await asyncio.sleep(0.05)  # the loop accepts the connection; nothing has come on it yet
            # What ArenaServer.push sends, sent late: the loop reads it when it comes.
            message = arena._PUSH.pack(arena.PUSH, len(server.secret)) + server.secret
            conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [server.fd]))])
            await asyncio.sleep(0.05)
            await _finish_on_loop(prefill, rank.registration())
            prefill.close()  # on the loop's thread: stops watching before the socket closes

        asyncio.run(main())
        assert prefill.stats.arenas_pushed == 1 and server.asked == 0
    finally:
        conn.close()
        rank.close()


def test_a_decode_pushes_nothing_to_a_socket_another_process_holds(prefill: LocalExecutor) -> None:
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        name = f"pdproto-inbox-{os.getpid()}-{'5' * 32}"
        squatter.bind("\0" + name)
        squatter.listen(4)
        squatter.setblocking(False)
        # The published pid is not this (the squatting) process: a dead prefill's name, taken over.
        stale = server_info_pb2.PrefillServerInfo(local_inbox=server_info_pb2.LocalInbox(socket=name, pid=1))
        assert not offer(rank.executor, stale)
        conn, _ = squatter.accept()
        conn.setblocking(False)
        msg, ancdata, _, _ = conn.recvmsg(256, socket.CMSG_SPACE(16))
        assert (msg, ancdata) == (b"", []), "the decode sent something to a process it should not trust"
        conn.close()
        for bad in (server_info_pb2.LocalInbox(socket="/tmp/x", pid=os.getpid()),
                    server_info_pb2.LocalInbox(socket=name)):
            assert not offer(rank.executor, server_info_pb2.PrefillServerInfo(local_inbox=bad))
        assert not offer(rank.executor, server_info_pb2.PrefillServerInfo())
        assert _server(rank).pushed == 0
    finally:
        squatter.close()
        rank.close()


def test_an_inbox_watched_by_a_closed_loop_is_taken_over_by_the_next(prefill: LocalExecutor) -> None:
    """A server started again in the same process (a new event loop) reads pushes on its own loop."""
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        for run in range(2):
            async def main() -> None:
                info = server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox(asyncio.get_running_loop()))
                assert offer(rank.executor, info)
                await asyncio.sleep(0.05)  # this loop reads the push
                await _finish_on_loop(prefill, rank.registration(), f"p{run}")

            asyncio.run(main())
        assert prefill.stats.arenas_pushed == 2 and _server(rank).asked == 0
    finally:
        rank.close()
