"""Aux and state entries, and MHA head slicing: matching the two sides, and who writes which bytes.

Besides KV rows a decode needs, per request, one aux slot (first output token, logprobs:
SGLang's metadata buffers) and a slot or pages of every state entry (SGLang state
components: Mamba/KDA recurrent and conv state, sliding-window pages). This module decides,
purely from ``PrefillServerInfo`` and ``KvRegistration``:

* **aux**: buffers pair by position; the counts must be equal (SGLang transferred the
  shorter list and misaligned the rest) and, when the decode sends its sizes, so must the
  bytes per slot. A decode that registers no aux buffers (vLLM samples the first token
  itself) gets none.
* **state entries** pair by position with the same count, the same kind and, when both sides
  name it, the same type name (SGLang's ``dsa`` and ``qsa_compressed`` are both paged, with
  other layouts). Inside an entry, tensors pair like KV entries (``pdproto.dcp.layers``): by
  layer id when the prefill sends ids (the decode must too), else by position when both hold the
  same stage (a decode's ids then go unused: SGLang numbers DSA index tensors on a single-stage
  decode, and on a prefill only where its CP ranks hold other layers).
* **per tensor**, how the two sides' items relate (the entry's ``StateTpPolicy``; unset reads
  it from ``dim``): equal state TP sizes copy the item whole; a replicated tensor (``dim`` 0,
  or ``REPLICATED``: the DSA index of an MLA pool) is whole on every rank and moves once; a
  ``REFUSED`` entry moves only between equal TP sizes, where an MLA prefill with CP ``c`` > 1 and TP ``t``
  also feeds a decode of TP ``t*c`` from its CP rank 0 (SGLang's DSpark PD, ``common/conn.py:1376-1384``); otherwise different sizes split it by
  ``pdproto.negotiation.shards`` (heads of a temporal state, the q/k/v channels of a conv state
  per window row, heads per token of a sliding-window page), which needs the split widths of
  both sides.
* **MHA KV rows** with different attention TP sizes are split by head the same way; MLA rows
  are whole on every prefill rank and written by one.

Each mismatch is a ``TopologyError`` with its own reason; malformed registrations (parallel
lists of different lengths) raise ``InvalidFieldError``. Pure, like ``pdproto.negotiation.topology``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproto.dcp.layers import EntryRef, resolve_entries
from pdproto.errors import InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.shards import Layout, Segment, SplitAxis, Whole, assign_writes, head_axis, local_width
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2

MLA_ATTENTION_KINDS = frozenset({common_pb2.ATTENTION_KIND_MLA, common_pb2.ATTENTION_KIND_HYBRID_MLA})
"""Attention kinds whose KV rows are whole on every prefill TP rank (MLA, and Kimi Linear's hybrid)."""

_KINDS = {common_pb2.STATE_KIND_RECURRENT, common_pb2.STATE_KIND_SLIDING_WINDOW, common_pb2.STATE_KIND_PAGED}


@dataclass(frozen=True)
class AuxPairing:
    """One prefill aux buffer paired with one decode aux buffer."""

    src_entry: int
    """Prefill aux buffer index."""
    dst_entry: int
    """Decode aux buffer index."""
    item_len: int
    """Bytes per aux slot on both sides."""

    def to_proto(self) -> server_info_pb2.AuxPairing:
        """The ``AuxPairing`` message."""
        return server_info_pb2.AuxPairing(src_entry=self.src_entry, dst_entry=self.dst_entry,
                                          item_len=self.item_len)


@dataclass(frozen=True)
class TensorMatch:
    """A prefill state tensor matched with a decode tensor, and how their items relate."""

    src_tensor: int
    """Tensor index in the prefill entry."""
    dst_tensor: int
    """Tensor index in the decode entry."""
    src_item_len: int
    """Bytes per slot (or page) on the prefill."""
    dst_item_len: int
    """Bytes per slot (or page) on the decode."""
    layout: Layout
    """``Whole`` when an item copies whole (equal TP sizes, or replicated); else the split."""


@dataclass(frozen=True)
class EntryMatch:
    """A prefill state entry matched with a decode state entry."""

    src_entry: int
    """Prefill state entry index."""
    dst_entry: int
    """Decode state entry index."""
    kind: int
    """``StateKind`` value."""
    tensors: tuple[TensorMatch, ...]
    """Tensor matches in prefill tensor order."""


@dataclass(frozen=True)
class StateTensorPairing:
    """The bytes of one tensor's item that one prefill rank writes into one decode rank."""

    src_tensor: int
    """Tensor index in the prefill entry."""
    dst_tensor: int
    """Tensor index in the decode entry."""
    src_item_len: int
    """Bytes per slot (or page) on the prefill."""
    dst_item_len: int
    """Bytes per slot (or page) on the decode."""
    segments: tuple[Segment, ...]
    """Byte ranges of one item; empty when another sender writes this tensor."""

    def to_proto(self) -> server_info_pb2.StateTensorPairing:
        """The ``StateTensorPairing`` message."""
        return server_info_pb2.StateTensorPairing(
            src_tensor=self.src_tensor, dst_tensor=self.dst_tensor,
            src_item_len=self.src_item_len, dst_item_len=self.dst_item_len,
            segments=[s.to_proto() for s in self.segments])


@dataclass(frozen=True)
class StatePairing:
    """One state entry as one prefill rank writes it into one decode rank."""

    src_entry: int
    """Prefill state entry index."""
    dst_entry: int
    """Decode state entry index."""
    kind: int
    """``StateKind`` value."""
    tensors: tuple[StateTensorPairing, ...]
    """Per tensor, the segments this prefill rank writes."""

    @property
    def writes(self) -> bool:
        """Whether this prefill rank writes any byte of the entry."""
        return any(t.segments for t in self.tensors)

    def to_proto(self) -> server_info_pb2.StatePairing:
        """The ``StatePairing`` message."""
        return server_info_pb2.StatePairing(
            src_entry=self.src_entry, dst_entry=self.dst_entry,
            kind=self.kind,  # type: ignore[arg-type]
            tensors=[t.to_proto() for t in self.tensors])


def _parallel(values: Sequence[int], n: int, field: str) -> None:
    """A list parallel to ``n`` entries must be empty or have ``n`` values."""
    if values and len(values) != n:
        raise InvalidFieldError(field, f"{len(values)} values for {n} entries",
                                metadata={"values": len(values), "entries": n})


def pair_aux(info: server_info_pb2.PrefillServerInfo,
             reg: registration_pb2.KvRegistration) -> tuple[AuxPairing, ...]:
    """Pair aux buffers by position; the counts and (when sent) the slot sizes must agree; none for a decode
    that registers none. A decode that registers aux waits for its row (SGLang gates each request on it), so a
    prefill that publishes none is refused."""
    n = len(reg.aux_ptrs)
    _parallel(reg.aux_item_lens, n, "registration.aux_item_lens")
    _parallel(reg.aux_data_lens, n, "registration.aux_data_lens")
    if n == 0:
        return ()
    if len(info.aux_entries) != n:
        raise TopologyError(
            f"the prefill has {len(info.aux_entries)} aux buffers, the decode registered {n}"
            + (" and would wait for an aux row that never comes (a vLLM prefill writes SGLang's only with"
               " kv_connector_extra_config sglang_bootstrap_port)" if not info.aux_entries
               else " (optional metadata buffers enabled on one side only?)"),
            reason=Reason.TOPOLOGY_AUX_COUNT_MISMATCH,
            metadata={"prefillAuxBuffers": len(info.aux_entries), "decodeAuxBuffers": n})
    out = []
    for i, entry in enumerate(info.aux_entries):
        if entry.item_len == 0:
            raise InvalidFieldError(f"info.aux_entries[{i}].item_len", "item_len must be > 0")
        if reg.aux_item_lens and reg.aux_item_lens[i] != entry.item_len:
            raise TopologyError(
                f"aux buffer {i}: {entry.item_len} bytes per slot on the prefill,"
                f" {reg.aux_item_lens[i]} on the decode",
                reason=Reason.TOPOLOGY_AUX_SIZE_MISMATCH,
                metadata={"auxBuffer": i, "prefillItemLen": entry.item_len,
                          "decodeItemLen": reg.aux_item_lens[i]})
        out.append(AuxPairing(i, i, entry.item_len))
    return tuple(out)


def _check_buffer(buf: registration_pb2.StateBuffer, j: int) -> None:
    """Reject a StateBuffer whose parallel per-tensor lists differ in length."""
    n = len(buf.data_ptrs)
    where = f"registration.state_buffers[{j}]"
    if len(buf.item_lens) != n:
        raise InvalidFieldError(f"{where}.item_lens", f"{len(buf.item_lens)} item lens for {n} tensors",
                                metadata={"values": len(buf.item_lens), "tensors": n})
    _parallel(buf.dim_per_tensors, n, f"{where}.dim_per_tensors")
    _parallel(buf.layer_ids, n, f"{where}.layer_ids")
    _parallel(buf.data_lens, n, f"{where}.data_lens")


def _tensor_pairs(src: server_info_pb2.StateEntryInfo, dst: registration_pb2.StateBuffer,
                  entry: int, *, src_pp: int, dst_pp: int) -> tuple[int, ...]:
    """Decode tensor index of every prefill tensor: by layer id, else by position (same stage)."""
    src_refs = [EntryRef(t.layer_id if t.HasField("layer_id") else None) for t in src.tensors]
    src_has, dst_has = any(r.layer_id is not None for r in src_refs), bool(dst.layer_ids)
    if src_has or (dst_has and src_pp != dst_pp):
        # resolve_entries rejects ids on one side only, partial ids and missing layers.
        dst_refs = [EntryRef(i) for i in dst.layer_ids] or [EntryRef(None)] * len(dst.data_ptrs)
        return resolve_entries(src_refs, dst_refs).dst_indices
    if src_pp != dst_pp:
        # Tensors are grouped by kind inside an entry (all conv, then all temporal), so a
        # stage's position offset, which pairs KV entries, means nothing here.
        raise TopologyError(
            f"state entry {entry}: a prefill stage's tensors cannot be paired by position"
            f" with a decode of PP {dst_pp}; both sides must send state layer ids",
            reason=Reason.TOPOLOGY_STATE_LAYER_IDS_REQUIRED,
            metadata={"stateEntry": entry, "prefillPpSize": src_pp, "decodePpSize": dst_pp})
    if len(src_refs) != len(dst.data_ptrs):
        raise TopologyError(
            f"state entry {entry}: {len(src_refs)} tensors on the prefill,"
            f" {len(dst.data_ptrs)} on the decode",
            reason=Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH,
            metadata={"stateEntry": entry, "prefillTensors": len(src_refs),
                      "decodeTensors": len(dst.data_ptrs)})
    return tuple(range(len(src_refs)))


def _layout(t: server_info_pb2.StateTensorInfo, dst_item: int, dst_dim: int | None, *,
            src_tp: int, dst_tp: int, replicated: bool, where: dict[str, int]) -> Layout:
    """How a prefill tensor's items relate to the decode's (rules in the module docstring)."""
    def reject(reason: Reason, message: str, **meta: object) -> TopologyError:
        return TopologyError(f"state entry {where['stateEntry']} tensor {where['tensor']}: {message}",
                             reason=reason, metadata={**where, **meta})

    if t.item_len == 0:
        raise InvalidFieldError("info.state_entries.tensors.item_len", "item_len must be > 0",
                                metadata=where)
    if src_tp == dst_tp or t.dim == 0 or replicated:
        if t.dim == 0 and dst_dim:
            raise reject(Reason.TOPOLOGY_STATE_SLICE_MISMATCH,
                         f"whole on every prefill rank but split ({dst_dim} per rank) on the decode",
                         decodeDim=dst_dim)
        if dst_dim is not None and t.dim and dst_dim != t.dim:
            raise reject(Reason.TOPOLOGY_STATE_SLICE_MISMATCH,
                         f"equal TP sizes but {t.dim} elements per rank on the prefill, {dst_dim}"
                         " on the decode", prefillDim=t.dim, decodeDim=dst_dim)
        if dst_item != t.item_len:
            raise reject(Reason.TOPOLOGY_STATE_SIZE_MISMATCH,
                         f"{t.item_len} bytes per item on the prefill, {dst_item} on the decode",
                         prefillItemLen=t.item_len, decodeItemLen=dst_item)
        return Whole(t.item_len)
    if dst_dim is None:
        raise reject(Reason.TOPOLOGY_STATE_DIMS_MISSING,
                     f"TP {src_tp} -> {dst_tp} needs the decode's split width (dim_per_tensors)",
                     prefillTpSize=src_tp, decodeTpSize=dst_tp)
    if dst_dim == 0:
        raise reject(Reason.TOPOLOGY_STATE_SLICE_MISMATCH,
                     f"split ({t.dim} per rank) on the prefill but whole on the decode",
                     prefillDim=t.dim)
    outer = t.outer_count or 1
    if t.item_len % (t.dim * outer) or dst_item % (dst_dim * outer):
        raise reject(Reason.TOPOLOGY_STATE_SIZE_MISMATCH,
                     f"items of {t.item_len} / {dst_item} bytes are not {outer} rows of"
                     f" {t.dim} / {dst_dim} whole elements",
                     prefillItemLen=t.item_len, decodeItemLen=dst_item, outerCount=outer)
    src_eb, dst_eb = t.item_len // (t.dim * outer), dst_item // (dst_dim * outer)
    if src_eb != dst_eb:
        raise reject(Reason.TOPOLOGY_STATE_SIZE_MISMATCH,
                     f"{src_eb} bytes per element on the prefill, {dst_eb} on the decode",
                     prefillElementBytes=src_eb, decodeElementBytes=dst_eb)
    groups = tuple(t.shard_groups) or (t.dim * src_tp,)
    axis = SplitAxis(groups=groups, element_bytes=src_eb, outer=outer)
    slice_reason = Reason.TOPOLOGY_STATE_SLICE_MISMATCH
    src_width = local_width(axis, src_tp, reason=slice_reason)
    dst_width = local_width(axis, dst_tp, reason=slice_reason)
    if (src_width, dst_width) != (t.dim, dst_dim):
        raise reject(slice_reason,
                     f"groups {list(groups)} split over TP {src_tp} / {dst_tp} give {src_width} /"
                     f" {dst_width} elements per rank, but the sides hold {t.dim} / {dst_dim}",
                     prefillDim=t.dim, decodeDim=dst_dim, prefillTpSize=src_tp,
                     decodeTpSize=dst_tp)
    return axis


def match_state(info: server_info_pb2.PrefillServerInfo, reg: registration_pb2.KvRegistration, *,
                src_tp: int, dst_tp: int) -> tuple[EntryMatch, ...]:
    """Match every prefill state entry and tensor with the decode's (module docstring rules).

    ``src_tp`` is the prefill's state TP size, ``dst_tp`` the decode's attention TP size.
    """
    for j, buf in enumerate(reg.state_buffers):
        _check_buffer(buf, j)
    if not info.state_entries:
        return ()
    entries = _entry_pairs(info, reg)
    src_pp, dst_pp = info.pp.size or 1, reg.pp.size or 1
    # An MLA prefill's CP ranks count as TP ranks for a REFUSED entry (module docstring).
    cp = info.attn_cp.size or 1
    world = src_tp * cp if cp > 1 and info.attention_kind in MLA_ATTENTION_KINDS and src_tp * cp == dst_tp else src_tp
    for e, d in entries:
        _check_kinds(info.state_entries[e], reg.state_buffers[d], e, src_tp=world, dst_tp=dst_tp)  # before any size
    out = []
    for e, d in entries:
        src, dst = info.state_entries[e], reg.state_buffers[d]
        pairs = _tensor_pairs(src, dst, e, src_pp=src_pp, dst_pp=dst_pp)
        tensors = []
        for i, (t, j) in enumerate(zip(src.tensors, pairs, strict=True)):
            dst_dim = dst.dim_per_tensors[j] if dst.dim_per_tensors else None
            layout = _layout(t, dst.item_lens[j], dst_dim, src_tp=src_tp, dst_tp=dst_tp,
                             replicated=src.tp_policy == common_pb2.STATE_TP_POLICY_REPLICATED,
                             where={"stateEntry": e, "tensor": i, "decodeTensor": j})
            tensors.append(TensorMatch(i, j, t.item_len, dst.item_lens[j], layout))
        out.append(EntryMatch(e, d, src.kind, tuple(tensors)))
    return tuple(out)


def _entry_pairs(info: server_info_pb2.PrefillServerInfo, reg: registration_pb2.KvRegistration) -> list[tuple[int, int]]:
    """(prefill, decode) state entries: by position, as many on both sides.

    A prefill PP stage may have fewer: SGLang leaves out a component the stage holds no layer of
    (DeepSeek-V4's ``c128_state`` on a stage without a ratio-128 layer). Then each of its entries pairs
    with the next decode entry of its type name, in order, and every decode entry left over must name
    its layers, none of them the stage's (another stage writes it).
    """
    n, m = len(info.state_entries), len(reg.state_buffers)
    if n == m:
        return [(e, e) for e in range(n)]
    pairs: list[tuple[int, int]] = []
    if n < m and (info.pp.size or 1) > 1:
        names = [b.type_name for b in reg.state_buffers]
        d = 0
        for e, src in enumerate(info.state_entries):
            while d < m and not (src.type_name and names[d] == src.type_name):
                d += 1
            if d == m:
                break
            pairs.append((e, d))
            d += 1
        held = {t.layer_id for x in info.state_entries for t in x.tensors if t.HasField("layer_id")}
        held |= {k.layer_id for k in info.kv_entries if k.HasField("layer_id")}
        left = [reg.state_buffers[j] for j in set(range(m)) - {d for _, d in pairs}]
        if len(pairs) == n and all(b.layer_ids and not held & set(b.layer_ids) for b in left):
            return pairs
    raise TopologyError(
        f"the prefill has {n} state entries, the decode registered {m}", reason=Reason.TOPOLOGY_STATE_COUNT_MISMATCH,
        metadata={"prefillStateEntries": n, "decodeStateEntries": m})


def _check_kinds(src: server_info_pb2.StateEntryInfo, dst: registration_pb2.StateBuffer, e: int, *,
                 src_tp: int, dst_tp: int) -> None:
    """Refuse an entry this negotiation cannot move, or one the two sides describe as different kinds."""
    named, meta = f" ({src.type_name})" if src.type_name else "", {"stateEntry": e, "typeName": src.type_name}
    if src.kind not in _KINDS:
        raise TopologyError(f"state entry {e}{named} has kind {src.kind}, which this negotiation cannot move",
                            reason=Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED, metadata={**meta, "kind": src.kind})
    pk, dk = enum_name(common_pb2.StateKind, src.kind), enum_name(common_pb2.StateKind, dst.kind or src.kind)
    dn = dst.type_name or src.type_name
    if pk != dk or (src.type_name and src.type_name != dn):  # a name only one side sends reads as agreeing
        raise TopologyError(f"state entry {e} is {pk} {src.type_name!r} on the prefill and {dk} {dn!r} on the decode",
                            reason=Reason.TOPOLOGY_STATE_KIND_MISMATCH,
                            metadata={**meta, "prefillKind": pk, "decodeKind": dk, "decodeTypeName": dn})
    if src.tp_policy == common_pb2.STATE_TP_POLICY_REFUSED and src_tp != dst_tp:
        raise TopologyError(
            f"state entry {e}{named} moves only between equal TP sizes, but the prefill's state TP is"
            f" {src_tp} and the decode's TP {dst_tp}", reason=Reason.TOPOLOGY_STATE_TP_REFUSED,
            metadata={**meta, "prefillTpSize": src_tp, "decodeTpSize": dst_tp})


def enum_name(enum_type: object, value: int) -> str:
    """Name of a proto enum value, or the number when unknown (newer peer)."""
    try:
        return str(enum_type.Name(value))  # type: ignore[attr-defined]
    except ValueError:
        return str(value)


def state_writes(matches: Sequence[EntryMatch], *, src_tp: int, dst_tp: int, dst_rank: int,
                 senders: Sequence[int]) -> dict[int, tuple[StatePairing, ...]]:
    """Per prefill TP rank in ``senders``, the state bytes it writes into decode rank ``dst_rank``.

    ``senders`` are the decode rank's prefill TP ranks in order (``pdproto.negotiation.senders``). With
    equal TP sizes ``match_state`` made every tensor ``Whole``, so the one sender writes whole
    items; otherwise every destination byte is written by exactly one sender
    (``pdproto.negotiation.shards.assign_writes``).
    """
    plans: dict[int, list[StatePairing]] = {s: [] for s in senders}
    for m in matches:
        per_sender: dict[int, list[StateTensorPairing]] = {s: [] for s in senders}
        for t in m.tensors:
            writes = assign_writes(t.layout, src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank,
                                   senders=senders, reason=Reason.TOPOLOGY_STATE_SLICE_MISMATCH)
            for s in senders:
                per_sender[s].append(StateTensorPairing(t.src_tensor, t.dst_tensor, t.src_item_len,
                                                        t.dst_item_len, writes[s]))
        for s in senders:
            plans[s].append(StatePairing(m.src_entry, m.dst_entry, m.kind, tuple(per_sender[s])))
    return {s: tuple(p) for s, p in plans.items()}


def kv_row_writes(*, mla: bool, total_heads: int, src_row_bytes: int, dst_row_bytes: int,
                  src_tp: int, dst_tp: int, dst_rank: int,
                  senders: Sequence[int]) -> dict[int, tuple[Segment, ...]]:
    """Per prefill TP rank in ``senders``, the part of each KV token row it writes.

    MLA rows are whole on every prefill rank: the first sender writes them (``tpmap.plan_tp`` hands the
    pairings out in turn where the decode asked for ``SPLIT_KV``). MHA rows with
    equal TP sizes copy whole; with different sizes each sender writes the heads the decode
    rank holds of its own, and ``total_heads`` (the model's KV heads) must be known. MHA rows
    that hold every head on each prefill rank (SGLang's CP-TP group sharing, attention TP 1
    presented as TP cp) are whole too: the first sender writes the decode rank's heads.
    """
    if not mla and src_tp > 1 and senders and every_head(total_heads, src_row_bytes, dst_row_bytes, src_tp, dst_tp):
        cut = assign_writes(head_axis(total_heads, src_row_bytes, 1), src_tp=1, dst_tp=dst_tp, dst_rank=dst_rank,
                            senders=[0])[0]
        return {s: cut if s == senders[0] else () for s in senders}
    if mla or src_tp == dst_tp:
        if src_row_bytes != dst_row_bytes:
            raise TopologyError(f"token rows of {src_row_bytes} and {dst_row_bytes} bytes",
                                reason=Reason.TOPOLOGY_ROW_SIZE_MISMATCH,
                                metadata={"prefillTokenBytes": src_row_bytes,
                                          "decodeTokenBytes": dst_row_bytes})
        # Every sender holds the same rows: the first writes them, once.
        return assign_writes(Whole(src_row_bytes), src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank,
                             senders=senders)
    reason = Reason.TOPOLOGY_KV_HEADS_MISMATCH
    if total_heads < 1:
        raise TopologyError(f"MHA TP {src_tp} -> {dst_tp} needs the model's KV head count",
                            reason=reason, metadata={"prefillTpSize": src_tp, "decodeTpSize": dst_tp})
    src_axis = head_axis(total_heads, src_row_bytes, src_tp)
    dst_axis = head_axis(total_heads, dst_row_bytes, dst_tp)
    if src_axis.element_bytes != dst_axis.element_bytes:
        raise TopologyError(
            f"{src_axis.element_bytes} bytes per head on the prefill, {dst_axis.element_bytes}"
            " on the decode", reason=reason,
            metadata={"prefillHeadBytes": src_axis.element_bytes,
                      "decodeHeadBytes": dst_axis.element_bytes, "totalKvHeads": total_heads})
    return assign_writes(src_axis, src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank,
                         senders=senders, reason=reason)


def every_head(total_heads: int, src_row_bytes: int, dst_row_bytes: int, src_tp: int, dst_tp: int) -> bool:
    """Whether a prefill row holds all ``total_heads`` KV heads, of the decode's head size, although its TP
    size would give it fewer."""
    if total_heads < 1 or any(total_heads % tp and tp % total_heads for tp in (src_tp, dst_tp)):
        return False  # no even split: head_axis names the error
    dst_heads = max(1, total_heads // dst_tp)
    return total_heads > max(1, total_heads // src_tp) and src_row_bytes * dst_heads == dst_row_bytes * total_heads


__all__ = ["MLA_ATTENTION_KINDS", "AuxPairing", "EntryMatch", "StatePairing", "StateTensorPairing", "TensorMatch",
           "enum_name", "every_head", "kv_row_writes", "match_state", "pair_aux", "state_writes"]
