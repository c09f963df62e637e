"""What SGLang 0.5.23 reads from frames our build_* writes, field for field.

``_sglang_*`` below model SGLang's own ``from_zmq`` parsers as the wire inventory
describes them (sections 1.2, 1.3, 1.5, 1.6: ``len(msg) > k`` checks, ``!= b""``
defaults, sentinels), written independently of pdproto.legacy. Messages a pdproto
peer would send (no legacy framing) are built with our codec and read with the
model; every value SGLang would see must equal what the message means.
Frames that came from SGLang itself are covered by the exactness tests
(test_legacy_errors.py, test_legacy_golden.py): identical bytes parse identically.
"""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.legacy import mooncake, nixl
from pdproto.v1 import (
    MEMORY_KIND_DRAM,
    MEMORY_KIND_UNSPECIFIED,
    MEMORY_KIND_VRAM,
    KvRegistration,
    TransferInfo,
    TransferStatus,
)
from ._legacy_strategies import ASCII, EXAMPLES, I32, STATES, U32, U64, UTF8

KVPOLL = {5: 0, 1: 1, 2: 2, 3: 3, 4: 4}  # TransferState -> KVPoll (Failed is 0)


def _ints(data: bytes, fmt: str) -> list[int]:
    size = struct.calcsize(fmt)
    return list(struct.unpack(f"{len(data) // size}{fmt}", data))


def _pil(data: bytes, fmt: str) -> list[list[int]]:
    """common/utils.py unpack_int_lists."""
    if not data:
        return []
    (n,) = struct.unpack_from("<I", data)
    lens = struct.unpack_from(f"<{n}I", data, 4)
    out, off, size = [], 4 * (n + 1), struct.calcsize("<" + fmt)
    for ln in lens:
        out.append(list(struct.unpack_from(f"<{ln // size}{fmt}", data, off)))
        off += ln
    return out


def _opt(msg: list[bytes], k: int) -> bytes | None:
    return msg[k] if len(msg) > k and msg[k] != b"" else None


def _sglang_mc_register(msg: list[bytes]) -> dict[str, Any]:
    """mooncake/conn.py KVArgsRegisterInfo.from_zmq, per inventory 1.2."""
    base = struct.unpack("Q", msg[14])[0] if len(msg) > 14 and len(msg[14]) == 8 else 0
    size = int(msg[15].decode("ascii")) if _opt(msg, 15) else 0
    staging = None if base == 0 and size == 0 else (
        base, size, _ints(msg[18], "Q") if len(msg) > 18 and msg[18] else [])
    return {
        "room": msg[0].decode("ascii"), "endpoint": msg[1].decode("ascii"),
        "dst_port": int(msg[2].decode("ascii")), "session": msg[3].decode("ascii"),
        "kv_ptrs": _ints(msg[4], "Q"), "aux_ptrs": _ints(msg[5], "Q"),
        "state_ptrs": _pil(msg[6], "Q"), "tp_rank": int(msg[7]), "tp_size": int(msg[8]),
        "kv_item_len": int(msg[9]),
        "state_item_lens": _pil(msg[10], "I") if len(msg) > 10 else [],
        "state_dims": _pil(msg[11], "I") if len(msg) > 11 else [],
        "kv_layer_ids": _ints(msg[12], "I") if _opt(msg, 12) else [],
        "state_layer_ids": _pil(msg[13], "I") if _opt(msg, 13) else [],
        "staging": staging,
        "dcp_size": int(msg[16]) if _opt(msg, 16) else 1,
        "dcp_rank": int(msg[17]) if _opt(msg, 17) else 0,
        "kv_item_lens": _ints(msg[19], "Q") if len(msg) > 19 and msg[19] else [],
    }


