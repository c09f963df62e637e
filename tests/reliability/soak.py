"""Soak: a Kimi-shaped model with state, fan-in (prefill TP 2 -> decode TP 1), mixed request sizes, for a while.

Two prefill ranks (TP 2, the KDA state split by head and channel group between them, the MLA KV
on both) feed two decode processes (TP 1 each): every decode rank takes KV and aux from one
prefill rank and half of each state tensor from each, so both prefill ranks write into every
request. Each round puts one request in flight per decode, of a size drawn from a seeded RNG
between 63 and 32,768 tokens (log-uniform, plus the page edges and the largest one now and
then; half of the long ones with a decode prefix), and every decode rank compares its whole KV
pool, its state and aux slots with the reference after every request.

Resident memory (``VmRSS``) of the four processes is read after the warm-up and at the end; the
row fails on a lost or corrupted request, work the prefills left open, or a process whose
resident memory grew by more than ``RSS_GROWTH`` over the measured part.

The warm-up is a fixed ladder, then random requests until ``WARMUP_SHARE`` of the run has
passed. The ladder puts on every process what is allocated once and sized by the requests: the
largest request (32,768 tokens and the largest prefix) on both decodes first, every state and
aux slot (the rooms cycle through them), every engine connection, and the pool pages each side
touches. The random part lets what depends on the mix settle (glibc keeps freed heap per thread
arena; gRPC and the engines keep per-connection buffers); measured from the end of the ladder
alone, a short run would count that settling as growth.
"""

from __future__ import annotations

import math
import random
import time

from pdproto_demo.cluster import Cluster, Geometry, Topology
from pdproto_demo.run import prefix_for

from .harness import LOG_DIR, Outcome, prefill_stats, put_in_flight
from .memory import FIXED_MMAP_THRESHOLD, rss

SMALLEST, LARGEST = 63, 32768
EDGES = (63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 32767, 32768)
"""Sizes drawn often on purpose: sub-page, page edges, the largest."""
LADDER = ((LARGEST, 0), (LARGEST, 0), (LARGEST, 1024), (LARGEST, 1024), (63, 0), (65, 0), (16384, 1024),
          (8192, 256), (257, 0), (4096, 0))
"""Warm-up (tokens, prefix) in order, two at a time (one per decode): the largest first, with and without prefix."""
WARMUP_SHARE, WARMUP_MIN_S = 0.1, 15.0
RSS_GROWTH = 0.05
DECODES = 2
TOPOLOGY = Topology(1, 1, src_tp=2, dst_tp=1)
SOAK_GEOMETRY = Geometry(layers=8, page_size=64, max_tokens=LARGEST, max_prefix=1024, slots=DECODES)
KDA_HEADS, KDA_HEAD_DIM = 32, 128
"""Kimi Linear's KDA shape: a temporal state of 2 MiB per KDA layer, 12 MiB a request with the conv states."""


def draw(rng: random.Random) -> tuple[int, int]:
    """(tokens, decode prefix) of one request: an edge size one time in five, else log-uniform."""
    if rng.random() < 0.2:
        tokens = rng.choice(EDGES)
    else:
        tokens = round(math.exp(rng.uniform(math.log(SMALLEST), math.log(LARGEST))))
    return tokens, prefix_for(tokens) if rng.random() < 0.5 else 0


