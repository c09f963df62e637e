"""A pdproto decode's side of SGLang's Mooncake protocol (pdproto/integrations/sglang/legacy_decode.py).

The frames are checked against SGLang's own builders and an SGLang prefill in
tests/sglang/test_legacy_decode.py; here, without SGLang: what the messages say once parsed
back by ``pdproto.legacy``, the listener on real ZMQ sockets (statuses, acks, aux rows,
hostile frames) and a prefill rank whose connection goes away.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import zmq

from pdproto.errors import LegacyFormatError, Reason, TopologyError
from pdproto.integrations.sglang import legacy_decode
from pdproto.legacy import mooncake
from pdproto.v1 import (
    TRANSFER_STATE_FAILED,
    TRANSFER_STATE_SUCCESS,
    AbortAck,
    AuxData,
    MooncakeEndpoint,
    NixlEndpoint,
    TransferStatus,
)

SESSION = "127.0.0.1:17001"


def _kv_args() -> SimpleNamespace:
    """A Kimi-shaped decode rank: 2 KV entries with layer ids, one state component of 2 tensors, no dims."""
    return SimpleNamespace(
        kv_item_lens=[73728, 73728], kv_data_ptrs=[0x1000, 0x2000], kv_layer_ids=[3, 7], engine_rank=1,
        aux_data_ptrs=[0x9000, 0xA000], state_data_ptrs=[[0x5000, 0x6000]], state_item_lens=[[640, 128]],
        state_dim_per_tensor=[], state_layer_ids=[[0, 1]])


def test_registration_says_what_sglangs_mooncake_decode_says() -> None:
    """M1 parses back to this rank's pools, ranks, DCP and engine; a shorter SGLang list stays short."""
    frames = mooncake.build_registration(legacy_decode.registration(
        _kv_args(), host="10.0.0.2", port=4242, session_id=SESSION, attn_tp_size=2, dcp=(2, 1)))
    assert len(frames) == mooncake.REGISTRATION_FRAMES and frames[0] == b"None"
    msg = mooncake.parse_registration(frames).message
    assert (msg.notify_endpoint.host, msg.notify_endpoint.port, msg.mooncake.session_id) == ("10.0.0.2", 4242, SESSION)
    assert [(b.ptr, b.item_len, b.layer_id) for b in msg.kv_buffers] == [(0x1000, 73728, 3), (0x2000, 73728, 7)]
    assert (msg.attn_tp.rank, msg.attn_tp.size, msg.dcp.size, msg.dcp.rank, msg.kv_item_len) == (1, 2, 2, 1, 73728)
    assert [list(s.data_ptrs) for s in msg.state_buffers] == [[0x5000, 0x6000]]
    assert frames[11] == b""  # state_dim_per_tensor: SGLang packs the empty outer list as an empty frame


def test_transfer_info_and_abort_say_what_sglang_sends() -> None:
    """M2 for a rank that writes (pages, aux row, state slots, prefix) and for a dummy (two empty slots); M4."""
    kw = dict(room=7, host="10.0.0.2", port=4242, session_id=SESSION, required_dst_info_num=2,
              kv_indices=np.array([5, 9, 2], dtype=np.int32), aux_index=3, state_indices=[[4], None],
              decode_prefix_len=None)
    real = mooncake.build_transfer_info(legacy_decode.transfer_info(**kw, is_dummy=False))
    assert real[4] == np.array([5, 9, 2], dtype=np.int32).tobytes() and real[8] == b"0"
    msg = mooncake.parse_transfer_info(real).message
    assert (msg.dst_aux_index, [list(s.indices) for s in msg.dst_state_indices]) == (3, [[4], []])
    dummy = mooncake.build_transfer_info(legacy_decode.transfer_info(**kw, is_dummy=True))
    assert (dummy[4], dummy[5], dummy[6]) == (b"", b"", b"")
    with pytest.raises(LegacyFormatError) as refused:  # SGLang itself would send "None" here
        mooncake.build_transfer_info(legacy_decode.transfer_info(**{**kw, "aux_index": None}, is_dummy=False))
    assert refused.value.reason is Reason.LEGACY_UNREPRESENTABLE
    abort = mooncake.build_abort(legacy_decode.abort(room=7, host="10.0.0.2", port=4242, generation=3))
    assert abort == [b"ABORT", b"7", b"10.0.0.2", b"4242", b"3"]


def test_a_decode_whose_pools_are_not_in_a_mooncake_engine_is_refused_with_what_to_change() -> None:
    assert legacy_decode.session_id(MooncakeEndpoint(session_id=SESSION), "mooncake") == SESSION
    with pytest.raises(TopologyError) as info:
        legacy_decode.session_id(NixlEndpoint(agent_name="a"), "nixl")
    assert info.value.reason is Reason.TOPOLOGY_BACKEND_UNSUPPORTED
    assert "PDPROTO_ENGINE=mooncake" in info.value.message and "backend pdproto" in info.value.message


