"""The SGLang decode side: registration with a prefill rank that cannot be reached, and aborts after forget.

``DecodeSide.peer.connect`` (``pdproto.client.DecodePeer``) runs on SGLang's scheduler thread. A prefill rank whose registration
fails (nothing listens, a firewall, a wrong TLS root) is not tried again for
``RETRY_AFTER_S``: the requests routed to it meanwhile fail at once with that failure,
where each would hold the scheduler thread for the whole Register deadline and stall every
decode batch. A real decode side (Mooncake over TCP, real memory) against a real socket.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pdproto.errors import PdprotoError
from pdproto.integrations.sglang import decode_side, layout
from pdproto.integrations.sglang.settings import BackendSettings

from .test_sglang_layout import AUX, kv_args

pytestmark = pytest.mark.process

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")


_MEMORY: list[np.ndarray] = []
"""The pools of every decode side made here (registered with its engine: kept alive)."""


def _side() -> decode_side.DecodeSide:
    """A decode rank (one MLA layer, SGLang's aux buffers) on a Mooncake engine of its own."""
    kv = np.zeros(64 * 1152 * 4, np.uint8)
    aux = [np.zeros(n * 8, np.uint8) for n in AUX]
    _MEMORY.extend([kv, *aux])
    args = kv_args(layers=1)
    args.kv_data_ptrs, args.kv_data_lens = [kv.ctypes.data], [kv.nbytes]
    args.aux_data_ptrs, args.aux_data_lens = [a.ctypes.data for a in aux], [a.nbytes for a in aux]
    return decode_side.DecodeSide(args, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True,
                                  settings=BackendSettings(engine="mooncake", rpc_timeout_s=2.0), host="127.0.0.1",
                                  notify_port=0, device="cpu", on_outcome=lambda room, outcome: None)


@pytest.fixture
def resetting() -> Iterator[tuple[str, list[int]]]:
    """host:port of a socket that takes each connection and closes it at once, and the connections it took."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    taken = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            taken[0] += 1
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{sock.getsockname()[1]}", taken
    sock.close()


def test_a_prefill_rank_whose_registration_failed_is_not_tried_again_for_a_while(
        resetting: tuple[str, list[int]]) -> None:
    address, taken = resetting
    side = _side()
    try:
        with pytest.raises(PdprotoError) as first:
            side.peer.connect(address)
        tried = taken[0]
        assert tried >= 1  # the registration really went out (and was retried within its deadline)
        with pytest.raises(PdprotoError) as again:
            side.peer.connect(address)
        assert again.value.reason is first.value.reason
        assert "is retried after" in again.value.message and first.value.message in again.value.message
        assert taken[0] == tried  # failed at once, from what the first attempt learned: nothing sent
    finally:
        side.close()


def test_an_abort_after_forget_still_waits_for_a_submit_on_its_way() -> None:
    """SGLang clears a failed room, then aborts it: a submit of the room still on its way must stay
    known, so the abort waits for it (a rank seeing the abort first would acknowledge it and then
    write pages SGLang freed). Done submits are forgotten with the room, kept ones once they end."""
    side = _side()
    try:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        on_way: concurrent.futures.Future[None] = concurrent.futures.Future()
        side.peer._submits[7] = {"a:1": done, "b:2": on_way}
        side.peer._submits[8] = {"a:1": done}
        side.peer.forget(7)
        side.peer.forget(8)
        assert side.peer._submits == {7: {"b:2": on_way}}
        on_way.set_result(None)
        assert side.peer._submits == {}
    finally:
        side.close()


HEADS, HEAD_BYTES, MHA_PAGE, MHA_LAYERS = 4, 32, 16, 2


def _mha_args(kv: list[np.ndarray], aux: list[np.ndarray], tp: int) -> Any:
    """KVArgs of an MHA pool of TP ``tp`` (K then V of every layer: HEADS / tp heads a row) over these arrays."""
    args = kv_args(layers=2 * MHA_LAYERS, token_bytes=HEADS // tp * HEAD_BYTES)
    args.page_size, args.total_kv_head_num = MHA_PAGE, HEADS
    args.kv_item_lens = [MHA_PAGE * HEADS // tp * HEAD_BYTES] * (2 * MHA_LAYERS)
    args.kv_data_ptrs, args.kv_data_lens = [a.ctypes.data for a in kv], [a.nbytes for a in kv]
    args.aux_data_ptrs, args.aux_data_lens = [a.ctypes.data for a in aux], [a.nbytes for a in aux]
    return args


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_an_mha_decode_gets_a_larger_tp_prefills_heads_packed_and_puts_them_in_row_order(engine: str) -> None:
    """Two MHA prefill ranks (TP 2, two heads each) feed an SGLang decode rank of TP 1: each writes its heads of
    every page but the last as one block, and the decode side puts those pages back in row order before SGLang
    hears SUCCESS. Every row of the request holds both ranks' heads; no other row of the pool changes."""
    outcome, seen, want, token_rows = _mha_fan_in(engine)
    assert outcome.state == 4, outcome  # SUCCESS, as SGLang's poll reads it
    for layer, pool in enumerate(seen):
        assert np.array_equal(pool[token_rows], want[layer]), layer
        others = np.setdiff1d(np.arange(pool.shape[0]), token_rows)
        assert not pool[others].any(), layer  # the last page's tail and every other page untouched


def test_a_reorder_that_fails_fails_the_room_instead_of_reporting_it_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong putting the pages in order (here: a fault injected into it), SGLang hears FAILED with
    the cause at once, never SUCCESS over pages out of order and never nothing."""
    def broken(*_: Any) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(decode_side, "unpack_buffers", broken)
    outcome, *_ = _mha_fan_in("mooncake")
    assert (outcome.state, outcome.failure_code) == (5, "INTERNAL") and "injected fault" in outcome.failure_reason


def _mha_fan_in(engine: str) -> tuple[Any, list[np.ndarray], np.ndarray, np.ndarray]:
    """One 70-token request from two MHA prefill sides of TP 2 into a decode side of TP 1: its outcome, the
    decode's pools as they were when SGLang heard it, the rows each layer should hold, and the request's rows."""
    from pdproto.integrations.sglang.prefill_side import PrefillSide

    tokens, rows = 70, 12 * MHA_PAGE  # 5 pages, the last with 6 tokens
    src_pages, dst_pages = [2, 7, 1, 9, 4], [10, 3, 8, 0, 6]
    rng = np.random.default_rng(5)
    want = rng.integers(1, 255, (2 * MHA_LAYERS, tokens, HEADS * HEAD_BYTES), dtype=np.uint8)
    half = HEADS // 2 * HEAD_BYTES
    settings = BackendSettings(engine=engine, rpc_timeout_s=10.0)
    prefills, memory = [], []
    try:
        for r in range(2):
            kv = [np.zeros((rows, half), np.uint8) for _ in range(2 * MHA_LAYERS)]
            token_rows = np.asarray(src_pages)[np.arange(tokens) // MHA_PAGE] * MHA_PAGE + np.arange(tokens) % MHA_PAGE
            for layer, pool in enumerate(kv):
                pool[token_rows] = want[layer][:, r * half:(r + 1) * half]
            aux = [np.zeros(n * 8, np.uint8) for n in AUX]
            memory += [*kv, *aux]
            prefills.append(PrefillSide(_mha_args(kv, aux, 2), layout.Ranks(attn_tp=(2, r)), is_mla_backend=False,
                                        settings=settings, host="127.0.0.1", device="cpu", prefill_rank=r,
                                        match_timeout_s=30.0))
        kv = [np.zeros((rows, 2 * half), np.uint8) for _ in range(2 * MHA_LAYERS)]
        aux = [np.zeros(n * 8, np.uint8) for n in AUX]
        memory += [*kv, *aux]
        _MEMORY.extend(memory)
        outcomes: concurrent.futures.Future[Any] = concurrent.futures.Future()
        side = decode_side.DecodeSide(_mha_args(kv, aux, 1), layout.Ranks(attn_tp=(1, 0)), is_mla_backend=False,
                                      settings=settings, host="127.0.0.1", notify_port=0, device="cpu",
                                      on_outcome=lambda room, outcome: outcomes.set_result((room, outcome, [
                                          pool.copy() for pool in kv])))
        try:
            addresses = [f"127.0.0.1:{p.port}" for p in prefills]
            assert all(side.peer.connect(a).result.entries[0].packed_fan_in for a in addresses)
            side.submit(5, addresses, dst_pages, 1, None, 0)
            for p in prefills:
                p.submit(5, src_pages[:3], 3 * MHA_PAGE, False, None, None)
                p.submit(5, src_pages[3:], tokens - 3 * MHA_PAGE, True, None, 1)
            room, outcome, seen = outcomes.result(60)
            packed = side.peer.fan_in(5)
            assert room == 5 and packed is not None and packed.pages == tuple(dst_pages[:-1])
            token_rows = np.asarray(dst_pages)[np.arange(tokens) // MHA_PAGE] * MHA_PAGE + np.arange(tokens) % MHA_PAGE
            return outcome, seen, want, token_rows
        finally:
            side.close()
    finally:
        for p in prefills:
            p.close()
