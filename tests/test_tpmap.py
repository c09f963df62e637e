"""One prefill rank's plan for one decode rank: senders, aux, state, row slices (pdproto.negotiation.tpmap)."""

from __future__ import annotations

import pytest

from pdproto.errors import Reason, TopologyError
from pdproto.negotiation.shards import Segment
from pdproto.negotiation.tpmap import PACKED_FAN_IN, SPLIT_KV, TpPlan, fan_in_packable, plan_tp
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2
from tests._tp_model import KimiShape

KIMI = KimiShape()
MLA_ROW = 1152


def prefill(tp: int, rank: int, *, kind: int = common_pb2.ATTENTION_KIND_HYBRID_MLA,
            heads: int = 0, state: bool = True) -> server_info_pb2.PrefillServerInfo:
    info = server_info_pb2.PrefillServerInfo(page_size=16, attention_kind=kind,  # type: ignore[arg-type]
                                             total_kv_heads=heads)
    info.attn_tp.size, info.attn_tp.rank = tp, rank
    info.aux_entries.add(item_len=64)
    if state:
        info.state_entries.append(KIMI.entry_info(tp))
    return info


def decode(tp: int, rank: int, *, state: bool = True) -> registration_pb2.KvRegistration:
    reg = registration_pb2.KvRegistration(aux_ptrs=[0x1000], aux_item_lens=[64], aux_data_lens=[64 * 8])
    reg.attn_tp.size, reg.attn_tp.rank = tp, rank
    if state:
        reg.state_buffers.append(KIMI.state_buffer(tp))
    return reg


