"""A stuck decode peer holds no capacity another peer needs (Mooncake over TCP, real processes).

Two kinds of stuck peer, each with five open requests against a real ``pdproto serve``:

* **frozen**: a real Mooncake decode process, SIGSTOPped while its transfers run;
* **black hole**: a registration whose Mooncake session is a socket that accepts
  connections and never answers.

While it is stuck (before its engine call reaches the server's deadline) other decodes
register, abort and watch, a frozen peer's neighbour moves a request byte-exact, and the
stuck peer's requests then fail with a reason. A black-holed session never gets that far:
the executor probes it at Register (off the engine's shared lock), and the Register fails
DEADLINE_EXCEEDED while other decodes are served. Nothing here measures time: the healthy
peer must finish while the stuck one is still stuck, which is an order of events, and
every wait has a generous deadline.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import DeadlineExceededError
from pdproto.v1 import common_pb2, session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import SyntheticSpec

from ._raw_session import RawSession, open_request
from ._server_harness import REPO, running_server

pytestmark = pytest.mark.process

mooncake = pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")

# 16 MiB per request in 4 chunks 300 ms apart: a frozen decode stops them mid-request.
SPEC = SyntheticSpec(layers=4, row_bytes=2048, pages=256, page_size=16, prompt_tokens=2048,
                     chunk_tokens=512, chunk_delay=0.3, backend="mooncake")
ENGINE_TIMEOUT = 10
"""Seconds the server lets one engine call run before writing the peer off."""
SERVE = ("--backend", "mooncake", "--layers", str(SPEC.layers), "--row-bytes", str(SPEC.row_bytes),
         "--pages", str(SPEC.pages), "--page-size", str(SPEC.page_size), "--prompt-tokens",
         str(SPEC.prompt_tokens), "--chunk-tokens", str(SPEC.chunk_tokens), "--chunk-delay-ms", "300",
         "--match-timeout", "60", "--engine-timeout", str(ENGINE_TIMEOUT))
STUCK_ROOMS = list(range(5000, 5005))
FAILED = common_pb2.TRANSFER_STATE_FAILED

_FROZEN_DECODE = """
import sys, time
from pdproto.client import HandshakeClient
from pdproto_demo.decode import DecodeRank
from tests.test_stuck_peers import SPEC, STUCK_ROOMS
peer = DecodeRank.for_spec(SPEC, pages=128 * len(STUCK_ROOMS), backend="mooncake")
with HandshakeClient(sys.argv[1], timeout=30) as client:
    pid = client.register(peer.registration()).peer_id
    client.submit_transfer(pid, peer.transfer_info(4999, peer.pages_for(SPEC.prompt_tokens)))
    assert client.wait_for(pid, [4999], timeout=60)[4999].state == 4  # SUCCESS: the engines have met
    for i, room in enumerate(STUCK_ROOMS):
        client.submit_transfer(pid, peer.transfer_info(room, peer.pages_for(SPEC.prompt_tokens, i * 128)))
    print(pid, client.credential(pid).hex(), flush=True)
    time.sleep(600)
"""


@pytest.fixture
def black_hole() -> Iterator[str]:
    """host:port of a socket that accepts every connection and never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    sock.close()
    for conn in held:
        conn.close()


def _healthy_peer_transfers(target: str) -> None:
    """A fresh decode registers and moves one request byte-exact."""
    good = DecodeRank.for_spec(SPEC, pages=128, backend="mooncake")
    try:
        with HandshakeClient(target, timeout=30) as client:
            pid = client.register(good.registration()).peer_id
            pages = good.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(pid, good.transfer_info(1, pages))
            status = client.wait_for(pid, [1], timeout=60)[1]
            assert status.state == common_pb2.TRANSFER_STATE_SUCCESS, status
            good.verify({1: pages}, SPEC.prompt_tokens)
            client.deregister(pid)
    finally:
        good.close()


def _open_and_then_failed(target: str, peer_id: str, credential: bytes) -> None:
    """The stuck peer's requests are all still open now, and each later fails with a reason."""
    with HandshakeClient(target, timeout=30) as client:
        client.adopt(peer_id, credential)
        first: dict[int, int] = {}
        final: dict[int, tuple[int, str]] = {}
        for status in client.watch_status(peer_id, STUCK_ROOMS, timeout=ENGINE_TIMEOUT * 4):
            first.setdefault(status.room, status.state)
            if status.state == FAILED:
                final[status.room] = (status.state, status.failure_code)
                if len(final) == len(STUCK_ROOMS):
                    break
    assert FAILED not in first.values(), f"the stuck peer was written off before the healthy one ran: {first}"
    assert set(final) == set(STUCK_ROOMS), final
    assert {code for _, code in final.values()} <= {"DEADLINE_EXCEEDED", "PEER_GONE"}, final


