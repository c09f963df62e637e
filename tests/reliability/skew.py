"""Version skew: newer/older minor versions against the real server."""

from __future__ import annotations

from pdproto_demo.cluster import Cluster, Topology
from pdproto_demo.proc import ChildError

from .harness import FAULT_GEOMETRY, LOG_DIR, Outcome, prefill_stats


def minor_skew(backend: str) -> Outcome:
    """Older-minor decode vs newer-minor server, and a newer-minor decode with unknown fields."""
    out = Outcome("minor version skew + unknown fields", backend)
    c = Cluster(backend, FAULT_GEOMETRY, dst_dcp=2, src_groups=(1,), log_dir=LOG_DIR,
                prefill={"info_minor": 1})
    try:
        c.launch()
        topo = Topology(1, 2)
        # Rank 0 speaks minor 0 (older than the server's 1); rank 1 speaks minor 2 and adds
        # a field this schema does not know, as a newer build would.
        c.connect(topo, ranks=[0], minor=0)
        c.connect(topo, ranks=[1], minor=2, unknown_field=True)
        out.faults = 2
        for tokens in (2048, 8192):
            out.count(c.run_request(tokens, 256))
        st = prefill_stats(c)
        out.expect(st["peers"] == 2, f"server holds {st['peers']} peers")
        out.notes.append(f"agreed versions: {st.get('versions')}")
    except ChildError as exc:
        out.problems.append(f"skewed peer rejected: {exc}")
    finally:
        c.close()
    return out

