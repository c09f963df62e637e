"""The decode side's one ``KvRegistration`` builder: a layout, an engine endpoint and buffers in, a message out.

Whatever runs a decode rank (the demo's decode peer, the tests, an engine adapter turning
SGLang's ``KVArgs`` into a registration) describes its pool once as a ``DecodeLayout``,
registers its KV memory with an executor, and calls::

    reg = make_registration(layout, executor.endpoint(), buffers)

``buffers`` are one region per KV entry, in layout order: ``pdproto.transfer.Buffer``
objects, or ``Region`` values for memory some other engine registered. The builder owns
the rules both sides must agree on: a target entry's page holds ``page_size`` rows, a
draft entry's page holds ``page_size * dcp_size`` rows (the draft pool is never
DCP-sharded), the legacy ``kv_item_len`` is entry 0's, and the endpoint goes into the case
``pdproto.backends`` names for it. Aux buffers and state entries (``AuxEntry``, ``StateEntry``)
come the same way: sizes in the layout, one region per aux buffer and per state tensor.

This module is core: no gRPC, threads or engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, backends
from pdproto.dcp.layers import EntryRole
from pdproto.errors import InvalidFieldError
from pdproto.v1 import common_pb2, registration_pb2


class KvRegion(Protocol):
    """Registered memory of one KV entry; ``pdproto.transfer.Buffer`` is one."""

    @property
    def ptr(self) -> int:
        """Address the prefill writes to (what goes into ``KvBuffer.ptr``)."""
        ...

    @property
    def length(self) -> int:
        """Bytes registered at ``ptr`` (0 when unknown: the prefill cannot bound writes then)."""
        ...

    @property
    def kind(self) -> common_pb2.MemoryKind.ValueType:
        """Where the memory lives (``pdproto.v1.MemoryKind``)."""
        ...


@dataclass(frozen=True)
class Region:
    """A ``KvRegion`` given as plain values, for memory registered outside ``pdproto.transfer``."""

    ptr: int
    """Address the prefill writes to."""
    length: int
    """Bytes registered at ``ptr``."""
    kind: common_pb2.MemoryKind.ValueType = common_pb2.MEMORY_KIND_VRAM
    """Where the memory lives."""


@dataclass(frozen=True)
class KvEntry:
    """One KV pool entry of the decode: a layer of the target model or of the draft model."""

    token_bytes: int
    """Bytes of one token's row in this entry."""
    layer_id: int | None = None
    """Global model layer id; None when the pool sends no layer metadata (pairing by position)."""
    role: EntryRole = EntryRole.TARGET
    """Target or draft entry."""


@dataclass(frozen=True)
class AuxEntry:
    """One aux (metadata) buffer of the decode: first output token, logprobs, ..."""

    item_len: int
    """Bytes per aux slot."""


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a decode state entry."""

    item_len: int
    """Bytes per slot (recurrent) or per page (sliding window, paged) on this rank."""
    dim: int | None = None
    """Elements of the TP-split axis this rank holds; 0: whole on every rank; None: not sent
    (then for every tensor of the entry; the prefill can only copy whole items)."""
    layer_id: int | None = None
    """Global model layer id; None for every tensor of the entry, or for none."""


@dataclass(frozen=True)
class StateEntry:
    """One state entry of the decode (an SGLang state component)."""

    kind: common_pb2.StateKind.ValueType
    """How a request addresses it (``pdproto.v1.StateKind``)."""
    tensors: tuple[StateTensor, ...]
    """Its tensors, in pool order."""
    type_name: str = ""
    """SGLang ``StateType`` value (``"dsa"``); when the prefill names its entry too, the names must agree."""


def kv_entries(count: int, token_bytes: int, *, layer_ids: bool = True) -> tuple[KvEntry, ...]:
    """``count`` target entries of ``token_bytes`` each, for layers 0 on."""
    return tuple(KvEntry(token_bytes, i if layer_ids else None) for i in range(count))


@dataclass(frozen=True, kw_only=True)
class DecodeLayout:
    """What a decode rank's KV pool looks like and where the rank sits in its parallel groups."""

    page_size: int
    """Physical page size in tokens."""
    kv: tuple[KvEntry, ...]
    """KV entries in pool order (the order of the buffers given to ``make_registration``)."""
    kv_cache_dtype: str
    """KV dtype string, e.g. "bfloat16"; compared with the prefill's."""
    attention_kind: common_pb2.AttentionKind.ValueType
    """KV pool family (``pdproto.v1.AttentionKind``)."""
    attn_tp_size: int = 1
    """Attention tensor-parallel size."""
    attn_tp_rank: int = 0
    """This rank's index in its attention TP group."""
    dcp_size: int = 1
    """Decode context-parallel size (1 when the KV cache is not sharded by token)."""
    dcp_rank: int = 0
    """This rank's index in its DCP group."""
    pp_size: int = 1
    """Pipeline-parallel size."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    model_id: str = ""
    """Model identity; empty means not checked."""
    notify_host: str = ""
    """Host of the decode's control endpoint; with the port it names the rank across restarts."""
    notify_port: int = 0
    """Port of the decode's control endpoint."""
    capabilities: tuple[str, ...] = ()
    """Optional features the decode supports (e.g. "dcp-relayout", "packed")."""
    gpu_id: int = 0
    """Device index of the decode rank."""
    minor: int = PROTOCOL_MINOR
    """Protocol minor the registration claims (another value only in version-skew tests)."""
    aux: tuple[AuxEntry, ...] = ()
    """Aux buffers, in pool order (the order of the ``aux`` regions)."""
    state: tuple[StateEntry, ...] = ()
    """State entries, in pool order (the order of the ``state`` regions)."""
    total_kv_heads: int = 0
    """KV heads of the model before TP (MHA head slicing); 0: not sent."""

    def item_lens(self) -> tuple[int, ...]:
        """Bytes per page of each KV entry: draft pages are virtual (``page_size * dcp_size`` rows)."""
        return tuple(e.token_bytes * self.page_size * (self.dcp_size if e.role is EntryRole.DRAFT else 1)
                     for e in self.kv)


