"""SGLang 0.5.23 NIXL positional frames <-> pdproto.v1 messages.

Slot layouts follow the wire inventory: registration section 1.3 (25 wire
frames), TransferInfo section 1.5 (11 wire frames). Both start with the
``b"NixlMsgGuard"`` frame, which ``parse_*`` requires and ``build_*`` emits;
slot numbers here (and in ``LegacyFraming``) are parser numbers, i.e. wire
index minus one. Status (``KV_STATUS``-tagged, section 1.6) and the shared
tagged messages of sections 1.7-1.9 travel without the guard.
BOOTSTRAP and AUX_DATA are Mooncake only.
"""

from __future__ import annotations

from pdproto.errors import Reason
from pdproto.legacy import _common
from pdproto.legacy._codec import (
    I32_MAX,
    I32_MIN,
    NIXL_GUARD,
    U32_MAX,
    CodecProblem,
    FrameReader,
    FrameWriter,
    ParseResult,
)
from pdproto.legacy._entries import (
    KvSlots,
    StateSlot,
    read_dcp,
    read_kv_buffers,
    read_staging,
    read_state_buffers,
    write_dcp,
    write_kv_buffers,
    write_staging,
    write_state_buffers,
)
from pdproto.v1 import (
    AbortAck,
    AbortNotification,
    ChunkReady,
    KvRegistration,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    StateIndices,
    TransferInfo,
    TransferStatus,
)

BACKEND = "NIXL"
GUARD = NIXL_GUARD
"""The guard frame SGLang's NIXL prefill listener asserts (wire frame 0)."""
REGISTRATION_FRAMES = 24
"""Parser frames in the current registration layout (25 on the wire with the guard)."""
TRANSFER_INFO_FRAMES = 10
"""Parser frames in the current TransferInfo layout (11 on the wire with the guard)."""

_REG = f"{BACKEND} KVArgsRegisterInfo"
_KV = KvSlots(ptrs=5, item_lens=18, layer_ids=20, mem_kinds=17)
_STATE = (
    StateSlot(7, "data_ptrs", "Q", "dst_state_data_ptrs"),
    StateSlot(12, "item_lens", "I", "dst_state_item_lens"),
    StateSlot(13, "dim_per_tensors", "I", "dst_state_dim_per_tensor"),
    StateSlot(19, "layer_ids", "I", "dst_state_layer_ids"),
    StateSlot(23, "data_lens", "Q", "dst_state_data_lens"),
)
_STAGING_BASE, _NUM_SLOTS, _DCP_SIZE, _DCP_RANK = 14, 16, 21, 22
_REG_RECORDABLE = frozenset({_STAGING_BASE, _STAGING_BASE + 1, _KV.item_lens, _DCP_SIZE,
                             _DCP_RANK})


def parse_registration(frames: list[bytes]) -> ParseResult[KvRegistration]:
    """Parse M1 (guard, then ``KVArgsRegisterInfo.from_zmq``, nixl/conn.py:341-456)."""
    r = FrameReader.open(frames, _REG, full=REGISTRATION_FRAMES, minimum=12, guarded=True)
    r.expect(0, "room", b"None")
    msg = KvRegistration(kv_item_len=r.num(11, "dst_kv_item_len"),
                         gpu_id=r.num(8, "gpu_id", hi=U32_MAX))
    msg.notify_endpoint.CopyFrom(_common.read_endpoint(r, 1, 2, "endpoint", "dst_port"))
    msg.nixl.agent_name = r.text(3, "agent_name")
    msg.nixl.agent_metadata = r.frames[4]
    msg.aux_ptrs.extend(r.array(6, "dst_aux_ptrs", "Q"))
    msg.attn_tp.size = r.num(9, "decode_tp_size", hi=U32_MAX)
    msg.attn_tp.rank = r.num(10, "decode_tp_rank", hi=U32_MAX)
    msg.kv_buffers.extend(read_kv_buffers(r, _KV, msg.kv_item_len))
    msg.state_buffers.extend(read_state_buffers(r, _STATE))
    if not r.has(23) and msg.state_buffers:
        r.assume("dst_state_data_lens absent: decode predates prepared state transfers")
    read_staging(r, msg, _STAGING_BASE, None)
    num_slots = r.opt_num(_NUM_SLOTS, "dst_num_slots", hi=U32_MAX)
    if num_slots is not None:
        msg.num_slots = num_slots
    read_dcp(r, msg, _DCP_SIZE, _DCP_RANK)
    return r.result(msg, msg.legacy)


