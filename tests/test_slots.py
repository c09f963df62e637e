"""Per-request aux and state copies and their decode-side bounds (pdproto.negotiation.slots)."""

from __future__ import annotations

import pytest

from pdproto.errors import InvalidFieldError, PdprotoError, Reason
from pdproto.negotiation.extras import AuxPairing, StatePairing, StateTensorPairing
from pdproto.negotiation.shards import Segment
from pdproto.negotiation.slots import SlotCopy, aux_copies, check_destination, state_copies
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2

REC, SW = common_pb2.STATE_KIND_RECURRENT, common_pb2.STATE_KIND_SLIDING_WINDOW
AUX = (AuxPairing(0, 0, 8), AuxPairing(1, 1, 16))


def registration(*, aux_lens: list[int], state_lens: list[int]) -> registration_pb2.KvRegistration:
    reg = registration_pb2.KvRegistration(aux_ptrs=[0x10000, 0x20000], aux_data_lens=aux_lens)
    reg.state_buffers.add(data_ptrs=[0x30000, 0x40000], item_lens=[64, 32], data_lens=state_lens)
    return reg


def pairing(kind: int, segments: tuple[Segment, ...] = (Segment(0, 0, 64),)) -> StatePairing:
    return StatePairing(0, 0, kind, (
        StateTensorPairing(0, 0, 64, 64, segments),
        StateTensorPairing(1, 1, 32, 32, (Segment(16, 0, 16),)),
    ))


def transfer(aux: int | None = None, state: list[list[int]] | None = None) -> transfer_pb2.TransferInfo:
    info = transfer_pb2.TransferInfo(room=1, dst_aux_index=aux)
    info.dst_state_indices.extend(transfer_pb2.StateIndices(indices=s) for s in state or [])
    return info


def refusal(*args: object) -> PdprotoError:
    with pytest.raises(PdprotoError) as caught:
        check_destination(*args)  # type: ignore[arg-type]
    return caught.value


def test_aux_copies_move_one_slot_of_every_buffer() -> None:
    assert aux_copies(AUX, src_slot=2, dst_slot=9) == [
        SlotCopy("aux", 0, 0, 0, 0, 8, 8, (Segment(0, 0, 8),), ((2, 9),)),
        SlotCopy("aux", 1, 0, 1, 0, 16, 16, (Segment(0, 0, 16),), ((2, 9),)),
    ]


def test_aux_index_past_the_registered_region_is_refused() -> None:
    reg = registration(aux_lens=[80, 160], state_lens=[])
    check_destination(AUX, (), reg, transfer(aux=9))
    err = refusal(AUX, (), reg, transfer(aux=10))
    assert err.reason is Reason.DESTINATION_OUT_OF_BOUNDS and err.metadata["kind"] == "aux"


def test_aux_without_lengths_is_not_bounded_but_must_be_named() -> None:
    reg = registration(aux_lens=[], state_lens=[])
    check_destination(AUX, (), reg, transfer(aux=10 ** 6))
    err = refusal(AUX, (), reg, transfer())
    assert isinstance(err, InvalidFieldError) and err.field == "transfer.dst_aux_index"
    assert refusal(AUX, (), reg, transfer(aux=-1)).reason is Reason.INVALID_FIELD


def test_a_dummy_request_names_nothing() -> None:
    check_destination(AUX, [pairing(REC)], registration(aux_lens=[8, 16], state_lens=[64, 32]),
                      transfer_pb2.TransferInfo(room=1, is_dummy=True))


def test_state_slot_past_the_registered_region_is_refused() -> None:
    reg = registration(aux_lens=[], state_lens=[64 * 4, 32 * 4])
    check_destination((), [pairing(REC)], reg, transfer(state=[[3]]))
    err = refusal((), [pairing(REC)], reg, transfer(state=[[4]]))
    assert err.reason is Reason.DESTINATION_OUT_OF_BOUNDS and err.metadata["kind"] == "state"
    assert err.metadata["field"] == "transfer.dst_state_indices[0]"


def test_recurrent_state_needs_exactly_one_slot() -> None:
    reg = registration(aux_lens=[], state_lens=[])
    for state in ([[1, 2]], [[]], []):
        err = refusal((), [pairing(REC)], reg, transfer(state=state))
        assert isinstance(err, InvalidFieldError) and err.field == "transfer.dst_state_indices[0]"


def test_recurrent_copies_pair_the_two_slots() -> None:
    (first, second) = state_copies([pairing(REC)], src_slots=[[5]], dst_slots=[[3]])
    assert first.items == ((5, 3),) and first.segments == (Segment(0, 0, 64),)
    assert second.segments == (Segment(16, 0, 16),) and second.nbytes == 16


@pytest.mark.parametrize("kind", [SW, common_pb2.STATE_KIND_PAGED])
def test_sliding_window_and_paged_pages_pair_in_order_and_lists_must_match(kind: int) -> None:
    (first, _) = state_copies([pairing(kind)], src_slots=[[2, 3]], dst_slots=[[6, 7]])
    assert first.items == ((2, 6), (3, 7)) and first.nbytes == 128
    with pytest.raises(InvalidFieldError) as caught:
        state_copies([pairing(kind)], src_slots=[[2, 3]], dst_slots=[[6]])
    assert "2 prefill pages for 1 decode pages" in caught.value.message
    with pytest.raises(InvalidFieldError):
        state_copies([pairing(REC)], src_slots=[], dst_slots=[[1]])


def test_a_pairing_this_rank_does_not_write_needs_no_slots() -> None:
    idle = StatePairing(0, 0, REC, (StateTensorPairing(0, 0, 64, 64, ()),))
    assert state_copies([idle], src_slots=[], dst_slots=[]) == []
    check_destination((), [idle], registration(aux_lens=[], state_lens=[]), transfer())
