"""TP slicing arithmetic (pdproto.negotiation.shards): every destination byte written once, from the right byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.errors import Reason, TopologyError
from pdproto.negotiation.senders import target_tp_ranks
from pdproto.negotiation.shards import (
    Segment,
    SplitAxis,
    Whole,
    assign_writes,
    head_axis,
    local_bytes,
    local_width,
    shard,
)
from tests._tp_model import apply, local_item

def check_every_byte_once(axis: SplitAxis, src_tp: int, dst_tp: int) -> None:
    """Each decode rank, fed by its SGLang sender set, gets exactly its bytes, each once."""
    sources = {s: local_item(axis, src_tp, s) for s in range(src_tp)}
    for d in range(dst_tp):
        senders = target_tp_ranks(src_tp, dst_tp, d)
        writes = assign_writes(axis, src_tp=src_tp, dst_tp=dst_tp, dst_rank=d, senders=senders)
        want = local_item(axis, dst_tp, d)
        got, count = apply(writes, sources, want.size)
        assert (count == 1).all(), f"rank {d}: bytes written {set(count.tolist())} times"
        np.testing.assert_array_equal(got, want)


# A KDA conv state: window rows first, then the q, k and v channels (each H*hd before TP).
KDA_CONV = SplitAxis(groups=(32, 32, 32), element_bytes=2, outer=3)
# A KDA temporal state: heads first, each head hd*hd fp32.
KDA_TEMPORAL = SplitAxis(groups=(8,), element_bytes=4 * 4 * 4)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 4), (4, 2), (1, 4), (4, 1), (4, 4), (2, 8)])
@pytest.mark.parametrize("axis", [KDA_CONV, KDA_TEMPORAL], ids=["conv", "temporal"])
def test_kda_state_reaches_every_decode_rank_exactly(axis: SplitAxis, src_tp: int, dst_tp: int) -> None:
    check_every_byte_once(axis, src_tp, dst_tp)


def test_equal_tp_is_one_whole_segment_even_with_window_rows_and_groups() -> None:
    width = local_width(KDA_CONV, 2)
    writes = assign_writes(KDA_CONV, src_tp=2, dst_tp=2, dst_rank=1, senders=[1])
    assert writes == {1: (Segment(0, 0, 3 * width * 2),)}


def test_conv_fan_out_takes_one_block_per_window_row_and_group() -> None:
    # Prefill TP 2 -> decode TP 4: rank 1 holds a quarter of each of q, k, v (8 channels),
    # which are the second halves of prefill rank 0's groups of 16.
    writes = assign_writes(KDA_CONV, src_tp=2, dst_tp=4, dst_rank=1, senders=[0])
    segs = writes[0]
    assert len(segs) == 3 * 3
    assert segs[:3] == (Segment(16, 0, 16), Segment(48, 16, 16), Segment(80, 32, 16))
    assert segs[3] == Segment(96 + 16, 48, 16)  # second window row: src row is 48 channels


def test_conv_fan_in_places_each_writer_inside_each_group() -> None:
    # Prefill TP 4 -> decode TP 2: decode rank 0 hears from prefill ranks 0 and 1, 8 channels
    # of each group each; writer 1 lands at offset 8 inside every group of 16.
    writes = assign_writes(KDA_CONV, src_tp=4, dst_tp=2, dst_rank=0, senders=[0, 1])
    assert writes[1][:3] == (Segment(0, 16, 16), Segment(16, 48, 16), Segment(32, 80, 16))


def test_temporal_fan_in_is_one_block_per_writer() -> None:
    writes = assign_writes(KDA_TEMPORAL, src_tp=4, dst_tp=2, dst_rank=1, senders=[2, 3])
    head = 4 * 4 * 4
    assert writes == {2: (Segment(0, 0, 2 * head),), 3: (Segment(0, 2 * head, 2 * head),)}


def test_replicated_tensor_is_written_by_the_first_sender_only() -> None:
    writes = assign_writes(Whole(100), src_tp=4, dst_tp=2, dst_rank=0, senders=[0, 1])
    assert writes == {0: (Segment(0, 0, 100),), 1: ()}


def test_gqa_replicas_are_written_once() -> None:
    # 2 KV heads over prefill TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1.
    axis = head_axis(2, 128, 4)
    assert axis.element_bytes == 128
    writes = assign_writes(axis, src_tp=4, dst_tp=2, dst_rank=1, senders=[2, 3])
    assert writes == {2: (Segment(0, 0, 128),), 3: ()}
    check_every_byte_once(axis, 4, 2)
    check_every_byte_once(axis, 1, 8)


def test_senders_that_miss_bytes_are_a_rejection() -> None:
    with pytest.raises(TopologyError) as info:
        assign_writes(KDA_TEMPORAL, src_tp=4, dst_tp=2, dst_rank=0, senders=[0],
                      reason=Reason.TOPOLOGY_STATE_SLICE_MISMATCH)
    assert info.value.reason is Reason.TOPOLOGY_STATE_SLICE_MISMATCH
    assert info.value.metadata["missing"] == "2"


def test_uneven_split_is_tp_not_divisible() -> None:
    with pytest.raises(TopologyError) as info:
        shard(6, 4, 0)
    assert info.value.reason is Reason.TOPOLOGY_TP_NOT_DIVISIBLE
    with pytest.raises(TopologyError) as info:
        head_axis(8, 102, 2)  # 4 heads per rank do not divide a 102-byte row
    assert info.value.reason is Reason.TOPOLOGY_KV_HEADS_MISMATCH


@st.composite
def layouts(draw: st.DrawFn) -> tuple[SplitAxis, int, int]:
    """A split axis and two TP sizes that can split every group (one dividing the other)."""
    tps = [1, 2, 4, 8]
    src_tp, dst_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    big = max(src_tp, dst_tp)
    if draw(st.booleans()):
        groups = tuple(big * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
    else:  # GQA-like: fewer elements than ranks on one side
        groups = (draw(st.sampled_from([w for w in tps if w <= big])),)
    return (SplitAxis(groups=groups, element_bytes=draw(st.integers(1, 5)),
                      outer=draw(st.integers(1, 4))), src_tp, dst_tp)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_destination_byte_is_written_once_from_the_right_source_byte(
        case: tuple[SplitAxis, int, int]) -> None:
    axis, src_tp, dst_tp = case
    check_every_byte_once(axis, src_tp, dst_tp)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.permutations(range(8)))
def test_any_sender_order_still_writes_every_byte_once(case: tuple[SplitAxis, int, int],
                                                       order: list[int]) -> None:
    axis, src_tp, dst_tp = case
    sources = {s: local_item(axis, src_tp, s) for s in range(src_tp)}
    senders = [s for s in order if s < src_tp]  # every prefill rank, in any order
    writes = assign_writes(axis, src_tp=src_tp, dst_tp=dst_tp, dst_rank=0, senders=senders)
    want = local_item(axis, dst_tp, 0)
    got, count = apply(writes, sources, want.size)
    assert (count == 1).all()
    np.testing.assert_array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_local_bytes_is_the_same_projection_as_the_model(case: tuple[SplitAxis, int, int]) -> None:
    axis, src_tp, _ = case
    for r in range(src_tp):
        np.testing.assert_array_equal(local_bytes(axis, src_tp, r), local_item(axis, src_tp, r))
    np.testing.assert_array_equal(local_bytes(Whole(7), 4, 3), np.arange(7))
