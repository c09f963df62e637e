"""Remembered negotiation verdicts: one per registration layout, exact for every peer that shares it."""

from __future__ import annotations

import pytest

from pdproto import v1
from pdproto.client import HandshakeClient
from pdproto.errors import InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.topology import example_registration, example_server_info, layout_of, negotiate
from pdproto.v1 import common_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_server.verdicts import Verdicts, result_for

from ._server_harness import SERVE_ARGS, SPEC, running_server

REMEMBERED = "pdproto_negotiations_remembered_total"


def _moved(reg: v1.KvRegistration, shift: int) -> v1.KvRegistration:
    """The same rank shape at other addresses and endpoints."""
    out = v1.KvRegistration()
    out.CopyFrom(reg)
    for b in out.kv_buffers:
        b.ptr += shift
    out.notify_endpoint.port += 1
    out.mooncake.session_id = f"10.0.0.{shift % 200}:1777"
    return out


def test_a_layout_is_negotiated_once_and_each_peer_gets_its_own_result() -> None:
    info = example_server_info(dcp_size=1)
    verdicts = Verdicts()
    first = example_registration(dcp_size=4, dcp_rank=1)
    verdict, shared, remembered = verdicts.of(info, first)
    assert not remembered and verdict == negotiate(info, first)
    again, shared_again, remembered = verdicts.of(info, _moved(first, 1 << 32))
    assert remembered and again is verdict and shared_again is shared
    a, b = result_for(shared, "p-a"), result_for(shared, "p-b")
    assert (a.peer_id, b.peer_id, shared.peer_id) == ("p-a", "p-b", "")
    assert a == verdict.to_proto("p-a")
    # Another DCP rank is another layout.
    assert not verdicts.of(info, example_registration(dcp_size=4, dcp_rank=2))[2]


def test_rejections_are_remembered_and_malformed_input_is_not() -> None:
    info = example_server_info()
    verdicts = Verdicts()
    bad = example_registration(dtype="fp8_e4m3")
    first, _, _ = verdicts.of(info, bad)
    second, result, remembered = verdicts.of(info, _moved(bad, 4096))
    assert remembered and second == first and result.rejection.reason == Reason.TOPOLOGY_KV_DTYPE_MISMATCH.code
    malformed = example_registration()
    del malformed.kv_buffers[:]
    for _ in range(2):
        with pytest.raises(InvalidFieldError) as caught:
            verdicts.of(info, malformed)
        assert caught.value.field == "registration.kv_buffers"


def test_the_memory_is_bounded_and_forgets_a_changed_topology() -> None:
    info = example_server_info(dcp_size=1)
    verdicts = Verdicts(size=2)
    regs = [example_registration(dcp_size=4, dcp_rank=r) for r in range(3)]
    for reg in regs:
        verdicts.of(info, reg)
    assert verdicts.of(info, regs[2])[2] and verdicts.of(info, regs[1])[2]
    assert not verdicts.of(info, regs[0])[2], "the least recently used layout was kept past the bound"
    other = v1.PrefillServerInfo()
    other.CopyFrom(info)
    other.kv_cache_dtype = "fp8_e4m3"
    verdict, _, remembered = verdicts.of(other, regs[0])
    assert not remembered and verdict.reason is Reason.TOPOLOGY_KV_DTYPE_MISMATCH


def test_layout_of_leaves_the_registration_alone_and_is_idempotent() -> None:
    reg = example_registration(dcp_size=2, dcp_rank=1)
    reg.aux_ptrs.extend([0x5000, 0x6000])
    reg.gpu_id = 3
    before = reg.SerializeToString(deterministic=True)
    layout = layout_of(reg)
    assert reg.SerializeToString(deterministic=True) == before
    assert layout_of(layout) == layout
    assert list(layout.aux_ptrs) == [0, 0] and layout.gpu_id == 0
    assert layout.WhichOneof("transport") == "mooncake" and not layout.mooncake.session_id
    assert all(b.ptr == 0 for b in layout.kv_buffers)
    assert [b.item_len for b in layout.kv_buffers] == [b.item_len for b in reg.kv_buffers]


@pytest.mark.process
def test_peers_sharing_a_layout_move_their_own_bytes() -> None:
    """Two decode processes of one shape: the second's verdict is remembered, and each receives its
    own bytes in its own arena; a peer of another shape and a rejected one are judged on their own."""
    peers = [DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=1, pages=32) for _ in range(2)]
    other = DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=3, pages=32)
    bad = DecodeRank.for_spec(SPEC, dcp_size=4, dcp_rank=1, pages=32, kv_dtype="fp8_e4m3")
    try:
        with running_server(*SERVE_ARGS, "--metrics-port", "0") as srv, HandshakeClient(srv.target) as client:
            results = [client.register(p.registration()) for p in peers]
            assert srv.metrics().get(REMEMBERED) == 1
            assert results[0].peer_id != results[1].peer_id
            assert results[0].mode == results[1].mode == v1.NEGOTIATION_MODE_DENSE_TO_DCP
            client.register(other.registration())
            assert srv.metrics().get(REMEMBERED) == 1
            for _ in range(2):
                with pytest.raises(TopologyError) as caught:
                    client.register(bad.registration())
                assert caught.value.reason is Reason.TOPOLOGY_KV_DTYPE_MISMATCH
            assert srv.metrics().get(REMEMBERED) == 2
            for i, (peer, result) in enumerate(zip(peers, results, strict=True)):
                room = 700 + i
                pages = peer.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(result.peer_id, peer.transfer_info(room, pages))
                done = client.wait_for(result.peer_id, [room], timeout=20)
                assert done[room].state == common_pb2.TRANSFER_STATE_SUCCESS, done[room]
                assert peer.verify({room: pages}, SPEC.prompt_tokens) > 0
    finally:
        for p in (*peers, other, bad):
            p.close()


def test_the_memory_is_bounded_by_weight_and_keeps_no_heavy_verdict() -> None:
    # A peer varying a field negotiation ignores (capabilities) makes a new layout each time.
    info = example_server_info(dcp_size=1)
    reg = example_registration(dcp_size=4, dcp_rank=1)
    reg.capabilities[:] = ["made-up-0000"]
    one = len(layout_of(reg).SerializeToString(deterministic=True)) + negotiate(info, reg).to_proto().ByteSize()
    verdicts = Verdicts(budget=8 * one + 7)  # keeps eight such verdicts; a heavier one is too heavy
    for i in range(40):
        reg.capabilities[:] = [f"made-up-{i:04d}"]
        verdicts.of(info, reg)
        assert verdicts.weight <= 8 * one + 7
    assert len(verdicts) == 8
    assert verdicts.of(info, reg)[2], "the latest layout was not kept"
    reg.capabilities[:] = ["made-up-00000"]
    assert not verdicts.of(info, reg)[2] and not verdicts.of(info, reg)[2], "a heavy verdict was kept"
    assert len(verdicts) == 8
