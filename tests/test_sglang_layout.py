"""SGLang's KVArgs as the pdproto backend reads them: both sides' translations agree under negotiation.

The KVArgs here carry the values SGLang 0.5.23's own pools produce (docs/sglang-notes.md
section 4, dumped from ``MLATokenToKVPool`` and ``HybridLinearKVPool`` over a Kimi
``MambaPool``); the end-to-end runs with SGLang's real pools are tests/sglang/test_harness.py.
Pure: no SGLang, no network.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdproto import v1
from pdproto.dcp.layers import EntryRole
from pdproto.errors import ConfigError, InvalidFieldError, Reason, TopologyError
from pdproto.integrations.sglang import layout, legacy_decode
from pdproto.integrations.sglang.settings import BackendSettings
from pdproto.negotiation.registration import make_registration
from pdproto.negotiation.slots import state_copies
from pdproto.negotiation.topology import Decision, Mode, Rejection, negotiate

PAGE = 64
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 512, 64]  # MetadataBuffers.get_buf_infos item lengths


def kv_args(*, layers: int = 4, layer_ids: list[int] | None = None, draft: int = 0, draft_item: int = 0,
            start: int = 0, state: list[dict[str, Any]] | None = None, hybrid: bool = False,
            base: int = 0x10_0000, token_bytes: int = 1152) -> SimpleNamespace:
    """A KVArgs as prefill.py/decode.py fill it, with made-up addresses."""
    items = [PAGE * token_bytes] * layers + [draft_item] * draft
    state = state or []
    return SimpleNamespace(
        kv_data_ptrs=[base + i * 0x100_0000 for i in range(len(items))],
        kv_data_lens=[it * 97 for it in items], kv_item_lens=items, kv_layer_ids=layer_ids or [],
        num_draft_entries=draft, prefill_start_layer=start, page_size=PAGE, kv_cache_dtype_str="bfloat16",
        kv_layout=None, aux_data_ptrs=[base + 0x8000_0000 + i * 0x1_0000 for i in range(len(AUX))],
        aux_data_lens=[n * 16 for n in AUX], aux_item_lens=AUX, gpu_id=0, is_hybrid_mla_backend=hybrid,
        state_types=[s["type"] for s in state], state_data_ptrs=[s["ptrs"] for s in state],
        state_data_lens=[[n * 5 for n in s["items"]] for s in state], state_item_lens=[s["items"] for s in state],
        state_dim_per_tensor=[s["dims"] for s in state], state_slice_outer_counts=[s["outer"] for s in state],
        state_conv_shard_groups=[s["groups"] for s in state], state_layer_ids=[s["layers"] for s in state])


def kimi_state(tp: int) -> dict[str, Any]:
    """Kimi Linear's one Mamba component: 6 conv tensors (bf16 [3, 3*64/tp]) then 6 temporal
    tensors (fp32 [4/tp, 16, 16]), for KDA layers 0-2 and 4-6."""
    kda = [0, 1, 2, 4, 5, 6]
    return {"type": "mamba", "ptrs": [0x9000_0000 + i * 0x1_0000 for i in range(12)],
            "items": [1152 // tp] * 6 + [4096 // tp] * 6, "dims": [192 // tp] * 6 + [4 // tp] * 6,
            "outer": [3] * 6 + [1] * 6, "groups": [[64, 64, 64]] * 6 + [None] * 6, "layers": kda + kda}


def _pair(prefill: SimpleNamespace, p_ranks: layout.Ranks, decode: SimpleNamespace, d_ranks: layout.Ranks, *,
          mla: bool = True) -> Decision | Rejection:
    """Both sides' translations, negotiated as the prefill's service does."""
    info = layout.server_info(prefill, p_ranks, is_mla_backend=mla, host="10.0.0.1", port=50051,
                              backend=v1.BACKEND_MOONCAKE)
    dec = layout.decode_layout(decode, d_ranks, is_mla_backend=mla, notify_host="10.0.0.2", notify_port=7000)
    regions = layout.regions(decode, on_device=True)
    reg = make_registration(dec, v1.MooncakeEndpoint(session_id="10.0.0.2:15000"), list(regions.kv),
                            aux=list(regions.aux), state=[list(e) for e in regions.state])
    return negotiate(info, reg)


def test_dense_mla_prefill_and_a_dcp4_decode_rank_agree() -> None:
    for rank in range(4):
        decision = _pair(kv_args(), layout.Ranks(attn_tp=(1, 0)), kv_args(),
                         layout.Ranks(attn_tp=(4, rank), dcp=(4, rank)))
        assert isinstance(decision, Decision), decision
        assert decision.mode is Mode.DENSE_TO_DCP
        assert [(p.src_entry, p.dst_entry, p.src_token_bytes) for p in decision.pairings] == [
            (i, i, 1152) for i in range(4)]
        assert decision.tp is not None and decision.tp.senders.decode_ranks_per_prefill_rank == 4


def test_a_plain_pool_numbers_its_layers_from_its_stage_so_pp_stages_pair() -> None:
    # Prefill stage 1 of 2 holds layers 2 and 3; a one-stage decode holds all four.
    stage = kv_args(layers=2, start=2)
    info = layout.server_info(stage, layout.Ranks(attn_tp=(1, 0), pp=(2, 1)), is_mla_backend=True,
                              host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    assert [e.layer_id for e in info.kv_entries] == [2, 3]
    decision = _pair(stage, layout.Ranks(attn_tp=(1, 0), pp=(2, 1)), kv_args(), layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(decision, Decision), decision
    assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(0, 2), (1, 3)]


def test_a_pp2_decode_stage_sends_no_layer_ids_and_pairs_its_prefill_stage_by_position() -> None:
    # Stage 1 of 2 on both sides, with a draft entry: SGLang gives the decode stage no ids.
    stage, ranks = kv_args(layers=2, start=2, draft=1, draft_item=PAGE * 1152), layout.Ranks(attn_tp=(1, 0), pp=(2, 1))
    dec = layout.decode_layout(stage, ranks, is_mla_backend=True, notify_host="h", notify_port=1)
    assert [e.layer_id for e in dec.kv] == [None] * 3
    decision = _pair(stage, ranks, stage, ranks)
    assert isinstance(decision, Decision), decision
    assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(0, 0), (1, 1), (2, 2)]
    # Stage 0 of the prefill does not feed decode stage 1.
    refused = _pair(kv_args(layers=2), layout.Ranks(attn_tp=(1, 0), pp=(2, 0)), stage, ranks)
    assert isinstance(refused, Rejection) and refused.reason is Reason.TOPOLOGY_NOT_A_SENDER, refused


def test_draft_entries_keep_virtual_pages_on_a_dcp_decode() -> None:
    # The draft pool is never DCP-sharded: its decode page holds PAGE * dcp rows.
    prefill = kv_args(draft=1, draft_item=PAGE * 1152)
    decode = kv_args(draft=1, draft_item=PAGE * 2 * 1152)
    dec = layout.decode_layout(decode, layout.Ranks(attn_tp=(2, 1), dcp=(2, 1)), is_mla_backend=True,
                               notify_host="h", notify_port=1)
    assert [(e.token_bytes, e.layer_id) for e in dec.kv] == [(1152, i) for i in range(5)]
    decision = _pair(prefill, layout.Ranks(attn_tp=(1, 0)), decode, layout.Ranks(attn_tp=(2, 1), dcp=(2, 1)))
    assert isinstance(decision, Decision), decision
    assert decision.pairings[-1].dst_token_bytes == 1152


def test_kimi_linear_prefill_tp1_and_decode_tp2_dcp2_agree_on_kv_state_and_aux() -> None:
    prefill = kv_args(layers=2, layer_ids=[3, 7], state=[kimi_state(1)], hybrid=True)
    info = layout.server_info(prefill, layout.Ranks(attn_tp=(1, 0), state_tp_size=1), is_mla_backend=False,
                              host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    assert info.attention_kind == v1.ATTENTION_KIND_HYBRID_MLA
    (entry,) = info.state_entries
    assert (entry.kind, entry.type_name, len(entry.tensors)) == (v1.STATE_KIND_RECURRENT, "mamba", 12)
    conv, temporal = entry.tensors[0], entry.tensors[6]
    assert (conv.item_len, conv.dim, conv.outer_count, list(conv.shard_groups)) == (1152, 192, 3, [64, 64, 64])
    assert (temporal.item_len, temporal.dim, temporal.outer_count, temporal.layer_id) == (4096, 4, 1, 0)
    for rank in range(2):
        decode = kv_args(layers=2, layer_ids=[3, 7], state=[kimi_state(2)], hybrid=True)
        decision = _pair(prefill, layout.Ranks(attn_tp=(1, 0), state_tp_size=1), decode,
                         layout.Ranks(attn_tp=(2, rank), dcp=(2, rank), state_tp_size=2), mla=False)
        assert isinstance(decision, Decision), decision
        assert decision.mode is Mode.DENSE_TO_DCP
        tp = decision.tp
        assert tp is not None and len(tp.aux) == len(AUX)
        (state,) = tp.state
        # Each of the 12 tensors moves this rank's share of a slot: half of it.
        assert [sum(s.length for s in t.segments) for t in state.tensors] == [576] * 6 + [2048] * 6


def component(name: str, items: list[int], base: int, layers: list[int] | None = None) -> dict[str, Any]:
    """One state component as setup_state_kv_args appends it for a paged or per-request kind: no dims,
    outer counts or groups; made-up addresses from ``base``."""
    return {"type": SimpleNamespace(value=name), "ptrs": [base + i * 0x10_0000 for i in range(len(items))],
            "items": items, "dims": [], "outer": [], "groups": [], "layers": layers or []}


def dsa_state(*, pages: int = 9, name: str = "dsa") -> dict[str, Any]:
    """DSATokenToKVPool's one DSA component as setup_state_kv_args appends it (utils.py:1702-1736):
    per layer the index-K buffer's pointer, length and bytes per page (index_key_cache.py:189-194),
    64 tokens * (128 fp8 + 4 scale bytes) = 8,448; no dims, outer counts, groups or layer ids."""
    return component(name, [8448] * 4, 0xA000_0000)


def test_dsa_index_pages_are_paged_and_replicated_so_one_mla_prefill_rank_writes_each_dcp_rank() -> None:
    info = layout.server_info(kv_args(state=[dsa_state()]), layout.Ranks(attn_tp=(2, 1)), is_mla_backend=True,
                              host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    (entry,) = info.state_entries
    assert (entry.kind, entry.type_name, entry.tp_policy) == (v1.STATE_KIND_PAGED, "dsa",
                                                              v1.STATE_TP_POLICY_REPLICATED)
    assert [(t.item_len, t.dim) for t in entry.tensors] == [(8448, 0)] * 4
    # Dense prefill -> decode TP 4 = DCP 4: each rank gets the whole page (a DCP decode's index buffer
    # covers every token: it is never sharded).
    for rank in range(4):
        decision = _pair(kv_args(state=[dsa_state()]), layout.Ranks(attn_tp=(1, 0)),
                         kv_args(state=[dsa_state(pages=36)]), layout.Ranks(attn_tp=(4, rank), dcp=(4, rank)))
        assert isinstance(decision, Decision) and decision.tp, decision
        (state,) = decision.tp.state
        assert state.kind == v1.STATE_KIND_PAGED
        assert [sum(s.length for s in t.segments) for t in state.tensors] == [8448] * 4
    # Prefill TP 4 -> decode TP 2 (MLA fan-in): of the two prefill ranks feeding a decode rank, one
    # writes every index page, the other none.
    for rank in range(2):
        written = {}
        for p_rank in range(4):
            decision = _pair(kv_args(state=[dsa_state()]), layout.Ranks(attn_tp=(4, p_rank)),
                             kv_args(state=[dsa_state()]), layout.Ranks(attn_tp=(2, rank)))
            if isinstance(decision, Rejection):
                assert decision.reason is Reason.TOPOLOGY_NOT_A_SENDER, decision
                continue
            assert decision.tp, decision
            (state,) = decision.tp.state
            written[p_rank] = [sum(s.length for s in t.segments) for t in state.tensors]
        assert sorted(written.values()) == [[0] * 4, [8448] * 4], written


def test_a_dsa_layer_that_shares_top_k_has_no_index_and_is_left_out_on_both_sides() -> None:
    shared = {**dsa_state(), "items": [8448, 8448, 0, 8448]}  # layer 2: a 0-row buffer
    args = kv_args(state=[shared])
    (entry,) = layout.server_info(args, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                                  backend=v1.BACKEND_MOONCAKE).state_entries
    assert [t.item_len for t in entry.tensors] == [8448] * 3
    (regions,) = layout.regions(args, on_device=True).state
    assert [r.ptr for r in regions] == [shared["ptrs"][i] for i in (0, 1, 3)]
    decision = _pair(args, layout.Ranks(attn_tp=(1, 0)), args, layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(decision, Decision) and decision.tp, decision
    assert [t.dst_tensor for t in decision.tp.state[0].tensors] == [0, 1, 2]


def test_a_dsa_entry_pairs_only_with_dsa() -> None:
    # qsa_compressed is paged too, but another layout: component i must be the same StateType.
    prefill = kv_args(state=[dsa_state()])
    decode = kv_args(state=[dsa_state(name="qsa_compressed")])
    rejection = _pair(prefill, layout.Ranks(attn_tp=(1, 0)), decode, layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(rejection, Rejection), rejection
    assert rejection.reason is Reason.TOPOLOGY_STATE_KIND_MISMATCH
    assert "'dsa'" in rejection.message and "'qsa_compressed'" in rejection.message
    assert rejection.metadata["typeName"] == "dsa" and rejection.metadata["decodeTypeName"] == "qsa_compressed"


def qsa_states() -> list[dict[str, Any]]:
    """QSATokenToKVPool's two QSA components (Qwen4-Exp; full layers 1 and 3) as setup_state_kv_args appends
    them after the Mamba one (utils.py:1640-1697): ``qsa_pending`` per layer a ring of 4 raw index keys of
    one 64-wide bf16 head (512 bytes per request row), then the shared RoPE ring (4 x 3 int64, layer id
    2**32 - 2); ``qsa_compressed`` per layer 16 compressed keys per KV page (2,048 bytes;
    qsa_kv_pool.py:275-312). One index head, not split by TP: the same on every rank; no dims."""
    return [component("qsa_pending", [512, 512, 96], 0xA000_0000, [1, 3, 2**32 - 2]),
            component("qsa_compressed", [2048, 2048], 0xB000_0000, [1, 3])]


def test_qsa_state_is_replicated_so_one_of_two_mha_prefill_ranks_writes_it() -> None:
    # Prefill TP 2 -> decode TP 1 (2 KV heads): both prefill ranks write their head of every KV row, but of
    # the QSA state, whole on both, only one writes it (SGLang's should_send_replicated_state, utils.py:872).
    decode = kv_args(layer_ids=[1, 3, 1, 3], token_bytes=256, state=qsa_states())  # K or V: 2 heads x 64 bf16
    decode.total_kv_head_num = 2
    written = {}
    for p_rank in range(2):
        prefill = kv_args(layer_ids=[1, 3, 1, 3], token_bytes=128, state=qsa_states())
        prefill.total_kv_head_num = 2
        decision = _pair(prefill, layout.Ranks(attn_tp=(2, p_rank)), decode, layout.Ranks(attn_tp=(1, 0)), mla=False)
        assert isinstance(decision, Decision) and decision.tp, decision
        pending, compressed = decision.tp.state
        assert (pending.kind, compressed.kind) == (v1.STATE_KIND_RECURRENT, v1.STATE_KIND_PAGED)
        written[p_rank] = [sum(s.length for s in t.segments) for e in (pending, compressed) for t in e.tensors]
    assert sorted(written.values()) == [[0] * 5, [512, 512, 96, 2048, 2048]], written


def qwen4_exp(*, tp: int, kv_heads_held: int) -> SimpleNamespace:
    """A Qwen4-Exp-shaped pool (MHA KV of 2 heads x 64 bf16 on layers 1 and 3, a GDN state split by ``tp``,
    QSA state whole) whose rank holds ``kv_heads_held`` KV heads."""
    args = kv_args(layer_ids=[1, 3, 1, 3], token_bytes=128 * kv_heads_held, state=[kimi_state(tp), *qsa_states()])
    args.total_kv_head_num = 2
    return args


def sharing_rank(cp_rank: int) -> layout.Ranks:
    """CP rank ``cp_rank`` of a CP-TP group sharing prefill (--tp-size 2 --attn-cp-size 2) as the manager
    presents it: attention TP 1 and CP 2 from SGLang, the GDN heads over the TP group (state TP 2)."""
    return layout.Ranks(attn_tp=(1, 0), attn_cp=(2, cp_rank), state_tp_size=2).cp_as_tp()


def written(decision: Decision | Rejection) -> tuple[list[int], list[int], int]:
    """(bytes of each KV row written, bytes of each state tensor's item written, aux pairings) of an accepted pair."""
    assert isinstance(decision, Decision) and decision.tp, decision
    rows = [p.dst_token_bytes if cut is None else cut.length for p, cut in zip(decision.pairings,
                                                                                decision.tp.row_slices, strict=True)]
    return rows, [sum(g.length for g in t.segments) for e in decision.tp.state for t in e.tensors], len(decision.tp.aux)


def test_a_cp_tp_sharing_prefill_rank_presents_itself_as_tp_rank_r_and_every_cp_rank_sends() -> None:
    # SGLang's CP-TP group sharing (Qwen4-Exp, --enable-prefill-cp --attn-cp-size 2 --tp-size 2): CP rank r
    # holds every KV head, the QSA state and GDN head shard r; SGLang's backends publish it as TP rank r of 2.
    infos = [layout.server_info(qwen4_exp(tp=2, kv_heads_held=2), sharing_rank(r), is_mla_backend=False,
                                host="h", port=1, backend=v1.BACKEND_MOONCAKE) for r in range(2)]
    for r, info in enumerate(infos):
        assert [(g.size, g.rank) for g in (info.attn_tp, info.attn_cp, info.state_tp)] == [(2, r), (1, 0), (2, r)]
    qsa = [512, 512, 96, 2048, 2048]
    # Decode TP 1 hears from both: each writes its half of every GDN tensor, rank 0 the KV, the QSA state and aux.
    fan_in = [written(_pair(qwen4_exp(tp=2, kv_heads_held=2), sharing_rank(r), qwen4_exp(tp=1, kv_heads_held=2),
                            layout.Ranks(attn_tp=(1, 0)), mla=False)) for r in range(2)]
    gdn = [576] * 6 + [2048] * 6
    assert fan_in == [([256] * 4, gdn + qsa, len(AUX)), ([0] * 4, gdn + [0] * 5, 0)], fan_in
    # Decode TP 2: rank d hears from prefill rank d only, which writes head d of its rows and all of the rest.
    for d in range(2):
        decode, d_ranks = qwen4_exp(tp=2, kv_heads_held=1), layout.Ranks(attn_tp=(2, d))
        assert written(_pair(qwen4_exp(tp=2, kv_heads_held=2), sharing_rank(d), decode, d_ranks, mla=False)) == (
            [128] * 4, gdn + qsa, len(AUX))
        other = _pair(qwen4_exp(tp=2, kv_heads_held=2), sharing_rank(1 - d), decode, d_ranks, mla=False)
        assert isinstance(other, Rejection) and other.reason is Reason.TOPOLOGY_NOT_A_SENDER, other


def test_without_cp_tp_sharing_a_cp_prefill_sends_from_cp_rank_0_only() -> None:
    # Plain prefill CP (MLA): rank (tp 0, cp 0) sends everything; cp rank 1 is a dummy, refused as a sender.
    for cp_rank, sends in ((0, True), (1, False)):
        decision = _pair(kv_args(), layout.Ranks(attn_tp=(1, 0), attn_cp=(2, cp_rank)), kv_args(),
                         layout.Ranks(attn_tp=(2, 1)))
        if sends:
            assert written(decision) == ([1152] * 4, [], len(AUX))
        else:
            assert isinstance(decision, Rejection) and decision.reason is Reason.TOPOLOGY_NOT_A_SENDER, decision


def test_a_cp_prefill_whose_ranks_split_the_pages_sends_kv_from_every_cp_rank_state_and_aux_from_rank_0() -> None:
    # Kimi Linear with --attn-cp-size 2 (SGLang enable_all_cp_ranks_for_transfer): each CP rank sends its
    # pages; the state and aux every CP rank holds whole come from CP rank 0 (decode TP 1, as SGLang's
    # decode asks every CP rank: common/conn.py:1500-1515).
    prefill = kv_args(layers=2, layer_ids=[3, 7], state=[kimi_state(1)], hybrid=True)
    decode = kv_args(layers=2, layer_ids=[3, 7], state=[kimi_state(1)], hybrid=True)
    for cp_rank in (0, 1):
        ranks = layout.Ranks(attn_tp=(1, 0), attn_cp=(2, cp_rank), state_tp_size=1, cp_split_pages=True)
        info = layout.server_info(prefill, ranks, is_mla_backend=False, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
        assert info.cp_ranks_split_pages
        decision = _pair(prefill, ranks, decode, layout.Ranks(attn_tp=(1, 0), state_tp_size=1), mla=False)
        rows, state, aux = written(decision)
        assert rows == [1152] * 2 and aux == (len(AUX) if cp_rank == 0 else 0)
        assert (sum(state) > 0) == (cp_rank == 0), state
    sharing = layout.Ranks(attn_tp=(1, 0), attn_cp=(2, 0), cp_split_pages=True).cp_as_tp()
    assert not layout.server_info(prefill, sharing, is_mla_backend=False, host="h", port=1,
                                  backend=v1.BACKEND_MOONCAKE).cp_ranks_split_pages


def layer_split_rank(cp_rank: int, tail: bool) -> tuple[SimpleNamespace, layout.Ranks]:
    """CP rank ``cp_rank`` of a GLM-5-shaped prefill with SGLang's DSA cache layer split over CP 2: 5 layers,
    rank 0 holding 0-2 (layer 1 shares top-k: no index), rank 1 3-4 and the MTP draft's (prefill.py:272-316);
    ``tail``: 4 layers (0-1, 2-3), no draft, and the ``dsa_tail`` whole on every rank."""
    start, n, draft = ((0, 2, 0), (2, 2, 0))[cp_rank] if tail else ((0, 3, 0), (3, 2, 1))[cp_rank]
    index = [8448, 0, 8448] if (cp_rank, tail) == (0, False) else [8448] * (n + draft)
    state = [component("dsa", index, 0xA000_0000)] + ([tail_state(4)] if tail else [])
    args = kv_args(layers=n, start=start, draft=draft, draft_item=PAGE * 1152, state=state)
    return args, layout.Ranks(attn_tp=(1, 0), attn_cp=(2, cp_rank), cp_layers=True)  # as the manager's _ranks


def test_dsa_pp_stages_fill_a_pp1_decodes_index_tensors_by_layer_each_once() -> None:
    # DeepSeek-V3.2 with --pp-size 2 (layers 0-2, 3-5) into a PP 1 decode: SGLang slices the decode's index
    # list by the stage's layers (get_mla_kv_ptrs_with_pp); a stage's dsa tensors carry its KV layers' ids.
    decode = kv_args(layers=6, state=[component("dsa", [8448] * 6, 0xB000_0000)])
    hits = []
    for r, start in enumerate((0, 3)):
        stage = kv_args(layers=3, start=start, state=[component("dsa", [8448] * 3, 0xA000_0000)])
        info = layout.server_info(stage, layout.Ranks(attn_tp=(1, 0), pp=(2, r)), is_mla_backend=True, host="h",
                                  port=1, backend=v1.BACKEND_MOONCAKE)
        assert [t.layer_id for t in info.state_entries[0].tensors] == [start, start + 1, start + 2]
        decision = _pair(stage, layout.Ranks(attn_tp=(1, 0), pp=(2, r)), decode, layout.Ranks(attn_tp=(1, 0)))
        assert isinstance(decision, Decision) and decision.tp, decision
        hits += [(t.dst_tensor, sum(g.length for g in t.segments)) for t in decision.tp.state[0].tensors]
    assert sorted(hits) == [(t, 8448) for t in range(6)]


def test_a_dsa_layer_split_cp_rank_sends_its_layers_kv_and_index_paired_by_layer_id() -> None:
    # The decode (CP 1) holds every layer and hears from both CP ranks (common/conn.py:1500-1511).
    decode = kv_args(layers=5, draft=1, draft_item=PAGE * 1152,
                     state=[component("dsa", [8448, 0, 8448, 8448, 8448, 8448], 0xB000_0000)])
    d_ranks = layout.Ranks(attn_tp=(1, 0))
    dec = layout.decode_layout(decode, d_ranks, is_mla_backend=True, notify_host="h", notify_port=1)
    assert [t.layer_id for t in dec.state[0].tensors] == [0, 2, 3, 4, 5]
    for cp_rank, kv_ids, index_ids, dst_index in ((0, [0, 1, 2], [0, 2], [0, 1]), (1, [3, 4, 5], [3, 4, 5], [2, 3, 4])):
        args, ranks = layer_split_rank(cp_rank, tail=False)
        info = layout.server_info(args, ranks, is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
        # SGLang skips the page filter under the split (_prepare_send_indices): every page of its layers.
        assert (info.enable_dsa_cache_layer_split, info.cp_ranks_split_pages) == (True, False)
        assert [e.layer_id for e in info.kv_entries] == kv_ids
        assert [t.layer_id for t in info.state_entries[0].tensors] == index_ids
        decision = _pair(args, ranks, decode, d_ranks)
        rows, state, aux = written(decision)
        assert isinstance(decision, Decision) and decision.tp, decision
        assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == list(enumerate(kv_ids))
        assert rows == [1152] * len(kv_ids) and state == [8448] * len(index_ids), (rows, state)
        assert [t.dst_tensor for t in decision.tp.state[0].tensors] == dst_index
        assert aux == (len(AUX) if cp_rank == 0 else 0)
        senders = decision.tp.senders
        assert [(s.cp_rank, s.sends_kv, s.sends_state, s.sends_aux) for s in senders.senders] == [
            (0, True, True, True), (1, True, True, False)] and senders.required_responses == 2
    # The dsa_tail every CP rank holds whole, with no layer ids: written by the last CP rank only.
    tail_decode = kv_args(state=[component("dsa", [8448] * 4, 0xB000_0000), tail_state(4)])
    tails = [written(_pair(*layer_split_rank(r, tail=True), tail_decode, d_ranks))[1] for r in (0, 1)]
    assert tails == [[8448] * 2 + [0] * 6, [8448] * 2 + [layout.TAIL_SLOT_BYTES] * 6], tails
    # A decode whose index tensors carry no layer ids cannot place a CP rank's: refused for that peer.
    args, ranks = layer_split_rank(1, tail=False)
    info = layout.server_info(args, ranks, is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    regions = layout.regions(decode, on_device=True)
    reg = make_registration(dec, v1.MooncakeEndpoint(session_id="h:1"), list(regions.kv), aux=list(regions.aux),
                            state=[list(e) for e in regions.state])
    del reg.state_buffers[0].layer_ids[:]
    refused = negotiate(info, reg)
    assert isinstance(refused, Rejection) and refused.reason is Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED, refused


def moved_at_equal_tp(states: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    """(kind, bytes written per tensor) of every state entry of an MHA pool, prefill TP 1 -> decode TP 1."""
    decision = _pair(kv_args(state=states), layout.Ranks(attn_tp=(1, 0)), kv_args(state=states),
                     layout.Ranks(attn_tp=(1, 0)), mla=False)
    assert isinstance(decision, Decision) and decision.tp, decision
    return [(e.kind, [sum(g.length for g in t.segments) for t in e.tensors]) for e in decision.tp.state]


def tp_refusal(prefill: list[dict[str, Any]], p_ranks: layout.Ranks, decode: list[dict[str, Any]],
               d_ranks: layout.Ranks) -> Rejection:
    """The registration's rejection, which must be TOPOLOGY_STATE_TP_REFUSED (MHA pools)."""
    rejection = _pair(kv_args(state=prefill), p_ranks, kv_args(state=decode), d_ranks, mla=False)
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_STATE_TP_REFUSED, rejection
    return rejection


def block_scale_states(tp: int) -> list[dict[str, Any]]:
    """SWAKVPool over MHATokenToKVPoolMXFP8 sub-pools (GPT-OSS, mxfp8 KV) as setup_state_kv_args appends its
    components (utils.py:1532-1556): ``swa`` (window layers' K then V pages: 64 tokens x 2/tp heads x 64 fp8),
    then the UE8M0 scales of the full layers (``block_scale``) and of the window layers (``block_scale_swa``):
    64 tokens x 2/tp heads x 64/32 per page (memory_pool.py:4192-4205); no dims."""
    return [component("swa", [8192 // tp] * 4, 0xA000_0000), component("block_scale", [256 // tp] * 4, 0xB000_0000),
            component("block_scale_swa", [256 // tp] * 4, 0xC000_0000)]


def test_mxfp8_block_scales_move_between_equal_tp_and_a_tp_mismatch_is_refused_naming_the_kind() -> None:
    assert moved_at_equal_tp(block_scale_states(1)) == [
        (v1.STATE_KIND_SLIDING_WINDOW, [8192] * 4), (v1.STATE_KIND_PAGED, [256] * 4),
        (v1.STATE_KIND_SLIDING_WINDOW, [256] * 4)]
    info = layout.server_info(kv_args(state=block_scale_states(1)), layout.Ranks(attn_tp=(1, 0)), host="h", port=1,
                              is_mla_backend=False, backend=v1.BACKEND_MOONCAKE)
    assert [(e.type_name, e.tp_policy) for e in info.state_entries][1:] == [
        ("block_scale", v1.STATE_TP_POLICY_REFUSED), ("block_scale_swa", v1.STATE_TP_POLICY_REFUSED)]
    # Prefill TP 1 -> decode TP 2 (as SGLang, common/conn.py:1391-1409): refused at registration, naming
    # the kind, ahead of the swa entry before it (whose pages of other sizes would be refused too).
    rejection = tp_refusal(block_scale_states(1), layout.Ranks(attn_tp=(1, 0)), block_scale_states(2),
                           layout.Ranks(attn_tp=(2, 0)))
    assert "(block_scale)" in rejection.message and rejection.metadata["typeName"] == "block_scale"
    # The SWA sub-pool's scales alone (decode TP 1 fed by prefill TP 2): refused the same way.
    rejection = tp_refusal(block_scale_states(2)[2:], layout.Ranks(attn_tp=(2, 1)), block_scale_states(1)[2:],
                           layout.Ranks(attn_tp=(1, 0)))
    assert rejection.metadata["typeName"] == "block_scale_swa"
    # An MHA prefill's CP ranks do not count as TP ranks (SGLang's exception is MLA's): TP 1 x CP 2 -> TP 2 refused.
    rejection = tp_refusal(block_scale_states(1), layout.Ranks(attn_tp=(1, 0), attn_cp=(2, 0)), block_scale_states(2),
                           layout.Ranks(attn_tp=(2, 0)))
    assert rejection.metadata["typeName"] == "block_scale"


def test_an_mha_window_moves_between_tp_sizes_sliced_by_head_as_sglang_slices_it() -> None:
    # GPT-OSS without mxfp8: SWAKVPool's swa pages (64 tokens x 8/tp KV heads x 64 bytes, K then V of 2 layers).
    # SGLang head-slices them between attention TP sizes like KV (_send_swa_state_slice); its KVArgs name
    # the rank's heads (kv_head_num), from which the window tensors take their split.
    def gpt_oss(tp: int) -> SimpleNamespace:
        args = kv_args(token_bytes=8 // tp * 64, state=[component("swa", [64 * 8 // tp * 64] * 4, 0xA000_0000)])
        args.kv_head_num, args.total_kv_head_num = 8 // tp, 8
        return args

    info = layout.server_info(gpt_oss(2), layout.Ranks(attn_tp=(2, 1)), is_mla_backend=False, host="h", port=1,
                              backend=v1.BACKEND_MOONCAKE)
    assert [(t.dim, t.outer_count) for t in info.state_entries[0].tensors] == [(4, 64)] * 4
    head = 64  # bytes of one head's row in one token
    for (p_tp, d_tp) in ((2, 1), (1, 2), (4, 2)):
        for d_rank in range(d_tp):
            writes: list[tuple[int, int, int]] = []  # (tensor, first decode byte of a token row, bytes), every sender
            for p_rank in range(p_tp):
                decision = _pair(gpt_oss(p_tp), layout.Ranks(attn_tp=(p_tp, p_rank)), gpt_oss(d_tp),
                                 layout.Ranks(attn_tp=(d_tp, d_rank)), mla=False)
                if isinstance(decision, Rejection):
                    assert decision.reason is Reason.TOPOLOGY_NOT_A_SENDER, decision
                    continue
                assert decision.tp is not None
                writes += [(t.dst_tensor, g.dst_offset, g.length) for e in decision.tp.state for t in e.tensors
                           for g in t.segments]
            # Every byte of every decode item written once: 64 token rows of 8 / d_tp heads each.
            row = 8 // d_tp * head
            for tensor in range(4):
                spans = sorted((o, n) for t, o, n in writes if t == tensor)
                covered = [b for o, n in spans for b in range(o, o + n)]
                assert sorted(covered) == list(range(64 * row)), (p_tp, d_tp, d_rank, tensor)
    # SGLang's own decode of TP 2 sends no split in its M1; its heads are the model's over its TP size.
    for d_rank in range(2):
        m1 = legacy_decode.registration(SimpleNamespace(**vars(gpt_oss(2)), engine_rank=d_rank), host="h", port=2,
                                        session_id="h:3", attn_tp_size=2, dcp=(1, 0))
        assert not any(b.dim_per_tensors for b in m1.state_buffers)
        info = layout.server_info(gpt_oss(1), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=False, host="h", port=1,
                                  backend=v1.BACKEND_MOONCAKE)
        decision = negotiate(info, m1)
        assert isinstance(decision, Decision) and decision.tp, decision
        for t in decision.tp.state[0].tensors:
            assert sorted(b for g in t.segments for b in range(g.dst_offset, g.dst_offset + g.length)) == list(
                range(64 * 4 * head)), d_rank


def minimax_states(tp: int) -> list[dict[str, Any]]:
    """MiniMaxSparseKVPool's components (MiniMax-M3 sparse; dense layers 0 and 2, sparse 1 and 3) as
    setup_state_kv_args appends them (utils.py:1518-1545): ``minimax_index_k`` per sparse layer one
    64-wide bf16 index key per token (8,192 bytes per page, not split by TP), then ``minimax_dense_kv``
    the dense layers' K then V (64 tokens x 2/tp heads x 64 bf16 per page; memory_pool.py:6300-6322)."""
    return [component("minimax_index_k", [8192] * 2, 0xA000_0000),
            component("minimax_dense_kv", [16384 // tp] * 4, 0xB000_0000)]


def test_minimax_state_moves_between_equal_tp_and_is_refused_on_a_tp_mismatch_or_with_pp() -> None:
    assert moved_at_equal_tp(minimax_states(1)) == [
        (v1.STATE_KIND_PAGED, [8192] * 2), (v1.STATE_KIND_PAGED, [16384] * 4)]
    # Prefill TP 1 -> decode TP 2 (SGLang: common/conn.py:1337-1346): refused at registration, naming the type.
    rejection = tp_refusal(minimax_states(1), layout.Ranks(attn_tp=(1, 0)), minimax_states(2),
                           layout.Ranks(attn_tp=(2, 1)))
    assert "(minimax_index_k)" in rejection.message and rejection.metadata["typeName"] == "minimax_index_k"
    # PP > 1 on either side (SGLang: mooncake/conn.py:2210-2216): refused when the manager is built.
    with pytest.raises(TopologyError) as info:
        layout.server_info(kv_args(layers=2, state=minimax_states(1)), layout.Ranks(attn_tp=(1, 0), pp=(2, 0)),
                           is_mla_backend=False, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    assert info.value.reason is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED
    assert "'minimax_index_k'" in info.value.message and "PP 2" in info.value.message
    with pytest.raises(TopologyError) as info:
        layout.decode_layout(kv_args(layers=2, state=minimax_states(1)[1:]), layout.Ranks(attn_tp=(1, 0), pp=(2, 1)),
                             is_mla_backend=False, notify_host="h", notify_port=1)
    assert info.value.metadata["stateType"] == "minimax_dense_kv"


DSV4_KV = [37440, 37440, 8448, 8448, 1728]
"""DeepSeekV4TokenToKVPool's KV entries per 256-token page (layers of ratios 0, 4, 128, 4; V4 layout, fp8):
C4 KV of layers 1 and 3 (64 rows of 584 bytes, padded to 576-byte blocks), their C4 indexer pages (64 x
(128 + 4)), C128 KV of layer 2 (2 rows, padded); ``get_contiguous_buf_infos``, deepseek_v4_memory_pool.py:1334."""


DSV4_UNIFIED_KV = [32768, 32768, 8192, 8192, 8448, 8448, 1024, 256]
"""The same pool on ROCm's unified KV, fp8 two-pool layout: per page the C4 rows of layers 1 and 3 (64 x 512 nope,
then 64 x 128 rope), their C4 indexer pages, C128 of layer 2 (2 x 512 nope, 2 x 128 rope), each after the layer's
SWA ring in its buffer (``get_contiguous_buf_infos``, deepseek_v4_memory_pool.py:1345-1400)."""


def dsv4(*, base: int = 0x10_0000, ratios: tuple[int, ...] = (0, 4, 128, 4), stage: tuple[int, int] | None = None,
         draft: int = 0, unified: bool = False, dspark: bool = False) -> SimpleNamespace:
    """A DeepSeek-V4 pool's KVArgs as ``setup_state_kv_args`` fills them (numbers from SGLang 0.5.23's own pool):
    per 256-token page the C4 KV of every ratio-4 layer, their C4 indexer keys, the C128 KV of every ratio-128
    layer; ``swa`` = every layer's SWA pages (256 x 584, padded), then the C4 compressor rings (8 rows x 4,096
    fp32 bytes) and C4 indexer-compressor rings of the ratio-4 layers, all by SWA page; ``c128_state`` = each
    ratio-128 layer's C128 ring of one request (128 rows x 4,096), left out without one; the model's
    ``mla_compression_ratios``, no KV layer ids. ``stage``: a PP stage's layers (a prefill's
    ``[prefill_start_layer, prefill_end_layer)``), whose pool registers those layers only, grouped the same way.
    ``unified``: ROCm's fp8 two-pool KV (``DSV4_UNIFIED_KV``), and the window is ``swa_ring`` instead of SWA
    pages, one token row per layer, nope (512) then rope (128), between ``swa`` and ``c128_state``
    (utils.py:1571-1596). ``dspark``: a DSpark draft's SWA pages (one layer) and its ``request_row``, one int64
    per request row, appended (utils.py:1775-1858)."""
    first, stop = stage or (0, len(ratios))
    c4 = sum(r == 4 for r in ratios[first:stop])
    c128 = sum(r == 128 for r in ratios[first:stop])
    if unified:
        kv = [32768] * c4 + [8192] * c4 + [8448] * c4 + [1024] * c128 + [256] * c128
        state = [component("swa", [65536] * c4 + [16384] * c4, base + 0x4000_0000),
                 component("swa_ring", [512] * (stop - first) + [128] * (stop - first), base + 0x5000_0000)]
    else:
        kv = [37440] * c4 + [8448] * c4 + [1728] * c128
        state = [component("swa", [149760] * (stop - first) + [65536] * c4 + [16384] * c4, base + 0x4000_0000)]
    state += [component("c128_state", [524288] * c128, base + 0x6000_0000)] if c128 else []
    if dspark:
        state += [component("swa", [149760], base + 0x7000_0000), component("request_row", [8], base + 0x7800_0000)]
    args = kv_args(layers=len(kv), base=base, state=state, start=first, draft=draft, draft_item=1728)
    args.page_size, args.kv_item_lens = 256, kv + [1728] * draft
    args.kv_data_lens = [n * 24 for n in args.kv_item_lens]
    args.mla_compression_ratios, args.prefill_end_layer = list(ratios), stop
    return args


def test_deepseek_v4_compressed_kv_moves_whole_pages_as_rows_and_its_state_is_replicated() -> None:
    info = layout.server_info(dsv4(), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                              backend=v1.BACKEND_MOONCAKE)
    # One pdproto row per SGLang page: the page ids SGLang passes move whole, as its own backends send them.
    assert info.page_size == 1 and [e.item_len for e in info.kv_entries] == DSV4_KV
    assert layout.page_rows(dsv4()) == 256 and layout.page_rows(kv_args()) == 1
    assert [(e.type_name, e.kind, e.tp_policy) for e in info.state_entries] == [
        ("swa", v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED),
        ("c128_state", v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED)]
    decision = _pair(dsv4(), layout.Ranks(attn_tp=(1, 0)), dsv4(base=0x20_0000), layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(decision, Decision), decision
    assert [p.src_token_bytes for p in decision.pairings] == DSV4_KV
    assert written(decision)[1] == [149760] * 4 + [65536] * 2 + [16384] * 2 + [524288]
    # Prefill TP 2 -> decode TP 1 (MLA fan-in, SGLang: replicated): the two prefill ranks write the KV entries in
    # turn (the decode asks for split-kv); the first also the window, the compressor rings and the C128 ring.
    moved = []
    for p_rank in range(2):
        rows, state, _ = written(_pair(dsv4(), layout.Ranks(attn_tp=(2, p_rank)), dsv4(), layout.Ranks(attn_tp=(1, 0))))
        moved.append((rows, sum(state)))
    assert moved == [(_turn(DSV4_KV, 0), 4 * 149760 + 2 * 65536 + 2 * 16384 + 524288), (_turn(DSV4_KV, 1), 0)], moved


def _turn(row_bytes: list[int], sender: int, senders: int = 2) -> list[int]:
    """The rows ``sender`` writes of KV entries that ``senders`` fan-in ranks write in turn (split-kv)."""
    return [n if j % senders == sender else 0 for j, n in enumerate(row_bytes)]


DSV4_PP = (0, 4, 128, 4, 128, 0)
"""A DeepSeek-V4 model whose two PP stages, layers 0-2 and 3-5, each hold a ratio-4 and a ratio-128 layer."""


def _v4_pp(stage: tuple[int, int]) -> tuple[SimpleNamespace, layout.Ranks]:
    """Prefill PP stage ``stage`` of ``DSV4_PP`` (rank 0 holds layers 0-2, rank 1 layers 3-5)."""
    return dsv4(ratios=DSV4_PP, stage=stage), layout.Ranks(attn_tp=(1, 0), pp=(2, stage[0] // 3))


def _ids(info: v1.PrefillServerInfo | Any) -> tuple[list[int | None], list[list[int | None]]]:
    """KV and per-entry state layer ids of a ``PrefillServerInfo`` or a ``DecodeLayout``."""
    if isinstance(info, v1.PrefillServerInfo):
        return ([e.layer_id if e.HasField("layer_id") else None for e in info.kv_entries],
                [[t.layer_id if t.HasField("layer_id") else None for t in e.tensors] for e in info.state_entries])
    return [e.layer_id for e in info.kv], [[t.layer_id for t in e.tensors] for e in info.state]


def test_deepseek_v4_pp_stages_number_their_entries_by_layer_and_fill_a_pp1_decode_exactly_once() -> None:
    # SGLang's pool lists entries by ratio ([C4 KV, C4 indexer, C128 KV]; swa = [window, C4 compressor, C4
    # indexer compressor]), and its PP slicing cuts each group by the stage's layers (common/conn.py:1890-1995).
    # pdproto gives each entry its layer (a C4 layer's two entries repeat it), so pairing by id does the cut.
    stages = [_v4_pp((0, 3)), _v4_pp((3, 6))]
    infos = [layout.server_info(a, r, is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
             for a, r in stages]
    assert [_ids(i) for i in infos] == [([1, 1, 2], [[0, 1, 2, 1, 1], [2]]), ([3, 3, 4], [[3, 4, 5, 3, 3], [4]])]
    assert [i.start_layer for i in infos] == [0, 3]
    decode = dsv4(ratios=DSV4_PP, base=0x20_0000)
    dec = layout.decode_layout(decode, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, notify_host="h",
                               notify_port=1)
    assert _ids(dec) == ([1, 3, 1, 3, 2, 4], [[0, 1, 2, 3, 4, 5, 1, 3, 1, 3], [2, 4]])
    _v4_stages_fill_decode_once(stages, decode)
    # ROCm's unified KV (nope, rope and indexer pages; the window as swa_ring rows, nope then rope) the same way.
    unified = [(dsv4(ratios=DSV4_PP, stage=st, unified=True), r) for st, (_, r) in zip(((0, 3), (3, 6)), stages)]
    info = layout.server_info(*unified[1], is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
    assert _ids(info) == ([3, 3, 3, 4, 4], [[3, 3], [3, 4, 5, 3, 4, 5], [4]])
    _v4_stages_fill_decode_once(unified, dsv4(ratios=DSV4_PP, base=0x20_0000, unified=True))


def _v4_stages_fill_decode_once(stages: list[tuple[SimpleNamespace, layout.Ranks]], decode: SimpleNamespace) -> None:
    """Every entry and state tensor of the PP 1 ``decode`` is written by exactly one of ``stages``, whole."""
    kv_hits: list[tuple[int, int]] = []
    state_hits: list[tuple[int, int, int]] = []
    for (args, ranks) in stages:
        decision = _pair(args, ranks, decode, layout.Ranks(attn_tp=(1, 0)))
        assert isinstance(decision, Decision) and decision.tp, decision
        kv_hits += [(p.dst_entry, rows) for p, rows in zip(decision.pairings, written(decision)[0], strict=True)]
        state_hits += [(e.dst_entry, t.dst_tensor, sum(g.length for g in t.segments))
                       for e in decision.tp.state for t in e.tensors]
    assert sorted(kv_hits) == list(enumerate(decode.kv_item_lens)), kv_hits
    assert sorted(state_hits) == [(e, t, n) for e, items in enumerate(decode.state_item_lens)
                                  for t, n in enumerate(items)], state_hits


def test_a_deepseek_v4_pp_stage_without_a_ratio_128_layer_fills_its_share_of_a_pp1_decode() -> None:
    # Ratios 0, 4, 4, 128 in two stages: layers 0-1 hold no ratio-128 layer, so that stage's pool has no c128_state
    # (SGLang pairs components by index and its swa comes first); its swa pairs with the decode's by type name, and
    # the other stage writes the C128 ring.
    ratios = (0, 4, 4, 128)
    stages = [(dsv4(ratios=ratios, stage=st), layout.Ranks(attn_tp=(1, 0), pp=(2, r)))
              for r, st in enumerate(((0, 2), (2, 4)))]
    assert [[t.value for t in a.state_types] for a, _ in stages] == [["swa"], ["swa", "c128_state"]]
    decode = dsv4(ratios=ratios, base=0x20_0000)
    _v4_stages_fill_decode_once(stages, decode)
    # A stage that leaves out an entry whose layers it holds (here its own C128 ring) is refused.
    args, ranks = stages[1]
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_dim_per_tensor",
                 "state_slice_outer_counts", "state_conv_shard_groups", "state_layer_ids"):
        setattr(args, name, getattr(args, name)[:1])
    refused = _pair(args, ranks, decode, layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(refused, Rejection) and refused.reason is Reason.TOPOLOGY_STATE_COUNT_MISMATCH, refused


def test_deepseek_v4_decode_stages_of_equal_pp_number_their_layers_from_sglangs_split() -> None:
    # A decode stage's KVArgs carry no layer range; the backend passes the one SGLang's model builds
    # (Ranks.stage_layers), so each decode stage pairs with its own prefill stage by layer id.
    for first in (0, 3):
        args, ranks = _v4_pp((first, first + 3))
        d_ranks = replace(ranks, stage_layers=(first, first + 3))
        dec = layout.decode_layout(dsv4(ratios=DSV4_PP, stage=(first, first + 3), base=0x20_0000), d_ranks,
                                   is_mla_backend=True, notify_host="h", notify_port=1)
        info = layout.server_info(args, ranks, is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
        assert _ids(dec) == _ids(info)
        decision = _pair(args, ranks, dsv4(ratios=DSV4_PP, stage=(first, first + 3)), d_ranks)
        assert isinstance(decision, Decision) and decision.tp, decision
        assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(0, 0), (1, 1), (2, 2)]
        assert written(decision)[1] == [149760] * 3 + [65536, 16384, 524288]
    # Stage 0 does not feed decode stage 1, and a decode stage split elsewhere than the prefill's lacks a layer
    # of it: both refused by the pairing, before any byte is planned.
    for prefill, decode_stage in (((0, 3), (3, 6)), ((3, 6), (4, 6))):
        refused = _pair(*_v4_pp(prefill), dsv4(ratios=DSV4_PP, stage=decode_stage),
                        layout.Ranks(attn_tp=(1, 0), pp=(2, 1), stage_layers=decode_stage))
        assert isinstance(refused, Rejection) and refused.reason is Reason.TOPOLOGY_MISSING_LAYER, refused


def test_deepseek_v4_with_dcp_or_pp_shapes_sglang_cannot_slice_is_refused_at_start_up() -> None:
    # SGLang's V4 attention has no DCP.
    with pytest.raises(ConfigError) as info:
        layout.decode_layout(dsv4(), layout.Ranks(attn_tp=(4, 1), dcp=(4, 1)), is_mla_backend=True, notify_host="h",
                             notify_port=1)
    assert info.value.reason is Reason.CONFIG_INVALID and "DeepSeek-V4" in info.value.message
    assert info.value.metadata == {"setting": "dcp_size", "value": "4"} and "mooncake or nixl" in info.value.message
    # SGLang slices PP stages for ratios 4 and 128 and no draft (V4.1's ratio 2 layers share a kv_source).
    v41 = dsv4(ratios=(0, 4, 128, 2), stage=(0, 2))
    for args in (v41, dsv4(ratios=DSV4_PP, stage=(3, 6), draft=1)):
        with pytest.raises(ConfigError) as info:
            layout.server_info(args, layout.Ranks(attn_tp=(1, 0), pp=(2, 1)), is_mla_backend=True, host="h",
                               port=1, backend=v1.BACKEND_MOONCAKE)
        assert info.value.metadata == {"setting": "pp_size", "value": "2"}, info.value
    # A decode stage without its layer range, and a pool whose lists are not its ratios' groups.
    with pytest.raises(ConfigError) as info:
        layout.decode_layout(dsv4(ratios=DSV4_PP, stage=(0, 3)), layout.Ranks(attn_tp=(1, 0), pp=(2, 0)),
                             is_mla_backend=True, notify_host="h", notify_port=1)
    assert "--pp-size 1" in info.value.message
    short = dsv4()
    short.kv_item_lens = short.kv_item_lens[:4]
    with pytest.raises(TopologyError) as refused:
        layout.server_info(short, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                           backend=v1.BACKEND_MOONCAKE)
    assert refused.value.reason is Reason.TOPOLOGY_LAYER_METADATA_PARTIAL and "'kv'" in refused.value.message


def _state_copies(prefill: SimpleNamespace, decode: SimpleNamespace, src: list[list[int]],
                  dst: list[list[int]]) -> list[Any]:
    """One request's state copies between two servers of TP 1, as the prefill's service builds them."""
    decision = _pair(prefill, layout.Ranks(attn_tp=(1, 0)), decode, layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(decision, Decision) and decision.tp, decision
    names = [str(t.value) for t in prefill.state_types]
    return state_copies(decision.tp.state, src_slots=src, dst_slots=dst, names=names)


def test_deepseek_v4_unified_kv_ring_rows_are_a_replicated_window_and_lists_of_unequal_length_are_refused() -> None:
    info = layout.server_info(dsv4(unified=True), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h",
                              port=1, backend=v1.BACKEND_MOONCAKE)
    assert [(e.type_name, e.kind, e.tp_policy) for e in info.state_entries] == [
        ("swa", v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED),
        ("swa_ring", v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED),
        ("c128_state", v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED)]
    # Prefill TP 2 -> decode TP 1 (MLA): the two prefill ranks write the KV entries in turn (split-kv); the first
    # every ring row, nope and rope.
    moved = []
    for p_rank in range(2):
        moved.append(written(_pair(dsv4(unified=True), layout.Ranks(attn_tp=(2, p_rank)), dsv4(unified=True),
                                   layout.Ranks(attn_tp=(1, 0))))[:2])
    assert moved == [(_turn(DSV4_UNIFIED_KV, 0), [65536] * 2 + [16384] * 2 + [512] * 4 + [128] * 4 + [524288]),
                     (_turn(DSV4_UNIFIED_KV, 1), [0] * 13)], moved
    # A 300-token prompt: SGLang's rows of positions 172..299 in the request row's ring of 128, row 5 on the
    # prefill and 9 on the decode (prefill.py:1652-1663); the i-th row lands at the i-th, in every tensor.
    def rows(row: int) -> list[int]:
        return [row * 128 + p % 128 for p in range(172, 300)]

    ring = [[3], rows(5), [5]], [[4], rows(9), [6]]
    copies = [c for c in _state_copies(dsv4(unified=True), dsv4(unified=True, base=0x20_0000), *ring)
              if c.src_entry == 1]
    assert [c.src_item_len for c in copies] == [512] * 4 + [128] * 4
    assert {c.items[:2] for c in copies} == {((684, 1196), (685, 1197))} and {len(c.items) for c in copies} == {128}
    # SGLang raises on lists of different lengths (mooncake/conn.py:1918-1926): the request is refused, naming it.
    with pytest.raises(InvalidFieldError) as caught:
        _state_copies(dsv4(unified=True), dsv4(unified=True), ring[0], [ring[1][0], ring[1][1][1:], ring[1][2]])
    assert caught.value.metadata["typeName"] == "swa_ring" and "128 prefill pages for 127" in caught.value.message


def test_a_dspark_drafts_request_row_moves_between_equal_tp_sizes_or_from_an_mla_cp_prefill_and_is_refused_otherwise(
        ) -> None:
    info = layout.server_info(dsv4(dspark=True), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                              backend=v1.BACKEND_MOONCAKE)
    assert [(e.type_name, e.kind, e.tp_policy) for e in info.state_entries][2:] == [
        ("swa", v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED),
        ("request_row", v1.STATE_KIND_RECURRENT, v1.STATE_TP_POLICY_REFUSED)]
    for p_rank in range(2):  # TP 2 -> 2: each decode rank's own prefill rank writes the draft's window and row
        rows, state, _ = written(_pair(dsv4(dspark=True), layout.Ranks(attn_tp=(2, p_rank)), dsv4(dspark=True),
                                       layout.Ranks(attn_tp=(2, p_rank))))
        assert rows == DSV4_KV and state[-2:] == [149760, 8], state
    # SGLang also admits an MLA prefill of TP t with CP c > 1 into a decode of TP t*c (common/conn.py:1376-1384),
    # pairing decode rank d with prefill TP rank d // c, CP rank 0 (_resolve_rank_mapping): so does pdproto.
    for p_tp, d_tp, d_rank in ((1, 2, 0), (1, 2, 1), (2, 4, 3)):
        p_ranks = layout.Ranks(attn_tp=(p_tp, d_rank // 2), attn_cp=(2, 0))
        rows, state, _ = written(_pair(dsv4(dspark=True), p_ranks, dsv4(dspark=True),
                                       layout.Ranks(attn_tp=(d_tp, d_rank))))
        assert rows == DSV4_KV and state[-2:] == [149760, 8], state
    # Every other TP mismatch is refused, as SGLang refuses DSpark PD (common/conn.py:1385-1389): at
    # registration, naming the type, either way; without the draft the same pair is served (replicated).
    for p_ranks, d_ranks in ((layout.Ranks(attn_tp=(2, 0)), layout.Ranks(attn_tp=(1, 0))),
                             (layout.Ranks(attn_tp=(1, 0)), layout.Ranks(attn_tp=(2, 1))),
                             (layout.Ranks(attn_tp=(1, 0), attn_cp=(2, 0)), layout.Ranks(attn_tp=(4, 1)))):
        rejection = _pair(dsv4(dspark=True), p_ranks, dsv4(dspark=True), d_ranks)
        assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_STATE_TP_REFUSED, rejection
        assert rejection.metadata["typeName"] == "request_row" and "(request_row)" in rejection.message
        assert isinstance(_pair(dsv4(), p_ranks, dsv4(), d_ranks), Decision)
    # One row per request on each side ([req_pool_idx], prefill.py:1671-1672): the prefill's row 7 to the decode's 9.
    src, dst = [[1], [2], [1], [7]], [[3], [4], [3], [9]]
    assert [c.items for c in _state_copies(dsv4(dspark=True), dsv4(dspark=True), src, dst)
            if c.src_entry == 3] == [((7, 9),)]
    with pytest.raises(InvalidFieldError) as caught:
        _state_copies(dsv4(dspark=True), dsv4(dspark=True), src, [*dst[:3], [9, 10]])
    assert caught.value.metadata["typeName"] == "request_row"


def test_state_types_pdproto_does_not_know_are_refused_by_name() -> None:
    # Every StateType of SGLang 0.5.23 is mapped; one a later SGLang adds is refused until a test moves it.
    assert len(layout.STATE_KINDS) == 13
    later = {**kimi_state(1), "type": SimpleNamespace(value="swa_ring_v2")}
    with pytest.raises(TopologyError) as info:
        layout.server_info(kv_args(state=[later]), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h",
                           port=1, backend=v1.BACKEND_MOONCAKE)
    assert info.value.reason is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED
    assert "'swa_ring_v2'" in info.value.message and "mooncake" in info.value.message


def tail_state(ring: int) -> dict[str, Any]:
    """DSATokenToKVPool's ``dsa_tail`` component as ``get_compress_tail_buf_infos`` gives it (memory_pool.py:
    5473-5486): the K-tail of layers 0-3, then their score-tail, each ``[rows, ring, 128]`` bf16, so one
    request row is ``ring * 256`` bytes; layer 2 shares layer 1's top-k and has 0 rows (item 0)."""
    rows = [ring * 256, ring * 256, 0, ring * 256]
    return component("dsa_tail", rows + rows, 0xC000_0000)


def _tail_copies(prefill: list[int], decode: list[int], *, rings: tuple[int, int] = (4, 5)) -> list[Any]:
    """One request's ``dsa_tail`` copies as the prefill's service builds them from both sides' 6-tuples."""
    src_args, dst_args = kv_args(state=[tail_state(rings[0])]), kv_args(state=[tail_state(rings[1])])
    decision = _pair(src_args, layout.Ranks(attn_tp=(1, 0)), dst_args, layout.Ranks(attn_tp=(1, 0)))
    assert isinstance(decision, Decision) and decision.tp, decision
    src = layout.state_items(layout.ring_sizes(src_args), [np.array(prefill, dtype=np.int64)])
    dst = layout.state_items(layout.ring_sizes(dst_args), [decode])
    return state_copies(decision.tp.state, src_slots=src, dst_slots=dst, names=["dsa_tail"])


def test_dsa_tail_rings_register_as_paged_replicated_slots_of_256_bytes() -> None:
    args = kv_args(state=[tail_state(5)])
    (entry,) = layout.server_info(args, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                                  backend=v1.BACKEND_MOONCAKE).state_entries
    assert (entry.kind, entry.type_name, entry.tp_policy) == (v1.STATE_KIND_PAGED, "dsa_tail",
                                                              v1.STATE_TP_POLICY_REPLICATED)
    assert [t.item_len for t in entry.tensors] == [layout.TAIL_SLOT_BYTES] * 6  # layer 2's K and score left out
    (regions,) = layout.regions(args, on_device=True).state
    assert [r.length for r in regions] == [5 * 256 * 5] * 6  # whole buffers: kv_args' lengths are 5 rows
    assert layout.ring_sizes(kv_args(state=[kimi_state(1), tail_state(5)])) == (None, 5)
    # Replicated (MLA): of the two prefill ranks feeding a decode rank of TP 1, one writes every slot.
    written = []
    for p_rank in range(2):
        decision = _pair(args, layout.Ranks(attn_tp=(2, p_rank)), args, layout.Ranks(attn_tp=(1, 0)))
        assert isinstance(decision, Decision) and decision.tp, decision
        written.append([sum(s.length for s in t.segments) for t in decision.tp.state[0].tensors])
    assert sorted(written) == [[0] * 6, [256] * 6], written
    # Rows that are not whole 256-byte slots (another index head width) are refused, naming the type.
    odd = component("dsa_tail", [5 * 200] * 2, 0xC000_0000)
    with pytest.raises(TopologyError) as refused:
        layout.ring_sizes(kv_args(state=[odd]))
    assert refused.value.reason is Reason.TOPOLOGY_STATE_SIZE_MISMATCH and "'dsa_tail'" in refused.value.message


def test_dsa_tail_live_slots_land_in_order_in_the_decode_ring_of_another_size() -> None:
    # seq 519, index_kpool 4: 3 live tokens at logical 516..518. The prefill's ring of 4 holds them at slots
    # 0-2 of row 3; the decode's ring of 5 (one extra speculative slot) at slot 4, then wrapped to 0-1 of row 6
    # (get_dsa_tail_state_indices: start = 516 % tail_size).
    copies = _tail_copies([3, 0, 3, 0, 0, 4], [6, 4, 1, 0, 2, 5])
    assert len(copies) == 6 and {c.src_item_len for c in copies} == {256}
    assert {c.items for c in copies} == {((12, 34), (13, 30), (14, 31))}
    assert sum(c.nbytes for c in copies) == 6 * 3 * 256
    # The other way: the prefill's ring wraps (slots 4, 0, 1 of a ring of 5), the decode's of 4 does not.
    (first, *_) = _tail_copies([2, 4, 1, 0, 2, 5], [1, 0, 3, 0, 0, 4], rings=(5, 4))
    assert first.items == ((14, 4), (10, 5), (11, 6))


def test_dsa_tail_without_live_tokens_moves_nothing_and_a_count_mismatch_is_refused_naming_it() -> None:
    # seq % index_kpool == 0: SGLang passes [] on both sides (utils.py:1286-1287).
    assert all(c.items == () for c in _tail_copies([], []))
    assert layout.state_items([4], [None]) == [[]]
    with pytest.raises(InvalidFieldError) as caught:  # 3 live tokens on the prefill, 2 on the decode
        _tail_copies([3, 0, 3, 0, 0, 4], [6, 1, 2, 0, 0, 5])
    assert "dsa_tail" in caught.value.message and caught.value.metadata["typeName"] == "dsa_tail"
    with pytest.raises(InvalidFieldError) as caught:  # SGLang's tuple on one side only
        _tail_copies([3, 0, 3, 0, 0, 4], [])
    assert "dsa_tail" in caught.value.message


def test_sglangs_own_mooncake_decode_registers_whole_tail_rows_and_a_pdproto_prefill_refuses_it() -> None:
    # Its M1 carries the rows SGLang registers (legacy_decode.registration is byte for byte SGLang's) and its
    # M2 the raw 6-tuple, which no pdproto prefill could pair: refused at registration, naming the sizes.
    args = kv_args(state=[component("dsa_tail", [4 * 256] * 8, 0xC000_0000)], layer_ids=[0, 1, 2, 3])
    info = layout.server_info(args, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="h", port=1,
                              backend=v1.BACKEND_MOONCAKE)
    m1 = legacy_decode.registration(SimpleNamespace(**vars(args), engine_rank=0), host="h", port=2,
                                    session_id="h:3", attn_tp_size=1, dcp=(1, 0))
    rejection = negotiate(info, m1)
    assert isinstance(rejection, Rejection), rejection
    assert rejection.reason is Reason.TOPOLOGY_STATE_SIZE_MISMATCH and "256 bytes per item on the prefill, 1024" \
        in rejection.message


def test_mha_pp_stages_pair_k_with_k_and_v_with_v() -> None:
    # An MHA pool lists every layer's K, then every layer's V (SGLang's get_mha_kv_ptrs_with_pp cuts each half by
    # the stage's layers). Stage r of 2 (layers 2r, 2r+1) into a whole-model decode, pdproto's or SGLang's own:
    # its K of layer l lands in the decode's K of layer l, its V in the decode's V (entry 4 + l), never a K.
    decode = kv_args(layers=8, token_bytes=256)
    sglangs = legacy_decode.registration(SimpleNamespace(**vars(decode), engine_rank=0), host="h", port=2,
                                         session_id="h:3", attn_tp_size=1, dcp=(1, 0))
    for r, start in enumerate((0, 2)):
        stage, ranks = kv_args(layers=4, start=start, token_bytes=256), layout.Ranks(attn_tp=(1, 0), pp=(2, r))
        want = [(0, start), (1, start + 1), (2, 4 + start), (3, 5 + start)]
        ours = _pair(stage, ranks, decode, layout.Ranks(attn_tp=(1, 0)), mla=False)
        info = layout.server_info(stage, ranks, is_mla_backend=False, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
        theirs = negotiate(info, sglangs)
        for decision in (ours, theirs):
            assert isinstance(decision, Decision), decision
            assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == want


def test_sglangs_own_single_stage_decode_pairs_by_layer_with_a_pp_stage_or_a_layer_split_cp_rank() -> None:
    # SGLang's own decode of a plain pool sends no layer ids (build_kv_layer_ids), and its backends address its
    # lists by layer: get_mla_kv_ptrs_with_pp slices them by a prefill stage's layers (PP, or a layer-split CP
    # rank's prefill_start_layer). Its M1 (legacy_decode.registration is byte for byte SGLang's) reads the same way.
    def m1(args: SimpleNamespace) -> v1.KvRegistration:
        return legacy_decode.registration(SimpleNamespace(**vars(args), engine_rank=0), host="h", port=2,
                                          session_id="h:3", attn_tp_size=1, dcp=(1, 0))

    def decided(args: SimpleNamespace, ranks: layout.Ranks, reg: v1.KvRegistration) -> Decision:
        info = layout.server_info(args, ranks, is_mla_backend=True, host="h", port=1, backend=v1.BACKEND_MOONCAKE)
        decision = negotiate(info, reg)
        assert isinstance(decision, Decision) and decision.tp, decision
        return decision

    whole_model = m1(kv_args(layers=6))
    assert not any(b.HasField("layer_id") for b in whole_model.kv_buffers)
    for r, start in enumerate((0, 3)):  # MLA with --pp-size 2: layers 0-2 and 3-5
        decision = decided(kv_args(layers=3, start=start), layout.Ranks(attn_tp=(1, 0), pp=(2, r)), whole_model)
        assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(i, start + i) for i in range(3)]
    # With an MTP draft (its entries after the target's on both sides; the frames name no roles): a one-stage
    # prefill pairs entry for entry, and the last stage of two writes the decode's draft entry.
    mtp = {"draft": 1, "draft_item": PAGE * 1152}
    decision = decided(kv_args(layers=6, **mtp), layout.Ranks(attn_tp=(1, 0)), m1(kv_args(layers=6, **mtp)))
    assert [(p.src_entry, p.dst_entry, p.role) for p in decision.pairings] == [
        *[(i, i, EntryRole.TARGET) for i in range(6)], (6, 6, EntryRole.DRAFT)]
    decision = decided(kv_args(layers=3, start=3, **mtp), layout.Ranks(attn_tp=(1, 0), pp=(2, 1)),
                       m1(kv_args(layers=6, **mtp)))
    assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(0, 3), (1, 4), (2, 5), (3, 6)]
    # GLM-5 with the DSA cache layer split over CP 2 (layers 0-1 and 2-3; layer 1 reuses layer 0's top-k, so
    # its index buffer is empty on both sides): KV and index tensors land at their layers' positions.
    index = [8448, 0, 8448, 8448]
    decode = m1(kv_args(layers=4, state=[component("dsa", index, 0xB000_0000)]))
    tensors = []
    for r, start in enumerate((0, 2)):
        args = kv_args(layers=2, start=start, state=[component("dsa", index[start:start + 2], 0xA000_0000)])
        decision = decided(args, layout.Ranks(attn_tp=(1, 0), attn_cp=(2, r), cp_layers=True), decode)
        assert [(p.src_entry, p.dst_entry) for p in decision.pairings] == [(0, start), (1, start + 1)]
        tensors += [(t.dst_tensor, sum(g.length for g in t.segments)) for t in decision.tp.state[0].tensors]
    assert sorted(tensors) == [(0, 8448), (2, 8448), (3, 8448)]


@pytest.mark.parametrize(("indices", "says"), [
    ([3, 0, 3, 0, 0], "is [row, start, n1, start2, n2, tail_size]"),
    ([3, 0, 3, 0, 0, 6], "ring of 6 slots, but the pool's rows hold 4"),
    ([3, 2, 3, 0, 0, 4], "inside the ring of 4 slots"),
    ([3, 0, 1, 3, 2, 4], "inside the ring of 4 slots"),
    ([-1, 0, 1, 0, 0, 4], "must be >= 0"),
])
def test_a_malformed_dsa_tail_index_is_refused_naming_it(indices: list[int], says: str) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        layout.state_items([None, 4], [[7], indices])
    assert caught.value.field == "state_indices[1]" and "'dsa_tail'" in caught.value.message
    assert says in caught.value.message


def test_layer_ids_that_do_not_cover_every_entry_are_refused() -> None:
    with pytest.raises(TopologyError) as info:
        layout.kv_layer_ids(kv_args(layer_ids=[3]), layout.Ranks(attn_tp=(1, 0)), prefill=True)
    assert info.value.reason is Reason.TOPOLOGY_LAYER_METADATA_PARTIAL


def test_on_a_gpu_kv_and_state_are_device_memory_and_aux_host_memory() -> None:
    regions = layout.regions(kv_args(layers=2, state=[kimi_state(1)]), on_device=True)
    assert {r.kind for r in regions.kv} | {r.kind for e in regions.state for r in e} == {v1.MEMORY_KIND_VRAM}
    assert {r.kind for r in regions.aux} == {v1.MEMORY_KIND_DRAM}
    assert {r.kind for r in layout.regions(kv_args(), on_device=False).all()} == {v1.MEMORY_KIND_DRAM}


def test_settings_come_from_the_environment_and_bad_values_name_their_variable(tmp_path: Any) -> None:
    assert BackendSettings.from_env({}) == BackendSettings()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    got = BackendSettings.from_env({"PDPROTO_ENGINE": "nixl", "PDPROTO_TOKEN_FILE": str(token),
                                    "PDPROTO_PORT": "50100", "PDPROTO_STAGING_MB": "0"})
    assert (got.engine, got.token, got.port, got.staging_mb) == ("nixl", "s3cret", 50100, 0)
    operator = tmp_path / "operator"
    operator.write_text("look\n")
    assert BackendSettings.from_env({"PDPROTO_OPERATOR_TOKEN_FILE": str(operator)}).operator_token == "look"
    with pytest.raises(ConfigError) as same:
        BackendSettings.from_env({"PDPROTO_TOKEN": "look", "PDPROTO_OPERATOR_TOKEN_FILE": str(operator)})
    assert "PDPROTO_OPERATOR_TOKEN_FILE" in same.value.message
    for flag in ("PDPROTO_ALLOW_UNAUTHENTICATED",):
        for on in ("1", "TRUE", "Yes", " on "):
            assert getattr(BackendSettings.from_env({flag: on}), flag.lower()[len("PDPROTO_"):]) is True
        for off in ("", "0", "False", "NO", "off"):
            assert getattr(BackendSettings.from_env({flag: off}), flag.lower()[len("PDPROTO_"):]) is False
    for name, value in (("PDPROTO_ENGINE", "local"), ("PDPROTO_PORT", "70000"), ("PDPROTO_STAGING_MB", "x"),
                        ("PDPROTO_PORT", "-1"), ("PDPROTO_ALLOW_UNAUTHENTICATED", "ture"),
                        ("PDPROTO_ALLOW_UNAUTHENTICATED", "2"),
                        ("PDPROTO_TOKEN_FILE", str(tmp_path / "missing"))):
        with pytest.raises(ConfigError) as info:
            BackendSettings.from_env({name: value})
        assert info.value.reason is Reason.CONFIG_INVALID and name in info.value.message
