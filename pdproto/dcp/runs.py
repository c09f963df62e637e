"""Row runs, the one form a plan takes from the planner to the executors.

A run array has shape (R, 5) and int64 columns ``SRC_START, SRC_STRIDE, DST_START,
DST_STRIDE, COUNT``: row pair i of a run is ``(src_start + i*src_stride,
dst_start + i*dst_stride)`` for ``0 <= i < count``. Strides are at least 1, so a run's
first and last rows are its extent on each side. A run of one row has both strides set
to 1 so that "stride 1" alone means "contiguous".

The planner builds runs (``progression_runs``); executors check them (``bad_run``,
``overflowing_run``, ``extents``), gather from them and cut descriptors from them (``segments``). Everything
is vectorised over pages or runs. ``expand`` and ``from_rows`` are O(tokens) and not on
the request path; ``source_rows`` is, once per chunk and row set, as the index of the
executors' gather kernel (8 bytes a row, against the row's bytes in every layer).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

SRC_START, SRC_STRIDE, DST_START, DST_STRIDE, COUNT = range(5)


def empty_runs() -> I64:
    """An empty (0, 5) int64 run array."""
    return np.zeros((0, 5), dtype=np.int64)


def bad_run(runs: I64) -> int | None:
    """Index of the first run with a negative start or a stride or count below 1; None if all are good."""
    bad = np.flatnonzero((runs[:, [SRC_START, DST_START]] < 0).any(axis=1)
                         | (runs[:, [SRC_STRIDE, DST_STRIDE, COUNT]] < 1).any(axis=1))
    return int(bad[0]) if bad.size else None


def overflowing_run(runs: I64) -> int | None:
    """Index of the first run whose last row (start + (count-1)*stride) does not fit in int64; None if all fit.

    Checked without computing it (which would wrap silently); runs must pass ``bad_run`` first.
    """
    if runs.shape[0] == 0:
        return None
    top = np.iinfo(np.int64).max
    last = runs[:, COUNT] - 1
    # last*stride <= top - start  <=>  last <= (top - start) // stride, for start >= 0 and stride >= 1.
    room = np.minimum((top - runs[:, SRC_START]) // runs[:, SRC_STRIDE],
                      (top - runs[:, DST_START]) // runs[:, DST_STRIDE])
    bad = np.flatnonzero(last > room)
    return int(bad[0]) if bad.size else None


def num_rows(runs: I64) -> int:
    """Row pairs the runs hold."""
    return int(runs[:, COUNT].sum())


def extents(runs: I64) -> tuple[int, int, int, int]:
    """(lowest src row, highest src row, lowest dst row, highest dst row) in O(runs).

    Runs must be non-empty and pass ``bad_run`` and ``overflowing_run`` (else the highest rows wrap).
    """
    if runs.shape[0] == 1:  # a state item or aux row: plain ints beat numpy's cost per call
        s, s_stride, d, d_stride, n = (int(v) for v in runs[0])
        return s, s + (n - 1) * s_stride, d, d + (n - 1) * d_stride
    last = runs[:, COUNT] - 1
    return (int(runs[:, SRC_START].min()), int((runs[:, SRC_START] + last * runs[:, SRC_STRIDE]).max()),
            int(runs[:, DST_START].min()), int((runs[:, DST_START] + last * runs[:, DST_STRIDE]).max()))


def from_rows(src: I64, dst: I64) -> I64:
    """Runs for arbitrary (src_rows[i], dst_rows[i]) pairs: one per stretch contiguous on both sides.

    O(tokens): for callers that hold row lists (tests, hand-made jobs), never the planner's path.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.size == 0:
        return empty_runs()
    cut = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], cut))
    runs = np.ones((starts.size, 5), dtype=np.int64)
    runs[:, SRC_START] = src[starts]
    runs[:, DST_START] = dst[starts]
    runs[:, COUNT] = np.diff(np.append(starts, src.size))
    return runs


