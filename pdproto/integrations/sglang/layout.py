"""SGLang's ``KVArgs`` as pdproto sees them: a prefill rank's ``PrefillServerInfo``, a decode rank's layout.

SGLang hands every backend the same ``KVArgs`` (``disaggregation/base/conn.py``), filled by
``prefill.py:257-353`` and ``decode.py:608-700`` and then ``setup_state_kv_args``
(``utils.py:1462``): per KV entry a pointer, a length and bytes per page; per aux buffer the
same; per state component (``state_types``) one list per field, one value per tensor. This
module reads them, and nothing else of SGLang, so it runs without SGLang (tests build the
arguments by hand):

* ``kv_item_lens`` are bytes per **physical** page; the last ``num_draft_entries`` entries
  are the speculative draft's, whose decode pages are virtual (``page_size * dcp`` rows).
* Layer ids: SGLang sends them for hybrid pools only (``build_kv_layer_ids``). Otherwise a
  plain pool holds its stage's layers in order, so the prefill numbers them from
  ``prefill_start_layer`` and a single-stage decode from 0 (draft entries after the target's
  layers, as SGLang numbers them); a decode with PP > 1 sends none and pairs by position
  (DeepSeek-V4's entries: below).
* A prefill whose every attention-CP rank sends a share of each request (SGLang's
  ``enable_all_cp_ranks_for_transfer`` with CP > 1: hybrid MLA, or
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``) publishes ``cp_ranks_split_pages``
  (``Ranks.cp_split_pages``): CP rank r sends its contiguous share of the pages
  (``filter_kv_indices_for_cp_rank``), each chunk at its page position and with the tokens of
  its own pages (``cp_share_tokens``), and CP rank 0 alone the state and aux every CP rank
  holds whole. Under SGLang's DSA cache layer split (``Ranks.cp_layers``) CP rank r holds
  layers ``[start, end)`` of the model (``get_layer_shard_range``: contiguous, the first ranks
  one more) and SGLang skips the page filter: the rank publishes ``enable_dsa_cache_layer_split``,
  its KV entries numbered from ``prefill_start_layer`` (SGLang's ``layer_shard_start``) and its
  ``dsa`` index tensors with the layer ids of its KV entries, and sends every page of them; the
  last CP rank also holds the draft's (``transfer_draft_cache``) and writes the state without
  layer ids (``dsa_tail``, whole on every rank), CP rank 0 the aux (``negotiation.senders``). A
  single-stage decode numbers its ``dsa`` tensors the same way, and so does a prefill PP stage,
  which pairs them with a decode of another PP size by layer; a single-stage prefill without the
  split leaves them unnumbered (paired by position, ``negotiation.extras``).
* KV cache sharding (``--enable-kv-cache-sharding``; ``Ranks.kv_shards``): logical page l lives on
  shard rank l % n as local page l // n, and SGLang hands each rank's sender its own local pages
  with their positions in the request (``filter_kv_indices_for_shard_rank``), which reach the
  engine as per-page positions with the tokens of those pages (``shard_tokens``). The shard group
  is attention CP when CP > 1 (the CP ranks then split the pages, ``cp_ranks_split_pages``),
  else, on MLA, attention TP: the rank publishes ``enable_kv_cache_sharding`` and every TP rank
  sends its pages to every decode rank (``negotiation.senders``).
  Under SGLang's CP-TP group sharing (Qwen4-Exp) CP rank r holds every KV head, the replicated
  state and linear-attention head shard r, and presents itself as TP rank r of CP size with CP 1,
  as SGLang's backends do (``Ranks.cp_as_tp``): every CP rank sends, the state split over that
  TP group, and the whole MHA rows cut per decode rank (``negotiation.extras.every_head``).
* DeepSeek-V4's KV entries (``DeepSeekV4TokenToKVPool``: C4 KV, C4 indexer and C128 KV, pages of
  rows compressed 4:1 and 128:1, 37,440, 8,448 and 1,728 bytes per 256-token page) hold no token
  rows, so pdproto plans them with one SGLang page per row (``page_rows``): the page ids SGLang
  passes, whole pages as SGLang's own backends send them (``mooncake/conn.py:1346-1394``), replicated
  as MLA rows are. Its ``swa`` component is the SWA pages of the window followed by the C4
  compressor and indexer-compressor rings of the same SWA pages (``deepseek_v4_memory_pool.py:1484-1518``),
  replicated; ``c128_state`` the request's C128 ring page, 0 or 1 index: paged, replicated. On ROCm's
  unified KV the window is ``swa_ring`` instead: per layer one token row of the ring
  (``deepseek_v4_memory_pool.py:1410-1436``), nope tensors then rope, SGLang's indices
  ``row * ring + pos % ring`` for the window's positions on each side (``prefill.py:1652-1663``):
  sliding-window, replicated; its KV entries are then nope pages, rope pages and indexer pages of the
  C4 layers, nope and rope pages of the C128 layers (fp8 two-pool). A DSpark draft adds its own ``swa``
  component and ``request_row``, one int64 per request row (``deepseek_v4_memory_pool.py:1245-1260``),
  index ``[req_pool_idx]``: recurrent, and refused between TP sizes, as SGLang refuses DSpark PD
  (``common/conn.py:1376-1389``), but for an MLA prefill of TP t with CP c into a decode of TP t·c, which
  negotiation pairs as SGLang does (``negotiation.extras``). DeepSeek-V4.1's ratios 1 and 2 add, after
  the C4 entries, each low ratio's kv_source KV and fp4 indexer pages (one item the index pages of a full
  page) and, in ``c128_state``, a ratio-2 kv_source's pending-pair ring (index ``[req_pool_idx]`` for an
  odd length); SGLang sends no layer ids for them and pairs by position (``dsv41_spec_layout``), as
  pdproto does, between single-stage servers (V4.1 refuses PP). Lists of unequal length are refused per request for every kind
  (``negotiation.slots``), as SGLang raises for these. The pool lists its entries by ratio, each list
  holding the rank's stage only (SGLang's PP slicing cuts each by the stage's layers and
  ``mla_compression_ratios``, ``common/conn.py:1890-1995``), so every entry carries its layer id
  (``_v4_layers``, ``_v4_ids``): KV ``[C4 layers, C4 layers, C128 layers]`` (two-pool: the C4 layers
  three times, the C128 layers twice), ``swa`` ``[every layer, C4 layers, C4 layers]``, ``swa_ring``
  every layer once per tensor group, ``c128_state`` the C128 layers, from ``[prefill_start_layer,
  prefill_end_layer)`` on a prefill, every ratio on a decode of PP 1, and on a decode stage the range
  SGLang's model builds (``Ranks.stage_layers``); pairing by id (a C4 layer's second entry with its
  second) then fills a PP 1 decode from every prefill stage. Refused at start-up
  (``_refuse_compressed_kv``): decode context parallelism (SGLang's V4 attention has none), and PP > 1
  with V4.1's ratios 1 and 2 or a draft (SGLang's slicing knows neither).
* State (``STATE_KINDS``): ``mamba`` components are recurrent (one slot per request), ``swa``
  ones sliding windows (pages), ``dsa`` (DeepSeek-V3.2, GLM-5: one index-K page per layer and
  KV page, ``DSATokenToKVPool``) paged and replicated, as on every MLA pool: one prefill rank
  writes it, and a DCP decode holds the whole index. A tensor of 0 bytes per item (the 0-row
  index buffer of a layer that reuses the previous layer's top-k) is left out on both sides.
  SGLang passes the indices itself (the prefill on its last chunk, the decode its own): for
  ``dsa`` the pages of ``[decode_prefix, seq)`` (``prefill.py:1627-1638``,
  ``decode.py:1704-1714``). MXFP8 KV's UE8M0 scales are paged too, ``block_scale`` per KV page
  of ``[0, seq)`` and ``block_scale_swa`` per window page, and refused between TP sizes, as SGLang
  refuses them; so are MiniMax-M3 sparse's ``minimax_index_k`` (pages of the suffix) and
  ``minimax_dense_kv`` (every page), also refused with PP > 1 (``PP_REFUSED``). Qwen4-Exp's QSA
  index state is replicated (one index head): ``qsa_pending`` one request row, ``qsa_compressed``
  every KV page of ``[0, seq)``. GLM-5-Next's ``dsa_tail`` (per request row and DSA layer, a ring
  of ``index_kpool + tail_extra_slots`` key and score slots, ``memory_pool.py:5409-5459``) is paged
  by ring slot: item ``row * tail_size + slot`` of ``TAIL_SLOT_BYTES``, so the live slots of SGLang's
  6-tuple (``state_items``) pair in order with the decode's, whatever each side's tail size, as
  SGLang remaps them (``build_dsa_tail_transfer_blocks``, ``utils.py:1331-1451``); replicated.
  Every one of SGLang 0.5.23's 13 state types is mapped; a type a later SGLang adds is refused with
  ``TOPOLOGY_STATE_KIND_UNSUPPORTED``, naming it, until a test moves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, v1
from pdproto.dcp.layers import EntryRole
from pdproto.errors import ConfigError, InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.registration import AuxEntry, DecodeLayout, KvEntry, Region, StateEntry, StateTensor
from pdproto.negotiation.topology import PAGE_RELAYOUT
from pdproto.negotiation.tpmap import PACKED_FAN_IN, SPLIT_KV
from pdproto.v1 import common_pb2

from ..dtypes import kv_dtype

STATE_KINDS: dict[str, tuple[common_pb2.StateKind.ValueType, common_pb2.StateTpPolicy.ValueType]] = {
    "mamba": (v1.STATE_KIND_RECURRENT, v1.STATE_TP_POLICY_UNSPECIFIED),  # sliced where dim > 0
    "swa": (v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_UNSPECIFIED),
    "dsa": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED),  # SGLang sends no dims for it
    # MXFP8 KV's UE8M0 scales (MHA only): per KV page, and per window page of an SWA pool; SGLang
    # refuses a TP mismatch on non-MLA pools (common/conn.py:1391-1409).
    # Qwen4-Exp's QSA indexer (one index head, replicated on every rank): its per-request ring of
    # pending keys, and the compressed keys of every KV page.
    "qsa_pending": (v1.STATE_KIND_RECURRENT, v1.STATE_TP_POLICY_REPLICATED),
    "qsa_compressed": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED),
    # MiniMax-M3 sparse: the sparse layers' index keys (the pages of the suffix) and the dense layers'
    # whole KV (every page); SGLang refuses a TP mismatch (common/conn.py:1337-1346) and PP > 1
    # (mooncake/conn.py:2210-2216), so does pdproto (PP_REFUSED).
    "minimax_index_k": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REFUSED),
    "minimax_dense_kv": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REFUSED),
    "block_scale": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REFUSED),
    "block_scale_swa": (v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REFUSED),
    "dsa_tail": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED),  # items are ring slots (state_items)
    # DeepSeek-V4 (MLA): the page of the request's C128 compressor ring that holds its pending block, none at a
    # block boundary (request_state_transfer_indices): 0 or 1 item, so paged (a recurrent slot is exactly one).
    "c128_state": (v1.STATE_KIND_PAGED, v1.STATE_TP_POLICY_REPLICATED),
    # DeepSeek-V4 on ROCm's unified KV: the window as token rows of each layer's ring (row * ring + pos % ring, the
    # window's positions in order on both sides), nope tensors then rope; MLA, so whole on every rank.
    "swa_ring": (v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED),
    # A DeepSeek-V4 DSpark draft's SWA valid-from, one int64 per request row; SGLang serves DSpark PD only between
    # equal attention TP sizes, an MLA prefill's CP ranks counted (common/conn.py:1376-1389); pdproto refuses the rest, naming this type.
    "request_row": (v1.STATE_KIND_RECURRENT, v1.STATE_TP_POLICY_REFUSED),
}
"""SGLang ``StateType`` value -> (``StateKind``, ``StateTpPolicy``), for the state types pdproto moves."""

TAIL_SLOT_BYTES = 256
"""One ``dsa_tail`` ring slot: ``index_head_dim`` bf16 values, which ``DSATokenToKVPool`` requires to be 128
(``memory_pool.py:5345``); a request's 6-tuple names its ring size, checked against the row bytes."""

