"""Slot tables and the one reader and writer that interpret them (inventory 1.2-1.10).

A :class:`Layout` describes a whole tagged message (or a status) as :class:`Slot` rows;
the backend modules bind each layout under their own name with :func:`codec` (e.g. the
2-frame legacy ABORT_ACK is Mooncake only). Registrations and TransferInfos read and
write their plain slots with :func:`read_slots` / :func:`write_slots` and hand-write the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, Generic

from pdproto.errors import Reason
from pdproto.legacy._codec import (
    I64_MAX,
    I64_MIN,
    U32_MAX,
    U64_MAX,
    CodecProblem,
    FrameReader,
    FrameWriter,
    M,
    ParseResult,
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
    PrefillCompleteBootstrap,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    TransferState,
)

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
_VERDICTS = {STAGING_ALLOCATION_PENDING: -1, STAGING_ALLOCATION_OVERSIZED: -2}


@dataclass(frozen=True)
class Slot:
    """One slot: its parser number, SGLang's name, the message field (dotted) and its encoding."""

    slot: int
    name: str
    field: str
    enc: str = "A"
    """``A``, ``S``, ``U8`` as in docs/migration.md; ``B`` raw bytes; ``Q*`` / ``i*`` native
    arrays; ``KVPoll`` a state; ``BE32`` the length of ``field``, in the next slot; ``offset``
    STAGING_RSP's offset or verdict."""
    hi: int = U64_MAX
    lo: int = 0


def _get(msg: Any, path: str) -> Any:
    return reduce(getattr, path.split("."), msg)


