"""vLLM 0.33.0's KV cache as pdproto sees it: what is served, the regions, a prefill's info, a decode's layout.

vLLM describes its KV cache once, in the ``KVCacheConfig`` every connector is built with
(``v1/kv_cache_interface.py``): per cache group a spec (``MLAAttentionSpec``,
``FullAttentionSpec``, ``MambaSpec``, ...) and per ``KVCacheTensor`` the layers sharing one
allocation, with their ``layer_stride`` and ``block_stride`` in bytes. This module reads
those (and the per-layer tensors the worker is handed, by address), and nothing else of
vLLM, so it imports no vLLM (tests and the type gate use it without vLLM).

What is served (``check_served``, run when the connector is built, in the scheduler and in
every worker, so a layout pdproto cannot map stops the engine at start-up with a typed
reason, never a request at transfer time):

* **MLA** (``MLAAttentionSpec``): one row per token per layer (bf16: 576 x 2 = 1,152 B),
  every layer a region of its own: layer ``l``'s block ``b`` at ``base + l * layer_stride
  + b * page``. A layer-compact layout (LBNHC, LBHNC: ``block_stride`` equal to the page)
  makes a block one contiguous run of ``block_size`` rows, which is pdproto's page. Block 0
  is vLLM's null block: never named by a request, registered like any other.
* **DCP** on either side: a block id names the same block on every DCP rank, each holding
  ``block_size`` rows of its tokens (rank ``t % N``, row ``t // N`` with the default
  interleave 1, which is pdproto's rule); pdproto's page is the physical block, its
  virtual page ``block_size * N``. A ``--cp-kv-cache-interleave-size`` other than 1 is
  refused (``refuse_interleave``).
* **MHA/GQA** (``FullAttentionSpec``) in vLLM's default LBNHC layout: a token's row is its
  heads one after the other, each head's K then V (``2 * head_size`` elements), so a TP
  slice of heads is one contiguous part of the row, which is what pdproto's head slicing
  cuts (``total_kv_heads``). No DCP with MHA (pdproto shards MLA rows only).
* **Mamba-family state** (``MambaSpec`` groups beside the one attention group: Mamba2, GDN,
  KDA hybrids) in Mamba cache mode ``none`` (``--no-enable-prefix-caching``: vLLM derives the
  mode from it): per layer and block one raw page, conv bytes
  then temporal, padded to the attention page (``model_executor/layers/mamba/abstract.py``).
  Each Mamba group is one pdproto ``RECURRENT`` state entry, a layer one tensor whose item
  is that page, and a request's slot its running-state block of the group (``MambaGroup``).
  Groups overlay the attention group's memory (``KVCacheTensor``): a layer's region is
  registered once. The state's description (kind, conv layout per
  ``VLLM_SSM_CONV_STATE_LAYOUT``, dtypes and per-rank shapes) is the entry's type name, so
  a decode that lays it out differently is refused at Register (``TOPOLOGY_STATE_KIND_MISMATCH``);
  the state moves between equal TP sizes only (``STATE_TP_POLICY_REFUSED``).
* Not served, refused with the reason named: sliding-window and other state specs, Mamba
  caches in mode ``align`` (prefix caching of Mamba state), a model without one
  full-attention group (pure Mamba), padded attention pages, block-outermost layouts (BLNHC, ...), head-major MHA
  layouts (LBHNC), caches quantized with per-token scales, and sparse MLA (DeepSeek V3.2/V4
  index caches).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, v1
from pdproto.errors import ConfigError, PdprotoError, Reason, TopologyError
from pdproto.negotiation.registration import DecodeLayout, KvEntry, Region, StateEntry, StateTensor
from pdproto.negotiation.topology import PAGE_RELAYOUT
from pdproto.negotiation.tpmap import PACKED_FAN_IN, SPLIT_KV
from pdproto.v1 import common_pb2

from ..dtypes import kv_dtype

CAPABILITIES = ("dcp-relayout", "packed", PAGE_RELAYOUT, PACKED_FAN_IN, SPLIT_KV)
"""What a decode rank of this connector announces: vLLM's block sizes differ between engines and
backends (16, 64, 128), so its blocks take rows planned per token from any prefill page size; it
puts packed fan-in blocks back in row order (``worker.DecodeWorker``); and it waits for every prefill
rank its negotiation names, so an MLA fan-in's ranks may each write part of the KV."""


