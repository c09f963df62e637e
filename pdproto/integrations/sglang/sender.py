"""The pdproto KV sender: one per request on a prefill rank (``req.disagg_kv_sender``).

``CommonKVSender`` keeps SGLang's own bookkeeping (page counting, the last-chunk test, CP
filtering, the bootstrap timeout, failure records); every send reaches the engine through
the manager's ``add_transfer_request``. What this class adds maps SGLang's calls onto the
engine API (``pdproto_server/README.md``):

=========================  ================================================================
``poll()``                 ``PrefillEngine.status(room)`` copied into SGLang's table, then
                           SGLang's poll (Bootstrapping -> WaitingForInput -> Transferring ->
                           Success, or Failed with the engine's reason)
``poll_pp_consensus()``    the same on PP rank 0, over every PP rank's table; with PP > 1 the
                           manager's status pump copies the room's state on every rank
                           between polls (SGLang polls only PP rank 0 during bootstrap)
``pop_decode_prefix_len``  ``PrefillEngine.decode_prefix_len(room)``
``abort()``                SGLang's abort, and ``PrefillEngine.abort``: the decodes are told
``clear()``                ``release_room`` after Success; after a failure the room stays
                           aborted (a late decode is told at once) until the service expires it
``get_transfer_metric``    the bytes the service wrote (KV, aux and state), not an estimate
``send()``                 SGLang's, with a CP rank's own tokens when the CP ranks split pages
=========================  ================================================================
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.base.conn import KVTransferMetric
from sglang.srt.disaggregation.common.conn import CommonKVSender

from pdproto.v1 import common_pb2
from pdproto_server.engine import RoomStatus

from . import layout


class PdprotoKVSender(CommonKVSender):  # type: ignore[misc]
    """SGLang's KV sender for the pdproto backend (module docstring)."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self._final: RoomStatus | None = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is None and self._engine_room:
            # PP > 1: this rank's state must reach PP rank 0's consensus though nobody polls here.
            mgr.watch_room(bootstrap_room)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None,
             indices_event: Any = None) -> None:
        """SGLang's send; when the CP or KV-shard ranks split the pages, with the tokens of this rank's share
        of the chunk (SGLang counts the whole chunk's; ``add_transfer_request`` receives the share's pages)."""
        mgr = self.kv_mgr
        if num_kv_tokens is not None and mgr.kv_shards > 1 and self.conclude_state is None:
            num_kv_tokens = layout.shard_tokens(kv_indices, int(num_kv_tokens),
                                                shards=(mgr.kv_shards, int(mgr.kv_shard_rank)),
                                                page_size=int(mgr.kv_args.page_size))
        elif num_kv_tokens is not None and mgr.splits_pages and self.conclude_state is None:
            num_kv_tokens = layout.cp_share_tokens(
                self.curr_idx, len(kv_indices), int(num_kv_tokens), total_pages=self.num_kv_indices,
                cp=(mgr.attn_cp_size, mgr.attn_cp_rank), page_size=int(mgr.kv_args.page_size))
        super().send(kv_indices, state_indices, num_kv_tokens, indices_event)

    @property
    def _engine_room(self) -> bool:
        """Whether this rank's engine serves the room (a non-sending CP rank's does not)."""
        return not self.kv_mgr.is_dummy_cp_rank

    def poll(self) -> Any:
        """SGLang's ``KVPoll`` of the room, after reading the engine's state of it."""
        if self.conclude_state is None and self._engine_room:
            self.kv_mgr.refresh_room(self.bootstrap_room)
        return super().poll()

    def poll_pp_consensus(self) -> Any:
        """SGLang's ``KVPoll`` of the room over every PP rank (PP rank 0), after reading this rank's engine."""
        if self.conclude_state is None and self._engine_room:
            self.kv_mgr.refresh_room(self.bootstrap_room)
        return super().poll_pp_consensus()

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode holds already (``decode_prefix_len`` of its request); 0 if none."""
        if not self._engine_room:
            return 0
        return int(self.kv_mgr.prefill_side.decode_prefix_len(self.bootstrap_room))

    def abort(self) -> None:
        """Fail the room here and for every decode request of it; never raises."""
        super().abort()
        if self._engine_room:
            self.kv_mgr.prefill_side.abort(self.bootstrap_room, "Aborted by AbortReq.")

    def clear(self) -> None:
        """Free the room: forgotten after Success, left aborted (with its reason) after a failure."""
        side, room = self.kv_mgr.prefill_side, self.bootstrap_room
        self.kv_mgr.unwatch_room(room)
        if self._engine_room and self._final is None:
            self._final = side.status(room)
            with self.kv_mgr.failure_lock:
                reason = self.kv_mgr.failure_records.get(room)
            if self._final.state == common_pb2.TRANSFER_STATE_SUCCESS:
                side.release(room)
            elif self._final.state != common_pb2.TRANSFER_STATE_FAILED or reason is not None:
                # SGLang ended the room (bootstrap timeout, abort): decodes still waiting are told why.
                side.abort(room, reason or "the prefill ended the request")
        super().clear()

    def get_transfer_metric(self) -> KVTransferMetric:
        """SGLang's metric with the bytes the service actually wrote for the room."""
        metric: KVTransferMetric = self._transfer_metric
        if self._engine_room:
            status = self._final or self.kv_mgr.prefill_side.status(self.bootstrap_room)
            metric.transfer_total_bytes = status.kv_bytes + status.aux_bytes + status.state_bytes
        return metric
