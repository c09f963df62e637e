"""A decode rank's half of the backend: its pools registered once, and SGLang's calls on the decode peer.

Built once per decode scheduler rank. Registering with every prefill rank SGLang's ``/route``
resolves for a request, submitting, folding the ranks' statuses into one outcome per room,
aborting and dropping ranks are the library's decode peer (``pdproto.client.DecodePeer``,
``peer``: the receiver and the manager call it directly). What remains here is the
translation: the pools into a ``KvRegistration`` (``pdproto.negotiation.registration``),
SGLang's page and slot arrays into each rank's ``TransferInfo``, SGLang's abort
acknowledgements by position; an outcome goes to ``on_outcome`` (the manager turns it into
SGLang's room status and failure reason).

SGLang's scheduler thread calls ``peer.connect`` (blocks for one Register per new prefill rank,
as SGLang's own receiver blocks on ``/route``), and ``submit``/``abort`` (they return at once;
a failure arrives as an outcome or an unacknowledged abort).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdproto import backends
from pdproto.client import DecodePeer, PrefillRank
from pdproto.client.peer import OutcomeHandler
from pdproto.errors import InvalidFieldError, Reason
from pdproto.negotiation.fanin import Outcome
from pdproto.negotiation.registration import make_registration
from pdproto.transfer import CredentialSlot
from pdproto.transfer.packing import unpack_buffers
from pdproto.v1 import common_pb2, transfer_pb2

from . import layout
from .engines import open_rank
from .settings import BackendSettings

log = logging.getLogger(__name__)


class DecodeSide:
    """One decode rank's registered pools and its decode peer (module docstring)."""

    def __init__(self, kv_args: Any, ranks: layout.Ranks, *, is_mla_backend: bool, settings: BackendSettings,
                 host: str, notify_port: int, device: str, on_outcome: OutcomeHandler) -> None:
        memory = open_rank(kv_args, settings, host=host, device=device)
        self.executor = memory.executor
        try:
            self.rings = layout.ring_sizes(kv_args)
            self.page_rows = layout.page_rows(kv_args)
            self.layout = layout.decode_layout(kv_args, ranks, is_mla_backend=is_mla_backend, notify_host=host,
                                               notify_port=notify_port)
            # Before the endpoint: NIXL's metadata lists the registered memory.
            self.credential = CredentialSlot(self.executor, memory.kv[0])
            self.registration = make_registration(self.layout, self.executor.endpoint(), memory.kv,
                                                  aux=memory.aux, state=memory.state)
            self.registration.credential_buffer.CopyFrom(self.credential.proto())
        except BaseException:
            self.executor.close()
            raise
        self.name = backends.by_name(settings.engine).identity_of(self.registration)
        """This rank's engine identity (``TransferInfo.peer_name``)."""
        self.kv = memory.kv
        self._on_outcome = on_outcome
        self.peer = DecodePeer(self.registration, token=settings.token, root_cert=settings.tls_root,
                               timeout=settings.rpc_timeout_s, on_outcome=self._outcome,
                               read_credential=self.credential.read)

    def _outcome(self, room: int, outcome: Outcome) -> None:
        """Put packed fan-in pages back in row order before SGLang hears that the room succeeded."""
        packed = self.peer.fan_in(room) if outcome.state == common_pb2.TRANSFER_STATE_SUCCESS else None
        if packed is not None:
            try:
                unpack_buffers(self.kv, packed.row_bytes, packed.pages, packed.page_size, packed.slices)
            except Exception as exc:  # noqa: BLE001 - the room must end, failed, not wait for SGLang's timeout
                log.exception("pdproto: room %d: reordering its packed fan-in pages failed", room)
                outcome = Outcome(common_pb2.TRANSFER_STATE_FAILED, Reason.INTERNAL.name,
                                  f"reordering the packed fan-in pages failed: {exc!r}")
        self._on_outcome(room, outcome)

    def submit(self, room: int, addresses: Sequence[str], kv_pages: Any, aux_index: int | None,
               state_indices: Sequence[Any] | None, prefix_len: int | None) -> int:
        """Hand every prefill rank of the request its destination; returns the request generation."""
        pages = np.asarray(kv_pages).reshape(-1).tolist()
        prefix = int(prefix_len or 0)
        if prefix % self.page_rows:
            raise InvalidFieldError("decode_prefix_len", f"a prefix of {prefix} tokens is not whole pages of"
                                    f" {self.page_rows}, the rows of DeepSeek-V4's compressed KV",
                                    metadata={"decodePrefixLen": prefix, "pageSize": self.page_rows})
        states = layout.state_items(self.rings, state_indices or ())

        def info(rank: PrefillRank) -> transfer_pb2.TransferInfo:
            out = transfer_pb2.TransferInfo(peer_name=self.name, dst_kv_pages=pages,
                                            notify_endpoint=self.registration.notify_endpoint,
                                            decode_prefix_len=prefix // self.page_rows)
            if aux_index is not None and not rank.dummy:
                out.dst_aux_index = int(aux_index)
            for s in states:
                out.dst_state_indices.add(indices=s)
            return out

        return self.peer.submit(room, addresses, info)

    def abort(self, room: int, addresses: Sequence[str], generation: int | None,
              on_ack: Callable[[int], None]) -> None:
        """Abort the request on every prefill rank; ``on_ack(i)`` once ``addresses[i]`` drained it.

        A request never submitted (no generation) has nothing in flight: acknowledged at once. An
        abort a rank refused stays unacknowledged: SGLang holds the pages until its release timeout.
        """
        if generation is None:
            for i in range(len(addresses)):
                on_ack(i)
            return
        for i, future in enumerate(self.peer.abort(room, generation, addresses)):
            future.add_done_callback(functools.partial(_ack_if_drained, on_ack, i))

    def close(self) -> None:
        """Deregister from every prefill rank, release the engine."""
        try:
            self.peer.close()
        finally:
            self.executor.close()


def _ack_if_drained(on_ack: Callable[[int], None], i: int, future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        on_ack(i)


__all__ = ["DecodeSide"]