def _state_buffer(entry: StateEntry, regions: Sequence[KvRegion], e: int) -> registration_pb2.StateBuffer:
    """One ``StateBuffer``: the entry's tensors with their regions."""
    if len(regions) != len(entry.tensors):
        raise InvalidFieldError(f"state[{e}]", f"{len(regions)} regions for {len(entry.tensors)} tensors",
                                metadata={"regions": len(regions), "tensors": len(entry.tensors)})
    dims = [t.dim for t in entry.tensors]
    ids = [t.layer_id for t in entry.tensors]
    for name, values in (("dim", dims), ("layer_id", ids)):
        if any(v is None for v in values) and any(v is not None for v in values):
            raise InvalidFieldError(f"state[{e}].{name}", f"every tensor of state entry {e} sets {name}, or none")
    return registration_pb2.StateBuffer(
        kind=entry.kind, type_name=entry.type_name, data_ptrs=[r.ptr for r in regions],
        item_lens=[t.item_len for t in entry.tensors], dim_per_tensors=[d for d in dims if d is not None],
        layer_ids=[i for i in ids if i is not None], data_lens=[r.length for r in regions])


def make_registration(layout: DecodeLayout, endpoint: backends.Endpoint | None,
                      kv: Sequence[KvRegion], *, aux: Sequence[KvRegion] = (),
                      state: Sequence[Sequence[KvRegion]] = ()) -> registration_pb2.KvRegistration:
    """The ``KvRegistration`` of a decode rank: ``layout``, its engine's ``endpoint``, one region per KV entry.

    ``aux`` holds one region per aux buffer and ``state`` one list of regions per state entry
    (one per tensor), in layout order; their lengths bound the prefill's writes.
    ``endpoint`` None leaves the transport unset (examples; a prefill rejects such a peer).
    Raises ``InvalidFieldError`` when the region counts do not match the layout, and
    ``TopologyError`` for an endpoint no backend owns. The layout's values are not judged
    here: negotiation does that, on both sides, with a reason for each rule.
    """
    if len(kv) != len(layout.kv):
        raise InvalidFieldError("kv", f"{len(kv)} KV regions for {len(layout.kv)} layout entries",
                                metadata={"regions": len(kv), "entries": len(layout.kv)})
    if len(aux) != len(layout.aux) or len(state) != len(layout.state):
        raise InvalidFieldError("aux" if len(aux) != len(layout.aux) else "state",
                                f"{len(aux)} aux and {len(state)} state regions for {len(layout.aux)} aux"
                                f" and {len(layout.state)} state entries")
    item_lens = layout.item_lens()
    reg = registration_pb2.KvRegistration(
        version=common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR, minor=layout.minor),
        capabilities=list(layout.capabilities),
        notify_endpoint=common_pb2.Endpoint(host=layout.notify_host, port=layout.notify_port),
        attn_tp=common_pb2.ParallelGroup(size=layout.attn_tp_size, rank=layout.attn_tp_rank),
        dcp=common_pb2.ParallelGroup(size=layout.dcp_size, rank=layout.dcp_rank),
        pp=common_pb2.ParallelGroup(size=layout.pp_size, rank=layout.pp_rank),
        page_size=layout.page_size,
        kv_cache_dtype=layout.kv_cache_dtype,
        attention_kind=layout.attention_kind,
        model_id=layout.model_id,
        kv_item_len=item_lens[0],
        gpu_id=layout.gpu_id,
        kv_buffers=[
            registration_pb2.KvBuffer(ptr=region.ptr, item_len=item_len, layer_id=entry.layer_id,
                                      memory_kind=region.kind, role=int(entry.role),  # type: ignore[arg-type]
                                      length=region.length)
            for entry, region, item_len in zip(layout.kv, kv, item_lens, strict=True)
        ],
        aux_ptrs=[r.ptr for r in aux],
        aux_item_lens=[a.item_len for a in layout.aux],
        aux_data_lens=[r.length for r in aux],
        state_buffers=[_state_buffer(entry, regions, e)
                       for e, (entry, regions) in enumerate(zip(layout.state, state, strict=True))],
        total_kv_heads=layout.total_kv_heads,
    )
    if endpoint is not None:
        backends.set_endpoint(reg, endpoint)
    return reg


__all__ = ["AuxEntry", "DecodeLayout", "KvEntry", "KvRegion", "Region", "StateEntry", "StateTensor",
           "kv_entries", "make_registration"]