def _put(msg: Any, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        msg = getattr(msg, name)
        msg.SetInParent()  # a slot that was sent sets its sub-message, even to defaults
    setattr(msg, leaf, value)


def _read(r: FrameReader, s: Slot, msg: Any) -> None:
    if s.enc == "A":
        _put(msg, s.field, r.num(s.slot, s.name, s.lo, s.hi))
    elif s.enc in ("S", "U8"):
        _put(msg, s.field, r.text(s.slot, s.name, "utf-8" if s.enc == "U8" else "ascii"))
    elif s.enc == "B":
        _put(msg, s.field, r.frames[s.slot])
    elif s.enc.endswith("*"):
        _get(msg, s.field).extend(r.array(s.slot, s.name, s.enc[:-1]))
    elif s.enc == "KVPoll":
        value = r.num(s.slot, s.name, hi=U32_MAX)
        if value not in KVPOLL_TO_STATE:
            raise r.error(s.slot, s.name, CodecProblem(
                Reason.LEGACY_BAD_VALUE, f"KVPoll value {value} is not one of 0..4"))
        _put(msg, s.field, KVPOLL_TO_STATE[value])
    elif s.enc == "BE32":
        length, data = r.scalar(s.slot, s.name, ">I"), r.frames[s.slot + 1]
        if length != len(data):
            raise r.error(s.slot, s.name, CodecProblem(
                Reason.LEGACY_BAD_LENGTH, f"says {length} bytes but the data frame has {len(data)}"))
    else:  # "offset": STAGING_RSP's offset, or a verdict below zero
        offset = r.num(s.slot, s.name, lo=min(_VERDICTS.values()), hi=I64_MAX)
        if offset < 0:
            msg.allocation = next(k for k, v in _VERDICTS.items() if v == offset)
        else:
            msg.allocation, msg.offset = STAGING_ALLOCATION_GRANTED, offset


def _write(w: FrameWriter, s: Slot, msg: Any) -> None:
    value = _get(msg, s.field)
    if s.enc == "A":
        w.num(s.slot, s.name, value, default=not value)
    elif s.enc in ("S", "U8"):
        w.text(s.slot, s.name, value, "utf-8" if s.enc == "U8" else "ascii", default=not value)
    elif s.enc == "B":
        w.raw(s.slot, s.name, value, default=not value)
    elif s.enc.endswith("*"):
        w.array(s.slot, s.name, value, s.enc[:-1])
    elif s.enc == "KVPoll":
        if value not in STATE_TO_KVPOLL:
            raise w.unrepresentable(s.slot, s.field, f"TransferState {value} has no KVPoll value")
        w.num(s.slot, s.name, STATE_TO_KVPOLL[value])
    elif s.enc == "BE32":
        w.scalar(s.slot, s.name, len(value), ">I", default=False)
    elif msg.allocation in _VERDICTS:  # "offset"
        if value:
            raise w.unrepresentable(s.slot, s.name, "an offset is meaningful only when GRANTED")
        w.num(s.slot, s.name, _VERDICTS[msg.allocation])
    elif msg.allocation != STAGING_ALLOCATION_GRANTED:
        raise w.unrepresentable(s.slot, "allocation", "allocation must be set")
    elif value > I64_MAX:
        raise w.unrepresentable(s.slot, s.name, f"{value} exceeds {I64_MAX}")
    else:
        w.num(s.slot, s.name, value)


def read_slots(r: FrameReader, msg: Any, slots: Sequence[Slot]) -> None:
    """Read every slot the sender sent into ``msg``."""
    for s in slots:
        if r.has(s.slot):
            _read(r, s, msg)


def write_slots(w: FrameWriter, msg: Any, slots: Sequence[Slot]) -> None:
    """Inverse of :func:`read_slots`; a default value may fall outside the layout written."""
    for s in slots:
        _write(w, s, msg)


def _sent(msg: Any, s: Slot) -> bool:
    """Whether a slot's field has a value to send (fields without presence always do)."""
    top = s.field.split(".")[0]
    return not msg.DESCRIPTOR.fields_by_name[top].has_presence or bool(msg.HasField(top))


@dataclass(frozen=True)
class Layout(Generic[M]):
    """A tagged message (or status): its type, frame 0 tag, slots and SGLang's frame counts."""

    cls: type[M]
    name: str
    tag: bytes | None
    slots: tuple[Slot, ...]
    counts: tuple[int, ...]
    """Frame counts SGLang 0.5.23 sends; without a ``legacy`` field, set fields pick one."""
    notes: tuple[tuple[int, str], ...] = ()
    """What SGLang assumes when a slot is not sent."""


def codec(layout: Layout[M], backend: str, module: str
          ) -> tuple[Callable[[list[bytes]], ParseResult[M]], Callable[[M], list[bytes]]]:
    """The ``parse_x`` / ``build_x`` pair (x: the layout's name) a backend ``module`` exports."""
    what = f"{backend} {layout.name}"
    lo, hi = min(layout.counts), max(layout.counts)

    def parse_fn(frames: list[bytes]) -> ParseResult[M]:
        r = FrameReader.open(frames, what, full=hi, minimum=lo, counts=layout.counts)
        if layout.tag is not None:
            r.expect(0, "tag", layout.tag)
        msg = layout.cls()
        read_slots(r, msg, layout.slots)
        for slot, note in layout.notes:
            if not r.has(slot):
                r.assumed.append(note)
        return r.result(msg, getattr(msg, "legacy", None))

    def build_fn(message: M) -> list[bytes]:
        msg: Any = message
        if "legacy" in msg.DESCRIPTOR.fields_by_name:  # the frame count follows ``legacy``
            w = FrameWriter(what, full=hi, minimum=lo,
                            framing=msg.legacy if hi > lo and msg.HasField("legacy") else None)
        else:  # or else the last optional field that is set
            count = max([lo] + [s.slot + 1 for s in layout.slots if s.slot >= lo and _sent(msg, s)])
            w = FrameWriter(what, full=count, minimum=count, framing=None)
        for s in layout.slots:
            if w.has(s.slot) and not _sent(msg, s):
                raise w.unrepresentable(s.slot, s.field, f"is unset, but SGLang's {w.count}-frame "
                                        f"{layout.name} carries {s.name} here")
        if layout.tag is not None:
            w.raw(0, "tag", layout.tag)
        write_slots(w, msg, layout.slots)
        return w.done()

    # Named, documented and typed as if written in ``module`` (fuzz targets and seeds find them).
    build_fn.__annotations__ = {"message": layout.cls, "return": list[bytes]}
    for fn, verb in ((parse_fn, "parse"), (build_fn, "build")):
        fn.__module__ = module
        fn.__name__ = fn.__qualname__ = f"{verb}_{layout.name.lower()}"
        fn.__doc__ = f"{verb.title()} {what} frames (slots: docs/migration.md)."
    return parse_fn, build_fn


NOTIFY = (Slot(1, "endpoint", "notify_endpoint.host", "S"),
          Slot(2, "dst_port", "notify_endpoint.port", hi=U32_MAX))
"""The decode's notify endpoint, slots 1-2 of every registration and TransferInfo."""
_ROOM = Slot(1, "room", "room")

ABORT = Layout(AbortNotification, "ABORT", b"ABORT", (
    _ROOM,
    Slot(2, "decode_ip", "reply_endpoint.host", "S"),
    Slot(3, "decode_port", "reply_endpoint.port", hi=U32_MAX),
    Slot(4, "generation", "generation"),
), counts=(2, 4, 5), notes=((3, "no return address: the prefill cannot acknowledge this abort"),))
ABORT_ACK = Layout(AbortAck, "ABORT_ACK", b"ABORT_ACK", (
    _ROOM,
    Slot(2, "prefill_rank", "prefill_rank", hi=U32_MAX),
    Slot(3, "generation", "generation"),
), counts=(2, 3, 4), notes=((3, "no generation: SGLang ignores this ack when deferred release is on"),))
"""Mooncake's counts: 2 frames is the legacy ack sent when deferred release is off."""
BOOTSTRAP = Layout(PrefillCompleteBootstrap, "BOOTSTRAP", b"BOOTSTRAP", (
    _ROOM,
    Slot(2, "decode_ip", "decode_endpoint.host", "S"),
    Slot(3, "decode_port", "decode_endpoint.port", hi=U32_MAX),
), counts=(4,))
"""``common/conn.py:2575-2582``."""
STAGING_REQ = Layout(StagingRequest, "STAGING_REQ", b"STAGING_REQ", (
    _ROOM,
    Slot(2, "chunk_idx", "chunk_index", hi=U32_MAX),
    Slot(3, "chunk_pages", "chunk_pages", hi=U32_MAX),
    Slot(4, "session_id", "session_id", "S"),
    Slot(5, "requester_pp_rank", "requester_pp_rank", hi=U32_MAX),
), counts=(5, 6))
STAGING_RSP = Layout(StagingResponse, "STAGING_RSP", b"STAGING_RSP", (
    _ROOM,
    Slot(2, "chunk_idx", "chunk_index", hi=U32_MAX),
    Slot(3, "offset", "offset", "offset"),
    Slot(4, "round", "round"),
    Slot(5, "end", "end", lo=I64_MIN, hi=I64_MAX),
    Slot(6, "session_id", "session_id", "S"),
), counts=(7,))
WATERMARK = Layout(StagingWatermark, "WATERMARK", b"WATERMARK", (
    Slot(1, "round", "round"),
    Slot(2, "tail", "tail"),
    Slot(3, "session_id", "session_id", "S"),
), counts=(3, 4), notes=((3, 'session_id absent: assumed ""'),))
CHUNK_READY = Layout(ChunkReady, "CHUNK_READY", b"CHUNK_READY", (
    _ROOM,
    Slot(2, "chunk_idx", "chunk_index", hi=U32_MAX),
    Slot(3, "page_start", "page_start", hi=U32_MAX),
    Slot(4, "num_pages", "num_pages", hi=U32_MAX),
    Slot(5, "writer_id", "writer_id", "S"),
    Slot(6, "prefill_rank", "prefill_rank", hi=U32_MAX),
), counts=(7,))
AUX_DATA = Layout(AuxData, "AUX_DATA", b"AUX_DATA", (
    _ROOM,
    Slot(2, "buffer_index", "buffer_index", hi=U32_MAX),
    Slot(3, "aux_index", "aux_index", hi=U32_MAX),
    Slot(4, "length", "data", "BE32"),
    Slot(5, "data", "data", "B"),
), counts=(6,))
"""``mooncake/conn.py:1842``."""
KV_STATUS = b"KV_STATUS"
"""Frame 0 of a NIXL status; Mooncake's status is untagged."""