def test_frozen_decode_does_not_block_other_peers() -> None:
    with running_server(*SERVE) as srv:
        child = subprocess.Popen([sys.executable, "-c", _FROZEN_DECODE, srv.target], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            peer_id, credential = child.stdout.readline().split()
            child.send_signal(signal.SIGSTOP)
            _healthy_peer_transfers(srv.target)
            _open_and_then_failed(srv.target, peer_id, bytes.fromhex(credential))
            _healthy_peer_transfers(srv.target)  # and the server still serves afterwards
        finally:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(timeout=10)


def test_a_submit_waiting_for_a_stuck_chunk_keeps_its_result_across_a_resume() -> None:
    """A new generation of a room whose chunk is stuck in the engine waits (up to ``--grace`` + 1 s) for
    that chunk before it replaces it. If the session's connection breaks during that wait, the submit
    counts as applied (``applied_command_seq``), so the decode does not send it again: its result must
    still come, on the resumed stream. Before, the old stream's reader was cancelled inside the submit,
    and the result never came (and the session lost a unit of command credit for good)."""
    with running_server(*SERVE, "--grace", "3") as srv:
        child = subprocess.Popen([sys.executable, "-c", _FROZEN_DECODE, srv.target], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        raw: RawSession | None = None
        try:
            assert child.stdout is not None
            peer_id, credential = child.stdout.readline().split()
            child.send_signal(signal.SIGSTOP)
            time.sleep(1.0)  # the first room's chunk is inside the engine, stuck (an order, not a measurement)
            room, first_page = STUCK_ROOMS[0], 0
            again = session_pb2.SessionCommand(seq=1, submit=transfer_pb2.TransferInfo(
                room=room, generation=1, required_dst_info_num=1,
                dst_kv_pages=list(range(first_page + 127, first_page - 1, -1))))
            opening = open_request(peer_id, bytes.fromhex(credential))
            opening.commands.append(again)
            raw = RawSession.opening(srv.target, opening)
            opened = raw.read()
            assert opened is not None and opened.HasField("opened"), raw.error
            time.sleep(1.0)  # the submit waits for the stuck chunk now
            raw.close()  # the stream breaks while the submit waits
            raw = RawSession.opening(srv.target, open_request(peer_id, bytes.fromhex(credential),
                                                              resume=opened.opened.session_id))
            resumed = raw.read()
            assert resumed is not None and resumed.opened.resumed, raw.error
            assert resumed.opened.applied_command_seq == 1, resumed  # so the decode will not send it again
            results = [e.result for e in resumed.events if e.HasField("result")]
            while not results:
                frame = raw.read()
                assert frame is not None, raw.error
                results = [e.result for e in frame.events if e.HasField("result")]
            assert [r.command_seq for r in results] == [1], results
            assert results[0].submitted.room == room and results[0].submitted.generation == 1, results[0]
        finally:
            if raw is not None:
                raw.close()
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(timeout=10)


class _BlackHoleRegister(threading.Thread):
    """Registers a peer whose Mooncake session is ``black_hole``, in the background; keeps the error."""

    def __init__(self, target: str, stuck: DecodeRank, black_hole: str) -> None:
        super().__init__(daemon=True)
        self.reg = stuck.registration()
        self.reg.mooncake.session_id = black_hole
        self.target = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with HandshakeClient(self.target, timeout=30) as client:
                client.register(self.reg)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc


def test_black_hole_session_holds_no_service_capacity(black_hole: str) -> None:
    """Registrations, status streams, aborts and transfers of other peers are served while a
    black-holed session's Register waits; that Register then fails DEADLINE_EXCEEDED."""
    stuck = DecodeRank.for_spec(SPEC, pages=128 * len(STUCK_ROOMS), backend="mooncake")
    other = DecodeRank.for_spec(SPEC, pages=128, backend="mooncake")
    try:
        with running_server(*SERVE) as srv:
            _healthy_peer_transfers(srv.target)
            hole = _BlackHoleRegister(srv.target, stuck, black_hole)
            hole.start()
            time.sleep(0.5)  # the probe is waiting on the silent socket (an order, not a measurement)
            with HandshakeClient(srv.target, timeout=30) as fresh:
                for _ in range(3):
                    oid = fresh.register(other.registration()).peer_id  # re-registers: a restart each time
                fresh.submit_transfer(oid, other.transfer_info(7, other.pages_for(SPEC.prompt_tokens)))
                fresh.abort(oid, 7)
                assert fresh.wait_for(oid, [7], timeout=30)[7].failure_code == "ABORTED"
                assert fresh.get_server_info().page_size == SPEC.page_size
                fresh.deregister(oid)
            _healthy_peer_transfers(srv.target)
            still_waiting = hole.is_alive()
            hole.join(60)
            assert still_waiting, "the black-holed Register answered before the other peers were served"
            assert isinstance(hole.error, DeadlineExceededError), hole.error
            assert "handshake" in hole.error.message
            _healthy_peer_transfers(srv.target)  # and the server still serves afterwards
    finally:
        stuck.close()
        other.close()
