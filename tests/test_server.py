"""The handshake service end to end: a real server subprocess, real clients, real shared memory."""

from __future__ import annotations

import concurrent.futures
import shutil
import signal
import subprocess
import sys
import urllib.request
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import SERVICE_NAME, common_pb2, registration_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import REPO, SERVE_ARGS, SPEC, ServerProcess, running_server, self_signed

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(*SERVE_ARGS, "--max-peers", "16", "--metrics-port", "0") as srv:
        yield srv
        assert srv.proc.poll() is None, srv.stderr()


def _transfer(client: HandshakeClient, peer: DecodeRank, rooms: list[int]) -> dict[int, list[int]]:
    """Register, submit rooms, wait for SUCCESS; returns room -> destination pages."""
    result = client.register(peer.registration())
    placed: dict[int, list[int]] = {}
    for i, room in enumerate(rooms):
        pages = peer.pages_for(SPEC.prompt_tokens, first_page=i * 8)
        placed[room] = pages
        client.submit_transfer(result.peer_id, peer.transfer_info(room, pages))
    done = client.wait_for(result.peer_id, rooms, timeout=20)
    for room, status in done.items():
        assert status.state == common_pb2.TRANSFER_STATE_SUCCESS, (room, status)
        assert status.bytes_transferred > 0
    client.deregister(result.peer_id)
    return placed


def test_health_and_reflection(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        names = {s.name for s in replies[0].list_services_response.service}
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_rejection_is_per_peer_while_dcp_and_tp_peers_transfer(server: ServerProcess) -> None:
    dcp = [DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=r, pages=32) for r in range(4)]
    tp = DecodeRank.for_spec(SPEC, pages=64)
    bad = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=0, pages=32, kv_dtype="fp8_e4m3")
    try:
        with HandshakeClient(server.target, timeout=10) as client:
            started = threading.Event()

            def good(peer: DecodeRank, rooms: list[int]) -> dict[int, list[int]]:
                started.set()
                return _transfer(client, peer, rooms)

            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                futures = {pool.submit(good, p, [100, 101]): p for p in (*dcp, tp)}
                started.wait(10)
                # The unsupported peer is rejected while the others are mid-transfer.
                with pytest.raises(E.TopologyError) as info:
                    client.register(bad.registration())
                assert info.value.reason is Reason.TOPOLOGY_KV_DTYPE_MISMATCH
                assert info.value.metadata["grpcCode"] == "FAILED_PRECONDITION"
                checked = 0
                for fut, peer in futures.items():
                    checked += peer.verify(fut.result(timeout=30), SPEC.prompt_tokens)
            assert checked > 0
            assert client.get_server_info().page_size == SPEC.page_size
    finally:
        for p in (*dcp, tp, bad):
            p.close()


def test_a_long_destination_page_list_lands_byte_exact(server: ServerProcess) -> None:
    """Lists of 4,096 pages and more are kept as an int64 array for the planner (``LARGE_PAGE_LIST``),
    shorter ones as the message's own list: both land every byte where it belongs, DCP 2 and dense."""
    peers = [DecodeRank.for_spec(SPEC, pages=4200), DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=1, pages=4200)]
    try:
        with HandshakeClient(server.target, timeout=20) as client:
            for peer in peers:
                pid = client.register(peer.registration()).peer_id
                needed = peer.pages_for(SPEC.prompt_tokens, first_page=4000)
                # Rooms no other test of this module's server uses (a room's chunks outlive its requests).
                placed = {7001: [*needed, *range(4099)], 7002: peer.pages_for(SPEC.prompt_tokens, first_page=4100)}
                assert len(placed[7001]) >= 4096 > len(placed[7002])
                for room, pages in placed.items():
                    client.submit_transfer(pid, peer.transfer_info(room, pages))
                done = client.wait_for(pid, placed, timeout=30)
                assert all(s.state == common_pb2.TRANSFER_STATE_SUCCESS for s in done.values()), done
                assert peer.verify(placed, SPEC.prompt_tokens) > 0
                client.deregister(pid)
    finally:
        for p in peers:
            p.close()


