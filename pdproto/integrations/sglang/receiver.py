"""The pdproto KV receiver: one per request on a decode rank (``decode_req.kv_receiver``).

``CommonKVReceiver`` keeps SGLang's own logic: the prefill ranks of a request come from
SGLang's bootstrap server (``init`` -> ``_setup_bootstrap_infos`` -> ``GET /route``), its
room status and failure records, the waiting timeout, the abort bookkeeping. This class
replaces the three places where Mooncake or NIXL would send ZMQ frames:

=============================  ===========================================================
``_register_kv_args``          ``Register`` with each prefill rank, once per rank per
                               process (the manager's ``DecodeSide.peer`` keeps the ranks)
``send_metadata``              ``SubmitTransfer`` to every prefill rank of the request,
                               dummies included (marked ``is_dummy``)
``_send_abort_notification``   ``Abort`` on every prefill rank; each answer (the rank's
                               in-flight chunk drained) is SGLang's ABORT_ACK
=============================  ===========================================================

Statuses arrive on the decode peer's per-rank streams, not here.

A request whose prefill ranks run SGLang's own Mooncake backend (their ``/route`` records have
no ``pdproto_port``) keeps SGLang's base methods for all three: the manager builds the frames
(``build_receiver_*_message``, pdproto.legacy) and this class only hands them the manager's
sockets (``_connect_to_bootstrap_server``) and builds the ABORT; the prefill's statuses
reach the manager's PULL socket (legacy_decode.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from pdproto.errors import ConfigError, PdprotoError, Reason
from pdproto.legacy import mooncake

from . import legacy_decode
from .bootstrap import PDPROTO_PORT
from .manager import rank_address

log = logging.getLogger(__name__)


class PdprotoKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """SGLang's KV receiver for the pdproto backend (module docstring)."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self._generation: int | None = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def _addresses(self) -> list[str]:
        return [rank_address(info) for info in self.bootstrap_infos or ()]

    def _fail(self, reason: str) -> None:
        self.kv_mgr.fail_room(self.bootstrap_room, reason)
        self.conclude_state = KVPoll.Failed

    def _legacy(self) -> bool:
        """Whether the request's prefill ranks run SGLang's own Mooncake backend (no ``pdproto_port``)."""
        return any(PDPROTO_PORT not in info for info in getattr(self, "bootstrap_infos", None) or ())

    def _endpoints(self) -> list[str]:
        return [legacy_decode.rank_endpoint(info) for info in self.bootstrap_infos or ()]

    def _connect_to_bootstrap_server(self, bootstrap_info: dict[str, Any]) -> Any:
        """The manager's socket to an SGLang Mooncake prefill rank (SGLang's base methods send on it)."""
        return self.kv_mgr.legacy.socket(legacy_decode.rank_endpoint(bootstrap_info))

    def _register_kv_args(self) -> bool:
        """Register this decode rank with every prefill rank of the request (each only once)."""
        if self.bootstrap_infos is None:
            return False
        if self._legacy():
            try:
                if not all(PDPROTO_PORT not in info for info in self.bootstrap_infos):
                    raise ConfigError(f"the prefill at {self.bootstrap_addr} has ranks with and without pdproto: run "
                                      "all its ranks with the same --disaggregation-transfer-backend",
                                      reason=Reason.CONFIG_INVALID, metadata={"bootstrapAddr": self.bootstrap_addr})
                self.kv_mgr.legacy_session()
            except PdprotoError as exc:
                self._fail(f"{exc.reason.name}: {exc.message}")
                return False
            for endpoint in self._endpoints():
                self.kv_mgr.legacy.note(endpoint, self.bootstrap_addr)
            return bool(super()._register_kv_args())  # M1 from build_receiver_registration_message
        for address in self._addresses():
            try:
                self.kv_mgr.decode_side.peer.connect(address)
            except PdprotoError as exc:
                self._fail(f"{exc.reason.name}: registration with prefill rank {address} failed: {exc.message}")
                return False
        return True

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None,
                      destination: Any = KVTransferDestination.DEVICE, device_kv_indices: Any = None) -> None:
        """Hand every prefill rank of the request its destination pages, aux slot and state slots."""
        if self.bootstrap_infos is None:
            self._fail(f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("the pdproto backend receives into device KV pools only")
        if self._legacy():
            if device_kv_indices is not None and self.kv_mgr.dcp_size > 1:
                # SGLang's Mooncake worker raises on this pair and dies with every request queued on it
                # (mooncake/conn.py:2615-2620, 2878-2884): refused here, for this request only.
                self._fail(f"{Reason.TOPOLOGY_BACKEND_UNSUPPORTED.name}: the prefill runs SGLang's own Mooncake "
                           "backend, which cannot write HiSparse device pages into a DCP decode; run the prefill with "
                           "--disaggregation-transfer-backend pdproto, or this decode without HiSparse")
                return
            self.kv_mgr.legacy.track(self.bootstrap_room, self._endpoints())
            try:  # M2 to every prefill rank (build_receiver_metadata_message); a failed send fails the room there
                super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination,
                                      device_kv_indices)
            except PdprotoError as exc:  # a destination SGLang's frames cannot carry
                self._fail(f"{exc.reason.name}: {exc.message}")
                self.invalidate_cached_bootstrap_infos()
            return
        try:
            self._generation = self.kv_mgr.decode_side.submit(
                self.bootstrap_room, self._addresses(), kv_indices, aux_index, state_indices, decode_prefix_len)
        except PdprotoError as exc:
            self._fail(f"{exc.reason.name}: {exc.message}")
            self.invalidate_cached_bootstrap_infos()
            return
        self.init_time = time.time()

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """Abort the request on every prefill rank; arm SGLang's acknowledgement count first."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            self._abort_generation = mgr.register_deferred_abort_room(room)
        armed = self._abort_generation
        if self._legacy():
            frames = mooncake.build_abort(legacy_decode.abort(room=room, host=mgr.local_ip, port=mgr.rank_port,
                                                              generation=armed))
            for info in self.bootstrap_infos or ():
                try:  # best effort, as SGLang's own: an unacknowledged abort waits for the release timeout
                    sock, lock = self._connect_to_bootstrap_server(info)
                    with lock:
                        sock.send_multipart(frames)
                except zmq.ZMQError as exc:
                    log.debug("pdproto: ABORT of room %d to %s failed: %s", room, info.get("rank_port"), exc)
            return

        def acked(position: int) -> None:
            if armed is not None:
                mgr.note_abort_ack(room, position, armed)

        mgr.decode_side.abort(room, self._addresses(), self._generation, acked)

    def clear(self) -> None:
        """SGLang's cleanup, and the room's fan-in forgotten."""
        super().clear()
        if self.bootstrap_room is not None:
            self.kv_mgr.decode_side.peer.forget(self.bootstrap_room)
            self.kv_mgr.legacy.forget(self.bootstrap_room)
