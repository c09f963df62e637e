"""Codec primitives shared by the SGLang 0.5.23 legacy bridges.

SGLang's positional frames mix three byte orders (inventory section 0): ASCII
decimal integers, native ``Q``/``I``/int32 arrays, little-endian
``pack_int_lists`` (PIL) and a big-endian length in AUX_DATA. This module owns
every one of those encodings, plus a reader and a writer that know which slot
they are on, so every failure names the message, slot, field and bytes found.
Backend modules only describe slot layouts.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from google.protobuf.message import Message

from pdproto.errors import LegacyFormatError, Reason
from pdproto.v1 import LegacyFraming

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

NIXL_GUARD = b"NixlMsgGuard"
"""First wire frame of every NIXL registration and TransferInfo (nixl/conn.py GUARD)."""

# str(int) output only: no sign on zero, no leading zeros, no spaces, no "+",
# so that decode(encode(x)) and encode(decode(b)) are both exact.
_CANONICAL_INT = re.compile(rb"0|-?[1-9][0-9]*")
_MAX_INT_DIGITS = 20  # every slot fits in 64 bits; longer strings are rejected early

M = TypeVar("M", bound=Message)
T = TypeVar("T")


@dataclass(frozen=True)
class ParseResult(Generic[M]):
    """A parsed legacy frame list: the pdproto.v1 message and the legacy defaults assumed."""

    message: M
    """The message; with its ``legacy`` field it rebuilds the same frames byte for byte."""
    assumed: tuple[str, ...] = ()
    """Human-readable notes on defaults SGLang 0.5.23 would assume for absent or empty slots."""


class CodecProblem(Exception):
    """A primitive encoding failed; the reader or writer adds the slot context."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def show(data: bytes, limit: int = 40) -> str:
    """Render frame bytes for an error message, truncated so messages stay readable."""
    if len(data) <= limit:
        return repr(data)
    return f"{data[:limit]!r}... ({len(data)} bytes)"


def encode_int(value: int) -> bytes:
    """SGLang ``A``: ``str(int).encode("ascii")``."""
    return str(value).encode("ascii")


def decode_int(data: bytes, lo: int, hi: int) -> int:
    """Parse an ``A`` frame, requiring the canonical ``str(int)`` form and lo <= value <= hi."""
    if len(data) > _MAX_INT_DIGITS + 1 or not _CANONICAL_INT.fullmatch(data):
        raise CodecProblem(
            Reason.LEGACY_BAD_INTEGER,
            f"expected an ASCII decimal integer as str(int) writes it, found {show(data)}",
        )
    value = int(data)
    if not lo <= value <= hi:
        raise CodecProblem(Reason.LEGACY_BAD_VALUE, f"{value} is outside {lo}..{hi}")
    return value


def pack_array(values: Sequence[int], fmt: str) -> bytes:
    """Native-order packed array (SGLang ``Q*``, ``I*``, ``i32``): ``struct.pack(f"{n}{fmt}")``."""
    try:
        return struct.pack(f"@{len(values)}{fmt}", *values)
    except struct.error as exc:
        raise CodecProblem(
            Reason.LEGACY_UNREPRESENTABLE, f"a value does not fit the {fmt!r} element: {exc}"
        ) from None


def unpack_array(data: bytes, fmt: str) -> list[int]:
    """Inverse of :func:`pack_array`; the frame length must be a multiple of the element size."""
    size = struct.calcsize(fmt)
    if len(data) % size:
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            f"{len(data)} bytes is not a multiple of the {size}-byte {fmt!r} element",
        )
    return list(struct.unpack(f"@{len(data) // size}{fmt}", data))


def pack_int_lists(lists: Sequence[Sequence[int]], fmt: str) -> bytes:
    """SGLang ``pack_int_lists``: little-endian ``<(n+1)I`` header of byte lengths, then each list."""
    if not lists:
        return b""  # SGLang encodes [] as an empty frame, keeping [] and [[]] distinct
    size = struct.calcsize("<" + fmt)
    try:
        header = struct.pack(f"<{len(lists) + 1}I", len(lists), *(len(x) * size for x in lists))
        return header + b"".join(struct.pack(f"<{len(x)}{fmt}", *x) for x in lists)
    except struct.error as exc:
        raise CodecProblem(
            Reason.LEGACY_UNREPRESENTABLE, f"a value does not fit the {fmt!r} element: {exc}"
        ) from None


