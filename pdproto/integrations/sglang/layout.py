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
  layers, as SGLang numbers them); a decode with PP > 1 sends none and pairs by position.
* A prefill whose every attention-CP rank sends a share of each request (SGLang's
  ``enable_all_cp_ranks_for_transfer`` with CP > 1: hybrid MLA, or
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``) publishes ``cp_ranks_split_pages``
  (``Ranks.cp_split_pages``): CP rank r sends its contiguous share of the pages
  (``filter_kv_indices_for_cp_rank``), each chunk at its page position and with the tokens of
  its own pages (``cp_share_tokens``), and CP rank 0 alone the state and aux every CP rank
  holds whole. A DSA cache layer split, whose CP ranks hold different layers, is refused
  (``refuse_cp_layer_split``).
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
  sliding-window, replicated. A DSpark draft adds its own ``swa`` component and ``request_row``, one
  int64 per request row (``deepseek_v4_memory_pool.py:1245-1260``), index ``[req_pool_idx]``:
  recurrent, and refused between TP sizes, as SGLang refuses DSpark PD (``common/conn.py:1376-1389``).
  Lists of unequal length are refused per request for every kind (``negotiation.slots``), as SGLang
  raises for these. SGLang runs DeepSeek-V4 with neither decode context parallelism nor (in PD)
  pipeline stages pdproto can pair, so both are refused at start-up (``_refuse_compressed_kv``).
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
    # equal attention TP sizes (common/conn.py:1376-1389), so a mismatch is refused naming this type.
    "request_row": (v1.STATE_KIND_RECURRENT, v1.STATE_TP_POLICY_REFUSED),
}
"""SGLang ``StateType`` value -> (``StateKind``, ``StateTpPolicy``), for the state types pdproto moves."""

TAIL_SLOT_BYTES = 256
"""One ``dsa_tail`` ring slot: ``index_head_dim`` bf16 values, which ``DSATokenToKVPool`` requires to be 128
(``memory_pool.py:5345``); a request's 6-tuple names its ring size, checked against the row bytes."""

PP_REFUSED = frozenset({"minimax_index_k", "minimax_dense_kv"})
"""State types SGLang moves only between servers without pipeline parallelism (compacted layer lists)."""

CAPABILITIES = ("dcp-relayout", "packed", PAGE_RELAYOUT)
"""What a decode rank of this backend announces: its pages take rows planned per token, so a prefill of
another page size (a vLLM prefill's block of 16) may feed it; SGLang's own bootstrap check still keeps
two SGLang servers to one ``--page-size``."""


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
    state_tp_size: int = 0
    """TP size that splits state tensors (SGLang ``linear_attn_tp_size``); 0: attention TP."""
    cp_split_pages: bool = False
    """Every attention-CP rank sends its share of each request's pages (SGLang
    ``enable_all_cp_ranks_for_transfer``); otherwise CP rank 0 sends everything."""
    kv_shards: int = 1
    """Ranks each request's pages are striped across (SGLang ``kv_shard_size``); 1: none."""

    def cp_as_tp(self) -> Ranks:
        """This rank as SGLang's backends present a CP-TP group sharing prefill rank: CP rank r of n sends as
        TP rank r of n with CP 1 (``register_to_bootstrap``), every CP rank a sender (``is_dummy_cp_rank``)."""
        return replace(self, attn_tp=self.attn_cp, attn_cp=(1, 0), cp_split_pages=False)


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it: an IPv6 host in brackets (``[::1]:50051``)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refuse_cp_layer_split(attn_cp_size: int, layer_split: bool) -> None:
    """Raise ``ConfigError`` for a prefill whose attention-CP ranks each hold other layers (DSA cache layer split).

    SGLang then has every CP rank send every page of its own layers and state
    (``_prepare_send_indices`` skips the page filter); pdproto pairs a prefill rank's layers
    as the whole model's, so each CP rank would overwrite the others' layers.
    """
    if attn_cp_size <= 1 or not layer_split:
        return
    raise ConfigError(
        f"--attn-cp-size {attn_cp_size} with the DSA cache layer split on the prefill is not supported with "
        "--disaggregation-transfer-backend pdproto: each CP rank holds other layers, and pdproto pairs a CP "
        "rank's layers as the model's; run this prefill without the layer split, or use "
        "--disaggregation-transfer-backend mooncake or nixl for it",
        reason=Reason.CONFIG_INVALID, metadata={"setting": "enable_dsa_cache_layer_split", "value": str(attn_cp_size)})


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
    """Raise ``ConfigError`` for a DeepSeek-V4 pool with decode context or pipeline parallelism.

    Its KV entries are compressed pages, not layers in order and not token rows: SGLang's V4
    attention has no DCP, and its KV entries carry no layer ids for pairing PP stages.
    """
    if not _compressed(kv_args):
        return
    for setting, size, flag in (("dcp_size", ranks.dcp[0], "--dcp-size"), ("pp_size", ranks.pp[0], "--pp-size")):
        if size > 1:
            raise ConfigError(
                f"DeepSeek-V4's compressed KV with {flag} {size} is not supported with "
                f"--disaggregation-transfer-backend pdproto: its KV entries are pages of compressed rows"
                f" (ratios {sorted({int(r) for r in kv_args.mla_compression_ratios})}), which pdproto moves"
                f" whole between single-stage servers without DCP; run this server with {flag} 1, or use"
                " --disaggregation-transfer-backend mooncake or nixl for it",
                reason=Reason.CONFIG_INVALID, metadata={"setting": setting, "value": str(size)})


