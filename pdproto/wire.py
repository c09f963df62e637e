"""Envelope framing: one pdproto message <-> one bytes frame (one ZMQ frame).

A frame is a 10-byte header (magic 0xB7 0x50, protocol major and minor, payload length)
and the serialized ``pdproto.v1.Envelope``: the layout, the checks and their reasons are
in docs/protocol.md, section 4.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final, TypeVar, cast, overload

from google.protobuf.message import Message

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR
from pdproto.errors import MessageTooLargeError, Reason, UnsupportedVersionError, WireError
from pdproto.v1.envelope_pb2 import Envelope

MAGIC: Final = b"\xb7\x50"
"""First two bytes of every Envelope frame."""

HEADER: Final = struct.Struct(">2sHHI")
"""Header layout: magic, major, minor, payload length."""

HEADER_SIZE: Final = HEADER.size
"""Bytes before the Envelope payload (10)."""

DEFAULT_MAX_FRAME_BYTES: Final = 4 * 1024 * 1024
"""Default frame size limit, header included; equal to gRPC's default receive limit."""

BODY_ONEOF: Final = "body"
"""Name of the oneof that holds an envelope's message."""

_MAX_HEADER_VERSION: Final = 0xFFFF
_PREVIEW_BYTES: Final = 16

M = TypeVar("M", bound=Message)