def unpack_int_lists(data: bytes, fmt: str) -> list[list[int]]:
    """Inverse of :func:`pack_int_lists`; header, element sizes and total length must agree."""
    if not data:
        return []
    size = struct.calcsize("<" + fmt)
    if len(data) < 4:
        raise CodecProblem(Reason.LEGACY_BAD_LENGTH, f"{len(data)} bytes is too short for a header")
    (count,) = struct.unpack_from("<I", data)
    if count == 0:
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            "header says 0 lists, but pack_int_lists writes an empty list as an empty frame",
        )
    head = 4 * (count + 1)
    if head > len(data):
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            f"header announces {count} lists ({head} header bytes) but the frame has {len(data)}",
        )
    lengths = struct.unpack_from(f"<{count}I", data, 4)
    bad = [n for n in lengths if n % size]
    if bad:
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            f"list byte length {bad[0]} is not a multiple of the {size}-byte {fmt!r} element",
        )
    if head + sum(lengths) != len(data):
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            f"header announces {head + sum(lengths)} bytes in total but the frame has {len(data)}",
        )
    out: list[list[int]] = []
    offset = head
    for n in lengths:
        out.append(list(struct.unpack_from(f"<{n // size}{fmt}", data, offset)))
        offset += n
    return out


def encode_text(value: str, encoding: str = "ascii") -> bytes:
    """SGLang ``S`` (ASCII) or ``U8`` (UTF-8) text."""
    try:
        return value.encode(encoding)
    except UnicodeEncodeError as exc:
        raise CodecProblem(
            Reason.LEGACY_UNREPRESENTABLE, f"{value!r} is not {encoding} text ({exc.reason})"
        ) from None


