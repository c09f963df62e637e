"""Bad legacy input: each error class, and 'accepted means rebuilt byte for byte'.

Every parse failure must be a LegacyFormatError (a ValueError) with a Reason and
a message naming the slot and field; never IndexError, struct.error,
UnicodeDecodeError or AssertionError. Any frame list the parser accepts must
rebuild to exactly the same frames, so the bridge never silently loses bytes.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.errors import LegacyFormatError, Reason
from pdproto.legacy import LegacyBackend, LegacyKind, classify, mooncake, nixl, parse_any
from pdproto.v1 import (
    AbortAck,
    AbortNotification,
    KvRegistration,
    PrefillCompleteBootstrap,
    TransferInfo,
    TransferStatus,
)
from ._legacy_strategies import (
    MC_REG,
    NX_REG,
    aborts,
    mooncake_transfer_infos,
    nixl_transfer_infos,
    registrations,
)


def _mc_registration() -> list[bytes]:
    q = lambda *v: struct.pack(f"{len(v)}Q", *v)  # noqa: E731
    return [b"None", b"10.0.0.2", b"7001", b"10.0.0.2:16000", q(4096, 8192), q(65536), b"",
            b"0", b"2", b"1024", b"", b"", b"", b"", b"", b"", b"2", b"1", b"", q(1024, 1024)]


def _nx_registration() -> list[bytes]:
    q = lambda *v: struct.pack(f"{len(v)}Q", *v)  # noqa: E731
    return [nixl.GUARD, b"None", b"10.0.0.3", b"7002", b"agent-1", b"\x00meta", q(4096),
            q(65536), b"", b"0", b"2", b"1", b"1024", b"", b"", b"", b"", b"", b"VRAM",
            q(1024), b"", b"", b"2", b"1", b""]


def _reason(fn: Any, frames: Any) -> LegacyFormatError:
    with pytest.raises(LegacyFormatError) as info:
        fn(frames)
    assert isinstance(info.value, ValueError)
    return info.value


def _with(frames: list[bytes], slot: int, value: bytes) -> list[bytes]:
    out = list(frames)
    out[slot] = value
    return out


def test_valid_fixtures_parse() -> None:
    assert mooncake.parse_registration(_mc_registration()).message.dcp.size == 2
    assert nixl.parse_registration(_nx_registration()).message.dcp.rank == 1


def test_frame_count() -> None:
    err = _reason(mooncake.parse_registration, _mc_registration()[:9])
    assert err.reason is Reason.LEGACY_FRAME_COUNT and "9 frames" in err.message
    err = _reason(mooncake.parse_registration, _mc_registration() + [b""])
    assert err.reason is Reason.LEGACY_FRAME_COUNT and "10..20" in err.message
    err = _reason(mooncake.parse_abort, [b"ABORT", b"1", b"host"])
    assert err.reason is Reason.LEGACY_FRAME_COUNT and "2, 4, 5" in err.message
    assert _reason(nixl.parse_abort_ack, [b"ABORT_ACK", b"1"]).reason is Reason.LEGACY_FRAME_COUNT
    assert _reason(mooncake.parse_status, [b"1", b"4"]).reason is Reason.LEGACY_FRAME_COUNT


@pytest.mark.parametrize("bad", [b"70a1", b"+7001", b"07001", b" 7001", b"-0", b"", b"1" * 40])
def test_bad_integer(bad: bytes) -> None:
    err = _reason(mooncake.parse_registration, _with(_mc_registration(), 2, bad))
    assert err.reason is Reason.LEGACY_BAD_INTEGER
    assert "slot 2 (dst_port)" in err.message and err.metadata["slot"] == "2"


def test_bad_integer_names_the_nixl_wire_frame() -> None:
    err = _reason(nixl.parse_registration, _with(_nx_registration(), 12, b"x"))
    assert err.reason is Reason.LEGACY_BAD_INTEGER
    assert "slot 11 (dst_kv_item_len, wire frame 12)" in err.message


def test_bad_text() -> None:
    err = _reason(mooncake.parse_registration, _with(_mc_registration(), 1, b"\xff\xfe"))
    assert err.reason is Reason.LEGACY_BAD_TEXT and "endpoint" in err.message
    err = _reason(nixl.parse_status, [b"KV_STATUS", b"1", b"0", b"0", b"\xc3("])
    assert err.reason is Reason.LEGACY_BAD_TEXT and "reason" in err.message


@pytest.mark.parametrize(("slot", "value", "field"), [
    (4, b"\x01" * 7, "dst_kv_ptrs"),
    (12, b"\x01" * 6, "dst_kv_layer_ids"),
    (6, b"\x01\x00\x00\x00", "data_ptrs"),  # PIL header announces a list it lacks
    (6, struct.pack("<2I", 1, 5) + b"\x00" * 5, "data_ptrs"),  # 5 bytes of Q
    (6, struct.pack("<2I", 1, 8) + b"\x00" * 9, "data_ptrs"),  # trailing byte
    (6, struct.pack("<I", 0), "data_ptrs"),  # SGLang never writes a 0-list header
    (14, b"\x01\x02\x03\x04", "staging_base_ptr"),
])
def test_bad_length(slot: int, value: bytes, field: str) -> None:
    err = _reason(mooncake.parse_registration, _with(_mc_registration(), slot, value))
    assert err.reason is Reason.LEGACY_BAD_LENGTH and field in err.message


def test_bad_length_aux_data() -> None:
    frames = [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 9), b"12345678"]
    err = _reason(mooncake.parse_aux_data, frames)
    assert err.reason is Reason.LEGACY_BAD_LENGTH and "9 bytes" in err.message


def test_missing_guard() -> None:
    err = _reason(nixl.parse_registration, _nx_registration()[1:])
    assert err.reason is Reason.LEGACY_MISSING_GUARD and "NixlMsgGuard" in err.message
    assert _reason(nixl.parse_transfer_info, []).reason is Reason.LEGACY_MISSING_GUARD


@pytest.mark.parametrize(("fn", "frames", "needle"), [
    (mooncake.parse_registration, _with(_mc_registration(), 0, b"7"), "room"),
    (mooncake.parse_status, [b"1", b"7", b"0"], "KVPoll value 7"),
    (nixl.parse_registration, _with(_nx_registration(), 18, b"HBM"), "memory kind 'HBM'"),
    (mooncake.parse_registration, _with(_mc_registration(), 2, b"4294967296"), "dst_port"),
    (mooncake.parse_staging_rsp,
     [b"STAGING_RSP", b"1", b"0", b"-3", b"0", b"0", b"s"], "offset"),
    (mooncake.parse_abort, [b"ABORTED", b"1"], "tag"),
])
def test_bad_value(fn: Any, frames: list[bytes], needle: str) -> None:
    err = _reason(fn, frames)
    assert err.reason is Reason.LEGACY_BAD_VALUE and needle in err.message


def test_bad_value_nixl_dummy_flag() -> None:
    frames = [nixl.GUARD, b"5", b"h", b"1", b"a", b"", b"0", b"1", b"", b"0", b"2"]
    err = _reason(nixl.parse_transfer_info, frames)
    assert err.reason is Reason.LEGACY_BAD_VALUE and "is_dummy" in err.message


def test_list_length_mismatch() -> None:
    frames = _with(_mc_registration(), 12, struct.pack("3I", 0, 1, 2))
    err = _reason(mooncake.parse_registration, frames)
    assert err.reason is Reason.LEGACY_LIST_LENGTH_MISMATCH
    assert "3 entries but the kv ptrs list has 2" in err.message
    frames = _with(_nx_registration(), 18, b"VRAM,DRAM")
    assert _reason(nixl.parse_registration, frames).reason is Reason.LEGACY_LIST_LENGTH_MISMATCH


def test_not_a_frame_list() -> None:
    assert _reason(mooncake.parse_status, b"123").reason is Reason.LEGACY_BAD_VALUE
    assert _reason(mooncake.parse_status, [b"1", "4", b"0"]).reason is Reason.LEGACY_BAD_VALUE


def _mc_reg_msg() -> KvRegistration:
    return mooncake.parse_registration(_mc_registration()).message


def test_unrepresentable() -> None:
    msg = _mc_reg_msg()
    msg.nixl.agent_name = "a"
    assert _reason(mooncake.build_registration, msg).reason is Reason.LEGACY_UNREPRESENTABLE
    msg = _mc_reg_msg()
    msg.kv_buffers[0].layer_id = 3
    err = _reason(mooncake.build_registration, msg)
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "layer id" in err.message
    msg = _mc_reg_msg()
    msg.notify_endpoint.host = "héte"
    assert _reason(mooncake.build_registration, msg).reason is Reason.LEGACY_UNREPRESENTABLE
    msg = _mc_reg_msg()
    msg.legacy.frame_count = 16  # pre-DCP layout cannot carry dcp size 2
    err = _reason(mooncake.build_registration, msg)
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "dcp is set" in err.message
    info = TransferInfo(room=1, dst_kv_pages=[1])
    err = _reason(mooncake.build_transfer_info, info)
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "aux index" in err.message
    err = _reason(nixl.build_status, TransferStatus(room=1))
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE
    # A set field SGLang sends only after an unset one, or a field its layout always carries.
    err = _reason(mooncake.build_abort, AbortNotification(room=1, generation=2))
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "decode_ip" in err.message
    err = _reason(nixl.build_abort_ack, AbortAck(room=1))
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "prefill_rank" in err.message
    err = _reason(mooncake.build_bootstrap, PrefillCompleteBootstrap(room=1))
    assert err.reason is Reason.LEGACY_UNREPRESENTABLE and "decode_ip" in err.message


def test_classify_and_parse_any() -> None:
    assert classify(_mc_registration()).backend is LegacyBackend.MOONCAKE
    assert classify(_nx_registration()).kind is LegacyKind.REGISTRATION
    assert classify([b"ABORT", b"1"]).backend is None
    assert classify([b"ABORT_ACK", b"1"]).backend is LegacyBackend.MOONCAKE
    assert classify([b"1", b"4", b"0"]).kind is LegacyKind.STATUS
    kind, result = parse_any([b"KV_STATUS", b"9", b"4", b"0", b""])
    assert kind.kind is LegacyKind.STATUS and result.message.room == 9
    kind, result = parse_any([b"CHUNK_READY", b"1", b"2", b"3", b"4", b"w", b"5"],
                             LegacyBackend.NIXL)
    assert kind.kind is LegacyKind.CHUNK_READY and result.message.prefill_rank == 5
    for junk in ([], [b"\x89PDP"], [b"1", b"2"], "frames"):
        assert _reason(classify, junk).reason is Reason.LEGACY_UNKNOWN_KIND
    err = _reason(lambda f: parse_any(f, LegacyBackend.NIXL), [b"AUX_DATA"] + [b""] * 5)
    assert err.reason is Reason.LEGACY_UNKNOWN_KIND
    err = _reason(lambda f: parse_any(f, LegacyBackend.NIXL), _mc_registration())
    assert err.reason is Reason.LEGACY_UNKNOWN_KIND


# --- accepted input rebuilds exactly --------------------------------------------------

CASES: list[tuple[Any, Any]] = [
    (registrations(MC_REG), mooncake.build_registration),
    (registrations(NX_REG), nixl.build_registration),
    (mooncake_transfer_infos(), mooncake.build_transfer_info),
    (nixl_transfer_infos(), nixl.build_transfer_info),
    (aborts(), mooncake.build_abort),
]
PARSERS = {
    mooncake.build_registration: mooncake.parse_registration,
    nixl.build_registration: nixl.parse_registration,
    mooncake.build_transfer_info: mooncake.parse_transfer_info,
    nixl.build_transfer_info: nixl.parse_transfer_info,
    mooncake.build_abort: mooncake.parse_abort,
}
INTERESTING = st.sampled_from([b"", b"0", b"1", b"-1", b"None", b"VRAM", b"\xff",
                               b"\x00" * 4, b"\x00" * 8, struct.pack("<2I", 1, 0),
                               struct.pack("<2I", 1, 4) + b"\x01\x00\x00\x00"])


@st.composite
def mutated(draw: st.DrawFn) -> tuple[Any, list[bytes]]:
    """Valid frames with one edit: drop, append, replace, truncate or extend a frame."""
    strategy, build = draw(st.sampled_from(CASES))
    frames = build(draw(strategy))
    op = draw(st.sampled_from(["drop", "append", "replace", "truncate", "extend"]))
    i = draw(st.integers(0, len(frames) - 1))
    if op == "drop":
        del frames[i]
    elif op == "append":
        frames.append(draw(INTERESTING | st.binary(max_size=8)))
    elif op == "replace":
        frames[i] = draw(INTERESTING | st.binary(max_size=12))
    elif op == "truncate":
        frames[i] = frames[i][: draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    else:
        frames[i] = frames[i] + draw(st.binary(min_size=1, max_size=4))
    return PARSERS[build], frames


@settings(max_examples=int(os.environ.get("LEGACY_EXAMPLES", "150")))
@given(mutated())
def test_accepted_frames_rebuild_byte_for_byte(case: tuple[Any, list[bytes]]) -> None:
    parse, frames = case
    try:
        result = parse(frames)
    except LegacyFormatError as err:
        assert err.reason in Reason and str(err)
        return
    build = next(b for b, p in PARSERS.items() if p is parse)
    assert build(result.message) == frames