def test_malformed_and_unknown_peer_keep_server_serving(server: ServerProcess) -> None:
    with HandshakeClient(server.target) as client:
        bad = registration_pb2.KvRegistration(page_size=0)
        with pytest.raises(E.InvalidFieldError) as info:
            client.register(bad)
        assert info.value.reason is Reason.INVALID_FIELD
        assert info.value.metadata["grpcCode"] == "INVALID_ARGUMENT"
        assert info.value.field.startswith("registration.")
        peer = DecodeRank.for_spec(SPEC, pages=16)
        try:
            with pytest.raises(E.NotFoundError) as nf:
                client.submit_transfer("p-unknown", peer.transfer_info(7, [0]), credential=b"x" * 32)
            assert nf.value.reason is Reason.PEER_NOT_FOUND
            assert nf.value.metadata["grpcCode"] == "NOT_FOUND"
            # Still serving: a good peer transfers and every byte matches.
            peer.verify(_transfer(client, peer, [5]), SPEC.prompt_tokens)
        finally:
            peer.close()


def test_abort_generation_reregister_and_deregister(server: ServerProcess) -> None:
    peer = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with HandshakeClient(server.target) as client:
            first = client.register(peer.registration())
            pages = peer.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(first.peer_id, peer.transfer_info(300, pages, generation=2))
            with pytest.raises(E.RequestFailedError) as dup:
                client.submit_transfer(first.peer_id, peer.transfer_info(300, pages, generation=2))
            assert dup.value.reason is Reason.DUPLICATE_REQUEST
            with pytest.raises(E.RequestFailedError) as stale:
                client.abort(first.peer_id, 300, generation=1)
            assert stale.value.reason is Reason.STALE_GENERATION
            ack = client.abort(first.peer_id, 300, generation=2)
            assert ack.room == 300 and ack.generation == 2
            status = client.wait_for(first.peer_id, [300], timeout=10)[300]
            assert status.state == common_pb2.TRANSFER_STATE_FAILED and status.failure_code == "ABORTED"
            # Registering the same decode again while it still reads a stream (the session its
            # submits opened) is refused: it is alive, not restarted (docs/security.md).
            before = server.metrics()
            with pytest.raises(E.IdentityInUseError):
                client.register(peer.registration())
            client.submit_transfer(first.peer_id, peer.transfer_info(301, pages))  # open (chunks 50 ms apart)
            old = client.credential(first.peer_id)
        # The decode "restarts": its process (client, streams) is gone, the same identity registers.
        with HandshakeClient(server.target) as client:
            second = client.register(peer.registration())
            assert second.peer_id != first.peer_id
            with pytest.raises(E.NotFoundError):
                client.submit_transfer(first.peer_id, peer.transfer_info(302, pages), credential=old)
            after = server.metrics()
            gone, refused = 'pdproto_requests_total{outcome="PEER_GONE"}', \
                'pdproto_registrations_total{outcome="IDENTITY_IN_USE"}'
            assert after[gone] - before.get(gone, 0) == 1  # the old peer's open request 301
            assert after[refused] - before.get(refused, 0) == 1
            client.submit_transfer(second.peer_id, peer.transfer_info(303, pages))
            assert client.deregister(second.peer_id) == 1
            with pytest.raises(E.NotFoundError):
                client.deregister(second.peer_id)
    finally:
        peer.close()


def test_auth_required_and_limits() -> None:
    with running_server(*SERVE_ARGS, "--max-peers", "1", token="s3cret-token") as srv:
        with grpc.insecure_channel(srv.target) as ch:  # health and reflection need no token
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = list(refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            assert SERVICE_NAME in {s.name for s in replies[0].list_services_response.service}
        for token in (None, "wrong"):
            with HandshakeClient(srv.target, token=token) as anon, pytest.raises(E.AuthError) as info:
                anon.get_server_info()
            assert info.value.metadata["grpcCode"] == "UNAUTHENTICATED"
        a, b = DecodeRank.for_spec(SPEC, pages=16), DecodeRank.for_spec(SPEC, pages=16)
        try:
            with HandshakeClient(srv.target, token="s3cret-token") as client:
                client.register(a.registration())
                with pytest.raises(E.ResourceLimitError) as lim:
                    client.register(b.registration())
                assert lim.value.reason is Reason.TOO_MANY_PEERS
                assert lim.value.metadata["grpcCode"] == "RESOURCE_EXHAUSTED"
        finally:
            a.close()
            b.close()


def test_sigterm_drains_in_flight_requests_and_exits_zero() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS[:-4], "--chunk-delay-ms", "150", "--match-timeout", "10") as srv:
            with HandshakeClient(srv.target, timeout=10) as client:
                peer_id = client.register(peer.registration()).peer_id
                placed = {room: peer.pages_for(SPEC.prompt_tokens, first_page=i * 8)
                          for i, room in enumerate((1, 2, 3))}
                for room, pages in placed.items():
                    client.submit_transfer(peer_id, peer.transfer_info(room, pages))
                seen: dict[int, int] = {}
                stream = client.watch_status(peer_id, placed, timeout=20)
                for status in stream:
                    if status.state == common_pb2.TRANSFER_STATE_TRANSFERRING:
                        break
                srv.proc.send_signal(signal.SIGTERM)
                for status in stream:
                    seen[status.room] = status.state
                assert all(seen.get(r) == common_pb2.TRANSFER_STATE_SUCCESS for r in placed), seen
                peer.verify(placed, SPEC.prompt_tokens)
            # The drain ended the stream; the process exits by itself, with status 0.
            assert srv.proc.wait(timeout=20) == 0, srv.stderr()
    finally:
        peer.close()


