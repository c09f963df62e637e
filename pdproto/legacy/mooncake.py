"""SGLang 0.5.23 Mooncake positional frames <-> pdproto.v1 messages.

Slot layouts follow the wire inventory: registration section 1.2 (20 frames,
``b"None"`` in slot 0), TransferInfo section 1.5 (10 frames, dummy = empty
slots 4 and 5), the untagged 3-frame status of section 1.6, and the shared
tagged messages of sections 1.7-1.10. Mooncake frames carry no guard frame.
"""

from __future__ import annotations

from pdproto.errors import Reason
from pdproto.legacy import _common
from pdproto.legacy._codec import (
    I32_MAX,
    I32_MIN,
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
    TRANSFER_STATE_FAILED,
    AbortAck,
    AbortNotification,
    AuxData,
    ChunkReady,
    KvRegistration,
    PrefillCompleteBootstrap,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    StateIndices,
    TransferInfo,
    TransferStatus,
)

BACKEND = "Mooncake"
REGISTRATION_FRAMES = 20
"""Frames in the current registration layout; senders may stop after slot 9."""
TRANSFER_INFO_FRAMES = 10
"""Frames in the current TransferInfo layout; senders may stop after slot 7."""

_REG = f"{BACKEND} KVArgsRegisterInfo"
_KV = KvSlots(ptrs=4, item_lens=19, layer_ids=12)
STATE_SLOTS = (
    StateSlot(6, "data_ptrs", "Q", "dst_state_data_ptrs"),
    StateSlot(10, "item_lens", "I", "dst_state_item_lens"),
    StateSlot(11, "dim_per_tensors", "I", "dst_state_dim_per_tensor"),
    StateSlot(13, "layer_ids", "I", "dst_state_layer_ids"),
)
"""The registration's state lists: slot, ``StateBuffer`` field, element format, SGLang's name
(``dst_`` + the ``KVArgs`` attribute the decode's builder reads)."""
_STAGING_BASE, _STAGING_SIZE, _DCP_SIZE, _DCP_RANK, _SLOT_IDS = 14, 15, 16, 17, 18  # size = base + 1
# Slots whose empty frame is not the natural encoding of the message value, so
# parse records it in LegacyFraming.empty_slots (see docs/migration.md).
_REG_RECORDABLE = frozenset({_STAGING_BASE, _STAGING_SIZE, _DCP_SIZE, _DCP_RANK, _KV.item_lens})


def parse_registration(frames: list[bytes]) -> ParseResult[KvRegistration]:
    """Parse M1 (``KVArgsRegisterInfo.from_zmq``, mooncake/conn.py:153-229)."""
    r = FrameReader.open(frames, _REG, full=REGISTRATION_FRAMES, minimum=10)
    r.expect(0, "room", b"None")
    msg = KvRegistration(kv_item_len=r.num(9, "dst_kv_item_len"))
    msg.notify_endpoint.CopyFrom(_common.read_endpoint(r, 1, 2, "endpoint", "dst_port"))
    msg.mooncake.session_id = r.text(3, "mooncake_session_id")
    msg.aux_ptrs.extend(r.array(5, "dst_aux_ptrs", "Q"))
    msg.attn_tp.rank = r.num(7, "dst_tp_rank", hi=U32_MAX)
    msg.attn_tp.size = r.num(8, "dst_attn_tp_size", hi=U32_MAX)
    msg.kv_buffers.extend(read_kv_buffers(r, _KV, msg.kv_item_len))
    msg.state_buffers.extend(read_state_buffers(r, STATE_SLOTS))
    read_staging(r, msg, _STAGING_BASE, _SLOT_IDS)
    read_dcp(r, msg, _DCP_SIZE, _DCP_RANK)
    return r.result(msg, msg.legacy)


