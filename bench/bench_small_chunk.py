"""Small-chunk bench: one 16-row chunk of a DCP relayout, packed against per-row (and inline, once it exists).

A chunk this small pays the packed pipeline's fixed costs (a pack per layer, a staging
handle, waits) for little data, so issue 12 item 4 gives the executors an inline path
below a size threshold: pack every layer at once and issue one engine call. This bench
measures, per engine, the time of one such chunk at 4 and 32 layers:
  packed   the planner's runs through the pack pipeline (what the server does today)
  per_row  the same runs, one descriptor per row per layer
  inline   the inline path: printed as "n/a" until the executors offer it
Each mode runs ROUNDS times, interleaved; the median is printed.

Environment: PDPROTO_BENCH_BACKENDS=mooncake,nixl picks the engines.
"""

from __future__ import annotations

import statistics

import numpy as np

from bench import per_backend
from pdproto.dcp import DcpLayout, plan_chunk
from pdproto.transfer import DRAM, LayerSpan, TransferJob, create_executor
from pdproto_demo.decode import DecodeConfig, DecodeProcess

ROW = 1152
ROWS = 16
"""Destination rows in the chunk (one decode rank's share of 64 tokens at DCP 4)."""
PAGE = 16
DCP, RANK = 4, 1
LAYERS = (4, 32)
ROUNDS = 30


def bench_backend(backend: str) -> dict[int, dict[str, float]]:
    """Median seconds per mode for one 16-row chunk, at each layer count."""
    layers = max(LAYERS)
    src_rows = ROWS * DCP
    ex = create_executor(backend, staging_bytes=layers * ROWS * ROW, transfer_timeout_s=60)
    peer = DecodeProcess.launch(DecodeConfig(backend=backend, layers=layers, pages=ROWS, page_size=1,
                                             row_bytes=ROW, background=0), timeout=120)
    try:
        srcs = [ex.allocate(src_rows * ROW, kind=DRAM) for _ in range(layers)]
        for i, b in enumerate(srcs):
            b.array[:] = i
        ex.register_memory(srcs)
        ex.connect("bench", peer.registration)
        plan = plan_chunk(DcpLayout(PAGE), DcpLayout(PAGE, DCP, RANK), np.arange(src_rows // PAGE),
                          np.arange(ROWS // PAGE))
        out: dict[int, dict[str, float]] = {}
        for n in LAYERS:
            spans = tuple(LayerSpan(s.addr, d.ptr, ROW) for s, d in zip(srcs[:n], peer.registration.kv_buffers))
            jobs = {"packed": TransferJob.of_runs(spans, plan.target_runs, pack=True),
                    "per_row": TransferJob.of_runs(spans, plan.target_runs, pack=False)}
            secs: dict[str, list[float]] = {mode: [] for mode in jobs}
            for job in jobs.values():
                ex.execute("bench", job)  # warm-up
            for _ in range(ROUNDS):
                for mode, job in jobs.items():
                    secs[mode].append(ex.execute("bench", job).seconds)
            out[n] = {mode: statistics.median(v) for mode, v in secs.items()}
        return out
    finally:
        peer.close()
        ex.close()


def main() -> int:
    """Print one line per engine and layer count; non-zero if an engine failed."""
    print(f"one chunk of {ROWS} destination rows x {ROW} B per layer, DCP {DCP} rank {RANK}; "
          f"median of {ROUNDS} (microseconds)")
    print(f"{'engine':<9} {'layers':>6} {'packed':>9} {'per_row':>9} {'inline':>9}")

    def report(backend: str, result: dict[int, dict[str, float]], seconds: float) -> None:
        for n, r in result.items():
            print(f"{backend:<9} {n:>6} {r['packed'] * 1e6:9.0f} {r['per_row'] * 1e6:9.0f} {'n/a':>9}")
        print(f"{backend:<9} (inline: the executors' small-chunk path, issue 12 item 4, is not there yet)"
              f"  [{seconds:.0f} s]", flush=True)

    return per_backend(bench_backend, report)


if __name__ == "__main__":
    raise SystemExit(main())