def test_hybrid_mla_fan_in_kv_and_aux_from_one_rank_state_from_both() -> None:
    first = plan_tp(prefill(4, 2), decode(2, 1), kv_rows=[(MLA_ROW, MLA_ROW)])
    second = plan_tp(prefill(4, 3), decode(2, 1), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert first.senders == second.senders
    assert first.senders.required_responses == 2
    assert (first.me.sends_kv, first.me.sends_aux, first.me.sends_state) == (True, True, True)
    assert (second.me.sends_kv, second.me.sends_aux, second.me.sends_state) == (False, False, True)
    assert first.row_slices == (None,) and second.row_slices == (Segment(0, 0, 0),)
    assert len(first.aux) == 1 and second.aux == ()
    assert all(t.segments for t in second.state[0].tensors)


def test_mla_fan_in_senders_write_the_kv_pairings_in_turn_for_a_decode_that_asks() -> None:
    """Prefill TP 4 -> decode TP 2 rank 1 (senders 2 and 3), three MLA pairings: with ``SPLIT_KV`` rank 2 writes
    pairings 0 and 2, rank 3 pairing 1, and both answer the same sender set; a decode that did not ask for it (an
    older one, or SGLang's own frames, which mark rank 3 a dummy) gets every pairing from rank 2."""
    rows = [(MLA_ROW, MLA_ROW)] * 3
    reg = decode(2, 1, state=False)
    reg.capabilities.append(SPLIT_KV)
    first, second = (plan_tp(prefill(4, r, kind=common_pb2.ATTENTION_KIND_MLA, state=False), reg, kv_rows=rows)
                     for r in (2, 3))
    nothing = Segment(0, 0, 0)
    assert first.row_slices == (None, nothing, None) and second.row_slices == (nothing, None, nothing)
    assert first.senders == second.senders and first.senders.required_responses == 2
    assert (first.me.sends_kv, first.me.sends_aux, second.me.sends_kv, second.me.sends_aux) == (True, True, True, False)
    older = [plan_tp(prefill(4, r, kind=common_pb2.ATTENTION_KIND_MLA, state=False), decode(2, 1, state=False),
                     kv_rows=rows) for r in (2, 3)]
    assert [p.row_slices for p in older] == [(None, None, None), (nothing, nothing, nothing)]
    assert older[1].me.dummy and older[0].senders.required_responses == 1
    # One MLA pairing (the Kimi-shaped hybrid's stage) between two senders: the second writes state only.
    reg = decode(2, 1)
    reg.capabilities.append(SPLIT_KV)
    hybrid = [plan_tp(prefill(4, r), reg, kv_rows=[(MLA_ROW, MLA_ROW)]) for r in (2, 3)]
    assert [p.row_slices for p in hybrid] == [(None,), (nothing,)]
    assert not hybrid[1].me.sends_kv and hybrid[1].me.sends_state


def test_a_prefill_rank_outside_the_decode_ranks_senders_is_rejected() -> None:
    with pytest.raises(TopologyError) as caught:
        plan_tp(prefill(4, 0), decode(2, 1), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert caught.value.reason is Reason.TOPOLOGY_NOT_A_SENDER
    assert caught.value.metadata["senderTpRanks"] == "2,3"


def test_mha_fan_out_writes_the_decode_ranks_heads() -> None:
    # 8 KV heads of 256 bytes: prefill TP 2 rows hold 4 heads, decode TP 4 rows hold 2.
    plan = plan_tp(prefill(2, 1, kind=common_pb2.ATTENTION_KIND_MHA, heads=8, state=False),
                   decode(4, 3, state=False), kv_rows=[(1024, 512), (1024, 512)])
    assert plan.row_slices == (Segment(512, 0, 512), Segment(512, 0, 512))
    assert plan.senders.decode_ranks_per_prefill_rank == 2


def test_mha_fan_in_every_rank_writes_its_heads() -> None:
    plans = [plan_tp(prefill(4, r, kind=common_pb2.ATTENTION_KIND_MHA, heads=8, state=False),
                     decode(2, 0, state=False), kv_rows=[(512, 1024)]) for r in (0, 1)]
    assert [p.row_slices for p in plans] == [(Segment(0, 0, 512),), (Segment(0, 512, 512),)]
    assert all(p.me.sends_kv for p in plans) and plans[0].senders.required_responses == 2


def test_mha_fan_in_goes_packed_only_for_a_decode_that_asks() -> None:
    def plans(*capabilities: str) -> list[TpPlan]:
        reg = decode(2, 0, state=False)
        reg.capabilities.extend(capabilities)
        return [plan_tp(prefill(4, r, kind=common_pb2.ATTENTION_KIND_MHA, heads=8, state=False), reg,
                        kv_rows=[(512, 1024), (512, 1024)]) for r in (0, 1)]

    assert [p.packed_fan_in for p in plans(PACKED_FAN_IN)] == [(True, True), (True, True)]
    assert [p.packed_fan_in for p in plans()] == [(False, False), (False, False)]
    result = server_info_pb2.NegotiationResult()
    result.entries.add()
    result.entries.add()
    plans(PACKED_FAN_IN)[1].fill(result)
    assert [(e.packed_fan_in, e.row_slice.dst_offset) for e in result.entries] == [(True, 512), (True, 512)]


def test_only_equal_aligned_parts_of_a_row_go_packed() -> None:
    assert fan_in_packable(Segment(0, 512, 512), 1024)
    assert not fan_in_packable(None, 1024)  # whole rows: nothing to pack
    assert not fan_in_packable(Segment(0, 0, 0), 1024)  # another rank writes the row
    assert not fan_in_packable(Segment(0, 0, 1024), 1024)  # the whole row
    assert not fan_in_packable(Segment(0, 0, 384), 1024)  # the row is not a whole number of them
    assert not fan_in_packable(Segment(0, 256, 512), 1024)  # not at a multiple of its width


def test_decode_heads_must_match_the_prefills() -> None:
    reg = decode(4, 0, state=False)
    reg.total_kv_heads = 16
    with pytest.raises(TopologyError) as caught:
        plan_tp(prefill(2, 0, kind=common_pb2.ATTENTION_KIND_MHA, heads=8, state=False), reg,
                kv_rows=[(1024, 512)])
    assert caught.value.reason is Reason.TOPOLOGY_KV_HEADS_MISMATCH


def test_state_tp_other_than_attention_tp_is_rejected() -> None:
    info = prefill(4, 0)
    info.state_tp.size = 2
    with pytest.raises(TopologyError) as caught:
        plan_tp(info, decode(4, 0), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert caught.value.reason is Reason.TOPOLOGY_STATE_SLICE_MISMATCH


def test_the_plan_fills_the_negotiation_result() -> None:
    plan = plan_tp(prefill(4, 3), decode(2, 1), kv_rows=[(MLA_ROW, MLA_ROW)])
    result = server_info_pb2.NegotiationResult(entries=[server_info_pb2.EntryPairing()])
    plan.fill(result)
    assert result.senders.self_index == 1 and result.senders.required_responses == 2
    assert result.entries[0].HasField("row_slice") and result.entries[0].row_slice.length == 0
    assert not result.aux and len(result.state) == 1


def test_cp_ranks_that_split_pages_each_write_kv_and_rank_0_alone_state_and_aux() -> None:
    def cp_rank(rank: int, *, split: bool = True) -> server_info_pb2.PrefillServerInfo:
        info = prefill(1, 0)
        info.attn_cp.size, info.attn_cp.rank = 2, rank
        info.cp_ranks_split_pages = split
        return info

    first = plan_tp(cp_rank(0), decode(1, 0), kv_rows=[(MLA_ROW, MLA_ROW)])
    second = plan_tp(cp_rank(1), decode(1, 0), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert first.senders == second.senders and first.senders.required_responses == 2
    def roles(plan: TpPlan) -> tuple[int, bool, bool, bool]:
        return plan.me.cp_rank, plan.me.sends_kv, plan.me.sends_state, plan.me.sends_aux

    assert roles(first) == (0, True, True, True) and roles(second) == (1, True, False, False)
    assert first.row_slices == second.row_slices == (None,)
    assert len(first.aux) == 1 and second.aux == ()
    assert first.state[0].writes and not any(p.writes for p in second.state)
    assert len(second.state) == len(first.state)
    # CP ranks holding copies of everything: rank 0 sends, the others are not senders.
    with pytest.raises(TopologyError) as caught:
        plan_tp(cp_rank(1, split=False), decode(1, 0), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert caught.value.reason is Reason.TOPOLOGY_NOT_A_SENDER


def test_kv_shard_tp_ranks_of_an_mla_prefill_each_write_kv_to_every_decode_rank() -> None:
    def shard(rank: int, tp: int = 2) -> server_info_pb2.PrefillServerInfo:
        info = prefill(tp, rank)
        info.enable_kv_cache_sharding = True
        return info

    for d in (0, 1):
        plans = [plan_tp(shard(r), decode(2, d), kv_rows=[(MLA_ROW, MLA_ROW)]) for r in (0, 1)]
        assert plans[0].senders == plans[1].senders and plans[0].senders.required_responses == 2
        assert plans[0].senders.decode_ranks_per_prefill_rank == 2
        # Every rank whole rows of its pages; aux and state from the rank the TP mapping names.
        assert [(p.me.tp_rank, p.me.sends_kv, p.me.sends_aux) for p in plans] == [(0, True, d == 0), (1, True, d == 1)]
        assert plans[0].row_slices == plans[1].row_slices == (None,)
    # A fan-in of sharded ranks: each writes whole rows of its own pages, so SPLIT_KV has nothing to hand out.
    reg = decode(2, 0)
    reg.capabilities.append(SPLIT_KV)
    assert all(plan_tp(shard(r, 4), reg, kv_rows=[(MLA_ROW, MLA_ROW)] * 2).row_slices == (None, None) for r in range(4))
    # Without sharding decode rank 1 hears from prefill rank 1 only.
    with pytest.raises(TopologyError) as caught:
        plan_tp(prefill(2, 0), decode(2, 1), kv_rows=[(MLA_ROW, MLA_ROW)])
    assert caught.value.reason is Reason.TOPOLOGY_NOT_A_SENDER
