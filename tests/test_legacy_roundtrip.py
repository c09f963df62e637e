"""Property tests: parse(build(m)).message == m for every legacy message and backend.

The strategies draw messages in the form the parser produces (a message plus the
LegacyFraming that a short or sparse frame list needs), including older senders'
shorter layouts, recorded empty slots and state lists of different outer lengths.
A protobuf serialize/parse round trip sits between build and parse, because the
message alone must carry everything needed to rebuild the frames.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.legacy import classify, mooncake, nixl
from pdproto.legacy._common import KVPOLL_TO_STATE
from pdproto.v1 import (
    MEMORY_KIND_DRAM,
    MEMORY_KIND_VRAM,
    STAGING_ALLOCATION_GRANTED,
    STAGING_ALLOCATION_OVERSIZED,
    STAGING_ALLOCATION_PENDING,
    AbortAck,
    AbortNotification,
    AuxData,
    ChunkReady,
    KvRegistration,
    LegacyFraming,
    PrefillCompleteBootstrap,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    TransferInfo,
    TransferStatus,
)

M = TypeVar("M", bound=Message)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
ASCII = st.text(st.characters(max_codepoint=127), max_size=12)
UTF8 = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
SMALL = {"max_size": 4}
# The legacy suite's whole budget is ~20 s on a shared 2-core machine; raise for soak runs.
EXAMPLES = int(os.environ.get("LEGACY_EXAMPLES", "40"))


def _reserialize(msg: M) -> M:
    """The message as a peer would see it after protobuf transport."""
    out = type(msg)()
    out.ParseFromString(msg.SerializeToString())
    return out


def _round_trip(msg: M, build: Callable[[M], list[bytes]],
                parse: Callable[[list[bytes]], Any]) -> list[bytes]:
    frames = build(msg)
    result = parse(frames)
    assert result.message == msg
    again = build(_reserialize(result.message))
    assert again == frames
    return frames


def _set_framing(msg: Any, count: int, full: int, empties: set[int],
                 lengths: dict[int, int] | None = None) -> None:
    framing = LegacyFraming(frame_count=count if count < full else 0,
                            empty_slots=sorted(empties))
    for slot, n in (lengths or {}).items():
        framing.list_lengths[slot] = n
    if framing.frame_count or framing.empty_slots or framing.list_lengths:
        msg.legacy.CopyFrom(framing)


# Registration layouts, by parser slot (inventory 1.2 and 1.3).
MC_REG = {"full": 20, "min": 10, "item_lens": 19, "layer_ids": 12, "kinds": None,
          "state": {6: "data_ptrs", 10: "item_lens", 11: "dim_per_tensors", 13: "layer_ids"},
          "staging": 14, "slot_ids": 18, "num_slots": None, "dcp": 16}
NX_REG = {"full": 24, "min": 12, "item_lens": 18, "layer_ids": 20, "kinds": 17,
          "state": {7: "data_ptrs", 12: "item_lens", 13: "dim_per_tensors", 19: "layer_ids",
                    23: "data_lens"},
          "staging": 14, "slot_ids": None, "num_slots": 16, "dcp": 21}
_STATE_ELEM = {"data_ptrs": U64, "item_lens": U32, "dim_per_tensors": U32, "layer_ids": U32,
               "data_lens": U64}


@st.composite
def registrations(draw: st.DrawFn, layout: dict[str, Any]) -> KvRegistration:
    """A KvRegistration exactly as the parser would produce it for ``layout``."""
    full = layout["full"]
    count = draw(st.integers(layout["min"], full))
    has = lambda slot: slot < count  # noqa: E731
    empties: set[int] = set()
    msg = KvRegistration(kv_item_len=draw(U64))
    msg.notify_endpoint.host = draw(ASCII)
    msg.notify_endpoint.port = draw(U32)
    if layout is MC_REG:
        msg.mooncake.session_id = draw(ASCII)
    else:
        msg.nixl.agent_name = draw(ASCII)
        msg.nixl.agent_metadata = draw(st.binary(max_size=16))
        msg.gpu_id = draw(U32)
    msg.attn_tp.size, msg.attn_tp.rank = draw(U32), draw(U32)
    msg.aux_ptrs.extend(draw(st.lists(U64, **SMALL)))
    # KV entries: parallel lists of one length, layer ids all-or-none.
    n = draw(st.integers(0, 4))
    ids = draw(st.lists(U32, min_size=n, max_size=n)) if has(layout["layer_ids"]) and \
        draw(st.booleans()) else None
    lens_slot = layout["item_lens"]
    lens_carried = has(lens_slot) and not (n and draw(st.booleans()))
    if has(lens_slot) and not lens_carried:
        empties.add(lens_slot)
    kinds = None
    if layout["kinds"] is not None and has(layout["kinds"]) and n and draw(st.booleans()):
        kinds = draw(st.lists(st.sampled_from([MEMORY_KIND_VRAM, MEMORY_KIND_DRAM]),
                              min_size=n, max_size=n))
    for i in range(n):
        buf = msg.kv_buffers.add(ptr=draw(U64),
                                 item_len=draw(U64) if lens_carried else msg.kv_item_len)
        if ids is not None:
            buf.layer_id = ids[i]
        if kinds is not None:
            buf.memory_kind = kinds[i]
    # State lists: each present slot has its own outer length.
    present = {s: a for s, a in layout["state"].items() if has(s)}
    outer = {s: draw(st.integers(0, 3)) for s in present}
    total = max(outer.values(), default=0)
    for i in range(total):
        buf = msg.state_buffers.add()
        for s, attr in present.items():
            if i < outer[s]:
                getattr(buf, attr).extend(draw(st.lists(_STATE_ELEM[attr], max_size=3)))
    lengths = {s: n_s for s, n_s in outer.items() if n_s < total}
    # Staging: base (Q or empty) and size (A or empty), Mooncake slot ids.
    base = layout["staging"]
    if has(base) and draw(st.booleans()):
        base_empty = draw(st.booleans())
        size_empty = has(base + 1) and draw(st.booleans())
        slot_ids = layout["slot_ids"]
        ids_list = draw(st.lists(U64, **SMALL)) if slot_ids is not None and has(slot_ids) else []
        if not (base_empty and (size_empty or not has(base + 1)) and not ids_list):
            msg.staging.base_ptr = 0 if base_empty else draw(U64)
            msg.staging.total_size = draw(U64) if has(base + 1) and not size_empty else 0
            msg.staging.slot_layer_ids.extend(ids_list)
            empties |= {base} if base_empty else set()
            empties |= {base + 1} if size_empty else set()
    if layout["num_slots"] is not None and has(layout["num_slots"]) and draw(st.booleans()):
        msg.num_slots = draw(U32)
    # DCP: unset only when both slots are absent or recorded empty.
    size_slot, rank_slot = layout["dcp"], layout["dcp"] + 1
    dcp_empty = {s for s in (size_slot, rank_slot) if has(s) and draw(st.booleans())}
    carried = [s for s in (size_slot, rank_slot) if has(s) and s not in dcp_empty]
    if carried:
        msg.dcp.size = draw(U32) if size_slot in carried else 0
        msg.dcp.rank = draw(U32) if rank_slot in carried else 0
    empties |= dcp_empty
    _set_framing(msg, count, full, empties, lengths)
    return msg


@settings(max_examples=EXAMPLES)
@given(registrations(MC_REG))
def test_mooncake_registration_round_trip(msg: KvRegistration) -> None:
    frames = _round_trip(msg, mooncake.build_registration, mooncake.parse_registration)
    assert classify(frames).kind.value == "registration"


@settings(max_examples=EXAMPLES)
@given(registrations(NX_REG))
def test_nixl_registration_round_trip(msg: KvRegistration) -> None:
    frames = _round_trip(msg, nixl.build_registration, nixl.parse_registration)
    assert frames[0] == nixl.GUARD and len(frames) <= 25
    assert classify(frames).backend is not None


def _transfer_common(draw: st.DrawFn, with_state: bool) -> TransferInfo:
    msg = TransferInfo(room=draw(U64), peer_name=draw(ASCII),
                       required_dst_info_num=draw(U32))
    msg.notify_endpoint.host = draw(ASCII)
    msg.notify_endpoint.port = draw(U32)
    for inner in draw(st.lists(st.lists(I32, **SMALL), **SMALL)) if with_state else []:
        msg.dst_state_indices.add(indices=inner)
    return msg


@st.composite
def mooncake_transfer_infos(draw: st.DrawFn) -> TransferInfo:
    """Mooncake TransferInfo: 8-10 frames, dummy = no kv pages and no aux index."""
    count = draw(st.integers(8, 10))
    msg = _transfer_common(draw, with_state=True)
    if draw(st.booleans()):
        msg.is_dummy = True
    else:
        msg.dst_kv_pages.extend(draw(st.lists(I32, max_size=6)))
        msg.dst_aux_index = draw(I32)
    if count > 8 and draw(st.booleans()):
        msg.decode_prefix_len = draw(U64)
    if count > 9 and draw(st.booleans()):
        msg.dst_device_kv_pages.pages.extend(draw(st.lists(I32, min_size=1, max_size=4)))
    _set_framing(msg, count, 10, set())
    return msg


@st.composite
def nixl_transfer_infos(draw: st.DrawFn) -> TransferInfo:
    """NIXL TransferInfo: 7-10 parser frames, explicit or inferred dummy flag."""
    count = draw(st.integers(7, 10))
    msg = _transfer_common(draw, with_state=count > 7)
    msg.dst_kv_pages.extend(draw(st.lists(I32, max_size=6)))
    msg.dst_aux_index = draw(I32)
    empties: set[int] = set()
    if count > 8:  # an unset prefix is an empty frame here; unset and not empty is sent as 0
        if draw(st.booleans()):
            msg.decode_prefix_len = draw(st.sampled_from([0, 1, 2**64 - 1]) | U64)
        else:
            empties.add(8)
    if count > 9 and draw(st.booleans()):
        msg.is_dummy = draw(st.booleans())
    else:
        if count > 9:
            empties.add(9)
        msg.is_dummy = not msg.dst_kv_pages and not msg.decode_prefix_len
    _set_framing(msg, count, 10, empties)
    return msg


@settings(max_examples=EXAMPLES)
@given(mooncake_transfer_infos())
def test_mooncake_transfer_info_round_trip(msg: TransferInfo) -> None:
    frames = _round_trip(msg, mooncake.build_transfer_info, mooncake.parse_transfer_info)
    assert classify(frames).kind.value == "transfer_info"


@settings(max_examples=EXAMPLES)
@given(nixl_transfer_infos())
def test_nixl_transfer_info_round_trip(msg: TransferInfo) -> None:
    frames = _round_trip(msg, nixl.build_transfer_info, nixl.parse_transfer_info)
    assert classify(frames).kind.value == "transfer_info"


STATES = st.sampled_from(sorted(KVPOLL_TO_STATE.values()))


@settings(max_examples=EXAMPLES)
@given(U64, STATES, U32)
def test_mooncake_status_round_trip(room: int, state: int, rank: int) -> None:
    msg = TransferStatus(room=room, state=state, prefill_rank=rank)  # type: ignore[arg-type]
    frames = _round_trip(msg, mooncake.build_status, mooncake.parse_status)
    assert len(frames) == 3


@settings(max_examples=EXAMPLES)
@given(U64, STATES, U32, UTF8, st.booleans())
def test_nixl_status_round_trip(room: int, state: int, rank: int, reason: str,
                                short: bool) -> None:
    msg = TransferStatus(room=room, state=state, prefill_rank=rank)  # type: ignore[arg-type]
    if short:
        msg.legacy.frame_count = 4
    else:
        msg.failure_reason = reason
    _round_trip(msg, nixl.build_status, nixl.parse_status)


@st.composite
def aborts(draw: st.DrawFn) -> AbortNotification:
    """ABORT with 2, 4 or 5 frames."""
    msg = AbortNotification(room=draw(U64))
    if draw(st.booleans()):
        msg.reply_endpoint.host = draw(ASCII)
        msg.reply_endpoint.port = draw(U32)
        if draw(st.booleans()):
            msg.generation = draw(U64)
    return msg


@st.composite
def abort_acks(draw: st.DrawFn, rank_required: bool) -> AbortAck:
    """ABORT_ACK with 2 (Mooncake legacy), 3 or 4 frames."""
    msg = AbortAck(room=draw(U64))
    if rank_required or draw(st.booleans()):
        msg.prefill_rank = draw(U32)
        if draw(st.booleans()):
            msg.generation = draw(U64)
    return msg


BACKENDS = st.sampled_from([mooncake, nixl])


@settings(max_examples=EXAMPLES)
@given(BACKENDS, aborts())
def test_abort_round_trip(backend: Any, msg: AbortNotification) -> None:
    _round_trip(msg, backend.build_abort, backend.parse_abort)


@settings(max_examples=EXAMPLES)
@given(abort_acks(rank_required=False))
def test_mooncake_abort_ack_round_trip(msg: AbortAck) -> None:
    _round_trip(msg, mooncake.build_abort_ack, mooncake.parse_abort_ack)


@settings(max_examples=EXAMPLES)
@given(abort_acks(rank_required=True))
def test_nixl_abort_ack_round_trip(msg: AbortAck) -> None:
    _round_trip(msg, nixl.build_abort_ack, nixl.parse_abort_ack)


@settings(max_examples=EXAMPLES)
@given(U64, ASCII, U32)
def test_mooncake_bootstrap_round_trip(room: int, host: str, port: int) -> None:
    msg = PrefillCompleteBootstrap(room=room)
    msg.decode_endpoint.host, msg.decode_endpoint.port = host, port
    _round_trip(msg, mooncake.build_bootstrap, mooncake.parse_bootstrap)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, U32, ASCII, st.none() | U32)
def test_staging_req_round_trip(backend: Any, room: int, chunk: int, pages: int, session: str,
                                pp: int | None) -> None:
    msg = StagingRequest(room=room, chunk_index=chunk, chunk_pages=pages, session_id=session)
    if pp is not None:
        msg.requester_pp_rank = pp
    _round_trip(msg, backend.build_staging_req, backend.parse_staging_req)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, st.sampled_from([STAGING_ALLOCATION_GRANTED,
                                            STAGING_ALLOCATION_PENDING,
                                            STAGING_ALLOCATION_OVERSIZED]),
       st.integers(0, 2**63 - 1), U64, I64, ASCII)
def test_staging_rsp_round_trip(backend: Any, room: int, chunk: int, alloc: int, offset: int,
                                rnd: int, end: int, session: str) -> None:
    msg = StagingResponse(room=room, chunk_index=chunk, allocation=alloc,  # type: ignore[arg-type]
                          round=rnd, end=end, session_id=session)
    if alloc == STAGING_ALLOCATION_GRANTED:
        msg.offset = offset
    _round_trip(msg, backend.build_staging_rsp, backend.parse_staging_rsp)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U64, ASCII, st.booleans())
def test_watermark_round_trip(backend: Any, rnd: int, tail: int, session: str,
                              short: bool) -> None:
    msg = StagingWatermark(round=rnd, tail=tail)
    if short:
        msg.legacy.frame_count = 3
    else:
        msg.session_id = session
    _round_trip(msg, backend.build_watermark, backend.parse_watermark)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, U32, U32, ASCII, U32)
def test_chunk_ready_round_trip(backend: Any, room: int, chunk: int, start: int, pages: int,
                                writer: str, rank: int) -> None:
    msg = ChunkReady(room=room, chunk_index=chunk, page_start=start, num_pages=pages,
                     writer_id=writer, prefill_rank=rank)
    _round_trip(msg, backend.build_chunk_ready, backend.parse_chunk_ready)


@settings(max_examples=EXAMPLES)
@given(U64, U32, U32, st.binary(max_size=64))
def test_mooncake_aux_data_round_trip(room: int, buf: int, aux: int, data: bytes) -> None:
    msg = AuxData(room=room, buffer_index=buf, aux_index=aux, data=data)
    frames = _round_trip(msg, mooncake.build_aux_data, mooncake.parse_aux_data)
    assert frames[4] == len(data).to_bytes(4, "big")
