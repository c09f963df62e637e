"""``Describe`` and ``pdproto status`` against a real ``pdproto serve``: what an operator sees."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, describe_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import REPO, SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

# Chunks come every 5 s: a submitted request stays in flight while the test looks at it. So
# requests are still in flight when a test ends: the server drains them 1 s at its SIGTERM, not
# the default 10 (what a drain does is tested on its own).
SLOW = (*SERVE_ARGS[:-4], "--chunk-delay-ms", "5000", "--match-timeout", "30", "--grace", "1")


def _cli(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pdproto COMMAND ARGS...`` in a subprocess, its output captured."""
    return subprocess.run([sys.executable, "-m", "pdproto_server.cli", command, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return _cli("status", *args)


def test_status_shows_a_registered_peer_and_its_request_in_flight() -> None:
    peer = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=1, pages=32)
    try:
        with running_server(*SLOW, token="peers", operator_token="operator") as srv, \
                HandshakeClient(srv.target, token=srv.token) as client:
            peer_id = client.register(peer.registration()).peer_id
            credential = client.credential(peer_id)
            client.submit_transfer(peer_id, peer.transfer_info(4242, peer.pages_for(SPEC.prompt_tokens)))
            token_file = srv.stderr_path.parent / "operator-token"

            table = _status("--target", srv.target, "--token-file", str(token_file))
            assert table.returncode == 0, table.stderr
            lines = table.stdout.splitlines()
            assert any(peer_id in line and "DENSE_TO_DCP" in line and "LIVE" in line for line in lines), table.stdout
            assert any(peer_id in line and "4242" in line and "WAITING_FOR_INPUT" in line for line in lines)
            assert any(line.startswith("max_peers") for line in lines)

            raw = _status("--target", srv.target, "--token-file", str(token_file), "--json")
            assert raw.returncode == 0, raw.stderr
            view = json.loads(raw.stdout)
            (shown,) = view["peers"]
            assert shown["peer_id"] == peer_id and shown["state"] == "PEER_STATE_LIVE"
            assert shown["result"]["mode"] == "NEGOTIATION_MODE_DENSE_TO_DCP"
            assert [r["room"] for r in shown["requests"]] == ["4242"]
            assert shown["open_requests"] == 1 and view["open_requests"] == 1
            limits = {lim["name"]: lim for lim in view["limits"]}
            assert limits["max_peers"]["used"] == "1"
            # An operator's view, not a key ring: no credential, no buffer address.
            for form in (credential.hex(), base64.b64encode(credential).decode()):
                assert form not in raw.stdout
            d = client.describe()
            assert credential not in d.SerializeToString()
            assert '"ptr"' not in raw.stdout
            assert not [b.ptr for b in peer.registration().kv_buffers if b.ptr > 1 << 16 and str(b.ptr) in raw.stdout]

            # The deployment's token shows the peer, but not its rooms or engine identity.
            peers_view = _status("--target", srv.target, "--token-file", str(srv.stderr_path.parent / "token"))
            assert peers_view.returncode == 0, peers_view.stderr
            assert peer_id in peers_view.stdout and "4242" not in peers_view.stdout
            assert "(hidden)" in peers_view.stdout and "--operator-token-file" in peers_view.stdout
            # A proof of the token is required like on every other call.
            refused = _status("--target", srv.target)
            assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
            client.deregister(peer_id)
            after = client.describe()
            assert not after.peers and after.open_requests == 0
            assert dict(after.outcomes) == {"PEER_GONE": 1}
    finally:
        peer.close()


def test_describe_filters_one_peer_and_bounds_the_request_list() -> None:
    a, b = DecodeRank.for_spec(SPEC, pages=80), DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=0, pages=64)
    try:
        with running_server(*SLOW) as srv, HandshakeClient(srv.target) as client:
            a_id = client.register(a.registration()).peer_id
            b_id = client.register(b.registration()).peer_id
            for room in range(5):
                client.submit_transfer(a_id, a.transfer_info(room, a.pages_for(SPEC.prompt_tokens, room * 13)))
            only_a = client.describe(peer_id=a_id, request_limit=2)
            assert [p.peer_id for p in only_a.peers] == [a_id]
            assert only_a.peers[0].open_requests == 5
            assert [r.room for r in only_a.peers[0].requests] == [0, 1]  # oldest first, at most 2
            assert all(r.state == common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT for r in only_a.peers[0].requests)
            both = client.describe()
            assert {p.peer_id for p in both.peers} == {a_id, b_id}
            assert {p.peer_id: p.state for p in both.peers} == {a_id: describe_pb2.PEER_STATE_LIVE,
                                                                b_id: describe_pb2.PEER_STATE_LIVE}
            with pytest.raises(E.NotFoundError) as gone:
                client.submit_transfer("p-unknown", a.transfer_info(1, [1]))
            assert gone.value.reason is Reason.PEER_NOT_FOUND
    finally:
        a.close()
        b.close()


