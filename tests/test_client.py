"""HandshakeClient / AsyncHandshakeClient against a real server: deadlines, retries, typed errors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator

import pytest

from pdproto import errors as E
from pdproto.client import AsyncHandshakeClient, HandshakeClient, RetryConfig, UnavailableError
from pdproto.errors import Reason
from pdproto.v1 import common_pb2
from pdproto_demo.cluster import free_port
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, ServerProcess, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(*SERVE_ARGS) as srv:
        yield srv


def test_unavailable_is_retried_then_raised_typed() -> None:
    target = f"127.0.0.1:{free_port()}"
    with HandshakeClient(target, timeout=1.0, retry=RetryConfig(attempts=3, initial_backoff=0.01)) as client:
        with pytest.raises(UnavailableError) as info:
            client.get_server_info()
    assert info.value.reason is Reason.UNAVAILABLE
    assert info.value.metadata["grpcCode"] == "UNAVAILABLE"
    assert isinstance(info.value, ConnectionError)


def test_retry_sleeps_are_jittered_and_settings_checked() -> None:
    """Clients broken by one event must not retry in step: each sleep varies within 1 ± jitter."""
    retry = RetryConfig(attempts=41, initial_backoff=0.1, max_backoff=0.1, jitter=0.25)
    sleeps = list(retry.backoffs())
    assert len(sleeps) == 40 and all(0.075 <= s <= 0.125 for s in sleeps), sleeps
    assert len(set(sleeps)) > 30, sleeps
    for bad in ({"attempts": 0}, {"initial_backoff": 2.0}, {"multiplier": 0.5}, {"jitter": 1.0}, {"jitter": -0.1}):
        with pytest.raises(E.ConfigError, match="RetryConfig"):
            RetryConfig(**bad)  # type: ignore[arg-type]


def test_a_refusal_that_says_when_to_retry_is_waited_for_and_others_are_not_retried() -> None:
    from pdproto.client._rpc import next_try, retry_hint

    refusal = E.ResourceLimitError("queue full", reason=Reason.TOO_MANY_REGISTRATIONS,
                                   metadata={"retryAfterMs": "750"})
    assert retry_hint(refusal) == 0.75
    assert next_try(refusal, iter([0.05])) == 0.75  # at least as long as it says
    assert next_try(refusal, iter([2.0])) == 2.0
    assert next_try(refusal, iter([])) is None  # out of tries
    assert next_try(E.ResourceLimitError("full", reason=Reason.TOO_MANY_PEERS), iter([0.05])) is None
    assert next_try(UnavailableError("down"), iter([0.05])) == 0.05


def test_a_session_opening_against_a_down_prefill_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a session waits between tries as every retry does. Before, the pump stopped at each
    failed open (no command or watcher waited yet) and the opening caller started it again at once:
    4,796 opens in 2 s."""
    from pdproto.client import _session as client_session

    tries = 0
    stream = client_session.PeerSession._stream

    async def counted(self: client_session.PeerSession) -> None:
        nonlocal tries
        tries += 1
        return await stream(self)

    monkeypatch.setattr(client_session.PeerSession, "_stream", counted)
    retry = RetryConfig(initial_backoff=0.1, max_backoff=0.1, jitter=0.25)

    async def run() -> float:
        async with AsyncHandshakeClient(f"127.0.0.1:{free_port()}", timeout=1.0, retry=retry) as client:
            started = asyncio.get_running_loop().time()
            with pytest.raises(UnavailableError, match="opening the session"):
                await client.wait_for("p-0000000000000000", [1], credential=bytes(32))
            return asyncio.get_running_loop().time() - started

    elapsed = asyncio.run(run())
    assert 1 <= tries <= elapsed / 0.075 + 1, (tries, elapsed)


@pytest.mark.process
def test_not_found_is_not_retried_and_carries_metadata(server: ServerProcess) -> None:
    with HandshakeClient(server.target) as client:
        with pytest.raises(E.NotFoundError) as info:
            client.abort("p-missing", 1)
        assert info.value.reason is Reason.PEER_NOT_FOUND
        assert info.value.metadata["peerId"] == "p-missing"
        assert info.value.__cause__ is not None


@pytest.mark.process
def test_watch_deadline_becomes_typed_error(server: ServerProcess) -> None:
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with HandshakeClient(server.target) as client:
            peer_id = client.register(peer.registration()).peer_id
            with pytest.raises(E.RequestFailedError) as info:
                list(client.watch_status(peer_id, [123456], timeout=0.3))
            assert info.value.reason is Reason.DEADLINE_EXCEEDED
            client.deregister(peer_id)
    finally:
        peer.close()


