"""Per-request aux and state extents with bounds (pdproto.slots)."""

from __future__ import annotations

import pytest

from pdproto.errors import InvalidFieldError, PdprotoError, Reason
from pdproto.extras import AuxPairing, StatePairing, StateTensorPairing
from pdproto.shards import Segment
from pdproto.slots import Extent, Region, aux_extents, state_extents
from pdproto.v1 import common_pb2, registration_pb2

REC, SW = common_pb2.STATE_KIND_RECURRENT, common_pb2.STATE_KIND_SLIDING_WINDOW


def registration(*, aux_lens: list[int], state_lens: list[int]) -> registration_pb2.KvRegistration:
    reg = registration_pb2.KvRegistration(aux_ptrs=[0x10000, 0x20000], aux_data_lens=aux_lens)
    reg.state_buffers.add(data_ptrs=[0x30000, 0x40000], item_lens=[64, 32], data_lens=state_lens)
    return reg


AUX = (AuxPairing(0, 0, 8), AuxPairing(1, 1, 16))
AUX_SRC = (Region(0x1000, 8 * 4), Region(0x2000, 16 * 4))


def test_aux_extents_address_the_slot_on_both_sides() -> None:
    out = aux_extents(AUX, AUX_SRC, registration(aux_lens=[80, 160], state_lens=[]),
                      src_index=2, dst_index=9)
    assert out == [Extent(0x1000 + 16, 0x10000 + 72, 8), Extent(0x2000 + 32, 0x20000 + 144, 16)]


def test_aux_index_past_the_registered_region_is_refused() -> None:
    reg = registration(aux_lens=[80, 160], state_lens=[])
    with pytest.raises(PdprotoError) as caught:
        aux_extents(AUX, AUX_SRC, reg, src_index=0, dst_index=10)
    assert caught.value.reason is Reason.DESTINATION_OUT_OF_BOUNDS
    assert caught.value.metadata["kind"] == "aux"


def test_aux_without_lengths_is_not_bounded_and_missing_index_is_invalid() -> None:
    reg = registration(aux_lens=[], state_lens=[])
    assert len(aux_extents(AUX, AUX_SRC, reg, src_index=0, dst_index=10 ** 6)) == 2
    with pytest.raises(InvalidFieldError) as caught:
        aux_extents(AUX, AUX_SRC, reg, src_index=0, dst_index=None)
    assert caught.value.field == "transfer.dst_aux_index"
    with pytest.raises(InvalidFieldError):
        aux_extents(AUX, AUX_SRC, reg, src_index=0, dst_index=-1)
    with pytest.raises(InvalidFieldError):  # the prefill's own slot past its buffer
        aux_extents(AUX, AUX_SRC, reg, src_index=4, dst_index=0)


def pairing(kind: int, segments: tuple[Segment, ...] = (Segment(0, 0, 64),)) -> StatePairing:
    return StatePairing(0, 0, kind, (
        StateTensorPairing(0, 0, 64, 64, segments),
        StateTensorPairing(1, 1, 32, 32, (Segment(16, 0, 16),)),
    ))


STATE_SRC = ((Region(0x5000, 64 * 8), Region(0x6000, 32 * 8)),)


def test_recurrent_state_moves_its_segments_of_one_slot() -> None:
    out = state_extents([pairing(REC)], STATE_SRC, registration(aux_lens=[], state_lens=[64 * 4, 32 * 4]),
                        src_indices=[[5]], dst_indices=[[3]])
    assert out == [Extent(0x5000 + 320, 0x30000 + 192, 64), Extent(0x6000 + 160 + 16, 0x40000 + 96, 16)]


def test_state_slot_past_the_registered_region_is_refused() -> None:
    with pytest.raises(PdprotoError) as caught:
        state_extents([pairing(REC)], STATE_SRC, registration(aux_lens=[], state_lens=[64 * 4, 32 * 4]),
                      src_indices=[[5]], dst_indices=[[4]])
    assert caught.value.reason is Reason.DESTINATION_OUT_OF_BOUNDS
    assert caught.value.metadata["kind"] == "state"


def test_recurrent_state_takes_exactly_one_slot_per_side() -> None:
    reg = registration(aux_lens=[], state_lens=[])
    for src, dst in (([1], [1, 2]), ([], [1]), ([1], [])):
        with pytest.raises(InvalidFieldError) as caught:
            state_extents([pairing(REC)], STATE_SRC, reg, src_indices=[src], dst_indices=[dst])
        assert caught.value.field == "transfer.dst_state_indices[0]"
    with pytest.raises(InvalidFieldError):
        state_extents([pairing(REC)], STATE_SRC, reg, src_indices=[[1]], dst_indices=[])


def test_sliding_window_pages_pair_in_order_and_merge_when_contiguous() -> None:
    out = state_extents([pairing(SW)], STATE_SRC, registration(aux_lens=[], state_lens=[]),
                        src_indices=[[2, 3]], dst_indices=[[6, 7]])
    assert out[0] == Extent(0x5000 + 128, 0x30000 + 384, 128)  # two pages, one extent
    assert out[1:] == [Extent(0x6000 + 64 + 16, 0x40000 + 192, 16), Extent(0x6000 + 96 + 16, 0x40000 + 224, 16)]
    with pytest.raises(InvalidFieldError):
        state_extents([pairing(SW)], STATE_SRC, registration(aux_lens=[], state_lens=[]),
                      src_indices=[[2, 3]], dst_indices=[[6]])


def test_a_pairing_this_rank_does_not_write_needs_no_slots() -> None:
    idle = StatePairing(0, 0, REC, (StateTensorPairing(0, 0, 64, 64, ()),))
    assert state_extents([idle], STATE_SRC, registration(aux_lens=[], state_lens=[]),
                         src_indices=[], dst_indices=[]) == []
