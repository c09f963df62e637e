"""The chunk notice: one format, built by the prefill service and parsed by the decode."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.transfer import decode_notification, encode_notification
from pdproto.transfer.notice import ChunkNotice, decode_chunk_notice, encode_chunk_notice

U64 = st.integers(0, 2**64 - 1)


@given(U64, U64, st.integers(0, 2**32), st.booleans())
def test_round_trip(room: int, generation: int, chunk: int, last: bool) -> None:
    notice = ChunkNotice(room, generation, chunk, last)
    received = decode_notification("prefill-agent", encode_chunk_notice(notice))
    assert received is not None and decode_chunk_notice(received) == notice


def test_wire_bytes_are_the_documented_ones() -> None:
    # docs/protocol.md, "Chunk notices": room as 8 bytes little-endian, then ASCII.
    assert encode_chunk_notice(ChunkNotice(7, 2, 3, True)) == bytes([7, 0, 0, 0, 0, 0, 0, 0]) + b"gen=2 chunk=3 last=1"


@pytest.mark.parametrize("payload", [b"", b"done", b"gen=1 chunk=2", b"gen=1 chunk=2 last=2", b"gen=-1 chunk=0 last=0",
                                     b"gen=1  chunk=2 last=0", b"gen=1 chunk=2 last=0 ", b"chunk=2 gen=1 last=0",
                                     b"gen=" + b"9" * 21 + b" chunk=0 last=0"])
def test_anything_else_is_not_a_chunk_notice(payload: bytes) -> None:
    received = decode_notification("peer", encode_notification(1, payload))
    assert received is not None and decode_chunk_notice(received) is None


@given(st.binary(max_size=64))
def test_arbitrary_payloads_never_raise(payload: bytes) -> None:
    received = decode_notification("peer", encode_notification(5, payload))
    assert received is not None
    parsed = decode_chunk_notice(received)
    assert parsed is None or encode_chunk_notice(parsed) == encode_notification(5, payload)