def test_no_request_limit_makes_describe_list_more_than_one_peer_can_hold() -> None:
    """Each view costs the server a few microseconds on its event loop, and a token holder names the
    limit: ``request_limit`` 2^32 - 1 on a busy server built hundreds of thousands of them. The whole
    response lists at most ``--max-inflight`` + ``--max-finished`` (4 + 2 here) request views."""
    peers = [DecodeRank.for_spec(SPEC, pages=80) for _ in range(3)]
    try:
        with running_server(*SLOW, "--max-inflight", "4", "--max-finished", "2") as srv, \
                HandshakeClient(srv.target) as client:
            ids = [client.register(p.registration()).peer_id for p in peers]
            for peer, peer_id in zip(peers, ids):
                for room in range(4):
                    client.submit_transfer(peer_id, peer.transfer_info(room, peer.pages_for(SPEC.prompt_tokens,
                                                                                             room * 13)))
            view = client.describe(request_limit=2**32 - 1)
            assert sum(p.open_requests for p in view.peers) == 12
            assert sum(len(p.requests) for p in view.peers) == 6, view
            own = client.describe(peer_id=ids[0], request_limit=2**32 - 1, include_finished=True)
            assert [r.room for r in own.peers[0].requests] == [0, 1, 2, 3]
    finally:
        for p in peers:
            p.close()


def test_a_token_holder_reads_no_other_peers_rooms_or_engine_identity() -> None:
    """A room id is enough to submit for that room and receive its KV, and an engine identity to replace
    its peer (docs/security.md): Describe shows them only to the operator token or the peer itself."""
    victim, attacker = DecodeRank.for_spec(SPEC, pages=80), DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=0, pages=64)
    room = 777_001
    try:
        with running_server(*SLOW, token="peers", operator_token="operator") as srv, \
                HandshakeClient(srv.target, token=srv.token) as mine, \
                HandshakeClient(srv.target, token=srv.token) as theirs, \
                HandshakeClient(srv.target, token="operator", session=False) as operator:
            victim_id = mine.register(victim.registration()).peer_id
            mine.submit_transfer(victim_id, victim.transfer_info(room, victim.pages_for(SPEC.prompt_tokens)))
            mine.submit_transfer(victim_id, victim.transfer_info(room + 1, victim.pages_for(SPEC.prompt_tokens)))
            mine.abort(victim_id, room + 1)  # a kept final status, too
            mine.wait_for(victim_id, [room + 1], timeout=20)
            attacker_id = theirs.register(attacker.registration()).peer_id
            identity = operator.describe(peer_id=victim_id).peers[0].engine_identity
            assert identity

            for seen in (theirs.describe(include_finished=True, request_limit=100),
                         theirs.describe(peer_id=victim_id, include_finished=True)):
                (view,) = [p for p in seen.peers if p.peer_id == victim_id]
                assert view.redacted and view.open_requests == 1 and len(view.requests) == 1
                assert view.requests[0].room == 0 and not view.finished
                assert not view.engine_identity and not view.HasField("notify_endpoint")
                assert identity.encode() not in seen.SerializeToString()
            # Its own peer, with its own credential, in full; its credential names no other peer.
            own = theirs.describe(peer_id=attacker_id).peers[0]
            assert not own.redacted and own.engine_identity
            with pytest.raises(E.NotFoundError) as wrong:
                theirs.describe(peer_id=victim_id, credential=theirs.credential(attacker_id))
            assert wrong.value.reason is Reason.PEER_NOT_FOUND

            # The operator sees every peer in full, and can do nothing a decode does.
            full = {p.peer_id: p for p in operator.describe(include_finished=True).peers}
            assert not full[victim_id].redacted and [r.room for r in full[victim_id].requests] == [room]
            assert [s.room for s in full[victim_id].finished] == [room + 1]
            assert full[victim_id].notify_endpoint.port == victim.registration().notify_endpoint.port
            assert operator.get_server_info().page_size == SPEC.page_size
            with pytest.raises(E.PdprotoError) as refused:
                operator.register(attacker.registration())
            assert refused.value.reason is Reason.UNAUTHENTICATED and "Describe" in refused.value.message
            with pytest.raises(E.PdprotoError) as guessed:
                with HandshakeClient(srv.target, token="operator-guess", session=False) as guess:
                    guess.describe()
            # A guessed token is refused before the call: the server cannot prove it (docs/security.md).
            assert guessed.value.reason is Reason.RANK_UNPROVEN and isinstance(guessed.value, E.AuthError)
    finally:
        victim.close()
        attacker.close()


