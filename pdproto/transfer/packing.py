"""Packing: gather a segment's source rows into staging from its runs, and cut descriptors from runs.

Descriptors are N×3 int64 arrays of (local address, peer address, bytes), the
form both engines take without a per-descriptor Python loop; they come from the
runs' contiguous segments. The gather reads the runs too: with torch, one
``index_select`` whose row index is built from the runs once per segment; without
torch (or for a small gather in a process that has not loaded it), one strided copy per run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from pdproto.dcp import runs as run_arith
from pdproto.errors import InvalidFieldError

from .base import VRAM, Buffer, LayerSpan, Runs, Segment

Descs = npt.NDArray[np.int64]
"""N×3 int64: local address, peer address, length in bytes."""

U8 = npt.NDArray[np.uint8]


def descriptors(src_addr: int, src_pitch: int, dst_addr: int, dst_pitch: int, nbytes: int,
                segs: npt.NDArray[np.int64]) -> Descs:
    """Descriptors for (src_row, dst_row, nrows) segments: row r of a side starts at ``addr + r * pitch``."""
    out = np.empty((segs.shape[0], 3), dtype=np.int64)
    out[:, 0] = src_addr + segs[:, 0] * src_pitch
    out[:, 1] = dst_addr + segs[:, 1] * dst_pitch
    out[:, 2] = segs[:, 2] * nbytes
    return out


def row_descriptors(layer: LayerSpan, runs: Runs, cut: dict[bool, Any] | None = None) -> Descs:
    """Unpacked descriptors: one per stretch of rows adjacent on both sides (one per row when strided).

    ``cut``: the runs' segments by merge rule (whole rows or not), shared by the layers of
    one segment (``row_layers``).
    """
    src, dst = layer.src_ptr + layer.src_offset, layer.dst_ptr + layer.dst_offset
    if runs.shape[0] == 1:
        # A state item or aux row is one run: a job holds dozens, and numpy's cost per call was most of its CPU.
        s, s_stride, d, d_stride, n = (int(v) for v in runs[0])
        if n == 1 or (layer.whole_rows and s_stride == d_stride == 1):
            return np.array([[src + s * layer.row_bytes, dst + d * layer.dst_pitch, n * layer.nbytes]], dtype=np.int64)
    segs = None if cut is None else cut.get(layer.whole_rows)
    if segs is None:
        segs = run_arith.segments(runs, merge=layer.whole_rows)
        if cut is not None:
            cut[layer.whole_rows] = segs
    return descriptors(src, layer.row_bytes, dst, layer.dst_pitch, layer.nbytes, segs)


def row_layers(layers: Sequence[LayerSpan], runs: Runs) -> list[Descs]:
    """``row_descriptors`` of every layer of one segment, the runs cut once per merge rule rather than
    once per layer: per layer, the cut was most of a job's CPU before its submit."""
    cut: dict[bool, Any] = {}
    return [row_descriptors(layer, runs, cut) for layer in layers]


def packed_layers(staging_addrs: Sequence[int], layers: Sequence[LayerSpan], runs: Runs) -> list[Descs]:
    """Descriptors after packing of every layer of one segment, layer i packed at ``staging_addrs[i]``: staging
    holds the rows in run order, so they break only where the destination does.

    The segments depend only on the runs and a layer's (width, destination pitch), so
    they are cut once per shape and placed for all its layers in one vector operation:
    cutting them per layer was most of a small packed job's CPU time (32 layers of 16
    rows). The arrays are views into one block per shape.
    """
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, layer in enumerate(layers):
        shapes.setdefault((layer.nbytes, layer.dst_pitch), []).append(i)
    out: list[Descs] = [np.zeros((0, 3), dtype=np.int64)] * len(layers)
    for (nbytes, pitch), members in shapes.items():
        segs = run_arith.segments(run_arith.pack_source(runs), merge=nbytes == pitch)
        rel = descriptors(0, nbytes, 0, pitch, nbytes, segs)
        src = np.array([staging_addrs[i] for i in members], dtype=np.int64)
        dst = np.array([layers[i].dst_ptr + layers[i].dst_offset for i in members], dtype=np.int64)
        block = np.empty((len(members), rel.shape[0], 3), dtype=np.int64)
        block[:, :, 0] = src[:, None] + rel[:, 0]
        block[:, :, 1] = dst[:, None] + rel[:, 1]
        block[:, :, 2] = rel[:, 2]
        for k, i in enumerate(members):
            out[i] = block[k]
    return out