def build_registration(message: KvRegistration) -> list[bytes]:
    """Build M1 frames as ``build_receiver_registration_message`` (nixl/conn.py:3467-3493)."""
    msg = message
    w = FrameWriter(_REG, full=REGISTRATION_FRAMES, minimum=12,
                    framing=msg.legacy if msg.HasField("legacy") else None,
                    recordable=_REG_RECORDABLE, prefix=(GUARD,))
    if msg.WhichOneof("transport") != "nixl":
        raise w.unrepresentable(3, "nixl.agent_name",
                                "a NIXL registration needs the nixl transport set")
    w.raw(0, "room", b"None")
    _common.write_endpoint(w, msg.notify_endpoint, 1, 2, "endpoint", "dst_port")
    w.text(3, "agent_name", msg.nixl.agent_name)
    w.raw(4, "agent_metadata", msg.nixl.agent_metadata)
    w.array(6, "dst_aux_ptrs", msg.aux_ptrs, "Q")
    w.num(8, "gpu_id", msg.gpu_id)
    w.num(9, "decode_tp_size", msg.attn_tp.size)
    w.num(10, "decode_tp_rank", msg.attn_tp.rank)
    w.num(11, "dst_kv_item_len", msg.kv_item_len)
    write_kv_buffers(w, _KV, msg)
    write_state_buffers(w, _STATE, msg.state_buffers)
    write_staging(w, msg, _STAGING_BASE, None)
    w.opt_num(_NUM_SLOTS, "dst_num_slots", msg.num_slots if msg.HasField("num_slots") else None)
    write_dcp(w, msg, _DCP_SIZE, _DCP_RANK)
    return w.done()


_TI = f"{BACKEND} TransferInfo"
_PREFIX, _DUMMY_FLAG = 8, 9


def _inferred_dummy(msg: TransferInfo) -> bool:
    """SGLang's rule when the flag frame is absent (nixl/conn.py:311-325)."""
    return not msg.dst_kv_pages and not msg.decode_prefix_len


def parse_transfer_info(frames: list[bytes]) -> ParseResult[TransferInfo]:
    """Parse M2 (guard, then ``TransferInfo.from_zmq``, nixl/conn.py:284-338)."""
    r = FrameReader.open(frames, _TI, full=TRANSFER_INFO_FRAMES, minimum=7, guarded=True)
    msg = TransferInfo(room=r.num(0, "room"), peer_name=r.text(3, "agent_name"),
                       dst_aux_index=r.num(5, "dst_aux_index", lo=I32_MIN, hi=I32_MAX),
                       required_dst_info_num=r.num(6, "required_dst_info_num", hi=U32_MAX))
    msg.notify_endpoint.CopyFrom(_common.read_endpoint(r, 1, 2, "endpoint", "dst_port"))
    msg.dst_kv_pages.extend(r.array(4, "dst_kv_indices", "i"))
    msg.dst_state_indices.extend(
        StateIndices(indices=x) for x in r.lists(7, "dst_state_indices", "i"))
    prefix = r.opt_num(_PREFIX, "decode_prefix_len", record=True)
    if prefix is not None:
        msg.decode_prefix_len = prefix
    flag = r.raw(_DUMMY_FLAG)
    if flag in (b"0", b"1"):
        msg.is_dummy = flag == b"1"
    elif flag:
        raise r.error(_DUMMY_FLAG, "is_dummy", CodecProblem(
            Reason.LEGACY_BAD_VALUE, f'expected b"0" or b"1", found {flag!r}'))
    else:
        if flag == b"":
            r.record_empty(_DUMMY_FLAG)
        msg.is_dummy = _inferred_dummy(msg)
        r.assume(f"is_dummy flag absent: inferred {msg.is_dummy} from empty kv indices and "
                 "decode_prefix_len")
    return r.result(msg, msg.legacy)


def build_transfer_info(message: TransferInfo) -> list[bytes]:
    """Build M2 frames as ``build_receiver_metadata_message`` (nixl/conn.py:3514-3526)."""
    msg = message
    w = FrameWriter(_TI, full=TRANSFER_INFO_FRAMES, minimum=7,
                    framing=msg.legacy if msg.HasField("legacy") else None,
                    recordable=(_PREFIX, _DUMMY_FLAG), prefix=(GUARD,))
    if not msg.HasField("dst_aux_index"):
        raise w.unrepresentable(5, "dst_aux_index",
                                "NIXL always sends an aux index, also for dummies")
    w.num(0, "room", msg.room)
    _common.write_endpoint(w, msg.notify_endpoint, 1, 2, "endpoint", "dst_port")
    w.text(3, "agent_name", msg.peer_name)
    w.array(4, "dst_kv_indices", msg.dst_kv_pages, "i")
    w.num(5, "dst_aux_index", msg.dst_aux_index)
    w.num(6, "required_dst_info_num", msg.required_dst_info_num)
    w.lists(7, "dst_state_indices", [list(x.indices) for x in msg.dst_state_indices], "i")
    if msg.HasField("decode_prefix_len"):
        w.num(_PREFIX, "decode_prefix_len", msg.decode_prefix_len)
    else:
        # SGLang's NIXL builder always sends a number here and the inventory does not
        # promise that its parser tolerates an empty frame, so "not set" goes out as 0
        # (what SGLang reads None as) unless the message recorded an empty frame.
        w.num(_PREFIX, "decode_prefix_len", 0, default=True)
    if w.carries(_DUMMY_FLAG):
        w.num(_DUMMY_FLAG, "is_dummy", int(msg.is_dummy))
    else:
        w.raw(_DUMMY_FLAG, "is_dummy", b"", default=msg.is_dummy == _inferred_dummy(msg))
    return w.done()


