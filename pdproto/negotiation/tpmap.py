"""The TP mapping of one prefill rank to one decode rank: what it writes besides the DCP token layout.

``plan_tp`` is the part of negotiation (``pdproto.negotiation.topology``) that handles tensor and
pipeline parallelism, aux and state, from the same ``(PrefillServerInfo, KvRegistration)``
pair on either side:

1. the decode rank's senders (``pdproto.negotiation.senders``): this prefill rank must be one of them
   (a CP rank past 0 only when the prefill's CP ranks split the pages, writing KV only, or its
   layers, writing their KV and state; any TP rank when an MLA prefill shards its pages across TP,
   writing KV only);
2. aux pairings (``pdproto.negotiation.extras.pair_aux``), moved by the one sender elected for aux;
3. state matches and the bytes of each item this rank writes (``extras.state_writes``),
   under the prefill's state TP (which must be its attention TP) and the decode's attention TP;
4. per KV pairing, the part of each token row this rank writes (``extras.kv_row_writes``):
   whole MLA rows from one sender (from the senders in turn, one pairing each, where the decode
   asked for it: ``SPLIT_KV``), whole MHA rows at equal TP sizes, heads otherwise (from one
   sender when each prefill rank holds every head), packed into the decode's pages where the
   decode asked for it (``PACKED_FAN_IN``).

Rejections are ``TopologyError`` values with the reasons of those modules, plus
TOPOLOGY_NOT_A_SENDER when the decode registered with a prefill rank that does not feed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdproto.errors import Reason, TopologyError
from pdproto.negotiation.extras import (MLA_ATTENTION_KINDS, AuxPairing, StatePairing, kv_row_writes, match_state,
                                        pair_aux, state_writes)
from pdproto.negotiation.senders import Sender, SenderSet, sender_set, target_pp_ranks, target_tp_ranks
from pdproto.negotiation.shards import Segment
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2


@dataclass(frozen=True)
class TpPlan:
    """What one prefill rank writes into one decode rank, beyond which tokens go where."""

    senders: SenderSet
    """Every prefill rank the decode rank hears from."""
    me: Sender
    """This prefill rank's place in ``senders``."""
    aux: tuple[AuxPairing, ...]
    """Aux pairings this rank writes (empty unless it is the aux sender)."""
    state: tuple[StatePairing, ...]
    """State pairings with the bytes this rank writes (a pairing may write nothing)."""
    row_slices: tuple[Segment | None, ...]
    """Per KV pairing, the part of each token row this rank writes; None: the whole row;
    a zero-length segment: nothing (another sender writes the row)."""
    packed_fan_in: tuple[bool, ...]
    """Per KV pairing, whether the row slice goes packed into the decode's pages (``fan_in_packable``)."""

    def fill(self, result: server_info_pb2.NegotiationResult) -> None:
        """Write the plan into a ``NegotiationResult`` (aux, state, senders, row slices)."""
        result.aux.extend(p.to_proto() for p in self.aux)
        result.state.extend(p.to_proto() for p in self.state)
        result.senders.CopyFrom(self.senders.to_proto(self.me))
        for entry, cut, pack in zip(result.entries, self.row_slices, self.packed_fan_in, strict=True):
            if cut is not None:
                entry.row_slice.CopyFrom(cut.to_proto())
                entry.packed_fan_in = pack


PACKED_FAN_IN = "packed-fan-in"
"""Decode capability: it puts packed fan-in pages back in row order (``pdproto.transfer.packing.unpack_fan_in``),
so a prefill rank that writes part of every row (MHA heads of a larger attention TP) may write each
destination page's part as one block instead of one descriptor per row (docs/protocol.md section 3, packed fan-in)."""


SPLIT_KV = "split-kv"
"""Decode capability: it takes each KV pairing from the sender its negotiation names, so the prefill ranks of an
MLA fan-in, which each hold every row, write the pairings in turn (pairing j from the j-th sender, modulo their
number) instead of the first sender writing them all: each of k senders moves about 1/k of the KV, side by side."""


