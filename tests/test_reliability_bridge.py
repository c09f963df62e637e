"""The ZMQ bridge: SGLang 0.5.23 positional frames and Envelope frames on one socket."""

from __future__ import annotations

import pytest

from pdproto import wire
from pdproto.bridge import ENVELOPE, LEGACY, route
from pdproto.errors import LegacyFormatError, WireError
from pdproto.negotiation.topology import example_registration
from pdproto.legacy import mooncake
from pdproto.v1 import transfer_pb2
from tests.reliability import skew


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_both_dialects_interleaved_on_one_socket(backend: str) -> None:
    """Golden SGLang frames and Envelopes from two senders all arrive intact; garbage is typed."""
    out = skew.mixed_bridge(backend, rounds=30)
    assert out.problems == []
    assert out.lost == 0 and out.corrupted == 0
    assert out.ok == 60 and out.failed_expected == out.faults == 30


def test_route_envelope_and_legacy() -> None:
    """The Envelope magic picks the decoder; legacy frames go through the SGLang parsers."""
    reg = example_registration(page_size=64, dcp_size=4, dcp_rank=1, num_layers=2, layer_ids=True)
    got = route([wire.encode(reg)])
    assert got.dialect == ENVELOPE and got.message == reg
    info = transfer_pb2.TransferInfo(room=9, dst_kv_pages=[3, 4], decode_prefix_len=0, dst_aux_index=1)
    frames = mooncake.build_transfer_info(info)
    got = route(frames)
    assert got.dialect == LEGACY and got.backend == "mooncake"
    assert isinstance(got.message, transfer_pb2.TransferInfo) and got.message.room == 9


@pytest.mark.parametrize("frames", [[b"\xb7\x50\x00\x01"], [wire.MAGIC + b"\x00" * 8, b"extra"], [b"WHAT", b"x"], []])
def test_route_rejects_with_typed_errors(frames: list[bytes]) -> None:
    """Malformed messages raise WireError or LegacyFormatError, nothing else."""
    with pytest.raises((WireError, LegacyFormatError)):
        route(frames)


@pytest.mark.parametrize("value", [None, 7, 10**9, 2**70, -1, "frames", b"one frame", [10**9], [b"None", 3],
                                   ["text"], [None], 3.5])
def test_non_frames_are_wire_errors_and_allocate_nothing(value: object) -> None:
    """Whatever a caller hands route or wire.decode, the answer is a typed WireError, and an
    integer "frame" is never turned into that many zero bytes."""
    import tracemalloc

    tracemalloc.start()
    try:
        for call in (route, wire.decode):
            with pytest.raises(WireError) as info:
                call(value)  # type: ignore[arg-type]
            assert info.value.reason.name == "WIRE_MALFORMED"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated for a {type(value).__name__}"
