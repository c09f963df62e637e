"""A pdproto decode pulling from SGLang 0.5.23's own Mooncake prefill (issue 35 item 3), on CPU.

The prefill rank is SGLang's real ``MooncakeKVManager``/``MooncakeKVSender`` (``mooncake_tcp``),
the decode ranks run the pdproto backend, in separate processes through tests/sglang/pd_harness.py;
every decode rank checks every byte of its KV pool, aux buffers and state, and that its frames
are the ones SGLang's own Mooncake decode builds (``frames_as_sglang``):

* dense MLA -> decode DCP 4 (SGLang's per-token relayout on the prefill), with a request the
  decode aborts: the prefill acknowledges it, so SGLang may release the pages at once;
* the Kimi-Linear-shaped model (MLA KV + KDA state split by TP + aux) -> decode DCP 2;
* dense TP 1 with the aux rows over TCP (``SGLANG_MOONCAKE_SEND_AUX_TCP``: SGLang's AUX_DATA
  messages), then the prefill killed mid-transfer: the decode's request fails with PEER_GONE
  about a second later, not at SGLang's timeouts;
* a decode whose pools are in a NIXL engine, which SGLang's Mooncake prefill cannot write into:
  each request is refused at its handshake, with what to change.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sglang.pd_harness import ABORTS, FAILED, REQUESTS, SUCCESS, Request, run

pytestmark = [pytest.mark.process, pytest.mark.long]

SIDES = {"prefill_backend": "mooncake_tcp", "decode_backend": "pdproto"}


def _assert_landed(out: dict[str, Any], ranks: int, rooms: int, failed: int = 0, aux_rows: int = 0) -> None:
    assert len(out["decode"]) == ranks
    for decode, err in zip(out["decode"], out.get("decode_stderr", [])):
        assert decode is not None, err
        assert decode["polls"] == [SUCCESS] * rooms + [FAILED] * failed, decode["reasons"]
        assert decode["mismatches"] == []  # every byte of KV, aux and state
        assert decode["frames_as_sglang"] is True  # M1 and M2, byte for byte
        # The per-peer decision: the prefill's one rank speaks SGLang's Mooncake protocol.
        assert list(decode["protocols"].values()) == ["sglang-mooncake"], decode["protocols"]
        counts = decode["legacy_counts"]  # the listener on the decode's rank port
        assert counts["statuses"] == rooms and (counts["aux_rows"], counts["malformed"]) == (aux_rows, 0), counts
    assert out["decode_rc"] == [0] * ranks, out["decode_stderr"]


def test_dense_mla_sglang_mooncake_prefill_to_pdproto_dcp4_decode() -> None:
    """SGLang's prefill relays into four DCP ranks' shards; a request the decode aborts fails on the
    prefill and is acknowledged by it (ABORT, ABORT_ACK with the generation)."""
    decode_abort = ABORTS[0]
    out = run("pdproto", REQUESTS + (decode_abort,), dcp=4, **SIDES)
    _assert_landed(out, 4, len(REQUESTS), failed=1)
    assert out["prefill_rc"] == 0, out["prefill_stderr"]
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    assert {r.room: results[r.room]["poll"] for r in REQUESTS} == {r.room: SUCCESS for r in REQUESTS}
    assert {r.room: results[r.room]["prefix"] for r in REQUESTS} == {r.room: r.decode_prefix for r in REQUESTS}
    assert results[decode_abort.room]["poll"] == FAILED
    for decode in out["decode"]:
        assert "Aborted by AbortReq." in decode["reasons"][str(decode_abort.room)]
        assert decode["release_safe"] == {str(decode_abort.room): True}


def test_kimi_linear_sglang_mooncake_prefill_to_pdproto_dcp2_decode() -> None:
    """KV, KDA state (split by TP) and aux all land on both decode ranks from SGLang's prefill."""
    requests = tuple(r for r in REQUESTS if r.decode_prefix == 0)
    out = run("pdproto", requests, model="kimi", dcp=2, **SIDES)
    _assert_landed(out, 2, len(requests))
    assert all(r["poll"] == SUCCESS for r in out["prefill"]["results"].values())


def test_dense_tp1_aux_over_tcp_then_sglang_prefill_killed_mid_transfer() -> None:
    """The aux rows arrive as SGLang's AUX_DATA messages and land; then the prefill dies after the
    last request's first chunk and the decode's request fails with PEER_GONE, within seconds."""
    out = run("pdproto", REQUESTS, kill_prefill=True, env={"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}, **SIDES)
    _assert_landed(out, 1, len(REQUESTS), aux_rows=len(REQUESTS) * 10)  # MetadataBuffers: 10 buffers
    assert out["submitted"] == [{"submitted": 999}]
    assert out["transferring"]["transferring"] > 0  # the first chunk was handed to SGLang's sender
    assert out["prefill_rc"] == -9
    (killed,) = out["killed"]
    assert killed["poll"] == FAILED, killed
    assert "PEER_GONE: SGLang Mooncake prefill rank tcp://127.0.0.1:" in killed["reason"], killed
    assert killed["seconds"] < 15, killed  # LOST_AFTER_S after the death, not SGLang's 60 s waiting timeout


def test_a_nixl_decode_refuses_each_request_of_an_sglang_mooncake_prefill_at_its_handshake() -> None:
    """SGLang's Mooncake prefill writes only into a Mooncake engine: with ``PDPROTO_ENGINE=nixl`` the
    decode fails each such request before sending a frame, naming both fixes. The prefill, never
    sent a TransferInfo, fails the room at its bootstrap timeout, as with SGLang's own decode."""
    out = run("pdproto", (Request(room=101, tokens=64), Request(room=102, tokens=5)), **SIDES,
              env={"PDPROTO_ENGINE": "nixl", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3"})
    (decode,) = out["decode"]
    assert decode is not None, out["decode_stderr"]
    assert decode["handshake"] == [FAILED, FAILED], decode
    for reason in decode["refused"].values():
        assert "TOPOLOGY_BACKEND_UNSUPPORTED: the prefill runs SGLang's own Mooncake backend" in reason, reason
        assert "PDPROTO_ENGINE=mooncake" in reason and "--disaggregation-transfer-backend pdproto" in reason
    # Never sent a TransferInfo, the prefill's rooms fail at its bootstrap timeout (3 s here).
    assert out["prefill"] is None and "prefill: bootstrap polls [0, 0]" in out["prefill_stderr"]
