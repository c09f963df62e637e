"""Property tests: parse(build(m)).message == m for every legacy message and backend.

The strategies (tests/_legacy_strategies.py) draw messages in the form the parser
produces. A protobuf serialize/parse round trip sits between build and parse, because
the message alone must carry everything needed to rebuild the frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.legacy import classify, mooncake, nixl
from pdproto.v1 import (
    STAGING_ALLOCATION_GRANTED,
    STAGING_ALLOCATION_OVERSIZED,
    STAGING_ALLOCATION_PENDING,
    AbortAck,
    AbortNotification,
    AuxData,
    ChunkReady,
    KvRegistration,
    PrefillCompleteBootstrap,
    StagingRequest,
    StagingResponse,
    StagingWatermark,
    TransferInfo,
    TransferStatus,
)

from ._legacy_strategies import (
    ASCII,
    EXAMPLES,
    I64,
    MC_REG,
    NX_REG,
    STATES,
    U32,
    U64,
    UTF8,
    abort_acks,
    aborts,
    mooncake_transfer_infos,
    nixl_transfer_infos,
    registrations,
)

M = TypeVar("M", bound=Message)


def _reserialize(msg: M) -> M:
    """The message as a peer would see it after protobuf transport."""
    out = type(msg)()
    out.ParseFromString(msg.SerializeToString())
    return out


def _round_trip(msg: M, build: Callable[[M], list[bytes]],
                parse: Callable[[list[bytes]], Any]) -> list[bytes]:
    frames = build(msg)
    result = parse(frames)
    assert result.message == msg
    again = build(_reserialize(result.message))
    assert again == frames
    return frames


@settings(max_examples=EXAMPLES)
@given(registrations(MC_REG))
def test_mooncake_registration_round_trip(msg: KvRegistration) -> None:
    frames = _round_trip(msg, mooncake.build_registration, mooncake.parse_registration)
    assert classify(frames).kind.value == "registration"


@settings(max_examples=EXAMPLES)
@given(registrations(NX_REG))
def test_nixl_registration_round_trip(msg: KvRegistration) -> None:
    frames = _round_trip(msg, nixl.build_registration, nixl.parse_registration)
    assert frames[0] == nixl.GUARD and len(frames) <= 25
    assert classify(frames).backend is not None


@settings(max_examples=EXAMPLES)
@given(mooncake_transfer_infos())
def test_mooncake_transfer_info_round_trip(msg: TransferInfo) -> None:
    frames = _round_trip(msg, mooncake.build_transfer_info, mooncake.parse_transfer_info)
    assert classify(frames).kind.value == "transfer_info"


@settings(max_examples=EXAMPLES)
@given(nixl_transfer_infos())
def test_nixl_transfer_info_round_trip(msg: TransferInfo) -> None:
    frames = _round_trip(msg, nixl.build_transfer_info, nixl.parse_transfer_info)
    assert classify(frames).kind.value == "transfer_info"


@settings(max_examples=EXAMPLES)
@given(U64, STATES, U32)
def test_mooncake_status_round_trip(room: int, state: int, rank: int) -> None:
    msg = TransferStatus(room=room, state=state, prefill_rank=rank)  # type: ignore[arg-type]
    frames = _round_trip(msg, mooncake.build_status, mooncake.parse_status)
    assert len(frames) == 3


@settings(max_examples=EXAMPLES)
@given(U64, STATES, U32, UTF8, st.booleans())
def test_nixl_status_round_trip(room: int, state: int, rank: int, reason: str,
                                short: bool) -> None:
    msg = TransferStatus(room=room, state=state, prefill_rank=rank)  # type: ignore[arg-type]
    if short:
        msg.legacy.frame_count = 4
    else:
        msg.failure_reason = reason
    _round_trip(msg, nixl.build_status, nixl.parse_status)


BACKENDS = st.sampled_from([mooncake, nixl])


@settings(max_examples=EXAMPLES)
@given(BACKENDS, aborts())
def test_abort_round_trip(backend: Any, msg: AbortNotification) -> None:
    _round_trip(msg, backend.build_abort, backend.parse_abort)


@settings(max_examples=EXAMPLES)
@given(abort_acks(rank_required=False))
def test_mooncake_abort_ack_round_trip(msg: AbortAck) -> None:
    _round_trip(msg, mooncake.build_abort_ack, mooncake.parse_abort_ack)


@settings(max_examples=EXAMPLES)
@given(abort_acks(rank_required=True))
def test_nixl_abort_ack_round_trip(msg: AbortAck) -> None:
    _round_trip(msg, nixl.build_abort_ack, nixl.parse_abort_ack)


@settings(max_examples=EXAMPLES)
@given(U64, ASCII, U32)
def test_mooncake_bootstrap_round_trip(room: int, host: str, port: int) -> None:
    msg = PrefillCompleteBootstrap(room=room)
    msg.decode_endpoint.host, msg.decode_endpoint.port = host, port
    _round_trip(msg, mooncake.build_bootstrap, mooncake.parse_bootstrap)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, U32, ASCII, st.none() | U32)
def test_staging_req_round_trip(backend: Any, room: int, chunk: int, pages: int, session: str,
                                pp: int | None) -> None:
    msg = StagingRequest(room=room, chunk_index=chunk, chunk_pages=pages, session_id=session)
    if pp is not None:
        msg.requester_pp_rank = pp
    _round_trip(msg, backend.build_staging_req, backend.parse_staging_req)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, st.sampled_from([STAGING_ALLOCATION_GRANTED,
                                            STAGING_ALLOCATION_PENDING,
                                            STAGING_ALLOCATION_OVERSIZED]),
       st.integers(0, 2**63 - 1), U64, I64, ASCII)
def test_staging_rsp_round_trip(backend: Any, room: int, chunk: int, alloc: int, offset: int,
                                rnd: int, end: int, session: str) -> None:
    msg = StagingResponse(room=room, chunk_index=chunk, allocation=alloc,  # type: ignore[arg-type]
                          round=rnd, end=end, session_id=session)
    if alloc == STAGING_ALLOCATION_GRANTED:
        msg.offset = offset
    _round_trip(msg, backend.build_staging_rsp, backend.parse_staging_rsp)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U64, ASCII, st.booleans())
def test_watermark_round_trip(backend: Any, rnd: int, tail: int, session: str,
                              short: bool) -> None:
    msg = StagingWatermark(round=rnd, tail=tail)
    if short:
        msg.legacy.frame_count = 3
    else:
        msg.session_id = session
    _round_trip(msg, backend.build_watermark, backend.parse_watermark)


@settings(max_examples=EXAMPLES)
@given(BACKENDS, U64, U32, U32, U32, ASCII, U32)
def test_chunk_ready_round_trip(backend: Any, room: int, chunk: int, start: int, pages: int,
                                writer: str, rank: int) -> None:
    msg = ChunkReady(room=room, chunk_index=chunk, page_start=start, num_pages=pages,
                     writer_id=writer, prefill_rank=rank)
    _round_trip(msg, backend.build_chunk_ready, backend.parse_chunk_ready)


@settings(max_examples=EXAMPLES)
@given(U64, U32, U32, st.binary(max_size=64))
def test_mooncake_aux_data_round_trip(room: int, buf: int, aux: int, data: bytes) -> None:
    msg = AuxData(room=room, buffer_index=buf, aux_index=aux, data=data)
    frames = _round_trip(msg, mooncake.build_aux_data, mooncake.parse_aux_data)
    assert frames[4] == len(data).to_bytes(4, "big")
