"""Model shapes beyond dense MLA: Kimi-Linear-shaped hybrids (MLA + KDA state + aux), DSA and MHA heads.

A ``ModelShape`` says what each rank of a TP group holds (``pdproto_demo/README.md`` lists it per kind):
each item is the monolithic (TP 1) item, bytes that are a function of (room, tensor, byte), projected
onto the rank (``pdproto.negotiation.shards.local_bytes``), so a decode checks every byte from first
principles. Kimi's recurrent state: for every KDA layer a conv state ``[K-1, q|k|v]`` (bf16 channels, each
group split by TP), then for every KDA layer a temporal state ``[H, hd, hd]`` (fp32, split by head); every
fourth layer (3, 7, ...) is MLA, the other three KDA. Aux bytes are the same on every prefill rank (the
first output token is not split by TP).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from pdproto.dcp.layers import stage_layer_range
from pdproto.errors import ConfigError, Reason
from pdproto.negotiation.registration import AuxEntry, DecodeLayout, KvEntry, StateEntry, StateTensor
from pdproto.negotiation.shards import Layout, SplitAxis, Whole, head_axis, local_bytes, local_width
from pdproto.negotiation.topology import example_server_info
from pdproto.v1 import common_pb2, server_info_pb2

from .data import I64, ROW_BYTES, U8, _mix, token_rows

KINDS = ("mla", "hybrid", "mha", "dsa")
"""``mla``: dense MLA rows only; ``hybrid``: Kimi-Linear-shaped; ``mha``: KV heads split by TP; ``dsa``: MLA
rows and a DSA index (DeepSeek-V3.2-shaped)."""


_TYPE_NAMES = {common_pb2.STATE_KIND_RECURRENT: "mamba", common_pb2.STATE_KIND_SLIDING_WINDOW: "swa",
               common_pb2.STATE_KIND_PAGED: "dsa"}
"""The SGLang state type each kind of entry stands for."""


def _bytes_of(seed: int, n: int) -> U8:
    """``n`` deterministic bytes of one seed (a bijective mix of every byte index)."""
    return _bytes_at(seed, np.arange(n, dtype=np.uint32))


def _bytes_at(seed: int, at: npt.NDArray[Any]) -> U8:
    """The bytes of ``_bytes_of(seed, n)`` at the indices ``at``, without the rest of them."""
    with np.errstate(over="ignore"):
        out: U8 = _mix(at.astype(np.uint32) * np.uint32(0x9E3779B9) ^ np.uint32(seed & 0xFFFFFFFF)).astype(np.uint8)
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
    window_pages: int = 0
    """Hybrid: pages of the sliding-window state entry a request names; 0: no such entry."""
    window_heads: int = 4
    """Hybrid: heads of a sliding-window page row before TP."""
    window_rows: int = 4
    """Hybrid: token rows of one sliding-window page (of 32 bytes per head)."""
    page_size: int = 64
    """DSA: tokens per KV page, and so per index page."""
    index_row_bytes: int = 132
    """DSA: index-K bytes per token (128 fp8 + 4 scale bytes)."""
    pp_size: int = 1
    """Pipeline stages (or CP ranks of a layer split) the layers are split over (``mla``, ``mha``, ``dsa``)."""
    pp_rank: int = 0
    """The stage this rank holds."""

    def __post_init__(self) -> None:
        # Aux and state per stage (which stage writes them) are not modelled here; a DSA index is per layer.
        if self.pp_size > 1 and self.kind not in ("mla", "mha", "dsa"):
            raise ConfigError(f"pipeline stages are modelled for mla, mha and dsa only, not {self.kind}",
                              reason=Reason.CONFIG_INVALID, metadata={"setting": "pp_size", "value": self.pp_size})

    @property
    def start_layer(self) -> int:
        """The first layer of this rank's stage (0 without PP)."""
        return stage_layer_range(self.layers, self.pp_size, self.pp_rank)[0]

    @property
    def hybrid(self) -> bool:
        """Whether the model has state and aux."""
        return self.kind == "hybrid"

    def kv_layers(self) -> tuple[int, ...]:
        """Global layer ids of the KV (attention) layers this rank's stage holds."""
        if self.hybrid:
            return tuple(layer for layer in range(self.layers) if layer % 4 == 3)
        return tuple(range(*stage_layer_range(self.layers, self.pp_size, self.pp_rank)))

    def kda_layers(self) -> tuple[int, ...]:
        """Global layer ids of the linear-attention (state) layers."""
        return tuple(layer for layer in range(self.layers) if layer % 4 != 3) if self.hybrid else ()

    def attention_kind(self) -> common_pb2.AttentionKind.ValueType:
        """The KV pool family this shape registers."""
        return {"mla": common_pb2.ATTENTION_KIND_MLA, "hybrid": common_pb2.ATTENTION_KIND_HYBRID_MLA,
                "mha": common_pb2.ATTENTION_KIND_MHA, "dsa": common_pb2.ATTENTION_KIND_MLA}[self.kind]

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

    # -- state and aux ----------------------------------------------------------------

    def entries(self) -> list[tuple[common_pb2.StateKind.ValueType, list[tuple[Layout, int]]]]:
        """The state entries in order: (kind, its tensors' layouts and layer ids)."""
        if self.kind == "dsa":
            return [(common_pb2.STATE_KIND_PAGED, [(Whole(self.page_size * self.index_row_bytes), layer)
                                                   for layer in self.kv_layers()])]
        if not self.hybrid:
            return []
        width = self.kda_heads * self.kda_head_dim
        conv = SplitAxis(groups=(width, width, width), element_bytes=2, outer=self.kernel - 1)
        temporal = SplitAxis(groups=(self.kda_heads,), element_bytes=self.kda_head_dim ** 2 * 4)
        recurrent: list[tuple[Layout, int]] = [(conv, layer) for layer in self.kda_layers()]
        recurrent += [(temporal, layer) for layer in self.kda_layers()]
        if self.replicated_bytes:
            recurrent.append((Whole(self.replicated_bytes), self.kda_layers()[0]))
        out: list[tuple[common_pb2.StateKind.ValueType, list[tuple[Layout, int]]]] = [
            (common_pb2.STATE_KIND_RECURRENT, recurrent)]
        if self.window_pages:
            # One sliding-window tensor per MLA layer, split by head.
            page = SplitAxis(groups=(self.window_heads,), element_bytes=32, outer=self.window_rows)
            out.append((common_pb2.STATE_KIND_SLIDING_WINDOW, [(page, layer) for layer in self.kv_layers()]))
        return out

    def entry_items(self, entry: int, slots: int, pages: int) -> int:
        """Items of each tensor of state entry ``entry`` on a rank of ``slots`` slots and ``pages`` index
        pages: a paged entry's pages, a window's pages per slot, or one item per slot."""
        kind = self.entries()[entry][0]
        return pages if kind == common_pb2.STATE_KIND_PAGED else \
            slots * (self.window_pages if kind == common_pb2.STATE_KIND_SLIDING_WINDOW else 1)

    def index_pages(self, pages: Sequence[int], tokens: int, dcp: int) -> list[int]:
        """The index pages of a request's ``tokens`` tokens on a rank whose KV ``pages`` hold them over DCP
        ``dcp`` (none unless ``dsa``): index page j is the (j mod dcp)-th of KV page j // dcp's ``dcp``."""
        n = -(-tokens // self.page_size) if self.kind == "dsa" else 0
        return [pages[j // dcp] * dcp + j % dcp for j in range(n)]

    def state_pages(self, entry: int, slot: int, side: str, index: Sequence[int] = ()) -> list[int]:
        """The items of ``slot`` in state entry ``entry`` as ``side`` ("prefill" or "decode") lists them:
        the prefill's window in order, the decode's reversed; a paged entry's are the ``index`` pages."""
        if self.entries()[entry][0] == common_pb2.STATE_KIND_PAGED:
            return list(index)
        n = self.entry_items(entry, 1, 0)
        items = [slot * n + j for j in range(n)]
        return items[::-1] if side == "decode" else items

    def _tensor(self, layout: Layout, tp: int) -> tuple[int, int]:
        """(item bytes, split width) of a tensor on a rank of TP size ``tp``; width 0 when whole."""
        if isinstance(layout, Whole):
            return layout.item_bytes, 0
        dim = local_width(layout, tp)
        return layout.outer * dim * layout.element_bytes, dim

    def decode_state(self, tp: int) -> tuple[StateEntry, ...]:
        """The decode layout's state entries at TP size ``tp``."""
        return tuple(StateEntry(kind, tuple(StateTensor(*self._tensor(layout, tp), layer) for layout, layer in layouts),
                                _TYPE_NAMES[kind]) for kind, layouts in self.entries())

    def server_info(self, *, tp: int, rank: int, page_size: int, dcp_size: int = 1, dcp_rank: int = 0,
                    backend: int = common_pb2.BACKEND_UNSPECIFIED, port: int = 0) -> server_info_pb2.PrefillServerInfo:
        """The ``PrefillServerInfo`` of prefill TP rank ``rank`` of ``tp``."""
        info = example_server_info(page_size=page_size, dcp_size=dcp_size, dcp_rank=dcp_rank, tp_size=tp,
                                   tp_rank=rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
                                   num_layers=self.layers, attention=self.attention_kind(),
                                   backends=[backend] if backend else (), layer_ids=True, port=port)
        del info.kv_entries[:]
        for layer in self.kv_layers():
            info.kv_entries.add(item_len=self.kv_row_bytes(tp) * page_size, layer_id=layer,
                                role=common_pb2.KV_ENTRY_ROLE_TARGET)
        if self.hybrid:
            info.aux_entries.extend(server_info_pb2.AuxEntryInfo(item_len=n) for n in self.aux_lens)
        for kind, layouts in self.entries():
            entry = info.state_entries.add(kind=kind, type_name=_TYPE_NAMES[kind])
            if kind == common_pb2.STATE_KIND_PAGED:
                entry.tp_policy = common_pb2.STATE_TP_POLICY_REPLICATED
            for layout, layer in layouts:
                item, dim = self._tensor(layout, tp)
                t = entry.tensors.add(item_len=item, dim=dim, layer_id=layer)
                if isinstance(layout, SplitAxis):
                    t.outer_count = layout.outer
                    if len(layout.groups) > 1:
                        t.shard_groups.extend(layout.groups)
        info.total_kv_heads = self.total_kv_heads()
        return info

    def decode_layout(self, *, tp: int, rank: int, page_size: int, dcp_size: int = 1, dcp_rank: int = 0,
                      layer_ids: bool = True, kv_cache_dtype: str = "bfloat16", **options: object) -> DecodeLayout:
        """The ``DecodeLayout`` of decode TP rank ``rank`` of ``tp`` (``options``: the other layout fields)."""
        kv = tuple(KvEntry(self.kv_row_bytes(tp), layer if layer_ids else None) for layer in self.kv_layers())
        return DecodeLayout(
            page_size=page_size, kv=kv, kv_cache_dtype=kv_cache_dtype, attention_kind=self.attention_kind(),
            attn_tp_size=tp, attn_tp_rank=rank, dcp_size=dcp_size, dcp_rank=dcp_rank,
            pp_size=self.pp_size, pp_rank=self.pp_rank,
            aux=tuple(AuxEntry(n) for n in self.aux_lens if self.hybrid), state=self.decode_state(tp),
            total_kv_heads=self.total_kv_heads(), **options)  # type: ignore[arg-type]

    def state_item(self, room: int, tensor: int, tp: int, rank: int, page: int = 0) -> U8:
        """The bytes of ``room``'s item of state ``tensor`` (numbered across entries) on a rank, the
        ``page``-th of its window for a sliding-window tensor: the monolithic item, projected."""
        layout, _ = [t for _, layouts in self.entries() for t in layouts][tensor]
        tensor += self.start_layer  # numbered across the model: a stage's DSA index has one tensor per layer
        # A rank's bytes only: mixing the whole item costs each TP rank its tp-fold share.
        return _bytes_at(room * 0x85EBCA77 + tensor * 0xC2B2AE35 + page * 0x9E3779B1 + 1, local_bytes(layout, tp, rank))

    def state_writes(self, room: int, tensor: int, tp: int, rank: int, items: Sequence[int]) -> list[tuple[int, U8]]:
        """(item, bytes) of ``room``'s state ``tensor`` on a rank: the i-th of the ``items`` a side lists
        (``state_pages``) holds page i of the request (a recurrent slot is one item)."""
        return [(item, self.state_item(room, tensor, tp, rank, page)) for page, item in enumerate(items)]

    def extra_items(self, slot: int, index: Sequence[int], side: str) -> list[list[int]]:
        """The items a request in ``slot`` (with DSA ``index`` pages) holds in each aux buffer, then in each
        state tensor, as ``side`` lists them (``state_pages``)."""
        aux = [[slot] for _ in self.aux_lens] if self.hybrid else []
        return aux + [self.state_pages(entry, slot, side, index) for entry in self.state_tensors()]

    def extra_writes(self, room: int, slot: int, index: Sequence[int], side: str, tp: int,
                     rank: int) -> list[list[tuple[int, U8]]]:
        """(item, bytes) of ``room`` on a rank at each of ``extra_items``."""
        aux = [[(slot, self.aux_item(room, i))] for i in range(len(self.aux_lens))] if self.hybrid else []
        return aux + [self.state_writes(room, k, tp, rank, items)
                      for k, items in enumerate(self.extra_items(slot, index, side)[len(aux):])]

    def state_tensors(self) -> list[int]:
        """The entry of each state tensor, in their numbering across entries."""
        return [e for e, (_, layouts) in enumerate(self.entries()) for _ in layouts]

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
        """Rows of ``tokens`` of KV entry ``layer`` as this rank holds them (its stage's layer ``layer``)."""
        s = self.shape
        layer += s.start_layer
        if s.kind != "mha":
            return token_rows(layer, tokens, s.row_bytes)
        full = token_rows(layer, tokens, s.kv_heads * s.head_bytes)
        out: U8 = full[:, local_bytes(s.head_layout(), self.tp, self.rank)]
        return out


@dataclass(frozen=True)
class RankConfig:
    """What shapes a prefill or decode rank process; each field is also a command-line flag of the process."""

    backend: str = "local"
    """Transfer backend (``pdproto.backends``)."""
    name: str = ""
    """Engine identity (NIXL agent name, a decode's ``TransferInfo.peer_name``); empty: from the pid."""
    layers: int = 8
    """Model layers (KV entries for ``mla`` and ``mha``; a hybrid has one KV layer in four)."""
    pages: int = 64
    """Pages per entry."""
    page_size: int = 64
    """Tokens per page."""
    row_bytes: int = ROW_BYTES
    """Bytes per token per layer."""
    dcp_size: int = 1
    """DCP size (1: plain TP)."""
    dcp_rank: int = 0
    """This rank's DCP index."""
    model: str = "mla"
    """Model shape (``KINDS``): KV only, Kimi-shaped hybrid with state and aux, MHA, or DSA (MLA + index)."""
    tp_size: int = 1
    """Attention TP size."""
    tp_rank: int = 0
    """This rank's attention TP index."""
    pp_size: int = 1
    """Pipeline stages (``mla``, ``mha``); a stage holds only its layers."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    slots: int = 8
    """Aux and state slots (hybrid); slot 0 is never used, as in SGLang."""
    replicated_bytes: int = 0
    """Bytes of a state tensor whole on every rank (hybrid); 0: none."""
    window_pages: int = 0
    """Pages of the sliding-window state entry a request names (hybrid); 0: no such entry."""
    kda_heads: int = ModelShape.kda_heads
    """KDA heads of the model before TP (hybrid)."""
    kda_head_dim: int = ModelShape.kda_head_dim
    """KDA head dimension (hybrid)."""

    def shape(self) -> ModelShape:
        """The model shape this rank holds."""
        return ModelShape(kind=self.model, layers=self.layers, row_bytes=self.row_bytes,
                          replicated_bytes=self.replicated_bytes, kda_heads=self.kda_heads,
                          kda_head_dim=self.kda_head_dim, window_pages=self.window_pages, page_size=self.page_size,
                          pp_size=self.pp_size, pp_rank=self.pp_rank)

    def argv(self) -> list[str]:
        """The command line that starts this rank as a process."""
        out: list[str] = []
        for key, value in asdict(self).items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                out += [flag if value else "--no-" + flag[2:]]
            else:
                out += [flag, str(value)]
        return out

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None) -> Self:
        """Read ``argv()`` output back (the process's flags: those of the subclass's fields)."""
        ap = argparse.ArgumentParser(description=sys.modules[cls.__module__].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        for key, value in asdict(cls()).items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
            else:
                ap.add_argument(flag, type=type(value), default=value)
        return cls(**vars(ap.parse_args(argv)))


__all__ = ["KINDS", "HeadReference", "ModelShape", "RankConfig"]
