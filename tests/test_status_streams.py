"""Every request's terminal status arrives exactly once on every stream, against a real ``pdproto serve``.

Under deregistration (while the stream is still sending its first snapshot), a graceful
restart and a reconnect; twenty concurrent Registers of one decode rank leave one live
peer; a destination bounds violation refuses that request only; the stream of an ended peer
whose client reads nothing is cut after the grace.
"""

from __future__ import annotations

import collections
import concurrent.futures
import signal
import threading
import time
import urllib.request
from typing import Any

import grpc
import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

TERMINAL = (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED)
# Chunks come a minute after a claim: every request stays open until the test ends it.
HELD = (*SERVE_ARGS[:-4], "--chunk-delay-ms", "60000", "--match-timeout", "120")


def _terminals(statuses: list[transfer_pb2.TransferStatus]) -> collections.Counter[int]:
    """How many terminal statuses each room got."""
    return collections.Counter(s.room for s in statuses if s.state in TERMINAL)


def _submit(client: HandshakeClient, peer_id: str, rooms: range) -> None:
    for room in rooms:
        client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))


def _unread_watch(target: str, peer_id: str, credential: bytes) -> tuple[grpc.Channel, Any]:
    """A WatchStatus call nobody reads, on a channel whose small receive window does not grow: the
    server's writes stall after a few KB."""
    channel = grpc.insecure_channel(target, options=[("grpc.http2.lookahead_bytes", 1024),
                                                     ("grpc.http2.bdp_probe", 0)])
    watch = channel.unary_stream(
        "/pdproto.v1.HandshakeService/WatchStatus",
        request_serializer=hs.WatchStatusRequest.SerializeToString,
        response_deserializer=hs.WatchStatusResponse.FromString)
    return channel, watch(hs.WatchStatusRequest(peer_id=peer_id, peer_credential=credential))


def test_deregister_during_first_snapshot_delivers_every_failed() -> None:
    rooms = range(1, 3001)
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*HELD, "--max-inflight", "4096") as srv, \
                HandshakeClient(srv.target, timeout=60) as client:
            pid = client.register(peer.registration()).peer_id
            _submit(client, pid, rooms)
            stream = client.watch_status(pid, timeout=60)
            seen = [next(stream)]  # the snapshot has started; 2,999 statuses are still to come
            assert client.deregister(pid) == len(rooms)
            seen.extend(stream)  # ends once every queued status was sent
            counts = _terminals(seen)
            assert {r for r in rooms if counts[r] == 0} == set(), "rooms that never got a terminal status"
            assert {r: n for r, n in counts.items() if n > 1} == {}, "rooms with a duplicated terminal status"
            assert all(s.failure_code == "PEER_GONE" for s in seen if s.state == common_pb2.TRANSFER_STATE_FAILED)
    finally:
        peer.close()


def test_graceful_restart_fails_each_open_request_once() -> None:
    rooms = range(10, 60)
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*HELD, "--grace", "1") as srv, HandshakeClient(srv.target, timeout=60) as client:
            pid = client.register(peer.registration()).peer_id
            _submit(client, pid, rooms)
            stream = client.watch_status(pid, timeout=60)
            seen = [next(stream)]
            srv.proc.send_signal(signal.SIGTERM)
            seen.extend(stream)
            counts = _terminals(seen)
            assert sorted(counts) == list(rooms) and set(counts.values()) == {1}, counts
            assert {s.failure_code for s in seen if s.state in TERMINAL} == {"SHUTTING_DOWN"}
            assert srv.proc.wait(timeout=30) == 0
    finally:
        peer.close()


def test_reconnect_sees_each_final_status_once() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=30) as client:
            pid = client.register(peer.registration()).peer_id
            pages = peer.pages_for(SPEC.prompt_tokens)
            for room in (1, 2, 3):
                client.submit_transfer(pid, peer.transfer_info(room, pages))
            first = client.watch_status(pid, timeout=30)
            next(first)
            first.close()  # the decode's stream breaks mid-way
            done = client.wait_for(pid, [1, 2, 3], timeout=30)  # a new stream, after the fact
            assert {s.state for s in done.values()} == {common_pb2.TRANSFER_STATE_SUCCESS}
            again: list[transfer_pb2.TransferStatus] = []
            for status in client.watch_status(pid, timeout=2):
                again.append(status)
                if len(again) == 3:
                    break
            assert _terminals(again) == {1: 1, 2: 1, 3: 1}, again
    finally:
        peer.close()


def _peers_gauge(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("pdproto_peers "):
                return float(line.split()[1])
    raise AssertionError("no pdproto_peers gauge")


def test_concurrent_registers_of_one_decode_leave_one_peer() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS, "--metrics-port", "0") as srv:
            assert srv.metrics_port is not None
            clients = [HandshakeClient(srv.target, timeout=30) for _ in range(20)]
            go = threading.Barrier(20)

            def register(client: HandshakeClient) -> str:
                go.wait()
                return client.register(peer.registration()).peer_id

            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                ids = list(pool.map(register, clients))
            assert len(set(ids)) == 20
            assert _peers_gauge(srv.metrics_port) == 1
            live = []
            for client, pid in zip(clients, ids, strict=True):
                try:
                    _submit(client, pid, range(1, 2))
                    live.append(pid)
                except E.NotFoundError:
                    pass
            assert len(live) == 1, live
            for client in clients:
                client.close()
    finally:
        peer.close()


