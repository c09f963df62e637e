"""NIXL peers: identity from the metadata itself, shared agents, and bounds that refuse one job only.

Real NIXL agents over UCX in a process of their own (``tests/_engine_rig.py``) writing into
real decode processes.
"""

from __future__ import annotations

import pytest

from ._engine_rig import run_scenario

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def test_a_registration_is_the_agent_its_metadata_loads() -> None:
    r = run_scenario("identity", "nixl")
    # Another agent's metadata under a name of its own: refused, and the agent it names keeps working.
    assert (r["mismatch"]["error"], r["mismatch"]["field"]) == ("InvalidFieldError", "registration.nixl.agent_name")
    assert "metadata describes agent" in r["mismatch"]["message"]
    assert r["a_after_mismatch"]["ok"], r
    # A refused registration leaves no agent loaded that nobody uses.
    assert r["stranger_unloaded_on_disconnect"]
    assert r["mismatch_unknown"]["field"] == "registration.nixl.agent_name" and not r["mismatch_left_loaded"]
    # An agent name that is not UTF-8: typed, with a reason, and not left loaded.
    assert (r["not_utf8"]["error"], r["not_utf8"]["field"]) == ("InvalidFieldError", "registration.nixl.agent_metadata")
    assert "not UTF-8" in r["not_utf8"]["message"] and not r["not_utf8_left_loaded"]
    assert r["a_at_end"]["ok"] and r["a_exact"], r


def test_one_peers_disconnect_never_cuts_off_another_peer_on_the_same_agent() -> None:
    r = run_scenario("shared", "nixl")
    assert r["after_other_left"]["ok"] and r["exact"], r
    assert r["loaded_while_used"] and r["unloaded_when_unused"], r


def test_a_row_past_the_nixl_region_refuses_that_job_only() -> None:
    r = run_scenario("bounds", "nixl")
    assert (r["past"]["error"], r["past"]["reason"]) == ("DestinationOutOfBoundsError", "DESTINATION_OUT_OF_BOUNDS"), r
    assert r["connected_after"] and r["inside"]["ok"] and r["exact"], r
