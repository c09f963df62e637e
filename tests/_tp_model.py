"""A model of TP-split items for tests: global byte ids per rank, running segments, Kimi-shaped state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdproto.negotiation.shards import Segment, SplitAxis, shard
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2

Ids = npt.NDArray[np.int64]


def local_item(axis: SplitAxis, tp: int, rank: int, *, base: int = 0) -> Ids:
    """One rank's item as unique global byte ids: (row * width + global element) * eb + byte + base."""
    total = sum(axis.groups)
    elements: list[int] = []
    offset = 0
    for g in axis.groups:
        start, count = shard(g, tp, rank)
        elements += range(offset + start, offset + start + count)
        offset += g
    el = np.array(elements, dtype=np.int64)
    rows = np.arange(axis.outer, dtype=np.int64)[:, None, None]
    byte = np.arange(axis.element_bytes, dtype=np.int64)[None, None, :]
    return ((rows * total + el[None, :, None]) * axis.element_bytes + byte).reshape(-1) + base


def apply(writes: Mapping[int, tuple[Segment, ...]], sources: Mapping[int, Ids],
          size: int) -> tuple[Ids, Ids]:
    """Run the segments: the destination item (-1 where unwritten) and a write count per byte."""
    dst = np.full(size, -1, dtype=np.int64)
    count = np.zeros(size, dtype=np.int64)
    for src_rank, segs in writes.items():
        for s in segs:
            assert s.length > 0
            dst[s.dst_offset:s.dst_offset + s.length] = \
                sources[src_rank][s.src_offset:s.src_offset + s.length]
            count[s.dst_offset:s.dst_offset + s.length] += 1
    return dst, count


@dataclass(frozen=True)
class KimiShape:
    """Kimi-Linear-shaped state: per KDA layer a conv state [K-1, q|k|v] bf16 and a temporal state
    [H, hd, hd] fp32, one entry holding every conv tensor, then every temporal tensor."""

    kda_layers: tuple[int, ...] = (0, 1, 2, 4, 5, 6)
    heads: int = 8
    head_dim: int = 4
    kernel: int = 4

    def conv_axis(self) -> SplitAxis:
        """The conv state's split: q, k, v channel groups per window row."""
        width = self.heads * self.head_dim
        return SplitAxis(groups=(width, width, width), element_bytes=2, outer=self.kernel - 1)

    def temporal_axis(self) -> SplitAxis:
        """The temporal state's split: heads."""
        return SplitAxis(groups=(self.heads,), element_bytes=self.head_dim * self.head_dim * 4)

    def axes(self) -> list[tuple[SplitAxis, int]]:
        """(axis, layer id) of every tensor, in entry order."""
        return [(self.conv_axis(), layer) for layer in self.kda_layers] + \
            [(self.temporal_axis(), layer) for layer in self.kda_layers]

    def entry_info(self, tp: int, *, with_ids: bool = True) -> server_info_pb2.StateEntryInfo:
        """The prefill's description of the entry at TP size ``tp``."""
        entry = server_info_pb2.StateEntryInfo(kind=common_pb2.STATE_KIND_RECURRENT, type_name="mamba")
        for axis, layer in self.axes():
            dim = sum(shard(g, tp, 0)[1] for g in axis.groups)
            t = entry.tensors.add(item_len=axis.outer * dim * axis.element_bytes, dim=dim,
                                  outer_count=axis.outer)
            if len(axis.groups) > 1:
                t.shard_groups.extend(axis.groups)
            if with_ids:
                t.layer_id = layer
        return entry

    def state_buffer(self, tp: int, *, with_ids: bool = True, slots: int = 4) -> registration_pb2.StateBuffer:
        """The decode's registration of the entry at TP size ``tp`` (pointers are offsets)."""
        buf = registration_pb2.StateBuffer()
        ptr = 0
        for axis, layer in self.axes():
            dim = sum(shard(g, tp, 0)[1] for g in axis.groups)
            item = axis.outer * dim * axis.element_bytes
            buf.data_ptrs.append(ptr)
            buf.item_lens.append(item)
            buf.dim_per_tensors.append(dim)
            buf.data_lens.append(item * slots)
            if with_ids:
                buf.layer_ids.append(layer)
            ptr += item * slots
        return buf


__all__ = ["Ids", "KimiShape", "apply", "local_item"]
