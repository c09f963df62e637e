"""Decode ranks of one shape: each is negotiated on its own and moves its own bytes."""

from __future__ import annotations

import pytest

from pdproto import v1
from pdproto.client import HandshakeClient
from pdproto.errors import Reason, TopologyError
from pdproto.v1 import common_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, running_server


@pytest.mark.process
def test_peers_sharing_a_layout_move_their_own_bytes() -> None:
    """Two decode processes of one shape each get their own peer id and their own bytes in their own
    arena; a peer of another shape and a rejected one are judged on their own, every time."""
    peers = [DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=1, pages=32) for _ in range(2)]
    other = DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=3, pages=32)
    bad = DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=1, pages=32, kv_dtype="fp8_e4m3")
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target) as client:
            results = [client.register(p.registration()) for p in peers]
            assert results[0].peer_id != results[1].peer_id
            assert results[0].mode == results[1].mode == v1.NEGOTIATION_MODE_DENSE_TO_DCP
            client.register(other.registration())
            for _ in range(2):
                with pytest.raises(TopologyError) as caught:
                    client.register(bad.registration())
                assert caught.value.reason is Reason.TOPOLOGY_KV_DTYPE_MISMATCH
            for i, (peer, result) in enumerate(zip(peers, results, strict=True)):
                room = 700 + i
                pages = peer.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(result.peer_id, peer.transfer_info(room, pages))
                done = client.wait_for(result.peer_id, [room], timeout=20)
                assert done[room].state == common_pb2.TRANSFER_STATE_SUCCESS, done[room]
                assert peer.verify({room: pages}, SPEC.prompt_tokens) > 0
    finally:
        for p in (*peers, other, bad):
            p.close()
