"""Load: 16 decode peers (4 DCP-4 groups) x N requests of mixed lengths against one dense prefill.

Each round puts one request in flight per group (4 at once, 16 peers busy), then collects
them; every decode rank checks its whole pool after every request. Latency is first chunk
reported -> last decode rank saw SUCCESS; throughput is KV bytes over wall time.
"""

from __future__ import annotations

import random
import time

import numpy as np

from pdproto_demo.cluster import Cluster, Geometry, Topology

from .harness import LOG_DIR, Outcome, prefill_stats, put_in_flight

PROMPTS = (63, 64, 65, 255, 256, 257, 1000, 2048, 4095, 4096)
GROUPS = 4
DCP = 4
LOAD_GEOMETRY = Geometry(layers=4, page_size=64, max_tokens=4096, max_prefix=256, slots=GROUPS)


def load(backend: str, requests_per_peer: int = 200, seed: int = 1) -> Outcome:
    """16 peers x ``requests_per_peer`` requests; nothing lost, nothing corrupted; p50/p99 latency."""
    out = Outcome(f"load {GROUPS * DCP} peers x {requests_per_peer} req", backend)
    rng = random.Random(seed)
    c = Cluster(backend, LOAD_GEOMETRY, dst_dcp=DCP, dst_groups=GROUPS, src_groups=(1,), log_dir=LOG_DIR)
    latencies: list[float] = []
    total_bytes = 0
    try:
        c.launch(timeout=300)
        c.connect(Topology(1, DCP))
        started = time.monotonic()
        for round_no in range(requests_per_peer):
            flights = []
            for g in range(GROUPS):
                tokens = rng.choice(PROMPTS)
                prefix = 256 if tokens >= 1000 and rng.random() < 0.5 else 0
                flights.append(put_in_flight(c, tokens, prefix, range(g * DCP, (g + 1) * DCP), g))
            for f in flights:
                res = c.finish_collect(f)
                out.count(res)
                total_bytes += res.bytes
                if round_no > 0:  # round 0 opens every engine connection; it is not steady state
                    latencies.append(res.seconds)
        wall = time.monotonic() - started
        lat = np.asarray(latencies or [0.0])
        out.extra.update(requests=out.runs, p50_ms=float(np.percentile(lat, 50) * 1e3),
                         p99_ms=float(np.percentile(lat, 99) * 1e3), wall_s=wall,
                         req_per_s=out.runs / wall, gb_per_s=total_bytes / wall / 1e9,
                         kv_bytes=total_bytes)
        out.notes.append(
            f"{out.runs} requests ({out.runs * DCP} peer-requests) in {wall:.1f} s: "
            f"{out.runs / wall:.1f} req/s, {total_bytes / wall / 1e9:.2f} GB/s KV, latency p50 "
            f"{out.extra['p50_ms']:.0f} ms p99 {out.extra['p99_ms']:.0f} ms (after the first round)")
        st = prefill_stats(c)
        out.expect(st["open_requests"] == 0 and st["engine_calls"] == 0,
                   f"server left work open: {st['open_requests']} requests, {st['engine_calls']} engine calls")
        out.expect(st["peers"] == GROUPS * DCP, f"server holds {st['peers']} peers")
    finally:
        c.close()
    return out
