"""Errors cross gRPC as one class per reason: what the server raises is what the client raises.

Every reason goes through the server's real status wrapper and the real client; then a
representative reason of each class reachable from outside is provoked on a real
``pdproto serve`` process. Each arrives as ``error_class(reason)`` with the declared code.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from pdproto import errors as E
from pdproto.client import AsyncHandshakeClient, HandshakeClient, RetryConfig
from pdproto.errors import GRPC_CODE_NAMES, PdprotoError, Reason, error_class, error_for
from pdproto import v1
from pdproto.v1 import handshake_service_pb2_grpc
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import SyntheticSpec
from pdproto_server import _status

from ._server_harness import ServerProcess, running_server

pytestmark = pytest.mark.process

SPEC = SyntheticSpec(layers=1, row_bytes=128, pages=64, page_size=16, prompt_tokens=64,
                     chunk_tokens=32, chunk_delay=0.5)
TOKEN = "errors-test-token"


def arrived_as(err: PdprotoError, reason: Reason) -> None:
    """The error is the reason's one class, with the reason and the declared gRPC code."""
    assert err.reason is reason, err
    assert type(err) is error_class(reason), (type(err).__name__, error_class(reason).__name__)
    assert err.metadata["grpcCode"] == GRPC_CODE_NAMES[reason], err.metadata


class _RaisesWhatItIsTold(handshake_service_pb2_grpc.HandshakeServiceServicer):
    """GetServerInfo raises the error of the reason the test set in ``next`` (no auth here)."""

    def __init__(self) -> None:
        self.calls: dict[Reason, int] = {}
        self.next = Reason.INTERNAL

    @_status.unary
    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        reason = self.next
        self.calls[reason] = self.calls.get(reason, 0) + 1
        if reason is Reason.INVALID_FIELD:
            raise E.InvalidFieldError.of([("registration.page_size", "must be > 0"),
                                          ("registration.kv_buffers", "required")])
        raise error_for(reason, f"raised {reason.name}", {"room": 7})


def test_every_reason_raised_by_a_handler_arrives_as_its_class() -> None:
    servicer = _RaisesWhatItIsTold()

    async def run() -> dict[Reason, PdprotoError]:
        server = grpc.aio.server()
        handshake_service_pb2_grpc.add_HandshakeServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        got: dict[Reason, PdprotoError] = {}
        try:
            for reason in Reason:
                retry = RetryConfig(attempts=3, initial_backoff=0.01)
                servicer.next = reason
                async with AsyncHandshakeClient(f"127.0.0.1:{port}", retry=retry) as client:
                    with pytest.raises(PdprotoError) as info:
                        await client.get_server_info()
                    got[reason] = info.value
        finally:
            await server.stop(0)
        return got

    got = asyncio.run(asyncio.wait_for(run(), 60))
    for reason, err in got.items():
        arrived_as(err, reason)
        if reason is not Reason.INVALID_FIELD:
            assert err.metadata["room"] == "7" and err.message == f"raised {reason.name}"
    # Retryability is the class's declaration: only those calls were sent again.
    assert {r for r, n in servicer.calls.items() if n == 3} == {r for r in Reason if error_class(r).retryable}
    assert {n for r, n in servicer.calls.items() if not error_class(r).retryable} == {1}
    field_err = got[Reason.INVALID_FIELD]
    assert isinstance(field_err, E.InvalidFieldError)
    assert field_err.violations == (("registration.page_size", "must be > 0"),
                                    ("registration.kv_buffers", "required"))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ("--layers", str(SPEC.layers), "--row-bytes", str(SPEC.row_bytes), "--pages", str(SPEC.pages),
            "--page-size", str(SPEC.page_size), "--prompt-tokens", str(SPEC.prompt_tokens),
            "--chunk-tokens", str(SPEC.chunk_tokens), "--chunk-delay-ms", "500",
            "--max-inflight", "2", "--match-timeout", "10")
    with running_server(*args, token=TOKEN) as srv:
        yield srv


def _expect(reason: Reason, call: Any, *args: Any, **kwargs: Any) -> PdprotoError:
    with pytest.raises(PdprotoError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            list(result)
    arrived_as(info.value, reason)
    return info.value


def test_representative_reasons_from_a_real_server(server: ServerProcess) -> None:
    with HandshakeClient(server.target) as anon:
        _expect(Reason.UNAUTHENTICATED, anon.get_server_info)
    with HandshakeClient(server.target, token="wrong") as wrong:  # the server cannot prove it: sent nothing
        _expect(Reason.RANK_UNPROVEN, wrong.get_server_info)
    peer = DecodeRank.for_spec(SPEC, pages=8)
    mismatched = DecodeRank.for_spec(SPEC, pages=8, kv_dtype="fp8_e4m3")
    try:
        with HandshakeClient(server.target, token=TOKEN, timeout=10) as client:
            _expect(Reason.TOPOLOGY_KV_DTYPE_MISMATCH, client.register, mismatched.registration())
            newer = peer.registration()
            newer.version.major = 2
            err = _expect(Reason.UNSUPPORTED_VERSION, client.register, newer)
            assert isinstance(err, E.TopologyError) and isinstance(err, E.WireError)
            err = _expect(Reason.INVALID_FIELD, client.register, v1.KvRegistration())
            assert isinstance(err, E.InvalidFieldError) and err.violations
            huge = peer.registration()
            huge.capabilities.append("x" * (5 << 20))
            _expect(Reason.MESSAGE_TOO_LARGE, client.register, huge)
            _expect(Reason.PEER_NOT_FOUND, client.abort, "p-missing", 1)

            peer_id = client.register(peer.registration()).peer_id
            pages = peer.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(peer_id, peer.transfer_info(1, pages, generation=2))
            _expect(Reason.DUPLICATE_REQUEST, client.submit_transfer, peer_id,
                    peer.transfer_info(1, pages, generation=2))
            _expect(Reason.STALE_GENERATION, client.abort, peer_id, 1, generation=1)
            _expect(Reason.DESTINATION_OUT_OF_BOUNDS, client.submit_transfer, peer_id,
                    peer.transfer_info(2, [peer.config.pages + 3]))
            client.submit_transfer(peer_id, peer.transfer_info(3, pages))
            _expect(Reason.TOO_MANY_REQUESTS, client.submit_transfer, peer_id, peer.transfer_info(4, pages))
            _expect(Reason.DEADLINE_EXCEEDED, client.watch_status, peer_id, [999], timeout=0.3)
            client.deregister(peer_id)
    finally:
        peer.close()
        mismatched.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    with HandshakeClient(closed, timeout=1, retry=RetryConfig(attempts=2, initial_backoff=0.01)) as gone:
        _expect(Reason.UNAVAILABLE, gone.get_server_info)
