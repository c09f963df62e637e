"""Per-entry KV and state buffers <-> SGLang's parallel lists (shared by both backends).

SGLang sends one list per attribute (kv ptrs, item lens, layer ids, memory kinds;
state ptrs, item lens, dims, layer ids, data lens). pdproto nests them per entry.
Parallel KV lists must agree in length; the state lists may legitimately differ
in outer length, which ``LegacyFraming.list_lengths`` records so rebuilds are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdproto.errors import Reason
from pdproto.legacy._codec import U32_MAX, FrameReader, FrameWriter, fail
from pdproto.v1 import (
    MEMORY_KIND_DRAM,
    MEMORY_KIND_UNSPECIFIED,
    MEMORY_KIND_VRAM,
    KvBuffer,
    KvRegistration,
    MemoryKind,
    StateBuffer,
)

MEMORY_KINDS: Mapping[str, MemoryKind.ValueType] = {"VRAM": MEMORY_KIND_VRAM, "DRAM": MEMORY_KIND_DRAM}
"""NIXL memory kind names as SGLang joins them with commas (nixl/conn.py KV_MEM_KINDS)."""
_KIND_NAMES = {v: k for k, v in MEMORY_KINDS.items()}


@dataclass(frozen=True)
class KvSlots:
    """Where a backend puts the per-entry KV lists (parser slot numbers; None if not sent)."""

    ptrs: int
    item_lens: int
    layer_ids: int
    mem_kinds: int | None = None


@dataclass(frozen=True)
class StateSlot:
    """One state list-of-lists slot: its number, StateBuffer attribute, PIL element, SGLang name."""

    slot: int
    attr: str
    fmt: str
    name: str


def _mismatch(r: FrameReader, slot: int, name: str, found: int, n: int) -> Exception:
    return fail(r.what, slot, name, Reason.LEGACY_LIST_LENGTH_MISMATCH,
                f"has {found} entries but the kv ptrs list has {n}; SGLang pairs them by index",
                r.offset)


def read_kv_buffers(r: FrameReader, slots: KvSlots, kv_item_len: int) -> list[KvBuffer]:
    """Zip the KV lists into KvBuffer entries, checking their lengths agree."""
    ptrs = r.array(slots.ptrs, "dst_kv_ptrs", "Q")
    n = len(ptrs)
    layer_ids = r.array(slots.layer_ids, "dst_kv_layer_ids", "I")
    if layer_ids and len(layer_ids) != n:
        raise _mismatch(r, slots.layer_ids, "dst_kv_layer_ids", len(layer_ids), n)
    raw_lens = r.raw(slots.item_lens)
    if raw_lens is None or (raw_lens == b"" and n):
        if raw_lens == b"":
            r.empty.append(slots.item_lens)
        if n:
            r.assumed.append("dst_kv_item_lens absent: assumed dst_kv_item_len for every KV entry")
        item_lens = [kv_item_len] * n
    else:
        item_lens = r.array(slots.item_lens, "dst_kv_item_lens", "Q")
        if len(item_lens) != n:
            raise _mismatch(r, slots.item_lens, "dst_kv_item_lens", len(item_lens), n)
    kinds = [MEMORY_KIND_UNSPECIFIED] * n
    if slots.mem_kinds is not None:
        text = r.text(slots.mem_kinds, "dst_kv_mem_kinds") if r.has(slots.mem_kinds) else ""
        if text:
            names = text.split(",")
            if len(names) != n:
                raise _mismatch(r, slots.mem_kinds, "dst_kv_mem_kinds", len(names), n)
            unknown = [x for x in names if x not in MEMORY_KINDS]
            if unknown:
                raise fail(r.what, slots.mem_kinds, "dst_kv_mem_kinds", Reason.LEGACY_BAD_VALUE,
                           f"unknown memory kind {unknown[0]!r}; expected one of "
                           f"{sorted(MEMORY_KINDS)}", r.offset)
            kinds = [MEMORY_KINDS[x] for x in names]
        elif n:
            r.assumed.append("dst_kv_mem_kinds absent: SGLang assumes VRAM for every KV entry")
    out = []
    for i, ptr in enumerate(ptrs):
        buf = KvBuffer(ptr=ptr, item_len=item_lens[i], memory_kind=kinds[i])
        if layer_ids:
            buf.layer_id = layer_ids[i]
        out.append(buf)
    return out


def write_kv_buffers(w: FrameWriter, slots: KvSlots, msg: KvRegistration) -> None:
    """Split KvBuffer entries back into SGLang's parallel lists."""
    bufs = msg.kv_buffers
    w.array(slots.ptrs, "dst_kv_ptrs", [b.ptr for b in bufs], "Q")
    with_ids = [b.HasField("layer_id") for b in bufs]
    if any(with_ids) and not all(with_ids):
        raise w.unrepresentable(slots.layer_ids, "kv_buffers[].layer_id",
                                "some entries have a layer id and others do not; SGLang "
                                "sends one list for all entries or none")
    w.array(slots.layer_ids, "dst_kv_layer_ids", [b.layer_id for b in bufs] if all(
        with_ids) else [], "I")
    lens = [b.item_len for b in bufs]
    fallback = all(x == msg.kv_item_len for x in lens)
    if w.carries(slots.item_lens) or not bufs:
        w.array(slots.item_lens, "dst_kv_item_lens", lens, "Q")
    else:
        w.raw(slots.item_lens, "kv_buffers[].item_len", b"", default=fallback)
    if slots.mem_kinds is not None:
        kinds = [b.memory_kind for b in bufs]
        if all(k == MEMORY_KIND_UNSPECIFIED for k in kinds):
            text = ""
        elif all(k in _KIND_NAMES for k in kinds):
            text = ",".join(_KIND_NAMES[k] for k in kinds)
        else:
            raise w.unrepresentable(slots.mem_kinds, "kv_buffers[].memory_kind",
                                    "memory kinds must be set on every entry or none")
        w.text(slots.mem_kinds, "dst_kv_mem_kinds", text, default=not text)


