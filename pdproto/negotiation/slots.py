"""Per request: which aux and state items move where, and the decode-side bounds of each.

Negotiation (``pdproto.negotiation.tpmap``) fixed, per decode peer, which aux buffers and state tensors
this prefill rank writes and which bytes of an item. A request then names the items: the
prefill engine's aux slot and state slots (on its last chunk), and the decode's
``TransferInfo.dst_aux_index`` and ``dst_state_indices``. This module pairs the two into
``SlotCopy`` values (an entry, its byte segments, and (source item, destination item)
pairs) that the server turns into executor segments, and refuses, when the decode submits,
an index that is missing, negative, or reaches past the region the decode registered for
that entry (``aux_data_lens``, ``StateBuffer.data_lens``; an unknown length of 0 is not
bounded here, as for KV, and the executor bounds every write again).

* A recurrent entry is addressed by one slot on each side: ``ptr + slot * item_len``.
* A sliding-window or paged entry by pages (the window's pages; for a paged entry such as
  SGLang's DSA index, the pages of the suffix the decode does not hold): the i-th prefill
  page goes to the i-th decode page, and the two lists must be equally long (SGLang trimmed
  the longer list; here it is refused).

A request may name up to 16,384 pages per entry and an entry may hold dozens of tensors,
and the check runs on the server's event loop: items are read as numpy arrays once per
entry, so the work per tensor does not grow with the pages.

Pure: indexes and sizes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError
from pdproto.negotiation.extras import AuxPairing, StatePairing
from pdproto.negotiation.shards import Segment
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2


@dataclass(frozen=True)
class SlotCopy:
    """One aux buffer or state tensor of one request: its items and the bytes of each that move."""

    kind: str
    """``"aux"`` or ``"state"``."""
    src_entry: int
    """Prefill aux buffer or state entry."""
    src_tensor: int
    """Tensor in the prefill state entry (0 for aux)."""
    dst_entry: int
    """Decode aux buffer or state entry."""
    dst_tensor: int
    """Tensor in the decode state entry (0 for aux)."""
    src_item_len: int
    """Bytes per item on the prefill."""
    dst_item_len: int
    """Bytes per item on the decode."""
    segments: tuple[Segment, ...]
    """Byte ranges of an item this prefill rank writes."""
    items: tuple[tuple[int, int], ...]
    """(prefill item, decode item) pairs: one slot, or the window's pages in order."""

    @property
    def nbytes(self) -> int:
        """Payload bytes of the copy."""
        return len(self.items) * sum(s.length for s in self.segments)


def _index(value: int, field: str) -> int:
    if value < 0:
        raise InvalidFieldError(field, f"{field} must be >= 0, got {value}", metadata={"index": value})
    return value


def _items(values: Sequence[int]) -> npt.NDArray[np.int64]:
    """Items as one int64 array, read in one call (a protobuf repeated field costs ~0.1-1 us per element)."""
    return np.asarray(values, dtype=np.int64)


def _check_dst(length: int, item: int, item_len: int, *, kind: str, field: str, entry: int) -> None:
    if length and (item + 1) * item_len > length:
        raise DestinationOutOfBoundsError(
            f"{kind} entry {entry}: item {item} reaches byte {(item + 1) * item_len} of the"
            f" {length}-byte region the decode registered for it",
            metadata={"kind": kind, "field": field, "entry": entry, "index": item,
                      "end": (item + 1) * item_len, "registered": length})


def _pairs(p: StatePairing, src: Sequence[int], dst: Sequence[int], field: str,
           name: str = "") -> tuple[tuple[int, int], ...]:
    """(prefill item, decode item) per index of one entry (type ``name``), checked against its kind."""
    named = f" ({name})" if name else ""
    if p.kind == common_pb2.STATE_KIND_RECURRENT and (len(src) != 1 or len(dst) != 1):
        raise InvalidFieldError(field, f"recurrent state entry {p.dst_entry}{named} takes one slot per request"
                                f" on each side, got {len(src)} and {len(dst)}",
                                metadata={"prefillSlots": len(src), "decodeSlots": len(dst), "typeName": name})
    if len(src) != len(dst):
        raise InvalidFieldError(field, f"paged state entry {p.dst_entry}{named}: {len(src)} prefill pages for"
                                f" {len(dst)} decode pages",
                                metadata={"prefillPages": len(src), "decodePages": len(dst), "typeName": name})
    src_items, dst_items = _items(src), _items(dst)
    if src_items.size and min(src_items.min(), dst_items.min()) < 0:
        at = int(np.flatnonzero((src_items < 0) | (dst_items < 0))[0])
        _index(int(src_items[at]), "state_slots")
        _index(int(dst_items[at]), field)
    return tuple(zip(src_items.tolist(), dst_items.tolist(), strict=True))


