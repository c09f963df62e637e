"""Shared pieces of the reliability runs: outcome counting, the table, polling, small clusters."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdproto import v1
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto.client import HandshakeClient
from pdproto_demo.cluster import Cluster, Flight, Geometry, RequestResult, Topology

# Fault runs use a small model: 8 MLA layers, requests up to 8K tokens.
FAULT_GEOMETRY = Geometry(layers=8, page_size=64, max_tokens=8192, max_prefix=256)
DENSE_TO_DCP2 = Topology(1, 2)
LOG_DIR = os.environ.get("PDPROTO_RELIABILITY_LOGS") or tempfile.mkdtemp(prefix="pdproto-rel-")


@dataclass
class Outcome:
    """One row of the reliability table."""

    scenario: str
    backend: str
    runs: int = 0
    faults: int = 0
    ok: int = 0
    failed_expected: int = 0
    lost: int = 0
    corrupted: int = 0
    bytes_verified: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    """Why the row could not run on this machine (it then neither passes nor fails)."""

    @property
    def passed(self) -> bool:
        """No request lost or corrupted and no problem recorded."""
        return self.lost == 0 and self.corrupted == 0 and not self.problems

    @property
    def result(self) -> str:
        """PASS, FAIL, or SKIP with the reason."""
        if self.skipped:
            return f"SKIP ({self.skipped})"
        return "PASS" if self.passed else "FAIL"

    def count(self, res: RequestResult, *, expect_ok: bool = True) -> None:
        """Classify one request seen by the decode ranks that waited for it."""
        self.runs += 1
        self.bytes_verified += res.checked
        if res.mismatches:
            self.corrupted += 1
            self.problems.append(f"room {res.room}: bytes differ {res.mismatches[0]}")
        elif res.ok:
            self.ok += 1
        elif not expect_ok and res.failures:
            self.failed_expected += 1
            self.notes.append(f"room {res.room}: {res.failures[0]}")
        else:
            self.lost += 1
            self.problems.append(f"room {res.room}: {res.failures or 'no terminal status'}")

    def succeeded(self, done: Mapping[int, transfer_pb2.TransferStatus]) -> None:
        """Count terminal statuses that must all be SUCCESS: ok, or lost with the reason."""
        for room, st in done.items():
            self.runs += 1
            if st.state == common_pb2.TRANSFER_STATE_SUCCESS:
                self.ok += 1
            else:
                self.lost += 1
                self.problems.append(f"room {room}: {st.state} {st.failure_code}")

    def expect(self, condition: bool, what: str) -> None:
        """Record a failed server-side check (health, freed resources)."""
        if not condition:
            self.problems.append(what)


HEADER = (f"{'scenario':<38}{'backend':<9}{'runs':>6}{'faults':>7}{'ok':>6}{'failed(exp)':>12}"
          f"{'lost':>6}{'corrupt':>8}{'bytes verified':>17}  result")


def row(o: Outcome) -> str:
    """One formatted table row."""
    return (f"{o.scenario:<38}{o.backend:<9}{o.runs:>6}{o.faults:>7}{o.ok:>6}{o.failed_expected:>12}"
            f"{o.lost:>6}{o.corrupted:>8}{o.bytes_verified:>17,}  {o.result}")


def wait_until(probe: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Poll ``probe`` until it returns something truthy or ``timeout`` passes; returns the last value."""
    end = time.monotonic() + timeout
    value = probe()
    while not value and time.monotonic() < end:
        time.sleep(interval)
        value = probe()
    return value


def put_in_flight(c: Cluster, tokens: int, prefix: int, decodes: Sequence[int], slot: int) -> Flight:
    """Lay out a request, report all its chunks and have its decode ranks wait for it (``finish_collect`` next)."""
    f = c.begin(tokens, prefix, decodes=decodes, slot=slot)
    c.send_chunks(f)
    c.finish_start(f)
    return f


def small_cluster(backend: str, *, decodes: int = 2, geometry: Geometry = FAULT_GEOMETRY,
                  token: str | None = None) -> Cluster:
    """A started dense prefill + DCP ``decodes`` cluster, registered and ready."""
    c = Cluster(backend, geometry, dst_dcp=decodes, src_groups=(1,), token=token, log_dir=LOG_DIR)
    try:
        c.launch()
        c.connect(Topology(1, decodes))
    except BaseException:
        c.close()
        raise
    return c


def prefill_stats(c: Cluster, group: int = 1, rank: int = 0) -> dict[str, Any]:
    """What a prefill rank holds, from its ``Describe`` RPC (what ``pdproto status`` prints).

    peers (gone ones too), live_peers, peer_ids, versions, open_requests, engine_calls (in
    flight), outcomes (finished requests by outcome), requests ("peer/room" -> [generation,
    state, failure code], open and kept final ones).
    """
    # The operator token: every peer's rooms (the deployment's token shows a peer's rooms only to itself).
    with HandshakeClient(f"127.0.0.1:{c.ports[group][rank]}", token=c.operator_token, timeout=20,
                         session=False) as client:
        d = client.describe(request_limit=100_000, include_finished=True)
    requests: dict[str, list[Any]] = {}
    for p in d.peers:
        requests.update({f"{p.peer_id}/{s.room}": [s.generation, s.state, s.failure_code] for s in p.finished})
        requests.update({f"{p.peer_id}/{r.room}": [r.generation, r.state, ""] for r in p.requests})
    return {
        "peers": len(d.peers),
        "live_peers": sum(1 for p in d.peers if p.state == v1.PEER_STATE_LIVE),
        "peer_ids": sorted(p.peer_id for p in d.peers),
        "versions": sorted(f"{p.result.version.major}.{p.result.version.minor}" for p in d.peers),
        "open_requests": d.open_requests,
        "engine_calls": d.engine_calls,
        "outcomes": dict(d.outcomes),
        "requests": requests,
    }


def request_state(c: Cluster, room: int) -> dict[str, list[Any]]:
    """peer id -> [generation, state, failure code] of one room on the prefill."""
    reqs = prefill_stats(c)["requests"]
    return {k.split("/")[0]: v for k, v in reqs.items() if k.endswith(f"/{room}")}