def soak(backend: str, seconds: float = 60.0, seed: int = 37) -> Outcome:
    """The row (see the module doc): ``seconds`` of traffic, warm-up included (the measured part is at
    least half of it, should the ladder alone outlast ``WARMUP_SHARE``)."""
    out = Outcome(f"soak {seconds:.0f} s, kimi TP2->TP1 x{DECODES}", backend)
    rng = random.Random(seed)
    c = Cluster(backend, SOAK_GEOMETRY, dst_dcp=1, dst_groups=DECODES, src_groups=(1,), model="hybrid",
                src_tp=TOPOLOGY.src_tp, dst_tp=TOPOLOGY.dst_tp, kda_heads=KDA_HEADS, kda_head_dim=KDA_HEAD_DIM,
                env=FIXED_MMAP_THRESHOLD, log_dir=LOG_DIR)
    moved = sizes = 0
    smallest, largest = LARGEST, 0

    def one_round(requests: list[tuple[int, int]]) -> None:
        """One request per decode at once: (tokens, prefix) each; count and check every one."""
        nonlocal moved, sizes, smallest, largest
        flights = [put_in_flight(c, tokens, prefix, [d], d) for d, (tokens, prefix) in enumerate(requests)]
        for f in flights:
            res = c.finish_collect(f)
            out.count(res)
            moved += res.bytes + res.aux_bytes + res.state_bytes
            sizes += res.tokens
            smallest, largest = min(smallest, res.tokens), max(largest, res.tokens)

    try:
        c.launch(timeout=300)
        c.connect(TOPOLOGY)
        procs = {**{f"prefill r{r}": p.proc.pid for r, p in enumerate(c.prefills[1])},
                 **{f"decode {d}": p.proc.pid for d, p in enumerate(c.decodes)}}
        started = time.monotonic()
        for i in range(0, len(LADDER), DECODES):
            one_round(list(LADDER[i:i + DECODES]))
        while time.monotonic() - started < max(WARMUP_SHARE * seconds, WARMUP_MIN_S):
            one_round([draw(rng) for _ in range(DECODES)])
        warm_runs, warm_bytes, warm_s = out.runs, moved, time.monotonic() - started
        # The rest of the run, but at least half of it when the ladder alone took longer than its share.
        measure_s = max(seconds - warm_s, seconds / 2)
        before = {name: rss(pid) for name, pid in procs.items()}
        peak = dict(before)
        t0 = time.monotonic()
        timeline = [sum(before.values())]  # all four processes, every tenth of the measured part
        while time.monotonic() - t0 < measure_s:
            one_round([draw(rng) for _ in range(DECODES)])
            now = {name: rss(pid) for name, pid in procs.items()}
            peak = {name: max(peak[name], now[name]) for name in procs}
            if time.monotonic() - t0 >= len(timeline) * measure_s / 10:
                timeline.append(sum(now.values()))
        wall = time.monotonic() - t0
        after = {name: rss(pid) for name, pid in procs.items()}
        runs, gbs = out.runs - warm_runs, (moved - warm_bytes) / wall / 1e9 if wall else 0.0
        out.extra.update(requests=out.runs, warmup_requests=warm_runs, warmup_s=warm_s, measured_s=wall,
                         gb_per_s=gbs, bytes_moved=moved, rss_before=before, rss_after=after, rss_peak=peak,
                         rss_timeline=timeline)
        out.notes.append(
            f"{out.runs} requests of {smallest}-{largest} tokens (mean {sizes // max(out.runs, 1)}) in "
            f"{warm_s + wall:.0f} s, {moved / 1e9:.1f} GB moved (KV, state, aux); warm-up {warm_runs} requests "
            f"in {warm_s:.0f} s, then {runs} in {wall:.0f} s: {runs / wall:.1f} req/s, {gbs:.2f} GB/s")
        out.notes.append("resident memory after warm-up -> end (peak): " + ", ".join(
            f"{name} {before[name] / 2**20:.0f} -> {after[name] / 2**20:.0f} MiB "
            f"({(after[name] - before[name]) / before[name]:+.1%}, peak {peak[name] / 2**20:.0f})" for name in procs))
        out.notes.append(f"resident memory of the four, every {measure_s / 10:.0f} s after the warm-up: "
                         + " ".join(f"{v / 2**20:.0f}" for v in timeline) + " MiB")
        for name in procs:
            out.expect(after[name] <= before[name] * (1 + RSS_GROWTH),
                       f"{name}: resident memory grew {(after[name] - before[name]) / before[name]:+.1%} "
                       f"({before[name] >> 20} -> {after[name] >> 20} MiB), past {RSS_GROWTH:.0%}")
        sent = []
        for r, p in enumerate(c.prefills[1]):
            st = prefill_stats(c, 1, r)
            out.expect(st["open_requests"] == 0 and st["engine_calls"] == 0,
                       f"prefill r{r} left work open: {st['open_requests']} requests, {st['engine_calls']} engine calls")
            sent.append(p.call("stats", 30)["moved"])
        # Fan-in: both prefill ranks wrote into the decodes (rank 1 its half of every state tensor).
        out.expect(all(s["state_bytes"] > 0 for s in sent), f"a prefill rank wrote no state: {sent}")
        out.notes.append("fan-in: " + ", ".join(f"prefill r{r} wrote KV {s['kv_bytes'] / 1e9:.2f} GB, state "
                                                f"{s['state_bytes'] / 1e9:.2f} GB" for r, s in enumerate(sent)))
    finally:
        c.close()
    return out