def read_state_buffers(r: FrameReader, slots: Sequence[StateSlot]) -> list[StateBuffer]:
    """Merge SGLang's state lists-of-lists into StateBuffer entries, noting short lists."""
    lists = {s.slot: r.lists(s.slot, s.name, s.fmt) for s in slots if r.has(s.slot)}
    n = max((len(v) for v in lists.values()), default=0)
    out = [StateBuffer() for _ in range(n)]
    for s in slots:
        values = lists.get(s.slot)
        if values is None:
            continue
        if len(values) < n:
            r.list_lengths[s.slot] = len(values)
        for buf, inner in zip(out, values):
            getattr(buf, s.attr).extend(inner)
    return out


def write_state_buffers(w: FrameWriter, slots: Sequence[StateSlot],
                        bufs: Sequence[StateBuffer]) -> None:
    """Split StateBuffer entries back into SGLang's lists, honouring recorded outer lengths."""
    n = len(bufs)
    longest = 0
    for s in slots:
        length = w.list_lengths.get(s.slot, n) if w.has(s.slot) else 0
        if length > n:
            raise w.unrepresentable(s.slot, "legacy.list_lengths",
                                    f"records {length} lists but there are {n} state buffers")
        tail = [i for i in range(length, n) if getattr(bufs[i], s.attr)]
        if tail:
            raise w.unrepresentable(s.slot, f"state_buffers[{tail[0]}].{s.attr}",
                                    f"has values but the legacy list stops after {length} "
                                    "entries")
        w.lists(s.slot, s.name, [list(getattr(b, s.attr)) for b in bufs[:length]], s.fmt)
        longest = max(longest, length)
    if longest != n:
        raise w.unrepresentable(None, "state_buffers",
                                f"{n} entries but no legacy state list is that long")


def read_dcp(r: FrameReader, msg: KvRegistration, size_slot: int, rank_slot: int) -> None:
    """DCP size and rank (``else 1`` / ``else 0``); unset dcp when neither slot has a value."""
    size = r.opt_num(size_slot, "dst_dcp_size", hi=U32_MAX, record=True)
    rank = r.opt_num(rank_slot, "dst_dcp_rank", hi=U32_MAX, record=True)
    if size is None and rank is None:
        r.assumed.append("DCP fields absent or empty: assumed size 1, rank 0")
        return
    msg.dcp.size = size or 0  # 0 reads as "not sent" = 1, exactly like SGLang's default
    msg.dcp.rank = rank or 0
    if size is None:
        r.assumed.append("dst_dcp_size absent: assumed 1")


def write_dcp(w: FrameWriter, msg: KvRegistration, size_slot: int, rank_slot: int) -> None:
    """Inverse of :func:`read_dcp`; an unset dcp is sent as 1 / 0 as SGLang's builder does."""
    if msg.HasField("dcp"):
        if not (w.carries(size_slot) or w.carries(rank_slot)):
            raise w.unrepresentable(size_slot, "dcp",
                                    "dcp is set but both DCP slots are absent or recorded empty")
        w.num(size_slot, "dst_dcp_size", msg.dcp.size, default=msg.dcp.size == 0)
        w.num(rank_slot, "dst_dcp_rank", msg.dcp.rank, default=msg.dcp.rank == 0)
    else:
        w.num(size_slot, "dst_dcp_size", 1, default=True)
        w.num(rank_slot, "dst_dcp_rank", 0, default=True)


def read_staging(r: FrameReader, msg: KvRegistration, base: int, slot_ids: int | None) -> None:
    """Staging base (``Q`` or empty) at ``base``, size (``A`` or empty) at ``base + 1`` and,
    on Mooncake, slot layer ids (``Q*``) at ``slot_ids`` (``StagingRegisterInfo.from_zmq_fields``).
    """
    slots = (base, base + 1) + ((slot_ids,) if slot_ids is not None else ())
    if all(r.blank(s) for s in slots):
        return  # SGLang: base 0 and size 0 means "no staging" (None)
    st = msg.staging
    if r.blank(base):
        r.empty.append(base)
    else:
        st.base_ptr = r.scalar(base, "staging_base_ptr", "@Q")
    st.total_size = r.opt_num(base + 1, "staging_total_size", record=True) or 0
    if slot_ids is not None:
        st.slot_layer_ids.extend(r.array(slot_ids, "staging slot_layer_ids", "Q"))
        if not r.has(slot_ids):
            r.assumed.append("staging slot_layer_ids absent: assumed [] (falls back to KV layer ids)")


def write_staging(w: FrameWriter, msg: KvRegistration, base: int, slot_ids: int | None) -> None:
    """Inverse of :func:`read_staging`; an unset staging region is sent as empty frames."""
    st = msg.staging
    ids = list(st.slot_layer_ids) if slot_ids is not None else []
    if not msg.HasField("staging"):
        w.raw(base, "staging_base_ptr", b"", default=True)
        w.raw(base + 1, "staging_total_size", b"", default=True)
    else:
        if not (w.carries(base) or w.carries(base + 1) or (ids and w.has(slot_ids or 0))):
            raise w.unrepresentable(base, "staging",
                                    "staging is set but no staging slot would carry a value")
        w.scalar(base, "staging_base_ptr", st.base_ptr, "@Q", default=st.base_ptr == 0)
        w.num(base + 1, "staging_total_size", st.total_size, default=st.total_size == 0)
    if slot_ids is not None:
        w.array(slot_ids, "staging slot_layer_ids", ids, "Q")