def test_a_draining_server_reports_not_serving_and_takes_no_new_work() -> None:
    """docs/security.md, SIGTERM: health turns NOT_SERVING and new registrations and submissions get
    UNAVAILABLE (SHUTTING_DOWN) while open requests drain; they complete, and the process exits 0."""
    peer, late = DecodeRank.for_spec(SPEC, pages=64), DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS[:-4], "--chunk-delay-ms", "1000", "--match-timeout", "10",
                            "--grace", "30") as srv:
            with HandshakeClient(srv.target, timeout=10) as client, grpc.insecure_channel(srv.target) as ch:
                peer_id = client.register(peer.registration()).peer_id
                pages = peer.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(peer_id, peer.transfer_info(1, pages))
                srv.proc.send_signal(signal.SIGTERM)
                health = health_pb2_grpc.HealthStub(ch)
                while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    pass  # the signal is handled on the server's loop, soon
                with pytest.raises(E.ShuttingDownError) as refused:
                    client.register(late.registration(), timeout=2)
                assert refused.value.metadata["grpcCode"] == "UNAVAILABLE"
                with pytest.raises(E.ShuttingDownError):
                    client.submit_transfer(peer_id, peer.transfer_info(2, pages), timeout=2)
                assert client.wait_for(peer_id, [1], timeout=20)[1].state == common_pb2.TRANSFER_STATE_SUCCESS
                peer.verify({1: pages}, SPEC.prompt_tokens)
            assert srv.proc.wait(timeout=30) == 0, srv.stderr()
    finally:
        peer.close()
        late.close()


def _listening_on(table: str, port: int) -> set[str]:
    """The local addresses in a /proc/net TCP table that listen on port."""
    path = Path(table)
    if not path.exists():
        return set()
    rows = [line.split() for line in path.read_text().splitlines()[1:]]
    return {row[1] for row in rows if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port}  # 0A: LISTEN


def test_metrics_listen_on_loopback_only_and_show_no_secret() -> None:
    """docs/security.md: the metrics port is bound to 127.0.0.1 and exposes counts, never tokens or addresses."""
    token = "metrics-must-not-show-this"
    peer = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, "--metrics-port", "0", token=token) as srv:
            with HandshakeClient(srv.target, token=token) as client:
                peer.verify(_transfer(client, peer, [901]), SPEC.prompt_tokens)
            assert srv.metrics_port is not None
            assert _listening_on("/proc/net/tcp", srv.metrics_port) == {f"0100007F:{srv.metrics_port:04X}"}
            # Only listeners count: another test's closed connection may still name this port as its remote end.
            assert _listening_on("/proc/net/tcp6", srv.metrics_port) == set()
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            assert "pdproto_requests_total" in text and token not in text
            assert not [b.ptr for b in peer.registration().kv_buffers if b.ptr > 1 << 16 and str(b.ptr) in text]
    finally:
        peer.close()


def test_inflight_limit_per_peer() -> None:
    peer = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--max-inflight", "1") as srv, HandshakeClient(srv.target) as client:
            peer_id = client.register(peer.registration()).peer_id
            client.submit_transfer(peer_id, peer.transfer_info(1, peer.pages_for(SPEC.prompt_tokens)))
            with pytest.raises(E.ResourceLimitError) as lim:
                client.submit_transfer(peer_id, peer.transfer_info(2, peer.pages_for(SPEC.prompt_tokens, 8)))
            assert lim.value.reason is Reason.TOO_MANY_REQUESTS
            assert lim.value.metadata["grpcCode"] == "RESOURCE_EXHAUSTED"
            # Out-of-bounds destination pages are refused before anything moves.
            with pytest.raises(E.PdprotoError) as oob:
                client.submit_transfer(peer_id, peer.transfer_info(3, [10_000]))
            assert oob.value.reason is Reason.DESTINATION_OUT_OF_BOUNDS
            assert oob.value.metadata["grpcCode"] == "OUT_OF_RANGE"
    finally:
        peer.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    with running_server(*SERVE_ARGS, "--tls-cert", str(cert), "--tls-key", str(key)) as srv:
        with HandshakeClient(srv.target, root_cert=cert) as client:
            assert client.get_server_info().page_size == SPEC.page_size
        with HandshakeClient(srv.target, timeout=1.0) as plain, pytest.raises(E.PdprotoError) as info:
            plain.get_server_info()
        assert info.value.reason is Reason.UNAVAILABLE


