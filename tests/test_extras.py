"""Aux and state matching, state slicing and MHA head slicing (pdproto.negotiation.extras)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.errors import InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.extras import (
    AuxPairing,
    kv_row_writes,
    match_state,
    pair_aux,
    state_writes,
)
from pdproto.negotiation.senders import target_tp_ranks
from pdproto.negotiation.shards import Segment, head_axis
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2
from tests._tp_model import KimiShape, apply, local_item

KIMI = KimiShape()


def info(tp: int = 1, *, aux: tuple[int, ...] = (), pp: int = 1, with_ids: bool = True,
         entries: int = 1) -> server_info_pb2.PrefillServerInfo:
    """A prefill publishing ``entries`` Kimi-shaped state entries and aux buffers of these sizes."""
    msg = server_info_pb2.PrefillServerInfo(page_size=16)
    msg.attn_tp.size, msg.pp.size = tp, pp
    msg.aux_entries.extend(server_info_pb2.AuxEntryInfo(item_len=n) for n in aux)
    for _ in range(entries):
        msg.state_entries.append(KIMI.entry_info(tp, with_ids=with_ids))
    return msg


def reg(tp: int = 1, *, aux: tuple[int, ...] = (), with_ids: bool = True,
        entries: int = 1, pp: int = 1) -> registration_pb2.KvRegistration:
    """A decode registering the same state at TP ``tp`` and aux buffers of these sizes."""
    msg = registration_pb2.KvRegistration(aux_ptrs=[0x1000 * (i + 1) for i in range(len(aux))],
                                          aux_item_lens=list(aux))
    msg.attn_tp.size, msg.pp.size = tp, pp
    for _ in range(entries):
        msg.state_buffers.append(KIMI.state_buffer(tp, with_ids=with_ids))
    return msg


def reason_of(fn: object, *args: object, **kwargs: object) -> Reason:
    with pytest.raises(TopologyError) as caught:
        fn(*args, **kwargs)  # type: ignore[operator]
    return caught.value.reason


# --- aux ------------------------------------------------------------------------------------

def test_aux_pairs_by_position() -> None:
    assert pair_aux(info(aux=(8, 64)), reg(aux=(8, 64))) == (AuxPairing(0, 0, 8), AuxPairing(1, 1, 64))
    assert pair_aux(info(aux=(8, 64)), reg()) == ()  # none for a decode without (vLLM samples its first token)


def test_a_decode_waiting_for_aux_is_refused_by_a_prefill_without() -> None:
    """An SGLang decode gates each request on its aux row: a prefill that writes none would hang it."""
    assert reason_of(pair_aux, info(), reg(aux=(8,))) is Reason.TOPOLOGY_AUX_COUNT_MISMATCH


def test_aux_sizes_default_to_the_prefill_when_the_decode_sends_none() -> None:
    r = reg(aux=(8, 64))
    del r.aux_item_lens[:]  # as SGLang frames register: pointers only
    assert pair_aux(info(aux=(8, 64)), r)[1].item_len == 64


def test_aux_count_mismatch() -> None:
    assert reason_of(pair_aux, info(aux=(8, 64)), reg(aux=(8,))) is Reason.TOPOLOGY_AUX_COUNT_MISMATCH


def test_aux_size_mismatch() -> None:
    assert reason_of(pair_aux, info(aux=(8, 64)), reg(aux=(8, 32))) is Reason.TOPOLOGY_AUX_SIZE_MISMATCH


def test_aux_lists_of_another_length_are_invalid() -> None:
    r = reg(aux=(8, 64))
    r.aux_data_lens.append(100)
    with pytest.raises(InvalidFieldError) as caught:
        pair_aux(info(aux=(8, 64)), r)
    assert caught.value.field == "registration.aux_data_lens"


# --- state matching -------------------------------------------------------------------------

def test_state_pairs_tensors_by_layer_id_across_pp() -> None:
    # Prefill stage 1 of 2 holds KDA layers 4, 5, 6; the decode (PP 1) holds all six.
    stage = KimiShape(kda_layers=(4, 5, 6))
    i = info(pp=2)
    del i.state_entries[:]
    i.state_entries.append(stage.entry_info(1))
    (m,) = match_state(i, reg(), src_tp=1, dst_tp=1)
    assert [t.dst_tensor for t in m.tensors] == [3, 4, 5, 9, 10, 11]


def test_state_count_mismatch() -> None:
    assert reason_of(match_state, info(entries=2), reg(), src_tp=1, dst_tp=1) \
        is Reason.TOPOLOGY_STATE_COUNT_MISMATCH


def test_state_kind_mismatch() -> None:
    r = reg()
    r.state_buffers[0].kind = common_pb2.STATE_KIND_SLIDING_WINDOW
    assert reason_of(match_state, info(), r, src_tp=1, dst_tp=1) is Reason.TOPOLOGY_STATE_KIND_MISMATCH


def _paged(name: str, policy: int, *, tp: int = 1, decode_name: str = "",
           decode_kind: int = common_pb2.STATE_KIND_PAGED) -> tuple[server_info_pb2.PrefillServerInfo,
                                                                     registration_pb2.KvRegistration]:
    """A prefill and a decode with one per-KV-page entry of two 8,448-byte tensors (SGLang's DSA index)."""
    i = server_info_pb2.PrefillServerInfo(page_size=64)
    i.attn_tp.size = tp
    entry = i.state_entries.add(kind=common_pb2.STATE_KIND_PAGED, type_name=name,
                                tp_policy=policy)  # type: ignore[arg-type]
    entry.tensors.add(item_len=8448)
    entry.tensors.add(item_len=8448)
    r = registration_pb2.KvRegistration()
    r.state_buffers.add(kind=decode_kind, type_name=decode_name,  # type: ignore[arg-type]
                        data_ptrs=[0x1000, 0x9000], item_lens=[8448, 8448])
    return i, r


def test_a_replicated_paged_entry_is_written_whole_by_one_sender() -> None:
    i, r = _paged("dsa", common_pb2.STATE_TP_POLICY_REPLICATED, tp=4, decode_name="dsa")
    (m,) = match_state(i, r, src_tp=4, dst_tp=2)
    assert m.kind == common_pb2.STATE_KIND_PAGED
    plans = state_writes((m,), src_tp=4, dst_tp=2, dst_rank=1, senders=(2, 3))
    assert [[sum(s.length for s in t.segments) for t in p.tensors] for _, (p,) in sorted(plans.items())] \
        == [[8448, 8448], [0, 0]]


def test_a_paged_entry_pairs_only_with_its_own_kind_and_type() -> None:
    for decode_name, decode_kind in (("qsa_compressed", common_pb2.STATE_KIND_PAGED),
                                     ("dsa", common_pb2.STATE_KIND_SLIDING_WINDOW)):
        i, r = _paged("dsa", common_pb2.STATE_TP_POLICY_REPLICATED, decode_name=decode_name,
                      decode_kind=decode_kind)
        with pytest.raises(TopologyError) as caught:
            match_state(i, r, src_tp=1, dst_tp=1)
        assert caught.value.reason is Reason.TOPOLOGY_STATE_KIND_MISMATCH
        assert "'dsa'" in caught.value.message and caught.value.metadata["typeName"] == "dsa"
    # A name only one side sends (a decode or prefill not built from SGLang) reads as agreeing.
    for prefill_name, decode_name in (("", "dsa"), ("dsa", "")):
        i, r = _paged(prefill_name, common_pb2.STATE_TP_POLICY_REPLICATED, decode_name=decode_name)
        assert len(match_state(i, r, src_tp=1, dst_tp=1)) == 1


def test_an_entry_that_needs_equal_tp_is_refused_on_a_mismatch_naming_its_type() -> None:
    i, r = _paged("block_scale", common_pb2.STATE_TP_POLICY_REFUSED, tp=2)
    assert len(match_state(i, r, src_tp=2, dst_tp=2)) == 1
    with pytest.raises(TopologyError) as caught:
        match_state(i, r, src_tp=2, dst_tp=4)
    assert caught.value.reason is Reason.TOPOLOGY_STATE_TP_REFUSED
    assert "(block_scale)" in caught.value.message
    assert caught.value.metadata == {"stateEntry": "0", "typeName": "block_scale", "prefillTpSize": "2",
                                     "decodeTpSize": "4"}


def test_a_kind_this_negotiation_does_not_know_is_refused_naming_its_type() -> None:
    i, r = _paged("swa_ring", common_pb2.STATE_TP_POLICY_UNSPECIFIED)
    i.state_entries[0].kind = 9  # type: ignore[assignment]  # from a newer minor
    with pytest.raises(TopologyError) as caught:
        match_state(i, r, src_tp=1, dst_tp=1)
    assert caught.value.reason is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED
    assert "(swa_ring)" in caught.value.message


def test_state_kind_unset_on_the_decode_takes_the_prefills() -> None:
    (m,) = match_state(info(), reg(), src_tp=1, dst_tp=1)
    assert m.kind == common_pb2.STATE_KIND_RECURRENT


def test_state_kind_unknown_on_the_prefill_is_unsupported() -> None:
    i = info()
    i.state_entries[0].kind = common_pb2.STATE_KIND_UNSPECIFIED
    assert reason_of(match_state, i, reg(), src_tp=1, dst_tp=1) is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED


def test_state_size_mismatch_at_equal_tp() -> None:
    r = reg()
    r.state_buffers[0].item_lens[0] += 2
    assert reason_of(match_state, info(), r, src_tp=1, dst_tp=1) is Reason.TOPOLOGY_STATE_SIZE_MISMATCH


def test_state_element_size_mismatch_when_sliced() -> None:
    # The decode's temporal heads are fp16 (half the bytes) while the prefill's are fp32.
    r = reg(2)
    last = len(r.state_buffers[0].item_lens) - 1
    r.state_buffers[0].item_lens[last] //= 2
    assert reason_of(match_state, info(4), r, src_tp=4, dst_tp=2) is Reason.TOPOLOGY_STATE_SIZE_MISMATCH


def test_state_slice_mismatch_when_replicated_on_one_side_only() -> None:
    i = info(4)
    t = i.state_entries[0].tensors[0]
    t.dim, t.item_len = 0, 3 * 96 * 2
    del t.shard_groups[:]
    assert reason_of(match_state, i, reg(2), src_tp=4, dst_tp=2) is Reason.TOPOLOGY_STATE_SLICE_MISMATCH


def test_state_slice_mismatch_when_widths_do_not_make_the_same_whole() -> None:
    r = reg(2)
    r.state_buffers[0].dim_per_tensors[-1] = 2  # 2 heads per rank at TP 2 is 4, not the model's 8
    r.state_buffers[0].item_lens[-1] = 2 * 64
    assert reason_of(match_state, info(4), r, src_tp=4, dst_tp=2) is Reason.TOPOLOGY_STATE_SLICE_MISMATCH


def test_state_dims_missing_when_tp_differs() -> None:
    r = reg(2)
    del r.state_buffers[0].dim_per_tensors[:]
    assert reason_of(match_state, info(4), r, src_tp=4, dst_tp=2) is Reason.TOPOLOGY_STATE_DIMS_MISSING


def test_state_dims_are_not_needed_at_equal_tp() -> None:
    r = reg(2)
    del r.state_buffers[0].dim_per_tensors[:]
    assert len(match_state(info(2), r, src_tp=2, dst_tp=2)[0].tensors) == 12


def test_state_layer_ids_required_across_pp_without_ids() -> None:
    assert reason_of(match_state, info(pp=2, with_ids=False), reg(with_ids=False), src_tp=1, dst_tp=1) \
        is Reason.TOPOLOGY_STATE_LAYER_IDS_REQUIRED


def test_state_without_ids_pairs_by_position_on_the_same_stage() -> None:
    (m,) = match_state(info(with_ids=False), reg(with_ids=False), src_tp=1, dst_tp=1)
    assert [t.dst_tensor for t in m.tensors] == list(range(12))


def test_state_layer_ids_on_one_side_only() -> None:
    assert reason_of(match_state, info(), reg(with_ids=False), src_tp=1, dst_tp=1) \
        is Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED


def test_state_missing_layer() -> None:
    r = reg()
    r.state_buffers[0].layer_ids[0] = 99
    assert reason_of(match_state, info(), r, src_tp=1, dst_tp=1) is Reason.TOPOLOGY_MISSING_LAYER


def test_state_tensor_count_mismatch_by_position() -> None:
    r = reg(with_ids=False)
    b = r.state_buffers[0]
    for field in (b.data_ptrs, b.item_lens, b.dim_per_tensors, b.data_lens):
        field.pop()
    assert reason_of(match_state, info(with_ids=False), r, src_tp=1, dst_tp=1) \
        is Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH


def test_malformed_state_buffer_is_invalid() -> None:
    r = reg()
    r.state_buffers[0].item_lens.pop()
    with pytest.raises(InvalidFieldError) as caught:
        match_state(info(), r, src_tp=1, dst_tp=1)
    assert caught.value.field == "registration.state_buffers[0].item_lens"


# --- state writes ---------------------------------------------------------------------------

def check_kimi_state(src_tp: int, dst_tp: int) -> None:
    """Every decode rank's every state byte comes once from the right prefill byte."""
    matches = match_state(info(src_tp), reg(dst_tp), src_tp=src_tp, dst_tp=dst_tp)
    axes = KIMI.axes()
    for d in range(dst_tp):
        senders = target_tp_ranks(src_tp, dst_tp, d)
        plans = state_writes(matches, src_tp=src_tp, dst_tp=dst_tp, dst_rank=d, senders=senders)
        for k, (axis, _) in enumerate(axes):
            base = k << 32  # tensors hold distinct ids
            sources = {s: local_item(axis, src_tp, s, base=base) for s in range(src_tp)}
            writes = {s: plans[s][0].tensors[k].segments for s in senders}
            want = local_item(axis, dst_tp, d, base=base)
            got, count = apply(writes, sources, want.size)
            assert (count == 1).all()
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 2), (2, 4), (1, 4), (4, 1), (4, 4), (2, 2)])
def test_kimi_state_moves_byte_exact(src_tp: int, dst_tp: int) -> None:
    check_kimi_state(src_tp, dst_tp)