def packing_saves(segments: Sequence[Segment]) -> bool:
    """True when packing at least halves some layer's descriptors: its rows land in longer stretches
    than they leave in (DCP and page-size relayouts, a source cut to fewer heads).

    Where none does (page-to-page copies, where only pages that happen to be adjacent on the
    destination join; a destination cut to fewer heads), a gather would copy every byte once
    more for about as many descriptors, on the cores the engine's own copy needs.
    """
    for seg in segments:
        if not seg.num_rows:
            continue
        packed = run_arith.pack_source(seg.runs)
        for whole, dst_whole in {(layer.whole_rows, layer.nbytes == layer.dst_pitch) for layer in seg.layers}:
            if (2 * (run_arith.count_segments(packed) if dst_whole else seg.num_rows)
                    <= (run_arith.count_segments(seg.runs) if whole else seg.num_rows)):
                return True
    return False


def unpack_fan_in(rows: Any, pages: Sequence[int], page_size: int, slices: Sequence[tuple[int, int]]) -> None:
    """Put packed fan-in pages of one KV buffer back in row order, in place.

    The decode's half of docs/protocol.md section 3, packed fan-in.

    ``rows`` is the buffer as (rows, row bytes) uint8, a numpy array or a torch tensor on any
    device; ``pages`` the request's destination pages but its last; ``slices`` every sender's
    (offset, length) in the row, which together cover it: slice (o, w) of row i of a page was
    written at byte ``o * page_size + i * w`` of the page.
    """
    if not len(pages):
        return
    row_bytes = rows.shape[1]
    index = (np.asarray(pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)).reshape(-1)
    shape = (len(pages), page_size, row_bytes)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rows, torch.Tensor):
        index = torch.as_tensor(index, device=rows.device)
        ordered = torch.empty(shape, dtype=rows.dtype, device=rows.device)
    else:
        ordered = np.empty(shape, dtype=rows.dtype)
    packed = rows[index].reshape(len(pages), page_size * row_bytes)
    for offset, width in slices:
        ordered[:, :, offset:offset + width] = packed[:, offset * page_size:(offset + width) * page_size].reshape(
            len(pages), page_size, width)
    rows[index] = ordered.reshape(len(pages) * page_size, row_bytes)


def unpack_buffers(buffers: Sequence[Buffer], row_bytes: Mapping[int, int], pages: Sequence[int], page_size: int,
                   slices: Mapping[int, Sequence[tuple[int, int]]]) -> None:
    """``unpack_fan_in`` on each KV buffer named in ``slices`` (by index: its rows of ``row_bytes``), and for
    device buffers a synchronize after it: an engine's forward may read the pages on streams of its own."""
    for entry, cuts in slices.items():
        unpack_fan_in(buffers[entry].array.reshape(-1, row_bytes[entry]), pages, page_size, cuts)
    devices = {b.device for b in buffers if b.kind == VRAM}
    for device in devices:
        sys.modules["torch"].cuda.synchronize(device)


def torch_or_none() -> Any:
    """torch if importable (fast multi-threaded gather), else None (numpy gather)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def copy_runs(src: U8, src_pitch: int, dst: U8, dst_pitch: int, runs: Runs, nbytes: int) -> None:
    """One strided numpy copy per run: ``nbytes`` from each source row into its destination row.

    ``src`` and ``dst`` are 1-D uint8 views whose byte 0 is the first moved byte of row 0.
    ``as_strided`` does not check bounds, so the runs' extents are checked here too (O(runs)).
    """
    if runs.shape[0] == 0:
        return
    _, smax, _, dmax = run_arith.extents(runs)
    if smax * src_pitch + nbytes > src.size or dmax * dst_pitch + nbytes > dst.size:
        raise InvalidFieldError("runs", "runs reach past the memory views they copy between",
                                metadata={"max_src_row": smax, "max_dst_row": dmax, "nbytes": nbytes})
    for s0, ss, d0, ds, count in runs.tolist():
        np.copyto(as_strided(dst[d0 * dst_pitch:], (count, nbytes), (ds * dst_pitch, 1)),
                  as_strided(src[s0 * src_pitch:], (count, nbytes), (ss * src_pitch, 1)))


TORCH_IMPORT_BYTES = 1 << 20
"""A numpy gather this large imports torch for its row gather; smaller ones never do (unless torch is loaded).

