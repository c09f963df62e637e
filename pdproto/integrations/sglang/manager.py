"""The pdproto KV manager: one per SGLang scheduler rank, in prefill or decode mode.

It derives from SGLang's ``CommonKVManager`` because ``prefill.py`` and ``decode.py`` call
members only that class has (the room status table, ``try_ensure_parallel_info``,
``prefill_info_table``, the deferred-abort acknowledgements, the heartbeat; see
docs/sglang-notes.md). What it adds is a translation, no protocol:

* **prefill**: before the rank registers with SGLang's bootstrap server (``PUT /route``,
  from the base constructor), it builds its ``PrefillSide`` (pools registered, engine,
  handshake service) and publishes the service's gRPC port as ``pdproto_port`` in the rank's
  record (bootstrap.py).
  SGLang's sends become ``PrefillEngine.submit_chunk`` (``add_transfer_request``); the
  engine's room status becomes SGLang's ``KVPoll`` and failure reason (``refresh_room``).
  With PP > 1 a thread of the manager (``StatusPump``) does that for every open room as
  well: SGLang then polls only PP rank 0, which reads every rank's status from the
  ``PPConsensusStore`` each rank fills through ``update_status``.
* **decode**: it builds its ``DecodeSide`` (pools registered; its decode peer keeps one client
  and status stream per prefill rank); outcomes folded over a request's prefill ranks become SGLang's room
  status and failure reason (``_on_outcome``). For prefill ranks that run SGLang's own Mooncake
  backend (no ``pdproto_port``) it provides SGLang's frame builders (``build_receiver_*_message``)
  and follows their answers on its own PULL socket (``legacy``, legacy_decode.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from pdproto.errors import ConfigError, PdprotoError, Reason
from pdproto.legacy import STATE_TO_KVPOLL, mooncake
from pdproto.negotiation.fanin import Outcome
from pdproto.v1 import AbortAck, TransferStatus, common_pb2

from . import layout, legacy_decode
from .bootstrap import PDPROTO_PORT
from .decode_side import DecodeSide
from .prefill_side import PrefillSide
from .settings import BackendSettings

log = logging.getLogger(__name__)

_KVPOLL: dict[int, int] = {
    common_pb2.TRANSFER_STATE_BOOTSTRAPPING: KVPoll.Bootstrapping,
    common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    common_pb2.TRANSFER_STATE_TRANSFERRING: KVPoll.Transferring,
    common_pb2.TRANSFER_STATE_SUCCESS: KVPoll.Success,
    common_pb2.TRANSFER_STATE_FAILED: KVPoll.Failed,
}
"""pdproto ``TransferState`` -> SGLang ``KVPoll`` (only FAILED differs in value)."""


PP_REFRESH_S = 0.005
"""How often the status pump (PP > 1) copies the engine's state of each open room into SGLang's table."""
PP_REFRESH_PER_ROOM_S = 100e-6
"""...at least this much per open room between sweeps: a sweep reads each room, so with
many rooms open the pump takes a bounded share of a core (a tenth: PrefillEngine.status took
7.7 µs a room here), not all of it."""


def rank_address(info: dict[str, Any]) -> str:
    """host:port of the pdproto handshake service of the prefill rank a ``/route`` answer names.

    A record without ``pdproto_port`` comes from an unmodified SGLang prefill (bootstrap.py).
    """
    port = info.get(PDPROTO_PORT)
    if port is None:
        raise ConfigError(
            f"prefill rank {info.get('rank_ip')}:{info.get('rank_port')} publishes no pdproto handshake "
            f"service in its bootstrap record: it runs SGLang's own transfer backend; run it with "
            f"--disaggregation-transfer-backend pdproto", reason=Reason.CONFIG_INVALID,
            metadata={"rank_ip": str(info.get("rank_ip")), "rank_port": str(info.get("rank_port"))})
    return layout.host_port(str(info["rank_ip"]), int(port))


class StatusPump:
    """Calls ``refresh(room)`` for every watched room, off the scheduler thread, until stopped.

    SGLang's own backends write a room's status from their background threads the moment
    it changes (Mooncake's bootstrap thread and transfer workers call ``update_status``).
    pdproto's engine changes state on its service loop and says so to nobody, so with PP > 1,
    where SGLang polls only PP rank 0 during bootstrap (``poll_and_all_reduce_prefill_pp``)
    and reads every other rank's status from the ``PPConsensusStore``, each rank copies its
    engine's state into its own store here; the store replicates it to rank 0.
    """

    def __init__(self, refresh: Callable[[int], bool], lock: threading.RLock, *,
                 interval_s: float = PP_REFRESH_S, name: str = "pdproto-pp-status") -> None:
        self._refresh = refresh
        """Copies one room's state; False once the room is concluded (no more refreshes)."""
        self._lock = lock
        """Held around each refresh; ``unwatch`` takes it, so no refresh of the room runs after it."""
        self._rooms: set[int] = set()
        self._interval = interval_s
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, room: int) -> None:
        """Refresh ``room`` until it concludes or is unwatched."""
        with self._lock:
            self._rooms.add(room)
        self._wake.set()

    def unwatch(self, room: int) -> None:
        """Stop refreshing ``room``; returns once no refresh of it is running."""
        with self._lock:
            self._rooms.discard(room)

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                rooms = list(self._rooms)
            if not rooms:
                # Nothing open: sleep until a room is watched (or the manager closes).
                self._wake.wait()
                self._wake.clear()
                continue
            for room in rooms:
                with self._lock:
                    if room in self._rooms and not self._refresh(room):
                        self._rooms.discard(room)
            self._stopped.wait(max(self._interval, len(rooms) * PP_REFRESH_PER_ROOM_S))

    def stop(self) -> None:
        """End the thread (the manager closes)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(5)


class PdprotoKVManager(CommonKVManager):  # type: ignore[misc]
    """SGLang's KV manager for ``--disaggregation-transfer-backend pdproto`` (module docstring)."""

    # A failed decode transfer may hold its pages until every prefill rank acknowledged the
    # abort: pdproto's Abort answers once the request's in-flight chunk drained.
    supports_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False, **_ascend_only: Any) -> None:
        self.settings = BackendSettings.from_env()
        if getattr(server_args, "enable_memory_saver", False):
            # Releasing and resuming GPU memory needs the engine's registrations redone, which
            # this backend does not do (register_buffer_to_engine is not provided).
            raise ConfigError("--enable-memory-saver is not supported with --disaggregation-transfer-backend "
                              "pdproto; use mooncake for it", reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "enable_memory_saver"})
        self.prefill_side: PrefillSide | None = None
        self.decode_side: DecodeSide | None = None
        # SGLang writes a room's status from the scheduler thread; the status pump writes it too.
        # update_status reads, then writes: one lock keeps a write from undoing another (Failed).
        self._status_lock = threading.RLock()
        self.status_pump: StatusPump | None = None
        super().__init__(args, disaggregation_mode, server_args, bool(is_mla_backend))
        if self.disaggregation_mode == DisaggregationMode.PREFILL and self.pp_size > 1:
            self.status_pump = StatusPump(self._pump_refresh, self._status_lock,
                                          name=f"pdproto-pp{self.pp_rank}-status")
        self.legacy: legacy_decode.LegacyPrefills | None = None
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self.decode_side = DecodeSide(
                args, self._decode_ranks(args), is_mla_backend=self.is_mla_backend, settings=self.settings,
                host=self.local_ip, notify_port=self.rank_port, device=_device(), on_outcome=self._on_outcome)
            from sglang.srt.environ import envs

            # SGLang's PULL socket (rank_port) receives what SGLang Mooncake prefills send back.
            self.legacy = legacy_decode.LegacyPrefills(
                self.server_socket, aux=list(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)),
                on_status=self._legacy_status, on_ack=self._legacy_ack, on_lost=self._legacy_lost,
                send_timeout_s=float(envs.SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT.get()))
            self._start_heartbeat_checker_thread()

    @property
    def splits_layers(self) -> bool:
        """Whether each CP rank holds its own layers and sends every page of them (DSA cache layer split)."""
        from sglang.srt.runtime_context import get_parallel

        return bool(get_parallel().enable_dsa_cache_layer_split) and self.attn_cp_size > 1

    @property
    def splits_pages(self) -> bool:
        """Whether SGLang cuts each chunk to this CP rank's share of the pages (``filter_kv_indices_for_cp_rank``;
        not under the layer split, ``_prepare_send_indices``)."""
        return bool(self.enable_all_cp_ranks_for_transfer) and self.attn_cp_size > 1 and not self.splits_layers

    @property
    def kv_shards(self) -> int:
        """Ranks each request's pages are striped across (``--enable-kv-cache-sharding``: page l on rank
        l % n, the attention-CP group when CP > 1, else attention TP); 1: no sharding."""
        return int(getattr(self, "kv_shard_size", 1) or 1)

    def _ranks(self) -> layout.Ranks:
        """Where this rank sits, as pdproto publishes and negotiates it (and SGLang's ``/route`` row says)."""
        from sglang.srt.runtime_context import get_parallel

        ranks = layout.Ranks(
            attn_tp=(self.attn_tp_size, self.attn_tp_rank), attn_cp=(self.attn_cp_size, self.attn_cp_rank),
            attn_dp=(self.attn_dp_size, self.attn_dp_rank), system_dp=(self.system_dp_size, self.system_dp_rank),
            pp=(self.pp_size, self.pp_rank), dcp=(self.dcp_size, self.dcp_rank), state_tp_size=self.state_tp_size,
            cp_split_pages=self.splits_pages, kv_shards=self.kv_shards, cp_layers=self.splits_layers)
        return ranks.cp_as_tp() if get_parallel().enable_cp_tp_group_sharing else ranks

    def _decode_ranks(self, args: Any) -> layout.Ranks:
        """``_ranks`` of a decode, with its PP stage's layers where DeepSeek-V4's entries need them
        (``layout.Ranks.stage_layers``): the range SGLang's model builds (``make_layers``)."""
        ranks = self._ranks()
        if self.pp_size == 1 or layout.page_rows(args) == 1:  # only DeepSeek-V4 moves a row per page
            return ranks
        from sglang.srt.distributed import get_pp_indices
        from sglang.srt.runtime_context import process_model_config

        layers = get_pp_indices(process_model_config().num_hidden_layers, self.pp_rank, self.pp_size)
        return replace(ranks, stage_layers=(int(layers[0]), int(layers[1])))

    # -- prefill ------------------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Start this rank's handshake service, then ``PUT /route``: its gRPC port as ``pdproto_port``, and as
        ``rank_port`` the legacy listener that SGLang's own Mooncake decodes dial (``pdproto_server/legacy.py``)."""
        if self.prefill_side is None:
            from sglang.srt.environ import envs

            match_timeout = max(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get(),
                                envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
            self.prefill_side = PrefillSide(
                self.kv_args, self._ranks(), is_mla_backend=bool(self.is_mla_backend), settings=self.settings,
                host=self.local_ip, device=_device(), prefill_rank=self._prefill_unique_rank(),
                match_timeout_s=float(match_timeout))
            # The service's legacy listener takes SGLang's decodes; do not hold a second port for them.
            self.server_socket.close(linger=0)
        self.rank_port = self.prefill_side.legacy_port
        super().register_to_bootstrap()

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        """SGLang's ``PUT /route``, with this rank's handshake port added (bootstrap.py)."""
        own = (payload.get("rank_ip"), payload.get("rank_port")) == (self.local_ip, self.rank_port)
        if own and self.prefill_side is not None:  # Rust-server mode also files other ranks' rows
            payload = {**payload, PDPROTO_PORT: self.prefill_side.port}
        super()._register_topology_row(url, payload)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: Any, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None,
                             num_kv_tokens: int | None = None, wait_event: Any = None,
                             **_unused: Any) -> None:
        """One send of ``CommonKVSender.send`` (pages after the decode prefix, in order) -> one engine chunk.

        When the CP ranks split the pages, SGLang has cut the chunk to this rank's share: it lands at
        ``index_slice.start``; under KV cache sharding ``index_slice`` holds each local page's position
        (``PdprotoKVSender.send`` counted the tokens of either)."""
        assert self.prefill_side is not None
        if wait_event is not None:
            # SGLang's early send of a cached prefix: the KV is written by work still queued on
            # the GPU; nothing may read it before that work is done.
            wait_event.synchronize()
        if num_kv_tokens is None:
            num_kv_tokens = len(kv_indices) * self.kv_args.page_size
        try:
            self.prefill_side.submit(bootstrap_room, kv_indices, num_kv_tokens, is_last_chunk, state_indices,
                                     aux_index, page_offset=index_slice if self.kv_shards > 1
                                     else index_slice.start if self.splits_pages else None)
        except PdprotoError as exc:
            # A refused chunk fails this room only; the scheduler thread never sees the raise.
            reason = f"{exc.reason.name}: {exc.message}"
            self.fail_room(bootstrap_room, reason)
            self.prefill_side.abort(bootstrap_room, reason)

    def refresh_room(self, room: int) -> None:
        """Copy the engine's view of ``room`` into SGLang's status table (and its reason, once failed)."""
        if self.prefill_side is None:
            return
        with self._status_lock:
            current = self.request_status.get(room)
            if current is None or current == KVPoll.Failed:
                return  # cleared (never recreated here), or failed for good
            status = self.prefill_side.status(room)
            if status.state == common_pb2.TRANSFER_STATE_FAILED:
                self.fail_room(room, f"{status.failure_code}: {status.failure_reason}")
            elif status.state in _KVPOLL and _KVPOLL[status.state] > current:
                # Only a change is written: with PP > 1 each write is a message to PP rank 0.
                self.update_status(room, _KVPOLL[status.state])

    def watch_room(self, room: int) -> None:
        """Keep ``room``'s status current without a poll (PP > 1: SGLang polls only PP rank 0)."""
        if self.status_pump is not None:
            self.status_pump.watch(room)

    def unwatch_room(self, room: int) -> None:
        """Stop keeping ``room``'s status current (its sender is cleared)."""
        if self.status_pump is not None:
            self.status_pump.unwatch(room)

    def _pump_refresh(self, room: int) -> bool:
        """The status pump's refresh of ``room``; False once it concluded (Success, Failed, or cleared)."""
        try:
            self.refresh_room(room)
        except Exception as exc:  # noqa: BLE001 - the room must end with a reason, not wait for a timeout
            log.exception("pdproto: status of room %d could not be read", room)
            self.fail_room(room, f"{Reason.INTERNAL.name}: reading the room's status failed: {exc!r}")
            return False
        return self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed)

    def update_status(self, bootstrap_room: int, status: Any) -> None:
        """SGLang's ``update_status``, serialized with the status pump's writes."""
        with self._status_lock:
            super().update_status(bootstrap_room, status)

    # -- decode -------------------------------------------------------------------------

    def _on_outcome(self, room: int, outcome: Outcome) -> None:
        """A request's outcome over its prefill ranks (decode loop thread) -> SGLang's status."""
        if outcome.state == common_pb2.TRANSFER_STATE_SUCCESS:
            self.update_status(room, KVPoll.Success)
        else:
            self.fail_room(room, f"{outcome.failure_code}: {outcome.failure_reason}")

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        """SGLang's heartbeat lost a prefill server: its rooms fail (SGLang), its ranks are forgotten (here)."""
        with self.connection_lock:
            addresses = [rank_address(info) for key, infos in self.connection_pool.items()
                         if key.startswith(failed_bootstrap_addr) for info in infos if PDPROTO_PORT in info]
        super()._handle_node_failure(failed_bootstrap_addr)
        if self.decode_side is not None:
            self.decode_side.peer.drop(addresses)

    # -- decode, from SGLang Mooncake prefills (legacy_decode.py) ---------------------------

    def legacy_session(self) -> str:
        """The Mooncake session id of this rank's pools, which an SGLang Mooncake prefill writes into."""
        assert self.decode_side is not None
        return legacy_decode.session_id(self.decode_side.executor.endpoint(), self.settings.engine)

    def build_receiver_registration_message(self) -> list[bytes]:
        """SGLang's M1 for a Mooncake prefill rank, from this rank's ``KVArgs`` (legacy_decode.registration)."""
        return mooncake.build_registration(legacy_decode.registration(
            self.kv_args, host=self.local_ip, port=self.rank_port, session_id=self.legacy_session(),
            attn_tp_size=self.attn_tp_size, dcp=(self.dcp_size, self.dcp_rank)))

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int, kv_indices: Any,
                                        aux_index: int | None, state_indices: Any, decode_prefix_len: int | None,
                                        is_dummy: bool, device_kv_indices: Any = None) -> list[bytes]:
        """SGLang's M2 for one Mooncake prefill rank (legacy_decode.transfer_info)."""
        return mooncake.build_transfer_info(legacy_decode.transfer_info(
            room=bootstrap_room, host=self.local_ip, port=self.rank_port, session_id=self.legacy_session(),
            required_dst_info_num=required_dst_info_num, kv_indices=kv_indices, aux_index=aux_index,
            state_indices=state_indices, decode_prefix_len=decode_prefix_len, is_dummy=is_dummy,
            device_kv_indices=device_kv_indices))

    def _legacy_status(self, status: TransferStatus) -> None:
        """An M3 status: Success counted per prefill rank by SGLang; Failed fails the room (no reason on the wire)."""
        if status.state != common_pb2.TRANSFER_STATE_FAILED:
            self.apply_prefill_status(bootstrap_room=status.room, status=STATE_TO_KVPOLL[status.state],
                                      prefill_rank=status.prefill_rank)
        elif status.room in self.request_status:  # a cleared room keeps no failure record (SGLang's rule)
            self.fail_room(status.room, f"{Reason.TRANSFER_FAILED.name}: SGLang Mooncake prefill rank "
                           f"{status.prefill_rank} failed the request; Mooncake's status carries no reason, that "
                           "prefill's log has it")

    def _legacy_ack(self, ack: AbortAck) -> None:
        """An M5 ABORT_ACK: counted toward SGLang's deferred release as its ``handle_abort_ack_message`` does."""
        if not self.enable_deferred_decode_kv_release or not ack.HasField("prefill_rank"):
            return  # the 2-frame ack of a prefill without deferred release: SGLang consumes and ignores it
        if not ack.HasField("generation"):
            log.warning("pdproto: an ABORT_ACK without a generation from SGLang prefill rank %d is ignored, as "
                        "SGLang ignores it; its pages wait for the release timeout", ack.prefill_rank)
            return
        self.note_abort_ack(ack.room, ack.prefill_rank, ack.generation)

    def _legacy_lost(self, endpoint: str, rooms: set[int]) -> None:
        """An SGLang Mooncake prefill rank's connection is gone: its rooms in flight fail, its ranks are forgotten."""
        with self.connection_lock:
            stale = [key for key, infos in self.connection_pool.items()
                     if any(legacy_decode.rank_endpoint(info) == endpoint for info in infos)]
            for key in stale:
                del self.connection_pool[key]  # a later request registers anew
        failed = sorted(room for room in rooms if self.request_status.get(room) not in (None, KVPoll.Success))
        for room in failed:
            self.fail_room(room, f"{Reason.PEER_GONE.name}: SGLang Mooncake prefill rank {endpoint} closed its "
                           "connection with the request in flight (the prefill exited or restarted)")
        log.error("pdproto: SGLang Mooncake prefill rank %s is gone; %d requests failed", endpoint, len(failed))

    def peer_protocols(self) -> dict[str, str]:
        """Every prefill rank this decode rank spoke to -> its protocol: "pdproto" or "sglang-mooncake"."""
        if self.decode_side is None or self.legacy is None:
            return {}
        out = {rank.address: "pdproto" for rank in self.decode_side.peer.ranks}
        out.update(dict.fromkeys(self.legacy.seen, legacy_decode.PROTOCOL))
        return out

    # -- both ---------------------------------------------------------------------------

    def fail_room(self, room: int, reason: str) -> None:
        """Mark ``room`` Failed, keeping the first reason recorded for it (the root cause)."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)

    def close(self) -> None:
        """Stop this rank's service or streams and release its engine (tests, shutdown)."""
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()
        if self.status_pump is not None:
            self.status_pump.stop()
        if self.legacy is not None:
            self.legacy.close()
        for side in (self.prefill_side, self.decode_side):
            if side is not None:
                side.close()


def _device() -> str:
    """"cuda" when SGLang runs this rank on a GPU, else "cpu"."""
    from sglang.srt.runtime_context import get_device

    return "cuda" if str(get_device().device).startswith("cuda") else "cpu"


__all__ = ["PP_REFRESH_PER_ROOM_S", "PP_REFRESH_S", "PdprotoKVManager", "StatusPump", "rank_address"]