def _group(pair: tuple[int, int]) -> v1.ParallelGroup:
    return v1.ParallelGroup(size=pair[0], rank=pair[1])


def attention_kind(is_mla_backend: bool, is_hybrid_mla_backend: bool) -> common_pb2.AttentionKind.ValueType:
    """The ``AttentionKind`` of an SGLang pool (Kimi Linear: hybrid MLA, passed as not MLA)."""
    if is_hybrid_mla_backend:
        return v1.ATTENTION_KIND_HYBRID_MLA
    return v1.ATTENTION_KIND_MLA if is_mla_backend else v1.ATTENTION_KIND_MHA


def _num_draft(kv_args: Any) -> int:
    return int(getattr(kv_args, "num_draft_entries", 0) or 0)


def kv_layer_ids(kv_args: Any, *, prefill: bool, pp_size: int) -> list[int | None]:
    """Global layer id of every KV entry (module docstring); all None: pairing by position."""
    n = len(kv_args.kv_item_lens)
    given = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if given:
        if len(given) != n:
            raise TopologyError(f"SGLang sent {len(given)} layer ids for {n} KV entries",
                                reason=Reason.TOPOLOGY_LAYER_METADATA_PARTIAL,
                                metadata={"layerIds": len(given), "entries": n})
        return list(given)
    if prefill:
        start = int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    elif pp_size == 1:
        start = 0
    else:
        return [None] * n
    return [start + i for i in range(n)]  # drafts follow the target layers, on the last stage


def _roles(kv_args: Any) -> list[EntryRole]:
    n = len(kv_args.kv_item_lens)
    targets = n - _num_draft(kv_args)
    return [EntryRole.TARGET if i < targets else EntryRole.DRAFT for i in range(n)]


def _state_components(kv_args: Any, pp_size: int = 1) -> list[tuple[str, tuple[common_pb2.StateKind.ValueType,
                                                                           common_pb2.StateTpPolicy.ValueType],
                                                                list[dict[str, Any]]]]:
    """(type name, kind, per tensor its fields) of every state component SGLang registered."""
    out = []
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
        tensors = [
            {"ptr": p, "length": ln, "item_len": it, "dim": d, "outer": o, "groups": g, "layer": lid}
            for p, ln, it, d, o, g, lid in zip(
                ptrs, column("state_data_lens", k, count), column("state_item_lens", k, count),
                column("state_dim_per_tensor", k, count), column("state_slice_outer_counts", k, count),
                column("state_conv_shard_groups", k, count), column("state_layer_ids", k, count), strict=True)
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
    ids = kv_layer_ids(kv_args, prefill=True, pp_size=ranks.pp[0])
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
        enable_kv_cache_sharding=ranks.kv_shards > 1)
    for item_len, layer_id, role in zip(kv_args.kv_item_lens, ids, _roles(kv_args), strict=True):
        info.kv_entries.add(item_len=int(item_len), layer_id=layer_id, role=int(role))
    info.aux_entries.extend(v1.AuxEntryInfo(item_len=int(n)) for n in kv_args.aux_item_lens)
    for name, (kind, policy), tensors in _state_components(kv_args, ranks.pp[0]):
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
    ids = kv_layer_ids(kv_args, prefill=False, pp_size=ranks.pp[0])
    kv = tuple(KvEntry(int(item_len) // (page * (dcp if role is EntryRole.DRAFT else 1)), layer_id, role)
               for item_len, layer_id, role in zip(kv_args.kv_item_lens, ids, _roles(kv_args), strict=True))
    state = tuple(StateEntry(kind, tuple(StateTensor(int(t["item_len"]), None if t["dim"] is None else int(t["dim"]),
                                                     None if t["layer"] is None else int(t["layer"]))
                                         for t in tensors), type_name=name)
                  for name, (kind, _), tensors in _state_components(kv_args, ranks.pp[0]))
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


__all__ = ["CAPABILITIES", "PP_REFUSED", "STATE_KINDS", "TAIL_SLOT_BYTES", "Ranks", "Regions", "attention_kind",
           "cp_share_tokens", "decode_layout", "host_port", "kv_layer_ids", "page_rows", "refuse_cp_layer_split",
           "regions", "ring_sizes", "server_info", "shard_tokens", "state_items"]
