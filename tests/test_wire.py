"""pdproto.wire: round trips for every body kind, the frame layout, and each error class."""

from __future__ import annotations

import struct

import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, wire
from pdproto.errors import Reason, WireError
from pdproto.v1 import (
    MEMORY_KIND_VRAM,
    TRANSFER_STATE_SUCCESS,
    AbortNotification,
    AuxData,
    Envelope,
    KvBuffer,
    KvRegistration,
    MooncakeEndpoint,
    ParallelGroup,
    ProtocolVersion,
    TransferStatus,
)
from tests.fuzz.messages import messages

BODY_FIELDS = list(Envelope.DESCRIPTOR.oneofs_by_name["body"].fields)
BODY_KINDS: list[type[Message]] = [
    f.message_type._concrete_class for f in BODY_FIELDS  # type: ignore[union-attr]
]

# The profile's budget is shared by all body kinds, so "thorough" still scales it up.
PER_KIND_EXAMPLES = max(10, settings().max_examples // 4)

# SGLang 0.5.23 first frames that share a socket with Envelope frames.
SGLANG_FRAMES = [b"None", b"123", b"ABORT", b"ABORT_ACK", b"NixlMsgGuard", b"", b"0", b"-1"]


def frame(payload: bytes, *, major: int = PROTOCOL_MAJOR, minor: int = PROTOCOL_MINOR,
          length: int | None = None) -> bytes:
    """Build a frame by hand from the layout documented in docs/protocol.md."""
    declared = len(payload) if length is None else length
    return b"\xb7\x50" + struct.pack(">HHI", major, minor, declared) + payload


def varint(value: int) -> bytes:
    """Protobuf base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """Protobuf field key."""
    return varint(number << 3 | wire_type)


def reason_of(data: bytes, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> Reason:
    """Decode ``data`` expecting a WireError, and return its reason."""
    with pytest.raises(WireError) as info:
        wire.decode(data, max_frame_bytes=max_frame_bytes)
    assert isinstance(info.value, ValueError)
    assert info.value.message  # a message saying what was found
    return info.value.reason


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", BODY_KINDS, ids=lambda k: k.__name__)
@settings(max_examples=PER_KIND_EXAMPLES)
@given(data=st.data())
def test_decode_encode_round_trips_every_body_kind(kind: type[Message], data: st.DataObject) -> None:
    message = data.draw(messages(kind))
    encoded = wire.encode(message)
    decoded = wire.decode(encoded)
    assert type(decoded) is kind
    assert decoded == message
    assert wire.encode(decoded) == encoded  # deterministic re-encode
    assert wire.is_envelope_frame(encoded)


def test_every_body_kind_is_covered() -> None:
    # A new oneof member gets a round-trip case automatically (parametrized from the descriptor).
    assert len(BODY_KINDS) == len(set(BODY_KINDS)) >= 13


@given(
    body=messages(TransferStatus),
    capabilities=st.lists(st.text(max_size=8), max_size=4),
    minor=st.integers(0, 0xFFFF),
)
def test_envelope_round_trips_with_version_and_capabilities(
    body: TransferStatus, capabilities: list[str], minor: int
) -> None:
    envelope = Envelope(
        version=ProtocolVersion(major=PROTOCOL_MAJOR, minor=minor),
        capabilities=capabilities,
        status=body,
    )
    assert wire.decode_envelope(wire.encode(envelope)) == envelope


def test_encode_stamps_version_and_capabilities() -> None:
    envelope = wire.decode_envelope(wire.encode(AbortNotification(room=7), capabilities=["packed"]))
    assert (envelope.version.major, envelope.version.minor) == (PROTOCOL_MAJOR, PROTOCOL_MINOR)
    assert list(envelope.capabilities) == ["packed"]
    assert envelope.WhichOneof("body") == "abort"


def test_encode_does_not_mutate_an_unversioned_envelope() -> None:
    envelope = Envelope(abort=AbortNotification(room=1))
    wire.encode(envelope)
    assert not envelope.HasField("version")


def test_frame_layout_matches_the_documentation() -> None:
    body = TransferStatus(room=5)
    version = ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR)
    payload = Envelope(version=version, status=body).SerializeToString()
    assert wire.encode(body) == frame(payload)
    assert wire.HEADER_SIZE == 10


# Golden 1.0 frames: the format is API, so these bytes must never change within major 1.
GOLDEN_STATUS = bytes.fromhex("b750000100000000000c0a0208016206082a10011804")
GOLDEN_REGISTRATION = bytes.fromhex(
    "b750000100000000004a0a020801120c6463702d72656c61796f7574523622100a0e31302e302e302e313a"
    "31373030303a04080410014840520862666c6f617431367210088080808080e01f1080a00218002001"
)


def golden_registration() -> KvRegistration:
    """The message GOLDEN_REGISTRATION carries."""
    return KvRegistration(
        page_size=64, kv_cache_dtype="bfloat16", dcp=ParallelGroup(size=4, rank=1),
        mooncake=MooncakeEndpoint(session_id="10.0.0.1:17000"),
        kv_buffers=[KvBuffer(ptr=0x7F0000000000, item_len=36864, layer_id=0,
                             memory_kind=MEMORY_KIND_VRAM)],
    )


def test_golden_frames_decode_and_re_encode_byte_for_byte() -> None:
    status = TransferStatus(room=42, generation=1, state=TRANSFER_STATE_SUCCESS)
    assert wire.decode(GOLDEN_STATUS) == status
    assert wire.encode(wire.decode_envelope(GOLDEN_STATUS)) == GOLDEN_STATUS
    envelope = wire.decode_envelope(GOLDEN_REGISTRATION)
    assert envelope.registration == golden_registration()
    assert list(envelope.capabilities) == ["dcp-relayout"]
    assert wire.encode(envelope) == GOLDEN_REGISTRATION
    # A fresh encode stamps this package's version; 1.0 readers read it (same major).
    fresh = wire.decode_envelope(wire.encode(golden_registration(), capabilities=["dcp-relayout"]))
    assert fresh.registration == golden_registration()
    assert (fresh.version.major, fresh.version.minor) == (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def test_bytes_like_inputs_are_accepted() -> None:
    encoded = wire.encode(TransferStatus(room=9))
    assert wire.decode(bytearray(encoded)) == TransferStatus(room=9)  # type: ignore[arg-type]
    assert wire.decode(memoryview(encoded)) == TransferStatus(room=9)  # type: ignore[arg-type]


def test_decode_as_checks_the_kind() -> None:
    encoded = wire.encode(TransferStatus(room=3))
    assert wire.decode_as(encoded, TransferStatus).room == 3
    with pytest.raises(WireError) as info:
        wire.decode_as(encoded, KvRegistration)
    assert info.value.reason is Reason.WIRE_UNEXPECTED_BODY
    assert "TransferStatus" in info.value.message


def test_encode_rejects_a_kind_no_envelope_carries() -> None:
    with pytest.raises(TypeError, match="ProtocolVersion"):
        wire.encode(ProtocolVersion(major=1))


# ---------------------------------------------------------------- telling frames apart


@pytest.mark.parametrize("data", SGLANG_FRAMES)
def test_sglang_frames_are_not_envelope_frames(data: bytes) -> None:
    assert not wire.is_envelope_frame(data)
    assert reason_of(data) in {Reason.WIRE_MALFORMED, Reason.WIRE_TRUNCATED}


@given(st.text())
def test_no_text_frame_looks_like_an_envelope(text: str) -> None:
    data = text.encode()
    assert not wire.is_envelope_frame(data)
    with pytest.raises(WireError):
        wire.decode(data)


# ---------------------------------------------------------------- error classes


def test_garbage_is_malformed_and_says_what_was_found() -> None:
    with pytest.raises(WireError) as info:
        wire.decode(b"NixlMsgGuard")
    assert info.value.reason is Reason.WIRE_MALFORMED
    assert "NixlMsgGuard" in info.value.message


def test_corrupt_payload_is_malformed() -> None:
    assert reason_of(frame(b"\xff\xff\xff")) is Reason.WIRE_MALFORMED


def test_invalid_utf8_in_a_string_field_is_malformed() -> None:
    # TransferStatus.failure_reason (5) inside body field status (12).
    body = tag(5, 2) + varint(2) + b"\xff\xfe"
    assert reason_of(frame(tag(12, 2) + varint(len(body)) + body)) is Reason.WIRE_MALFORMED


def test_trailing_bytes_are_malformed() -> None:
    assert reason_of(wire.encode(TransferStatus(room=1)) + b"\x00") is Reason.WIRE_MALFORMED


def test_every_proper_prefix_is_truncated() -> None:
    encoded = wire.encode(KvRegistration(page_size=64, kv_cache_dtype="bfloat16"))
    for cut in range(len(encoded)):
        assert reason_of(encoded[:cut]) is Reason.WIRE_TRUNCATED, cut


def test_truncation_message_gives_declared_and_available_sizes() -> None:
    with pytest.raises(WireError) as info:
        wire.decode(frame(b"abc", length=5))
    assert info.value.reason is Reason.WIRE_TRUNCATED
    assert "5" in info.value.message and "3" in info.value.message


def test_envelope_without_body_is_empty_body() -> None:
    payload = Envelope(version=ProtocolVersion(major=PROTOCOL_MAJOR,
                                               minor=PROTOCOL_MINOR)).SerializeToString()
    assert reason_of(frame(payload)) is Reason.WIRE_EMPTY_BODY
    assert reason_of(frame(b"")) is Reason.WIRE_EMPTY_BODY
    with pytest.raises(WireError) as info:
        wire.encode(Envelope(capabilities=["x"]))
    assert info.value.reason is Reason.WIRE_EMPTY_BODY


@pytest.mark.parametrize("major", [0, PROTOCOL_MAJOR + 1, 0xFFFF])
def test_unknown_major_is_rejected_before_the_body_is_read(major: int) -> None:
    with pytest.raises(WireError) as info:
        wire.decode(frame(b"\xff\xff not protobuf", major=major))
    assert info.value.reason is Reason.UNSUPPORTED_VERSION
    assert str(major) in info.value.message
    assert info.value.metadata["major"] == str(major)


def test_unknown_major_written_by_encode_is_rejected_by_decode() -> None:
    envelope = Envelope(version=ProtocolVersion(major=2, minor=0), status=TransferStatus())
    assert reason_of(wire.encode(envelope)) is Reason.UNSUPPORTED_VERSION


def test_header_and_envelope_versions_must_agree() -> None:
    payload = Envelope(version=ProtocolVersion(major=1, minor=3), status=TransferStatus()).SerializeToString()
    assert reason_of(frame(payload, minor=0)) is Reason.WIRE_MALFORMED


def test_non_bytes_input_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        wire.decode("not bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- size limit


def test_oversized_frames_are_rejected_on_both_sides() -> None:
    big = AuxData(room=1, data=b"x" * 1000)
    encoded = wire.encode(big)
    assert reason_of(encoded, max_frame_bytes=500) is Reason.MESSAGE_TOO_LARGE
    with pytest.raises(WireError) as info:
        wire.encode(big, max_frame_bytes=500)
    assert info.value.reason is Reason.MESSAGE_TOO_LARGE
    assert info.value.metadata["limit"] == "500"


def test_the_limit_is_configurable_and_inclusive() -> None:
    encoded = wire.encode(AuxData(data=b"y" * (wire.DEFAULT_MAX_FRAME_BYTES)),
                          max_frame_bytes=2 * wire.DEFAULT_MAX_FRAME_BYTES)
    assert reason_of(encoded) is Reason.MESSAGE_TOO_LARGE
    assert isinstance(wire.decode(encoded, max_frame_bytes=len(encoded)), AuxData)


def test_a_header_declaring_more_than_the_limit_is_too_large() -> None:
    assert reason_of(frame(b"", length=2**32 - 1)) is Reason.MESSAGE_TOO_LARGE


# ---------------------------------------------------------------- newer minor versions


def test_newer_minor_with_unknown_fields_decodes_and_keeps_them() -> None:
    # A 1.7 writer added KvRegistration field 999 and Envelope field 9.
    registration = KvRegistration(page_size=64).SerializeToString() + tag(999, 0) + varint(42)
    payload = (
        Envelope(version=ProtocolVersion(major=1, minor=7)).SerializeToString()
        + tag(9, 2) + varint(3) + b"new"
        + tag(10, 2) + varint(len(registration)) + registration
    )
    data = frame(payload, minor=7)
    body = wire.decode(data)
    assert isinstance(body, KvRegistration) and body.page_size == 64
    assert tag(999, 0) + varint(42) in body.SerializeToString()
    # Re-encoding the body (as this 1.0 reader would forward it) keeps the unknown field.
    assert tag(999, 0) + varint(42) in wire.encode(body)
    # Re-encoding the whole envelope keeps both unknown fields and the sender's version.
    again = wire.encode(wire.decode_envelope(data))
    assert again[2:6] == struct.pack(">HH", 1, 7)
    assert wire.decode_envelope(again) == wire.decode_envelope(data)
    assert b"new" in again and tag(999, 0) + varint(42) in again


def test_unknown_body_kind_from_a_newer_minor() -> None:
    payload = (
        Envelope(version=ProtocolVersion(major=1, minor=2)).SerializeToString()
        + tag(40, 2) + varint(2) + tag(1, 0) + varint(5)
    )
    data = frame(payload, minor=2)
    with pytest.raises(WireError) as info:
        wire.decode(data)
    assert info.value.reason is Reason.WIRE_UNKNOWN_BODY
    envelope = wire.decode_envelope(data)  # kept whole for forwarding
    assert envelope.WhichOneof("body") is None
    assert wire.encode(envelope) == data


def test_an_envelope_without_version_gets_the_header_version() -> None:
    payload = Envelope(status=TransferStatus(room=2)).SerializeToString()
    envelope = wire.decode_envelope(frame(payload, minor=3))
    assert (envelope.version.major, envelope.version.minor) == (PROTOCOL_MAJOR, 3)
    assert wire.decode_envelope(wire.encode(envelope)) == envelope


# ---------------------------------------------------------------- docs drift


def test_protocol_doc_matches_the_frame_constants_and_version() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    assert wire.MAGIC == bytes([0xB7, 0x50]) and "magic 0xB7 0x50" in text
    assert f"{wire.HEADER_SIZE}      n     pdproto.v1.Envelope" in text
    assert f"| {PROTOCOL_MAJOR}.{PROTOCOL_MINOR} |" in text  # the current version has a history row
    for reason in (Reason.WIRE_MALFORMED, Reason.WIRE_TRUNCATED, Reason.WIRE_EMPTY_BODY,
                   Reason.UNSUPPORTED_VERSION, Reason.MESSAGE_TOO_LARGE,
                   Reason.WIRE_UNKNOWN_BODY, Reason.WIRE_UNEXPECTED_BODY):
        assert f"`{reason.name}`" in text


def test_capabilities_go_on_the_envelope_when_one_is_given() -> None:
    with pytest.raises(TypeError, match="capabilities"):
        wire.encode(Envelope(status=TransferStatus()), capabilities=["packed"])