@dataclass(frozen=True)
class Ranks:
    """Where one vLLM worker sits: (size, rank) of its tensor, decode-context and pipeline groups."""

    tp: tuple[int, int] = (1, 0)
    """Tensor parallelism (vLLM's DCP reuses these ranks: ``tp % dcp == 0``)."""
    dcp: tuple[int, int] = (1, 0)
    """Decode context parallelism."""
    pp: tuple[int, int] = (1, 0)
    """Pipeline parallelism."""


@dataclass(frozen=True)
class MambaGroup:
    """One Mamba cache group: per layer one page per block (conv bytes, then temporal, padded to the attention
    page); a request's state is its running-state block of the group (Mamba cache mode ``none``)."""

    index: int
    """Its index in ``kv_cache_groups`` (vLLM hands a request's block ids per group)."""
    layers: tuple[str, ...]
    """vLLM's layer names, in allocation order."""
    layer_ids: tuple[int | None, ...]
    """Global layer id of each (``layer_ids``)."""
    page_bytes: int
    """Bytes of one block of one layer (the padded page: a block's stride)."""
    type_name: str
    """What both sides must agree on: kind, conv layout, dtypes and per-rank shapes."""
    spec_blocks: int = 0
    """Speculative scratch blocks after the running-state block."""

    def state_block(self, blocks: Sequence[int]) -> int:
        """The block holding a request's running state (vLLM's ``clip_ssm_state_blocks``)."""
        return int(blocks[len(blocks) - 1 - min(self.spec_blocks, len(blocks) - 1)])


