"""Tagged SGLang 0.5.23 messages whose layout both backends share (inventory 1.6-1.10).

These come from ``common/conn.py`` and ``staging_handler.py`` and travel without
the NIXL guard on both backends; the backend modules bind them with their name
and the backend-specific frame counts (e.g. the 2-frame legacy ABORT_ACK is
Mooncake only).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdproto.errors import Reason
from pdproto.legacy._codec import (
    I64_MAX,
    I64_MIN,
    U32_MAX,
    FrameReader,
    FrameWriter,
    ParseResult,
    CodecProblem,
)
from pdproto.v1 import (
    STAGING_ALLOCATION_GRANTED,
    STAGING_ALLOCATION_OVERSIZED,
    STAGING_ALLOCATION_PENDING,
    TRANSFER_STATE_BOOTSTRAPPING,
    TRANSFER_STATE_FAILED,
    TRANSFER_STATE_SUCCESS,
    TRANSFER_STATE_TRANSFERRING,
    TRANSFER_STATE_WAITING_FOR_INPUT,
    AbortAck,
    AbortNotification,
    AuxData,
    ChunkReady,
    Endpoint,
    PrefillCompleteBootstrap,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    TransferState,
)

ABORT = b"ABORT"
ABORT_ACK = b"ABORT_ACK"
BOOTSTRAP = b"BOOTSTRAP"
STAGING_REQ = b"STAGING_REQ"
STAGING_RSP = b"STAGING_RSP"
WATERMARK = b"WATERMARK"
CHUNK_READY = b"CHUNK_READY"
AUX_DATA = b"AUX_DATA"
KV_STATUS = b"KV_STATUS"

KVPOLL_TO_STATE: dict[int, TransferState.ValueType] = {
    0: TRANSFER_STATE_FAILED,
    1: TRANSFER_STATE_BOOTSTRAPPING,
    2: TRANSFER_STATE_WAITING_FOR_INPUT,
    3: TRANSFER_STATE_TRANSFERRING,
    4: TRANSFER_STATE_SUCCESS,
}
"""SGLang ``KVPoll`` ints (base/conn.py) to pdproto TransferState."""
STATE_TO_KVPOLL: dict[TransferState.ValueType, int] = {v: k for k, v in KVPOLL_TO_STATE.items()}
"""pdproto TransferState to SGLang ``KVPoll`` ints (UNSPECIFIED has none)."""

# STAGING_RSP offsets below zero are verdicts, not offsets (staging_handler.py:645-647).
_PENDING, _OVERSIZED = -1, -2


def read_endpoint(r: FrameReader, host_slot: int, port_slot: int, host: str,
                  port: str) -> Endpoint:
    """An ``S`` host and an ``A`` port in two slots."""
    return Endpoint(host=r.text(host_slot, host), port=r.num(port_slot, port, hi=U32_MAX))


def write_endpoint(w: FrameWriter, ep: Endpoint, host_slot: int, port_slot: int, host: str,
                   port: str) -> None:
    """Inverse of :func:`read_endpoint`."""
    w.text(host_slot, host, ep.host)
    w.num(port_slot, port, ep.port)


def read_state(r: FrameReader, slot: int) -> TransferState.ValueType:
    """A KVPoll ``A`` slot as a TransferState."""
    value = r.num(slot, "status", hi=U32_MAX)
    if value not in KVPOLL_TO_STATE:
        raise r.error(slot, "status", CodecProblem(
            Reason.LEGACY_BAD_VALUE, f"KVPoll value {value} is not one of 0..4"))
    return KVPOLL_TO_STATE[value]


def write_state(w: FrameWriter, slot: int, state: TransferState.ValueType) -> None:
    """Inverse of :func:`read_state`."""
    if state not in STATE_TO_KVPOLL:
        raise w.unrepresentable(slot, "state", f"TransferState {state} has no KVPoll value")
    w.num(slot, "status", STATE_TO_KVPOLL[state])


def parse_abort(frames: object, backend: str) -> ParseResult[AbortNotification]:
    """``[ABORT, room]`` (+ ``decode_ip, decode_port``) (+ ``generation``): 2, 4 or 5 frames."""
    r = FrameReader.open(frames, f"{backend} ABORT", full=5, minimum=2, counts=(2, 4, 5))
    r.expect(0, "tag", ABORT)
    msg = AbortNotification(room=r.num(1, "room"))
    if r.has(3):
        msg.reply_endpoint.CopyFrom(read_endpoint(r, 2, 3, "decode_ip", "decode_port"))
    else:
        r.assume("no return address: the prefill cannot acknowledge this abort")
    if r.has(4):
        msg.generation = r.num(4, "generation")
    return r.result(msg)


def build_abort(msg: AbortNotification, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_abort`; the frame count follows which fields are set."""
    count = 5 if msg.HasField("generation") else 4 if msg.HasField("reply_endpoint") else 2
    w = FrameWriter(f"{backend} ABORT", full=count, minimum=count, framing=None)
    w.raw(0, "tag", ABORT)
    w.num(1, "room", msg.room)
    if count >= 4:
        if not msg.HasField("reply_endpoint"):
            raise w.unrepresentable(4, "generation",
                                    "SGLang sends a generation only after a return address")
        write_endpoint(w, msg.reply_endpoint, 2, 3, "decode_ip", "decode_port")
    if count == 5:
        w.num(4, "generation", msg.generation)
    return w.done()


