"""The decode side's one registration builder: what it writes is what negotiation reads."""

from __future__ import annotations

import pytest

from pdproto import backends, v1
from pdproto.dcp.layers import EntryRole
from pdproto.errors import InvalidFieldError, TopologyError
from pdproto.negotiation.registration import DecodeLayout, KvEntry, Region, kv_entries, make_registration
from pdproto.negotiation.topology import Decision, Rejection, example_server_info, negotiate
from pdproto.transfer import create_executor

MOONCAKE = v1.MooncakeEndpoint(session_id="10.0.0.7:17000")


def _accepted(reg: v1.KvRegistration, info: v1.PrefillServerInfo) -> Decision:
    """negotiate, asserting acceptance."""
    result = negotiate(info, reg)
    assert isinstance(result, Decision), result
    return result


def _layout(**kw: object) -> DecodeLayout:
    base: dict[str, object] = dict(page_size=16, kv=kv_entries(4, 1152), kv_cache_dtype="bfloat16",
                                   attention_kind=v1.ATTENTION_KIND_MLA, dcp_size=4, dcp_rank=1)
    base.update(kw)
    return DecodeLayout(**base)  # type: ignore[arg-type]


def _regions(layout: DecodeLayout, pages: int = 8) -> list[Region]:
    return [Region(0x10_0000 * (i + 1), n * pages) for i, n in enumerate(layout.item_lens())]


def test_registration_carries_layout_endpoint_and_buffers() -> None:
    layout = _layout(notify_host="10.0.0.7", notify_port=7001, model_id="m", capabilities=("packed",),
                     pp_size=2, pp_rank=1, attn_tp_size=2, attn_tp_rank=1, gpu_id=3)
    regions = _regions(layout)
    reg = make_registration(layout, MOONCAKE, regions)
    assert reg.WhichOneof("transport") == "mooncake" and reg.mooncake == MOONCAKE
    assert (reg.page_size, reg.kv_cache_dtype, reg.attention_kind) == (16, "bfloat16", v1.ATTENTION_KIND_MLA)
    assert [(g.size, g.rank) for g in (reg.attn_tp, reg.dcp, reg.pp)] == [(2, 1), (4, 1), (2, 1)]
    assert (reg.notify_endpoint.host, reg.notify_endpoint.port, reg.model_id, reg.gpu_id) == ("10.0.0.7", 7001, "m", 3)
    assert list(reg.capabilities) == ["packed"] and reg.kv_item_len == 16 * 1152
    assert [(b.ptr, b.length, b.item_len, b.layer_id, b.memory_kind) for b in reg.kv_buffers] == [
        (r.ptr, r.length, 16 * 1152, i, v1.MEMORY_KIND_VRAM) for i, r in enumerate(regions)]


def test_draft_entries_get_virtual_pages_and_negotiate() -> None:
    kv = (*kv_entries(4, 1152), KvEntry(1152, 4, EntryRole.DRAFT))
    layout = _layout(kv=kv)
    assert layout.item_lens() == (16 * 1152,) * 4 + (16 * 4 * 1152,)
    reg = make_registration(layout, MOONCAKE, _regions(layout))
    assert reg.kv_buffers[4].role == v1.KV_ENTRY_ROLE_DRAFT
    d = _accepted(reg, example_server_info(num_layers=4, num_draft=1, layer_ids=True))
    assert [(p.dst_entry, p.role, p.dst_token_bytes) for p in d.pairings][-1] == (4, EntryRole.DRAFT, 1152)


def test_without_layer_ids_entries_pair_by_position() -> None:
    layout = _layout(kv=kv_entries(4, 1152, layer_ids=False))
    reg = make_registration(layout, MOONCAKE, _regions(layout))
    assert not any(b.HasField("layer_id") for b in reg.kv_buffers)
    assert len(_accepted(reg, example_server_info()).pairings) == 4


def test_region_count_must_match_the_layout() -> None:
    layout = _layout()
    with pytest.raises(InvalidFieldError) as info:
        make_registration(layout, MOONCAKE, _regions(layout)[:3])
    assert info.value.field == "kv"


def test_endpoint_no_backend_owns_is_refused() -> None:
    layout = _layout()
    with pytest.raises(TopologyError):
        make_registration(layout, v1.Endpoint(host="h"), _regions(layout))


def test_unset_endpoint_is_rejected_by_negotiation() -> None:
    layout = _layout()
    reg = make_registration(layout, None, _regions(layout))
    assert reg.WhichOneof("transport") is None
    result = negotiate(example_server_info(), reg)
    assert isinstance(result, Rejection) and result.reason.code == "TOPOLOGY_BACKEND_UNSUPPORTED"


def test_executor_buffers_are_regions() -> None:
    ex = create_executor("local", arena_bytes=1 << 20)
    try:
        layout = _layout(kv=kv_entries(2, 64, layer_ids=False), dcp_size=1, dcp_rank=0)
        bufs = [ex.allocate(64 * 16 * 4) for _ in range(2)]
        reg = make_registration(layout, ex.endpoint(), bufs)
        assert backends.of_registration(reg) is backends.by_name("local")
        assert [(b.ptr, b.length, b.memory_kind) for b in reg.kv_buffers] == [(b.ptr, b.length, b.kind) for b in bufs]
        info = example_server_info(page_size=16, token_bytes=64, num_layers=2)
        assert _accepted(reg, info).backend == v1.BACKEND_LOCAL
    finally:
        ex.close()