@dataclass(frozen=True)
class KvCache:
    """The served KV cache: one cache group of MLA or MHA layers, each a region of ``num_blocks`` pages, and the
    hybrid model's Mamba groups."""

    layers: tuple[str, ...]
    """vLLM's layer names, in allocation order."""
    layer_ids: tuple[int | None, ...]
    """Global layer id of each (from its name); all None when a name holds no single number."""
    block_size: int
    """Rows per physical block on this rank."""
    row_bytes: int
    """Bytes of one token's row in one layer."""
    num_blocks: int
    """Blocks every layer holds (block 0 is the null block)."""
    dtype: str
    """KV dtype in the canonical spelling (``pdproto.integrations.dtypes``: "bfloat16", "fp8_e4m3", ...)."""
    kind: common_pb2.AttentionKind.ValueType = v1.ATTENTION_KIND_MLA
    """MLA (one latent row per token) or MHA (per token, this rank's heads, each head's K then V)."""
    heads: int = 1
    """KV heads this rank holds (MHA)."""
    group: int = 0
    """The attention group's index in ``kv_cache_groups``."""
    mamba: tuple[MambaGroup, ...] = ()
    """Mamba groups (hybrid models), each one state entry."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.block_size * self.row_bytes


def _not_served(what: str, why: str, reason: Reason = Reason.CONFIG_INVALID, **metadata: Any) -> PdprotoError:
    """The refusal of a layout the connector does not serve, naming what and why."""
    cls = ConfigError if reason is Reason.CONFIG_INVALID else TopologyError
    return cls(f"PdprotoConnector does not serve {what}: {why}", reason=reason,
               metadata={"what": what, **{k: str(v) for k, v in metadata.items()}})


def layer_ids(names: Sequence[str]) -> tuple[int | None, ...]:
    """Each layer's global id: the one number in its name (``model.layers.7.self_attn.attn``), as vLLM's
    ``extract_layer_index`` reads it; all None (pairing by position) when a name has none or several."""
    ids = []
    for name in names:
        numbers = [int(part) for part in name.split(".") if part.isdigit()]
        if len(numbers) != 1:
            return (None,) * len(names)
        ids.append(numbers[0])
    return tuple(ids)


ATTENTION_SPECS = ("MLAAttentionSpec", "FullAttentionSpec")


def check_served(kv_cache_config: Any) -> KvCache:
    """The MLA or MHA cache ``kv_cache_config`` describes, with its Mamba groups; raises ``ConfigError``/
    ``TopologyError`` for what is not served."""
    groups = list(kv_cache_config.kv_cache_groups)
    specs = [type(g.kv_cache_spec).__name__ for g in groups]
    attention = [i for i, s in enumerate(specs) if s in ATTENTION_SPECS]
    if len(groups) == 1 and not attention:
        reason = Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED if "Mamba" in specs[0] else Reason.CONFIG_INVALID
        raise _not_served(f"KV cache spec {specs[0]}", "only full-attention caches (MLA, MHA/GQA), and Mamba state "
                          "beside one, are moved; use vLLM's NixlConnector or MooncakeConnector", reason, spec=specs[0])
    if len(attention) != 1 or any(s not in ATTENTION_SPECS and s != "MambaSpec" for s in specs):
        reason = Reason.CONFIG_INVALID if attention else Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED
        raise _not_served(f"a model with {len(groups)} KV cache groups ({', '.join(specs)})",
                          "hybrid models move one full-attention group and Mamba groups; sliding-window and other "
                          "state groups are not moved; use vLLM's NixlConnector or MooncakeConnector", reason,
                          specs=specs)
    (index,) = attention
    spec = groups[index].kv_cache_spec
    name = specs[index]
    mha = name == "FullAttentionSpec"
    if mha and getattr(spec, "sliding_window", None):
        raise _not_served("sliding-window attention", "the window's blocks are not tracked", spec=name)
    if mha and kv_cache_config.kv_cache_layout not in (None, "LBNHC"):
        # LBNHC keeps a token's heads together (each head's K then V): a token is one row, and a
        # TP slice of heads one contiguous part of it. Head-major layouts (LBHNC) are not rows.
        raise _not_served(f"MHA KV cache layout {kv_cache_config.kv_cache_layout}",
                          "a token's heads must be one row; set VLLM_KV_CACHE_LAYOUT=LBNHC", spec=name)
    if int(getattr(getattr(spec, "kv_quant_mode", None), "value", 0) or 0) > 1:
        raise _not_served("KV caches quantized with per-token or per-block scales", "the scales are not moved",
                          spec=name, quant=getattr(spec.kv_quant_mode, "name", ""))
    if getattr(spec, "topk_buffer_width", None) or getattr(spec, "model_version", None):
        raise _not_served("sparse MLA (an index cache beside the latent cache)", "only dense MLA is moved",
                          spec=name)
    page = int(spec.page_size_bytes)
    if page != int(spec.real_page_size_bytes) or page % int(spec.block_size):
        raise _not_served("padded KV pages", f"page {page} B holds {spec.real_page_size_bytes} B of rows",
                          page=page)
    layers = _compact_layers(kv_cache_config, groups[index].layer_names, page)
    dtype = kv_dtype(getattr(spec, "cache_dtype_str", None)) or kv_dtype(spec.dtype)  # vLLM's auto: the torch dtype
    block = int(spec.block_size)
    return KvCache(tuple(layers), layer_ids(layers), block, page // block, int(kv_cache_config.num_blocks), dtype,
                   v1.ATTENTION_KIND_MHA if mha else v1.ATTENTION_KIND_MLA, int(spec.num_kv_heads), index,
                   tuple(_mamba_group(kv_cache_config, i) for i, s in enumerate(specs) if s == "MambaSpec"))


def _compact_layers(kv_cache_config: Any, names: Sequence[str], page: int) -> list[str]:
    """The layers ``names`` of the config's tensors, in allocation order; refused unless each block of a layer is one
    contiguous page."""
    layers: list[str] = []
    for t in kv_cache_config.kv_cache_tensors:
        if set(t.layers).isdisjoint(names):
            continue  # another group's tensor
        if int(t.block_stride) != page or int(t.layer_stride) < page * int(kv_cache_config.num_blocks):
            raise _not_served(
                f"KV cache layout {kv_cache_config.kv_cache_layout or '(default)'}",
                f"a block must be one contiguous page of a layer (block stride {t.block_stride} B, page {page} B,"
                f" layer stride {t.layer_stride} B); set VLLM_KV_CACHE_LAYOUT=LBNHC",
                blockStride=t.block_stride, page=page)
        layers.extend(t.layers)
    return layers


def _mamba_group(kv_cache_config: Any, index: int) -> MambaGroup:
    """Mamba group ``index`` as a state entry; refused in a cache mode other than ``none``."""
    group = kv_cache_config.kv_cache_groups[index]
    spec = group.kv_cache_spec
    mode = str(spec.mamba_cache_mode)
    if mode != "none":
        # align keeps a state per block position; vLLM's P/D hands over the running state only.
        raise _not_served(f"Mamba state in cache mode {mode} (prefix caching of Mamba state)",
                          "only mode none (one state block per request) is moved; run the prefill and the decode "
                          "with --no-enable-prefix-caching", Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED, mode=mode)
    layers = _compact_layers(kv_cache_config, group.layer_names, int(spec.page_size_bytes))
    # vLLM's conv layout (model_executor/layers/mamba/mamba_utils.py: get_conv_state_layout) is also in the
    # shapes, but a square conv state would hide it.
    conv = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") or "SD"
    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
    states = ", ".join(f"{kv_dtype(d) or d}{tuple(int(n) for n in shape)}"
                       for shape, d in zip(spec.shapes, spec.dtypes, strict=True))
    return MambaGroup(index, tuple(layers), layer_ids(layers), int(spec.page_size_bytes),
                      f"vllm {kind} conv {conv}: {states}", int(spec.num_speculative_blocks))


def refuse_interleave(interleave: int, dcp_size: int) -> None:
    """Raise ``ConfigError`` for a DCP token interleave other than 1 (pdproto's rule is token ``t`` on rank ``t % N``)."""
    if dcp_size > 1 and interleave != 1:
        raise _not_served(f"--cp-kv-cache-interleave-size {interleave} with DCP {dcp_size}",
                          "pdproto places token t on DCP rank t % N (interleave 1); run with "
                          "--cp-kv-cache-interleave-size 1", interleave=interleave)


def regions(cache: KvCache, kv_caches: Mapping[str, Any], *,
            on_device: bool) -> tuple[tuple[Region, ...], tuple[tuple[Region, ...], ...]]:
    """One region per layer of ``cache``, and per Mamba group one per layer, from the per-layer tensors vLLM
    handed ``register_kv_caches``."""
    missing = [n for n in (*cache.layers, *(n for g in cache.mamba for n in g.layers)) if n not in kv_caches]
    if missing:
        raise ConfigError(f"register_kv_caches was not handed layers {missing[:3]} of the KV cache config",
                          reason=Reason.CONFIG_INVALID, metadata={"missing": ",".join(missing[:3])})
    kind = v1.MEMORY_KIND_VRAM if on_device else v1.MEMORY_KIND_DRAM

    def of(names: Sequence[str], page: int) -> tuple[Region, ...]:
        return tuple(Region(int(kv_caches[n].data_ptr()), cache.num_blocks * page, kind) for n in names)

    return of(cache.layers, cache.page_bytes), tuple(of(g.layers, g.page_bytes) for g in cache.mamba)


def server_info(cache: KvCache, ranks: Ranks, *, host: str, port: int, backend: int) -> v1.PrefillServerInfo:
    """The ``PrefillServerInfo`` a vLLM prefill worker publishes."""
    info = v1.PrefillServerInfo(
        version=v1.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
        attn_tp=v1.ParallelGroup(size=ranks.tp[0], rank=ranks.tp[1]), attn_cp=v1.ParallelGroup(size=1, rank=0),
        attn_dp=v1.ParallelGroup(size=1, rank=0), system_dp=v1.ParallelGroup(size=1, rank=0),
        pp=v1.ParallelGroup(size=ranks.pp[0], rank=ranks.pp[1]),
        dcp=v1.ParallelGroup(size=ranks.dcp[0], rank=ranks.dcp[1]),
        rank_endpoint=v1.Endpoint(host=host, port=port), page_size=cache.block_size, kv_cache_dtype=cache.dtype,
        attention_kind=cache.kind, start_layer=min((i for i in cache.layer_ids if i is not None), default=0),
        backends=[backend],  # type: ignore[list-item]
        total_kv_heads=total_heads(cache, ranks))
    for layer_id in cache.layer_ids:
        info.kv_entries.add(item_len=cache.page_bytes, layer_id=layer_id)
    for g in cache.mamba:
        entry = info.state_entries.add(kind=v1.STATE_KIND_RECURRENT, type_name=g.type_name,
                                       tp_policy=v1.STATE_TP_POLICY_REFUSED)
        for layer_id in g.layer_ids:
            entry.tensors.add(item_len=g.page_bytes, layer_id=layer_id)
    return info


def decode_layout(cache: KvCache, ranks: Ranks, *, notify_host: str, notify_port: int,
                  gpu_id: int) -> DecodeLayout:
    """The ``DecodeLayout`` of a vLLM decode worker."""
    return DecodeLayout(
        page_size=cache.block_size, kv=tuple(KvEntry(cache.row_bytes, i) for i in cache.layer_ids),
        kv_cache_dtype=cache.dtype, attention_kind=cache.kind, total_kv_heads=total_heads(cache, ranks),
        attn_tp_size=ranks.tp[0],
        attn_tp_rank=ranks.tp[1], dcp_size=ranks.dcp[0], dcp_rank=ranks.dcp[1], pp_size=ranks.pp[0],
        pp_rank=ranks.pp[1], notify_host=notify_host, notify_port=notify_port, capabilities=CAPABILITIES,
        gpu_id=gpu_id, state=tuple(StateEntry(v1.STATE_KIND_RECURRENT, tuple(StateTensor(g.page_bytes, None, i)
                                                                            for i in g.layer_ids), g.type_name)
                                   for g in cache.mamba))


def total_heads(cache: KvCache, ranks: Ranks) -> int:
    """The model's KV heads (MHA: what TP head slicing splits); 0 for MLA."""
    return cache.heads * ranks.tp[0] if cache.kind == v1.ATTENTION_KIND_MHA else 0


def room_of(transfer_id: str) -> int:
    """The pdproto room of a transfer id both engines were given: 63 bits of its BLAKE2b digest."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def notify_port(engine_id: str, tp_rank: int) -> int:
    """A decode worker's control-endpoint port: nothing listens there, it names the worker (with the host)."""
    digest = hashlib.blake2b(f"{engine_id}/{tp_rank}".encode(), digest_size=4).digest()
    return 1024 + int.from_bytes(digest, "big") % (65536 - 1024)


__all__ = ["ATTENTION_SPECS", "CAPABILITIES", "KvCache", "MambaGroup", "Ranks", "check_served", "decode_layout",
           "layer_ids", "notify_port", "refuse_interleave", "regions", "room_of", "server_info", "total_heads"]