def test_equal_tp_writes_whole_slots_in_one_segment_per_tensor() -> None:
    matches = match_state(info(4), reg(4), src_tp=4, dst_tp=4)
    (plan,) = state_writes(matches, src_tp=4, dst_tp=4, dst_rank=3, senders=[3])[3]
    assert all(len(t.segments) == 1 and t.segments[0] == Segment(0, 0, t.src_item_len)
               for t in plan.tensors)


def test_fan_in_senders_each_write_part_of_every_tensor() -> None:
    matches = match_state(info(4), reg(2), src_tp=4, dst_tp=2)
    plans = state_writes(matches, src_tp=4, dst_tp=2, dst_rank=1, senders=[2, 3])
    assert plans[2][0].writes and plans[3][0].writes
    conv = plans[3][0].tensors[0].segments
    assert len(conv) == 3 * 3  # one block per window row and q/k/v group


def test_state_pairing_message_carries_every_segment() -> None:
    matches = match_state(info(4), reg(2), src_tp=4, dst_tp=2)
    plan = state_writes(matches, src_tp=4, dst_tp=2, dst_rank=0, senders=[0, 1])[1][0]
    msg = plan.to_proto()
    assert (msg.src_entry, msg.dst_entry, msg.kind) == (plan.src_entry, plan.dst_entry, plan.kind)
    sent = [[(s.src_offset, s.dst_offset, s.length) for s in t.segments] for t in msg.tensors]
    assert sent == [[(s.src_offset, s.dst_offset, s.length) for s in t.segments] for t in plan.tensors]


