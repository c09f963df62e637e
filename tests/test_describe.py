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

# Chunks come every 5 s: a submitted request stays in flight while the test looks at it.
SLOW = (*SERVE_ARGS[:-4], "--chunk-delay-ms", "5000", "--match-timeout", "30")


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdproto_server.cli", "status", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_status_shows_a_registered_peer_and_its_request_in_flight() -> None:
    peer = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=1, pages=32)
    try:
        with running_server(*SLOW, token="operator-and-peers") as srv, \
                HandshakeClient(srv.target, token=srv.token) as client:
            peer_id = client.register(peer.registration()).peer_id
            credential = client.credential(peer_id)
            client.submit_transfer(peer_id, peer.transfer_info(4242, peer.pages_for(SPEC.prompt_tokens)))
            token_file = srv.stderr_path.parent / "token"

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

            # The bearer token is required like on every other call.
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
