"""What an engine call that outlives its deadline still holds: at close, at exit, at a failed release.

Real engines and real decode processes (``tests/_engine_rig.py``, one process per run). The
assertions are about order and outcome, not speed.
"""

from __future__ import annotations

import os
import signal

import pytest

from ._engine_rig import run_scenario

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def test_close_keeps_the_engine_under_a_disconnected_peers_stuck_call_and_the_process_still_exits() -> None:
    """``pdproto serve`` disconnects every peer before ``executor.close()``: close must still wait for
    their workers, and a worker stuck in native code must not keep the process from exiting."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    # The run returns only if the process exits while the frozen peer's batch is still inside
    # Mooncake (its transport gives it up after 600 s); a worker the interpreter joins would hang it.
    r = run_scenario("stuck_close", "mooncake", timeout=200)
    try:
        assert r["warm"]["ok"], r
        assert r["stuck"]["reason"] == "DEADLINE_EXCEEDED", r
        assert r["quiet_before_close"] is False, r  # the disconnected peer's call is still in the engine
        # Deregistering memory or stopping the engine under that call could crash the process.
        assert r["engine_kept"] is True and r["buffers_kept"] > 0, r
    finally:
        try:
            os.killpg(r["frozen_pid"], signal.SIGKILL)
        except (ProcessLookupError, KeyError):
            pass


def test_a_transfer_nixl_will_not_release_yet_keeps_its_extent_and_its_peer_unquiet() -> None:
    """A release that fails (the cancel is still under way) is injected at the real agent's
    ``release_xfer_handle``: a real NIXL cannot be made to fail it on demand."""
    pytest.importorskip("nixl_cu12", reason="nixl-cu12 not installed")
    r = run_scenario("unreleased", "nixl")
    assert r["warm"]["ok"], r
    assert r["stuck"]["reason"] == "DEADLINE_EXCEEDED" and r["worker_returned"], r
    assert r["refused_releases"] > 0, r
    # UCX may still read the job's staging bytes: they stay reserved, and the handle counts.
    handles, staging = r["held_while_cancelling"]
    assert handles >= 1 and staging > 0, r
    # The transfer may still write the peer's pages: the peer is not quiet, and not served.
    assert r["quiet_while_cancelling"] is False and r["drained_while_cancelling"] is False, r
    assert r["next_while_cancelling"]["reason"] == "DEADLINE_EXCEEDED", r
    assert "not let go" in r["next_while_cancelling"]["message"], r
    # Once NIXL releases the handle, everything is given back and the peer is served again.
    assert r["quiet_later"] is True and r["drained_later"] is True, r
    assert r["held_after"] == [0, 0], r
    assert r["resumed"]["ok"] and r["resumed_exact"], r


def test_a_probe_that_cannot_say_neither_refuses_nor_writes_off_a_healthy_mooncake_peer() -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    r = run_scenario("probes", "mooncake")
    assert r["warm"]["ok"], r
    assert r["hole"]["reason"] == "DEADLINE_EXCEEDED", r
    # The one probe slot is taken by the black hole: refused at once, typed, retryable, saying why.
    assert (r["another"]["error"], r["another"]["reason"]) == ("UnavailableError", "UNAVAILABLE"), r
    assert "probes" in r["another"]["message"] and "retry" in r["another"]["message"], r
    # A failed batch whose probe could not run is not PEER_GONE (which makes the server drop the peer).
    assert r["failed_batch"]["reason"] == "TRANSFER_FAILED", r
    assert r["b_after"]["ok"], r
