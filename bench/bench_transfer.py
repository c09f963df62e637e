"""Transfer bench: dense vs packed DCP relayout vs per-row descriptors, same bytes, same run.

For each engine (Mooncake TCP, NIXL UCX), a decode peer runs in its own process
with 8 layers × 8192 rows × 1152 bytes (one DCP-4 rank's share of 32,768
tokens, 75.5 MB). The prefill, in this process, writes the same bytes three ways,
each a job carrying runs (as the server builds them):
  dense    one run, one contiguous descriptor per layer (rows 0..n-1 -> 0..n-1): the ceiling
  packed   the planner's DCP relayout runs, gathered into staging, one descriptor per destination run
  per_row  the same runs without packing: one descriptor per row per layer (the baseline)
Targets: packed/dense >= 0.8 and packed/per_row >= 10.

Then small chunks (issue 12): one chunk of 16 rows per layer (64 tokens of the same
relayout), for 4 and 32 layers, into a second decode peer, three ways, interleaved in an
order that rotates every round:
  inline     packed on the calling thread, all layers in one engine call with one wait
  pipelined  the per-layer pack pipeline (a pack-thread hop, an engine handle and a wait per layer)
  per_row    one descriptor per row, one engine call per layer
Below ``inline_bytes`` (default 4 MiB) the executor takes the inline path by itself.

Environment: PDPROTO_BENCH_DEVICE=cuda puts both sides in VRAM;
PDPROTO_BENCH_BACKENDS=mooncake,nixl picks the engines; PDPROTO_BENCH_LAYERS and
PDPROTO_BENCH_ROWS shrink the payload for a quick run.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np

from bench import per_backend
from pdproto.dcp import DcpLayout, plan_chunk
from pdproto.transfer import (DRAM, VRAM, Buffer, LayerSpan, TransferExecutor, TransferJob, TransferResult,
                              create_executor)
from pdproto.transfer.engines._engine import EngineExecutor
from pdproto_demo.decode import DecodeConfig, DecodeProcess

ROW = 1152
PAGE = 64
DCP = 4
RANK = 1
ROUNDS = 5
SMALL_ROWS = 16
SMALL_LAYERS = (4, 32)
SMALL_ROUNDS = 41
SMALL_MODES = ("inline", "pipelined", "per_row")


def bench_backend(backend: str, *, layers: int, rows: int, device: str) -> dict[str, float]:
    """Measure the three modes for one engine; returns seconds and GB/s per mode."""
    src_total = rows * DCP
    # Staging holds every layer, as SGLang sizes its DCP pack buffer: no layer waits for a slot.
    ex = create_executor(backend, staging_bytes=layers * rows * ROW, device=device,
                         transfer_timeout_s=120)
    peer = DecodeProcess.launch(DecodeConfig(backend=backend, layers=layers, pages=rows, page_size=1,
                                             row_bytes=ROW, device=device, background=0), timeout=120)
    try:
        vram = device.startswith("cuda")
        srcs = [ex.allocate(src_total * ROW, kind=VRAM if vram else DRAM) for _ in range(layers)]
        rng = np.random.default_rng(0)
        fill = rng.integers(0, 256, src_total * ROW, dtype=np.uint8)
        for b in srcs:
            if vram:
                import torch

                b.array.copy_(torch.from_numpy(fill))
            else:
                b.array[:] = fill
        ex.register_memory(srcs)
        ex.connect("bench", peer.registration)
        spans = tuple(LayerSpan(s.addr, d.ptr, ROW) for s, d in zip(srcs, peer.registration.kv_buffers))

        # Prefill pages are scattered; decode pages are a fresh consecutive allocation.
        plan = plan_chunk(DcpLayout(PAGE), DcpLayout(PAGE, DCP, RANK), rng.permutation(src_total // PAGE),
                          np.arange(rows // PAGE))
        dense = np.array([[0, 1, 0, 1, rows]], dtype=np.int64)
        jobs = {
            "dense": TransferJob.of_runs(spans, dense, pack=False),
            "packed": TransferJob.of_runs(spans, plan.target_runs, pack=True),
            "per_row": TransferJob.of_runs(spans, plan.target_runs, pack=False),
        }
        for job in jobs.values():
            ex.execute("bench", job)  # warm-up: connections, registrations, page faults
        # Rounds interleave the modes, so load from other processes hits all of them alike.
        secs: dict[str, list[float]] = {mode: [] for mode in jobs}
        packs: list[float] = []
        last: dict[str, TransferResult] = {}
        slow_rows = backend == "mooncake"  # about 18k descriptors/s: seconds per per-row run
        for rnd in range(ROUNDS):
            for mode, job in jobs.items():
                if mode == "per_row" and slow_rows and rnd >= 2:
                    continue
                last[mode] = ex.execute("bench", job)
                secs[mode].append(last[mode].seconds)
                if mode == "packed":
                    packs.append(last[mode].pack_seconds)
        out: dict[str, float] = {}
        for mode, res in last.items():
            med = statistics.median(secs[mode])
            out[f"{mode}_s"] = med
            out[f"{mode}_gbps"] = res.bytes / med / 1e9
            out[f"{mode}_desc"] = res.descriptors
        out["pack_s"] = statistics.median(packs)
        # The last run was per-row over the relayout rows; check that every byte landed.
        _verify(peer, fill.reshape(-1, ROW), *plan.expand(), layers, rows)
        out.update(bench_small(ex, backend, srcs, fill.reshape(-1, ROW), device))
        return out
    except Exception as exc:
        # Say whether the decode peer died (and how) or the engine failed with it alive.
        raise RuntimeError(f"{exc!r}; decode peer exit status: {peer.proc.poll()}") from exc
    finally:
        peer.close()
        ex.close()


def bench_small(ex: TransferExecutor, backend: str, srcs: list[Buffer], src: np.ndarray,
                device: str) -> dict[str, float]:
    """Time one 16-row chunk per layer count in each of ``SMALL_MODES``; ``small_{layers}_{mode}_s`` medians.

    ``srcs`` are the registered source layers, each holding ``src`` ((rows, ROW) bytes).
    """
    assert isinstance(ex, EngineExecutor)  # inline_bytes picks the path
    layers = max(SMALL_LAYERS)
    rows = 4 * PAGE  # four decode pages; the chunk fills part of one
    peer = DecodeProcess.launch(DecodeConfig(backend=backend, layers=layers, pages=rows, page_size=1,
                                             row_bytes=ROW, device=device, background=0), timeout=120)
    default = ex.inline_bytes
    try:
        ex.connect("small", peer.registration)
        rng = np.random.default_rng(1)
        tokens = SMALL_ROWS * DCP
        plan = plan_chunk(DcpLayout(PAGE), DcpLayout(PAGE, DCP, RANK), rng.integers(0, src.shape[0] // PAGE, 1),
                          rng.integers(0, rows // PAGE, 1), num_kv_tokens=tokens)
        kv = peer.registration.kv_buffers
        out: dict[str, float] = {}
        for n in SMALL_LAYERS:
            spans = tuple(LayerSpan(srcs[i % len(srcs)].addr, kv[i].ptr, ROW) for i in range(n))
            jobs = {"inline": (TransferJob.of_runs(spans, plan.target_runs, pack=True), 1 << 40),
                    "pipelined": (TransferJob.of_runs(spans, plan.target_runs, pack=True), 0),
                    "per_row": (TransferJob.of_runs(spans, plan.target_runs, pack=False), 0)}
            for mode, (job, threshold) in jobs.items():
                # Warm-up, and each mode's bytes checked from a zeroed peer.
                peer.call("fill", value=0)
                ex.inline_bytes = threshold
                res = ex.execute("small", job)
                if (res.inline, res.packed) != (mode == "inline", mode != "per_row"):
                    raise AssertionError(f"{mode}: the job took another path ({res})")
                _verify(peer, src, *plan.expand(), layers, rows, upto=n)
            secs: dict[str, list[float]] = {mode: [] for mode in jobs}
            order = list(jobs.items())
            for rnd in range(SMALL_ROUNDS):
                # The order rotates each round: what one mode leaves the engine doing (Mooncake
                # finishing a per-row job's 512 requests) must not always land on the same mode.
                for mode, (job, threshold) in order[rnd % 3:] + order[:rnd % 3]:
                    ex.inline_bytes = threshold
                    secs[mode].append(ex.execute("small", job).seconds)
            for mode in jobs:
                out[f"small_{n}_{mode}_s"] = statistics.median(secs[mode])
        return out
    finally:
        ex.inline_bytes = default
        ex.disconnect("small")
        peer.close()


def _verify(peer: DecodeProcess, src: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray,
            layers: int, rows: int, upto: int | None = None) -> None:
    """Every destination row of the first ``upto`` layers (all by default) holds its source row."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dump.bin")
        peer.call("dump", path=path)
        got = np.fromfile(path, dtype=np.uint8).reshape(layers, rows, ROW)
    for i in range(layers if upto is None else upto):
        if not np.array_equal(got[i][dst_rows], src[src_rows]):
            raise AssertionError(f"layer {i}: destination bytes differ from the source rows")