# --- MHA head slicing -----------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8, 16]),
       st.integers(1, 6))
def test_mha_rows_move_byte_exact_in_both_directions(src_tp: int, dst_tp: int, heads: int,
                                                      head_bytes: int) -> None:
    def row_bytes(tp: int) -> int:
        return max(1, heads // tp) * head_bytes

    for d in range(dst_tp):
        senders = target_tp_ranks(src_tp, dst_tp, d)
        writes = kv_row_writes(mla=False, total_heads=heads, src_row_bytes=row_bytes(src_tp),
                               dst_row_bytes=row_bytes(dst_tp), src_tp=src_tp, dst_tp=dst_tp,
                               dst_rank=d, senders=senders)
        axis = head_axis(heads, row_bytes(src_tp), src_tp)
        sources = {s: local_item(axis, src_tp, s) for s in range(src_tp)}
        want = local_item(axis, dst_tp, d)
        got, count = apply(writes, sources, want.size)
        assert (count == 1).all()
        np.testing.assert_array_equal(got, want)


def test_mha_tp2_to_tp4_sends_half_rows() -> None:
    writes = kv_row_writes(mla=False, total_heads=8, src_row_bytes=4 * 256, dst_row_bytes=2 * 256,
                           src_tp=2, dst_tp=4, dst_rank=3, senders=[1])
    assert writes == {1: (Segment(512, 0, 512),)}


def test_mha_rows_holding_every_head_are_cut_by_the_first_sender_only() -> None:
    # SGLang's CP-TP group sharing: each rank of a "TP 2" prefill holds all 8 heads (attention TP 1).
    writes = kv_row_writes(mla=False, total_heads=8, src_row_bytes=8 * 256, dst_row_bytes=2 * 256,
                           src_tp=2, dst_tp=4, dst_rank=3, senders=[1])
    assert writes == {1: (Segment(6 * 256, 0, 512),)}
    writes = kv_row_writes(mla=False, total_heads=8, src_row_bytes=8 * 256, dst_row_bytes=8 * 256,
                           src_tp=2, dst_tp=1, dst_rank=0, senders=[0, 1])
    assert writes == {0: (Segment(0, 0, 8 * 256),), 1: ()}


def test_mla_rows_are_written_by_the_first_sender_only() -> None:
    writes = kv_row_writes(mla=True, total_heads=0, src_row_bytes=1152, dst_row_bytes=1152,
                           src_tp=4, dst_tp=2, dst_rank=0, senders=[0, 1])
    assert writes == {0: (Segment(0, 0, 1152),), 1: ()}


def test_mha_heads_unknown_or_different() -> None:
    kwargs = dict(mla=False, src_row_bytes=1024, dst_row_bytes=512, src_tp=2, dst_tp=4,
                  dst_rank=0, senders=[0])
    assert reason_of(kv_row_writes, total_heads=0, **kwargs) is Reason.TOPOLOGY_KV_HEADS_MISMATCH
    kwargs["dst_row_bytes"] = 600  # 2 heads of 300 bytes against heads of 256
    assert reason_of(kv_row_writes, total_heads=8, **kwargs) is Reason.TOPOLOGY_KV_HEADS_MISMATCH
