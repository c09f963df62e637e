"""SGLang 0.5.23's PD transfer on CPU through tests/sglang/pd_harness.py: SGLang's Mooncake, then pdproto.

Every run is real processes: SGLang's ServerArgs, bootstrap server, pools and the backend's
manager, sender and receiver, driven in the order of ``prefill.py``/``decode.py``; each
decode rank checks every byte of its KV pool, aux buffers and state. The Mooncake run
proves the harness on SGLang's own backend; the pdproto runs are issue 13's proof:

* dense MLA prefill -> DCP 4 decode (5 processes): chunked prefill, a partial last page,
  a sub-page prompt and a decode that holds a 256-token prefix, with a bearer token;
* the Kimi-Linear-shaped model (MLA KV + KDA state + aux) -> decode DCP 2 (the state split
  by TP), on SGLang's shared Mooncake engine, then a decode killed mid-transfer.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang.pd_harness import FAILED, REQUESTS, SUCCESS, TRANSFERRING, run

pytestmark = pytest.mark.process

TOKEN = {"PDPROTO_TOKEN": "harness-token"}
KV_ROW = 1152  # bytes of one MLA row (576 bf16)


def _assert_ranks_ok(out: dict[str, Any], ranks: int, rooms: int) -> None:
    assert out["prefill_rc"] == 0, out["prefill_stderr"]
    assert len(out["decode"]) == ranks
    for decode, err in zip(out["decode"], out.get("decode_stderr", [])):
        assert decode is not None, err
        assert decode["polls"] == [SUCCESS] * rooms, decode["reasons"]
        assert decode["mismatches"] == []


def test_sglang_mooncake_moves_every_byte() -> None:
    """Chunked prefill, a decode prefix, partial and sub-page prompts: all land exactly."""
    out = run("mooncake_tcp")
    _assert_ranks_ok(out, 1, len(REQUESTS))
    assert out["decode_rc"] == [0], out["decode_stderr"]
    results = out["prefill"]["results"]
    assert {int(room): r["poll"] for room, r in results.items()} == {r.room: SUCCESS for r in REQUESTS}
    # The prefill learned each decode prefix through pop_decode_prefix_len().
    assert {int(room): r["prefix"] for room, r in results.items()} == {
        r.room: r.decode_prefix for r in REQUESTS
    }
    assert all(r["metric_bytes"] > 0 for r in results.values())


def test_pdproto_dense_mla_prefill_to_dcp4_decode_moves_every_byte() -> None:
    """pdproto relays a dense MLA prefill into four DCP ranks' shards, every byte where it belongs."""
    out = run("pdproto", dcp=4, env=TOKEN)
    _assert_ranks_ok(out, 4, len(REQUESTS))
    assert out["decode_rc"] == [0] * 4, out["decode_stderr"]
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    assert {room: r["poll"] for room, r in results.items()} == {r.room: SUCCESS for r in REQUESTS}
    assert {room: r["prefix"] for room, r in results.items()} == {r.room: r.decode_prefix for r in REQUESTS}
    # The metric is what moved: each token row after the prefix once (4 layers), and one aux row
    # per decode rank, the same for every room.
    aux = set()
    for req in REQUESTS:
        extra = results[req.room]["metric_bytes"] - (req.tokens - req.decode_prefix) * 4 * KV_ROW
        assert extra > 0 and extra % 4 == 0
        aux.add(extra)
    assert len(aux) == 1
    # Every rank registered with the prefill's gRPC service through the bootstrap server's /route.
    assert out["ready"]["engine"]["adopted"] is False  # no shared Mooncake engine in this run


def test_pdproto_kimi_linear_kv_state_aux_then_decode_killed_mid_transfer() -> None:
    """KV, KDA state (split by TP) and aux all land on both decode ranks; SGLang's shared Mooncake
    engine is reused; then the decode server dies mid-transfer and the prefill's sender names why."""
    requests = tuple(r for r in REQUESTS if r.decode_prefix == 0)
    out = run("pdproto", requests, model="kimi", dcp=2, kill=True, shared_engine=True, env=TOKEN)
    _assert_ranks_ok(out, 2, len(requests))
    results = out["prefill"]["results"]
    assert all(r["poll"] == SUCCESS for r in results.values())
    # One Mooncake engine per process: the backend adopted SGLang's on every rank.
    for engine in [out["ready"]["engine"]] + [d["engine"] for d in out["decode"]]:
        assert engine["adopted"] is True and engine["session"] == engine["shared"]
    # The decode ranks were killed while the request was Transferring, after its first chunk moved.
    assert out["submitted"] == [{"submitted": 999}] * 2
    assert out["transferring"]["poll"] == TRANSFERRING and out["transferring"]["transferring"] > 0
    assert out["decode_rc"] == [-9, -9]
    kill = out["kill"]
    assert kill["poll"] == FAILED, kill
    code, _, text = kill["failure_reason"].partition(": ")
    assert code in ("PEER_GONE", "TRANSFER_FAILED") and text, kill
    assert kill["failure_reason"] in kill["reason"]  # failure_exception() raised with that reason
