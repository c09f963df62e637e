"""SGLang 0.5.23 Mooncake positional frames <-> pdproto.v1 messages.

Slot layouts follow the wire inventory: registration section 1.2 (20 frames,
``b"None"`` in slot 0), TransferInfo section 1.5 (10 frames, dummy = empty
slots 4 and 5), the untagged 3-frame status of section 1.6, and the shared
tagged messages of sections 1.7-1.10. Mooncake frames carry no guard frame.
"""

from __future__ import annotations

from pdproto.errors import Reason
from pdproto.legacy import _common, _entries
from pdproto.legacy._codec import (
    I32_MAX,
    I32_MIN,
    U32_MAX,
    CodecProblem,
    FrameReader,
    FrameWriter,
    ParseResult,
)
from pdproto.legacy._common import NOTIFY, Layout, Slot, codec, read_slots, write_slots
from pdproto.legacy._entries import KvSlots, StateSlot
from pdproto.v1 import KvRegistration, StateIndices, TransferInfo, TransferStatus

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
_REG_SLOTS = (
    *NOTIFY,
    Slot(3, "mooncake_session_id", "mooncake.session_id", "S"),
    Slot(5, "dst_aux_ptrs", "aux_ptrs", "Q*"),
    Slot(7, "dst_tp_rank", "attn_tp.rank", hi=U32_MAX),
    Slot(8, "dst_attn_tp_size", "attn_tp.size", hi=U32_MAX),
    Slot(9, "dst_kv_item_len", "kv_item_len"),
)


def parse_registration(frames: list[bytes]) -> ParseResult[KvRegistration]:
    """Parse M1 (``KVArgsRegisterInfo.from_zmq``, mooncake/conn.py:153-229)."""
    r = FrameReader.open(frames, _REG, full=REGISTRATION_FRAMES, minimum=10)
    r.expect(0, "room", b"None")
    msg = KvRegistration()
    read_slots(r, msg, _REG_SLOTS)
    msg.kv_buffers.extend(_entries.read_kv_buffers(r, _KV, msg.kv_item_len))
    msg.state_buffers.extend(_entries.read_state_buffers(r, STATE_SLOTS))
    _entries.read_staging(r, msg, _STAGING_BASE, _SLOT_IDS)
    _entries.read_dcp(r, msg, _DCP_SIZE, _DCP_RANK)
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
    write_slots(w, msg, _REG_SLOTS)
    _entries.write_kv_buffers(w, _KV, msg)
    _entries.write_state_buffers(w, STATE_SLOTS, msg.state_buffers)
    _entries.write_staging(w, msg, _STAGING_BASE, _SLOT_IDS)
    _entries.write_dcp(w, msg, _DCP_SIZE, _DCP_RANK)
    return w.done()


_TI = f"{BACKEND} TransferInfo"
_TI_SLOTS = (
    Slot(0, "room", "room"),
    *NOTIFY,
    Slot(3, "mooncake_session_id", "peer_name", "S"),
    Slot(7, "required_dst_info_num", "required_dst_info_num", hi=U32_MAX),
)


def parse_transfer_info(frames: list[bytes]) -> ParseResult[TransferInfo]:
    """Parse M2 (``TransferInfo.from_zmq``, mooncake/conn.py:103-149)."""
    r = FrameReader.open(frames, _TI, full=TRANSFER_INFO_FRAMES, minimum=8)
    msg = TransferInfo()
    read_slots(r, msg, _TI_SLOTS)
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
    write_slots(w, msg, _TI_SLOTS)
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
    w.opt_num(8, "decode_prefix_len",
              msg.decode_prefix_len if msg.HasField("decode_prefix_len") else None)
    w.array(9, "dst_device_kv_indices", msg.dst_device_kv_pages.pages, "i")
    return w.done()


STATUS = Layout(TransferStatus, "status", None, (
    Slot(0, "room", "room"),
    Slot(1, "status", "state", "KVPoll"),
    Slot(2, "prefill_rank", "prefill_rank", hi=U32_MAX),
), counts=(3,), notes=((3, "no reason frame: a failed room gets SGLang's default failure reason"),))
"""M3, the untagged ``[room, status, prefill_rank]`` (common/conn.py:739-808); a
``failure_reason`` has no slot and is not sent."""

parse_status, build_status = codec(STATUS, BACKEND, __name__)
parse_abort, build_abort = codec(_common.ABORT, BACKEND, __name__)
parse_abort_ack, build_abort_ack = codec(_common.ABORT_ACK, BACKEND, __name__)
parse_bootstrap, build_bootstrap = codec(_common.BOOTSTRAP, BACKEND, __name__)
parse_staging_req, build_staging_req = codec(_common.STAGING_REQ, BACKEND, __name__)
parse_staging_rsp, build_staging_rsp = codec(_common.STAGING_RSP, BACKEND, __name__)
parse_watermark, build_watermark = codec(_common.WATERMARK, BACKEND, __name__)
parse_chunk_ready, build_chunk_ready = codec(_common.CHUNK_READY, BACKEND, __name__)
parse_aux_data, build_aux_data = codec(_common.AUX_DATA, BACKEND, __name__)