def _sglang_nx_register(wire: list[bytes]) -> dict[str, Any]:
    """nixl/conn.py listener (guard assert) + KVArgsRegisterInfo.from_zmq, per inventory 1.3."""
    assert wire[0] == b"NixlMsgGuard"
    msg = wire[1:]
    kv_ptrs = _ints(msg[5], "Q")
    kinds = msg[17].decode("ascii").split(",") if len(msg) > 17 and msg[17] else [
        "VRAM"] * len(kv_ptrs)
    item_len = int(msg[11])
    return {
        "room": msg[0].decode("ascii"), "endpoint": msg[1].decode("ascii"),
        "dst_port": int(msg[2]), "agent_name": msg[3].decode("ascii"), "agent_metadata": msg[4],
        "kv_ptrs": kv_ptrs, "aux_ptrs": _ints(msg[6], "Q"),
        "state_ptrs": _pil(msg[7], "Q") if _opt(msg, 7) else [],
        "gpu_id": int(msg[8]), "tp_size": int(msg[9]), "tp_rank": int(msg[10]),
        "kv_item_len": item_len,
        "state_item_lens": _pil(msg[12], "I") if len(msg) > 12 and len(msg[12]) else [],
        "state_dims": _pil(msg[13], "I") if len(msg) > 13 and len(msg[13]) else [],
        "staging_base": struct.unpack("Q", msg[14])[0] if len(msg[14]) == 8 else 0,
        "staging_size": int(msg[15]) if _opt(msg, 15) else 0,
        "num_slots": int(msg[16]) if _opt(msg, 16) else None,
        "mem_kinds": kinds,
        "kv_item_lens": _ints(msg[18], "Q") if _opt(msg, 18) else [item_len] * len(kv_ptrs),
        "state_layer_ids": _pil(msg[19], "I") if _opt(msg, 19) else [],
        "kv_layer_ids": _ints(msg[20], "I") if _opt(msg, 20) else [],
        "dcp_size": int(msg[21]) if _opt(msg, 21) else 1,
        "dcp_rank": int(msg[22]) if _opt(msg, 22) else 0,
        "state_data_lens": _pil(msg[23], "Q") if _opt(msg, 23) else [],
    }


@st.composite
def native_registrations(draw: st.DrawFn, backend: str) -> KvRegistration:
    """A registration as a pdproto decode would fill it: no legacy framing."""
    msg = KvRegistration(kv_item_len=draw(U64))
    msg.notify_endpoint.host, msg.notify_endpoint.port = draw(ASCII), draw(st.integers(1, 65535))
    if backend == "mooncake":
        msg.mooncake.session_id = draw(ASCII)
    else:
        msg.nixl.agent_name = draw(ASCII)
        msg.nixl.agent_metadata = draw(st.binary(max_size=8))
        msg.gpu_id = draw(U32)
        if draw(st.booleans()):
            msg.num_slots = draw(U32)
    msg.attn_tp.size, msg.attn_tp.rank = draw(U32), draw(U32)
    msg.aux_ptrs.extend(draw(st.lists(U64, max_size=3)))
    n = draw(st.integers(0, 4))
    with_ids, kinds = draw(st.booleans()), draw(st.booleans()) and backend == "nixl"
    for _ in range(n):
        buf = msg.kv_buffers.add(ptr=draw(U64), item_len=draw(U64))
        if with_ids:
            buf.layer_id = draw(U32)
        if kinds:
            buf.memory_kind = draw(st.sampled_from([MEMORY_KIND_VRAM, MEMORY_KIND_DRAM]))
    for _ in range(draw(st.integers(0, 3))):
        sb = msg.state_buffers.add(data_ptrs=draw(st.lists(U64, max_size=2)),
                                   item_lens=draw(st.lists(U32, max_size=2)),
                                   dim_per_tensors=draw(st.lists(U32, max_size=2)),
                                   layer_ids=draw(st.lists(U32, max_size=2)))
        if backend == "nixl":
            sb.data_lens.extend(draw(st.lists(U64, max_size=2)))
    if draw(st.booleans()):
        msg.staging.base_ptr = draw(st.integers(1, 2**64 - 1))
        msg.staging.total_size = draw(U64)
        if backend == "mooncake":
            msg.staging.slot_layer_ids.extend(draw(st.lists(U64, max_size=3)))
    if draw(st.booleans()):
        msg.dcp.size, msg.dcp.rank = draw(st.integers(1, 64)), draw(st.integers(0, 63))
    return msg


def _common_expect(m: KvRegistration, sg: dict[str, Any]) -> None:
    assert sg["room"] == "None"
    assert (sg["endpoint"], sg["dst_port"]) == (m.notify_endpoint.host, m.notify_endpoint.port)
    assert sg["kv_ptrs"] == [b.ptr for b in m.kv_buffers]
    assert sg["kv_item_lens"] == [b.item_len for b in m.kv_buffers]
    assert sg["kv_layer_ids"] == [b.layer_id for b in m.kv_buffers if b.HasField("layer_id")]
    assert sg["aux_ptrs"] == list(m.aux_ptrs)
    assert (sg["tp_size"], sg["tp_rank"], sg["kv_item_len"]) == (
        m.attn_tp.size, m.attn_tp.rank, m.kv_item_len)
    assert sg["state_ptrs"] == [list(s.data_ptrs) for s in m.state_buffers]
    assert sg["state_item_lens"] == [list(s.item_lens) for s in m.state_buffers]
    assert sg["state_dims"] == [list(s.dim_per_tensors) for s in m.state_buffers]
    assert sg["state_layer_ids"] == [list(s.layer_ids) for s in m.state_buffers]
    dcp = (m.dcp.size, m.dcp.rank) if m.HasField("dcp") else (1, 0)
    assert (sg["dcp_size"], sg["dcp_rank"]) == dcp