def build_registration(message: KvRegistration) -> list[bytes]:
    """Build M1 frames as ``build_receiver_registration_message`` (mooncake/conn.py:3255)."""
    msg = message
    w = FrameWriter(_REG, full=REGISTRATION_FRAMES, minimum=10,
                    framing=msg.legacy if msg.HasField("legacy") else None,
                    recordable=_REG_RECORDABLE)
    if msg.WhichOneof("transport") != "mooncake":
        raise w.unrepresentable(3, "mooncake.session_id",
                                "a Mooncake registration needs the mooncake transport set")
    w.raw(0, "room", b"None")
    _common.write_endpoint(w, msg.notify_endpoint, 1, 2, "endpoint", "dst_port")
    w.text(3, "mooncake_session_id", msg.mooncake.session_id)
    w.array(5, "dst_aux_ptrs", msg.aux_ptrs, "Q")
    w.num(7, "dst_tp_rank", msg.attn_tp.rank)
    w.num(8, "dst_attn_tp_size", msg.attn_tp.size)
    w.num(9, "dst_kv_item_len", msg.kv_item_len)
    write_kv_buffers(w, _KV, msg)
    write_state_buffers(w, STATE_SLOTS, msg.state_buffers)
    write_staging(w, msg, _STAGING_BASE, _SLOT_IDS)
    write_dcp(w, msg, _DCP_SIZE, _DCP_RANK)
    return w.done()


_TI = f"{BACKEND} TransferInfo"


def parse_transfer_info(frames: list[bytes]) -> ParseResult[TransferInfo]:
    """Parse M2 (``TransferInfo.from_zmq``, mooncake/conn.py:103-149)."""
    r = FrameReader.open(frames, _TI, full=TRANSFER_INFO_FRAMES, minimum=8)
    msg = TransferInfo(room=r.num(0, "room"), peer_name=r.text(3, "mooncake_session_id"),
                       required_dst_info_num=r.num(7, "required_dst_info_num", hi=U32_MAX))
    msg.notify_endpoint.CopyFrom(_common.read_endpoint(r, 1, 2, "endpoint", "dst_port"))
    if r.frames[4] == b"" and r.frames[5] == b"":
        msg.is_dummy = True  # SGLang's sentinel (mooncake/conn.py:121-125)
    elif r.frames[5] == b"":
        raise r.error(5, "dst_aux_index", CodecProblem(
            Reason.LEGACY_BAD_INTEGER, "empty, but slot 4 is not: an empty aux index is only "
            "valid in the dummy sentinel (slots 4 and 5 both empty)"))
    else:
        msg.dst_kv_pages.extend(r.array(4, "dst_kv_indices", "i"))
        msg.dst_aux_index = r.num(5, "dst_aux_index", lo=I32_MIN, hi=I32_MAX)
    msg.dst_state_indices.extend(
        StateIndices(indices=x) for x in r.lists(6, "dst_state_indices", "i"))
    prefix = r.opt_num(8, "decode_prefix_len")
    if prefix is not None:
        msg.decode_prefix_len = prefix
    if not r.blank(9):
        msg.dst_device_kv_pages.pages.extend(r.array(9, "dst_device_kv_indices", "i"))
    return r.result(msg, msg.legacy)


def build_transfer_info(message: TransferInfo) -> list[bytes]:
    """Build M2 frames as ``build_receiver_metadata_message`` (mooncake/conn.py:3293-3308)."""
    msg = message
    w = FrameWriter(_TI, full=TRANSFER_INFO_FRAMES, minimum=8,
                    framing=msg.legacy if msg.HasField("legacy") else None)
    w.num(0, "room", msg.room)
    _common.write_endpoint(w, msg.notify_endpoint, 1, 2, "endpoint", "dst_port")
    w.text(3, "mooncake_session_id", msg.peer_name)
    if msg.is_dummy:
        if msg.dst_kv_pages or msg.HasField("dst_aux_index"):
            raise w.unrepresentable(4, "is_dummy", "a Mooncake dummy is two empty slots (4, 5); "
                                    "it cannot also carry kv pages or an aux index")
        w.raw(4, "dst_kv_indices", b"")
        w.raw(5, "dst_aux_index", b"")
    else:
        if not msg.HasField("dst_aux_index"):
            raise w.unrepresentable(5, "dst_aux_index", "a non-dummy Mooncake TransferInfo "
                                    "needs an aux index (an empty slot 5 means dummy)")
        w.array(4, "dst_kv_indices", msg.dst_kv_pages, "i")
        w.num(5, "dst_aux_index", msg.dst_aux_index)
    w.lists(6, "dst_state_indices", [list(x.indices) for x in msg.dst_state_indices], "i")
    w.num(7, "required_dst_info_num", msg.required_dst_info_num)
    w.opt_num(8, "decode_prefix_len",
              msg.decode_prefix_len if msg.HasField("decode_prefix_len") else None)
    w.array(9, "dst_device_kv_indices", msg.dst_device_kv_pages.pages, "i")
    return w.done()


