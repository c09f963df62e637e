"""Builders of well-formed PrefillServerInfo / KvRegistration messages (re-exported by topology).

The CLI, the server tests and the demo share these, so a topology is written as a
few keywords instead of dozens of hand-filled fields. Layer split across PP stages
is even (``pdproto.dcp.layers.stage_layer_range``); draft entries live on the last
stage. Draft entries hold virtual pages of ``page_size * dcp_size`` rows.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, backends, v1
from pdproto.dcp.layers import EntryRole, stage_layer_range
from pdproto.negotiation.registration import DecodeLayout, KvEntry, Region, make_registration

_DEFAULT_TOKEN_BYTES = 1152
"""576 bf16 values: one DeepSeek-style MLA latent row."""


def _layer_plan(num_layers: int, num_draft: int, pp_size: int,
                pp_rank: int) -> tuple[int, list[tuple[int, bool]]]:
    """(start layer, [(layer id, is_draft)]) of one PP stage; drafts sit on the last stage."""
    start, end = stage_layer_range(num_layers, pp_size, pp_rank)
    plan = [(layer, False) for layer in range(start, end)]
    if pp_rank == pp_size - 1:
        # Draft layers get ids after the target model's, as MTP layers are numbered.
        plan += [(num_layers + k, True) for k in range(num_draft)]
    return start, plan


def example_server_info(
    *,
    page_size: int = 16,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    cp_size: int = 1,
    num_layers: int = 4,
    token_bytes: int = _DEFAULT_TOKEN_BYTES,
    num_draft: int = 0,
    draft_token_bytes: int | None = None,
    dtype: str = "bfloat16",
    attention: int = v1.ATTENTION_KIND_MLA,
    backends: Iterable[int] = (v1.BACKEND_MOONCAKE, v1.BACKEND_NIXL, v1.BACKEND_LOCAL),
    model_id: str = "",
    layer_ids: bool = False,
    kv_sharding: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
) -> v1.PrefillServerInfo:
    """A prefill rank's ``PrefillServerInfo`` for the given topology."""
    start, plan = _layer_plan(num_layers, num_draft, pp_size, pp_rank)
    draft_bytes = token_bytes if draft_token_bytes is None else draft_token_bytes
    entries = [
        v1.KvEntryInfo(
            item_len=(draft_bytes * page_size * dcp_size) if draft else token_bytes * page_size,
            layer_id=layer if layer_ids else None,
            role=v1.KV_ENTRY_ROLE_DRAFT if draft else v1.KV_ENTRY_ROLE_TARGET,
        )
        for layer, draft in plan
    ]
    return v1.PrefillServerInfo(
        version=v1.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
        attn_tp=v1.ParallelGroup(size=tp_size, rank=tp_rank),
        attn_cp=v1.ParallelGroup(size=cp_size, rank=0),
        attn_dp=v1.ParallelGroup(size=1, rank=0),
        system_dp=v1.ParallelGroup(size=1, rank=0),
        pp=v1.ParallelGroup(size=pp_size, rank=pp_rank),
        dcp=v1.ParallelGroup(size=dcp_size, rank=dcp_rank),
        rank_endpoint=v1.Endpoint(host=host, port=port),
        page_size=page_size,
        kv_cache_dtype=dtype,
        enable_kv_cache_sharding=kv_sharding,
        attention_kind=attention,  # type: ignore[arg-type]
        num_layers=num_layers,
        start_layer=start,
        model_id=model_id,
        kv_entries=entries,
        backends=list(backends),  # type: ignore[arg-type]
    )


def example_registration(
    *,
    page_size: int = 16,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    num_layers: int = 4,
    token_bytes: int = _DEFAULT_TOKEN_BYTES,
    num_draft: int = 0,
    draft_token_bytes: int | None = None,
    dtype: str = "bfloat16",
    attention: int = v1.ATTENTION_KIND_MLA,
    backend: int = v1.BACKEND_MOONCAKE,
    model_id: str = "",
    layer_ids: bool = False,
    num_pages: int = 64,
    base_ptr: int = 0x1000_0000,
    memory_kind: int = v1.MEMORY_KIND_VRAM,
    host: str = "127.0.0.1",
    port: int = 0,
) -> v1.KvRegistration:
    """A decode rank's ``KvRegistration`` for the given topology; buffers are laid end to end."""
    _, plan = _layer_plan(num_layers, num_draft, pp_size, pp_rank)
    draft_bytes = token_bytes if draft_token_bytes is None else draft_token_bytes
    layout = DecodeLayout(
        page_size=page_size,
        kv=tuple(KvEntry(draft_bytes if draft else token_bytes, layer if layer_ids else None,
                         EntryRole.DRAFT if draft else EntryRole.TARGET) for layer, draft in plan),
        kv_cache_dtype=dtype, attention_kind=attention,  # type: ignore[arg-type]
        attn_tp_size=tp_size, attn_tp_rank=tp_rank, dcp_size=dcp_size, dcp_rank=dcp_rank,
        pp_size=pp_size, pp_rank=pp_rank, model_id=model_id, notify_host=host, notify_port=port)
    regions: list[Region] = []
    for item_len in layout.item_lens():
        start = regions[-1].ptr + regions[-1].length if regions else base_ptr
        regions.append(Region(start, item_len * num_pages, memory_kind))  # type: ignore[arg-type]
    endpoint = None
    if backend != v1.BACKEND_UNSPECIFIED:
        spec = backends.by_enum(backend)
        endpoint = spec.endpoint(**{spec.identity: f"decode-{host}-{port}-tp{tp_rank}-dcp{dcp_rank}-pp{pp_rank}"})
    return make_registration(layout, endpoint, regions)


__all__ = ["example_registration", "example_server_info"]
