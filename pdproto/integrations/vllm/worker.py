"""A vLLM worker's half of the connector: its KV cache registered, and the sends or receives of each step.

``PrefillWorker`` (``kv_producer``) runs pdproto's handshake service over the blocks vLLM
registers (the prefill engine API, ``pdproto_server/README.md``, as the SGLang backend's
``prefill_side`` does): a request the scheduler finished (``Send``) is reported as one last
chunk once a decode submitted for its room (from the decode's prefix on), and its blocks
are handed back to vLLM (``finished_sending``) when its room is SUCCESS or FAILED, or its
lease ends with no decode in sight.

``DecodeWorker`` (``kv_consumer``) is a ``pdproto.client.DecodePeer`` over its blocks: a
request to receive (``Recv``) is submitted to every prefill rank of its ``kv_transfer_params``,
and its outcome becomes ``finished_recving`` (and ``failed_recving`` when it failed).

vLLM calls both from its worker thread, once per step (``get_transfer_results``); the
service and the peer run on their own event-loop threads. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdproto import backends
from pdproto.client import DecodePeer, PrefillRank
from pdproto.errors import PdprotoError, Reason
from pdproto.negotiation.fanin import Outcome
from pdproto.negotiation.registration import make_registration
from pdproto.negotiation.senders import target_tp_ranks
from pdproto.transfer import CredentialSlot, TransferExecutor, at_address, create_executor
from pdproto.transfer.address import advertise_host
from pdproto.transfer.packing import unpack_buffers
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_server.app import ServerConfig, ServiceThread
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import KvSource, PrefillEngine
from pdproto_server.registry import Limits

from ..sglang.layout import host_port
from ..sglang.settings import BackendSettings
from . import layout
from .sglang_peer import MetadataRows

log = logging.getLogger(__name__)

_DONE = (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED)


@dataclass(frozen=True)
class Send:
    """A finished prefill request whose blocks wait for its decode (scheduler -> prefill workers)."""

    request_id: str
    room: int
    blocks: tuple[int, ...]
    """Its blocks (the attention group's), in token order."""
    num_tokens: int
    """Tokens computed (what the decode loads)."""
    lease_s: float
    """How long the blocks wait for a decode to submit."""
    first_token: int | None = None
    """The token vLLM sampled at the end of the prefill (an SGLang decode's metadata row carries it)."""
    state: tuple[int, ...] = ()
    """Per Mamba group, the block holding its running state."""


@dataclass(frozen=True)
class Recv:
    """A decode request whose blocks wait for its prefill's bytes (scheduler -> decode workers)."""

    request_id: str
    room: int
    addresses: tuple[str, ...]
    """host:port of every prefill rank of the request."""
    blocks: tuple[int, ...]
    """The blocks allocated for the tokens after the prefix, in token order."""
    prefix: int
    """Tokens this decode computed itself (local prefix-cache hits)."""
    state: tuple[int, ...] = ()
    """Per Mamba group, the block its running state goes to."""


@dataclass
class Results:
    """What one step reports to vLLM."""

    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    """Receives that failed (also in ``received``, as vLLM wants them)."""


def open_executor(settings: BackendSettings, cache: layout.KvCache, kv_caches: Mapping[str, Any], *, on_device: bool,
                  gpu_id: int) -> tuple[TransferExecutor, tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
    """An executor of ``settings.engine`` with every layer of ``cache`` registered; the buffers in layer order,
    and per Mamba group its layers' (a region its group overlays with the attention group's is registered once)."""
    executor = create_executor(settings.engine, staging_bytes=settings.staging_mb << 20,
                               device=f"cuda:{gpu_id}" if on_device else "cpu")
    try:
        kv, state = layout.regions(cache, kv_caches, on_device=on_device)
        unique = {r: at_address(r.ptr, r.length, kind=r.kind, device=gpu_id)
                  for r in (*kv, *(r for g in state for r in g))}
        executor.register_memory(tuple(unique.values()))
    except BaseException:
        executor.close()
        raise
    return executor, tuple(unique[r] for r in kv), tuple(tuple(unique[r] for r in g) for g in state)


@dataclass
class _Held:
    send: Send
    until: float
    submitted: bool = False
    slot: int | None = None
    """Its SGLang metadata row (``MetadataRows``)."""


class PrefillWorker:
    """One prefill worker's registered KV cache, prefill engine and handshake service (module docstring)."""

    def __init__(self, settings: BackendSettings, cache: layout.KvCache, kv_caches: Mapping[str, Any],
                 ranks: layout.Ranks, *, on_device: bool, gpu_id: int, port: int,
                 match_timeout_s: float, sglang_rows: bool = False) -> None:
        self.cache = cache
        self.executor, buffers, state = open_executor(settings, cache, kv_caches, on_device=on_device, gpu_id=gpu_id)
        try:
            host = advertise_host()
            info = layout.server_info(cache, ranks, host=host, port=port,
                                      backend=backends.by_name(settings.engine).enum)
            self.rows = MetadataRows(self.executor) if sglang_rows else None
            """SGLang decodes' metadata rows (``sglang_peer``), when this prefill serves them."""
            if self.rows is not None:
                info.aux_entries.extend(self.rows.entries())
            self.engine = PrefillEngine(KvSource(buffers, info, aux=() if self.rows is None else self.rows.buffers,
                                                 state=state), self.executor, prefill_rank=ranks.tp[1])
            config = ServerConfig(listen=host_port(host, port), token=settings.token,
                                  operator_token=settings.operator_token,
                                  allow_unauthenticated=settings.allow_unauthenticated,
                                  tls_cert=settings.tls_cert, tls_key=settings.tls_key)
            # A decode submits when vLLM may still be queueing or computing the request: its submit
            # waits for the chunk as long as a decode waits for its bytes.
            self.service = ServiceThread(HandshakeCore(self.engine, limits=Limits(match_timeout=match_timeout_s)),
                                         config,
                                         name=f"pdproto-vllm-prefill-{ranks.tp[1]}")
            self.port = self.service.start()
        except BaseException:
            self.executor.close()
            raise
        self.virtual_page = cache.block_size * ranks.dcp[0]
        self._held: dict[int, _Held] = {}
        log.info("pdproto: vLLM prefill worker %d serves %s (%s)", ranks.tp[1], host_port(host, self.port),
                 settings.engine)

    def hold(self, sends: Sequence[Send]) -> None:
        """Take finished requests' blocks until their decode has them (or their lease ends)."""
        now = time.monotonic()
        for s in sends:
            earlier = self._held.get(s.room)
            if earlier is not None and earlier.slot is not None and self.rows is not None:
                self.rows.free(earlier.slot)  # the room's request again: its row is rewritten below
            held = self._held[s.room] = _Held(s, now + s.lease_s)
            if self.rows is not None and s.first_token is not None:
                held.slot = self.rows.write(s.room, s.first_token)

    def step(self) -> Results:
        """Report the chunks whose decode submitted; the requests whose blocks are free again.

        A request's blocks are held until its room is SUCCESS or FAILED, or its lease ends: then
        the room is aborted (its decode sees why) and the blocks go back to vLLM.
        """
        out = Results()
        now = time.monotonic()
        for room, held in list(self._held.items()):
            if not held.submitted:
                prefix = self.engine.decode_prefix_len(room)
                if prefix is not None:
                    held.until = max(held.until, now + held.send.lease_s)  # the transfer's own time
                    self._submit(held, prefix)
            if self.engine.status(room).state not in _DONE:
                if now < held.until:
                    continue
                self.engine.abort(room, f"request {held.send.request_id}: " + (
                    "its transfer did not end" if held.submitted else "no decode submitted for it")
                    + f" within its {held.send.lease_s:g} s lease")
            out.sent.add(held.send.request_id)
            if held.slot is not None and self.rows is not None:
                self.rows.free(held.slot)
            self.engine.release_room(room)
            del self._held[room]
        return out

    def _submit(self, held: _Held, prefix: int) -> None:
        s = held.send
        held.submitted = True
        if prefix % self.virtual_page:
            # The planner would refuse it for every chunk: say why once, for the decode to see.
            self.engine.abort(s.room, f"the decode's prefix of {prefix} tokens is not a multiple of this "
                                      f"prefill's block of {self.virtual_page} tokens")
            return
        if self.rows is not None and held.slot is None:
            self.engine.abort(s.room, f"request {s.request_id}: " + (
                "no first token to write into its SGLang metadata row" if s.first_token is None
                else f"all {self.rows.slots} SGLang metadata rows are taken"))
            return
        skip = prefix // self.virtual_page
        try:
            self.engine.submit_chunk(s.room, list(s.blocks[skip:]), max(s.num_tokens - prefix, 0), True,
                                     aux_slot=held.slot,
                                     state_slots=[(b,) for b in s.state] if self.cache.mamba else None)
        except PdprotoError as exc:
            self.engine.abort(s.room, f"{exc.reason.name}: {exc.message}")

    @property
    def pending(self) -> int:
        """Requests whose blocks are still held."""
        return len(self._held)

    def close(self) -> None:
        """Drain and stop the service, then release the engine."""
        self.service.stop()
        self.executor.close()


class DecodeWorker:
    """One decode worker's registered KV cache and decode peer (module docstring)."""

    def __init__(self, settings: BackendSettings, cache: layout.KvCache, kv_caches: Mapping[str, Any],
                 ranks: layout.Ranks, *, on_device: bool, gpu_id: int, engine_id: str, timeout_s: float) -> None:
        self.ranks = ranks
        self.executor, buffers, state = open_executor(settings, cache, kv_caches, on_device=on_device, gpu_id=gpu_id)
        self.kv = buffers
        try:
            self.layout = layout.decode_layout(cache, ranks, notify_host=advertise_host(),
                                               notify_port=layout.notify_port(engine_id, ranks.tp[1]),
                                               gpu_id=gpu_id)
            # Before the endpoint: NIXL's metadata lists the registered memory.
            self.credential = CredentialSlot(self.executor, buffers[0])
            self.registration = make_registration(self.layout, self.executor.endpoint(), buffers, state=state)
            self.registration.credential_buffer.CopyFrom(self.credential.proto())
        except BaseException:
            self.executor.close()
            raise
        self.name = backends.by_name(settings.engine).identity_of(self.registration)
        self._lock = threading.Lock()
        self._outcomes: dict[int, Outcome] = {}
        """Terminal outcomes not yet reported (the peer's loop thread adds, the worker takes)."""
        self._rooms: dict[int, tuple[str, int | None]] = {}
        """Request id and generation of each room submitted and not yet reported."""
        self.timeout_s = timeout_s
        """How long a request waits for its bytes (then ``DecodePeer.wait`` probes its prefill ranks)."""
        self._deadlines: dict[int, float] = {}
        self.peer = DecodePeer(self.registration, token=settings.token, root_cert=settings.tls_root,
                               timeout=settings.rpc_timeout_s, on_outcome=self._on_outcome,
                               read_credential=self.credential.read)

    def _on_outcome(self, room: int, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes[room] = outcome

    def receive(self, recvs: Sequence[Recv]) -> None:
        """Submit each request's blocks to its prefill ranks (a refusal fails the request, reported next step)."""
        for r in recvs:
            self._rooms[r.room] = (r.request_id, None)
            self._deadlines[r.room] = time.monotonic() + self.timeout_s

            def info(rank: PrefillRank, r: Recv = r) -> transfer_pb2.TransferInfo:
                return transfer_pb2.TransferInfo(peer_name=self.name, dst_kv_pages=list(r.blocks),
                                                  notify_endpoint=self.registration.notify_endpoint,
                                                  decode_prefix_len=r.prefix,
                                                  dst_state_indices=[transfer_pb2.StateIndices(indices=[b])
                                                                     for b in r.state])
            try:
                # Only the prefill ranks that feed this rank (vLLM's TP rule, as SGLang's decode asks): another
                # refuses the registration (TOPOLOGY_NOT_A_SENDER), and each frees its blocks on its own decodes' submits.
                senders = target_tp_ranks(len(r.addresses), *self.ranks.tp)
                self._rooms[r.room] = (r.request_id, self.peer.submit(r.room, [r.addresses[i] for i in senders], info))
            except PdprotoError as exc:
                log.warning("pdproto: request %s: %s", r.request_id, exc)
                self._on_outcome(r.room, Outcome(common_pb2.TRANSFER_STATE_FAILED, exc.reason.name, exc.message))

    def cancel(self, request_ids: Sequence[str]) -> None:
        """Abort these requests' rooms on their prefill ranks (vLLM aborted them); each ends as failed.

        A room ends once every rank drained it: by the FAILED status a rank sends, or, where a rank
        had nothing left to abort (and so sends none), when the last abort answered.
        """
        for room, (request_id, generation) in list(self._rooms.items()):
            if request_id in request_ids and generation is not None:
                futures = self.peer.abort(room, generation)
                left = [len(futures)]

                def drained(_: object, room: int = room, left: list[int] = left) -> None:
                    with self._lock:
                        left[0] -= 1
                        if left[0] == 0:
                            self._outcomes.setdefault(room, Outcome(
                                common_pb2.TRANSFER_STATE_FAILED, Reason.ABORTED.name,
                                "vLLM aborted the request; every prefill rank drained it"))
                for future in futures:
                    future.add_done_callback(drained)

    def step(self) -> Results:
        """The requests whose bytes landed or failed since the last step, or waited past their deadline."""
        now = time.monotonic()
        for room in [r for r, t in self._deadlines.items() if t <= now]:
            del self._deadlines[room]
            # A prefill rank that died keeps its status stream retrying; at the deadline the peer asks
            # each silent rank once more and ends the room either way (on_outcome).
            try:
                self.peer.wait(room, 0.0)
            except PdprotoError as exc:
                self._on_outcome(room, Outcome(common_pb2.TRANSFER_STATE_FAILED, exc.reason.name, exc.message))
        with self._lock:
            done, self._outcomes = self._outcomes, {}
        out = Results()
        for room, outcome in done.items():
            known = self._rooms.pop(room, None)
            if known is None:
                continue
            request_id, generation = known
            self._deadlines.pop(room, None)
            if outcome.state == common_pb2.TRANSFER_STATE_SUCCESS:
                outcome = self._unpack(room, outcome)
            if outcome.state != common_pb2.TRANSFER_STATE_SUCCESS:
                log.warning("pdproto: request %s failed: %s: %s", request_id, outcome.failure_code,
                            outcome.failure_reason)
                out.failed.add(request_id)
                if generation is not None:
                    # vLLM reuses the blocks now: no other prefill rank may still write them.
                    self.peer.abort(room, generation)
            self.peer.forget(room)
            out.received.add(request_id)
        return out

    def _unpack(self, room: int, outcome: Outcome) -> Outcome:
        """Put the blocks its prefill ranks wrote packed back in row order (docs/protocol.md section 3, packed
        fan-in); the room's outcome, failed if that failed."""
        packed = self.peer.fan_in(room)
        if packed is None:
            return outcome
        try:
            unpack_buffers(self.kv, packed.row_bytes, packed.pages, packed.page_size, packed.slices)
        except Exception as exc:  # noqa: BLE001 - vLLM's worker thread must not die of it; the request fails
            log.exception("pdproto: room %d: reordering its packed fan-in blocks failed", room)
            return Outcome(common_pb2.TRANSFER_STATE_FAILED, Reason.INTERNAL.name,
                           f"reordering the packed fan-in blocks failed: {exc!r}")
        return outcome

    @property
    def pending(self) -> int:
        """Requests submitted and not yet reported."""
        return len(self._rooms)

    def close(self) -> None:
        """Deregister from every prefill rank, release the engine."""
        try:
            self.peer.close()
        finally:
            self.executor.close()


__all__ = ["DecodeWorker", "PrefillWorker", "Recv", "Results", "Send", "open_executor"]
