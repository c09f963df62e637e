"""Per request: the byte extents that move a request's aux slot and state slots, bounds-checked.

Negotiation (``pdproto.extras``) fixed, per decode peer, which aux buffers and state tensors
pair up and which bytes of an item this prefill rank writes. A request then names the items:
the prefill engine's aux slot and state slots (on its last chunk), and the decode's
``TransferInfo.dst_aux_index`` and ``dst_state_indices``. This module turns the two into
``Extent`` values (local source address, peer destination address, length) and refuses, before
anything moves, an index that is missing, negative, or reaches past the region the decode
registered for that entry (``aux_data_lens``, ``StateBuffer.data_lens``; an unknown length of 0
is not bounded, as for KV) or past the prefill's own buffer.

* A recurrent entry is addressed by one slot on each side: ``ptr + slot * item_len``.
* A sliding-window entry by pages: the i-th prefill page goes to the i-th decode page, and the
  two lists must be equally long (SGLang trimmed the longer list; here it is refused).

Pure: addresses are numbers; the executor moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError, Reason
from pdproto.extras import AuxPairing, StatePairing
from pdproto.v1 import common_pb2, registration_pb2


@dataclass(frozen=True)
class Region:
    """A registered buffer: its base address and length in bytes (0: unknown)."""

    addr: int
    """Base address."""
    length: int
    """Bytes; 0 means unknown (not bounded)."""


@dataclass(frozen=True)
class Extent:
    """One contiguous copy: local source address, peer destination address, bytes."""

    src: int
    """Local address of the first source byte."""
    dst: int
    """Peer address of the first destination byte."""
    length: int
    """Bytes."""


def _merge(extents: list[Extent]) -> list[Extent]:
    out: list[Extent] = []
    for e in extents:
        if out and out[-1].src + out[-1].length == e.src and out[-1].dst + out[-1].length == e.dst:
            out[-1] = Extent(out[-1].src, out[-1].dst, out[-1].length + e.length)
        else:
            out.append(e)
    return out


def _check_dst(region: Region, offset: int, length: int, *, kind: str, field: str,
               index: int, entry: int) -> None:
    if region.length and offset + length > region.length:
        raise DestinationOutOfBoundsError(
            f"{kind} entry {entry}: index {index} reaches byte {offset + length} of a"
            f" {region.length}-byte region the decode registered",
            reason=Reason.DESTINATION_OUT_OF_BOUNDS,
            metadata={"kind": kind, "field": field, "entry": entry, "index": index,
                      "end": offset + length, "registered": region.length})


def _check_src(region: Region, offset: int, length: int, *, kind: str, index: int, entry: int) -> None:
    if region.length and offset + length > region.length:
        raise InvalidFieldError(
            f"{kind}_indices", f"prefill {kind} entry {entry}: slot {index} is outside its"
            f" {region.length}-byte buffer", metadata={"entry": entry, "index": index})


def _index(value: int, field: str) -> int:
    if value < 0:
        raise InvalidFieldError(field, f"{field} must be >= 0, got {value}", metadata={"index": value})
    return value


def aux_extents(pairings: Sequence[AuxPairing], src: Sequence[Region],
                registration: registration_pb2.KvRegistration, *, src_index: int,
                dst_index: int | None) -> list[Extent]:
    """The extents that copy prefill aux slot ``src_index`` into the decode's ``dst_index``."""
    if not pairings:
        return []
    if dst_index is None:
        raise InvalidFieldError("transfer.dst_aux_index", "this prefill rank writes the aux slot,"
                                " but the request names no dst_aux_index")
    _index(src_index, "aux_index")
    _index(dst_index, "transfer.dst_aux_index")
    lens = registration.aux_data_lens
    out = []
    for p in pairings:
        dst = Region(registration.aux_ptrs[p.dst_entry], lens[p.dst_entry] if lens else 0)
        _check_dst(dst, dst_index * p.item_len, p.item_len, kind="aux",
                   field="transfer.dst_aux_index", index=dst_index, entry=p.dst_entry)
        _check_src(src[p.src_entry], src_index * p.item_len, p.item_len, kind="aux",
                   index=src_index, entry=p.src_entry)
        out.append(Extent(src[p.src_entry].addr + src_index * p.item_len,
                          dst.addr + dst_index * p.item_len, p.item_len))
    return out


def _item_pairs(p: StatePairing, src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(prefill item, decode item) per index of one entry, checked against its kind."""
    field = f"transfer.dst_state_indices[{p.dst_entry}]"
    if p.kind == common_pb2.STATE_KIND_RECURRENT and (len(src) != 1 or len(dst) != 1):
        raise InvalidFieldError(field, f"recurrent state entry {p.dst_entry} takes one slot per"
                                f" request on each side, got {len(src)} and {len(dst)}",
                                metadata={"prefillSlots": len(src), "decodeSlots": len(dst)})
    if len(src) != len(dst):
        raise InvalidFieldError(field, f"sliding-window entry {p.dst_entry}: {len(src)} prefill"
                                f" pages for {len(dst)} decode pages",
                                metadata={"prefillPages": len(src), "decodePages": len(dst)})
    return [(_index(s, "state_indices"), _index(d, field)) for s, d in zip(src, dst, strict=True)]


def state_extents(pairings: Sequence[StatePairing], src: Sequence[Sequence[Region]],
                  registration: registration_pb2.KvRegistration, *,
                  src_indices: Sequence[Sequence[int]],
                  dst_indices: Sequence[Sequence[int]]) -> list[Extent]:
    """The extents that copy every state entry this prefill rank writes for one request.

    ``src[e][t]`` is prefill state entry ``e``'s tensor ``t``; ``src_indices[e]`` and
    ``dst_indices[e]`` are the items of entry ``e`` on each side.
    """
    out: list[Extent] = []
    for p in pairings:
        if not p.writes:
            continue
        if p.src_entry >= len(src_indices) or p.dst_entry >= len(dst_indices):
            raise InvalidFieldError(
                "transfer.dst_state_indices" if p.dst_entry >= len(dst_indices) else "state_indices",
                f"state entry {p.src_entry} -> {p.dst_entry} has no slot on the"
                f" {'decode' if p.dst_entry >= len(dst_indices) else 'prefill'} side",
                metadata={"prefillEntries": len(src_indices), "decodeEntries": len(dst_indices)})
        items = _item_pairs(p, src_indices[p.src_entry], dst_indices[p.dst_entry])
        buf = registration.state_buffers[p.dst_entry]
        extents = []
        for t in p.tensors:
            if not t.segments:
                continue
            s_region = src[p.src_entry][t.src_tensor]
            d_region = Region(buf.data_ptrs[t.dst_tensor],
                              buf.data_lens[t.dst_tensor] if buf.data_lens else 0)
            for s_item, d_item in items:
                s_base, d_base = s_item * t.src_item_len, d_item * t.dst_item_len
                _check_src(s_region, s_base, t.src_item_len, kind="state", index=s_item,
                           entry=p.src_entry)
                _check_dst(d_region, d_base, t.dst_item_len, kind="state",
                           field=f"transfer.dst_state_indices[{p.dst_entry}]", index=d_item,
                           entry=p.dst_entry)
                extents += [Extent(s_region.addr + s_base + g.src_offset,
                                   d_region.addr + d_base + g.dst_offset, g.length)
                            for g in t.segments]
        out += _merge(extents)
    return out


__all__ = ["Extent", "Region", "aux_extents", "state_extents"]
