"""Fan-in and fan-out: which prefill ranks feed one decode rank, and what each of them sends.

A decode rank needs data from one prefill rank or from several (SGLang
``_resolve_rank_mapping``, ``common/conn.py:1432-1530``):

* **TP.** Equal TP sizes pair rank with rank. A decode TP that is ``k`` times the prefill's
  (fan-out) takes everything from prefill rank ``d // k``, which serves ``k`` decode ranks per
  request. A prefill TP that is ``k`` times the decode's (fan-in) has decode rank ``d`` hear
  from prefill ranks ``d*k .. d*k+k-1``, each holding part of the heads.
* **PP.** Equal PP sizes pair stage with stage; a decode that holds every layer (PP 1) hears
  from every prefill stage, each sending its own layers.
* **CP.** Only prefill attention-CP rank 0 is contacted, as SGLang does by default (CP ranks
  hold the same KV and state). A prefill whose CP ranks split the pages
  (``PrefillServerInfo.cp_ranks_split_pages``, SGLang ``enable_all_cp_ranks_for_transfer``) has
  every CP rank send its share of the KV; state and aux, which every CP rank holds whole, come
  from CP rank 0 only (SGLang ``_should_skip_cp_replicated_state_transfer``). A prefill whose CP
  ranks each hold other layers (``PrefillServerInfo.enable_dsa_cache_layer_split``, SGLang's DSA
  cache layer split) has every CP rank send every page of its layers, KV and state; the decode
  pairs them by layer id as it pairs PP stages'.
* **KV cache sharding.** An MLA prefill with CP 1 that stripes each request's pages across its
  attention-TP ranks (``PrefillServerInfo.enable_kv_cache_sharding``; SGLang ``get_kv_shard_group``:
  page ``l`` on rank ``l % N``) has every TP rank send its pages to every decode rank; state and
  aux still come from the sender TP mapping above names.

Within one stage's TP group the senders split the work: the KV of an MLA pool is whole on
every prefill rank, so only the first sender writes it, or, for a decode that asks for it
(``pdproto.negotiation.tpmap.SPLIT_KV``), the senders write its entries in turn (a stage with
fewer MLA entries than senders leaves the last ones without KV); MHA senders write their heads; state
is written by every sender that holds part of it (a tensor replicated across TP by one only,
``pdproto.negotiation.shards.assign_writes``); the aux slot once per destination, by the first sender of
the last stage in the set (the stage that computed the first output token). A sender that
writes nothing is a *dummy*: the decode still submits to it (``TransferInfo.is_dummy``) so its
room completes, and does not wait for its status. A request is SUCCESS on the decode only when
every non-dummy sender reported SUCCESS (``pdproto.negotiation.fanin``).

Pure: the same inputs give the same set on the prefill (in its negotiation answer) and on the
decode.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pdproto.errors import Reason, TopologyError
from pdproto.v1 import server_info_pb2


def prefill_rank_id(*, tp_rank: int, pp_rank: int, cp_rank: int, pp_size: int, cp_size: int) -> int:
    """SGLang's prefill rank number: ``tp_rank*(pp*cp) + pp_rank*cp + cp_rank`` (status messages carry it)."""
    return tp_rank * (pp_size * cp_size) + pp_rank * cp_size + cp_rank


def _divides(prefill_tp: int, decode_tp: int) -> None:
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if small < 1 or big % small:
        raise TopologyError(
            f"prefill TP {prefill_tp} and decode TP {decode_tp} must divide one another",
            reason=Reason.TOPOLOGY_TP_NOT_DIVISIBLE,
            metadata={"prefillTpSize": prefill_tp, "decodeTpSize": decode_tp})