Importing torch costs about 3 s of CPU here, paid on a prefill's first transfer, and its
gather saves about 0.2 ms per MB against numpy's (1.5-2x faster): a process that only ever moves small
chunks (a test's prefill moves a few hundred KB per layer) never earns the import back.
"""


class Gatherer:
    """Gathers a segment's source rows into contiguous staging (numpy or torch, CPU or GPU)."""

    def __init__(self) -> None:
        """Prefer torch (one multi-threadable gather call per layer), imported on the first large gather."""
        self._torch: Any = None
        self._loaded = False
        self.threads = int(os.environ.get("PDPROTO_PACK_THREADS", "1"))
        """torch threads for CPU gathers (0 leaves torch's default); the pack overlaps a transfer."""

    def _torch_module(self, nbytes: int) -> Any:
        if not self._loaded and ("torch" in sys.modules or nbytes >= TORCH_IMPORT_BYTES):
            self._torch, self._loaded = torch_or_none(), True
            if self._torch is not None and self.threads:
                # The transfer engine needs the other core while a layer is packed.
                self._torch.set_num_threads(self.threads)
        return self._torch

    def gather(self, src: Any, pitch: int, runs: Runs, out: Any, index: npt.NDArray[np.int64], *,
               sync: bool = True) -> None:
        """``out`` row k = the k-th row of the runs, in run order.

        ``src`` is a 1-D uint8 view (numpy or torch) whose byte 0 is the first moved byte
        of source row 0, rows ``pitch`` apart; ``out`` is (rows, width), contiguous.
        ``index`` is ``pdproto.dcp.runs.source_rows(runs)``, built once per segment: on a
        CPU torch's row gather ran about a quarter faster than one strided view per run
        (7.4 against 9.0 ms for 8 layers of 8,192 MLA rows, one thread). On a GPU, ``sync``
        waits for the gather before returning; a caller gathering several units on one
        stream passes False for all but the last.
        """
        if runs.shape[0] == 0:
            return
        t = self._torch_module(int(out.nbytes))
        width = int(out.shape[1])
        if isinstance(src, np.ndarray):
            if t is None:
                packed = runs.copy()  # the same source rows, landing at packed positions 0..n-1
                packed[:, run_arith.DST_START] = np.cumsum(runs[:, run_arith.COUNT]) - runs[:, run_arith.COUNT]
                packed[:, run_arith.DST_STRIDE] = 1
                copy_runs(src, pitch, out.reshape(-1), width, packed, width)
                return
            src, out = t.from_numpy(src), t.from_numpy(out)
        # Every source row as one row of a (rows, width) view, rows ``pitch`` apart.
        rows = src.as_strided(((src.shape[0] - width) // pitch + 1, width), (pitch, 1), src.storage_offset())
        idx = t.from_numpy(index)
        if src.is_cuda:
            idx = idx.to(src.device, non_blocking=True)
        t.index_select(rows, 0, idx, out=out)
        if src.is_cuda and sync:
            # The engine reads staging right after this returns; the gather must have landed.
            t.cuda.current_stream(src.device).synchronize()


__all__ = ["TORCH_IMPORT_BYTES", "Descs", "Gatherer", "StagingExtents", "copy_runs", "descriptors",
           "packed_layers", "packing_saves", "row_descriptors", "row_layers", "torch_or_none", "unpack_buffers",
           "unpack_fan_in"]


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

    def free_bytes(self) -> int:
        """Bytes no job holds right now."""
        with self._cond:
            return sum(size for _, size in self._free)

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
