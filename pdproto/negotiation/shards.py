"""Tensor-parallel slicing: which bytes of a split item each prefill rank writes on a decode rank.

An *item* is what one index addresses: a recurrent-state slot, a sliding-window page, or an
MHA token row. On every rank it is laid out as ``[outer, axis, element]``: ``outer`` rows,
each holding this rank's part of the split axis, each axis element ``element_bytes`` wide.
TP splits the axis group by group: the axis is the concatenation of ``groups`` (widths before
TP; a KDA conv state has three, its q, k and v channels; heads are one group), and each group
is split evenly across the ranks, so rank r holds ``[r*w/tp, (r+1)*w/tp)`` of every group and
lays its parts out one after the other. When the TP size is a multiple of a group's width
(GQA: fewer KV heads than ranks), consecutive ranks hold the same element, as SGLang does.

Moving an item from prefill TP size ``Ts`` to decode TP size ``Td`` is then interval
arithmetic: a decode rank's elements come from every prefill rank holding them. When several
hold the same element (replicas, or a tensor whole on every rank), the first in the decode's
sender order writes it and the others skip it, so every destination byte is written exactly
once. Segments are merged where both sides are contiguous, so equal TP sizes give one segment
per item and a split gives one per row and group at most.

Pure: no I/O; errors are ``TopologyError`` with the reason the caller names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdproto.errors import Reason, TopologyError
from pdproto.v1 import common_pb2


@dataclass(frozen=True)
class Segment:
    """One byte range copied from a source item to a destination item."""

    src_offset: int
    """Offset inside the source item."""
    dst_offset: int
    """Offset inside the destination item."""
    length: int
    """Bytes copied."""

    def to_proto(self) -> common_pb2.ByteSegment:
        """The ``ByteSegment`` message."""
        return common_pb2.ByteSegment(src_offset=self.src_offset, dst_offset=self.dst_offset,
                                      length=self.length)


@dataclass(frozen=True)
class SplitAxis:
    """How TP splits one tensor's items: group widths before TP, rows before the axis, element size."""

    groups: tuple[int, ...]
    """Widths of the independently split groups along the axis, before TP."""
    element_bytes: int
    """Bytes of one axis element (everything after the axis)."""
    outer: int = 1
    """Rows before the axis in one item."""


@dataclass(frozen=True)
class Whole:
    """A tensor whose items are identical on every rank (replicated across TP)."""

    item_bytes: int
    """Bytes of one item on both sides."""


Layout = SplitAxis | Whole
"""How one tensor's items relate across ranks."""


def shard(width: int, tp: int, rank: int, *,
          reason: Reason = Reason.TOPOLOGY_TP_NOT_DIVISIBLE) -> tuple[int, int]:
    """``(start, count)`` of a group of ``width`` elements held by ``rank`` under TP size ``tp``.

    An even split when ``tp`` divides ``width``; one element shared by ``tp // width``
    consecutive ranks when ``width`` divides ``tp``; otherwise a ``TopologyError``.
    """
    if tp < 1 or not 0 <= rank < tp or width < 1:
        raise TopologyError(f"cannot split {width} elements over rank {rank} of TP {tp}",
                            reason=reason, metadata={"width": width, "tp": tp, "rank": rank})
    if width % tp == 0:
        per = width // tp
        return rank * per, per
    if tp % width == 0:
        return rank // (tp // width), 1
    raise TopologyError(
        f"TP {tp} cannot split {width} elements evenly (neither divides the other)",
        reason=reason, metadata={"width": width, "tp": tp})


def local_width(axis: SplitAxis, tp: int, *,
                reason: Reason = Reason.TOPOLOGY_TP_NOT_DIVISIBLE) -> int:
    """Axis elements one rank holds (every rank holds the same number)."""
    return sum(shard(g, tp, 0, reason=reason)[1] for g in axis.groups)


def _held(axis: SplitAxis, tp: int, rank: int, reason: Reason) -> list[tuple[int, int, int]]:
    """Per group: (global start, count, local offset) of what ``rank`` holds."""
    out, local = [], 0
    for g in axis.groups:
        start, count = shard(g, tp, rank, reason=reason)
        out.append((start, count, local))
        local += count
    return out


