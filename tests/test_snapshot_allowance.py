"""A peer that opens status streams in a loop is held to its snapshot allowance, against a real server.

Every new WatchStatus or Session starts with a snapshot of the peer's kept statuses, and
every resume writes the session's unacknowledged events again: with thousands kept, each
costs the server milliseconds of CPU while asking for it costs the client next to nothing.
``--snapshot-rate`` bounds what one peer's opens may be sent (four full snapshots at once,
then so many per second); past it an open is refused TOO_MANY_STREAMS with the seconds to
wait, and other peers are not affected. The clients honour the wait.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.rpc import error_from_rpc
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc, session_pb2
from pdproto.v1 import transfer_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_server.cmd_status import render
from pdproto_server.registry import SNAPSHOT_BURST, Allowance, Limits

from ._server_harness import SERVE_ARGS, SPEC, proof_metadata, running_server

KEPT = 1000
"""Final statuses the attacking peer keeps: every snapshot of it holds this many."""
LIMITS = ("--max-inflight", "24", "--max-finished", str(KEPT), "--max-streams", "64")
CAPACITY, RATE = Limits(max_inflight_per_peer=24, max_finished_per_peer=KEPT).snapshot_allowance
"""The allowance of each peer of the server these tests start (``LIMITS``, default ``--snapshot-rate``)."""
OPENS = 30


def test_the_allowance_refills_at_its_rate_and_says_how_long_to_wait() -> None:
    bucket = Allowance()
    assert bucket.take(300, 1000, 100, now=5.0) == 0.0  # starts full
    assert bucket.take(700, 1000, 100, now=5.0) == 0.0
    assert bucket.take(50, 1000, 100, now=5.0) == pytest.approx(0.5)  # empty: 50 units at 100/s
    assert bucket.take(50, 1000, 100, now=5.25) == pytest.approx(0.25)  # a refusal draws nothing
    assert bucket.take(50, 1000, 100, now=5.5) == 0.0
    assert bucket.take(5000, 1000, 100, now=1000.0) == 0.0  # more than it holds costs a full bucket
    assert bucket.take(1, 1000, 100, now=1000.0) == pytest.approx(0.01)


def _open_watch(stub: hs_grpc.HandshakeServiceStub, peer_id: str, credential: bytes) -> E.PdprotoError | None:
    """Open WatchStatus, take its first status and leave: None when served, the refusal otherwise."""
    call = stub.WatchStatus(hs.WatchStatusRequest(peer_id=peer_id, peer_credential=credential), timeout=30)
    try:
        next(call)
        return None
    except grpc.RpcError as exc:
        return error_from_rpc(exc)
    finally:
        call.cancel()


@contextlib.contextmanager
def _session(stub: hs_grpc.HandshakeServiceStub, opening: hs.SessionRequest) -> Iterator[Any]:
    """A Session call that sends ``opening`` and then nothing (it stays open until left)."""
    leave = threading.Event()

    def requests() -> Iterator[hs.SessionRequest]:
        yield opening
        leave.wait(60)

    call = stub.Session(requests(), timeout=60)
    try:
        yield call
    finally:
        leave.set()
        call.cancel()


def _first(call: Any) -> hs.SessionResponse | E.PdprotoError:
    try:
        response: hs.SessionResponse = next(call)
        return response
    except grpc.RpcError as exc:
        return error_from_rpc(exc)


def _check_refusals(refusals: list[E.PdprotoError]) -> None:
    for error in refusals:
        assert isinstance(error, E.ResourceLimitError) and error.reason is Reason.TOO_MANY_STREAMS, error
        assert "--snapshot-rate" in error.message and int(error.metadata["retryAfterMs"]) > 0, error


def _served_at_most(elapsed: float, each: int) -> int:
    """Opens of ``each`` statuses the allowance lets through in ``elapsed`` seconds (one for rounding)."""
    return math.floor((CAPACITY + elapsed * RATE) / each) + 1


@pytest.mark.process
def test_a_peer_opening_watches_in_a_loop_is_refused_while_another_peer_is_served() -> None:
    attacker, other = DecodeRank.for_spec(SPEC, pages=16), DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS[:-4], "--chunk-delay-ms", "0", *LIMITS, "--metrics-port", "0") as srv, \
                HandshakeClient(srv.target, timeout=60) as client, grpc.insecure_channel(srv.target) as channel:
            stub = hs_grpc.HandshakeServiceStub(channel)
            bad = client.register(attacker.registration()).peer_id
            good = client.register(other.registration()).peer_id
            rooms = range(1, KEPT + 1)
            for room in rooms:
                client.submit_transfer(bad, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))
            client.wait_for(bad, rooms, timeout=60)

            started = time.monotonic()
            outcomes = [_open_watch(stub, bad, client.credential(bad)) for _ in range(OPENS)]
            elapsed = time.monotonic() - started
            refusals = [o for o in outcomes if o is not None]
            served = OPENS - len(refusals)
            assert refusals, "thirty snapshots of 1,000 statuses back to back were all sent"
            assert served <= _served_at_most(elapsed, KEPT), (served, elapsed)
            _check_refusals(refusals)
            # Describe names the peer that keeps asking, with how often it was refused, for the operator.
            shown = client.describe()
            views = {p.peer_id: p for p in shown.peers}
            assert (views[bad].snapshots_refused, views[good].snapshots_refused) == (len(refusals), 0)
            row = next(line for line in render(shown).splitlines() if line.startswith(bad))
            assert row.split()[-1] == str(len(refusals)), row

            # The other peer's allowance is its own: its requests complete, and it watches them at once.
            client.submit_transfer(good, transfer_pb2.TransferInfo(room=7, dst_kv_pages=[0], is_dummy=True))
            assert client.wait_for(good, [7], timeout=30)[7].state == common_pb2.TRANSFER_STATE_SUCCESS
            assert _open_watch(stub, good, client.credential(good)) is None

            # The client waits as long as the refusal says, within its deadline, and is then served.
            assert _open_watch(stub, bad, client.credential(bad)) is not None
            with HandshakeClient(srv.target, timeout=30, session=False) as unary:
                seen = set()
                for status in unary.watch_status(bad, credential=client.credential(bad)):
                    seen.add(status.room)
                    if len(seen) == KEPT:
                        break
            assert seen == set(rooms)
            # So does a new session (its snapshot is the same 1,000 statuses): the caller just waits,
            # asking again only once the allowance has refilled (before, hundreds of opens in a second).
            assert _open_watch(stub, bad, client.credential(bad)) is not None
            refused = srv.metrics()["pdproto_snapshots_refused_total"]
            with HandshakeClient(srv.target, timeout=30) as fresh:
                done = fresh.wait_for(bad, [1], credential=client.credential(bad))
            assert done[1].state == common_pb2.TRANSFER_STATE_SUCCESS
            assert srv.metrics()["pdproto_snapshots_refused_total"] - refused <= 2
            assert srv.metrics()["pdproto_snapshots_refused_total"] >= len(refusals) + 1
            assert "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
    finally:
        attacker.close()
        other.close()


@pytest.mark.process
def test_a_session_opened_or_resumed_in_a_loop_is_refused() -> None:
    """New sessions take the same allowance as watches; a resume that acknowledges nothing makes the
    server write every event again, so resuming in a loop draws on it too."""
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS[:-4], "--chunk-delay-ms", "0", *LIMITS) as srv, \
                HandshakeClient(srv.target, timeout=60, session=False) as client, \
                grpc.insecure_channel(srv.target) as channel:
            stub = hs_grpc.HandshakeServiceStub(channel)
            pid = client.register(peer.registration()).peer_id
            rooms = range(1, KEPT + 1)
            for room in rooms:
                client.submit_transfer(pid, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))
            client.wait_for(pid, rooms, timeout=60)
            opening = session_pb2.SessionOpen(peer_id=pid, peer_credential=client.credential(pid), event_window=KEPT)

            started = time.monotonic()
            session_id, outcomes = "", []
            for _ in range(OPENS):
                with _session(stub, hs.SessionRequest(open=opening)) as call:
                    first = _first(call)
                outcomes.append(first)
                if isinstance(first, hs.SessionResponse):
                    session_id = first.opened.session_id
                    assert len(first.events) == KEPT  # the whole snapshot, unacknowledged from here on
            refusals = [o for o in outcomes if isinstance(o, E.PdprotoError)]
            assert refusals and len(outcomes) - len(refusals) <= _served_at_most(time.monotonic() - started, KEPT)
            _check_refusals(refusals)

            time.sleep(SNAPSHOT_BURST + 0.5)  # the allowance is full again
            resume = session_pb2.SessionOpen(peer_id=pid, peer_credential=client.credential(pid),
                                             resume_session_id=session_id, event_window=KEPT)
            started = time.monotonic()
            outcomes = []
            for _ in range(OPENS):
                with _session(stub, hs.SessionRequest(open=resume)) as call:
                    outcomes.append(_first(call))
            resumed = [o for o in outcomes if isinstance(o, hs.SessionResponse)]
            refusals = [o for o in outcomes if isinstance(o, E.PdprotoError)]
            assert resumed and all(r.opened.resumed and len(r.events) == KEPT for r in resumed)
            assert refusals and len(resumed) <= _served_at_most(time.monotonic() - started, KEPT)
            _check_refusals(refusals)
            # The session itself is intact: a resume that acknowledges everything costs nothing.
            with _session(stub, hs.SessionRequest(open=resume, event_ack=resumed[-1].events[-1].seq)) as call:
                first = _first(call)
            assert isinstance(first, hs.SessionResponse) and first.opened.resumed, first
    finally:
        peer.close()


@pytest.mark.process
def test_describe_of_a_peers_statuses_draws_on_its_allowance_and_the_operator_is_not_limited() -> None:
    """``Describe`` with ``include_finished`` builds a view of every kept status: 11.7 ms of server CPU
    per call with 4,096 kept, against 0.8 ms for a call that lists none. A peer's own views draw on its
    allowance, those of callers without a credential on one they share; the operator's on none."""
    peer = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS[:-4], "--chunk-delay-ms", "0", *LIMITS, token="peers",
                            operator_token="operator") as srv, \
                HandshakeClient(srv.target, token="peers", timeout=60, session=False) as client, \
                HandshakeClient(srv.target, token="operator", timeout=60, session=False) as operator:
            pid = client.register(peer.registration()).peer_id
            rooms = range(1, KEPT + 1)
            for room in rooms:
                client.submit_transfer(pid, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))
            client.wait_for(pid, rooms, timeout=60)
            own = hs.DescribeRequest(peer_id=pid, peer_credential=client.credential(pid), include_finished=True,
                                     request_limit=8192)
            with grpc.insecure_channel(srv.target) as channel:
                describe = hs_grpc.HandshakeServiceStub(channel).Describe
                metadata = proof_metadata(srv.target, "peers")
                started = time.monotonic()
                outcomes: list[E.PdprotoError | None] = []
                for _ in range(OPENS):
                    try:
                        assert len(describe(own, timeout=30, metadata=metadata).peers[0].finished) == KEPT
                        outcomes.append(None)
                    except grpc.RpcError as exc:
                        outcomes.append(error_from_rpc(exc))
                refusals = [o for o in outcomes if o is not None]
                assert refusals and OPENS - len(refusals) <= _served_at_most(time.monotonic() - started, KEPT)
                _check_refusals(refusals)
                # A call that lists no status costs no allowance, and the operator is not limited.
                assert describe(hs.DescribeRequest(), timeout=30, metadata=metadata).peers[0].peer_id == pid
            for _ in range(OPENS // 3):
                assert len(operator.describe(peer_id=pid, include_finished=True, request_limit=8192)
                           .peers[0].finished) == KEPT
            # The client waits as long as the refusal says, and is then served.
            assert len(client.describe(peer_id=pid, include_finished=True, request_limit=8192)
                       .peers[0].finished) == KEPT
    finally:
        peer.close()
