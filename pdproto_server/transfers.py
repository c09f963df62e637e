"""How a chunk becomes one executor job: plan with ``plan_chunk``, then KV, state and aux segments.

The request's last chunk carries its state and aux slot in the same job, after the KV
segments, so the tail of a request is one engine call; each segment's kind comes back with
the job, so bytes and descriptors are still counted per kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdproto.dcp import DcpLayout, RelayoutPlan, plan_chunk
from pdproto.dcp import runs as run_arith
from pdproto.dcp.layers import EntryRole
from pdproto.errors import InvalidFieldError
from pdproto.negotiation.slots import SlotCopy, aux_copies, state_copies
from pdproto.transfer import LayerSpan, Segment, TransferJob
from pdproto.transfer.notice import ChunkNotice, encode_chunk_notice
from pdproto.transfer.packing import packing_saves

from .engine import Chunk, KvSource
from .registry import Peer, Request


def _kv_layer(source: KvSource, peer: Peer, index: int, *, packed: bool = False) -> LayerSpan | None:
    """The span of KV pairing ``index``: whole rows, this rank's heads, or None (another rank writes them).

    ``packed``: the heads as rows of their own width (rows remapped by ``runs.packed_fan_in``;
    docs/protocol.md section 3, packed fan-in).
    """
    d = peer.decision
    p = d.pairings[index]
    cut = d.tp.row_slices[index]
    src, dst = source.buffers[p.src_entry].addr, peer.registration.kv_buffers[p.dst_entry].ptr
    if cut is None:
        return LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=p.src_token_bytes)
    if cut.length == 0:
        return None
    if packed:
        return LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=p.src_token_bytes, dst_row_bytes=cut.length,
                         src_offset=cut.src_offset, width=cut.length)
    return LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=p.src_token_bytes, dst_row_bytes=p.dst_token_bytes,
                     src_offset=cut.src_offset, dst_offset=cut.dst_offset, width=cut.length)


def build_job(source: KvSource, peer: Peer, request: Request, chunks: Sequence[Chunk],
              extras: Sequence[tuple[str, list[SlotCopy]]] = ()) -> tuple[TransferJob, tuple[str, ...]]:
    """The executor job that moves ``chunks`` (consecutive) into ``request``'s pages, and each segment's kind.

    Per chunk one KV segment per entry role, then the segments of each ``extras`` kind
    (``state``, ``aux``: the last chunk's ``slot_copies``). The negotiated layouts go to the
    planner as they are, and its runs go to the executor as they are: nothing here is per
    token. The job carries each chunk's completion notice, in order; a rank that owns no
    rows of a chunk still gets a row-less job, so an engine with notifications (NIXL) tells
    the decode the chunk finished.
    """
    d = peer.decision
    has_draft = any(p.role is EntryRole.DRAFT for p in d.pairings)
    packed = d.tp.packed_fan_in
    layers = {role: tuple(layer for i, p in enumerate(d.pairings) if p.role is role and not packed[i]
                          if (layer := _kv_layer(source, peer, i)) is not None)
              for role in (EntryRole.TARGET, EntryRole.DRAFT)}
    # Packed fan-in pairings by how many slices fill a destination row and which is this rank's (the runs'
    # remapping; normally one group: every layer's heads are cut alike): their spans packed, and row by row
    # for the request's last page.
    fan_in: dict[tuple[EntryRole, int, int], list[int]] = {}
    for i, (p, cut) in enumerate(zip(d.pairings, d.tp.row_slices, strict=True)):
        if packed[i] and cut is not None:
            fan_in.setdefault((p.role, p.dst_token_bytes // cut.length, cut.dst_offset // cut.length), []).append(i)
    spans = {group: [tuple(span for i in pairings if (span := _kv_layer(source, peer, i, packed=pack)) is not None)
                     for pack in (True, False)] for group, pairings in fan_in.items()}
    segments = []
    for chunk in chunks:
        plans = chunk_plans(d.src, d.dst, chunk, request.dst_pages, prefix_len=request.prefix_len,
                            include_draft=has_draft)
        for role in (EntryRole.TARGET, EntryRole.DRAFT):
            runs = np.concatenate([p.target_runs if role is EntryRole.TARGET else p.draft_runs for p in plans])
            if layers[role] and runs.shape[0]:
                segments.append(Segment(runs, layers[role]))
            for (of, factor, slot), (packed_spans, row_spans) in spans.items():
                if of is not role or not runs.shape[0]:
                    continue
                inner, tail = run_arith.packed_fan_in(runs, d.dst.page_size, factor, slot, int(request.dst_pages[-1]))
                for rows, group in ((inner, packed_spans), (tail, row_spans)):
                    if rows.shape[0] and group:
                        segments.append(Segment(rows, group))
    kinds = ["kv"] * len(segments)
    for kind, copies in extras:
        more = slot_segments(source, peer, copies)
        segments += more
        kinds += [kind] * len(more)
    # Packing buys nothing where every row set is page-to-page: it would copy each byte once more.
    return TransferJob(segments=tuple(segments), pack=packing_saves(segments),
                       notification=tuple(encode_chunk_notice(ChunkNotice(request.room, request.generation, c.index,
                                                                          c.last)) for c in chunks)), tuple(kinds)


def chunk_plans(src: DcpLayout, dst: DcpLayout, chunk: Chunk, dst_pages: Sequence[int] | run_arith.I64, *,
                prefix_len: int, include_draft: bool) -> list[RelayoutPlan]:
    """The plans of ``chunk`` into the request's ``dst_pages`` after a decode prefix of ``prefix_len``: one,
    or for a KV-shard rank's scattered pages one per run of consecutive positions (only the last run may
    be partial), or one again where both sides are one dense layout."""
    at = chunk.positions
    if at is None:
        return [plan_chunk(src, dst, chunk.src_pages, dst_pages, src_page_offset=chunk.page_offset,
                           decode_prefix_len=prefix_len, num_kv_tokens=chunk.num_tokens,
                           include_draft=include_draft)]
    pages = np.asarray(dst_pages, dtype=np.int64)
    if src == dst and src.dcp_size == 1 and int(at[-1]) < pages.size:
        # Page j's rows land whole in the destination page at its position: plan the pages as one
        # chunk into those destination pages (a plan per run costs ~0.1 ms, 256 of them per 32K tokens).
        return [plan_chunk(src, dst, chunk.src_pages, pages[at], decode_prefix_len=prefix_len,
                           num_kv_tokens=chunk.num_tokens, include_draft=include_draft)]
    starts = [0, *(np.flatnonzero(np.diff(at) != 1) + 1).tolist()]
    ends = [*starts[1:], at.size]
    page = src.virtual_page
    return [plan_chunk(src, dst, chunk.src_pages[a:b], pages, src_page_offset=int(at[a]),
                       decode_prefix_len=prefix_len, include_draft=include_draft,
                       num_kv_tokens=(b - a) * page if b < at.size else chunk.num_tokens - a * page)
            for a, b in zip(starts, ends, strict=True)]


def slot_copies(source: KvSource, peer: Peer, request: Request, chunk: Chunk) -> tuple[list[SlotCopy], list[SlotCopy]]:
    """(state, aux) copies of the request's last chunk: what this rank writes, item by item."""
    tp = peer.decision.tp
    if request.transfer.is_dummy or not (tp.state or tp.aux):
        return [], []
    t = request.transfer
    state: list[SlotCopy] = []
    if any(p.writes for p in tp.state):
        if chunk.state_slots is None:
            raise InvalidFieldError("state_slots", f"room {request.room}: the prefill engine's last chunk"
                                    " named no state slots, and this rank writes state")
        # The repeated fields as they are: state_copies reads only the entries this rank writes.
        state = state_copies(tp.state, src_slots=chunk.state_slots, dst_slots=[s.indices for s in t.dst_state_indices],
                             names=[e.type_name for e in source.info.state_entries])
    aux: list[SlotCopy] = []
    if tp.aux:
        if chunk.aux_slot is None:
            raise InvalidFieldError("aux_slot", f"room {request.room}: the prefill engine's last chunk"
                                    " named no aux slot, and this rank writes aux")
        aux = aux_copies(tp.aux, src_slot=chunk.aux_slot, dst_slot=t.dst_aux_index)
    return state, aux