def target_tp_ranks(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[int, ...]:
    """The prefill TP ranks decode TP rank ``decode_rank`` hears from, in order."""
    _divides(prefill_tp, decode_tp)
    if decode_tp >= prefill_tp:
        return (decode_rank // (decode_tp // prefill_tp),)
    k = prefill_tp // decode_tp
    return tuple(range(decode_rank * k, decode_rank * k + k))


def target_pp_ranks(prefill_pp: int, decode_pp: int, decode_pp_rank: int) -> tuple[int, ...]:
    """The prefill stages a decode stage hears from: its own, or all of them for decode PP 1."""
    if decode_pp == prefill_pp:
        return (decode_pp_rank,)
    if decode_pp == 1:
        return tuple(range(prefill_pp))
    raise TopologyError(f"decode PP {decode_pp} must equal prefill PP {prefill_pp} or be 1",
                        reason=Reason.TOPOLOGY_PP_MISMATCH,
                        metadata={"prefillPpSize": prefill_pp, "decodePpSize": decode_pp})


@dataclass(frozen=True)
class Sender:
    """One prefill rank a decode rank hears from, and what it writes there."""

    tp_rank: int
    """Attention TP rank."""
    pp_rank: int
    """Pipeline stage."""
    cp_rank: int
    """Attention CP rank."""
    prefill_rank: int
    """SGLang prefill rank number (``TransferStatus.prefill_rank``)."""
    sends_kv: bool
    """Writes KV rows (or its heads of them)."""
    sends_state: bool
    """Writes state."""
    sends_aux: bool
    """Writes the aux slot."""

    @property
    def dummy(self) -> bool:
        """Writes nothing; submitted to with ``is_dummy`` and not waited for."""
        return not (self.sends_kv or self.sends_state or self.sends_aux)

    def to_proto(self) -> server_info_pb2.PrefillSender:
        """The ``PrefillSender`` message."""
        return server_info_pb2.PrefillSender(
            prefill_rank=self.prefill_rank, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
            cp_rank=self.cp_rank, sends_kv=self.sends_kv, sends_state=self.sends_state,
            sends_aux=self.sends_aux, dummy=self.dummy)

    @classmethod
    def from_proto(cls, msg: server_info_pb2.PrefillSender) -> Sender:
        """Read a ``PrefillSender`` (its ``dummy`` flag follows from the three others)."""
        return cls(msg.tp_rank, msg.pp_rank, msg.cp_rank, msg.prefill_rank, msg.sends_kv,
                   msg.sends_state, msg.sends_aux)


@dataclass(frozen=True)
class SenderSet:
    """Every prefill rank one decode rank needs for a request."""

    senders: tuple[Sender, ...]
    """In prefill-rank order."""
    decode_ranks_per_prefill_rank: int
    """Decode ranks each of these prefill ranks serves per request (SGLang required_dst_info_num)."""

    @property
    def required_responses(self) -> int:
        """Senders whose SUCCESS the decode waits for (the non-dummies)."""
        return sum(1 for s in self.senders if not s.dummy)

    def find(self, *, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> Sender | None:
        """The sender with these ranks, or None when that prefill rank is not in the set."""
        for s in self.senders:
            if (s.tp_rank, s.pp_rank, s.cp_rank) == (tp_rank, pp_rank, cp_rank):
                return s
        return None

    def to_proto(self, self_sender: Sender | None = None) -> server_info_pb2.SenderSet:
        """The ``SenderSet`` message; ``self_sender`` marks the answering prefill rank."""
        return server_info_pb2.SenderSet(
            senders=[s.to_proto() for s in self.senders],
            required_responses=self.required_responses,
            decode_ranks_per_prefill_rank=self.decode_ranks_per_prefill_rank,
            self_index=self.senders.index(self_sender) if self_sender is not None else 0)

    @classmethod
    def from_proto(cls, msg: server_info_pb2.SenderSet) -> SenderSet:
        """Read a ``SenderSet``."""
        return cls(tuple(Sender.from_proto(s) for s in msg.senders),
                   msg.decode_ranks_per_prefill_rank or 1)


def sender_set(*, prefill_tp: int, prefill_pp: int, prefill_cp: int, decode_tp: int,
               decode_tp_rank: int, decode_pp: int, decode_pp_rank: int,
               kv_writers: Collection[int], state_writers: Collection[int],
               has_aux: bool, cp_split: bool = False, cp_layers: bool = False,
               tp_shards: bool = False) -> SenderSet:
    """The senders of one decode rank (rules in the module docstring).

    ``kv_writers`` and ``state_writers`` are the prefill TP ranks (of this decode rank's
    ``target_tp_ranks``) that write KV and state into it; every stage in the set splits its
    work the same way, since TP splits each stage's layers alike. ``cp_split``: every CP rank
    sends its share of the pages (``PrefillServerInfo.cp_ranks_split_pages``); ``cp_layers``: every CP
    rank sends its layers' KV and state (``enable_dsa_cache_layer_split``); ``tp_shards``: every
    TP rank sends its pages of the KV (``PrefillServerInfo.enable_kv_cache_sharding``, MLA, CP 1).
    """
    mapped = target_tp_ranks(prefill_tp, decode_tp, decode_tp_rank)
    tps = tuple(range(prefill_tp)) if tp_shards else mapped
    pps = target_pp_ranks(prefill_pp, decode_pp, decode_pp_rank)
    cps = range(prefill_cp) if cp_split or cp_layers else range(1)
    senders = [
        Sender(tp_rank=tp, pp_rank=pp, cp_rank=cp,
               prefill_rank=prefill_rank_id(tp_rank=tp, pp_rank=pp, cp_rank=cp,
                                            pp_size=prefill_pp, cp_size=prefill_cp),
               sends_kv=tp in kv_writers or tp_shards, sends_state=tp in state_writers and (cp == 0 or cp_layers),
               sends_aux=has_aux and tp == mapped[0] and pp == pps[-1] and cp == 0)
        for tp in tps for pp in pps for cp in cps
    ]
    senders.sort(key=lambda s: s.prefill_rank)
    return SenderSet(tuple(senders), decode_tp if tp_shards else max(1, decode_tp // prefill_tp))


__all__ = ["Sender", "SenderSet", "prefill_rank_id", "sender_set", "target_pp_ranks",
           "target_tp_ranks"]
