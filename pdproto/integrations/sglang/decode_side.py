"""A decode rank's half of the backend: its pools registered once, one client and status stream per prefill rank.

Built once per decode scheduler rank. Every prefill rank SGLang's ``/route`` resolves for a
request becomes a *peer*: one ``AsyncHandshakeClient``, one ``Register`` (the decode's whole
registration, built by ``pdproto.negotiation.registration``), the negotiated sender set (which tells
whether that rank writes anything here, and how many decode ranks it serves per request),
and one long-lived status stream. Requests submit their destination to each peer of the
request; the statuses of the non-dummy peers are folded by ``pdproto.negotiation.fanin.FanInTracker``;
a terminal outcome is handed to ``on_outcome`` once (the manager turns it into SGLang's
room status and failure reason).

The network calls run on this side's own event loop in a thread. SGLang's scheduler thread
calls ``connect`` (blocks for one Register per new prefill rank, as SGLang's own receiver
blocks on ``/route``), and ``submit``/``abort`` (they return at once; a failure arrives as
an outcome or an unacknowledged abort).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproto import backends
from pdproto.client import AsyncHandshakeClient
from pdproto.errors import DeadlineExceededError, PdprotoError, Reason, error_for
from pdproto.negotiation.fanin import FanInTracker, Outcome
from pdproto.negotiation.registration import make_registration
from pdproto.negotiation.senders import SenderSet
from pdproto.v1 import common_pb2, transfer_pb2

from . import layout
from .engines import open_rank
from .settings import BackendSettings

log = logging.getLogger(__name__)

WATCH_S = 300.0
"""Deadline of one status stream; it is opened again at once when it passes. A rank whose stream
is broken then (its process died while its bootstrap server, so SGLang's heartbeat, lives on) ends
UNAVAILABLE and is dropped as lost: within SGLang's own waiting timeout (300 s), not an hour later."""
RELEASE_S = 2.0
"""Longest wait for a dropped prefill rank to answer our ``Deregister`` (it may be dead)."""
RETRY_AFTER_S = 5.0
"""A prefill rank whose registration failed is not tried again for this long: its requests fail at
once with that failure, where each would block SGLang's scheduler thread for the whole Register
deadline (a dead or unreachable prefill would stall every decode batch, request after request)."""


@dataclass
class Peer:
    """One prefill rank this decode rank registered with."""

    address: str
    """host:port of the prefill rank's handshake service (SGLang ``rank_ip:rank_port``)."""
    index: int
    """This side's number for the rank (fan-in key; SGLang's abort-ack key)."""
    client: AsyncHandshakeClient
    peer_id: str
    senders: SenderSet
    """The prefill ranks this decode rank hears from, as that rank computed them."""
    dummy: bool
    """That rank writes nothing here: submitted to (``is_dummy``), not waited for."""
    rooms: set[int] = field(default_factory=set)
    """Rooms waiting for this rank's terminal status."""
    watch: asyncio.Task[None] | None = None


OutcomeHandler = Callable[[int, Outcome], None]


class DecodeSide:
    """One decode rank's registered pools, peers and status streams (module docstring)."""

    def __init__(self, kv_args: Any, ranks: layout.Ranks, *, is_mla_backend: bool, settings: BackendSettings,
                 host: str, notify_port: int, device: str, on_outcome: OutcomeHandler) -> None:
        self.settings = settings
        self.on_outcome = on_outcome
        memory = open_rank(kv_args, settings, host=host, device=device)
        self.executor = memory.executor
        try:
            self.layout = layout.decode_layout(kv_args, ranks, is_mla_backend=is_mla_backend, notify_host=host,
                                               notify_port=notify_port)
            self.registration = make_registration(self.layout, self.executor.endpoint(), memory.kv,
                                                  aux=memory.aux, state=memory.state)
        except BaseException:
            self.executor.close()
            raise
        self.name = backends.by_name(settings.engine).identity_of(self.registration)
        """This rank's engine identity (``TransferInfo.peer_name``)."""
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        """Guards ``_peers``; never held while waiting for the loop (the loop takes it too)."""
        self._connecting = threading.Lock()
        """Serializes registrations (callers' threads only), so a rank is registered once."""
        self._failed: dict[str, tuple[float, PdprotoError]] = {}
        """Prefill ranks whose registration failed: until when they are not tried again, and why."""
        self._numbers = itertools.count()
        self._generations = itertools.count(1)
        self._tracker = FanInTracker()
        self._lock = threading.Lock()
        """Guards the tracker and the peers' room sets (scheduler thread and loop thread)."""
        self._done: set[int] = set()
        self._closing: dict[str, asyncio.Task[None]] = {}
        """Dropped peers being released (deregistered, their clients closed), by address (loop only): a
        new registration waits for it, or a prefill that is in fact alive would read this live rank as an
        impostor (IDENTITY_IN_USE); an abort on that rank is acknowledged once it is done."""
        self._submits: dict[int, dict[str, concurrent.futures.Future[None]]] = {}
        """Submits by room and rank: an abort of the room waits for its submit, so the rank never
        sees the abort first (calls on one channel may be served out of order)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdproto-decode", daemon=True)
        self._thread.start()

    # -- peers --------------------------------------------------------------------------

    def connect(self, address: str) -> Peer:
        """The peer at ``address``, registering with it first if needed; raises ``PdprotoError``."""
        with self._connecting:
            with self._peers_lock:
                peer = self._peers.get(address)
            if peer is not None:
                return peer
            failed = self._failed.get(address)
            now = time.monotonic()
            if failed is not None and now < failed[0]:
                until, exc = failed
                raise error_for(exc.reason, f"registration with prefill rank {address} failed "
                                f"{RETRY_AFTER_S - (until - now):.1f} s ago and is retried after "
                                f"{RETRY_AFTER_S:g} s: {exc.message}", metadata={"address": address})
            try:
                registered: Peer = self._run(self._register(address))
            except PdprotoError as exc:
                self._failed[address] = (time.monotonic() + RETRY_AFTER_S, exc)
                raise
            self._failed.pop(address, None)
            with self._peers_lock:
                self._peers[address] = registered
            return registered

    async def _register(self, address: str) -> Peer:
        s = self.settings
        await self._released(address, timeout=s.rpc_timeout_s)
        client = AsyncHandshakeClient(address, token=s.token, root_cert=s.tls_root, timeout=s.rpc_timeout_s)
        try:
            result = await client.register(self.registration)
        except BaseException:
            await client.close()
            raise
        senders = SenderSet.from_proto(result.senders)
        me = senders.senders[result.senders.self_index] if senders.senders else None
        peer = Peer(address, next(self._numbers), client, result.peer_id, senders,
                    dummy=me is not None and me.dummy)
        peer.watch = asyncio.get_running_loop().create_task(self._watch(peer), name=f"watch-{address}")
        log.info("pdproto: registered with prefill rank %s as %s (mode %d%s)", address, peer.peer_id,
                 result.mode, ", dummy" if peer.dummy else "")
        return peer

    async def _watch(self, peer: Peer) -> None:
        """The peer's status stream for as long as the peer is ours: every status into the fan-in."""
        while True:
            try:
                async for status in peer.client.watch_status(peer.peer_id, timeout=WATCH_S):
                    self._apply(peer, status)
            except asyncio.CancelledError:
                return
            except PdprotoError as exc:
                if exc.reason is Reason.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: open it again (it starts with a snapshot)
                self._lost(peer, exc.reason.name, exc.message)
                return
            except Exception as exc:  # noqa: BLE001 - the rooms waiting on this rank must still end
                log.exception("pdproto: status stream of %s broke", peer.address)
                self._lost(peer, Reason.INTERNAL.name, repr(exc))
                return
            # The server ends a stream only when it dropped the peer or shuts down.
            self._lost(peer, Reason.UNAVAILABLE.name, "the prefill rank ended its status stream")
            return

    def _apply(self, peer: Peer, status: transfer_pb2.TransferStatus) -> None:
        with self._lock:
            outcome = self._tracker.update(status, sender=peer.index)
            if status.state in (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED):
                peer.rooms.discard(status.room)
            if outcome is None or not outcome.terminal or status.room in self._done:
                return
            self._done.add(status.room)
        self.on_outcome(status.room, outcome)

    def _lost(self, peer: Peer, code: str, message: str) -> None:
        """The peer's stream broke: fail what waits on it, and register again on next use."""
        log.warning("pdproto: status stream of prefill rank %s ended: %s: %s", peer.address, code, message)
        with self._peers_lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        with self._lock:
            rooms, peer.rooms = set(peer.rooms), set()
        for room in rooms:
            self._fail(room, code, f"lost prefill rank {peer.address}: {message}")
        self._retire(peer)

    def _fail(self, room: int, code: str, reason: str) -> None:
        with self._lock:
            outcome = self._tracker.fail(room, code, reason)
            if outcome is None or room in self._done:
                return
            self._done.add(room)
        self.on_outcome(room, outcome)

    def drop(self, addresses: Sequence[str]) -> None:
        """Forget these prefill ranks (SGLang found their server dead); their streams are cancelled."""
        with self._peers_lock:
            gone = [self._peers.pop(a) for a in addresses if a in self._peers]
        for peer in gone:
            self.loop.call_soon_threadsafe(self._retire, peer)

    def _retire(self, peer: Peer) -> None:
        """Stop the peer's status stream (unless it is the caller) and release it in the background (loop only)."""
        if peer.watch is not asyncio.current_task():
            self._cancel(peer)
        self._closing[peer.address] = self.loop.create_task(self._release(peer), name=f"release-{peer.address}")

    async def _release(self, peer: Peer) -> None:
        """Deregister a dropped peer, then close its client.

        SGLang drops a rank on missed heartbeats, and may be wrong: a prefill that is alive
        would go on writing the rooms SGLang just failed and may reuse. ``Deregister`` returns
        once that rank's in-flight chunks drained, so afterwards it writes nothing here, and
        it frees this rank's identity at once for the next registration. A rank that is
        really gone answers with an error (or not in time): nothing is left to stop there.
        """
        try:
            await peer.client.deregister(peer.peer_id, timeout=min(RELEASE_S, self.settings.rpc_timeout_s))
        except PdprotoError as exc:
            log.info("pdproto: deregistering from dropped prefill rank %s: %s", peer.address, exc.reason.name)
        except Exception:  # noqa: BLE001 - the client must still close
            log.exception("pdproto: deregistering from dropped prefill rank %s failed", peer.address)
        finally:
            await peer.client.close()

    @staticmethod
    def _cancel(peer: Peer) -> None:
        if peer.watch is not None:
            peer.watch.cancel()

    # -- requests -----------------------------------------------------------------------

    def submit(self, room: int, addresses: Sequence[str], kv_pages: Any, aux_index: int | None,
               state_indices: Sequence[Any] | None, prefix_len: int | None) -> int:
        """Hand every prefill rank of the request its destination; returns the request generation.

        Registers with a rank first where needed (a rank dropped since the request resolved it).
        """
        generation = next(self._generations)
        peers = [self.connect(a) for a in addresses]
        live = [p.index for p in peers if not p.dummy]
        with self._lock:
            self._done.discard(room)
            self._tracker.expect(room, generation, live or [peers[0].index])
            for p in peers:
                if not p.dummy:
                    p.rooms.add(room)
        pages = np.asarray(kv_pages).reshape(-1).tolist()
        futures = self._submits[room] = {}
        for p in peers:
            info = transfer_pb2.TransferInfo(
                room=room, generation=generation, peer_name=self.name, dst_kv_pages=pages,
                notify_endpoint=self.registration.notify_endpoint,
                required_dst_info_num=p.senders.decode_ranks_per_prefill_rank or 1,
                decode_prefix_len=int(prefix_len or 0), is_dummy=p.dummy)
            if aux_index is not None and not p.dummy:
                info.dst_aux_index = int(aux_index)
            for s in state_indices or ():
                info.dst_state_indices.add(indices=[] if s is None else np.asarray(s).reshape(-1).tolist())
            futures[p.address] = asyncio.run_coroutine_threadsafe(self._submit(p, info), self.loop)
        return generation

    async def _submit(self, peer: Peer, info: transfer_pb2.TransferInfo) -> None:
        try:
            status = await peer.client.submit_transfer(peer.peer_id, info)
        except PdprotoError as exc:
            self._fail(info.room, exc.reason.name, f"prefill rank {peer.address} refused room {info.room}: "
                                                   f"{exc.message}")
            return
        except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not vanish in a future
            log.exception("pdproto: submit of room %d to %s failed", info.room, peer.address)
            self._fail(info.room, Reason.INTERNAL.name, f"submit to prefill rank {peer.address} failed: {exc!r}")
            return
        self._apply(peer, status)

    def abort(self, room: int, addresses: Sequence[str], generation: int | None,
              on_ack: Callable[[int], None]) -> None:
        """Abort the request on every prefill rank; ``on_ack(i)`` once ``addresses[i]`` drained it.

        A rank that never got the request has nothing in flight: acknowledged at once. One
        dropped since is acknowledged once its release (``_release``) is done.
        """
        for i, address in enumerate(addresses):
            peer = self._peers.get(address)
            if generation is None:
                on_ack(i)
            elif peer is None:
                asyncio.run_coroutine_threadsafe(self._ack_released(address, functools.partial(on_ack, i)), self.loop)
            else:
                acked = functools.partial(on_ack, i)
                submitted = self._submits.get(room, {}).get(address)
                asyncio.run_coroutine_threadsafe(self._abort(peer, room, generation, acked, submitted), self.loop)

    async def _ack_released(self, address: str, acked: Callable[[], None]) -> None:
        """Acknowledge an abort on a dropped rank once its release is done (at once if there is none)."""
        await self._released(address)
        acked()

    async def _released(self, address: str, timeout: float | None = None) -> None:
        """Wait for the release of the peer dropped at ``address``, if there is one (loop only)."""
        closing = self._closing.get(address)
        if closing is not None:
            await asyncio.wait([closing], timeout=timeout)

    async def _abort(self, peer: Peer, room: int, generation: int, acked: Callable[[], None],
                     submitted: concurrent.futures.Future[None] | None) -> None:
        if submitted is not None:
            await asyncio.wait([asyncio.wrap_future(submitted)])
        try:
            await peer.client.abort(peer.peer_id, room, generation)
        except PdprotoError as exc:
            if exc.reason not in (Reason.REQUEST_NOT_FOUND, Reason.STALE_GENERATION, Reason.PEER_NOT_FOUND):
                log.warning("pdproto: abort of room %d on %s failed: %s", room, peer.address, exc)
                return  # not acknowledged: SGLang holds the pages until its release timeout
        except Exception:  # noqa: BLE001 - logged; unacknowledged, as above
            log.exception("pdproto: abort of room %d on %s failed", room, peer.address)
            return
        acked()

    def forget(self, room: int) -> None:
        """Stop tracking ``room`` (SGLang cleared it); a submit still on its way is kept for an abort."""
        submits = self._submits.pop(room, None)
        pending = {a: f for a, f in (submits or {}).items() if not f.done()}
        if pending:
            # SGLang clears a failed room before it sends the abort (decode.py pop_transferred:
            # failure_exception, then ensure_abort_notified): the abort must still wait for these,
            # or a rank could see it first, acknowledge it, and then write pages SGLang freed.
            self._submits[room] = pending
            for future in pending.values():
                future.add_done_callback(functools.partial(self._submitted, room, pending))
        with self._lock:
            self._tracker.forget(room)
            self._done.discard(room)
            for peer in list(self._peers.values()):
                peer.rooms.discard(room)

    def _submitted(self, room: int, pending: dict[str, concurrent.futures.Future[None]], _: object) -> None:
        """A kept submit of a forgotten room ended: forget the room's submits once all have."""
        if self._submits.get(room) is pending and all(f.done() for f in pending.values()):
            self._submits.pop(room, None)

    # -- life cycle -----------------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for it; a wait past the deadline is DEADLINE_EXCEEDED."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(self.settings.rpc_timeout_s * 3)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceededError("the pdproto decode loop did not answer in time",
                                        reason=Reason.DEADLINE_EXCEEDED) from None

    def close(self) -> None:
        """Deregister from every prefill rank, stop the loop, release the engine."""
        async def shutdown() -> None:
            for peer in list(self._peers.values()):
                self._cancel(peer)
                try:
                    await peer.client.deregister(peer.peer_id, timeout=2.0)
                except PdprotoError:
                    pass
                await peer.client.close()
            if self._closing:
                await asyncio.wait(self._closing.values(), timeout=2.0)

        if self._thread.is_alive():
            try:
                self._run(shutdown())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(5)
        self.executor.close()


__all__ = ["DecodeSide", "Peer", "WATCH_S"]