def check_destination(aux: Sequence[AuxPairing], state: Sequence[StatePairing],
                      registration: registration_pb2.KvRegistration,
                      transfer: transfer_pb2.TransferInfo) -> None:
    """Refuse a request whose aux index or state slots this prefill rank cannot write (submit time)."""
    if transfer.is_dummy:
        return
    if aux:
        if not transfer.HasField("dst_aux_index"):
            raise InvalidFieldError("transfer.dst_aux_index", "this prefill rank writes the aux slot,"
                                    " but the request names no dst_aux_index")
        slot = _index(transfer.dst_aux_index, "transfer.dst_aux_index")
        lens = registration.aux_data_lens
        for p in aux:
            _check_dst(lens[p.dst_entry] if lens else 0, slot, p.item_len, kind="aux",
                       field="transfer.dst_aux_index", entry=p.dst_entry)
    for sp in state:
        if not sp.writes:
            continue
        field = f"transfer.dst_state_indices[{sp.dst_entry}]"
        if sp.dst_entry >= len(transfer.dst_state_indices):
            raise InvalidFieldError(field, f"this prefill rank writes state entry {sp.dst_entry}, but the"
                                    " request names no slot for it")
        items = transfer.dst_state_indices[sp.dst_entry].indices
        if sp.kind == common_pb2.STATE_KIND_RECURRENT and len(items) != 1:
            raise InvalidFieldError(field, f"recurrent state entry {sp.dst_entry} takes one slot, got {len(items)}")
        buf = registration.state_buffers[sp.dst_entry]
        slots = _items(items)
        if not slots.size:
            continue
        low, high = int(slots.min()), int(slots.max())
        for t in sp.tensors:
            if not t.segments:
                continue
            length = buf.data_lens[t.dst_tensor] if buf.data_lens else 0
            # The smallest item past the region, by _check_dst's rule: (item + 1) * item_len > length.
            # Capped at high + 1, where nothing is past it, so the mask below stays in int64.
            past = min(length // t.dst_item_len, high + 1) if length and t.dst_item_len else high + 1
            if low >= 0 and high < past:
                continue
            # Refuse the first bad item, as a walk item by item would, with the same error.
            item = int(slots[np.flatnonzero((slots < 0) | (slots >= past))[0]])
            _check_dst(length, _index(item, field), t.dst_item_len, kind="state", field=field,
                       entry=sp.dst_entry)


def aux_copies(pairings: Sequence[AuxPairing], *, src_slot: int, dst_slot: int) -> list[SlotCopy]:
    """The copies that move prefill aux slot ``src_slot`` into the decode's ``dst_slot``."""
    items = ((_index(src_slot, "aux_slot"), dst_slot),)  # one object: the buffers move as one row set
    return [SlotCopy("aux", p.src_entry, 0, p.dst_entry, 0, p.item_len, p.item_len,
                     (Segment(0, 0, p.item_len),), items)
            for p in pairings]


def state_copies(pairings: Sequence[StatePairing], *, src_slots: Sequence[Sequence[int]],
                 dst_slots: Sequence[Sequence[int]], names: Sequence[str] = ()) -> list[SlotCopy]:
    """The copies that move every state tensor this prefill rank writes for one request.

    ``src_slots[e]`` and ``dst_slots[e]`` are the items of entry ``e`` on each side; ``names[e]``, when
    given, its type name, for the errors.
    """
    out = []
    for p in pairings:
        if not p.writes:
            continue
        field = f"transfer.dst_state_indices[{p.dst_entry}]"
        if p.src_entry >= len(src_slots):
            raise InvalidFieldError("state_slots", f"the prefill named no slot for state entry {p.src_entry}")
        if p.dst_entry >= len(dst_slots):
            raise InvalidFieldError(field, f"the request names no slot for state entry {p.dst_entry}")
        name = names[p.src_entry] if p.src_entry < len(names) else ""
        items = _pairs(p, src_slots[p.src_entry], dst_slots[p.dst_entry], field, name)
        out += [SlotCopy("state", p.src_entry, t.src_tensor, p.dst_entry, t.dst_tensor, t.src_item_len,
                         t.dst_item_len, t.segments, items)
                for t in p.tensors if t.segments]
    return out


__all__ = ["SlotCopy", "aux_copies", "check_destination", "state_copies"]
