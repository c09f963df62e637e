"""The local backend's arena handover on the event loop (``LocalExecutor.start_connect``), as Register uses it.

The same refusals as the blocking ``connect`` (tests/test_local_arena.py runs those both
ways), plus what only the loop path has: a decode that accepts the connection and never
answers fails at the deadline without holding the loop, and a decode whose socket takes
no connection now (its backlog is full) sends the caller back to the blocking path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import socket
from collections.abc import Iterator

import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import DeadlineExceededError, Reason
from pdproto.transfer import arena
from pdproto.transfer.local import LocalExecutor
from pdproto.v1 import common_pb2, registration_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _silent_listener() -> tuple[socket.socket, str]:
    """An arena socket that accepts connections (the kernel does) and never answers: a frozen decode."""
    name = f"pdproto-arena-1-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    return listener, name


@pytest.fixture
def silent() -> Iterator[str]:
    """The name of a silent arena socket."""
    listener, name = _silent_listener()
    yield name
    listener.close()


def _silenced(rank: DecodeRank, name: str) -> registration_pb2.KvRegistration:
    """The rank's registration with its arena socket swapped for a silent one."""
    reg = rank.registration()
    reg.local.socket, reg.local.secret, reg.local.pid = name, secrets.token_bytes(32), 0
    return reg


def test_a_silent_decode_fails_at_the_deadline_and_the_loop_runs_meanwhile(silent: str) -> None:
    rank = DecodeRank.for_spec(SPEC, pages=8)
    reg = _silenced(rank, silent)
    ex = LocalExecutor(arena_bytes=1 << 20)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def main() -> None:
        pending = ex.start_connect(reg)
        assert pending is not None  # the kernel accepted: the wait is for the decode's answer
        ticker = asyncio.get_running_loop().create_task(tick())
        try:
            with pytest.raises(DeadlineExceededError) as info:
                await pending.finish("p", 0.5)
        finally:
            pending.close()
            ticker.cancel()
        assert info.value.reason is Reason.DEADLINE_EXCEEDED
        assert "hand its arena over in time" in info.value.message

    try:
        asyncio.run(main())
        assert ticks > 0, "the loop did not run while the handover waited"
    finally:
        ex.close()
        rank.close()


def test_a_full_backlog_sends_the_caller_to_the_blocking_connect() -> None:
    name = f"pdproto-arena-1-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(0)
    queued: list[socket.socket] = []
    try:
        while True:  # fill the backlog: nobody accepts
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect("\0" + name)
            except BlockingIOError:
                break
        endpoint = registration_pb2.LocalEndpoint(shm_name="x", socket=name, secret=secrets.token_bytes(32))
        assert arena.Handover.start(endpoint, 0) is None
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_register_over_the_loop_path_moves_bytes_and_a_silent_decode_does_not_stop_others(silent: str) -> None:
    peer, frozen = DecodeRank.for_spec(SPEC, pages=32), DecodeRank.for_spec(SPEC, pages=8)
    try:
        with running_server(*SERVE_ARGS, "--engine-timeout", "10") as srv, \
                HandshakeClient(srv.target, timeout=30) as client, HandshakeClient(srv.target, timeout=30) as other, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(other.register, _silenced(frozen, silent))
            # While that Register waits on the silent decode, this one is served in full.
            peer_id = client.register(peer.registration()).peer_id
            pages = peer.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(peer_id, peer.transfer_info(7, pages))
            done = client.wait_for(peer_id, [7], timeout=30)
            assert not waiting.done(), "the silent decode's Register ended before the healthy one's transfer"
            with pytest.raises(DeadlineExceededError) as info:
                waiting.result(timeout=60)
            assert "hand its arena over in time" in info.value.message, info.value.message
        assert done[7].state == common_pb2.TRANSFER_STATE_SUCCESS, done[7]
        peer.verify({7: pages}, SPEC.prompt_tokens)
    finally:
        peer.close()
        frozen.close()