PP_REFUSED = frozenset({"minimax_index_k", "minimax_dense_kv"})
"""State types SGLang moves only between servers without pipeline parallelism (compacted layer lists)."""

V4_PP_RATIOS = frozenset({0, 4, 128})
"""DeepSeek-V4 compression ratios whose entries pdproto numbers by layer (``_v4_layers``), as SGLang's PP slicing
does; V4.1's ratios 1 and 2 (entries of kv_source layers) pair by position, between single-stage servers."""

CAPABILITIES = ("dcp-relayout", "packed", PAGE_RELAYOUT, PACKED_FAN_IN, SPLIT_KV)
"""What a decode rank of this backend announces: its pages take rows planned per token, so a prefill of
another page size (a vLLM prefill's block of 16) may feed it (SGLang's own bootstrap check still keeps
two SGLang servers to one ``--page-size``); it puts packed fan-in pages back in row order
(``decode_side``); and it waits for every prefill rank its negotiation names, so an MLA fan-in's ranks
may each write part of the KV."""


@dataclass(frozen=True)
class Ranks:
    """Where one SGLang scheduler rank sits: the groups ``CommonKVManager`` reads from SGLang."""

    attn_tp: tuple[int, int]
    """(size, rank) of attention tensor parallelism."""
    attn_cp: tuple[int, int] = (1, 0)
    """(size, rank) of attention context parallelism."""
    attn_dp: tuple[int, int] = (1, 0)
    """(size, rank) of attention data parallelism."""
    system_dp: tuple[int, int] = (1, 0)
    """(size, rank) of system data parallelism."""
    pp: tuple[int, int] = (1, 0)
    """(size, rank) of pipeline parallelism."""
    dcp: tuple[int, int] = (1, 0)
    """(size, rank) of decode context parallelism."""
    stage_layers: tuple[int, int] | None = None
    """``[start, end)`` layers of a decode's PP stage (SGLang ``get_pp_indices``), which its KVArgs do not
    carry; read only for DeepSeek-V4's entries (``_v4_layers``)."""
    state_tp_size: int = 0
    """TP size that splits state tensors (SGLang ``linear_attn_tp_size``); 0: attention TP."""
    cp_split_pages: bool = False
    """Every attention-CP rank sends its share of each request's pages (SGLang
    ``enable_all_cp_ranks_for_transfer``); otherwise CP rank 0 sends everything."""
    kv_shards: int = 1
    """Ranks each request's pages are striped across (SGLang ``kv_shard_size``); 1: none."""
    cp_layers: bool = False
    """Each attention-CP rank holds its own layers (SGLang's DSA cache layer split) and sends every page of
    them, KV and DSA index."""

    def cp_as_tp(self) -> Ranks:
        """This rank as SGLang's backends present a CP-TP group sharing prefill rank: CP rank r of n sends as
        TP rank r of n with CP 1 (``register_to_bootstrap``), every CP rank a sender (``is_dummy_cp_rank``)."""
        return replace(self, attn_tp=self.attn_cp, attn_cp=(1, 0), cp_split_pages=False)


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it: an IPv6 host in brackets (``[::1]:50051``)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cp_share_tokens(chunk_start: int, chunk_pages: int, chunk_tokens: int, *, total_pages: int,
                    cp: tuple[int, int], page_size: int) -> int:
    """Tokens of CP rank ``cp[1]`` of ``cp[0]``'s own pages in a chunk of ``chunk_pages`` pages from page
    ``chunk_start`` holding ``chunk_tokens`` (SGLang counts the whole chunk's, ``prefill.py:1772``).

    CP rank r owns a contiguous range of the request's ``total_pages``, the first ``total % n``
    ranks one page more (``utils.py:_get_cp_rank_page_bounds``); chunks start on a page.
    """
    size, rank = cp
    base, rem = divmod(total_pages, size)
    low = rank * base + min(rank, rem)
    high = low + base + (1 if rank < rem else 0)
    first, stop = max(low, chunk_start), min(high, chunk_start + chunk_pages)
    if stop <= first:
        return 0
    return min(stop * page_size, chunk_start * page_size + chunk_tokens) - first * page_size


