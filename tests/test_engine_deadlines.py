"""Every engine call has a deadline, and a stuck peer holds nothing another peer needs.

Real engines and real decode processes (``tests/_engine_rig.py``, one process per run):
a SIGSTOPped decode on Mooncake and on NIXL (UCX over TCP), and a Mooncake session that
accepts connections and never answers. The assertions are about order and outcome, not
speed: the other peer's transfer completes while the stuck call is still waiting, the
stuck call ends DEADLINE_EXCEEDED while its peer is still frozen, and nothing stays held.
"""

from __future__ import annotations

import pytest

from ._engine_rig import run_scenario as _run

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_frozen_decode_fails_its_own_transfer_at_the_deadline_and_blocks_nobody(backend: str) -> None:
    r = _run("frozen", backend)
    assert all(w["ok"] for w in r["warm"]), r["warm"]
    # The other peer was served, byte-exact, while the frozen peer's call was still inside the engine.
    assert r["other"]["ok"] and r["other_done_while_stuck"] and r["other_exact"], r
    # The frozen peer's call ended with a reason while the peer was still stopped (SIGCONT comes later).
    assert (r["stuck"]["error"], r["stuck"]["reason"]) == ("DeadlineExceededError", "DEADLINE_EXCEEDED"), r["stuck"]
    assert r["next"]["reason"] == "DEADLINE_EXCEEDED", r["next"]
    # Mooncake keeps the stuck batch until its own timeout (8 s here): the peer is not quiet
    # (its pages may still be written) until then. NIXL cancels the transfer at the deadline.
    assert r["quiet_while_stuck"] is (backend == "nixl") and r["quiet_later"] is True, r
    # drained() says the same with a future the server awaits on its loop (no thread waits for it).
    assert r["drained_while_stuck"] is (backend == "nixl") and r["drained_later"] is True, r
    # Once the engine let go of the stuck call, no engine handle and no staging byte is held.
    assert r["held_after"] == [0, 0], r
    assert r["stats_timeouts"] >= 1
    # A decode that thaws is served again, byte-exact.
    assert r["resumed"]["ok"] and r["resumed_exact"], r


def test_a_black_holed_mooncake_session_is_refused_at_connect_and_blocks_nobody() -> None:
    r = _run("blackhole", "mooncake")
    assert (r["connect"]["error"], r["connect"]["reason"]) == ("DeadlineExceededError", "DEADLINE_EXCEEDED"), r
    assert "handshake" in r["connect"]["message"]
    assert r["other"]["ok"] and r["other_done_while_connecting"] and r["other_exact"], r
    assert r["held_after"] == [0, 0]


def test_a_slow_decode_past_the_deadline_gets_no_layer_after_the_one_in_flight() -> None:
    r = _run("slow", "mooncake")
    assert r["warm"]["ok"], r["warm"]
    assert (r["slow"]["error"], r["slow"]["reason"]) == ("DeadlineExceededError", "DEADLINE_EXCEEDED"), r["slow"]
    assert r["quiet"] is True and r["released_after_s"] < 60, r
    # The caller was told the job failed: once the thawed decode let layer 0 through, the
    # job stopped there instead of writing layers 1 to 3 into pages the decode may reuse.
    assert r["later_layers_untouched"], r["later_bytes_written"]
    assert r["next"]["ok"], r["next"]
