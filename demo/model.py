"""Model shapes beyond dense MLA: Kimi-Linear-shaped hybrids (MLA + KDA state + aux) and MHA heads.

A ``ModelShape`` says what each rank of a TP group holds and what a monolithic (TP 1)
run holds, so a decode rank checks every byte it received against first principles:

* **KV.** MLA rows are whole on every rank (``data.token_rows``). MHA rows hold this
  rank's share of the KV heads: the monolithic row of all heads, projected through
  ``pdproto.shards.local_bytes``.
* **State.** One recurrent entry, Kimi's layout: for every KDA layer a conv state
  ``[K-1, q|k|v]`` (bf16 channels, each group split by TP), then for every KDA layer a
  temporal state ``[H, hd, hd]`` (fp32, split by head); optionally one tensor whole on
  every rank (replicated), which must reach each decode rank exactly once. A slot's
  monolithic bytes are a function of (room, tensor, byte), projected onto each rank.
* **Aux.** Buffers whose slot bytes are a function of (room, buffer): every prefill rank
  holds the same (the first output token is not split by TP).

Layers follow Kimi Linear's ratio: every fourth layer (3, 7, ...) is MLA, the other three KDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdproto.registration import AuxEntry, DecodeLayout, KvEntry, StateEntry, StateTensor
from pdproto.shards import Layout, SplitAxis, Whole, head_axis, local_bytes, local_width
from pdproto.topology import example_server_info
from pdproto.v1 import common_pb2, server_info_pb2

from .data import I64, ROW_BYTES, U8, Reference, _mix, token_rows

KINDS = ("mla", "hybrid", "mha")
"""``mla``: dense MLA rows only; ``hybrid``: Kimi-Linear-shaped; ``mha``: KV heads split by TP."""


def _bytes_of(seed: int, n: int) -> U8:
    """``n`` deterministic bytes of one seed (a bijective mix of every byte index)."""
    idx = np.arange(n, dtype=np.uint32)
    with np.errstate(over="ignore"):
        out: U8 = _mix(idx * np.uint32(0x9E3779B9) ^ np.uint32(seed & 0xFFFFFFFF)).astype(np.uint8)
    return out


@dataclass(frozen=True)
class ModelShape:
    """What a rank of a TP group holds: KV rows, state slots, aux slots."""

    kind: str = "mla"
    """One of ``KINDS``."""
    layers: int = 8
    """Model layers; for ``hybrid`` only every fourth is an MLA (KV) layer."""
    row_bytes: int = ROW_BYTES
    """MLA bytes per token per KV layer."""
    kv_heads: int = 8
    """MHA: KV heads of the model before TP."""
    head_bytes: int = 128
    """MHA: bytes of one head of one token."""
    kda_heads: int = 8
    """Hybrid: KDA heads of the model before TP."""
    kda_head_dim: int = 8
    """Hybrid: KDA head dimension."""
    kernel: int = 4
    """Hybrid: conv kernel size (the conv state keeps K-1 window rows)."""
    aux_lens: tuple[int, ...] = (8, 256)
    """Hybrid: bytes per slot of each aux buffer (e.g. output ids, logprobs)."""
    replicated_bytes: int = 0
    """Hybrid: bytes per slot of one extra state tensor whole on every rank; 0: none."""

    @property
    def hybrid(self) -> bool:
        """Whether the model has state and aux."""
        return self.kind == "hybrid"

    def kv_layers(self) -> tuple[int, ...]:
        """Global layer ids of the KV (attention) layers."""
        if self.hybrid:
            return tuple(layer for layer in range(self.layers) if layer % 4 == 3)
        return tuple(range(self.layers))

    def kda_layers(self) -> tuple[int, ...]:
        """Global layer ids of the linear-attention (state) layers."""
        return tuple(layer for layer in range(self.layers) if layer % 4 != 3) if self.hybrid else ()

    def attention_kind(self) -> common_pb2.AttentionKind.ValueType:
        """The KV pool family this shape registers."""
        return {"mla": common_pb2.ATTENTION_KIND_MLA, "hybrid": common_pb2.ATTENTION_KIND_HYBRID_MLA,
                "mha": common_pb2.ATTENTION_KIND_MHA}[self.kind]

    # -- KV -------------------------------------------------------------------------

    def kv_row_bytes(self, tp: int) -> int:
        """Bytes per token per KV layer on a rank of TP size ``tp``."""
        if self.kind != "mha":
            return self.row_bytes
        return local_width(self.head_layout(), tp) * self.head_bytes

    def head_layout(self) -> SplitAxis:
        """The MHA row split: one group of KV heads."""
        return head_axis(self.kv_heads, self.kv_heads * self.head_bytes, 1)

    def total_kv_heads(self) -> int:
        """``total_kv_heads`` to publish (0 unless MHA)."""
        return self.kv_heads if self.kind == "mha" else 0

    def kv_reference(self, tp: int, rank: int) -> Reference:
        """The KV rows a rank holds: whole rows, or its heads of the monolithic row."""
        return HeadReference(self, tp, rank)

    # -- state and aux ----------------------------------------------------------------

    def state_layouts(self) -> list[tuple[Layout, int]]:
        """(layout, layer id) of every state tensor, in entry order."""
        width = self.kda_heads * self.kda_head_dim
        conv = SplitAxis(groups=(width, width, width), element_bytes=2, outer=self.kernel - 1)
        temporal = SplitAxis(groups=(self.kda_heads,), element_bytes=self.kda_head_dim ** 2 * 4)
        out: list[tuple[Layout, int]] = [(conv, layer) for layer in self.kda_layers()]
        out += [(temporal, layer) for layer in self.kda_layers()]
        if self.hybrid and self.replicated_bytes:
            out.append((Whole(self.replicated_bytes), self.kda_layers()[0]))
        return out

    def _tensor(self, layout: Layout, tp: int) -> tuple[int, int]:
        """(item bytes, split width) of a tensor on a rank of TP size ``tp``; width 0 when whole."""
        if isinstance(layout, Whole):
            return layout.item_bytes, 0
        dim = local_width(layout, tp)
        return layout.outer * dim * layout.element_bytes, dim

    def state_info(self, tp: int) -> list[server_info_pb2.StateEntryInfo]:
        """The prefill's ``state_entries`` at TP size ``tp``."""
        if not self.hybrid:
            return []
        entry = server_info_pb2.StateEntryInfo(kind=common_pb2.STATE_KIND_RECURRENT, type_name="mamba")
        for layout, layer in self.state_layouts():
            item, dim = self._tensor(layout, tp)
            t = entry.tensors.add(item_len=item, dim=dim, layer_id=layer)
            if isinstance(layout, SplitAxis):
                t.outer_count = layout.outer
                if len(layout.groups) > 1:
                    t.shard_groups.extend(layout.groups)
        return [entry]

    def aux_info(self) -> list[server_info_pb2.AuxEntryInfo]:
        """The prefill's ``aux_entries``."""
        return [server_info_pb2.AuxEntryInfo(item_len=n) for n in self.aux_lens] if self.hybrid else []

    def decode_state(self, tp: int) -> tuple[StateEntry, ...]:
        """The decode layout's state entries at TP size ``tp``."""
        if not self.hybrid:
            return ()
        tensors = []
        for layout, layer in self.state_layouts():
            item, dim = self._tensor(layout, tp)
            tensors.append(StateTensor(item, dim, layer))
        return (StateEntry(common_pb2.STATE_KIND_RECURRENT, tuple(tensors)),)

    def decode_aux(self) -> tuple[AuxEntry, ...]:
        """The decode layout's aux entries."""
        return tuple(AuxEntry(n) for n in self.aux_lens) if self.hybrid else ()

    def server_info(self, *, tp: int, rank: int, page_size: int, dcp_size: int = 1, dcp_rank: int = 0,
                    backend: int = common_pb2.BACKEND_UNSPECIFIED, port: int = 0) -> server_info_pb2.PrefillServerInfo:
        """The ``PrefillServerInfo`` of prefill TP rank ``rank`` of ``tp``."""
        info = example_server_info(page_size=page_size, dcp_size=dcp_size, dcp_rank=dcp_rank, tp_size=tp,
                                   tp_rank=rank, num_layers=self.layers, attention=self.attention_kind(),
                                   backends=[backend] if backend else (), layer_ids=True, port=port)
        del info.kv_entries[:]
        for layer in self.kv_layers():
            info.kv_entries.add(item_len=self.kv_row_bytes(tp) * page_size, layer_id=layer,
                                role=common_pb2.KV_ENTRY_ROLE_TARGET)
        info.aux_entries.extend(self.aux_info())
        info.state_entries.extend(self.state_info(tp))
        info.total_kv_heads = self.total_kv_heads()
        return info

    def decode_layout(self, *, tp: int, rank: int, page_size: int, dcp_size: int = 1, dcp_rank: int = 0,
                      layer_ids: bool = True, kv_cache_dtype: str = "bfloat16", **options: object) -> DecodeLayout:
        """The ``DecodeLayout`` of decode TP rank ``rank`` of ``tp`` (``options``: the other layout fields)."""
        kv = tuple(KvEntry(self.kv_row_bytes(tp), layer if layer_ids else None) for layer in self.kv_layers())
        return DecodeLayout(
            page_size=page_size, kv=kv, kv_cache_dtype=kv_cache_dtype, attention_kind=self.attention_kind(),
            attn_tp_size=tp, attn_tp_rank=rank,
            dcp_size=dcp_size, dcp_rank=dcp_rank, aux=self.decode_aux(), state=self.decode_state(tp),
            total_kv_heads=self.total_kv_heads(), **options)  # type: ignore[arg-type]

    def state_item(self, room: int, tensor: int, tp: int, rank: int) -> U8:
        """The bytes of ``room``'s slot of state ``tensor`` on a rank: the monolithic slot, projected."""
        layout, _ = self.state_layouts()[tensor]
        whole = _bytes_of(room * 0x85EBCA77 + tensor * 0xC2B2AE35 + 1, self._tensor(layout, 1)[0])
        out: U8 = whole[local_bytes(layout, tp, rank)]
        return out

    def aux_item(self, room: int, buffer: int) -> U8:
        """The bytes of ``room``'s aux slot in aux ``buffer`` (the same on every prefill rank)."""
        return _bytes_of(room * 0x27D4EB2F + buffer * 0x165667B1 + 7, self.aux_lens[buffer])


@dataclass(frozen=True)
class HeadReference:
    """``data.Reference`` of one rank's KV rows: the monolithic row, projected onto its heads (MHA)."""

    shape: ModelShape
    tp: int
    rank: int

    def rows(self, layer: int, room: int, tokens: I64) -> U8:
        """Rows of ``tokens`` of KV entry ``layer`` as this rank holds them."""
        s = self.shape
        if s.kind != "mha":
            return token_rows(layer, tokens, s.row_bytes)
        full = token_rows(layer, tokens, s.kv_heads * s.head_bytes)
        out: U8 = full[:, local_bytes(s.head_layout(), self.tp, self.rank)]
        return out


__all__ = ["KINDS", "HeadReference", "ModelShape"]
