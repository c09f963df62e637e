"""Topology negotiation: modes, pairings, and one test per rejection reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, v1
from pdproto.dcp import DcpLayout
from pdproto.dcp.layers import EntryRole
from pdproto.errors import InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.senders import SenderSet
from pdproto.negotiation.topology import (
    PAGE_RELAYOUT,
    Decision,
    Mode,
    Rejection,
    backend_of,
    example_registration,
    example_server_info,
    negotiate,
)

Info = v1.PrefillServerInfo
Reg = v1.KvRegistration


def decide(info: Info, reg: Reg) -> Decision:
    """negotiate, asserting acceptance."""
    result = negotiate(info, reg)
    assert isinstance(result, Decision), result
    return result


def reject(info: Info, reg: Reg, reason: Reason) -> Rejection:
    """negotiate, asserting a rejection with ``reason``; raised, it must say the same."""
    result = negotiate(info, reg)
    assert isinstance(result, Rejection), result
    assert result.reason is reason, result
    with pytest.raises(TopologyError) as exc:
        raise result.to_error()
    assert exc.value.reason is reason and exc.value.metadata == dict(result.metadata)
    return result


# --- accepted layouts ------------------------------------------------------------------

def test_dense_same_layout() -> None:
    d = decide(example_server_info(), example_registration())
    assert d.mode is Mode.SAME_LAYOUT and not d.mode.requires_relayout
    assert [(p.src_entry, p.dst_entry) for p in d.pairings] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert all(p.src_token_bytes == p.dst_token_bytes == 1152 for p in d.pairings)
    assert d.backend == v1.BACKEND_MOONCAKE and d.version == (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def test_dense_to_dcp_with_draft_virtual_pages() -> None:
    info = example_server_info(num_draft=1)
    reg = example_registration(dcp_size=4, dcp_rank=3, num_draft=1)
    # The decode's draft pages hold page_size*dcp_size rows: 4x the prefill's item_len.
    assert reg.kv_buffers[-1].item_len == 4 * info.kv_entries[-1].item_len
    d = decide(info, reg)
    assert d.mode is Mode.DENSE_TO_DCP and d.mode.requires_relayout
    assert d.pairings[-1].role is EntryRole.DRAFT
    assert d.pairings[-1].src_token_bytes == d.pairings[-1].dst_token_bytes == 1152
    assert (d.src, d.dst) == (DcpLayout(16, 1, 0), DcpLayout(16, 4, 3))


def test_dcp_to_dcp_n_to_m_with_other_page_sizes() -> None:
    info = example_server_info(dcp_size=2, dcp_rank=1, page_size=32, num_draft=1)
    reg = example_registration(dcp_size=4, dcp_rank=3, page_size=16, num_draft=1)
    d = decide(info, reg)
    assert d.mode is Mode.DCP_TO_DCP
    assert (d.src, d.dst) == (DcpLayout(32, 2, 1), DcpLayout(16, 4, 3))


def test_dcp_to_dense() -> None:
    d = decide(example_server_info(dcp_size=4, dcp_rank=2), example_registration(page_size=64))
    assert d.mode is Mode.DCP_TO_DENSE


def test_same_dcp_layout() -> None:
    d = decide(example_server_info(dcp_size=4, dcp_rank=2), example_registration(dcp_size=4, dcp_rank=2))
    assert d.mode is Mode.SAME_LAYOUT


@pytest.mark.parametrize("layer_ids", [False, True])
def test_pp2_to_pp1_stage1_pairs_by_global_layer(layer_ids: bool) -> None:
    # Inventory 4.9: stage 1 [3,4,5,draft] -> decode entries [3,4,5,6].
    info = example_server_info(pp_size=2, pp_rank=1, num_layers=6, num_draft=1, layer_ids=layer_ids)
    reg = example_registration(dcp_size=2, num_layers=6, num_draft=1, layer_ids=layer_ids)
    d = decide(info, reg)
    assert [p.dst_entry for p in d.pairings] == [3, 4, 5, 6]


def test_pp2_to_pp2_stage1_pairs_locally() -> None:
    info = example_server_info(pp_size=2, pp_rank=1, num_layers=6, layer_ids=True)
    reg = example_registration(pp_size=2, pp_rank=1, num_layers=6, layer_ids=True)
    assert [p.dst_entry for p in decide(info, reg).pairings] == [0, 1, 2]


@pytest.mark.parametrize("num_draft", [0, 1])
def test_pp2_decode_stage_without_layer_ids_pairs_its_own_stage_by_position(num_draft: int) -> None:
    # SGLang's plain pools: the prefill stage numbers its layers, the decode stage sends none.
    info = example_server_info(pp_size=2, pp_rank=1, num_layers=6, num_draft=num_draft, layer_ids=True)
    reg = example_registration(pp_size=2, pp_rank=1, num_layers=6, num_draft=num_draft)
    assert [p.dst_entry for p in decide(info, reg).pairings] == list(range(3 + num_draft))
    # Stage 0 does not feed decode stage 1: the pairing by position never reaches it.
    other = example_server_info(pp_size=2, pp_rank=0, num_layers=6, layer_ids=True)
    reject(other, reg, Reason.TOPOLOGY_NOT_A_SENDER)
    # A decode that holds every layer, without ids, still cannot be paired with a stage's ids.
    reject(info, example_registration(num_layers=6, num_draft=num_draft), Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED)


@pytest.mark.parametrize("backend", [v1.BACKEND_MOONCAKE, v1.BACKEND_NIXL, v1.BACKEND_LOCAL])
def test_backend_from_transport(backend: int) -> None:
    reg = example_registration(backend=backend)
    assert backend_of(reg) == backend
    assert decide(example_server_info(), reg).backend == backend


def test_legacy_optional_fields_are_not_compared() -> None:
    # Legacy (bridged SGLang) registrations carry no dtype, model, kind or version.
    reg = example_registration()
    reg.ClearField("kv_cache_dtype")
    reg.ClearField("model_id")
    reg.ClearField("attention_kind")
    reg.ClearField("version")
    for b in reg.kv_buffers[1:]:
        b.item_len = 0  # falls back to the legacy scalar kv_item_len
    d = decide(example_server_info(model_id="m"), reg)
    assert d.mode is Mode.SAME_LAYOUT and d.version == (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def test_agreed_minor_is_the_smaller() -> None:
    info, reg = example_server_info(), example_registration()
    info.version.minor, reg.version.minor = 3, 1
    assert decide(info, reg).version == (PROTOCOL_MAJOR, 1)


def test_to_proto_round_trips() -> None:
    d = decide(example_server_info(num_draft=1), example_registration(dcp_size=2, num_draft=1))
    msg = v1.NegotiationResult.FromString(d.to_proto("peer-7").SerializeToString())
    assert msg.peer_id == "peer-7" and msg.mode == v1.NEGOTIATION_MODE_DENSE_TO_DCP
    assert not msg.HasField("rejection")
    assert [(e.src_entry, e.dst_entry, e.role) for e in msg.entries][-1] == (4, 4, v1.KV_ENTRY_ROLE_DRAFT)
    assert (msg.dst_dcp.size, msg.src_page_size, msg.dst_page_size) == (2, 16, 16)

    r = reject(example_server_info(dtype="fp8_e4m3"), example_registration(),
               Reason.TOPOLOGY_KV_DTYPE_MISMATCH)
    rm = r.to_proto("peer-8")
    assert rm.mode == v1.NEGOTIATION_MODE_UNSPECIFIED and not rm.entries
    assert rm.rejection.reason == "TOPOLOGY_KV_DTYPE_MISMATCH"
    assert dict(rm.rejection.metadata) == {"prefillKvCacheDtype": "fp8_e4m3",
                                           "decodeKvCacheDtype": "bfloat16"}


# --- one test per rejection reason -----------------------------------------------------

Mutation = Callable[[Info, Reg], object]


def _no_change(info: Info, reg: Reg) -> None:
    """Leave the pair as built."""


def _versions(prefill: int, decode: int) -> Mutation:
    def mutate(info: Info, reg: Reg) -> None:
        info.version.major, reg.version.major = prefill, decode
    return mutate


def _decode_pp_rank(info: Info, reg: Reg) -> None:
    reg.pp.rank = 1


def _partial_ids(info: Info, reg: Reg) -> None:
    info.kv_entries[1].ClearField("layer_id")


def _draft_in_physical_pages(info: Info, reg: Reg) -> None:
    # SGLang's MC prefill skipped draft checks; a decode draft sized per physical page
    # would be read as a quarter-width row.
    reg.kv_buffers[-1].item_len = 1152 * 16


def _src_remainder(info: Info, reg: Reg) -> None:
    info.kv_entries[2].item_len = 1152 * 16 + 8


def _dst_remainder(info: Info, reg: Reg) -> None:
    reg.kv_buffers[3].item_len = 1152 * 16 + 8


def _mixed_memory(info: Info, reg: Reg) -> None:
    reg.kv_buffers[1].memory_kind = v1.MEMORY_KIND_DRAM


def _state(kind: int = v1.STATE_KIND_RECURRENT, *, item_len: int = 256, dim: int = 4,
           layer: int | None = None) -> v1.StateEntryInfo:
    """One state entry with one tensor: ``dim`` heads of ``item_len / dim`` bytes (dim 0: whole)."""
    return v1.StateEntryInfo(kind=kind, tensors=[v1.StateTensorInfo(item_len=item_len, dim=dim,
                                                                    layer_id=layer)])


def _buffer(kind: int = 0, *, item_len: int = 256, dims: list[int] | None = None,
            layer: int | None = None) -> v1.StateBuffer:
    return v1.StateBuffer(kind=kind, data_ptrs=[0x9000_0000], item_lens=[item_len],  # type: ignore[arg-type]
                          dim_per_tensors=[4] if dims is None else dims,
                          layer_ids=[] if layer is None else [layer])


def _aux(prefill: list[int], decode: list[int]) -> Mutation:
    def mutate(info: Info, reg: Reg) -> None:
        info.aux_entries.extend(v1.AuxEntryInfo(item_len=n) for n in prefill)
        reg.aux_ptrs.extend(0x8000_0000 + i for i in range(len(decode)))
        reg.aux_item_lens.extend(decode)
    return mutate


def _states(prefill: list[v1.StateEntryInfo], decode: list[v1.StateBuffer]) -> Mutation:
    def mutate(info: Info, reg: Reg) -> None:
        info.state_entries.extend(prefill)
        reg.state_buffers.extend(decode)
    return mutate


def _decode_tp(size: int, rank: int = 0) -> Mutation:
    def mutate(info: Info, reg: Reg) -> None:
        reg.attn_tp.size, reg.attn_tp.rank = size, rank
    return mutate


def _tp_states(prefill: list[v1.StateEntryInfo], decode: list[v1.StateBuffer], tp: int) -> Mutation:
    def mutate(info: Info, reg: Reg) -> None:
        _states(prefill, decode)(info, reg)
        _decode_tp(tp)(info, reg)
    return mutate


def _unknown_heads(info: Info, reg: Reg) -> None:
    info.attention_kind = reg.attention_kind = v1.ATTENTION_KIND_MHA
    reg.attn_tp.size = 4


# case -> (prefill keywords, decode keywords, mutation, expected reason)
REJECTIONS: dict[str, tuple[dict[str, Any], dict[str, Any], Mutation, Reason]] = {
    "major differs": ({}, {}, _versions(PROTOCOL_MAJOR, PROTOCOL_MAJOR + 1), Reason.UNSUPPORTED_VERSION),
    "major unsupported on both": ({}, {}, _versions(0, 0), Reason.UNSUPPORTED_VERSION),
    "backend not served": ({"backends": [v1.BACKEND_MOONCAKE]}, {"backend": v1.BACKEND_NIXL},
                           _no_change, Reason.TOPOLOGY_BACKEND_UNSUPPORTED),
    "no transport": ({}, {"backend": v1.BACKEND_UNSPECIFIED}, _no_change,
                     Reason.TOPOLOGY_BACKEND_UNSUPPORTED),
    "model": ({"model_id": "deepseek-v3"}, {"model_id": "kimi-k2"}, _no_change,
              Reason.TOPOLOGY_MODEL_MISMATCH),
    "decode dcp rank out of range": ({}, {"dcp_size": 4, "dcp_rank": 5}, _no_change,
                                     Reason.TOPOLOGY_RANK_OUT_OF_RANGE),
    "decode pp rank out of range": ({}, {}, _decode_pp_rank, Reason.TOPOLOGY_RANK_OUT_OF_RANGE),
    "attention kind": ({"attention": v1.ATTENTION_KIND_MLA}, {"attention": v1.ATTENTION_KIND_MHA},
                       _no_change, Reason.TOPOLOGY_ATTENTION_KIND_MISMATCH),
    "dtype": ({"dtype": "fp8_e4m3"}, {"dtype": "bfloat16"}, _no_change,
              Reason.TOPOLOGY_KV_DTYPE_MISMATCH),
    "dcp decode on MHA": ({"attention": v1.ATTENTION_KIND_MHA},
                          {"dcp_size": 2, "attention": v1.ATTENTION_KIND_MHA}, _no_change,
                          Reason.TOPOLOGY_DCP_REQUIRES_MLA),
    "dcp prefill on unknown pool": ({"dcp_size": 2, "attention": v1.ATTENTION_KIND_UNSPECIFIED},
                                    {"dcp_size": 2}, _no_change, Reason.TOPOLOGY_DCP_REQUIRES_MLA),
    "kv sharding": ({"kv_sharding": True}, {"dcp_size": 2}, _no_change,
                    Reason.TOPOLOGY_KV_SHARDING_WITH_DCP),
    "prefill cp": ({"cp_size": 2}, {"dcp_size": 2}, _no_change, Reason.TOPOLOGY_PREFILL_CP_UNSUPPORTED),
    "pp": ({"pp_size": 4, "num_layers": 8}, {"pp_size": 2, "num_layers": 8}, _no_change,
           Reason.TOPOLOGY_PP_MISMATCH),
    "equal dcp, other rank": ({"dcp_size": 4, "dcp_rank": 1}, {"dcp_size": 4, "dcp_rank": 2},
                              _no_change, Reason.TOPOLOGY_DCP_RANK_MISMATCH),
    "no shared tokens": ({"dcp_size": 2, "dcp_rank": 0}, {"dcp_size": 4, "dcp_rank": 1}, _no_change,
                         Reason.TOPOLOGY_DCP_RANK_MISMATCH),
    "page size same layout": ({"page_size": 16}, {"page_size": 32}, _no_change,
                              Reason.TOPOLOGY_PAGE_SIZE_MISMATCH),
    "layer ids one side": ({"layer_ids": True}, {"layer_ids": False}, _no_change,
                           Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED),
    "layer ids partial": ({"layer_ids": True}, {"layer_ids": True}, _partial_ids,
                          Reason.TOPOLOGY_LAYER_METADATA_PARTIAL),
    "missing layer": ({"layer_ids": True, "num_layers": 6, "pp_size": 2, "pp_rank": 1},
                      {"layer_ids": True, "num_layers": 4}, _no_change, Reason.TOPOLOGY_MISSING_LAYER),
    "too few decode entries": ({"num_layers": 6, "pp_size": 2, "pp_rank": 1}, {"num_layers": 5},
                               _no_change, Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH),
    "row bytes differ": ({"token_bytes": 1152}, {"token_bytes": 1024}, _no_change,
                         Reason.TOPOLOGY_ROW_SIZE_MISMATCH),
    "draft not in virtual pages": ({"num_draft": 1}, {"dcp_size": 4, "num_draft": 1},
                                   _draft_in_physical_pages, Reason.TOPOLOGY_ROW_SIZE_MISMATCH),
    "source remainder": ({}, {}, _src_remainder, Reason.TOPOLOGY_ROW_SIZE_MISMATCH),
    "destination remainder": ({}, {}, _dst_remainder, Reason.TOPOLOGY_ROW_SIZE_MISMATCH),
    "mixed memory kinds": ({}, {"dcp_size": 2}, _mixed_memory, Reason.TOPOLOGY_MEMORY_KIND_MIXED),
    "tp sizes do not divide": ({"tp_size": 4}, {}, _decode_tp(3), Reason.TOPOLOGY_TP_NOT_DIVISIBLE),
    "prefill rank feeds another decode rank": ({"tp_size": 2, "tp_rank": 1}, {}, _decode_tp(2, 0),
                                               Reason.TOPOLOGY_NOT_A_SENDER),
    "aux count": ({}, {}, _aux([8, 64], [8]), Reason.TOPOLOGY_AUX_COUNT_MISMATCH),
    "aux size": ({}, {}, _aux([8, 64], [8, 32]), Reason.TOPOLOGY_AUX_SIZE_MISMATCH),
    "state count": ({}, {}, _states([_state()], []), Reason.TOPOLOGY_STATE_COUNT_MISMATCH),
    "state kind": ({}, {}, _states([_state()], [_buffer(v1.STATE_KIND_SLIDING_WINDOW)]),
                   Reason.TOPOLOGY_STATE_KIND_MISMATCH),
    "state kind unknown": ({}, {}, _states([_state(v1.STATE_KIND_UNSPECIFIED)], [_buffer()]),
                           Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED),
    "state size": ({}, {}, _states([_state()], [_buffer(item_len=512)]), Reason.TOPOLOGY_STATE_SIZE_MISMATCH),
    "state split on one side only": ({"tp_size": 2}, {}, _tp_states([_state(dim=0)], [_buffer(dims=[4])], 1),
                                     Reason.TOPOLOGY_STATE_SLICE_MISMATCH),
    "state tp refused": ({"tp_size": 2}, {},
                         _tp_states([v1.StateEntryInfo(kind=v1.STATE_KIND_PAGED, type_name="block_scale",
                                                       tp_policy=v1.STATE_TP_POLICY_REFUSED,
                                                       tensors=[v1.StateTensorInfo(item_len=256)])],
                                    [_buffer(v1.STATE_KIND_PAGED, dims=[])], 1),
                         Reason.TOPOLOGY_STATE_TP_REFUSED),
    "state dims missing": ({}, {}, _tp_states([_state()], [_buffer(item_len=128, dims=[])], 2),
                           Reason.TOPOLOGY_STATE_DIMS_MISSING),
    "state needs layer ids across pp": ({"pp_size": 2, "num_layers": 8}, {"num_layers": 8},
                                        _states([_state()], [_buffer()]),
                                        Reason.TOPOLOGY_STATE_LAYER_IDS_REQUIRED),
    "mha heads unknown": ({"token_bytes": 1024}, {"token_bytes": 256}, _unknown_heads,
                          Reason.TOPOLOGY_KV_HEADS_MISMATCH),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejection(case: str) -> None:
    info_kw, reg_kw, mutate, reason = REJECTIONS[case]
    info, reg = example_server_info(**info_kw), example_registration(**reg_kw)
    mutate(info, reg)
    r = reject(info, reg, reason)
    assert r.message and r.metadata


def test_every_topology_reason_has_a_rejection_test() -> None:
    tested = {case[-1] for case in REJECTIONS.values()}
    topology = {r for r in Reason if r.name.startswith("TOPOLOGY_")}
    assert topology - tested == set()


def test_rejection_metadata_names_offending_values() -> None:
    r = reject(example_server_info(), example_registration(dcp_size=4, dcp_rank=4),
               Reason.TOPOLOGY_RANK_OUT_OF_RANGE)
    assert dict(r.metadata) == {"group": "decodeDcp", "rank": "4", "size": "4"}
    r = reject(example_server_info(page_size=16), example_registration(page_size=32),
               Reason.TOPOLOGY_PAGE_SIZE_MISMATCH)
    assert dict(r.metadata) == {"prefillPageSize": "16", "decodePageSize": "32"}


def test_page_relayout_capability_lifts_the_page_size_rule() -> None:
    reg = example_registration(page_size=64)
    reg.capabilities.append(PAGE_RELAYOUT)
    d = decide(example_server_info(page_size=16), reg)
    assert (d.mode, d.src.page_size, d.dst.page_size) == (Mode.SAME_LAYOUT, 16, 64)


def test_mixed_memory_kinds_are_fine_without_relayout() -> None:
    reg = example_registration()
    reg.kv_buffers[1].memory_kind = v1.MEMORY_KIND_DRAM
    assert decide(example_server_info(), reg).mode is Mode.SAME_LAYOUT


def test_explicit_backends_override_published_list() -> None:
    info, reg = example_server_info(), example_registration(backend=v1.BACKEND_LOCAL)
    assert isinstance(negotiate(info, reg, backends=[v1.BACKEND_NIXL]), Rejection)
    info.ClearField("backends")  # an unpublished list accepts any real backend
    assert isinstance(negotiate(info, reg), Decision)


# --- malformed input raises ------------------------------------------------------------

def _zero_decode_item(reg: Reg) -> None:
    reg.kv_item_len = 0
    reg.kv_buffers[2].item_len = 0


MALFORMED: dict[str, tuple[Mutation, str]] = {
    "prefill page size": (lambda i, r: setattr(i, "page_size", 0), "info.page_size"),
    "no prefill entries": (lambda i, r: i.ClearField("kv_entries"), "info.kv_entries"),
    "no decode buffers": (lambda i, r: r.ClearField("kv_buffers"), "registration.kv_buffers"),
    "zero prefill item": (lambda i, r: setattr(i.kv_entries[1], "item_len", 0),
                          "info.kv_entries[1].item_len"),
    "zero decode item without scalar": (
        lambda i, r: _zero_decode_item(r),
        "registration.kv_buffers[2].item_len"),
    "legacy scalar contradicts entry 0": (lambda i, r: setattr(r, "kv_item_len", 7),
                                          "registration.kv_item_len"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_raises(case: str) -> None:
    mutate, field = MALFORMED[case]
    info, reg = example_server_info(), example_registration()
    mutate(info, reg)
    with pytest.raises(InvalidFieldError) as exc:
        negotiate(info, reg)
    assert exc.value.field == field and exc.value.reason is Reason.INVALID_FIELD


def test_decode_global_tp_rank_beyond_attention_tp_is_accepted() -> None:
    # Under DP attention SGLang registers the global TP rank with a smaller attn TP size.
    reg = example_registration(tp_size=1, tp_rank=5)
    assert decide(example_server_info(), reg).mode is Mode.SAME_LAYOUT
    info = example_server_info(tp_size=2, tp_rank=2)
    reject(info, reg, Reason.TOPOLOGY_RANK_OUT_OF_RANGE)


def test_bridged_sglang_dcp_registration_is_judged_by_the_prefill_pool() -> None:
    """SGLang frames carry no pool kind: a real DCP 4 registration parsed from them negotiates."""
    from pdproto.legacy import mooncake

    reg = example_registration(dcp_size=4, dcp_rank=1, backend=v1.BACKEND_MOONCAKE)
    parsed = mooncake.parse_registration(mooncake.build_registration(reg)).message
    assert parsed.attention_kind == v1.ATTENTION_KIND_UNSPECIFIED
    decision = negotiate(example_server_info(), parsed)
    assert isinstance(decision, Decision) and decision.mode == Mode.DENSE_TO_DCP
    rejected = negotiate(example_server_info(attention=v1.ATTENTION_KIND_MHA), parsed)
    assert isinstance(rejected, Rejection)
    assert rejected.reason == Reason.TOPOLOGY_DCP_REQUIRES_MLA


def test_unset_decode_page_size_reads_as_the_prefills() -> None:
    """Page size 0 is "not sent" (SGLang frames never carry it), not malformed."""
    reg = example_registration(dcp_size=4)
    reg.page_size = 0
    decision = negotiate(example_server_info(), reg)
    assert isinstance(decision, Decision)
    assert decision.dst.page_size == example_server_info().page_size


def test_the_tp_plan_survives_the_negotiation_result() -> None:
    # The decode reads back what the prefill decided: senders, aux, state segments, row slices.
    info = example_server_info(tp_size=2, tp_rank=1, attention=v1.ATTENTION_KIND_MHA, token_bytes=1024)
    info.total_kv_heads = 8
    info.aux_entries.add(item_len=64)
    info.state_entries.append(_state(dim=4))
    reg = example_registration(tp_size=4, tp_rank=3, attention=v1.ATTENTION_KIND_MHA, token_bytes=512)
    reg.aux_ptrs.append(0x8000_0000)
    reg.state_buffers.append(_buffer(item_len=128, dims=[2]))
    d = decide(info, reg)
    assert d.tp is not None and d.tp.me.sends_kv and d.tp.me.sends_aux and d.tp.me.sends_state
    assert all(cut is not None and cut.length == 512 for cut in d.tp.row_slices)
    back = v1.NegotiationResult.FromString(d.to_proto("p-1").SerializeToString())
    assert SenderSet.from_proto(back.senders) == d.tp.senders and len(back.aux) == 1
    assert [len(t.segments) for t in back.state[0].tensors] == [len(t.segments) for t in d.tp.state[0].tensors]
    assert [e.row_slice.length for e in back.entries] == [cut.length for cut in d.tp.row_slices if cut is not None]