def test_metrics_count_registrations_requests_and_bytes(server: ServerProcess) -> None:
    peer = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with HandshakeClient(server.target) as client:
            peer.verify(_transfer(client, peer, [900]), SPEC.prompt_tokens)
    finally:
        peer.close()
    values = server.metrics()
    assert values['pdproto_registrations_total{outcome="ACCEPTED"}'] >= 1
    assert values['pdproto_requests_total{outcome="SUCCESS"}'] >= 1
    assert values["pdproto_kv_bytes_total"] >= SPEC.prompt_tokens * SPEC.row_bytes * SPEC.layers
    assert values["pdproto_transfer_descriptors_total"] >= 1
    assert values["pdproto_negotiation_seconds_count"] >= 1


_DYING_DECODE = """
import os, sys
from pdproto.client import HandshakeClient
from pdproto_demo.decode import DecodeRank
from tests._server_harness import SPEC
peer = DecodeRank.for_spec(SPEC, pages=32)
with HandshakeClient(sys.argv[1]) as client:
    peer_id = client.register(peer.registration()).peer_id
    client.submit_transfer(peer_id, peer.transfer_info(1, peer.pages_for(SPEC.prompt_tokens)))
    print(peer_id, client.credential(peer_id).hex(), flush=True)
os._exit(0)  # dies mid-transfer: no Deregister, arena left behind
"""


def test_dead_decode_is_detected_and_freed(server: ServerProcess) -> None:
    proc = subprocess.run([sys.executable, "-c", _DYING_DECODE, server.target], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    peer_id, credential = proc.stdout.split()[-2:]
    with HandshakeClient(server.target) as client:
        client.adopt(peer_id, bytes.fromhex(credential))
        final = None
        for status in client.watch_status(peer_id, [1], timeout=15):
            final = status  # the stream ends once the dead peer's requests are failed
        assert final is not None
        assert (final.state, final.failure_code) == (common_pb2.TRANSFER_STATE_FAILED, "PEER_GONE"), final
        # The record stays (for inspection) but admits no new work until the decode re-registers.
        with pytest.raises(E.RequestFailedError) as gone:
            client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=2, dst_kv_pages=[0]))
        assert gone.value.reason is Reason.PEER_GONE
        assert client.get_server_info().page_size == SPEC.page_size


def _has_mooncake() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_mooncake(), reason="mooncake-transfer-engine not installed")
def test_mooncake_backend_dense_to_dcp() -> None:
    peer = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=1, pages=32, backend="mooncake")
    try:
        with running_server(*SERVE_ARGS, "--backend", "mooncake") as srv, \
                HandshakeClient(srv.target, timeout=10) as client:
            peer.verify(_transfer(client, peer, [21, 22]), SPEC.prompt_tokens)
    finally:
        peer.close()


@pytest.mark.skipif(not _has_mooncake(), reason="mooncake-transfer-engine not installed")
@pytest.mark.parametrize(("inline_bytes", "inline"), [(None, True), ("0", False), ("1", False)])
def test_inline_bytes_picks_the_path_and_inline_jobs_counts_it(inline_bytes: str | None, inline: bool) -> None:
    # Every chunk of SPEC (at most 64 tokens x 2 layers x 256 bytes = 32 KiB) is far below the 4 MiB default.
    # A DCP 2 decode: packing halves its descriptors, so its jobs are packed (page-to-page ones are not).
    chunks = -(-SPEC.prompt_tokens // SPEC.chunk_tokens)
    flag = ("--inline-bytes", inline_bytes) if inline_bytes is not None else ()
    peer = DecodeRank.for_spec(SPEC, pages=32, backend="mooncake", dcp_size=2)
    try:
        with running_server(*SERVE_ARGS, "--backend", "mooncake", "--metrics-port", "0", *flag) as srv, \
                HandshakeClient(srv.target, timeout=10) as client:
            peer.verify(_transfer(client, peer, [31]), SPEC.prompt_tokens)
            values = srv.metrics()
            assert values["pdproto_chunks_total"] == chunks
            assert values["pdproto_inline_jobs_total"] == (chunks if inline else 0)
    finally:
        peer.close()
