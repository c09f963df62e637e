"""SGLang 0.5.23's PD transfer on CPU through tests/sglang/pd_harness.py: SGLang's Mooncake, then pdproto.

Every run is real processes: SGLang's ServerArgs, bootstrap server, pools and the backend's
manager, sender and receiver, driven in the order of ``prefill.py``/``decode.py``; each
decode rank checks every byte of its KV pool, aux buffers and state. The Mooncake runs
prove the harness on SGLang's own backend (MLA 1 -> 1, DSA -> DCP 4); the pdproto runs are
issues 13's and 33's proof:

* dense MLA prefill -> DCP 4 decode (5 processes): chunked prefill, a partial last page,
  a sub-page prompt and a decode that holds a 256-token prefix, with a bearer token;
* a DeepSeek-V3.2-shaped model (``DSATokenToKVPool``, its ``dsa`` index pages) -> DCP 4, the
  same requests, on the backend's Mooncake and NIXL engines (more state kinds:
  ``test_state_kinds.py``);
* the Kimi-Linear-shaped model (MLA KV + KDA state + aux) -> decode DCP 2 (the state split
  by TP), on SGLang's shared Mooncake engine, then a decode killed mid-transfer.
* two MLA prefill TP ranks with SGLang's KV cache sharding -> decode TP 2 (4 processes);
* two prefill CP ranks of the Kimi-Linear hybrid, each sending its share of the pages -> decode TP 1;
* the Kimi-Linear hybrid from two plain prefill TP ranks -> decode TP 1 (fan-in), and from one prefill rank ->
  decode TP 2 without DCP (head slicing), each on SGLang's Mooncake too.

And issue 35's mixed fleet: a pdproto prefill serving unmodified SGLang Mooncake decodes (TP 1,
DCP 4, the Kimi-Linear hybrid, one killed mid-transfer) beside a pdproto decode, after hostile
frames on its rank port.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang._models import PAGE
from tests.sglang.pd_harness import (ABORTS, FAILED, HOSTILE_REFUSALS, LEGACY, REQUESTS, SUCCESS, TRANSFERRING,
                                     Request, Spec, hostile_frames, prefill_pages, run)

pytestmark = [pytest.mark.process, pytest.mark.long]

TOKEN = {"PDPROTO_TOKEN": "harness-token"}
KV_ROW = 1152  # bytes of one MLA row (576 bf16)


def _assert_ranks_ok(out: dict[str, Any], ranks: int, rooms: int, failed: int = 0) -> None:
    assert out["prefill_rc"] == 0, out["prefill_stderr"]
    assert len(out["decode"]) == ranks
    for decode, err in zip(out["decode"], out.get("decode_stderr", [])):
        assert decode is not None, err
        assert decode["polls"] == [SUCCESS] * rooms + [FAILED] * failed, decode["reasons"]
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


def test_sglang_mooncake_moves_dsa_index_pages_to_dcp4() -> None:
    """The harness's DSA expectations are SGLang's: its own Mooncake backend lands the index pages of
    the suffix on every DCP rank exactly where check_index expects them."""
    out = run("mooncake_tcp", model="dsa", dcp=4)
    _assert_ranks_ok(out, 4, len(REQUESTS))
    assert out["decode_rc"] == [0] * 4, out["decode_stderr"]


def test_pdproto_dense_mla_prefill_to_dcp4_decode_moves_every_byte() -> None:
    """pdproto relays a dense MLA prefill into four DCP ranks' shards, every byte where it belongs;
    a request either side aborts fails on the other side too, with the reason, and moves nothing;
    SGLang's heartbeat loses the prefill with a request in flight, which stops on the prefill before
    the decode may reuse its pages; a last request reaches it again."""
    out = run("pdproto", REQUESTS + ABORTS, dcp=4, again=True, env=TOKEN)
    _assert_ranks_ok(out, 4, len(REQUESTS), failed=len(ABORTS))  # mismatches: aborted rooms stay zero
    assert out["decode_rc"] == [0] * 4, out["decode_stderr"]
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    assert {r.room: results[r.room]["poll"] for r in REQUESTS} == {r.room: SUCCESS for r in REQUESTS}
    assert {r.room: results[r.room]["prefix"] for r in REQUESTS} == {r.room: r.decode_prefix for r in REQUESTS}
    # The metric is what moved: each token row after the prefix once (4 layers), and one aux row
    # per decode rank, the same for every room.
    aux = set()
    for req in REQUESTS:
        extra = results[req.room]["metric_bytes"] - (req.tokens - req.decode_prefix) * 4 * KV_ROW
        assert extra > 0 and extra % 4 == 0
        aux.add(extra)
    assert len(aux) == 1
    # The decode aborted 105: the prefill's sender fails with pdproto's reason; every decode rank
    # got each prefill rank's acknowledgement, so SGLang may release the pages at once.
    decode_abort, prefill_abort = (r.room for r in ABORTS)
    assert results[decode_abort]["poll"] == FAILED
    assert results[decode_abort]["failure_reason"].startswith("ABORTED: ")
    # The prefill aborted 106: every decode rank fails with the prefill's reason.
    assert results[prefill_abort]["failure_reason"] == "Aborted by AbortReq."
    for decode in out["decode"]:
        assert decode["release_safe"] == {str(decode_abort): True, str(prefill_abort): True}
        assert "Aborted by AbortReq." in decode["reasons"][str(decode_abort)]
        assert "ABORTED: the prefill aborted room 106: Aborted by AbortReq." in decode["reasons"][str(prefill_abort)]
    assert out["ready"]["engine"]["adopted"] is False  # no shared Mooncake engine in this run
    # The decode ranks' submits and statuses travel on Session streams the prefill rank serves.
    sessions = out["prefill"]["sessions"]
    assert sessions["connected"] > 0, sessions
    # The heartbeat loss made SGLang forget the prefill's ranks while room 997 was in flight. Each
    # decode rank deregistered the rank SGLang dropped: the prefill failed 997 with PEER_GONE, and
    # by the time SGLang could release its pages (every abort acknowledged) the registration had
    # already ended there; nothing landed in them (mismatches covers every byte of the pool).
    assert out["dropped"]["poll"] == FAILED, out["dropped"]
    assert out["dropped"]["failure_reason"].startswith("PEER_GONE: "), out["dropped"]
    for again in out["again_decode"]:
        assert again is not None, out["decode_stderr"]
        dropped = again["dropped"]
        assert (dropped["poll"], dropped["release_safe"], dropped["registrations"]) == (
            FAILED, True, ["PEER_NOT_FOUND"]), dropped
        assert "Lost connection with prefill instance" in dropped["reason"], dropped
    # The last request registered every decode rank anew and landed byte-exact.
    assert out["again"]["poll"] == SUCCESS, out["again"]
    assert [(a["poll"], a["mismatches"]) for a in out["again_decode"]] == [(SUCCESS, [])] * 4, out["again_decode"]


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pdproto_deepseek_v32_dsa_index_pages_to_dcp4_decode_move_every_byte(engine: str) -> None:
    """A DeepSeek-V3.2-shaped model (SGLang's DSATokenToKVPool: MLA rows + one index-K page per layer
    and KV page, its ``dsa`` state) from a dense prefill into four DCP ranks: every rank gets its
    token shard of the KV and the whole index pages of the suffix (state is never DCP-sharded), at
    the pages its own req_to_token names; the prefix's index pages and every other page stay zero.
    Layer 2 shares layer 1's top-k: its 0-row index buffer is left out on both sides. On the
    backend's Mooncake and on its NIXL engine (``PDPROTO_ENGINE``)."""
    out = run("pdproto", REQUESTS, model="dsa", dcp=4, env={**TOKEN, "PDPROTO_ENGINE": engine})
    _assert_ranks_ok(out, 4, len(REQUESTS))  # mismatches: every byte of KV, aux and index buffers
    assert out["decode_rc"] == [0] * 4, out["decode_stderr"]
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    assert {r.room: results[r.room]["poll"] for r in REQUESTS} == {r.room: SUCCESS for r in REQUESTS}
    # What moved: each suffix token row once (4 layers), each suffix index page once per decode rank
    # (8,448 bytes in each of the 3 layers that hold an index), and the same aux rows for every room.
    aux = set()
    for req in REQUESTS:
        suffix = req.tokens - req.decode_prefix
        index = -(-suffix // 64) * 3 * 8448 * 4
        aux.add(results[req.room]["metric_bytes"] - suffix * 4 * KV_ROW - index)
    assert len(aux) == 1 and aux.pop() > 0
    # The engine asked for: Mooncake names its engine by a session id, NIXL has none.
    assert (out["ready"]["engine"]["session"] is None) == (engine == "nixl"), out["ready"]


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


def test_pdproto_kv_sharded_mla_prefill_tp2_to_decode_tp2_moves_every_byte() -> None:
    """Two SGLang prefill TP ranks with KV cache sharding (each holds every other page) into a decode of
    TP 2: every decode rank asks both prefill ranks and holds every token, each page from its shard rank."""
    requests = (Request(room=101, tokens=300, chunk=128),)  # 5 pages: rank 0 sends 3, rank 1 sends 2
    out = run("pdproto", requests, dcp=2, kv_shard=True)
    _assert_ranks_ok(out, 2, 1)
    assert out["prefill_rcs"] == [0, 0] and out["decode_rc"] == [0, 0], out["decode_stderr"]
    for prefill in out["prefills"]:
        assert prefill["results"]["101"]["poll"] == SUCCESS, out["prefill_stderr"]
    # The metric is what each prefill rank moved: the token rows of its own pages (logical page l on
    # rank l % 2), to both decode ranks, and the same aux bytes.
    pages = prefill_pages(Spec(requests=requests, kv_shard=True))[101]
    tokens = [sum(min(PAGE, 300 - PAGE * i) for i, page in enumerate(pages) if page % 2 == r) for r in (0, 1)]
    assert 0 < tokens[0] < 300 and sum(tokens) == 300, pages
    extra = {p["results"]["101"]["metric_bytes"] - n * 4 * KV_ROW * 2 for p, n in zip(out["prefills"], tokens)}
    assert len(extra) == 1 and extra.pop() > 0


def test_pdproto_cp_split_kimi_linear_prefill_cp2_to_decode_moves_every_byte() -> None:
    """Two SGLang prefill CP ranks of the Kimi-Linear hybrid (``--attn-cp-size 2``, every CP rank a KV sender)
    into one pdproto decode: SGLang's sender cuts each chunk to the rank's contiguous share of the pages after
    the decode prefix, the chunk that straddles the two shares included; CP rank 0 alone sends the state and
    aux. Each rank holds other bytes where it must not send (the other share's pages; past rank 0 the state and
    aux), and the decode checks every KV, state and aux byte of its pools."""
    requests = (
        Request(room=101, tokens=300, chunk=128),  # 5 pages: rank 0 pages 0-2, rank 1 pages 3-4
        Request(room=103, tokens=1000, decode_prefix=256, chunk=256),  # 12 suffix pages: 6 each
        Request(room=104, tokens=5),  # 1 page: rank 1 sends an empty last chunk
    )
    shares = {101: (192, 108), 103: (384, 360), 104: (5, 0)}  # suffix tokens of each CP rank's pages
    out = run("pdproto", requests, model="kimi", cp_split=True, env=TOKEN)
    _assert_ranks_ok(out, 1, len(requests))  # mismatches: every KV, state and aux byte
    assert out["prefill_rcs"] == [0, 0] and out["decode_rc"] == [0], out["prefill_stderr"]
    extra = []
    for rank, prefill in enumerate(out["prefills"]):
        results = {int(room): r for room, r in prefill["results"].items()}
        assert {room: (r["poll"], r["prefix"]) for room, r in results.items()} == {
            req.room: (SUCCESS, req.decode_prefix) for req in requests}, out["prefill_stderr"]
        # What each rank wrote: its share's token rows (2 MLA layers), rank 0 also the state and aux row.
        extra.append({results[room]["metric_bytes"] - tokens[rank] * 2 * KV_ROW for room, tokens in shares.items()})
    assert len(extra[0]) == 1 and extra[0].pop() > 0 and extra[1] == {0}, extra


def test_pdproto_prefill_serves_sglang_mooncake_decodes_beside_a_pdproto_decode() -> None:
    """One pdproto prefill rank, three decode servers at once: pdproto (TP 1), SGLang's own Mooncake
    (TP 1) and SGLang's own Mooncake with DCP 4 (relaid out by pdproto, which SGLang's Mooncake prefill
    cannot do for this shape). Hostile frames on the rank port first: each refused with its reason, then
    every request lands byte-exact; a decode abort is acknowledged, a prefill abort reaches the SGLang
    decodes as a Failed status with pdproto's reason."""
    requests = (
        Request(room=101, tokens=300, chunk=128, decode=1),
        Request(room=104, tokens=5, decode=1),
        Request(room=103, tokens=1000, decode_prefix=256, chunk=256, decode=2),
        Request(room=105, tokens=200, abort="decode", decode=2),
        Request(room=106, tokens=150, abort="prefill", decode=2),
        Request(room=102, tokens=64, decode=0),
    )
    out = run("pdproto", requests, decodes=(("pdproto", 1), ("mooncake_tcp", 1), ("mooncake_tcp", 4)),
              env={**TOKEN, **LEGACY}, hostile=hostile_frames())
    assert out["prefill_rc"] == 0, out["prefill_stderr"]
    assert out["decode_rc"] == [0] * 6, out["decode_stderr"]
    for decode, err in zip(out["decode"], out["decode_stderr"]):
        assert decode is not None, err
        assert decode["mismatches"] == [], decode  # every byte of KV and aux, aborted rooms still zero
        want = {0: [SUCCESS], 1: [SUCCESS, SUCCESS], 2: [SUCCESS, FAILED, FAILED]}[decode["instance"]]
        assert decode["polls"] == want, decode["reasons"]
        if decode["instance"] == 2:
            assert "Aborted by AbortReq." in decode["reasons"]["105"]  # the decode's own reason stays
            assert "ABORTED: the prefill aborted room 106: Aborted by AbortReq." in decode["reasons"]["106"]
            assert decode["release_safe"] == {"105": True, "106": True}  # every ABORT acknowledged
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    assert {room: results[room]["poll"] for room in (101, 102, 103, 104)} == dict.fromkeys((101, 102, 103, 104),
                                                                                           SUCCESS)
    assert results[103]["prefix"] == 256
    assert results[105]["failure_reason"].startswith("ABORTED: "), results[105]
    assert out["prefill"]["sessions"]["connected"] > 0  # the pdproto decode on its Session stream
    legacy = out["prefill"]["legacy"]
    assert legacy["registration ACCEPTED"] == 5 and legacy["transfer_info ACCEPTED"] == 2 + 3 * 4, legacy
    assert legacy["abort ACCEPTED"] >= 4, legacy  # both aborts, from each DCP rank
    refused = {key: n for key, n in legacy.items() if not key.endswith("ACCEPTED")}
    assert refused == HOSTILE_REFUSALS, legacy


def test_sglang_mooncake_decodes_get_kimi_linear_kv_state_aux_then_one_is_killed_mid_transfer() -> None:
    """The Kimi-Linear hybrid (MLA KV + KDA state split by TP + aux) from a pdproto prefill into SGLang's
    own Mooncake decodes (DCP 2), byte-exact; then they die mid-transfer and the prefill's sender names
    why (its engine finds the peer gone), without waiting for a timeout."""
    requests = tuple(r for r in REQUESTS if r.decode_prefix == 0)
    out = run("pdproto", requests, model="kimi", decodes=(("mooncake_tcp", 2),), kill=True, env=LEGACY)
    _assert_ranks_ok(out, 2, len(requests))
    assert all(r["poll"] == SUCCESS for r in out["prefill"]["results"].values())
    assert out["transferring"]["poll"] == TRANSFERRING and out["transferring"]["transferring"] > 0
    assert out["decode_rc"] == [-9, -9]
    kill = out["kill"]
    code, _, text = kill["failure_reason"].partition(": ")
    assert kill["poll"] == FAILED and code in ("PEER_GONE", "TRANSFER_FAILED") and text, kill


HYBRID_TP = (Request(room=101, tokens=300, chunk=192),)  # two chunks, the last page partial
KIMI_STATE = 6 * (3 * 192 * 2 + 4 * 16 * 16 * 4)
"""Bytes of one request's KDA state at TP 1: 6 layers of conv [3, 192] bf16 and temporal [4, 16, 16] fp32."""


@pytest.mark.parametrize("backend", ["pdproto", "mooncake_tcp"])
def test_kimi_linear_prefill_tp2_to_decode_tp1_fan_in_moves_every_byte(backend: str) -> None:
    """Two plain prefill TP ranks of the Kimi-Linear hybrid (both hold the MLA KV, each half the KDA state heads)
    into a decode of TP 1, which asks both: the KV, both state halves at their heads and channels, and the aux row
    land byte-exact. pdproto's prefill ranks write one of the two MLA layers each (its decode asks for SPLIT_KV),
    each its own state half, and the aux from rank 0."""
    out = run(backend, HYBRID_TP, model="kimi", prefill_tp=2)
    _assert_ranks_ok(out, 1, 1)  # mismatches: every KV, state and aux byte
    assert out["prefill_rcs"] == [0, 0] and out["decode_rc"] == [0], out["prefill_stderr"]
    results = [p["results"]["101"] for p in out["prefills"]]
    assert [r["poll"] for r in results] == [SUCCESS, SUCCESS], out["prefill_stderr"]
    if backend == "pdproto":  # SGLang's metric counts no replication for a hybrid (its harness notes)
        layer, (first, second) = 300 * KV_ROW, (r["metric_bytes"] for r in results)
        assert second == layer + KIMI_STATE // 2 and first - layer - KIMI_STATE // 2 > 0, results  # rank 0: aux too


@pytest.mark.parametrize("backend", ["pdproto", "mooncake_tcp"])
def test_kimi_linear_prefill_tp1_to_decode_tp2_head_slicing_moves_every_byte(backend: str) -> None:
    """One prefill rank of the Kimi-Linear hybrid into a decode of TP 2 without DCP: every decode rank gets every
    token's MLA KV, its half of the KDA state heads (conv channels per q/k/v group) and the aux row, byte-exact."""
    out = run(backend, HYBRID_TP, model="kimi", dcp=2, decode_tp_only=True)
    _assert_ranks_ok(out, 2, 1)  # mismatches: every KV, state and aux byte of each rank
    assert out["prefill_rc"] == 0 and out["decode_rc"] == [0, 0], out["decode_stderr"]
    result = out["prefill"]["results"]["101"]
    assert result["poll"] == SUCCESS, out["prefill_stderr"]
    if backend == "pdproto":  # each decode rank: the KV rows, its state half and the aux row
        aux = (result["metric_bytes"] - 2 * (300 * 2 * KV_ROW + KIMI_STATE // 2)) / 2
        assert aux > 0 and aux.is_integer(), result
