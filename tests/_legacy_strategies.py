"""Hypothesis strategies for SGLang 0.5.23 legacy messages, shared by the legacy tests.

Each strategy draws a message in the form the parser produces (a message plus the
LegacyFraming that a short or sparse frame list needs), including older senders'
shorter layouts, recorded empty slots and state lists of different outer lengths.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import strategies as st

from pdproto.legacy._common import KVPOLL_TO_STATE
from pdproto.v1 import (
    MEMORY_KIND_DRAM,
    MEMORY_KIND_VRAM,
    AbortAck,
    AbortNotification,
    KvRegistration,
    LegacyFraming,
    TransferInfo,
)

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
ASCII = st.text(st.characters(max_codepoint=127), max_size=12)
UTF8 = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
SMALL = {"max_size": 4}
# The legacy suite's whole budget is ~20 s on a shared 2-core machine; raise for soak runs.
EXAMPLES = int(os.environ.get("LEGACY_EXAMPLES", "40"))


def set_framing(msg: Any, count: int, full: int, empties: set[int],
                 lengths: dict[int, int] | None = None) -> None:
    framing = LegacyFraming(frame_count=count if count < full else 0,
                            empty_slots=sorted(empties))
    for slot, n in (lengths or {}).items():
        framing.list_lengths[slot] = n
    if framing.frame_count or framing.empty_slots or framing.list_lengths:
        msg.legacy.CopyFrom(framing)


# Registration layouts, by parser slot (inventory 1.2 and 1.3).
MC_REG = {"full": 20, "min": 10, "item_lens": 19, "layer_ids": 12, "kinds": None,
          "state": {6: "data_ptrs", 10: "item_lens", 11: "dim_per_tensors", 13: "layer_ids"},
          "staging": 14, "slot_ids": 18, "num_slots": None, "dcp": 16}
NX_REG = {"full": 24, "min": 12, "item_lens": 18, "layer_ids": 20, "kinds": 17,
          "state": {7: "data_ptrs", 12: "item_lens", 13: "dim_per_tensors", 19: "layer_ids",
                    23: "data_lens"},
          "staging": 14, "slot_ids": None, "num_slots": 16, "dcp": 21}
_STATE_ELEM = {"data_ptrs": U64, "item_lens": U32, "dim_per_tensors": U32, "layer_ids": U32,
               "data_lens": U64}


@st.composite
def registrations(draw: st.DrawFn, layout: dict[str, Any]) -> KvRegistration:
    """A KvRegistration exactly as the parser would produce it for ``layout``."""
    full = layout["full"]
    count = draw(st.integers(layout["min"], full))
    has = lambda slot: slot < count  # noqa: E731
    empties: set[int] = set()
    msg = KvRegistration(kv_item_len=draw(U64))
    msg.notify_endpoint.host = draw(ASCII)
    msg.notify_endpoint.port = draw(U32)
    if layout is MC_REG:
        msg.mooncake.session_id = draw(ASCII)
    else:
        msg.nixl.agent_name = draw(ASCII)
        msg.nixl.agent_metadata = draw(st.binary(max_size=16))
        msg.gpu_id = draw(U32)
    msg.attn_tp.size, msg.attn_tp.rank = draw(U32), draw(U32)
    msg.aux_ptrs.extend(draw(st.lists(U64, **SMALL)))
    # KV entries: parallel lists of one length, layer ids all-or-none.
    n = draw(st.integers(0, 4))
    ids = draw(st.lists(U32, min_size=n, max_size=n)) if has(layout["layer_ids"]) and \
        draw(st.booleans()) else None
    lens_slot = layout["item_lens"]
    lens_carried = has(lens_slot) and not (n and draw(st.booleans()))
    if has(lens_slot) and not lens_carried:
        empties.add(lens_slot)
    kinds = None
    if layout["kinds"] is not None and has(layout["kinds"]) and n and draw(st.booleans()):
        kinds = draw(st.lists(st.sampled_from([MEMORY_KIND_VRAM, MEMORY_KIND_DRAM]),
                              min_size=n, max_size=n))
    for i in range(n):
        buf = msg.kv_buffers.add(ptr=draw(U64),
                                 item_len=draw(U64) if lens_carried else msg.kv_item_len)
        if ids is not None:
            buf.layer_id = ids[i]
        if kinds is not None:
            buf.memory_kind = kinds[i]
    # State lists: each present slot has its own outer length.
    present = {s: a for s, a in layout["state"].items() if has(s)}
    outer = {s: draw(st.integers(0, 3)) for s in present}
    total = max(outer.values(), default=0)
    for i in range(total):
        buf = msg.state_buffers.add()
        for s, attr in present.items():
            if i < outer[s]:
                getattr(buf, attr).extend(draw(st.lists(_STATE_ELEM[attr], max_size=3)))
    lengths = {s: n_s for s, n_s in outer.items() if n_s < total}
    # Staging: base (Q or empty) and size (A or empty), Mooncake slot ids.
    base = layout["staging"]
    if has(base) and draw(st.booleans()):
        base_empty = draw(st.booleans())
        size_empty = has(base + 1) and draw(st.booleans())
        slot_ids = layout["slot_ids"]
        ids_list = draw(st.lists(U64, **SMALL)) if slot_ids is not None and has(slot_ids) else []
        if not (base_empty and (size_empty or not has(base + 1)) and not ids_list):
            msg.staging.base_ptr = 0 if base_empty else draw(U64)
            msg.staging.total_size = draw(U64) if has(base + 1) and not size_empty else 0
            msg.staging.slot_layer_ids.extend(ids_list)
            empties |= {base} if base_empty else set()
            empties |= {base + 1} if size_empty else set()
    if layout["num_slots"] is not None and has(layout["num_slots"]) and draw(st.booleans()):
        msg.num_slots = draw(U32)
    # DCP: unset only when both slots are absent or recorded empty.
    size_slot, rank_slot = layout["dcp"], layout["dcp"] + 1
    dcp_empty = {s for s in (size_slot, rank_slot) if has(s) and draw(st.booleans())}
    carried = [s for s in (size_slot, rank_slot) if has(s) and s not in dcp_empty]
    if carried:
        msg.dcp.size = draw(U32) if size_slot in carried else 0
        msg.dcp.rank = draw(U32) if rank_slot in carried else 0
    empties |= dcp_empty
    set_framing(msg, count, full, empties, lengths)
    return msg



def _transfer_common(draw: st.DrawFn, with_state: bool) -> TransferInfo:
    msg = TransferInfo(room=draw(U64), peer_name=draw(ASCII),
                       required_dst_info_num=draw(U32))
    msg.notify_endpoint.host = draw(ASCII)
    msg.notify_endpoint.port = draw(U32)
    for inner in draw(st.lists(st.lists(I32, **SMALL), **SMALL)) if with_state else []:
        msg.dst_state_indices.add(indices=inner)
    return msg


@st.composite
def mooncake_transfer_infos(draw: st.DrawFn) -> TransferInfo:
    """Mooncake TransferInfo: 8-10 frames, dummy = no kv pages and no aux index."""
    count = draw(st.integers(8, 10))
    msg = _transfer_common(draw, with_state=True)
    if draw(st.booleans()):
        msg.is_dummy = True
    else:
        msg.dst_kv_pages.extend(draw(st.lists(I32, max_size=6)))
        msg.dst_aux_index = draw(I32)
    if count > 8 and draw(st.booleans()):
        msg.decode_prefix_len = draw(U64)
    if count > 9 and draw(st.booleans()):
        msg.dst_device_kv_pages.pages.extend(draw(st.lists(I32, min_size=1, max_size=4)))
    set_framing(msg, count, 10, set())
    return msg


@st.composite
def nixl_transfer_infos(draw: st.DrawFn) -> TransferInfo:
    """NIXL TransferInfo: 7-10 parser frames, explicit or inferred dummy flag."""
    count = draw(st.integers(7, 10))
    msg = _transfer_common(draw, with_state=count > 7)
    msg.dst_kv_pages.extend(draw(st.lists(I32, max_size=6)))
    msg.dst_aux_index = draw(I32)
    empties: set[int] = set()
    if count > 8:  # an unset prefix is an empty frame here; unset and not empty is sent as 0
        if draw(st.booleans()):
            msg.decode_prefix_len = draw(st.sampled_from([0, 1, 2**64 - 1]) | U64)
        else:
            empties.add(8)
    if count > 9 and draw(st.booleans()):
        msg.is_dummy = draw(st.booleans())
    else:
        if count > 9:
            empties.add(9)
        msg.is_dummy = not msg.dst_kv_pages and not msg.decode_prefix_len
    set_framing(msg, count, 10, empties)
    return msg



STATES = st.sampled_from(sorted(KVPOLL_TO_STATE.values()))


@st.composite
def aborts(draw: st.DrawFn) -> AbortNotification:
    """ABORT with 2, 4 or 5 frames."""
    msg = AbortNotification(room=draw(U64))
    if draw(st.booleans()):
        msg.reply_endpoint.host = draw(ASCII)
        msg.reply_endpoint.port = draw(U32)
        if draw(st.booleans()):
            msg.generation = draw(U64)
    return msg


@st.composite
def abort_acks(draw: st.DrawFn, rank_required: bool) -> AbortAck:
    """ABORT_ACK with 2 (Mooncake legacy), 3 or 4 frames."""
    msg = AbortAck(room=draw(U64))
    if rank_required or draw(st.booleans()):
        msg.prefill_rank = draw(U32)
        if draw(st.booleans()):
            msg.generation = draw(U64)
    return msg