@settings(max_examples=EXAMPLES)
@given(native_registrations("mooncake"))
def test_sglang_reads_our_mooncake_registration(m: KvRegistration) -> None:
    sg = _sglang_mc_register(mooncake.build_registration(m))
    _common_expect(m, sg)
    assert sg["session"] == m.mooncake.session_id
    st_ = m.staging
    assert sg["staging"] == ((st_.base_ptr, st_.total_size, list(st_.slot_layer_ids))
                             if m.HasField("staging") else None)


@settings(max_examples=EXAMPLES)
@given(native_registrations("nixl"))
def test_sglang_reads_our_nixl_registration(m: KvRegistration) -> None:
    sg = _sglang_nx_register(nixl.build_registration(m))
    _common_expect(m, sg)
    assert (sg["agent_name"], sg["agent_metadata"], sg["gpu_id"]) == (
        m.nixl.agent_name, m.nixl.agent_metadata, m.gpu_id)
    assert sg["num_slots"] == (m.num_slots if m.HasField("num_slots") else None)
    names = {MEMORY_KIND_VRAM: "VRAM", MEMORY_KIND_DRAM: "DRAM", MEMORY_KIND_UNSPECIFIED: "VRAM"}
    assert sg["mem_kinds"] == [names[b.memory_kind] for b in m.kv_buffers]
    assert sg["state_data_lens"] == [list(s.data_lens) for s in m.state_buffers]
    assert (sg["staging_base"], sg["staging_size"]) == (m.staging.base_ptr, m.staging.total_size)


@st.composite
def native_transfer_infos(draw: st.DrawFn, backend: str) -> TransferInfo:
    """A TransferInfo as a pdproto decode would fill it."""
    msg = TransferInfo(room=draw(U64), peer_name=draw(ASCII), required_dst_info_num=draw(U32))
    msg.notify_endpoint.host, msg.notify_endpoint.port = draw(ASCII), draw(st.integers(1, 65535))
    for inner in draw(st.lists(st.lists(I32, max_size=3), max_size=3)):
        msg.dst_state_indices.add(indices=inner)
    msg.is_dummy = draw(st.booleans())
    if not msg.is_dummy or backend == "nixl":
        msg.dst_kv_pages.extend(draw(st.lists(I32, max_size=5)))
        msg.dst_aux_index = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        msg.decode_prefix_len = draw(U64)
    if backend == "mooncake" and draw(st.booleans()):
        msg.dst_device_kv_pages.pages.extend(draw(st.lists(I32, min_size=1, max_size=3)))
    return msg


@settings(max_examples=EXAMPLES)
@given(native_transfer_infos("mooncake"))
def test_sglang_reads_our_mooncake_transfer_info(m: TransferInfo) -> None:
    msg = mooncake.build_transfer_info(m)  # mooncake/conn.py TransferInfo.from_zmq:
    dummy = msg[4] == b"" and msg[5] == b""
    assert dummy == m.is_dummy
    assert (int(msg[0]), msg[1].decode("ascii"), int(msg[2]), msg[3].decode("ascii")) == (
        m.room, m.notify_endpoint.host, m.notify_endpoint.port, m.peer_name)
    if not dummy:
        assert (_ints(msg[4], "i"), int(msg[5])) == (list(m.dst_kv_pages), m.dst_aux_index)
    assert _pil(msg[6], "i") == [list(x.indices) for x in m.dst_state_indices]
    assert int(msg[7]) == m.required_dst_info_num
    prefix = int(msg[8]) if _opt(msg, 8) else None
    assert prefix == (m.decode_prefix_len if m.HasField("decode_prefix_len") else None)
    device = _ints(msg[9], "i") if _opt(msg, 9) else None
    assert device == (list(m.dst_device_kv_pages.pages) if m.HasField(
        "dst_device_kv_pages") else None)


