"""What a flooding session peer must not do, checked the same way on gRPC and on the session lane.

A flooder writes submits without reading or acknowledging anything; meanwhile a good
peer's requests must complete, byte-exact, the server must have applied no more of the
flooder's commands than its command window, and the flooder's writes must have stalled.
"""

from __future__ import annotations

import time

from pdproto.client import HandshakeClient
from pdproto.session import DEFAULT_COMMAND_WINDOW
from pdproto.v1 import common_pb2, describe_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SPEC


def check_held_back(client: HandshakeClient, good: DecodeRank, good_id: str, bad_id: str,
                    written: list[int]) -> dict[str, describe_pb2.PeerView]:
    """Run four of the good peer's requests while the flood goes on; returns both peers' views after."""
    time.sleep(1.0)
    placed = {room: good.pages_for(SPEC.prompt_tokens, first_page=i * 16) for i, room in enumerate(range(4))}
    for room, pages in placed.items():
        client.submit_transfer(good_id, good.transfer_info(room, pages))
    done = client.wait_for(good_id, placed, timeout=20)
    assert all(s.state == common_pb2.TRANSFER_STATE_SUCCESS for s in done.values()), done
    good.verify(placed, SPEC.prompt_tokens)
    stalled_at = written[0]
    time.sleep(0.5)
    views = {p.peer_id: p for p in client.describe().peers}
    applied = views[bad_id].open_requests + views[bad_id].finished_kept
    assert applied <= DEFAULT_COMMAND_WINDOW, applied
    assert written[0] == stalled_at and written[0] < 20_000, written[0]
    return views


__all__ = ["check_held_back"]
