"""Packing: gather a rank's source rows into a staging region, and build descriptors.

Descriptors are N×3 int64 arrays of (local address, peer address, bytes), the
form both engines take without a per-descriptor Python loop.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from .base import Rows, contiguous_runs

Descs = npt.NDArray[np.int64]
"""N×3 int64: local address, peer address, length in bytes."""


def _descs(src_addr: Rows, dst_addr: Rows, nbytes: Rows) -> Descs:
    out = np.empty((src_addr.size, 3), dtype=np.int64)
    out[:, 0] = src_addr
    out[:, 1] = dst_addr
    out[:, 2] = nbytes
    return out


def row_descriptors(src_ptr: int, dst_ptr: int, row_bytes: int, src: Rows, dst: Rows) -> Descs:
    """Unpacked descriptors: one per run of rows consecutive on both sides (one per row when strided)."""
    s, d, n = contiguous_runs(src, dst)
    return _descs(src_ptr + s * row_bytes, dst_ptr + d * row_bytes, n * row_bytes)


def packed_descriptors(staging_addr: int, dst_ptr: int, row_bytes: int, dst: Rows) -> Descs:
    """Descriptors after packing: staging holds rows in job order, so runs break only where dst does."""
    packed = np.arange(dst.size, dtype=np.int64)
    return row_descriptors(staging_addr, dst_ptr, row_bytes, packed, dst)


def torch_or_none() -> Any:
    """torch if importable (fast multi-threaded gather), else None (numpy gather)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def strided_runs(rows: Rows) -> tuple[Rows, Rows, Rows, Rows] | None:
    """Split rows into arithmetic runs with a positive step: (first index, count, first row, step).

    DCP rows are strided by the DCP size within a page, so a rank's rows form one
    run per page. Returns None when runs would be short (fewer than 4 rows on
    average) or a step is not positive, where a plain indexed gather is faster.
    """
    n = int(rows.size)
    if n < 2:
        return None
    d = np.diff(rows)
    seg_starts = np.flatnonzero(d[1:] != d[:-1]) + 1  # indices into d where the step changes
    if len(seg_starts) + 1 > n // 2:  # each run adds at most two step changes
        return None
    seg_ends = np.append(seg_starts, d.size)
    firsts: list[int] = []
    counts: list[int] = []
    i = 0
    # One Python step per run (per page), never per row.
    while i < n:
        if i == n - 1:
            firsts.append(i)
            counts.append(1)
            break
        end = int(seg_ends[np.searchsorted(seg_ends, i, side="right")])  # exclusive, in d
        firsts.append(i)
        counts.append(end - i + 1)
        i = end + 1
    f = np.asarray(firsts, dtype=np.int64)
    c = np.asarray(counts, dtype=np.int64)
    step = np.where(c > 1, d[np.minimum(f, d.size - 1)], 1)
    if len(f) > n // 4 or (step <= 0).any():
        return None
    return f, c, rows[f], step


class Gatherer:
    """Gathers rows of a 2-D uint8 source view into a 2-D staging view (numpy or torch, CPU or GPU)."""

    def __init__(self) -> None:
        """Prefer torch (its index_select uses every core, numpy's take one), imported on first use."""
        self._torch: Any = None
        self._loaded = False
        self.threads = int(os.environ.get("PDPROTO_PACK_THREADS", "1"))
        """torch threads for CPU gathers (0 leaves torch's default); the pack overlaps a transfer."""

    def _torch_module(self) -> Any:
        if not self._loaded:
            # Lazy: importing torch costs seconds, and many processes never need it.
            self._torch, self._loaded = torch_or_none(), True
            if self._torch is not None and self.threads:
                # The transfer engine needs the other core while a layer is packed.
                self._torch.set_num_threads(self.threads)
        return self._torch

    def plan(self, rows: Rows) -> tuple[Rows, Rows, Rows, Rows] | None:
        """Work out once per job how to gather ``rows``: strided runs, only without torch."""
        # torch's index_select beat per-page strided copies here (2.2 vs 3.5 ms per
        # layer of 8,192 MLA rows, one thread), so the runs are only numpy's fallback.
        if self._torch_module() is not None:
            return None
        return strided_runs(rows)

    def gather(self, src2d: Any, rows: Rows, out2d: Any,
               runs: tuple[Rows, Rows, Rows, Rows] | None = None) -> None:
        """``out2d[i] = src2d[rows[i]]`` for every i, writing into the preallocated ``out2d``."""
        if isinstance(src2d, np.ndarray) and runs is not None:
            # Strided block copies beat numpy's per-row take (no torch here).
            for k, c, r, st in zip(*(a.tolist() for a in runs)):
                np.copyto(out2d[k:k + c], src2d[r:r + (c - 1) * st + 1:st])
            return
        self._torch_module()
        if isinstance(src2d, np.ndarray):
            if self._torch is not None:
                t = self._torch
                t.index_select(t.from_numpy(src2d), 0, t.from_numpy(rows), out=t.from_numpy(out2d))
            else:
                np.take(src2d, rows, axis=0, out=out2d)
            return
        # torch tensors (VRAM): one kernel at device bandwidth; indices must live on the device.
        t = self._torch
        idx = t.from_numpy(rows).to(src2d.device, non_blocking=True)
        t.index_select(src2d, 0, idx, out=out2d)
        if src2d.is_cuda:
            # The engine reads staging right after this returns; the gather must have landed.
            t.cuda.current_stream(src2d.device).synchronize()


def pack_fits(num_rows: int, row_bytes: tuple[int, ...], staging_bytes: int) -> bool:
    """True when every layer's packed rows fit the staging region on their own."""
    return all(num_rows * rb <= staging_bytes for rb in row_bytes)


__all__ = ["Descs", "Gatherer", "pack_fits", "strided_runs", "packed_descriptors", "row_descriptors", "torch_or_none"]


class StagingExtents:
    """Hands out disjoint byte ranges of one staging region to concurrent jobs.

    A single lock over the whole region made every peer wait behind the slowest
    one (a frozen decode held it for the engine's whole timeout); with extents,
    a stalled job pins only its own range and the others keep packing.
    """

    def __init__(self, length: int) -> None:
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, length)] if length > 0 else []
        self.length = length

    def acquire(self, min_bytes: int, want_bytes: int, timeout: float) -> tuple[int, int] | None:
        """Reserve ``[min_bytes, want_bytes]`` bytes; None if none frees up within ``timeout``."""
        if min_bytes <= 0 or min_bytes > self.length:
            return None
        # Leave room for a second job unless this one cannot fit otherwise.
        want = max(min_bytes, min(want_bytes, self.length // 2))
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                best = max(self._free, key=lambda e: e[1], default=None)
                if best is not None and best[1] >= min_bytes:
                    take = min(best[1], want)
                    self._free.remove(best)
                    if best[1] > take:
                        self._free.append((best[0] + take, best[1] - take))
                    return best[0], take
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def release(self, offset: int, length: int) -> None:
        """Return a range from ``acquire`` and merge it with free neighbours."""
        with self._cond:
            spans = sorted([*self._free, (offset, length)])
            merged: list[tuple[int, int]] = []
            for start, size in spans:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged
            self._cond.notify_all()