def shard_tokens(pages: Any, chunk_tokens: int, *, shards: tuple[int, int], page_size: int) -> int:
    """Tokens of KV-shard rank ``shards[1]`` of ``shards[0]`` in a chunk of logical ``pages`` holding
    ``chunk_tokens`` (SGLang counts the whole chunk's): page l is on rank l % n
    (``utils.py:filter_kv_indices_for_shard_rank``), and only the chunk's last page may be partial."""
    size, rank = shards
    owned = np.asarray(pages, dtype=np.int64) % size == rank
    if not owned.size:
        return 0
    return int(owned.sum()) * page_size - (owned.size * page_size - chunk_tokens if owned[-1] else 0)


def page_rows(kv_args: Any) -> int:
    """Tokens one pdproto KV row stands for: SGLang's page for DeepSeek-V4's compressed KV, else 1."""
    return int(kv_args.page_size) if _compressed(kv_args) else 1


def _compressed(kv_args: Any) -> bool:
    """Whether ``kv_args`` are a ``DeepSeekV4TokenToKVPool``'s (``setup_state_kv_args`` sets its ratios,
    ``utils.py:1494``)."""
    return any(int(r) for r in getattr(kv_args, "mla_compression_ratios", None) or ())


def _refuse_compressed_kv(kv_args: Any, ranks: Ranks) -> None:
    """Raise ``ConfigError`` for a DeepSeek-V4 pool with decode context parallelism, or pipeline stages
    whose entries pdproto cannot number by layer (``_v4_layers``).

    Its KV entries are compressed pages, not layers in order and not token rows: SGLang's V4
    attention has no DCP, and SGLang's PP slicing (``common/conn.py:1890-1995``) knows ratios 4 and
    128 and no draft entries.
    """
    if not _compressed(kv_args):
        return
    ratios = sorted({int(r) for r in kv_args.mla_compression_ratios})
    if ranks.dcp[0] > 1:
        raise ConfigError(
            f"DeepSeek-V4's compressed KV with --dcp-size {ranks.dcp[0]} is not supported with "
            f"--disaggregation-transfer-backend pdproto: its KV entries are pages of compressed rows"
            f" (ratios {ratios}), which pdproto moves whole between servers without DCP; run this server with"
            " --dcp-size 1, or use --disaggregation-transfer-backend mooncake or nixl for it",
            reason=Reason.CONFIG_INVALID, metadata={"setting": "dcp_size", "value": str(ranks.dcp[0])})
    if ranks.pp[0] > 1 and (not set(ratios) <= V4_PP_RATIOS or _num_draft(kv_args)):
        raise ConfigError(
            f"DeepSeek-V4 with --pp-size {ranks.pp[0]} is served by --disaggregation-transfer-backend pdproto for"
            f" compression ratios {sorted(V4_PP_RATIOS)} without a speculative draft, as SGLang slices its stages;"
            f" this server has ratios {ratios} and {_num_draft(kv_args)} draft KV entries: run it with --pp-size 1",
            reason=Reason.CONFIG_INVALID, metadata={"setting": "pp_size", "value": str(ranks.pp[0])})