def test_the_operator_evicts_a_squatter_and_no_one_else_can() -> None:
    """docs/security.md, "Squat a decode's identity": a token holder registered under a decode's
    notify endpoint, holding a stream, keeps that decode out (IDENTITY_IN_USE) until the operator
    runs ``pdproto evict``; no token holder may evict, nor anyone on a server without an operator token."""
    victim = DecodeRank.for_spec(SPEC, pages=32)
    squatter = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, token="peers", operator_token="operator") as srv, \
                HandshakeClient(srv.target, token=srv.token, timeout=10) as sc, \
                HandshakeClient(srv.target, token=srv.token, timeout=10) as vc:
            squat = squatter.registration()
            squat.notify_endpoint.CopyFrom(victim.registration().notify_endpoint)
            sid = sc.register(squat).peer_id
            pages = squatter.pages_for(SPEC.prompt_tokens)
            sc.submit_transfer(sid, squatter.transfer_info(1, pages))  # its session stays open
            assert sc.wait_for(sid, [1], timeout=20)[1].state == common_pb2.TRANSFER_STATE_SUCCESS
            with pytest.raises(E.IdentityInUseError):
                vc.register(victim.registration())
            for client in (vc, sc):  # the deployment's token evicts no one, not even itself
                with pytest.raises(E.AuthError):
                    client.evict(sid)
            token_file = str(srv.stderr_path.parent / "operator-token")
            evicted = _cli("evict", "--target", srv.target, "--token-file", token_file, "--peer", sid)
            assert evicted.returncode == 0, evicted.stderr
            assert f"evicted {sid}: 0 open request(s)" in evicted.stdout
            again = _cli("evict", "--target", srv.target, "--token-file", token_file, "--peer", sid)
            assert again.returncode == 1 and "PEER_NOT_FOUND" in again.stderr, again.stderr
            vid = vc.register(victim.registration()).peer_id  # the decode is back
            mine = victim.pages_for(SPEC.prompt_tokens)
            vc.submit_transfer(vid, victim.transfer_info(2, mine))
            assert vc.wait_for(vid, [2], timeout=20)[2].state == common_pb2.TRANSFER_STATE_SUCCESS
            victim.verify({2: mine}, SPEC.prompt_tokens)
            with pytest.raises(E.NotFoundError):
                sc.submit_transfer(sid, squatter.transfer_info(3, pages))
        with running_server(*SERVE_ARGS) as open_srv, HandshakeClient(open_srv.target, timeout=10) as anyone:
            pid = anyone.register(squatter.registration()).peer_id
            with pytest.raises(E.AuthError) as refused:
                anyone.evict(pid)
            assert "--operator-token-file" in refused.value.message
    finally:
        victim.close()
        squatter.close()