_STATUS = f"{BACKEND} status"


def parse_status(frames: list[bytes]) -> ParseResult[TransferStatus]:
    """Parse M3, the untagged ``[room, status, prefill_rank]`` (common/conn.py:739-808)."""
    r = FrameReader.open(frames, _STATUS, full=3, minimum=3)
    msg = TransferStatus(room=r.num(0, "room"), state=_common.read_state(r, 1),
                         prefill_rank=r.num(2, "prefill_rank", hi=U32_MAX))
    if msg.state == TRANSFER_STATE_FAILED:
        r.assume("no reason frame: SGLang's decode records its default failure reason")
    return r.result(msg)


def build_status(message: TransferStatus) -> list[bytes]:
    """Build M3 frames; Mooncake has no reason frame, so failure_reason is not sent."""
    w = FrameWriter(_STATUS, full=3, minimum=3, framing=None)
    w.num(0, "room", message.room)
    _common.write_state(w, 1, message.state)
    w.num(2, "prefill_rank", message.prefill_rank)
    return w.done()


def parse_abort(frames: list[bytes]) -> ParseResult[AbortNotification]:
    """Parse M4 ``ABORT`` (2, 4 or 5 frames)."""
    return _common.parse_abort(frames, BACKEND)


def build_abort(message: AbortNotification) -> list[bytes]:
    """Build M4 ``ABORT``."""
    return _common.build_abort(message, BACKEND)


_ACK_COUNTS = (2, 3, 4)  # 2 = the legacy ack sent when deferred release is off


def parse_abort_ack(frames: list[bytes]) -> ParseResult[AbortAck]:
    """Parse M5 ``ABORT_ACK`` (2, 3 or 4 frames)."""
    return _common.parse_abort_ack(frames, BACKEND, _ACK_COUNTS)


def build_abort_ack(message: AbortAck) -> list[bytes]:
    """Build M5 ``ABORT_ACK``; no prefill_rank gives the legacy 2-frame ack."""
    return _common.build_abort_ack(message, BACKEND, _ACK_COUNTS)


def parse_bootstrap(frames: list[bytes]) -> ParseResult[PrefillCompleteBootstrap]:
    """Parse M6 ``BOOTSTRAP`` (Mooncake only)."""
    return _common.parse_bootstrap(frames, BACKEND)


def build_bootstrap(message: PrefillCompleteBootstrap) -> list[bytes]:
    """Build M6 ``BOOTSTRAP``."""
    return _common.build_bootstrap(message, BACKEND)


def parse_staging_req(frames: list[bytes]) -> ParseResult[StagingRequest]:
    """Parse M7 ``STAGING_REQ`` (Mooncake appends requester_pp_rank)."""
    return _common.parse_staging_req(frames, BACKEND)


def build_staging_req(message: StagingRequest) -> list[bytes]:
    """Build M7 ``STAGING_REQ``."""
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


def parse_aux_data(frames: list[bytes]) -> ParseResult[AuxData]:
    """Parse M11 ``AUX_DATA`` (Mooncake only)."""
    return _common.parse_aux_data(frames, BACKEND)


def build_aux_data(message: AuxData) -> list[bytes]:
    """Build M11 ``AUX_DATA``."""
    return _common.build_aux_data(message, BACKEND)
