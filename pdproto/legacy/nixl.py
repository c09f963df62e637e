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

from dataclasses import replace

from pdproto.errors import Reason
from pdproto.legacy import _common, _entries
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
from pdproto.legacy._common import NOTIFY, Layout, Slot, codec, read_slots, write_slots
from pdproto.legacy._entries import KvSlots, StateSlot
from pdproto.v1 import KvRegistration, StateIndices, TransferInfo, TransferStatus

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
_REG_SLOTS = (
    *NOTIFY,
    Slot(3, "agent_name", "nixl.agent_name", "S"),
    Slot(4, "agent_metadata", "nixl.agent_metadata", "B"),
    Slot(6, "dst_aux_ptrs", "aux_ptrs", "Q*"),
    Slot(8, "gpu_id", "gpu_id", hi=U32_MAX),
    Slot(9, "decode_tp_size", "attn_tp.size", hi=U32_MAX),
    Slot(10, "decode_tp_rank", "attn_tp.rank", hi=U32_MAX),
    Slot(11, "dst_kv_item_len", "kv_item_len"),
)


def parse_registration(frames: list[bytes]) -> ParseResult[KvRegistration]:
    """Parse M1 (guard, then ``KVArgsRegisterInfo.from_zmq``, nixl/conn.py:341-456)."""
    r = FrameReader.open(frames, _REG, full=REGISTRATION_FRAMES, minimum=12, guarded=True)
    r.expect(0, "room", b"None")
    msg = KvRegistration()
    read_slots(r, msg, _REG_SLOTS)
    msg.kv_buffers.extend(_entries.read_kv_buffers(r, _KV, msg.kv_item_len))
    msg.state_buffers.extend(_entries.read_state_buffers(r, _STATE))
    if not r.has(23) and msg.state_buffers:
        r.assumed.append("dst_state_data_lens absent: decode predates prepared state transfers")
    _entries.read_staging(r, msg, _STAGING_BASE, None)
    num_slots = r.opt_num(_NUM_SLOTS, "dst_num_slots", hi=U32_MAX)
    if num_slots is not None:
        msg.num_slots = num_slots
    _entries.read_dcp(r, msg, _DCP_SIZE, _DCP_RANK)
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
    write_slots(w, msg, _REG_SLOTS)
    _entries.write_kv_buffers(w, _KV, msg)
    _entries.write_state_buffers(w, _STATE, msg.state_buffers)
    _entries.write_staging(w, msg, _STAGING_BASE, None)
    w.opt_num(_NUM_SLOTS, "dst_num_slots", msg.num_slots if msg.HasField("num_slots") else None)
    _entries.write_dcp(w, msg, _DCP_SIZE, _DCP_RANK)
    return w.done()


_TI = f"{BACKEND} TransferInfo"
_PREFIX, _DUMMY_FLAG = 8, 9
_TI_SLOTS = (
    Slot(0, "room", "room"),
    *NOTIFY,
    Slot(3, "agent_name", "peer_name", "S"),
    Slot(4, "dst_kv_indices", "dst_kv_pages", "i*"),
    Slot(5, "dst_aux_index", "dst_aux_index", lo=I32_MIN, hi=I32_MAX),
    Slot(6, "required_dst_info_num", "required_dst_info_num", hi=U32_MAX),
)


def _inferred_dummy(msg: TransferInfo) -> bool:
    """SGLang's rule when the flag frame is absent (nixl/conn.py:311-325)."""
    return not msg.dst_kv_pages and not msg.decode_prefix_len


def parse_transfer_info(frames: list[bytes]) -> ParseResult[TransferInfo]:
    """Parse M2 (guard, then ``TransferInfo.from_zmq``, nixl/conn.py:284-338)."""
    r = FrameReader.open(frames, _TI, full=TRANSFER_INFO_FRAMES, minimum=7, guarded=True)
    msg = TransferInfo()
    read_slots(r, msg, _TI_SLOTS)
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
            r.empty.append(_DUMMY_FLAG)
        msg.is_dummy = _inferred_dummy(msg)
        r.assumed.append(f"is_dummy flag absent: inferred {msg.is_dummy} from empty kv indices and "
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
    write_slots(w, msg, _TI_SLOTS)
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


STATUS = Layout(TransferStatus, "status", _common.KV_STATUS, (
    Slot(1, "room", "room"),
    Slot(2, "status", "state", "KVPoll"),
    Slot(3, "prefill_rank", "prefill_rank", hi=U32_MAX),
    Slot(4, "reason", "failure_reason", "U8"),
), counts=(4, 5), notes=((4, "no reason frame: a failed room gets SGLang's default failure reason"),))
"""M3 ``[KV_STATUS, room, status, prefill_rank, reason]`` (common/conn.py:739-808)."""

parse_status, build_status = codec(STATUS, BACKEND, __name__)
parse_abort, build_abort = codec(_common.ABORT, BACKEND, __name__)
# NIXL never sends the 2-frame legacy ack (nixl/conn.py:3340-3346).
parse_abort_ack, build_abort_ack = codec(replace(_common.ABORT_ACK, counts=(3, 4)), BACKEND, __name__)
parse_staging_req, build_staging_req = codec(_common.STAGING_REQ, BACKEND, __name__)
parse_staging_rsp, build_staging_rsp = codec(_common.STAGING_RSP, BACKEND, __name__)
parse_watermark, build_watermark = codec(_common.WATERMARK, BACKEND, __name__)
parse_chunk_ready, build_chunk_ready = codec(_common.CHUNK_READY, BACKEND, __name__)