def _split_whole_rows(rows: Sequence[dict[int, tuple[Segment, ...]]],
                     senders: Sequence[int]) -> list[dict[int, tuple[Segment, ...]]]:
    """Rows every sender holds whole, ``kv_row_writes`` giving them to the first: pairing j to ``senders[j % k]``."""
    return [{t: r[senders[0]] if t == senders[j % len(senders)] else () for t in r} for j, r in enumerate(rows)]


def fan_in_packable(cut: Segment | None, dst_row_bytes: int) -> bool:
    """Whether a row slice may go packed: part of the row, one of equal parts that fill it."""
    return (cut is not None and 0 < cut.length < dst_row_bytes and dst_row_bytes % cut.length == 0
            and cut.dst_offset % cut.length == 0)


def _size(group: common_pb2.ParallelGroup) -> int:
    return group.size or 1


def plan_tp(info: server_info_pb2.PrefillServerInfo, reg: registration_pb2.KvRegistration, *,
            kv_rows: Sequence[tuple[int, int]]) -> TpPlan:
    """This prefill rank's plan for the registering decode rank (steps in the module docstring).

    ``kv_rows`` holds (prefill, decode) bytes per token of every KV pairing, in order.
    """
    p_tp, p_pp, p_cp = _size(info.attn_tp), _size(info.pp), _size(info.attn_cp)
    d_tp, d_pp = _size(reg.attn_tp), _size(reg.pp)
    # SGLang registers its global TP rank, which exceeds the attention TP size under DP attention.
    d_rank, d_pp_rank = reg.attn_tp.rank % d_tp, reg.pp.rank
    mapped = target_tp_ranks(p_tp, d_tp, d_rank)
    # SGLang shards MLA KV pages across attention TP only with CP 1 (get_kv_shard_group); each TP
    # rank then holds every N-th page and sends it to every decode rank.
    tp_shards = info.enable_kv_cache_sharding and p_cp == 1 and info.attention_kind in MLA_ATTENTION_KINDS
    tps = tuple(range(p_tp)) if tp_shards else mapped
    pps = target_pp_ranks(p_pp, d_pp, d_pp_rank)
    me_tp, me_pp, me_cp = info.attn_tp.rank, info.pp.rank, info.attn_cp.rank
    cp_split = info.cp_ranks_split_pages and p_cp > 1
    cp_layers = info.enable_dsa_cache_layer_split and p_cp > 1  # each CP rank holds its own layers
    cps = f"cp 0..{p_cp - 1}" if cp_split or cp_layers else "cp 0"
    if me_tp not in tps or me_pp not in pps or not (me_cp == 0 or cp_split or cp_layers):
        raise TopologyError(
            f"prefill rank (tp {me_tp}, pp {me_pp}, cp {me_cp}) does not feed decode rank"
            f" (tp {d_rank}/{d_tp}, pp {d_pp_rank}/{d_pp}); it hears from tp {list(tps)},"
            f" pp {list(pps)}, {cps}", reason=Reason.TOPOLOGY_NOT_A_SENDER,
            metadata={"prefillTpRank": me_tp, "prefillPpRank": me_pp, "prefillCpRank": me_cp,
                      "decodeTpRank": d_rank, "decodeTpSize": d_tp,
                      "senderTpRanks": ",".join(map(str, tps))})

    aux = pair_aux(info, reg)
    state_tp = _size(info.state_tp) if info.HasField("state_tp") else p_tp
    if info.state_entries and state_tp != p_tp:
        raise TopologyError(
            f"state TP {state_tp} differs from attention TP {p_tp} on the prefill; pdproto"
            " slices state only over the attention TP group",
            reason=Reason.TOPOLOGY_STATE_SLICE_MISMATCH,
            metadata={"prefillStateTpSize": state_tp, "prefillTpSize": p_tp})
    matches = match_state(info, reg, src_tp=p_tp, dst_tp=d_tp)
    writes = state_writes(matches, src_tp=p_tp, dst_tp=d_tp, dst_rank=d_rank, senders=mapped)

    mla = info.attention_kind in MLA_ATTENTION_KINDS
    heads = info.total_kv_heads
    if reg.total_kv_heads and heads and reg.total_kv_heads != heads:
        raise TopologyError(f"{heads} KV heads on the prefill, {reg.total_kv_heads} on the decode",
                            reason=Reason.TOPOLOGY_KV_HEADS_MISMATCH,
                            metadata={"prefillKvHeads": heads, "decodeKvHeads": reg.total_kv_heads})
    rows = [kv_row_writes(mla=mla, total_heads=heads or reg.total_kv_heads, src_row_bytes=s,
                          dst_row_bytes=d, src_tp=p_tp, dst_tp=d_tp, dst_rank=d_rank, senders=mapped)
            for s, d in kv_rows]
    if mla and len(mapped) > 1 and not tp_shards and SPLIT_KV in reg.capabilities:
        rows = _split_whole_rows(rows, mapped)
    kv_writers = {t for r in rows for t, segs in r.items() if segs}
    state_writers = {t for t, plan in writes.items() if any(p.writes for p in plan)}
    senders = sender_set(prefill_tp=p_tp, prefill_pp=p_pp, prefill_cp=p_cp, decode_tp=d_tp,
                         decode_tp_rank=d_rank, decode_pp=d_pp, decode_pp_rank=d_pp_rank,
                         kv_writers=kv_writers, state_writers=state_writers, has_aux=bool(aux),
                         cp_split=cp_split, cp_layers=cp_layers, tp_shards=tp_shards)
    me = senders.find(tp_rank=me_tp, pp_rank=me_pp, cp_rank=me_cp)
    assert me is not None  # checked above: this rank is one of the targets
    # A CP rank past 0 holds the same state as CP rank 0, and a KV-shard TP rank outside the TP
    # mapping none of this decode rank's: either keeps the pairings and writes no state. A KV-shard
    # rank writes the whole rows the mapped rank would, of its own pages.
    own = me_tp if me_tp in writes else mapped[0]

    def writes_tensor(entry: int, tensor: int) -> bool:
        if own != me_tp:
            return False
        if not cp_layers:
            return me_cp == 0
        # Each CP rank writes its own layers' tensors; one without a layer id is whole on every CP
        # rank and comes from the last, which also holds the draft's (SGLang transfer_draft_cache).
        return info.state_entries[entry].tensors[tensor].HasField("layer_id") or me_cp == p_cp - 1

    state = tuple(replace(p, tensors=tuple(t if writes_tensor(p.src_entry, t.src_tensor) else replace(t, segments=())
                                           for t in p.tensors)) for p in writes[own])
    row_owner = mapped[0] if tp_shards else me_tp
    cuts = tuple(_row_slice(r[row_owner], s, d) for r, (s, d) in zip(rows, kv_rows, strict=True))
    packs = PACKED_FAN_IN in reg.capabilities
    return TpPlan(senders=senders, me=me, aux=aux if me.sends_aux else (), state=state, row_slices=cuts,
                  packed_fan_in=tuple(packs and fan_in_packable(c, d) for c, (_, d) in zip(cuts, kv_rows, strict=True)))


def _row_slice(segments: tuple[Segment, ...], src_row: int, dst_row: int) -> Segment | None:
    """None for a whole row, the one head range otherwise (a zero-length one for none)."""
    if not segments:
        return Segment(0, 0, 0)
    if src_row == dst_row and segments == (Segment(0, 0, src_row),):
        return None
    (cut,) = segments  # heads of one rank are contiguous on both sides
    return cut


__all__ = ["PACKED_FAN_IN", "SPLIT_KV", "TpPlan", "fan_in_packable", "plan_tp"]