def decode_text(data: bytes, encoding: str = "ascii") -> str:
    """Inverse of :func:`encode_text`."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise CodecProblem(
            Reason.LEGACY_BAD_TEXT,
            f"not {encoding} text at byte {exc.start}: {show(data)}",
        ) from None


def pack_scalar(value: int, fmt: str) -> bytes:
    """One packed scalar, e.g. the native ``Q`` staging base pointer."""
    try:
        return struct.pack(fmt, value)
    except struct.error as exc:
        raise CodecProblem(Reason.LEGACY_UNREPRESENTABLE, f"{value} does not fit {fmt!r}: {exc}")


def unpack_scalar(data: bytes, fmt: str) -> int:
    """Inverse of :func:`pack_scalar`; the frame must be exactly one element long."""
    if len(data) != struct.calcsize(fmt):
        raise CodecProblem(
            Reason.LEGACY_BAD_LENGTH,
            f"expected {struct.calcsize(fmt)} bytes ({fmt!r}), found {len(data)}",
        )
    value: int = struct.unpack(fmt, data)[0]
    return value


def fail(what: str, slot: int | None, name: str, reason: Reason, detail: str,
         offset: int = 0) -> LegacyFormatError:
    """Build the LegacyFormatError for a problem at one slot of one legacy message."""
    where = what
    meta: dict[str, object] = {"message": what, "field": name}
    if slot is not None:
        wire = f", wire frame {slot + offset}" if offset else ""
        where = f"{what} slot {slot} ({name}{wire})"
        meta["slot"] = slot
    elif name:
        where = f"{what} ({name})"
    return LegacyFormatError(f"{where}: {detail}", reason=reason, metadata=meta)


def _as_frames(frames: object, what: str) -> list[bytes]:
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(
        frames, Sequence
    ):
        raise fail(what, None, "frames", Reason.LEGACY_BAD_VALUE,
                   f"expected a list of bytes frames, got {type(frames).__name__}")
    out: list[bytes] = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise fail(what, None, "frames", Reason.LEGACY_BAD_VALUE,
                       f"frame {i} is {type(frame).__name__}, not bytes")
        out.append(bytes(frame))
    return out


@dataclass
class FrameReader:
    """Reads the slots of one legacy frame list (parser numbering) with slot-aware errors."""

    what: str
    """Message name for errors, e.g. "Mooncake KVArgsRegisterInfo"."""
    frames: list[bytes]
    """Frames after any guard."""
    full: int
    """Frame count of the current SGLang 0.5.23 layout."""
    offset: int = 0
    """Wire index of parser slot 0 (1 for NIXL guarded messages)."""
    empty: list[int] = field(default_factory=list)
    """Slots where an empty frame stood for a value (``LegacyFraming.empty_slots``)."""
    assumed: list[str] = field(default_factory=list)
    """Defaults SGLang would assume for what was not sent (``ParseResult.assumed``)."""
    list_lengths: dict[int, int] = field(default_factory=dict)

    @classmethod
    def open(cls, frames: object, what: str, *, full: int, minimum: int,
             guarded: bool = False, counts: Iterable[int] | None = None) -> FrameReader:
        """Validate the frame count (and NIXL guard) and return a reader."""
        body = _as_frames(frames, what)
        if guarded:  # NIXL's leading NixlMsgGuard frame, which SGLang asserts
            if not body or body[0] != NIXL_GUARD:
                raise fail(what, None, "guard", Reason.LEGACY_MISSING_GUARD, f"wire frame 0 must be "
                           f"{NIXL_GUARD!r}, found {show(body[0]) if body else 'no frames'}")
            body = body[1:]
        allowed = sorted(counts) if counts is not None else list(range(minimum, full + 1))
        if len(body) not in allowed:
            shape = (f"{allowed[0]}..{allowed[-1]}" if allowed == list(
                range(allowed[0], allowed[-1] + 1)) else ", ".join(map(str, allowed)))
            extra = " after the NixlMsgGuard frame" if guarded else ""
            raise LegacyFormatError(
                f"{what}: has {len(body)} frames{extra}; SGLang 0.5.23 sends {shape}",
                reason=Reason.LEGACY_FRAME_COUNT,
                metadata={"message": what, "frames": len(body), "expected": shape},
            )
        return cls(what, body, full, 1 if guarded else 0)

    def error(self, slot: int | None, name: str, problem: CodecProblem) -> LegacyFormatError:
        """Attach this message and slot to a primitive's problem."""
        return fail(self.what, slot, name, problem.reason, problem.detail, self.offset)

    def has(self, slot: int) -> bool:
        """Whether the sender sent this slot at all."""
        return slot < len(self.frames)

    def raw(self, slot: int) -> bytes | None:
        """The slot's bytes, or None when the sender stopped before it."""
        return self.frames[slot] if self.has(slot) else None

    def blank(self, slot: int) -> bool:
        """Whether the slot is absent or an empty frame."""
        return not self.raw(slot)

    def expect(self, slot: int, name: str, value: bytes) -> None:
        """Require an exact constant (e.g. the registration room sentinel b"None")."""
        if self.frames[slot] != value:
            raise fail(self.what, slot, name, Reason.LEGACY_BAD_VALUE,
                       f"expected {value!r}, found {show(self.frames[slot])}", self.offset)

    def decode(self, slot: int, name: str, fn: Callable[..., T], *args: object) -> T:
        """Run a decoder, attaching this slot to any failure."""
        try:
            return fn(*args)
        except CodecProblem as p:
            raise self.error(slot, name, p) from None

    def num(self, slot: int, name: str, lo: int = 0, hi: int = U64_MAX) -> int:
        """A required ``A`` slot."""
        return self.decode(slot, name, decode_int, self.frames[slot], lo, hi)

    def opt_num(self, slot: int, name: str, lo: int = 0, hi: int = U64_MAX, *,
                record: bool = False) -> int | None:
        """An ``A`` slot that may be absent or empty (None); ``record`` notes an empty frame."""
        data = self.raw(slot)
        if data is None:
            return None
        if data == b"":
            if record:
                self.empty.append(slot)
            return None
        return self.num(slot, name, lo, hi)

    def text(self, slot: int, name: str, encoding: str = "ascii") -> str:
        """An ``S`` or ``U8`` slot."""
        return self.decode(slot, name, decode_text, self.frames[slot], encoding)

    def array(self, slot: int, name: str, fmt: str) -> list[int]:
        """A native packed array slot; absent means empty."""
        return self.decode(slot, name, unpack_array, self.raw(slot) or b"", fmt)

    def lists(self, slot: int, name: str, fmt: str) -> list[list[int]]:
        """A ``pack_int_lists`` slot; absent means empty."""
        return self.decode(slot, name, unpack_int_lists, self.raw(slot) or b"", fmt)

    def scalar(self, slot: int, name: str, fmt: str) -> int:
        """A single packed scalar slot."""
        return self.decode(slot, name, unpack_scalar, self.frames[slot], fmt)

    def result(self, message: M, legacy: LegacyFraming | None = None) -> ParseResult[M]:
        """Wrap the message with the assumptions made while reading; ``legacy`` (the message's field)
        gets what is unusual about the frames, and stays unset when nothing is."""
        count = len(self.frames) if len(self.frames) < self.full else 0
        if legacy is not None and (count or self.empty or self.list_lengths):
            legacy.CopyFrom(LegacyFraming(frame_count=count, empty_slots=sorted(self.empty),
                                          list_lengths=self.list_lengths))
        return ParseResult(message, tuple(self.assumed))