V4Layers = tuple[list[int], list[int], list[int]]
"""(every layer, ratio-4 layers, ratio-128 layers) of a DeepSeek-V4 stage (``_v4_layers``)."""


def _v4_layers(kv_args: Any, ranks: Ranks, *, prefill: bool) -> V4Layers | None:
    """(layers, ratio-4 layers, ratio-128 layers) of this rank's stage of a DeepSeek-V4 pool, which
    lists its entries by ratio (module docstring); None for other pools and V4.1's ratios."""
    ratios = [int(r) for r in getattr(kv_args, "mla_compression_ratios", None) or ()]
    if not any(ratios) or not set(ratios) <= V4_PP_RATIOS:
        return None
    stage: tuple[int, int] | None = ranks.stage_layers
    if ranks.pp[0] == 1:
        stage = (0, len(ratios))  # SGLang counts a whole-model peer's groups over every ratio
    elif prefill:
        end = getattr(kv_args, "prefill_end_layer", None)  # set by SGLang's prefill (prefill.py:295)
        stage = None if end is None else (int(kv_args.prefill_start_layer), int(end))
    if stage is None:
        raise ConfigError(
            f"a DeepSeek-V4 {'prefill' if prefill else 'decode'} stage (PP rank {ranks.pp[1]} of {ranks.pp[0]}) needs"
            " its layer range to number its entries, and SGLang did not give it: run this server with --pp-size 1",
            reason=Reason.CONFIG_INVALID, metadata={"setting": "pp_size", "value": str(ranks.pp[0])})
    layers = list(range(*stage))
    return layers, [i for i in layers if ratios[i] == 4], [i for i in layers if ratios[i] == 128]