def slot_segments(source: KvSource, peer: Peer, copies: list[SlotCopy]) -> list[Segment]:
    """The segments of aux or state copies: one per distinct item list, a layer per tensor byte range.

    Every layer's destination is the base of the entry's registered region, so the
    executor bounds each write by that entry's own length. They move with the chunk's KV,
    packed when its job is.
    """
    reg = peer.registration
    # One segment per distinct item list (an entry's tensors, or every aux buffer, share one),
    # holding all of its layers: descriptors are then cut once per segment and shape, not once
    # per tensor, which was most of a request's aux and state time.
    layers_of: dict[int, tuple[run_arith.I64, list[LayerSpan]]] = {}  # by id(c.items)
    for c in copies:
        if c.kind == "aux":
            src, dst = source.aux[c.src_entry].addr, reg.aux_ptrs[c.dst_entry]
        else:
            src = source.state[c.src_entry][c.src_tensor].addr
            dst = reg.state_buffers[c.dst_entry].data_ptrs[c.dst_tensor]
        if id(c.items) not in layers_of:
            pairs = np.array(c.items, dtype=np.int64).reshape(-1, 2)
            layers_of[id(c.items)] = (run_arith.from_rows(pairs[:, 0], pairs[:, 1]), [])
        layers_of[id(c.items)][1].extend(
            LayerSpan(src_ptr=src, dst_ptr=dst, row_bytes=c.src_item_len, dst_row_bytes=c.dst_item_len,
                      src_offset=g.src_offset, dst_offset=g.dst_offset, width=g.length) for g in c.segments)
    return [Segment(runs, tuple(layers)) for runs, layers in layers_of.values()]


__all__ = ["build_job", "slot_copies", "slot_segments"]
