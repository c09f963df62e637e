"""Request sizes are checked before parsing, and each peer's calls are held to its call rate, on a real server.

A request over its method's limit (``pdproto_server.service.request_limits``) is refused
MESSAGE_TOO_LARGE, naming both sizes, before a byte of it is parsed (the bodies here are not
protobuf at all: parsed, they would be WIRE_MALFORMED); one over the channel's
``max_message_bytes`` is refused by gRPC before it is even buffered. A peer calling faster than
``--call-rate`` is refused TOO_MANY_CALLS with ``retryAfterMs`` while another peer's calls and
transfers go on, and the client waits as long as the refusal says.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.rpc import error_from_rpc
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc
from pdproto_demo.decode import DecodeRank
from pdproto_server.registry import CALL_BURST_S, Allowance, Limits
from pdproto_server.service import SMALL_REQUEST_BYTES, request_limits

from ._flood import calling
from ._server_harness import SERVE_ARGS, SPEC, running_server

SERVICE = "/pdproto.v1.HandshakeService/"
GARBAGE = b"\xff"
"""Not a protobuf message in any length: a body made of it is WIRE_MALFORMED if it is ever parsed."""


def _raw(channel: grpc.Channel, method: str, body: bytes, *, stream: bool = False) -> E.PdprotoError | bytes:
    """Call ``method`` with ``body`` as the request's bytes: the answer's bytes, or the typed refusal."""
    call = (channel.unary_stream if stream else channel.unary_unary)(SERVICE + method)
    try:
        answer = call(body, timeout=30)
        return next(iter(answer)) if stream else answer  # type: ignore[no-any-return]
    except grpc.RpcError as exc:
        return error_from_rpc(exc)


def test_small_methods_have_small_limits_and_a_room_filter_fits_its_own() -> None:
    caps = request_limits(Limits(max_inflight_per_peer=24, max_finished_per_peer=1000))
    assert caps["GetServerInfo"] == SMALL_REQUEST_BYTES < 4 << 20
    assert "Register" not in caps and "SubmitTransfer" not in caps and "Session" not in caps
    most = hs.WatchStatusRequest(peer_id="p-" + "f" * 16, peer_credential=b"c" * 32,
                                 rooms=[(1 << 64) - 1] * Limits(24, 1000).kept_per_peer)
    assert most.ByteSize() <= caps["WatchStatus"]


@pytest.mark.process
def test_oversized_requests_are_refused_before_they_are_parsed() -> None:
    with running_server(*SERVE_ARGS) as srv, \
            grpc.insecure_channel(srv.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        malformed = _raw(channel, "GetServerInfo", GARBAGE * 100)
        assert isinstance(malformed, E.WireError) and malformed.reason is Reason.WIRE_MALFORMED, malformed
        for method, stream in (("GetServerInfo", False), ("Abort", False), ("Describe", False),
                               ("WatchStatus", True)):
            limit = request_limits(Limits())[method]
            refused = _raw(channel, method, GARBAGE * (limit + 1), stream=stream)
            assert isinstance(refused, E.MessageTooLargeError), (method, refused)
            assert refused.metadata["grpcCode"] == "RESOURCE_EXHAUSTED"
            assert (refused.metadata["size"], refused.metadata["limit"]) == (str(limit + 1), str(limit))
            assert str(limit) in refused.message and str(limit + 1) in refused.message
        # At the limit, a request with room for a newer minor's fields is served.
        body = _unknown_field(SMALL_REQUEST_BYTES)
        assert len(body) == SMALL_REQUEST_BYTES
        served = _raw(channel, "GetServerInfo", body)
        assert isinstance(served, bytes) and hs.GetServerInfoResponse.FromString(served).info.page_size == SPEC.page_size
        # Over the channel's limit gRPC refuses before it buffers the body; the client reads that typed too.
        refused = _raw(channel, "Register", GARBAGE * (5 << 20))
        assert isinstance(refused, E.MessageTooLargeError), refused
        assert (refused.metadata["size"], refused.metadata["limit"]) == (str(5 << 20), str(4 << 20)), refused
        with HandshakeClient(srv.target) as client:
            assert client.get_server_info().page_size == SPEC.page_size
        assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]


def _unknown_field(size: int) -> bytes:
    """A request of exactly ``size`` bytes: one unknown length-delimited field (number 1000)."""
    tag = b"\xc2\x3e"  # field 1000, wire type 2
    for length_bytes in range(1, 5):
        payload = size - len(tag) - length_bytes
        varint = _varint(payload)
        if len(varint) == length_bytes:
            return tag + varint + b"x" * payload
    raise AssertionError(size)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


RATE = 20.0
BURST = CALL_BURST_S * RATE
AT_ONCE = 50
"""Calls each flooding thread sends together: more than the rate holds, so some are refused."""


def test_calls_past_the_rate_are_held_then_refused_with_how_long_to_wait() -> None:
    calls, rate, burst, hold = Allowance(), 10.0, 3, 1.0
    assert [calls.take(1, burst, rate, 5.0, hold) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert [round(calls.take(1, burst, rate, 5.0, hold), 6) for _ in range(10)] == [i / 10 for i in range(1, 11)]
    assert calls.take(1, burst, rate, 5.0, hold) == pytest.approx(1.1)  # past the hold: not drawn
    assert calls.take(1, burst, rate, 5.05, hold) == pytest.approx(1.05)
    assert calls.take(1, burst, rate, 6.1, hold) == pytest.approx(0.0)  # room again
    assert Allowance().take(1, 1, 0.2, 0.0, hold) == 0.0 and Allowance(due=5.0).take(1, 1, 0.2, 1.0, hold) == 4.0


def _served_at_most(elapsed: float) -> int:
    """Calls the rate lets start in ``elapsed`` seconds (one for rounding)."""
    return math.floor(BURST + elapsed * RATE) + 1


@pytest.mark.process
def test_a_flooding_peer_is_refused_while_another_peers_calls_and_transfer_succeed() -> None:
    flooder, victim = DecodeRank.for_spec(SPEC, pages=16), DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, "--call-rate", f"{RATE:g}") as srv, \
                HandshakeClient(srv.target, timeout=60) as client, grpc.insecure_channel(srv.target) as channel:
            bad = client.register(flooder.registration()).peer_id
            good = client.register(victim.registration()).peer_id
            describe = hs_grpc.HandshakeServiceStub(channel).Describe
            own = hs.DescribeRequest(peer_id=bad, peer_credential=client.credential(bad))
            outcomes: list[E.PdprotoError | None] = []
            go, stop = threading.Event(), threading.Event()
            go.set()
            started = time.monotonic()
            threads = [threading.Thread(target=calling, args=(lambda: describe.future(own, timeout=30), AT_ONCE,
                                                              outcomes, go, stop)) for _ in range(4)]
            for t in threads:
                t.start()
            try:
                # Meanwhile the other peer moves its KV and makes calls of its own, none of them held or refused.
                pages = {room: victim.pages_for(SPEC.prompt_tokens, 16 * (room - 1)) for room in (1, 2)}
                for room, room_pages in pages.items():
                    client.submit_transfer(good, victim.transfer_info(room, room_pages))
                done = client.wait_for(good, pages, timeout=60)
                assert {r: s.state for r, s in done.items()} == {1: common_pb2.TRANSFER_STATE_SUCCESS,
                                                                2: common_pb2.TRANSFER_STATE_SUCCESS}
                assert victim.verify(pages, SPEC.prompt_tokens) > 0
                for _ in range(10):
                    assert client.describe(peer_id=good).peers[0].peer_id == good
                while len(outcomes) < 4 * BURST:
                    time.sleep(0.05)
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
            elapsed = time.monotonic() - started
            refusals = [o for o in outcomes if o is not None]
            assert refusals, f"{len(outcomes)} calls at a call rate of {RATE:g} were all served"
            assert len(outcomes) - len(refusals) <= _served_at_most(elapsed), (len(outcomes), len(refusals))
            for error in refusals:
                assert isinstance(error, E.ResourceLimitError) and error.reason is Reason.TOO_MANY_CALLS, error
                assert error.metadata["grpcCode"] == "RESOURCE_EXHAUSTED" and int(error.metadata["retryAfterMs"]) > 0
                assert "--call-rate" in error.message
            # Describe without a credential is not paced; it shows each peer's refusals, the victim's none.
            with HandshakeClient(srv.target, timeout=30, session=False) as anyone:
                views = {p.peer_id: p for p in anyone.describe().peers}
            assert (views[bad].calls_refused, views[good].calls_refused) == (len(refusals), 0)
            assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
    finally:
        flooder.close()
        victim.close()


@pytest.mark.process
def test_the_client_waits_as_long_as_a_refusal_says() -> None:
    """At one call per 5 s, a second call right after the first would wait about 5 s, past the server's
    1 s hold: refused, with about 4 s to wait. The client sleeps that long and is then held and served,
    refused once; with its own backoff (50 ms, doubling to 1 s) it would have been refused about eight times."""
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS, "--call-rate", "0.2") as srv, \
                HandshakeClient(srv.target, timeout=60, session=False) as client, \
                HandshakeClient(srv.target, timeout=60, session=False) as anyone:
            pid = client.register(peer.registration()).peer_id
            for _ in range(2):
                assert client.describe(peer_id=pid).peers[0].peer_id == pid
            assert anyone.describe().peers[0].calls_refused == 1
    finally:
        peer.close()