def parse_abort_ack(frames: object, backend: str, counts: Iterable[int]) -> ParseResult[AbortAck]:
    """``[ABORT_ACK, room]`` (Mooncake legacy) or ``+ prefill_rank`` (+ ``generation``)."""
    r = FrameReader.open(frames, f"{backend} ABORT_ACK", full=4, minimum=2, counts=counts)
    r.expect(0, "tag", ABORT_ACK)
    msg = AbortAck(room=r.num(1, "room"))
    if r.has(2):
        msg.prefill_rank = r.num(2, "prefill_rank", hi=U32_MAX)
    if r.has(3):
        msg.generation = r.num(3, "generation")
    elif r.has(2):
        r.assume("no generation: SGLang ignores this ack when deferred release is on")
    return r.result(msg)


def build_abort_ack(msg: AbortAck, backend: str, counts: Iterable[int]) -> list[bytes]:
    """Inverse of :func:`parse_abort_ack`."""
    count = 4 if msg.HasField("generation") else 3 if msg.HasField("prefill_rank") else 2
    w = FrameWriter(f"{backend} ABORT_ACK", full=count, minimum=count, framing=None)
    if count not in set(counts):
        raise w.unrepresentable(2, "prefill_rank", f"{backend} never sends the {count}-frame "
                                "ABORT_ACK (the prefill rank is required)")
    w.raw(0, "tag", ABORT_ACK)
    w.num(1, "room", msg.room)
    if count >= 3:
        if not msg.HasField("prefill_rank"):
            raise w.unrepresentable(3, "generation", "SGLang sends a generation only after "
                                    "the prefill rank")
        w.num(2, "prefill_rank", msg.prefill_rank)
    if count == 4:
        w.num(3, "generation", msg.generation)
    return w.done()


def parse_bootstrap(frames: object, backend: str) -> ParseResult[PrefillCompleteBootstrap]:
    """``[BOOTSTRAP, room, decode_ip, decode_port]`` (common/conn.py:2575-2582)."""
    r = FrameReader.open(frames, f"{backend} BOOTSTRAP", full=4, minimum=4)
    r.expect(0, "tag", BOOTSTRAP)
    msg = PrefillCompleteBootstrap(room=r.num(1, "room"))
    msg.decode_endpoint.CopyFrom(read_endpoint(r, 2, 3, "decode_ip", "decode_port"))
    return r.result(msg)