def _subtract(lo: int, hi: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` not covered by the intervals in ``taken``."""
    parts = [(lo, hi)]
    for a, b in taken:
        parts = [p for x, y in parts for p in ((x, min(y, a)), (max(x, b), y)) if p[0] < p[1]]
    return parts


def _merge(segments: list[Segment]) -> tuple[Segment, ...]:
    """Join neighbours that are contiguous on both sides (emission order is kept)."""
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].src_offset + out[-1].length == s.src_offset \
                and out[-1].dst_offset + out[-1].length == s.dst_offset:
            last = out[-1]
            out[-1] = Segment(last.src_offset, last.dst_offset, last.length + s.length)
        else:
            out.append(s)
    return tuple(out)


def assign_writes(layout: Layout, *, src_tp: int, dst_tp: int, dst_rank: int,
                  senders: Sequence[int],
                  reason: Reason = Reason.TOPOLOGY_TP_NOT_DIVISIBLE) -> dict[int, tuple[Segment, ...]]:
    """The segments each source rank in ``senders`` writes into ``dst_rank``'s item.

    Every destination byte is assigned to exactly one sender: the first in ``senders``
    that holds it. Raises ``TopologyError`` (``reason``) when the senders together do not
    hold every byte the destination needs.
    """
    out: dict[int, tuple[Segment, ...]] = {s: () for s in senders}
    if isinstance(layout, Whole):
        if not senders:
            raise TopologyError("no sender holds a replicated tensor", reason=reason)
        out[senders[0]] = (Segment(0, 0, layout.item_bytes),)
        return out
    eb = layout.element_bytes
    dst_held = _held(layout, dst_tp, dst_rank, reason)
    dst_width = sum(c for _, c, _ in dst_held)
    taken: list[list[tuple[int, int]]] = [[] for _ in layout.groups]
    for src in senders:
        src_held = _held(layout, src_tp, src, reason)
        src_width = sum(c for _, c, _ in src_held)
        per_group: list[tuple[int, int, int]] = []  # (src local, dst local, count)
        for g, ((d0, dn, dloc), (s0, sn, sloc)) in enumerate(zip(dst_held, src_held, strict=True)):
            lo, hi = max(d0, s0), min(d0 + dn, s0 + sn)
            for a, b in _subtract(lo, hi, taken[g]) if lo < hi else []:
                per_group.append((sloc + a - s0, dloc + a - d0, b - a))
                taken[g].append((a, b))
        segs = [Segment((o * src_width + s) * eb, (o * dst_width + d) * eb, n * eb)
                for o in range(layout.outer) for s, d, n in per_group]
        out[src] = _merge(segs)
    missing = sum(dn for _, dn, _ in dst_held) - sum(b - a for t in taken for a, b in t)
    if missing:
        raise TopologyError(
            f"the senders {list(senders)} do not hold {missing} of the {dst_width} elements"
            f" decode rank {dst_rank} needs", reason=reason,
            metadata={"senders": list(senders), "dstRank": dst_rank, "missing": missing})
    return out


def local_bytes(layout: Layout, tp: int, rank: int) -> npt.NDArray[np.int64]:
    """For every byte of ``rank``'s item, its offset in the whole (pre-TP) item: the layout as an index.

    The whole item is ``[outer, sum(groups), element]``; ``whole[local_bytes(...)]`` is what
    ``rank`` holds, which is how a reference (tests, the demo) projects one model-wide item
    onto each rank. A ``Whole`` tensor's item is the same on every rank.
    """
    if isinstance(layout, Whole):
        return np.arange(layout.item_bytes, dtype=np.int64)
    total, base, elements = sum(layout.groups), 0, []
    for g in layout.groups:
        start, count = shard(g, tp, rank)
        elements.append(np.arange(base + start, base + start + count, dtype=np.int64))
        base += g
    el = np.concatenate(elements)
    rows = np.arange(layout.outer, dtype=np.int64)[:, None, None]
    byte = np.arange(layout.element_bytes, dtype=np.int64)[None, None, :]
    out: npt.NDArray[np.int64] = ((rows * total + el[None, :, None]) * layout.element_bytes + byte).reshape(-1)
    return out


def head_axis(total_heads: int, row_bytes: int, tp: int, *,
              reason: Reason = Reason.TOPOLOGY_KV_HEADS_MISMATCH) -> SplitAxis:
    """The split of an MHA token row of ``row_bytes`` holding this rank's share of ``total_heads``."""
    heads = shard(total_heads, tp, 0, reason=reason)[1]
    if row_bytes % heads:
        raise TopologyError(f"a {row_bytes}-byte token row does not hold {heads} whole heads",
                            reason=reason, metadata={"rowBytes": row_bytes, "heads": heads})
    return SplitAxis(groups=(total_heads,), element_bytes=row_bytes // heads)


__all__ = ["Layout", "Segment", "SplitAxis", "Whole", "assign_writes", "head_axis",
           "local_bytes", "local_width", "shard"]