class _Listener:
    """A LegacyPrefills on a real PULL socket, recording what it hands on."""

    def __init__(self, aux: list[tuple[int, int, int]]) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.statuses: list[TransferStatus] = []
        self.acks: list[AbortAck] = []
        self.lost: list[tuple[str, set[int]]] = []
        self.event = threading.Event()
        self.legacy = legacy_decode.LegacyPrefills(
            self.pull, aux=aux, on_status=self._got(self.statuses), on_ack=self._got(self.acks),
            on_lost=lambda endpoint, rooms: self._got(self.lost)((endpoint, rooms)), send_timeout_s=1.0,
            connect_within_s=1.5)

    def _got(self, into: list[Any]) -> Callable[[object], None]:
        def add(item: object) -> None:
            into.append(item)
            self.event.set()
        return add

    def wait(self, what: list[Any], n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(what) < n and time.monotonic() < deadline:
            self.event.wait(0.05)
            self.event.clear()
        assert len(what) >= n, what

    def close(self) -> None:
        self.legacy.close()
        self.pull.close(linger=0)
        self.ctx.destroy(linger=0)


@pytest.mark.process
def test_listener_follows_statuses_acks_and_aux_rows_and_drops_hostile_frames() -> None:
    """What an SGLang prefill pushes to the decode's rank port reaches the manager; malformed or
    out-of-bounds frames are counted and dropped, and the listener keeps serving."""
    row = 16
    aux = (ctypes.c_ubyte * (row * 4))()
    listener = _Listener([(ctypes.addressof(aux), len(aux), row)])
    push = listener.ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{listener.port}")
    try:
        # The listener starts with the first prefill socket the decode opens.
        listener.legacy.socket(f"tcp://127.0.0.1:{listener.port}")
        for frames in ([b"\xff"], [b"AUX_DATA", b"1", b"0", b"3", b"\x00\x00\x00\x11", b"x" * 17],
                       [b"AUX_DATA", b"1", b"5", b"0", b"\x00\x00\x00\x01", b"x"], [b"STAGING_REQ", b"1", b"0", b"1", b"s"],
                       [b"7", b"9", b"0"]):
            push.send_multipart(frames)  # garbage; aux row past its buffer; no such buffer; staging; KVPoll 9
        push.send_multipart(mooncake.build_aux_data(AuxData(room=7, buffer_index=0, aux_index=2, data=b"a" * row)))
        push.send_multipart(mooncake.build_abort_ack(AbortAck(room=7, prefill_rank=0, generation=4)))
        push.send_multipart(mooncake.build_status(TransferStatus(room=7, state=TRANSFER_STATE_FAILED, prefill_rank=1)))
        push.send_multipart(mooncake.build_status(TransferStatus(room=8, state=TRANSFER_STATE_SUCCESS, prefill_rank=0)))
        listener.wait(listener.statuses, 2)
        assert [(s.room, s.state, s.prefill_rank) for s in listener.statuses] == [
            (7, TRANSFER_STATE_FAILED, 1), (8, TRANSFER_STATE_SUCCESS, 0)]
        assert [(a.room, a.prefill_rank, a.generation) for a in listener.acks] == [(7, 0, 4)]
        assert bytes(aux) == bytes(2 * row) + b"a" * row + bytes(row)  # row 2 only
        assert listener.legacy.counts == {"statuses": 2, "aux_rows": 1, "malformed": 5, "lost": 0}
    finally:
        push.close(linger=0)
        listener.close()


@pytest.mark.process
def test_a_prefill_rank_that_goes_away_fails_the_rooms_sent_to_it() -> None:
    """A connection that closes fails the rooms tracked on that rank after LOST_AFTER_S, one that
    never comes up after its connect grace, and only those rooms; the socket is closed, and a later
    request's new one connects."""
    listener = _Listener([])
    prefill = listener.ctx.socket(zmq.PULL)
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    up, down = f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:9"  # nothing listens on port 9
    try:
        sock, lock = listener.legacy.socket(up)
        with lock:
            sock.send_multipart([b"None"])
        assert prefill.poll(5000) and prefill.recv_multipart() == [b"None"]
        deadline = time.monotonic() + 5
        while not listener.legacy.connected(up) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.legacy.connected(up)
        listener.legacy.track(1, [up])
        listener.legacy.track(2, [up, down])
        listener.legacy.track(3, ["tcp://127.0.0.1:1"])
        listener.legacy.forget(3)
        listener.legacy.socket(down)  # never connects
        listener.wait(listener.lost, 1)
        assert listener.lost == [(down, {2})]
        prefill.close(linger=0)  # the prefill rank exits
        began = time.monotonic()
        listener.wait(listener.lost, 2)
        assert listener.lost[1] == (up, {1, 2})
        assert time.monotonic() - began >= legacy_decode.LOST_AFTER_S * 0.9
        assert listener.legacy.counts["lost"] == 2 and not listener.legacy.connected(up)
        # The prefill comes back: a later request's socket reaches it (closing the lost ones wedged nothing).
        again = listener.ctx.socket(zmq.PULL)
        port = again.bind_to_random_port("tcp://127.0.0.1")
        sock, lock = listener.legacy.socket(f"tcp://127.0.0.1:{port}")
        with lock:
            sock.send_multipart([b"None"])
        assert again.poll(5000) and again.recv_multipart() == [b"None"]
        again.close(linger=0)
    finally:
        listener.close()