@pytest.mark.process
def test_async_client_end_to_end(server: ServerProcess) -> None:
    peer = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=1, pages=16)

    async def run() -> None:
        async with AsyncHandshakeClient(server.target, timeout=10) as client:
            info = await client.get_server_info()
            assert info.page_size == SPEC.page_size
            result = await client.register(peer.registration())
            assert result.mode == 2  # NEGOTIATION_MODE_DENSE_TO_DCP
            pages = peer.pages_for(SPEC.prompt_tokens)
            first = await client.submit_transfer(result.peer_id, peer.transfer_info(77, pages))
            assert first.state == common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT
            async for status in client.watch_status(result.peer_id, [77], timeout=20):
                if status.state in (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED):
                    assert status.state == common_pb2.TRANSFER_STATE_SUCCESS, status
                    break
            with pytest.raises(E.RequestFailedError) as dup:
                await client.submit_transfer(result.peer_id, peer.transfer_info(77, pages))
            assert dup.value.reason is Reason.DUPLICATE_REQUEST
            assert await client.deregister(result.peer_id) == 0
        peer.verify({77: pages}, SPEC.prompt_tokens)

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        peer.close()


@pytest.mark.process
@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
def test_one_blocking_client_serves_many_threads_and_a_watch_closed_early_ends(server: ServerProcess,
                                                                              session: bool) -> None:
    """The blocking client runs the async one on the shared loop thread: threads calling one client
    at once each get their own answers; an iterator closed early ends its watch (with unary calls
    the server counts no WatchStatus stream left); closing twice is harmless."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    client = HandshakeClient(server.target, timeout=20, session=session)
    try:
        peer_id = client.register(peer.registration()).peer_id
        watch = client.watch_status(peer_id, timeout=20)

        def transfer(room: int) -> tuple[int, int]:
            client.submit_transfer(peer_id, peer.transfer_info(room, peer.pages_for(SPEC.prompt_tokens, 16 * room)))
            return room, client.wait_for(peer_id, [room])[room].state

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = dict(pool.map(transfer, range(4)))
        assert done == dict.fromkeys(range(4), common_pb2.TRANSFER_STATE_SUCCESS)
        assert next(watch).room in range(4)
        watch.close()

        def watch_streams() -> int:
            (view,) = client.describe(peer_id=peer_id).peers
            return int(view.watch_streams)

        end = time.monotonic() + 10
        while watch_streams() and time.monotonic() < end:
            time.sleep(0.05)
        assert watch_streams() == 0
        assert client.deregister(peer_id) == 0
        peer.verify({room: peer.pages_for(SPEC.prompt_tokens, 16 * room) for room in range(4)}, SPEC.prompt_tokens)
    finally:
        client.close()
        client.close()
        peer.close()


@pytest.mark.process
def test_oversized_message_is_refused_typed(server: ServerProcess) -> None:
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        reg = peer.registration()
        reg.capabilities.append("x" * (5 << 20))  # over the symmetric 4 MiB limit
        with HandshakeClient(server.target) as client:
            with pytest.raises(E.ResourceLimitError) as info:
                client.register(reg)
            assert info.value.reason is Reason.MESSAGE_TOO_LARGE
            assert info.value.metadata["grpcCode"] == "RESOURCE_EXHAUSTED"
            assert info.value.metadata["limit"] == str(4 << 20)  # gRPC's text names the sizes; the error carries them
            assert int(info.value.metadata["size"]) > 5 << 20
            assert client.get_server_info().page_size == SPEC.page_size
    finally:
        peer.close()


@pytest.mark.process
def test_a_call_made_before_the_server_starts_succeeds_within_its_deadline() -> None:
    """A decode that reaches a (re)starting prefill keeps retrying UNAVAILABLE until the deadline."""
    import threading

    port = free_port()
    results: list[object] = []
    with HandshakeClient(f"127.0.0.1:{port}", timeout=20.0) as client:
        caller = threading.Thread(target=lambda: results.append(_info_or_error(client)))
        caller.start()
        try:
            with running_server(*SERVE_ARGS, "--listen", f"127.0.0.1:{port}"):
                caller.join(timeout=25)
        finally:
            caller.join(timeout=25)
    assert len(results) == 1
    assert isinstance(results[0], common_pb2.ParallelGroup), results[0]


def _info_or_error(client: HandshakeClient) -> object:
    try:
        return client.get_server_info().attn_tp
    except Exception as exc:  # noqa: BLE001 - the test reports what came back
        return exc