def test_bounds_violation_refuses_that_request_only() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=30) as client:
            reg = peer.registration()
            for buf in reg.kv_buffers:
                buf.length = 0  # unknown length: only the executor can bound the write
            pid = client.register(reg).peer_id
            far = peer.pages_for(SPEC.prompt_tokens, first_page=peer.config.pages * 1000)  # past the arena
            client.submit_transfer(pid, peer.transfer_info(1, far))
            bad = client.wait_for(pid, [1], timeout=30)[1]
            assert (bad.state, bad.failure_code) == (common_pb2.TRANSFER_STATE_FAILED, "DESTINATION_OUT_OF_BOUNDS")
            pages = peer.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(pid, peer.transfer_info(2, pages))
            assert client.wait_for(pid, [2], timeout=30)[2].state == common_pb2.TRANSFER_STATE_SUCCESS
            peer.verify({2: pages}, SPEC.prompt_tokens)  # the same peer, still served
    finally:
        peer.close()


def test_a_watch_of_an_ended_peer_that_reads_nothing_is_cut_after_the_grace() -> None:
    """A client opens WatchStatus on a peer with thousands of kept statuses and never reads, so the
    server's writes stall under HTTP/2 flow control; then the peer deregisters. The peer counts toward
    no limit any more, so its stream (and handler) must not stay: it is cut ``--grace`` seconds later.
    Before, it stayed as long as the client kept the connection."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--grace", "2", "--log-level", "INFO") as srv, \
                HandshakeClient(srv.target, timeout=30) as client:
            peer_id = client.register(peer.registration()).peer_id
            rooms = range(1, 3001)
            _submit(client, peer_id, rooms)
            client.wait_for(peer_id, rooms, timeout=60)
            channel, call = _unread_watch(srv.target, peer_id, client.credential(peer_id))
            try:
                time.sleep(1.0)  # its snapshot fills the flow-control windows; nothing is read
                client.deregister(peer_id)
                waited = time.monotonic()
                while "took nothing" not in srv.stderr() and time.monotonic() - waited < 20:
                    time.sleep(0.2)
                assert "a status stream of peer" in srv.stderr() and "took nothing" in srv.stderr(), \
                    srv.stderr()[-2000:]
            finally:
                call.cancel()
                channel.close()
    finally:
        peer.close()


def test_a_watch_that_reads_nothing_while_its_peer_finishes_requests_is_ended_not_kept() -> None:
    """A client opens WatchStatus and never reads, while the peer's requests (submitted on other calls)
    finish one after another: each adds a terminal status the stream must deliver. Past twice what the
    peer can have open and kept (``--max-inflight`` + ``--max-finished``, 16 here: 32) the stream is
    ended; before, it queued every one for as long as the client kept the connection."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--chunk-delay-ms", "0", "--max-inflight", "8", "--max-finished", "8",
                            "--metrics-port", "0") as srv, HandshakeClient(srv.target, timeout=30) as client:
            peer_id = client.register(peer.registration()).peer_id
            channel, call = _unread_watch(srv.target, peer_id, client.credential(peer_id))
            try:
                for first in range(1, 400, 8):
                    rooms = range(first, first + 8)
                    _submit(client, peer_id, rooms)
                    client.wait_for(peer_id, rooms, timeout=30)
                    if "left more than 32 statuses unread" in srv.stderr():
                        break
                assert "left more than 32 statuses unread; ending it" in srv.stderr(), srv.stderr()[-2000:]
                # The peer is served on: its own session is another stream, untouched.
                _submit(client, peer_id, range(1000, 1008))
                done = client.wait_for(peer_id, range(1000, 1008), timeout=30)
                assert all(s.state == common_pb2.TRANSFER_STATE_SUCCESS for s in done.values()), done
                view = client.describe(peer_id=peer_id).peers[0]
                assert view.watch_streams == 0, view
            finally:
                call.cancel()
                channel.close()
    finally:
        peer.close()


def test_a_watch_filter_of_more_rooms_than_a_peer_can_hold_is_refused() -> None:
    """A room filter is kept as a set for as long as the stream: 1.3 million rooms (4 MB) took the loop
    0.2 s and 110 MB per stream, eight streams per peer. More rooms than the peer can have open and
    kept (``--max-inflight`` + ``--max-finished``, 16 here) is refused; before, it was taken."""
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--max-inflight", "8", "--max-finished", "8") as srv, \
                HandshakeClient(srv.target, timeout=30) as client, grpc.insecure_channel(srv.target) as channel:
            peer_id = client.register(peer.registration()).peer_id
            watch = channel.unary_stream(
                "/pdproto.v1.HandshakeService/WatchStatus",
                request_serializer=hs.WatchStatusRequest.SerializeToString,
                response_deserializer=hs.WatchStatusResponse.FromString)
            ok = watch(hs.WatchStatusRequest(peer_id=peer_id, peer_credential=client.credential(peer_id),
                                             rooms=range(16)), timeout=2)
            with pytest.raises(grpc.RpcError) as quiet:
                next(ok)  # taken: nothing to send, so it runs until its deadline
            assert quiet.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            big = watch(hs.WatchStatusRequest(peer_id=peer_id, peer_credential=client.credential(peer_id),
                                              rooms=range(17)), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                next(big)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "17 rooms, more than the 16" in str(refused.value.details())
    finally:
        peer.close()