_STATUS = f"{BACKEND} status"


def parse_status(frames: list[bytes]) -> ParseResult[TransferStatus]:
    """Parse M3 ``[KV_STATUS, room, status, prefill_rank, reason]`` (common/conn.py:739-808)."""
    r = FrameReader.open(frames, _STATUS, full=5, minimum=4)
    r.expect(0, "tag", _common.KV_STATUS)
    msg = TransferStatus(room=r.num(1, "room"), state=_common.read_state(r, 2),
                         prefill_rank=r.num(3, "prefill_rank", hi=U32_MAX))
    if r.has(4):
        msg.failure_reason = r.text(4, "reason", "utf-8")
    return r.result(msg, msg.legacy)


def build_status(message: TransferStatus) -> list[bytes]:
    """Build M3 frames (``_encode_kv_status_message`` with the NIXL class flags)."""
    w = FrameWriter(_STATUS, full=5, minimum=4,
                    framing=message.legacy if message.HasField("legacy") else None)
    w.raw(0, "tag", _common.KV_STATUS)
    w.num(1, "room", message.room)
    _common.write_state(w, 2, message.state)
    w.num(3, "prefill_rank", message.prefill_rank)
    w.text(4, "reason", message.failure_reason, "utf-8", default=not message.failure_reason)
    return w.done()


def parse_abort(frames: list[bytes]) -> ParseResult[AbortNotification]:
    """Parse M4 ``ABORT`` (2, 4 or 5 frames, no guard)."""
    return _common.parse_abort(frames, BACKEND)


def build_abort(message: AbortNotification) -> list[bytes]:
    """Build M4 ``ABORT``."""
    return _common.build_abort(message, BACKEND)


_ACK_COUNTS = (3, 4)  # NIXL never sends the 2-frame legacy ack (nixl/conn.py:3340-3346)


def parse_abort_ack(frames: list[bytes]) -> ParseResult[AbortAck]:
    """Parse M5 ``ABORT_ACK`` (3 or 4 frames)."""
    return _common.parse_abort_ack(frames, BACKEND, _ACK_COUNTS)


def build_abort_ack(message: AbortAck) -> list[bytes]:
    """Build M5 ``ABORT_ACK``; prefill_rank is required on NIXL."""
    return _common.build_abort_ack(message, BACKEND, _ACK_COUNTS)


def parse_staging_req(frames: list[bytes]) -> ParseResult[StagingRequest]:
    """Parse M7 ``STAGING_REQ``."""
    return _common.parse_staging_req(frames, BACKEND)


def build_staging_req(message: StagingRequest) -> list[bytes]:
    """Build M7 ``STAGING_REQ`` (NIXL senders leave requester_pp_rank unset)."""
    return _common.build_staging_req(message, BACKEND)


def parse_staging_rsp(frames: list[bytes]) -> ParseResult[StagingResponse]:
    """Parse M8 ``STAGING_RSP``."""
    return _common.parse_staging_rsp(frames, BACKEND)


def build_staging_rsp(message: StagingResponse) -> list[bytes]:
    """Build M8 ``STAGING_RSP``."""
    return _common.build_staging_rsp(message, BACKEND)


def parse_watermark(frames: list[bytes]) -> ParseResult[StagingWatermark]:
    """Parse M9 ``WATERMARK``."""
    return _common.parse_watermark(frames, BACKEND)


def build_watermark(message: StagingWatermark) -> list[bytes]:
    """Build M9 ``WATERMARK``."""
    return _common.build_watermark(message, BACKEND)


def parse_chunk_ready(frames: list[bytes]) -> ParseResult[ChunkReady]:
    """Parse M10 ``CHUNK_READY``."""
    return _common.parse_chunk_ready(frames, BACKEND)


def build_chunk_ready(message: ChunkReady) -> list[bytes]:
    """Build M10 ``CHUNK_READY``."""
    return _common.build_chunk_ready(message, BACKEND)
