"""Which prefill ranks feed a decode rank, and what each sends (pdproto.negotiation.senders)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.errors import Reason, TopologyError
from pdproto.negotiation.senders import (
    Sender,
    SenderSet,
    prefill_rank_id,
    sender_set,
    target_pp_ranks,
    target_tp_ranks,
)


def roles(s: SenderSet) -> list[tuple[int, str]]:
    """(tp rank, role letters: k=KV, s=state, a=aux, '-' dummy) per sender."""
    return [(x.tp_rank, "".join(c for c, on in (("k", x.sends_kv), ("s", x.sends_state),
                                              ("a", x.sends_aux)) if on) or "-")
            for x in s.senders]


def test_equal_tp_pairs_rank_with_rank() -> None:
    s = sender_set(prefill_tp=4, prefill_pp=1, prefill_cp=1, decode_tp=4, decode_tp_rank=2,
                   decode_pp=1, decode_pp_rank=0, kv_writers={2}, state_writers={2}, has_aux=True)
    assert roles(s) == [(2, "ksa")]
    assert s.required_responses == 1 and s.decode_ranks_per_prefill_rank == 1


def test_fan_out_one_prefill_rank_serves_k_decode_ranks() -> None:
    # SGLang: prefill TP1 -> decode TP2, required_dst_info_num = 2 (state-layout reference).
    s = sender_set(prefill_tp=1, prefill_pp=1, prefill_cp=1, decode_tp=2, decode_tp_rank=1,
                   decode_pp=1, decode_pp_rank=0, kv_writers={0}, state_writers={0}, has_aux=True)
    assert roles(s) == [(0, "ksa")]
    assert s.decode_ranks_per_prefill_rank == 2


def test_hybrid_mla_fan_in_one_rank_sends_kv_the_other_only_state() -> None:
    # SGLang: prefill TP2 -> decode TP1 needs both ranks; replicated MLA KV from sub-rank 0.
    s = sender_set(prefill_tp=2, prefill_pp=1, prefill_cp=1, decode_tp=1, decode_tp_rank=0,
                   decode_pp=1, decode_pp_rank=0, kv_writers={0}, state_writers={0, 1},
                   has_aux=True)
    assert roles(s) == [(0, "ksa"), (1, "s")]
    assert s.required_responses == 2


def test_pure_mla_fan_in_leaves_dummies() -> None:
    s = sender_set(prefill_tp=4, prefill_pp=1, prefill_cp=1, decode_tp=2, decode_tp_rank=1,
                   decode_pp=1, decode_pp_rank=0, kv_writers={2}, state_writers=set(),
                   has_aux=True)
    assert roles(s) == [(2, "ka"), (3, "-")]
    assert s.senders[1].dummy and s.required_responses == 1


def test_pp_stages_each_send_their_layers_and_the_last_sends_aux() -> None:
    s = sender_set(prefill_tp=2, prefill_pp=2, prefill_cp=1, decode_tp=2, decode_tp_rank=1,
                   decode_pp=1, decode_pp_rank=0, kv_writers={1}, state_writers={1}, has_aux=True)
    assert [(x.tp_rank, x.pp_rank, x.prefill_rank) for x in s.senders] == [(1, 0, 2), (1, 1, 3)]
    assert [x.sends_aux for x in s.senders] == [False, True]
    assert s.required_responses == 2


def test_equal_pp_pairs_stage_with_stage() -> None:
    assert target_pp_ranks(4, 4, 2) == (2,)
    assert target_pp_ranks(4, 1, 0) == (0, 1, 2, 3)
    with pytest.raises(TopologyError) as info:
        target_pp_ranks(4, 2, 0)
    assert info.value.reason is Reason.TOPOLOGY_PP_MISMATCH


def test_sizes_that_do_not_divide_are_rejected() -> None:
    with pytest.raises(TopologyError) as info:
        target_tp_ranks(4, 6, 0)
    assert info.value.reason is Reason.TOPOLOGY_TP_NOT_DIVISIBLE


def test_prefill_rank_numbers_follow_sglang() -> None:
    # attn_tp_rank*(pp*cp) + pp_rank*cp + cp_rank (common/conn.py:1024-1030)
    assert prefill_rank_id(tp_rank=3, pp_rank=1, cp_rank=1, pp_size=2, cp_size=2) == 15


def test_proto_round_trip_and_self_index() -> None:
    s = sender_set(prefill_tp=4, prefill_pp=1, prefill_cp=1, decode_tp=2, decode_tp_rank=0,
                   decode_pp=1, decode_pp_rank=0, kv_writers={0}, state_writers={0, 1},
                   has_aux=True)
    me = s.find(tp_rank=1, pp_rank=0)
    assert me is not None
    msg = s.to_proto(me)
    assert msg.self_index == 1 and msg.required_responses == 2
    assert msg.senders[0].sends_kv and not msg.senders[1].dummy
    assert SenderSet.from_proto(msg) == s
    assert s.find(tp_rank=3, pp_rank=0) is None


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_prefill_rank_serves_its_share_of_decode_ranks(prefill_tp: int, decode_tp: int) -> None:
    served: dict[int, int] = {}
    for d in range(decode_tp):
        tps = target_tp_ranks(prefill_tp, decode_tp, d)
        assert len(tps) == max(1, prefill_tp // decode_tp)
        for t in tps:
            served[t] = served.get(t, 0) + 1
    assert sorted(served) == list(range(prefill_tp))
    assert set(served.values()) == {max(1, decode_tp // prefill_tp)}


def test_a_sender_that_writes_nothing_is_a_dummy() -> None:
    assert Sender(0, 0, 0, 0, False, False, False).dummy
    assert not Sender(0, 0, 0, 0, False, True, False).dummy


def test_cp_ranks_that_split_pages_all_send_kv_and_rank_0_alone_state_and_aux() -> None:
    # SGLang enable_all_cp_ranks_for_transfer: the decode asks every CP rank and waits for each
    # (required_prefill_response_num *= cp_size, common/conn.py:1500-1515).
    s = sender_set(prefill_tp=2, prefill_pp=1, prefill_cp=2, decode_tp=2, decode_tp_rank=1,
                   decode_pp=1, decode_pp_rank=0, kv_writers={1}, state_writers={1}, has_aux=True,
                   cp_split=True)
    assert [(x.cp_rank, x.prefill_rank) for x in s.senders] == [(0, 2), (1, 3)]
    assert roles(s) == [(1, "ksa"), (1, "k")]
    assert s.required_responses == 2
    replicas = sender_set(prefill_tp=2, prefill_pp=1, prefill_cp=2, decode_tp=2, decode_tp_rank=1,
                          decode_pp=1, decode_pp_rank=0, kv_writers={1}, state_writers={1}, has_aux=True)
    assert [(x.cp_rank, x.prefill_rank) for x in replicas.senders] == [(0, 2)]


def test_kv_shard_tp_ranks_all_send_kv_to_every_decode_rank() -> None:
    # MLA KV sharded across prefill attn-TP with CP 1: every decode rank pulls from every prefill TP
    # rank, each of which serves every decode rank (SGLang _resolve_rank_mapping, common/conn.py:1437-1451).
    s = sender_set(prefill_tp=2, prefill_pp=1, prefill_cp=1, decode_tp=2, decode_tp_rank=1,
                   decode_pp=1, decode_pp_rank=0, kv_writers={1}, state_writers={1}, has_aux=True,
                   tp_shards=True)
    assert [(x.tp_rank, x.sends_kv, x.sends_state, x.sends_aux) for x in s.senders] == [
        (0, True, False, False), (1, True, True, True)]
    assert s.required_responses == 2 and s.decode_ranks_per_prefill_rank == 2