def main() -> int:
    """Run the bench for each engine and print GB/s and ratios; non-zero if a run failed."""
    layers = int(os.environ.get("PDPROTO_BENCH_LAYERS", "8"))
    rows = int(os.environ.get("PDPROTO_BENCH_ROWS", "8192"))
    device = os.environ.get("PDPROTO_BENCH_DEVICE", "cpu")
    mb = layers * rows * ROW / 1e6
    print(f"payload: {layers} layers x {rows} rows x {ROW} B = {mb:.1f} MB per mode; "
          f"DCP {DCP} rank {RANK}, page {PAGE}; device {device}", flush=True)
    print(f"{'engine':<9} {'mode':<8} {'ms':>8} {'GB/s':>7} {'desc':>7}")
    def report(backend: str, r: dict[str, float], seconds: float) -> None:
        for mode in ("dense", "packed", "per_row"):
            print(f"{backend:<9} {mode:<8} {r[mode + '_s'] * 1e3:8.1f} {r[mode + '_gbps']:7.2f} "
                  f"{int(r[mode + '_desc']):7d}")
        bound = max(r["pack_s"], r["dense_s"])
        pd, pr = r["packed_gbps"] / r["dense_gbps"], r["packed_gbps"] / r["per_row_gbps"]
        print(f"{backend:<9} packed/dense {pd:.2f} (target >= 0.8)  packed/per_row {pr:.1f} "
              f"(target >= 10)  pack {r['pack_s'] * 1e3:.1f} ms, bound max(pack, dense) "
              f"{bound * 1e3:.1f} ms = {bound / r['packed_s']:.2f} of packed  [{seconds:.0f} s]", flush=True)
        for n in SMALL_LAYERS:
            ms = {mode: r[f"small_{n}_{mode}_s"] * 1e3 for mode in SMALL_MODES}
            print(f"{backend:<9} small chunk, {SMALL_ROWS} rows x {n} layers: "
                  + "  ".join(f"{mode} {ms[mode]:.3f} ms" for mode in SMALL_MODES)
                  + f"  pipelined/inline {ms['pipelined'] / ms['inline']:.2f}"
                  f"  per_row/inline {ms['per_row'] / ms['inline']:.2f}"
                  f"  pipelined/per_row {ms['pipelined'] / ms['per_row']:.2f}", flush=True)

    return per_backend(lambda backend: bench_backend(backend, layers=layers, rows=rows, device=device), report)


if __name__ == "__main__":
    raise SystemExit(main())