def build_bootstrap(msg: PrefillCompleteBootstrap, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_bootstrap`."""
    w = FrameWriter(f"{backend} BOOTSTRAP", full=4, minimum=4, framing=None)
    w.raw(0, "tag", BOOTSTRAP)
    w.num(1, "room", msg.room)
    write_endpoint(w, msg.decode_endpoint, 2, 3, "decode_ip", "decode_port")
    return w.done()


def parse_staging_req(frames: object, backend: str) -> ParseResult[StagingRequest]:
    """``[STAGING_REQ, room, chunk_idx, chunk_pages, session_id, (requester_pp_rank)]``."""
    r = FrameReader.open(frames, f"{backend} STAGING_REQ", full=6, minimum=5)
    r.expect(0, "tag", STAGING_REQ)
    msg = StagingRequest(room=r.num(1, "room"), chunk_index=r.num(2, "chunk_idx", hi=U32_MAX),
                         chunk_pages=r.num(3, "chunk_pages", hi=U32_MAX),
                         session_id=r.text(4, "session_id"))
    if r.has(5):
        msg.requester_pp_rank = r.num(5, "requester_pp_rank", hi=U32_MAX)
    return r.result(msg)


def build_staging_req(msg: StagingRequest, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_staging_req`."""
    count = 6 if msg.HasField("requester_pp_rank") else 5
    w = FrameWriter(f"{backend} STAGING_REQ", full=count, minimum=count, framing=None)
    w.raw(0, "tag", STAGING_REQ)
    w.num(1, "room", msg.room)
    w.num(2, "chunk_idx", msg.chunk_index)
    w.num(3, "chunk_pages", msg.chunk_pages)
    w.text(4, "session_id", msg.session_id)
    if count == 6:
        w.num(5, "requester_pp_rank", msg.requester_pp_rank)
    return w.done()


def parse_staging_rsp(frames: object, backend: str) -> ParseResult[StagingResponse]:
    """``[STAGING_RSP, room, chunk_idx, offset, round, end, session_id]``; offset -1/-2 are verdicts."""
    r = FrameReader.open(frames, f"{backend} STAGING_RSP", full=7, minimum=7)
    r.expect(0, "tag", STAGING_RSP)
    offset = r.num(3, "offset", lo=_OVERSIZED, hi=I64_MAX)
    msg = StagingResponse(room=r.num(1, "room"), chunk_index=r.num(2, "chunk_idx", hi=U32_MAX),
                          round=r.num(4, "round"), end=r.num(5, "end", lo=I64_MIN, hi=I64_MAX),
                          session_id=r.text(6, "session_id"))
    if offset == _PENDING:
        msg.allocation = STAGING_ALLOCATION_PENDING
    elif offset == _OVERSIZED:
        msg.allocation = STAGING_ALLOCATION_OVERSIZED
    else:
        msg.allocation = STAGING_ALLOCATION_GRANTED
        msg.offset = offset
    return r.result(msg)


def build_staging_rsp(msg: StagingResponse, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_staging_rsp`."""
    w = FrameWriter(f"{backend} STAGING_RSP", full=7, minimum=7, framing=None)
    w.raw(0, "tag", STAGING_RSP)
    w.num(1, "room", msg.room)
    w.num(2, "chunk_idx", msg.chunk_index)
    if msg.allocation == STAGING_ALLOCATION_GRANTED:
        if msg.offset > I64_MAX:
            raise w.unrepresentable(3, "offset", f"{msg.offset} exceeds {I64_MAX}")
        w.num(3, "offset", msg.offset)
    elif msg.allocation in (STAGING_ALLOCATION_PENDING, STAGING_ALLOCATION_OVERSIZED):
        if msg.offset:
            raise w.unrepresentable(3, "offset", "an offset is meaningful only when GRANTED")
        pending = msg.allocation == STAGING_ALLOCATION_PENDING
        w.num(3, "offset", _PENDING if pending else _OVERSIZED)
    else:
        raise w.unrepresentable(3, "allocation", "allocation must be set")
    w.num(4, "round", msg.round)
    w.num(5, "end", msg.end)
    w.text(6, "session_id", msg.session_id)
    return w.done()


def parse_watermark(frames: object, backend: str) -> ParseResult[StagingWatermark]:
    """``[WATERMARK, round, tail, (session_id)]``; older senders omit the session."""
    r = FrameReader.open(frames, f"{backend} WATERMARK", full=4, minimum=3)
    r.expect(0, "tag", WATERMARK)
    msg = StagingWatermark(round=r.num(1, "round"), tail=r.num(2, "tail"))
    if r.has(3):
        msg.session_id = r.text(3, "session_id")
    else:
        r.assume("session_id absent: assumed \"\"")
    return r.result(msg, msg.legacy)


def build_watermark(msg: StagingWatermark, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_watermark`."""
    framing = msg.legacy if msg.HasField("legacy") else None
    w = FrameWriter(f"{backend} WATERMARK", full=4, minimum=3, framing=framing)
    w.raw(0, "tag", WATERMARK)
    w.num(1, "round", msg.round)
    w.num(2, "tail", msg.tail)
    w.text(3, "session_id", msg.session_id, default=not msg.session_id)
    return w.done()


def parse_chunk_ready(frames: object, backend: str) -> ParseResult[ChunkReady]:
    """``[CHUNK_READY, room, chunk_idx, page_start, num_pages, writer_id, prefill_rank]``."""
    r = FrameReader.open(frames, f"{backend} CHUNK_READY", full=7, minimum=7)
    r.expect(0, "tag", CHUNK_READY)
    msg = ChunkReady(room=r.num(1, "room"), chunk_index=r.num(2, "chunk_idx", hi=U32_MAX),
                     page_start=r.num(3, "page_start", hi=U32_MAX),
                     num_pages=r.num(4, "num_pages", hi=U32_MAX),
                     writer_id=r.text(5, "writer_id"),
                     prefill_rank=r.num(6, "prefill_rank", hi=U32_MAX))
    return r.result(msg)


def build_chunk_ready(msg: ChunkReady, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_chunk_ready`."""
    w = FrameWriter(f"{backend} CHUNK_READY", full=7, minimum=7, framing=None)
    w.raw(0, "tag", CHUNK_READY)
    w.num(1, "room", msg.room)
    w.num(2, "chunk_idx", msg.chunk_index)
    w.num(3, "page_start", msg.page_start)
    w.num(4, "num_pages", msg.num_pages)
    w.text(5, "writer_id", msg.writer_id)
    w.num(6, "prefill_rank", msg.prefill_rank)
    return w.done()


def parse_aux_data(frames: object, backend: str) -> ParseResult[AuxData]:
    """``[AUX_DATA, room, buffer_index, aux_index, BE32(len), data]`` (mooncake/conn.py:1842)."""
    r = FrameReader.open(frames, f"{backend} AUX_DATA", full=6, minimum=6)
    r.expect(0, "tag", AUX_DATA)
    length = r.scalar(4, "length", ">I")
    data = r.frames[5]
    if length != len(data):
        raise r.error(4, "length", CodecProblem(
            Reason.LEGACY_BAD_LENGTH, f"says {length} bytes but the data frame has {len(data)}"))
    msg = AuxData(room=r.num(1, "room"), buffer_index=r.num(2, "buffer_index", hi=U32_MAX),
                  aux_index=r.num(3, "aux_index", hi=U32_MAX), data=data)
    return r.result(msg)


def build_aux_data(msg: AuxData, backend: str) -> list[bytes]:
    """Inverse of :func:`parse_aux_data`."""
    w = FrameWriter(f"{backend} AUX_DATA", full=6, minimum=6, framing=None)
    w.raw(0, "tag", AUX_DATA)
    w.num(1, "room", msg.room)
    w.num(2, "buffer_index", msg.buffer_index)
    w.num(3, "aux_index", msg.aux_index)
    w.scalar(4, "length", len(msg.data), ">I", default=False)  # SGLang's BE32
    w.raw(5, "data", msg.data)
    return w.done()

