"""The decode peer (``pdproto.client.DecodePeer``) against a real ``pdproto serve``, through its own API.

Rooms, a per-rank ``TransferInfo`` builder, the outcome callback and the waitable, the
peer's own generation numbering, and a wait on a prefill killed mid-request: it ends at its
deadline with the cause (UNAVAILABLE), not a bare timeout. Every byte the serve rank wrote
is checked in the decode rank's memory.
"""

from __future__ import annotations

import threading

import pytest

from pdproto.client import DecodePeer, PrefillRank
from pdproto.errors import PdprotoError, Reason
from pdproto.negotiation.fanin import Outcome
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank
from tests._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process


def test_rooms_submitted_through_a_builder_end_in_one_outcome_each_and_land_byte_exact() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=32)
    outcomes: dict[int, Outcome] = {}
    called = threading.Event()

    def on_outcome(room: int, outcome: Outcome) -> None:
        outcomes[room] = outcome
        called.set()

    with running_server(*SERVE_ARGS) as srv:
        peer = DecodePeer(rank.registration(), timeout=10.0, on_outcome=on_outcome)
        try:
            (only,) = [peer.connect(srv.target)]
            assert peer.connect(srv.target) is only and peer.ranks == [only] and not only.dummy
            pages = {7: rank.pages_for(SPEC.prompt_tokens), 8: rank.pages_for(SPEC.prompt_tokens, first_page=16)}
            built: list[PrefillRank] = []

            def info_for(room: int) -> transfer_pb2.TransferInfo:
                def build(r: PrefillRank) -> transfer_pb2.TransferInfo:
                    built.append(r)
                    return rank.transfer_info(room, pages[room])
                return build

            generations = [peer.submit(room, [srv.target], info_for(room)) for room in pages]
            assert generations == [1, 2] and built == [only, only]
            assert [s.room for room in pages for s in peer.submitted(room, 10.0)] == [7, 8]
            for room in pages:
                out = peer.wait(room, 30.0)
                assert out.state == common_pb2.TRANSFER_STATE_SUCCESS and out.reported == {only.index}
                assert sum(s.bytes_transferred for s in peer.statuses(room)) > 0
                peer.forget(room)
            assert called.wait(5) and set(outcomes) == {7, 8}
            assert all(o.state == common_pb2.TRANSFER_STATE_SUCCESS for o in outcomes.values())
            rank.verify(pages, SPEC.prompt_tokens)
            with pytest.raises(PdprotoError) as unknown:
                peer.wait(7, 1.0)  # forgotten
            assert unknown.value.reason is Reason.REQUEST_NOT_FOUND
            with pytest.raises(PdprotoError) as nowhere:
                peer.submit(9, [], info_for(7))
            assert nowhere.value.reason is Reason.INVALID_FIELD
        finally:
            peer.close()
            rank.close()


def test_a_wait_on_a_killed_prefill_ends_at_its_deadline_with_the_cause() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=32)
    slow = list(SERVE_ARGS)
    slow[slow.index("--chunk-delay-ms") + 1] = "3000"  # chunks 3 s apart: the room stays open
    with running_server(*slow) as srv:
        peer = DecodePeer(rank.registration(), timeout=5.0)
        try:
            peer.connect(srv.target)
            pages = rank.pages_for(SPEC.prompt_tokens)
            peer.submit(7, [srv.target], [rank.transfer_info(7, pages)], generation=4)
            (status,) = peer.submitted(7, 10.0)
            assert status.generation == 4
            srv.kill()
            out = peer.wait(7, 2.0)
            assert out.state == common_pb2.TRANSFER_STATE_FAILED
            assert out.failure_code == Reason.UNAVAILABLE.name, out
            assert srv.target in out.failure_reason
        finally:
            peer.close()
            rank.close()


def test_prefill_ranks_that_disagree_on_packed_fan_in_refuse_the_request() -> None:
    """Heads written packed by one prefill rank and row by row by another (two releases) have no right order on
    the decode: the peer refuses before submitting. Agreeing ranks give every slice of each packed entry."""
    from pdproto.client.peer import _fan_in_slices
    from pdproto.negotiation.senders import SenderSet
    from pdproto.negotiation.tpmap import PACKED_FAN_IN
    from pdproto.v1 import registration_pb2, server_info_pb2

    def rank(index: int, offset: int, packed: bool) -> PrefillRank:
        result = server_info_pb2.NegotiationResult(peer_id=f"p{index}")
        for entry in (0, 1):
            e = result.entries.add(dst_entry=entry, packed_fan_in=packed)
            e.row_slice.dst_offset, e.row_slice.length = offset, 512
        return PrefillRank(f"127.0.0.1:{index}", index, None, result, SenderSet((), 1), dummy=False)  # type: ignore[arg-type]

    asked = registration_pb2.KvRegistration(page_size=16, capabilities=[PACKED_FAN_IN])
    for _ in range(2):
        asked.kv_buffers.add(item_len=16 * 1024)
    assert _fan_in_slices([rank(0, 0, True), rank(1, 512, True)], asked) == (
        {0: [(0, 512), (512, 512)], 1: [(0, 512), (512, 512)]}, {0: 1024, 1: 1024})
    assert _fan_in_slices([rank(0, 0, False), rank(1, 512, False)], asked) == ({}, {})
    with pytest.raises(PdprotoError) as caught:
        _fan_in_slices([rank(0, 0, True), rank(1, 512, False)], asked)
    assert caught.value.reason is Reason.UNSUPPORTED_VERSION and caught.value.metadata["entries"] == "0,1"
    # A prefill that says packed where the decode never asked, or whose slices would leave part of a row to
    # chance (one half only, overlapping halves), is refused: the decode reorders nothing it cannot account for.
    not_asked = registration_pb2.KvRegistration()
    not_asked.CopyFrom(asked)
    del not_asked.capabilities[:]
    for ranks, registration in (([rank(0, 0, True), rank(1, 512, True)], not_asked), ([rank(0, 0, True)], asked),
                                ([rank(0, 0, True), rank(1, 256, True)], asked)):
        with pytest.raises(PdprotoError) as caught:
            _fan_in_slices(ranks, registration)
        assert caught.value.reason is Reason.INVALID_FIELD and caught.value.metadata["entry"] == "0", caught.value
