"""Golden SGLang 0.5.23 frames: each parses to known values and rebuilds byte for byte.

The files are written by tests/golden/generate.py from the inventory's slot
tables with struct, independently of pdproto.legacy (see tests/golden/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdproto.legacy import LegacyBackend, LegacyKind, classify, mooncake, nixl
from pdproto.v1 import (
    MEMORY_KIND_DRAM,
    MEMORY_KIND_UNSPECIFIED,
    MEMORY_KIND_VRAM,
    STAGING_ALLOCATION_GRANTED,
    STAGING_ALLOCATION_OVERSIZED,
    STAGING_ALLOCATION_PENDING,
    TRANSFER_STATE_FAILED,
    TRANSFER_STATE_SUCCESS,
)
from tests.golden.generate import GOLDENS, unpack_container

GOLDEN = Path(__file__).resolve().parent / "golden"


def _frames(name: str) -> list[bytes]:
    return unpack_container((GOLDEN / name).read_bytes())


def _kind(name: str) -> str:
    """'mooncake/abort_ack_legacy.bin' -> 'abort_ack' (the longest matching kind)."""
    stem = name.split("/")[1].removesuffix(".bin")
    return max((k.value for k in LegacyKind if stem.startswith(k.value)), key=len)


def test_committed_files_match_the_generator() -> None:
    on_disk = sorted(str(p.relative_to(GOLDEN)) for p in GOLDEN.glob("*/*.bin"))
    assert on_disk == sorted(GOLDENS)
    for name, frames in GOLDENS.items():
        assert _frames(name) == frames, name


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_rebuilds_byte_for_byte(name: str) -> None:
    backend = mooncake if name.startswith("mooncake/") else nixl
    kind = _kind(name)
    frames = _frames(name)
    parse: Callable[[list[bytes]], Any] = getattr(backend, f"parse_{kind}")
    build: Callable[[Any], list[bytes]] = getattr(backend, f"build_{kind}")
    result = parse(frames)
    assert build(result.message) == frames
    again = type(result.message)()
    again.ParseFromString(result.message.SerializeToString())
    assert build(again) == frames
    found = classify(frames)
    assert found.kind.value == kind
    assert found.backend in (None, LegacyBackend(name.split("/")[0]))


def test_mooncake_registration_v0523() -> None:
    r = mooncake.parse_registration(_frames("mooncake/registration_v0523.bin"))
    m = r.message
    assert r.assumed == ()
    assert (m.notify_endpoint.host, m.notify_endpoint.port) == ("10.1.2.3", 17001)
    assert m.mooncake.session_id == "10.1.2.3:15001"
    assert [b.ptr for b in m.kv_buffers] == [0x7F0000001000, 0x7F0000101000, 0x7F0000201000]
    assert [b.item_len for b in m.kv_buffers] == [36864, 36864, 147456]
    assert [b.layer_id for b in m.kv_buffers] == [0, 1, 61]
    assert all(b.memory_kind == MEMORY_KIND_UNSPECIFIED for b in m.kv_buffers)
    assert list(m.aux_ptrs) == [0x7E0000000000]
    assert (m.attn_tp.rank, m.attn_tp.size, m.kv_item_len) == (1, 4, 36864)
    assert (m.dcp.size, m.dcp.rank) == (4, 1)
    assert len(m.state_buffers) == 2
    assert list(m.state_buffers[0].data_ptrs) == [0x7D0000000000, 0x7D0000100000]
    assert list(m.state_buffers[0].item_lens) == [4096, 8192]
    assert list(m.state_buffers[0].dim_per_tensors) == [16, 32]
    assert list(m.state_buffers[1].dim_per_tensors) == []
    assert list(m.state_buffers[1].layer_ids) == [7]
    assert dict(m.legacy.list_lengths) == {11: 1}  # dims list is shorter than the others
    assert (m.staging.base_ptr, m.staging.total_size) == (0x7C0000000000, 1 << 30)
    assert list(m.staging.slot_layer_ids) == [0, 1, 61]
    assert m.legacy.frame_count == 0 and not m.legacy.empty_slots


def test_mooncake_registration_pre_dcp() -> None:
    r = mooncake.parse_registration(_frames("mooncake/registration_pre_dcp.bin"))
    m = r.message
    assert not m.HasField("dcp") and not m.HasField("staging")
    assert m.legacy.frame_count == 16
    assert [b.item_len for b in m.kv_buffers] == [36864, 36864]  # from slot 9
    assert not any(b.HasField("layer_id") for b in m.kv_buffers)
    assert "DCP fields absent or empty: assumed size 1, rank 0" in r.assumed
    assert any("dst_kv_item_lens absent" in a for a in r.assumed)
    assert (m.attn_tp.rank, m.attn_tp.size) == (0, 2)


def test_mooncake_transfer_infos() -> None:
    m = mooncake.parse_transfer_info(_frames("mooncake/transfer_info_v0523.bin")).message
    assert (m.room, m.peer_name, list(m.dst_kv_pages)) == (9001, "10.1.2.3:15001", [12, 13, 40])
    assert m.dst_aux_index == 5 and not m.is_dummy
    assert [list(x.indices) for x in m.dst_state_indices] == [[2], []]
    assert (m.required_dst_info_num, m.decode_prefix_len) == (1, 256)
    assert not m.HasField("dst_device_kv_pages") and not m.HasField("legacy")
    d = mooncake.parse_transfer_info(_frames("mooncake/transfer_info_dummy.bin")).message
    assert d.is_dummy and not d.dst_kv_pages and not d.HasField("dst_aux_index")
    assert d.HasField("decode_prefix_len") and d.decode_prefix_len == 0
    old = mooncake.parse_transfer_info(_frames("mooncake/transfer_info_pre_prefix.bin"))
    assert old.message.legacy.frame_count == 8
    assert not old.message.HasField("decode_prefix_len")
    assert (list(old.message.dst_kv_pages), old.message.required_dst_info_num) == ([3], 2)


def test_mooncake_small_messages() -> None:
    s = mooncake.parse_status(_frames("mooncake/status_success.bin")).message
    assert (s.room, s.state, s.prefill_rank) == (9001, TRANSFER_STATE_SUCCESS, 5)
    a = mooncake.parse_abort(_frames("mooncake/abort_room_only.bin"))
    assert a.message.room == 9001 and not a.message.HasField("reply_endpoint") and a.assumed
    a2 = mooncake.parse_abort(_frames("mooncake/abort_v0523.bin")).message
    assert (a2.reply_endpoint.host, a2.reply_endpoint.port, a2.generation) == (
        "10.1.2.3", 17001, 3)
    ack = mooncake.parse_abort_ack(_frames("mooncake/abort_ack_legacy.bin")).message
    assert ack.room == 9001 and not ack.HasField("prefill_rank")
    ack2 = mooncake.parse_abort_ack(_frames("mooncake/abort_ack_v0523.bin")).message
    assert (ack2.prefill_rank, ack2.generation) == (5, 3)
    b = mooncake.parse_bootstrap(_frames("mooncake/bootstrap.bin")).message
    assert (b.room, b.decode_endpoint.port) == (9001, 17001)
    q = mooncake.parse_staging_req(_frames("mooncake/staging_req.bin")).message
    assert (q.chunk_index, q.chunk_pages, q.requester_pp_rank) == (2, 16, 1)
    g = mooncake.parse_staging_rsp(_frames("mooncake/staging_rsp_granted.bin")).message
    assert (g.allocation, g.offset, g.round, g.end) == (
        STAGING_ALLOCATION_GRANTED, 65536, 3, 131072)
    o = mooncake.parse_staging_rsp(_frames("mooncake/staging_rsp_oversized.bin")).message
    assert (o.allocation, o.offset, o.end) == (STAGING_ALLOCATION_OVERSIZED, 0, -1)
    w = mooncake.parse_watermark(_frames("mooncake/watermark.bin")).message
    assert (w.round, w.tail, w.session_id) == (3, 65536, "10.0.0.9:15000")
    c = mooncake.parse_chunk_ready(_frames("mooncake/chunk_ready.bin")).message
    assert (c.page_start, c.num_pages, c.writer_id, c.prefill_rank) == (32, 16, "w-0", 5)
    x = mooncake.parse_aux_data(_frames("mooncake/aux_data.bin")).message
    assert (x.aux_index, x.data) == (5, b"\x01\x02aux\x00")


def test_nixl_registrations() -> None:
    r = nixl.parse_registration(_frames("nixl/registration_v0523.bin"))
    m = r.message
    assert r.assumed == ()
    assert m.nixl.agent_name == "0b5a0f9e-2c7d-4f35-9a51-6c1d1e0f0a11"
    assert m.nixl.agent_metadata == b"\x00\x01nixl-agent-metadata\xff"
    assert (m.gpu_id, m.attn_tp.size, m.attn_tp.rank) == (3, 8, 3)
    assert [b.memory_kind for b in m.kv_buffers] == [MEMORY_KIND_VRAM, MEMORY_KIND_DRAM]
    assert [b.layer_id for b in m.kv_buffers] == [0, 1]
    assert m.num_slots == 4096 and not m.HasField("staging")
    assert (m.dcp.size, m.dcp.rank) == (2, 1)
    assert list(m.state_buffers[0].data_lens) == [1 << 20]
    assert list(m.state_buffers[0].layer_ids) == [5]
    old = nixl.parse_registration(_frames("nixl/registration_pre_dcp.bin"))
    assert old.message.legacy.frame_count == 21 and not old.message.HasField("dcp")
    assert not old.message.HasField("num_slots")
    assert any("VRAM" in a for a in old.assumed)


def test_nixl_transfer_infos() -> None:
    m = nixl.parse_transfer_info(_frames("nixl/transfer_info_v0523.bin")).message
    assert (list(m.dst_kv_pages), m.dst_aux_index, m.is_dummy) == ([100, 101], 9, False)
    assert [list(x.indices) for x in m.dst_state_indices] == [[4]]
    d = nixl.parse_transfer_info(_frames("nixl/transfer_info_dummy.bin")).message
    assert d.is_dummy and d.dst_aux_index == 0 and not d.HasField("legacy")
    old = nixl.parse_transfer_info(_frames("nixl/transfer_info_no_flag.bin"))
    assert old.message.is_dummy and old.message.legacy.frame_count == 9
    assert any("inferred True" in a for a in old.assumed)


def test_nixl_small_messages() -> None:
    f = nixl.parse_status(_frames("nixl/status_failed.bin")).message
    assert (f.state, f.prefill_rank) == (TRANSFER_STATE_FAILED, 2)
    assert f.failure_reason == "KV transfer failed: ünreachable"
    n = nixl.parse_status(_frames("nixl/status_no_reason.bin")).message
    assert n.state == TRANSFER_STATE_SUCCESS and n.legacy.frame_count == 4
    ack = nixl.parse_abort_ack(_frames("nixl/abort_ack_v0523.bin"))
    assert ack.message.prefill_rank == 2 and not ack.message.HasField("generation")
    q = nixl.parse_staging_req(_frames("nixl/staging_req.bin")).message
    assert not q.HasField("requester_pp_rank") and q.session_id == "agent-x"
    p = nixl.parse_staging_rsp(_frames("nixl/staging_rsp_pending.bin")).message
    assert p.allocation == STAGING_ALLOCATION_PENDING and p.offset == 0
    w = nixl.parse_watermark(_frames("nixl/watermark_no_session.bin"))
    assert w.message.session_id == "" and w.message.legacy.frame_count == 3