@settings(max_examples=EXAMPLES)
@given(native_transfer_infos("nixl"))
def test_sglang_reads_our_nixl_transfer_info(m: TransferInfo) -> None:
    wire = nixl.build_transfer_info(m)  # nixl/conn.py listener + TransferInfo.from_zmq:
    assert wire[0] == b"NixlMsgGuard"
    msg = wire[1:]
    assert (int(msg[0]), msg[1].decode("ascii"), int(msg[2]), msg[3].decode("ascii")) == (
        m.room, m.notify_endpoint.host, m.notify_endpoint.port, m.peer_name)
    assert (_ints(msg[4], "i"), int(msg[5]), int(msg[6])) == (
        list(m.dst_kv_pages), m.dst_aux_index, m.required_dst_info_num)
    assert _pil(msg[7], "i") == [list(x.indices) for x in m.dst_state_indices]
    assert int(msg[8]) == m.decode_prefix_len  # unset is sent as 0, which SGLang reads as 0
    assert msg[9] == (b"1" if m.is_dummy else b"0")


@settings(max_examples=EXAMPLES)
@given(U64, STATES, U32, UTF8)
def test_sglang_reads_our_status(room: int, state: int, rank: int, reason: str) -> None:
    m = TransferStatus(room=room, state=state, prefill_rank=rank,  # type: ignore[arg-type]
                       failure_reason=reason)
    mc = mooncake.build_status(m)  # common/conn.py parse_kv_status_message, MC flags
    assert [int(x) for x in mc] == [room, KVPOLL[state], rank]
    nx = nixl.build_status(m)  # NIXL flags: tag, then the reason frame
    assert nx[0] == b"KV_STATUS" and [int(x) for x in nx[1:4]] == [room, KVPOLL[state], rank]
    assert (nx[4].decode("utf-8") if nx[4] else None) == (reason or None)


# --- the other direction: frames as SGLang's builders write them parse with ours --------

def _pack_pil(lists: list[list[int]], fmt: str) -> bytes:
    """common/utils.py pack_int_lists."""
    if not lists:
        return b""
    size = struct.calcsize("<" + fmt)
    return struct.pack(f"<{len(lists) + 1}I", len(lists), *(len(x) * size for x in lists)) + \
        b"".join(struct.pack(f"<{len(x)}{fmt}", *x) for x in lists)


def _q(values: list[int], fmt: str = "Q") -> bytes:
    return struct.pack(f"{len(values)}{fmt}", *values)


@st.composite
def sglang_kv_args(draw: st.DrawFn) -> dict[str, Any]:
    """The decode-side values SGLang's registration builders read (inventory section 5)."""
    n = draw(st.integers(0, 4))
    lists = lambda elem: draw(st.lists(st.lists(elem, max_size=2), max_size=3))  # noqa: E731
    staging = None
    if draw(st.booleans()):
        staging = (draw(st.integers(1, 2**64 - 1)), draw(U64), draw(st.lists(U64, max_size=3)))
    return {
        "ip": draw(ASCII), "port": draw(st.integers(1, 65535)), "name": draw(ASCII),
        "metadata": draw(st.binary(max_size=8)), "gpu_id": draw(U32),
        "kv_ptrs": draw(st.lists(U64, min_size=n, max_size=n)),
        "kv_item_lens": draw(st.lists(U64, min_size=n, max_size=n)),
        "kv_layer_ids": draw(st.lists(U32, min_size=n, max_size=n) | st.just([])),
        "mem_kinds": draw(st.lists(st.sampled_from(["VRAM", "DRAM"]), min_size=n, max_size=n)),
        "aux_ptrs": draw(st.lists(U64, max_size=2)), "rank": draw(U32), "tp": draw(U32),
        "state_ptrs": lists(U64), "state_item_lens": lists(U32), "state_dims": lists(U32),
        "state_layer_ids": lists(U32), "state_data_lens": lists(U64),
        "staging": staging, "num_slots": draw(U32),
        "dcp": (draw(st.integers(1, 64)), draw(st.integers(0, 63))),
    }


def _state_lists(m: KvRegistration, attr: str, slot: int) -> list[list[int]]:
    n = m.legacy.list_lengths.get(slot, len(m.state_buffers))
    return [list(getattr(s, attr)) for s in m.state_buffers[:n]]


