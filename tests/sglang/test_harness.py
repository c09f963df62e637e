"""SGLang 0.5.23's own PD transfer on CPU through tests/sglang/pd_harness.py.

The Mooncake run proves the dependency set and the stubs carry a real transfer: SGLang's
manager, sender, receiver, bootstrap server and engine, prefill and decode in separate
processes, every byte of the decode's KV pool and aux buffers checked. The pdproto run is
the same harness with the plugin's backend, which stops where the placeholder manager is
built; when the backend lands, that test is where it is proven.
"""

from __future__ import annotations

import pytest

from tests.sglang.pd_harness import REQUESTS, SUCCESS, run

pytestmark = pytest.mark.process


def test_sglang_mooncake_moves_every_byte() -> None:
    """Chunked prefill, a decode prefix, partial and sub-page prompts: all land exactly."""
    out = run("mooncake_tcp")
    assert out["prefill_rc"] == 0, out["prefill_stderr"]
    assert out["decode_rc"] == [0], out["decode_stderr"]
    (decode,) = out["decode"]
    assert decode["polls"] == [SUCCESS] * len(REQUESTS)
    assert decode["mismatches"] == []
    results = out["prefill"]["results"]
    assert {int(room): r["poll"] for room, r in results.items()} == {
        r.room: SUCCESS for r in REQUESTS
    }
    # The prefill learned each decode prefix through pop_decode_prefix_len().
    assert {int(room): r["prefix"] for room, r in results.items()} == {
        r.room: r.decode_prefix for r in REQUESTS
    }
    assert all(r["metric_bytes"] > 0 for r in results.values())


def test_pdproto_backend_is_selected_and_stops_at_its_placeholder() -> None:
    """SGLang accepts the flag and starts pdproto's bootstrap server; the manager refuses."""
    out = run("pdproto", timeout=30)
    assert out["prefill_rc"] != 0
    assert out["decode"] == [None]
    assert "NotImplementedError" in out["prefill_stderr"]
    assert "not implemented yet" in out["prefill_stderr"]