def _v4_ids(name: str, v4: V4Layers, count: int) -> list[int]:
    """Layer ids of the ``count`` entries of a DeepSeek-V4 group list ``name`` (module docstring); raises
    ``TopologyError`` when the pool's lists do not have the groups its ratios give."""
    layers, c4, c128 = v4
    start = layers[0] if layers else 0
    window = max(count - 2 * len(c4), 0)  # swa: a window page per layer, then the C4 compressor rings
    two_pool = count == 3 * len(c4) + 2 * len(c128)  # unified fp8 KV: nope, rope (and C4 indexer) pages
    ids = {"kv": [*c4, *c4, *c4, *c128, *c128] if two_pool else [*c4, *c4, *c128], "c128_state": c128,
           "swa": [*layers[:window], *c4, *c4],
           "swa_ring": layers * (count // len(layers)) if layers else []}[name]
    if len(ids) != count:
        raise TopologyError(
            f"DeepSeek-V4's {name!r} entries from layer {start}: {len(c4)} ratio-4 and {len(c128)} ratio-128 layers"
            f" give {len(ids)}, but SGLang registered {count}: use --disaggregation-transfer-backend mooncake or nixl"
            " for this pool", reason=Reason.TOPOLOGY_LAYER_METADATA_PARTIAL,
            metadata={"group": name, "entries": count, "layerIds": len(ids)})
    return ids


def _group(pair: tuple[int, int]) -> v1.ParallelGroup:
    return v1.ParallelGroup(size=pair[0], rank=pair[1])


def attention_kind(is_mla_backend: bool, is_hybrid_mla_backend: bool) -> common_pb2.AttentionKind.ValueType:
    """The ``AttentionKind`` of an SGLang pool (Kimi Linear: hybrid MLA, passed as not MLA)."""
    if is_hybrid_mla_backend:
        return v1.ATTENTION_KIND_HYBRID_MLA
    return v1.ATTENTION_KIND_MLA if is_mla_backend else v1.ATTENTION_KIND_MHA


def _num_draft(kv_args: Any) -> int:
    return int(getattr(kv_args, "num_draft_entries", 0) or 0)


def kv_layer_ids(kv_args: Any, ranks: Ranks, *, prefill: bool, mha: bool = False) -> list[int | None]:
    """Global layer id of every KV entry (module docstring); all None: pairing by position. An MHA pool
    (``mha``) lists every layer's K, then every layer's V (a draft's after them, the same way): both
    halves take the layers' ids, which pairing consumes in order."""
    n = len(kv_args.kv_item_lens)
    given = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if given:
        if len(given) != n:
            raise TopologyError(f"SGLang sent {len(given)} layer ids for {n} KV entries",
                                reason=Reason.TOPOLOGY_LAYER_METADATA_PARTIAL,
                                metadata={"layerIds": len(given), "entries": n})
        return list(given)
    v4 = _v4_layers(kv_args, ranks, prefill=prefill)
    if v4 is not None:  # a draft's entries (PP 1 only) pair by position among drafts
        return [*_v4_ids("kv", v4, n - _num_draft(kv_args)), *[None] * _num_draft(kv_args)]
    if prefill:
        start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    elif ranks.pp[0] == 1:
        start = 0
    else:
        return [None] * n
    targets, drafts = n - _num_draft(kv_args), _num_draft(kv_args)
    if mha and not targets % 2 and not drafts % 2:
        return [*[start + i for i in range(targets // 2)] * 2,
                *[start + targets // 2 + i for i in range(drafts // 2)] * 2]
    return [start + i for i in range(n)]  # drafts follow the target layers, on the last stage


def _roles(kv_args: Any) -> list[EntryRole]:
    n = len(kv_args.kv_item_lens)
    targets = n - _num_draft(kv_args)
    return [EntryRole.TARGET if i < targets else EntryRole.DRAFT for i in range(n)]


_Component = tuple[str, tuple[common_pb2.StateKind.ValueType, common_pb2.StateTpPolicy.ValueType], list[dict[str, Any]]]


def _state_components(kv_args: Any, pp_size: int = 1, dsa_layers: Sequence[int | None] = (),
                      v4: V4Layers | None = None) -> list[_Component]:
    """(type name, kind, per tensor its fields) of every state component SGLang registered; a ``dsa``
    component's tensors, one per KV entry (the target's layers, then the draft's), take ``dsa_layers``
    as layer ids, SGLang sending none; ``v4`` (from ``_v4_layers``) numbers a DeepSeek-V4 pool's ``swa``
    (the target's, not a draft's second) and ``c128_state``."""
    out: list[_Component] = []
    types = list(getattr(kv_args, "state_types", None) or [])

    def column(name: str, k: int, count: int) -> list[Any]:
        lists = getattr(kv_args, name, None) or []
        values = list(lists[k]) if k < len(lists) and lists[k] is not None else []
        return values if len(values) == count else [None] * count

    for k, state_type in enumerate(types):
        name = str(getattr(state_type, "value", state_type))
        kind = STATE_KINDS.get(name)
        if kind is None:
            raise TopologyError(
                f"the pdproto backend moves SGLang state of types {sorted(STATE_KINDS)}; this model also "
                f"needs {name!r}: use --disaggregation-transfer-backend mooncake or nixl for it",
                reason=Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED, metadata={"stateType": name})
        if name == "swa" and _compressed(kv_args):  # DeepSeek-V4 is MLA: its window and compressor state
            kind = (v1.STATE_KIND_SLIDING_WINDOW, v1.STATE_TP_POLICY_REPLICATED)  # are whole on every rank
        if name in PP_REFUSED and pp_size > 1:
            raise TopologyError(
                f"SGLang moves {name!r} state only without pipeline parallelism, and this server has PP"
                f" {pp_size}: run it with --pp-size 1", reason=Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED,
                metadata={"stateType": name, "ppSize": pp_size})
        ptrs = list(kv_args.state_data_ptrs[k])
        count = len(ptrs)
        layers = column("state_layer_ids", k, count)
        if name == "dsa" and len(dsa_layers) == count and all(i is None for i in layers):
            layers = list(dsa_layers)
        if v4 is not None and name in ("swa", "swa_ring", "c128_state") and name not in [c[0] for c in out]:
            layers = _v4_ids(name, v4, count)
        dims, outers = column("state_dim_per_tensor", k, count), column("state_slice_outer_counts", k, count)
        heads = int(getattr(kv_args, "kv_head_num", 0) or 0)
        if name == "swa" and not _compressed(kv_args) and heads and all(d is None for d in dims):
            # An MHA window page is page_size token rows of this rank's KV heads: SGLang slices it by head
            # between attention TP sizes as it slices KV (_send_swa_state_slice, mooncake/conn.py:2435).
            dims, outers = [heads] * count, [int(kv_args.page_size)] * count
        tensors = [
            {"ptr": p, "length": ln, "item_len": it, "dim": d, "outer": o, "groups": g, "layer": lid}
            for p, ln, it, d, o, g, lid in zip(
                ptrs, column("state_data_lens", k, count), column("state_item_lens", k, count), dims, outers,
                column("state_conv_shard_groups", k, count), layers, strict=True)
            # A DSA layer that reuses the previous layer's top-k has a 0-row index buffer: nothing
            # moves for it and it registers nothing (SGLang's is_elided_entry, utils.py:1045-1064).
            if it != 0
        ]
        if _ring(name, [t["item_len"] for t in tensors]) is not None:
            tensors = [{**t, "item_len": TAIL_SLOT_BYTES} for t in tensors]
        out.append((name, kind, tensors))
    return out


def _ring(name: str, row_bytes: Sequence[int]) -> int | None:
    """Slots per request row of a ``dsa_tail`` component (None for other types); its rows must be whole slots."""
    if name != "dsa_tail":
        return None
    rows = sorted({int(n) for n in row_bytes if n})
    if len(rows) > 1 or any(n % TAIL_SLOT_BYTES for n in rows):
        raise TopologyError(
            f"SGLang's 'dsa_tail' rows hold {rows} bytes; pdproto moves them as ring slots of {TAIL_SLOT_BYTES}"
            " bytes (128 bf16 values) and needs one row size of whole slots: use --disaggregation-transfer-backend"
            " mooncake or nixl for this model", reason=Reason.TOPOLOGY_STATE_SIZE_MISMATCH,
            metadata={"stateType": name, "rowBytes": str(rows)})
    return rows[0] // TAIL_SLOT_BYTES if rows else 0


def ring_sizes(kv_args: Any) -> tuple[int | None, ...]:
    """Per state component, the slots per request row of a ``dsa_tail`` ring; None for every other type."""
    types = list(getattr(kv_args, "state_types", None) or [])
    return tuple(_ring(str(getattr(t, "value", t)), kv_args.state_item_lens[k]) for k, t in enumerate(types))


def state_items(rings: Sequence[int | None], state_indices: Sequence[Any]) -> list[list[int]]:
    """SGLang's per-component state indices as pdproto's item lists (``rings`` from ``ring_sizes``).

    Every list is taken as it is, except a ``dsa_tail`` 6-tuple, which becomes its live ring slots
    in order (``_tail_slots``). Raises ``InvalidFieldError``.
    """
    out = []
    for k, s in enumerate(state_indices):
        values: list[int] = [] if s is None else np.asarray(s).reshape(-1).tolist()
        ring = rings[k] if k < len(rings) else None
        out.append(_tail_slots(values, ring, k) if ring is not None and values else values)
    return out


def _tail_slots(t: list[int], ring: int, k: int) -> list[int]:
    """``[req_row, start, n1, start2, n2, tail_size]`` (``get_dsa_tail_state_indices``, ``utils.py:1269-1297``)
    as items ``req_row * tail_size + slot``: slots ``[start, start + n1)``, then ``[start2, start2 + n2)``."""
    field, meta = f"state_indices[{k}]", {"stateType": "dsa_tail", "indices": str(t)}
    if len(t) != 6:
        raise InvalidFieldError(field, f"a 'dsa_tail' index is [row, start, n1, start2, n2, tail_size], got {t}",
                                metadata=meta)
    row, start, n1, start2, n2, size = t
    if size != ring:
        raise InvalidFieldError(field, f"'dsa_tail' {t} names a ring of {size} slots, but the pool's rows hold"
                                f" {ring} slots of {TAIL_SLOT_BYTES} bytes", metadata=meta)
    if min(t) < 0 or start + n1 > size or start2 + n2 > size:
        raise InvalidFieldError(field, f"'dsa_tail' {t}: the row and segments must be >= 0 and inside the ring"
                                f" of {size} slots", metadata=meta)
    base = row * size
    return [*range(base + start, base + start + n1), *range(base + start2, base + start2 + n2)]


def server_info(kv_args: Any, ranks: Ranks, *, is_mla_backend: bool, host: str, port: int,
                backend: int) -> v1.PrefillServerInfo:
    """The ``PrefillServerInfo`` a prefill rank publishes for the ``KVArgs`` SGLang gave its manager."""
    _refuse_compressed_kv(kv_args, ranks)
    hybrid = bool(getattr(kv_args, "is_hybrid_mla_backend", False))
    ids = kv_layer_ids(kv_args, ranks, prefill=True, mha=not is_mla_backend)
    layer_split = ranks.cp_layers and ranks.attn_cp[0] > 1
    info = v1.PrefillServerInfo(
        version=v1.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
        attn_tp=_group(ranks.attn_tp), attn_cp=_group(ranks.attn_cp), attn_dp=_group(ranks.attn_dp),
        system_dp=_group(ranks.system_dp), pp=_group(ranks.pp), dcp=_group(ranks.dcp),
        rank_endpoint=v1.Endpoint(host=host, port=port),
        page_size=int(kv_args.page_size) // page_rows(kv_args),
        kv_cache_dtype=kv_dtype(kv_args.kv_cache_dtype_str), kv_layout=str(getattr(kv_args, "kv_layout", None) or ""),
        attention_kind=attention_kind(is_mla_backend, hybrid),
        start_layer=int(getattr(kv_args, "prefill_start_layer", 0) or 0),
        backends=[backend],  # type: ignore[list-item]
        total_kv_heads=int(getattr(kv_args, "total_kv_head_num", 0) or 0),
        cp_ranks_split_pages=ranks.cp_split_pages and ranks.attn_cp[0] > 1,
        enable_dsa_cache_layer_split=layer_split, enable_kv_cache_sharding=ranks.kv_shards > 1)
    for item_len, layer_id, role in zip(kv_args.kv_item_lens, ids, _roles(kv_args), strict=True):
        info.kv_entries.add(item_len=int(item_len), layer_id=layer_id, role=int(role))
    info.aux_entries.extend(v1.AuxEntryInfo(item_len=int(n)) for n in kv_args.aux_item_lens)
    # A stage's (or a layer-split CP rank's) dsa tensors carry its layers, for a decode of another PP size.
    stage = layer_split or ranks.pp[0] > 1
    for name, (kind, policy), tensors in _state_components(kv_args, ranks.pp[0], ids if stage else (),
                                                           _v4_layers(kv_args, ranks, prefill=True)):
        entry = info.state_entries.add(kind=kind, type_name=name, tp_policy=policy)
        for t in tensors:
            entry.tensors.add(item_len=int(t["item_len"]), dim=int(t["dim"] or 0), outer_count=int(t["outer"] or 0),
                              shard_groups=[int(w) for w in t["groups"] or ()],
                              layer_id=None if t["layer"] is None else int(t["layer"]))
    if ranks.state_tp_size and info.state_entries:
        info.state_tp.CopyFrom(v1.ParallelGroup(size=ranks.state_tp_size,
                                                rank=ranks.attn_tp[1] % ranks.state_tp_size))
    return info


def decode_layout(kv_args: Any, ranks: Ranks, *, is_mla_backend: bool, notify_host: str,
                  notify_port: int) -> DecodeLayout:
    """The ``DecodeLayout`` of a decode rank for the ``KVArgs`` SGLang gave its manager."""
    _refuse_compressed_kv(kv_args, ranks)
    page, dcp = int(kv_args.page_size) // page_rows(kv_args), ranks.dcp[0]
    ids = kv_layer_ids(kv_args, ranks, prefill=False, mha=not is_mla_backend)
    kv = tuple(KvEntry(int(item_len) // (page * (dcp if role is EntryRole.DRAFT else 1)), layer_id, role)
               for item_len, layer_id, role in zip(kv_args.kv_item_lens, ids, _roles(kv_args), strict=True))
    state = tuple(StateEntry(kind, tuple(StateTensor(int(t["item_len"]), None if t["dim"] is None else int(t["dim"]),
                                                     None if t["layer"] is None else int(t["layer"]))
                                         for t in tensors), type_name=name)
                  for name, (kind, _), tensors in _state_components(kv_args, ranks.pp[0], ids,
                                                                    _v4_layers(kv_args, ranks, prefill=False)))
    return DecodeLayout(
        page_size=page, kv=kv, kv_cache_dtype=kv_dtype(kv_args.kv_cache_dtype_str),
        attention_kind=attention_kind(is_mla_backend, bool(getattr(kv_args, "is_hybrid_mla_backend", False))),
        attn_tp_size=ranks.attn_tp[0], attn_tp_rank=ranks.attn_tp[1], dcp_size=dcp, dcp_rank=ranks.dcp[1],
        pp_size=ranks.pp[0], pp_rank=ranks.pp[1], notify_host=notify_host, notify_port=notify_port,
        capabilities=CAPABILITIES, gpu_id=int(getattr(kv_args, "gpu_id", 0) or 0),
        aux=tuple(AuxEntry(int(n)) for n in kv_args.aux_item_lens), state=state,
        total_kv_heads=int(getattr(kv_args, "total_kv_head_num", 0) or 0))


@dataclass(frozen=True)
class Regions:
    """Every buffer of a rank's pools as (address, length, memory kind): what gets registered."""

    kv: tuple[Region, ...]
    """One per KV entry."""
    aux: tuple[Region, ...]
    """One per aux buffer."""
    state: tuple[tuple[Region, ...], ...]
    """Per state component, one per tensor."""

    def all(self) -> list[Region]:
        """Every region, KV first."""
        return [*self.kv, *self.aux, *(r for entry in self.state for r in entry)]


def regions(kv_args: Any, *, on_device: bool) -> Regions:
    """The regions behind ``kv_args``. On a GPU, KV and state live in device memory and aux in host
    memory (SGLang's ``MetadataBuffers``); on a CPU host all of it is host memory."""
    pool = v1.MEMORY_KIND_VRAM if on_device else v1.MEMORY_KIND_DRAM

    def of(ptrs: Sequence[int], lens: Sequence[int], kind: int) -> tuple[Region, ...]:
        return tuple(Region(int(p), int(n), kind) for p, n in zip(ptrs, lens, strict=True))  # type: ignore[arg-type]

    return Regions(kv=of(kv_args.kv_data_ptrs, kv_args.kv_data_lens, pool),
                   aux=of(kv_args.aux_data_ptrs, kv_args.aux_data_lens, v1.MEMORY_KIND_DRAM),
                   state=tuple(of([t["ptr"] for t in tensors], [t["length"] for t in tensors], pool)
                               for _, _, tensors in _state_components(kv_args)))


__all__ = ["CAPABILITIES", "PP_REFUSED", "STATE_KINDS", "TAIL_SLOT_BYTES", "V4_PP_RATIOS", "Ranks", "Regions",
           "attention_kind", "cp_share_tokens", "decode_layout", "host_port", "kv_layer_ids", "page_rows",
           "regions", "ring_sizes", "server_info", "shard_tokens", "state_items"]