def is_envelope_frame(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` starts with the Envelope magic (SGLang's ASCII frames never do)."""
    try:
        # memoryview: any buffer (zmq frames included), without copying the frame.
        return bytes(memoryview(data)[: len(MAGIC)]) == MAGIC
    except TypeError:
        return False


def body_field_for(message: Message, envelope_type: type[Message] = Envelope) -> str:
    """Name of the envelope body field that carries ``message``'s type; TypeError if none."""
    oneof = envelope_type.DESCRIPTOR.oneofs_by_name[BODY_ONEOF]
    for field in oneof.fields:
        if field.message_type is message.DESCRIPTOR:
            return str(field.name)
    kinds = ", ".join(f.message_type.name for f in oneof.fields if f.message_type is not None)
    raise TypeError(
        f"{type(message).__name__} cannot travel in {envelope_type.__name__}; carried kinds: {kinds}"
    )


def encode(
    message: Message,
    *,
    capabilities: Iterable[str] = (),
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> bytes:
    """Frame ``message`` (a body kind, or a whole ``Envelope``) as one bytes frame.

    A body message is wrapped in an Envelope stamped with this package's protocol
    version and ``capabilities``. An Envelope is framed as it is (its version is
    filled in when unset; its own capabilities are used); an Envelope whose only
    body is a kind unknown to this reader (kept by ``decode_envelope``) is
    forwarded as it came. Raises WireError (WIRE_EMPTY_BODY, MESSAGE_TOO_LARGE),
    and TypeError for a message kind no Envelope can carry.
    """
    capabilities = list(capabilities)
    if isinstance(message, Envelope):
        if capabilities:
            raise TypeError("an Envelope carries its own capabilities; set them on it")
        envelope = message
    else:
        envelope = Envelope(capabilities=capabilities)
        getattr(envelope, body_field_for(message)).CopyFrom(message)
    return encode_envelope(envelope, max_frame_bytes=max_frame_bytes)


def encode_envelope(
    envelope: Message,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> bytes:
    """Frame any envelope-shaped message (a ``version`` field and a ``body`` oneof).

    The header version is the envelope's ``version`` when set, otherwise
    (PROTOCOL_MAJOR, PROTOCOL_MINOR), which is then also written into a copy of
    the envelope, so header and payload always agree.
    """
    if envelope.WhichOneof(BODY_ONEOF) is None and not _has_unknown_fields(envelope):
        raise WireError(
            f"refusing to encode a {type(envelope).__name__} with no body",
            reason=Reason.WIRE_EMPTY_BODY,
        )
    if envelope.HasField("version"):
        version = getattr(envelope, "version")
        major, minor = int(version.major), int(version.minor)
    else:
        major, minor = PROTOCOL_MAJOR, PROTOCOL_MINOR
        stamped = type(envelope)()
        stamped.CopyFrom(envelope)
        version = getattr(stamped, "version")
        version.major, version.minor = major, minor
        envelope = stamped
    if major > _MAX_HEADER_VERSION or minor > _MAX_HEADER_VERSION:
        raise UnsupportedVersionError(
            f"version {major}.{minor} does not fit the 16-bit frame header",
            reason=Reason.UNSUPPORTED_VERSION,
            metadata={"major": major, "minor": minor},
        )
    # Deterministic: map entries in key order, so equal messages give equal frames.
    payload = envelope.SerializeToString(deterministic=True)
    size = HEADER_SIZE + len(payload)
    if size > max_frame_bytes:
        raise _too_large(size, max_frame_bytes)
    return HEADER.pack(MAGIC, major, minor, len(payload)) + payload


def decode(
    data: bytes,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    envelope_type: type[Message] = Envelope,
) -> Message:
    """Decode one frame and return its body message (e.g. a ``KvRegistration``).

    Raises WireError, and nothing else, on any input; see ``decode_envelope``.
    A body kind unknown to this reader raises WIRE_UNKNOWN_BODY (use
    ``decode_envelope`` to keep such a frame whole).
    """
    envelope = decode_envelope(data, envelope_type, max_frame_bytes=max_frame_bytes)
    case = envelope.WhichOneof(BODY_ONEOF)
    if case is None:  # only unknown fields are set
        version = getattr(envelope, "version")
        raise WireError(
            f"body kind unknown to this reader (sender speaks {version.major}.{version.minor}, "
            f"reader {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}); decode_envelope keeps it whole",
            reason=Reason.WIRE_UNKNOWN_BODY,
            metadata={"major": version.major, "minor": version.minor},
        )
    return cast(Message, getattr(envelope, case))


def decode_as(
    data: bytes, kind: type[M], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> M:
    """Decode one frame whose body must be a ``kind``; WIRE_UNEXPECTED_BODY otherwise."""
    body = decode(data, max_frame_bytes=max_frame_bytes)
    if not isinstance(body, kind):
        raise WireError(
            f"expected a {kind.__name__} body, found {type(body).__name__}",
            reason=Reason.WIRE_UNEXPECTED_BODY,
            metadata={"expected": kind.__name__, "found": type(body).__name__},
        )
    return body


@overload
def decode_envelope(data: bytes, *, max_frame_bytes: int = ...) -> Envelope: ...


@overload
def decode_envelope(
    data: bytes, envelope_type: type[M], *, max_frame_bytes: int = ...
) -> M: ...


def decode_envelope(
    data: bytes,
    envelope_type: type[Message] = Envelope,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Decode one frame into a whole envelope (version, capabilities, body).

    Checks, in order: size limit (MESSAGE_TOO_LARGE), magic (WIRE_MALFORMED),
    header and payload length (WIRE_TRUNCATED / WIRE_MALFORMED), major version
    (UNSUPPORTED_VERSION), then parses the payload (WIRE_MALFORMED) and requires a
    body (WIRE_EMPTY_BODY). An envelope without ``version`` gets the header's.
    Fields and body kinds from a newer minor are kept and survive re-encoding.
    Raises WireError, and nothing else, on any input.
    """
    try:  # any bytes-like frame (bytearray, memoryview, zmq frames' buffers)
        view = data if isinstance(data, bytes) else bytes(memoryview(data))
    except TypeError:
        raise WireError(
            f"expected a bytes-like frame, found {type(data).__name__}",
            reason=Reason.WIRE_MALFORMED,
        ) from None
    major, minor, payload = _split_frame(view, max_frame_bytes)
    envelope = envelope_type()
    try:
        envelope.ParseFromString(payload)
    except Exception as exc:  # upb raises DecodeError, but any parser failure is a bad frame
        raise WireError(
            f"payload is not a valid {envelope_type.__name__}: {exc}",
            reason=Reason.WIRE_MALFORMED,
            metadata={"payload_bytes": len(payload)},
        ) from exc
    version = getattr(envelope, "version")
    if not envelope.HasField("version"):
        # The header is authoritative; callers always get the sender's version.
        version.major, version.minor = major, minor
    elif (version.major, version.minor) != (major, minor):
        raise WireError(
            f"header says version {major}.{minor} but the envelope says "
            f"{version.major}.{version.minor}",
            reason=Reason.WIRE_MALFORMED,
            metadata={"header": f"{major}.{minor}", "envelope": f"{version.major}.{version.minor}"},
        )
    if envelope.WhichOneof(BODY_ONEOF) is None and not _has_unknown_fields(envelope):
        raise WireError(
            f"{envelope_type.__name__} (version {major}.{minor}) carries no body",
            reason=Reason.WIRE_EMPTY_BODY,
        )
    return envelope


def _split_frame(data: bytes, max_frame_bytes: int) -> tuple[int, int, bytes]:
    """Check the header and return (major, minor, payload)."""
    if len(data) > max_frame_bytes:
        raise _too_large(len(data), max_frame_bytes)
    if len(data) < HEADER_SIZE:
        if data == MAGIC[: len(data)] or data.startswith(MAGIC):
            raise WireError(
                f"frame of {len(data)} bytes ends inside the {HEADER_SIZE}-byte header",
                reason=Reason.WIRE_TRUNCATED,
                metadata={"size": len(data)},
            )
        raise _bad_magic(data)
    magic, major, minor, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _bad_magic(data)
    # The version gate comes before any look at the payload (STYLE: decode version first).
    if major != PROTOCOL_MAJOR:
        raise UnsupportedVersionError(
            f"protocol major {major} (minor {minor}) is not supported; this reader speaks "
            f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}",
            reason=Reason.UNSUPPORTED_VERSION,
            metadata={"major": major, "minor": minor, "supported_major": PROTOCOL_MAJOR},
        )
    available = len(data) - HEADER_SIZE
    if length > available:
        if HEADER_SIZE + length > max_frame_bytes:
            raise _too_large(HEADER_SIZE + length, max_frame_bytes, "header declares a {size}-byte frame, "
                             "over the limit of {limit} bytes")
        raise WireError(
            f"header declares {length} payload bytes but only {available} follow",
            reason=Reason.WIRE_TRUNCATED,
            metadata={"declared": length, "available": available},
        )
    if length < available:
        raise WireError(
            f"{available - length} trailing bytes after the {length}-byte payload",
            reason=Reason.WIRE_MALFORMED,
            metadata={"declared": length, "available": available},
        )
    return major, minor, data[HEADER_SIZE:]


def _too_large(size: int, limit: int,
               message: str = "frame of {size} bytes exceeds the limit of {limit} bytes") -> MessageTooLargeError:
    """MESSAGE_TOO_LARGE for a frame of ``size`` bytes over ``limit`` (``message`` names them as fields)."""
    return MessageTooLargeError(message.format(size=size, limit=limit), metadata={"size": size, "limit": limit})


def _bad_magic(data: bytes) -> WireError:
    """The error for a frame that is not an Envelope frame at all."""
    preview = data[:_PREVIEW_BYTES]
    return WireError(
        f"not an Envelope frame: expected magic {MAGIC!r}, found {preview!r}"
        + ("..." if len(data) > _PREVIEW_BYTES else ""),
        reason=Reason.WIRE_MALFORMED,
        metadata={"size": len(data)},
    )


def _has_unknown_fields(message: Message) -> bool:
    """True when parsing kept fields this schema does not know (a newer writer's)."""
    # Serialized size minus the known fields' size is the unknown fields' size;
    # clearing known fields on a copy leaves exactly the unknown ones.
    probe = type(message)()
    probe.CopyFrom(message)
    for field, _ in probe.ListFields():
        probe.ClearField(field.name)
    return probe.ByteSize() > 0


__all__ = [
    "BODY_ONEOF",
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "body_field_for",
    "decode",
    "decode_as",
    "decode_envelope",
    "encode",
    "encode_envelope",
    "is_envelope_frame",
]