@settings(max_examples=EXAMPLES)
@given(sglang_kv_args())
def test_our_parser_reads_sglang_mooncake_registration(a: dict[str, Any]) -> None:
    st_ = a["staging"]
    frames = [  # mooncake/conn.py build_receiver_registration_message, in builder order
        b"None", a["ip"].encode(), str(a["port"]).encode(), a["name"].encode(),
        _q(a["kv_ptrs"]), _q(a["aux_ptrs"]), _pack_pil(a["state_ptrs"], "Q"),
        str(a["rank"]).encode(), str(a["tp"]).encode(),
        str(a["kv_item_lens"][0] if a["kv_item_lens"] else 0).encode(),
        _pack_pil(a["state_item_lens"], "I"), _pack_pil(a["state_dims"], "I"),
        _q(a["kv_layer_ids"], "I"), _pack_pil(a["state_layer_ids"], "I"),
        struct.pack("Q", st_[0]) if st_ else b"", str(st_[1]).encode() if st_ else b"",
        str(a["dcp"][0]).encode(), str(a["dcp"][1]).encode(), _q(st_[2] if st_ else []),
        _q(a["kv_item_lens"]),
    ]
    m = mooncake.parse_registration(frames).message
    assert mooncake.build_registration(m) == frames
    assert [b.ptr for b in m.kv_buffers] == a["kv_ptrs"]
    assert [b.item_len for b in m.kv_buffers] == a["kv_item_lens"]
    assert [b.layer_id for b in m.kv_buffers if b.HasField("layer_id")] == a["kv_layer_ids"]
    assert (m.attn_tp.rank, m.attn_tp.size, m.mooncake.session_id) == (a["rank"], a["tp"],
                                                                       a["name"])
    for attr, key, slot in (("data_ptrs", "state_ptrs", 6), ("item_lens", "state_item_lens", 10),
                            ("dim_per_tensors", "state_dims", 11),
                            ("layer_ids", "state_layer_ids", 13)):
        assert _state_lists(m, attr, slot) == a[key]
    staging = (m.staging.base_ptr, m.staging.total_size, list(m.staging.slot_layer_ids))
    assert (staging if m.HasField("staging") else None) == st_
    assert (m.dcp.size, m.dcp.rank) == a["dcp"]


@settings(max_examples=EXAMPLES)
@given(sglang_kv_args())
def test_our_parser_reads_sglang_nixl_registration(a: dict[str, Any]) -> None:
    st_ = a["staging"]
    frames = [  # nixl/conn.py build_receiver_registration_message, in builder order
        b"NixlMsgGuard", b"None", a["ip"].encode(), str(a["port"]).encode(), a["name"].encode(),
        a["metadata"], _q(a["kv_ptrs"]), _q(a["aux_ptrs"]), _pack_pil(a["state_ptrs"], "Q"),
        str(a["gpu_id"]).encode(), str(a["tp"]).encode(), str(a["rank"]).encode(),
        str(a["kv_item_lens"][0] if a["kv_item_lens"] else 0).encode(),
        _pack_pil(a["state_item_lens"], "I"), _pack_pil(a["state_dims"], "I"),
        struct.pack("Q", st_[0]) if st_ else b"", str(st_[1]).encode() if st_ else b"",
        str(a["num_slots"]).encode(), ",".join(a["mem_kinds"]).encode("ascii"),
        _q(a["kv_item_lens"]), _pack_pil(a["state_layer_ids"], "I"), _q(a["kv_layer_ids"], "I"),
        str(a["dcp"][0]).encode(), str(a["dcp"][1]).encode(), _pack_pil(a["state_data_lens"], "Q"),
    ]
    m = nixl.parse_registration(frames).message
    assert nixl.build_registration(m) == frames
    assert [b.ptr for b in m.kv_buffers] == a["kv_ptrs"]
    assert [b.item_len for b in m.kv_buffers] == a["kv_item_lens"]
    kinds = {MEMORY_KIND_VRAM: "VRAM", MEMORY_KIND_DRAM: "DRAM"}
    assert [kinds[b.memory_kind] for b in m.kv_buffers] == a["mem_kinds"]
    assert (m.gpu_id, m.num_slots, m.nixl.agent_metadata) == (a["gpu_id"], a["num_slots"],
                                                             a["metadata"])
    for attr, key, slot in (("data_ptrs", "state_ptrs", 7), ("item_lens", "state_item_lens", 12),
                            ("dim_per_tensors", "state_dims", 13),
                            ("layer_ids", "state_layer_ids", 19),
                            ("data_lens", "state_data_lens", 23)):
        assert _state_lists(m, attr, slot) == a[key]
    assert (m.HasField("staging"), m.staging.base_ptr, m.staging.total_size) == (
        st_ is not None, st_[0] if st_ else 0, st_[1] if st_ else 0)
    assert (m.dcp.size, m.dcp.rank) == a["dcp"]
