"""One fault scenario per backend inside `make test` (the full matrix is `make reliability`).

Real prefill and decode processes and real engines. For a decode rank killed mid-transfer
(local, Mooncake) the killed rank's request must end FAILED with a reason, the surviving
rank's request must complete byte-exact, and the restarted rank (same address, stale state
replaced) must be served byte-exact with no open requests or tasks left. For NIXL the
restart on the same agent name runs here (the stale-agent failure users report most): the
old peer's open request fails, the new peer gets a new id and byte-exact data.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.reliability import faults

pytestmark = pytest.mark.process


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _engine(backend: str, module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not _has(module), reason=f"{backend} engine not installed")


CASES = [
    pytest.param("decode_killed", "local", id="decode_killed-local"),
    pytest.param("decode_killed", "mooncake", id="decode_killed-mooncake",
                 marks=_engine("mooncake", "mooncake.engine")),
    pytest.param("decode_restart", "nixl", id="decode_restart-nixl", marks=_engine("nixl", "nixl_cu12")),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("scenario", "backend"), CASES)
def test_fault_scenario(scenario: str, backend: str) -> None:
    """The fault reaches its request with a reason; everything else stays byte-exact."""
    out = faults.SCENARIOS[scenario](backend)
    assert out.problems == [], out.problems
    assert out.lost == 0 and out.corrupted == 0
    assert out.faults == 1 and out.failed_expected == 1, out.notes
    assert out.ok >= 2 and out.bytes_verified > 0
    assert any(r in " ".join(out.notes) for r in ("PEER_GONE", "TRANSFER_FAILED")), out.notes


@pytest.mark.timeout(240)
def test_crashing_peer_row_local() -> None:
    """The crashing-peer row of the local backend: every fault reported with a reason, nothing lost."""
    from tests.reliability import crash

    out = crash.crashing_peer("local")
    assert out.problems == [] and out.lost == 0 and out.corrupted == 0, out.problems
    from tests._arena_peer import KINDS

    # Every hostile arena kind (all but "good"), the killed decode and the dropped arena.
    faults = len(KINDS) - 1 + 2
    assert out.faults == out.failed_expected == faults and out.ok == 3, (out.faults, out.failed_expected, out.ok)