class FrameWriter:
    """Writes the slots of one legacy frame list, honouring the message's LegacyFraming."""

    def __init__(self, what: str, *, full: int, minimum: int,
                 framing: LegacyFraming | None, recordable: Iterable[int] = (),
                 prefix: Sequence[bytes] = ()) -> None:
        self.what = what
        self.offset = len(prefix)
        self.prefix = list(prefix)
        count = framing.frame_count if framing is not None and framing.frame_count else full
        if not minimum <= count <= full:
            raise fail(what, None, "legacy.frame_count", Reason.LEGACY_UNREPRESENTABLE,
                       f"frame_count {count} is not a layout SGLang 0.5.23 parses "
                       f"({minimum}..{full})")
        self.count = count
        self.empties = set(framing.empty_slots) if framing is not None else set()
        self.list_lengths: dict[int, int] = (
            dict(framing.list_lengths) if framing is not None else {})
        bad = sorted(self.empties - set(recordable))
        if bad:
            raise fail(what, bad[0], "legacy.empty_slots", Reason.LEGACY_UNREPRESENTABLE,
                       "this slot is never recorded as empty by the parser", self.offset)
        self.frames: list[bytes | None] = [None] * count

    def has(self, slot: int) -> bool:
        """Whether the layout being written includes this slot."""
        return slot < self.count

    def carries(self, slot: int) -> bool:
        """Whether this slot is written with a value (present and not recorded empty)."""
        return self.has(slot) and slot not in self.empties

    def raw(self, slot: int, name: str, data: bytes, *, default: bool = False) -> None:
        """Write bytes as they are; ``default`` says the value may go unsent or as an empty frame."""
        if not self.has(slot) or slot in self.empties:
            if not default:
                why = ("the message records it as an empty frame" if self.has(slot)
                       else f"legacy.frame_count {self.count} stops before it")
                raise fail(self.what, slot, name, Reason.LEGACY_UNREPRESENTABLE,
                           f"has a non-default value but {why}", self.offset)
            if self.has(slot):
                self.frames[slot] = b""
            return
        self.frames[slot] = data

    def encode(self, slot: int, name: str, fn: Callable[..., bytes], *args: object) -> bytes:
        """Run an encoder, attaching this slot to any failure."""
        try:
            return fn(*args)
        except CodecProblem as p:
            raise fail(self.what, slot, name, p.reason, p.detail, self.offset) from None

    def num(self, slot: int, name: str, value: int, *, default: bool = False) -> None:
        """Write an ``A`` integer."""
        self.raw(slot, name, encode_int(value), default=default)

    def opt_num(self, slot: int, name: str, value: int | None) -> None:
        """Write an ``A`` integer, or an empty frame for None."""
        self.raw(slot, name, b"" if value is None else encode_int(value), default=value is None)

    def text(self, slot: int, name: str, value: str, encoding: str = "ascii", *,
             default: bool = False) -> None:
        """Write ``S`` / ``U8`` text."""
        self.raw(slot, name, self.encode(slot, name, encode_text, value, encoding), default=default)

    def array(self, slot: int, name: str, values: Sequence[int], fmt: str) -> None:
        """Write a native packed array (empty list = empty frame)."""
        self.raw(slot, name, self.encode(slot, name, pack_array, values, fmt), default=not values)

    def lists(self, slot: int, name: str, values: Sequence[Sequence[int]], fmt: str) -> None:
        """Write a ``pack_int_lists`` frame (empty outer list = empty frame)."""
        self.raw(slot, name, self.encode(slot, name, pack_int_lists, values, fmt), default=not values)

    def scalar(self, slot: int, name: str, value: int, fmt: str, *, default: bool) -> None:
        """Write one packed scalar."""
        self.raw(slot, name, self.encode(slot, name, pack_scalar, value, fmt), default=default)

    def unrepresentable(self, slot: int | None, name: str, detail: str) -> LegacyFormatError:
        """An error for a message that cannot be expressed in this layout."""
        return fail(self.what, slot, name, Reason.LEGACY_UNREPRESENTABLE, detail, self.offset)

    def done(self) -> list[bytes]:
        """The finished frame list (with any guard prefix)."""
        missing = [i for i, f in enumerate(self.frames) if f is None]
        if missing:  # a layout bug in this package, not bad input
            raise fail(self.what, missing[0], "layout", Reason.LEGACY_UNREPRESENTABLE,
                       "slot was never written")
        return self.prefix + [f for f in self.frames if f is not None]