def _page_breaks(x0: int, step: int, page_size: int, count: int) -> I64:
    """Indices k in 1..count-1 where ``(x0 + k*step) // page_size`` differs from k-1's page.

    One entry per page boundary crossed (several boundaries may give the same k when
    step > page_size; the caller deduplicates), so the cost is O(pages), not O(tokens).
    """
    first_page = x0 // page_size
    last_page = (x0 + (count - 1) * step) // page_size
    bounds = np.arange(first_page + 1, last_page + 1, dtype=np.int64) * page_size
    # ceil((bound - x0) / step) without floats: the first k at or past the boundary.
    return -((x0 - bounds) // step)


def progression_runs(
    count: int,
    src_first: int,
    src_step: int,
    src_pages: I64,
    src_page_size: int,
    dst_first: int,
    dst_step: int,
    dst_pages: I64,
    dst_page_size: int,
) -> I64:
    """Runs for tokens k = 0..count-1 at local positions src_first + k*src_step -> dst_first + k*dst_step.

    Local position x on a side lives at row ``pages[x // page_size] * page_size + x % page_size``.
    Runs break exactly where either side crosses a page boundary. The caller has checked
    that every touched page index is inside its page list.
    """
    if count <= 0:
        return empty_runs()
    # Both break lists are sorted; a plain sort plus adjacent dedup beats np.union1d's hashing.
    breaks = np.concatenate((
        np.zeros(1, dtype=np.int64),
        _page_breaks(src_first, src_step, src_page_size, count),
        _page_breaks(dst_first, dst_step, dst_page_size, count),
    ))
    breaks.sort()
    keep = np.empty(breaks.size, dtype=bool)
    keep[0] = True
    np.not_equal(breaks[1:], breaks[:-1], out=keep[1:])
    starts = breaks[keep]
    counts = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=counts[:-1])
    counts[-1] = count - starts[-1]
    src_local = src_first + starts * src_step
    dst_local = dst_first + starts * dst_step
    runs = np.empty((starts.size, 5), dtype=np.int64)
    runs[:, SRC_START] = src_pages[src_local // src_page_size] * src_page_size + src_local % src_page_size
    runs[:, DST_START] = dst_pages[dst_local // dst_page_size] * dst_page_size + dst_local % dst_page_size
    runs[:, SRC_STRIDE] = src_step
    runs[:, DST_STRIDE] = dst_step
    runs[counts == 1, SRC_STRIDE:DST_STRIDE + 1:2] = 1
    runs[:, COUNT] = counts
    return runs


def packed_fan_in(runs: I64, page_size: int, factor: int, slot: int, last_page: int) -> tuple[I64, I64]:
    """(packed runs, last-page runs) of slice ``slot`` of ``factor`` equal ones.

    Rows of ``last_page`` keep their place; row i of any other destination page p moves to row
    ``(p * factor + slot) * page_size + i`` of the slice's width: its block of the page
    (docs/protocol.md section 3, packed fan-in). Runs never cross a destination page.
    """
    page = runs[:, DST_START] // page_size
    if np.any((runs[:, DST_START] + (runs[:, COUNT] - 1) * runs[:, DST_STRIDE]) // page_size != page):
        raise ValueError("packed fan-in needs runs that each stay inside one destination page (the planner's)")
    tail = page == last_page
    packed = runs[~tail]
    dst = packed[:, DST_START]
    packed[:, DST_START] = (dst // page_size * factor + slot) * page_size + dst % page_size
    return packed, runs[tail]


def _rows_within(runs: I64) -> tuple[I64, I64]:
    """For every row of the runs, in run order: its run's index and its position in that run."""
    counts = runs[:, COUNT]
    run_of_row = np.repeat(np.arange(runs.shape[0]), counts)
    first_row = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - first_row[run_of_row]
    return run_of_row, within


def expand(runs: I64) -> tuple[I64, I64]:
    """Every (src_row, dst_row) pair of the runs, in run order, as two int64 arrays."""
    run_of_row, within = _rows_within(runs)
    src = runs[run_of_row, SRC_START] + within * runs[run_of_row, SRC_STRIDE]
    dst = runs[run_of_row, DST_START] + within * runs[run_of_row, DST_STRIDE]
    return src, dst


def source_rows(runs: I64) -> I64:
    """Every source row of the runs, in run order: the index a row gather kernel takes."""
    run_of_row, within = _rows_within(runs)
    rows: I64 = runs[run_of_row, SRC_START] + within * runs[run_of_row, SRC_STRIDE]
    return rows


def pack_source(runs: I64) -> I64:
    """The same runs with the source replaced by packed positions 0..n-1 (token order)."""
    packed = runs.copy()
    counts = runs[:, COUNT]
    packed[:, SRC_START] = np.cumsum(counts) - counts
    packed[:, SRC_STRIDE] = 1
    return packed


def _join_flags(runs: I64) -> npt.NDArray[np.bool_]:
    """For each boundary between run i and i+1: does run i's last row continue into run i+1 on both sides."""
    last_src = runs[:-1, SRC_START] + (runs[:-1, COUNT] - 1) * runs[:-1, SRC_STRIDE]
    last_dst = runs[:-1, DST_START] + (runs[:-1, COUNT] - 1) * runs[:-1, DST_STRIDE]
    joins: npt.NDArray[np.bool_] = (last_src + 1 == runs[1:, SRC_START]) & (last_dst + 1 == runs[1:, DST_START])
    return joins


def count_segments(runs: I64) -> int:
    """Number of maximal both-sides-contiguous segments, computed from runs in O(runs)."""
    if runs.shape[0] == 0:
        return 0
    contiguous = (runs[:, SRC_STRIDE] == 1) & (runs[:, DST_STRIDE] == 1)
    pieces = int(np.where(contiguous, 1, runs[:, COUNT]).sum())
    return pieces - int(_join_flags(runs).sum())


def segments(runs: I64, *, merge: bool = True) -> I64:
    """Maximal both-sides-contiguous segments as an (S, 3) int64 array of (src_row, dst_row, nrows).

    ``merge=False`` gives one segment per row, for rows whose bytes are not adjacent in
    memory (a byte sub-range of each row) even where the row indexes are.
    """
    if runs.shape[0] == 0:
        return np.zeros((0, 3), dtype=np.int64)
    contiguous = (runs[:, SRC_STRIDE] == 1) & (runs[:, DST_STRIDE] == 1)
    if not merge:
        contiguous[:] = False
    # A strided run splits into single rows; a contiguous run stays whole.
    pieces_per_run = np.where(contiguous, 1, runs[:, COUNT])
    total = int(pieces_per_run.sum())
    first_piece = np.cumsum(pieces_per_run) - pieces_per_run
    # Index of each piece within its run: a cumulative sum of ones that resets at run starts
    # (cheaper than fancy-indexing a per-piece run id).
    within = np.ones(total, dtype=np.int64)
    within[0] = 0
    within[first_piece[1:]] = 1 - pieces_per_run[:-1]
    np.cumsum(within, out=within)
    out = np.empty((total, 3), dtype=np.int64)
    out[:, 0] = np.repeat(runs[:, SRC_START], pieces_per_run) + within * np.repeat(runs[:, SRC_STRIDE], pieces_per_run)
    out[:, 1] = np.repeat(runs[:, DST_START], pieces_per_run) + within * np.repeat(runs[:, DST_STRIDE], pieces_per_run)
    out[:, 2] = np.repeat(np.where(contiguous, runs[:, COUNT], 1), pieces_per_run)
    # Pieces inside one run never join (a stride > 1 leaves a gap); only a run's first piece
    # can continue the previous run's last piece, so the merge test is O(runs).
    joins = _join_flags(runs) if merge else np.zeros(0, dtype=bool)
    if not joins.any():
        return out
    keep = np.ones(total, dtype=bool)
    keep[first_piece[1:][joins]] = False
    heads = np.flatnonzero(keep)
    merged = out[heads]
    merged[:, 2] = np.add.reduceat(out[:, 2], heads)
    return merged
