"""The handshake service's state machine, free of gRPC: peers, requests, aborts, draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pdproto.errors import (
    DeadlineExceededError,
    DuplicateRequestError,
    IdentityInUseError,
    InvalidFieldError,
    NotFoundError,
    PdprotoError,
    Reason,
    RequestFailedError,
    ResourceLimitError,
    ShuttingDownError,
)
from pdproto.negotiation.topology import Decision, Rejection
from pdproto.v1 import (
    handshake_service_pb2 as hs,
    registration_pb2,
    server_info_pb2,
    transfer_pb2,
)

from .engine import PrefillEngine
from .expiry import Deadlines
from .feed import StatusFeed
from .lanes import Lane, LanePool
from .metrics import ServiceMetrics
from .registry import Allowance, Limits, Peer, PeerRegistry, Request, Snapshot, StatusSink, identity_of
from .runner import TransferRunner, drained
from .validate import Bounds, check_registration, check_transfer, page_limit, registration_entries
from .verdicts import Verdicts, result_for

log = logging.getLogger("pdproto_server.core")
Verdict = tuple[Decision, server_info_pb2.NegotiationResult]
"""An accepted registration's decision and its ``NegotiationResult`` without a peer id (shared: copy it)."""
LARGE_PAGE_LIST = 4096
"""Destination pages from which a request keeps its list as an int64 array (1M pages over 64 chunks:
about 230 ms of server CPU converting the protobuf list again at each chunk)."""
HEAVY_ENTRIES = 1024
"""A registration listing more buffers and tensors than this is checked and negotiated off the loop;
real ones list a few hundred at most (two per layer for MHA, plus state tensors)."""

JUDGE_BURST, JUDGE_RATE = 4 * Bounds.REGIONS, Bounds.REGIONS // 4
"""Buffers and tensors of large registrations the judge takes at once, and per second after that (about
9 µs of its time each): a fleet's decodes registering together fit, and a token holder registering large
ones in a loop keeps the judge busy about 15 % of the time, not all of it."""
MAX_JUDGED = 4
"""Registrations on or waiting for the judge thread at once; more are refused TOO_MANY_REGISTRATIONS. Each
holds its parsed message while it waits, and costs the judge up to a few hundred ms for a few hundred KB
sent: unbounded, a token holder sending them concurrently grew the queue (and memory) without limit."""

IDENTITY_GRACE_S = 1.0
"""How long a registration naming a live peer waits for that peer's streams to end (a client closing them)."""
IDENTITY_POLLS = 20


def _retry_after_ms(wait: float) -> int:
    """A refusal's ``retryAfterMs`` for ``wait`` seconds, rounded up: a client back after exactly that
    long finds the room there, not a second refusal."""
    return max(1, math.ceil(wait * 1000))


class HandshakeCore:
    """Everything the servicer does, as plain async methods raising ``PdprotoError``."""

    def __init__(self, engine: PrefillEngine, *, limits: Limits | None = None,
                 metrics: ServiceMetrics | None = None) -> None:
        self.engine = engine
        self.limits = limits or Limits()
        self.metrics = metrics or ServiceMetrics()
        self.registry = PeerRegistry(self.limits)
        # Read when scraped: setting the gauge on every Register and Deregister cost them a lock and a walk.
        self.metrics.peers.set_function(self.registry.live)
        # One thread per peer the registry may hold: a stuck peer keeps only its own.
        self.pool = LanePool(self.limits.max_peers)
        self.runner = TransferRunner(engine, self.metrics, self.limits, self.registry.peers)
        self.runner.on_peer_gone = self._peer_gone
        self._background: set[asyncio.Task[object]] = set()
        self.shutting_down = False
        self._streams_closed = False
        self._registering = 0
        self._janitor: asyncio.Task[None] | None = None
        self.verdicts = Verdicts()
        """Negotiation verdicts by registration layout: a decode rank shape is negotiated once."""
        self._judge = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdproto-judge")
        """Checks and negotiates registrations of more than ``HEAVY_ENTRIES`` buffers and tensors, one at
        a time: on the loop, one would stall every other peer's calls for its whole length."""
        self.judged = 0
        """Registrations on or waiting for the judge thread (``DescribeResponse.registrations_judged``)."""
        self._judge_s = 0.1
        """Seconds the judge took per registration lately (a refused one is told to wait for the queue)."""
        self._judging = Allowance()
        """What the judge may still take (``JUDGE_BURST``, ``JUDGE_RATE``): all registrants share it, since
        Register names no peer yet."""
        self.anonymous = Allowance()
        """The snapshot allowance every ``Describe`` caller without a peer credential (nor the operator
        token) shares: one peer's, since no peer is named to charge."""
        engine.orphan_after, engine.keep_finished = self.limits.match_timeout, self.limits.keep_finished
        self.deadlines: Deadlines[Peer] = Deadlines()
        """When to look at a peer again: its oldest kept final status expires, or it is gone long enough."""
        self.runner.on_kept = lambda peer: self.deadlines.add(time.monotonic() + self.limits.keep_finished, peer)
        self.on_tick: list[Callable[[float], None]] = []
        """Also called on each housekeeping tick, with the time (the sessions' expiry)."""

    @property
    def info(self) -> server_info_pb2.PrefillServerInfo:
        """The published topology."""
        return self.engine.source.info

    async def start(self) -> None:
        """Attach the engine to this loop and start housekeeping."""
        self.engine.attach(asyncio.get_running_loop())
        self._janitor = asyncio.get_running_loop().create_task(self._housekeeping(), name="janitor")

    def _accepting(self) -> None:
        if self.shutting_down:
            raise ShuttingDownError("the prefill is shutting down and takes no new work")

    def ended_reason(self, peer: Peer) -> PdprotoError:
        """Why ``peer``'s streams end: the server drains, the peer is gone, or it was removed."""
        if self._streams_closed or self.shutting_down:
            return ShuttingDownError("the prefill is shutting down; its streams have ended")
        if peer.gone_at is not None:
            return RequestFailedError(f"peer {peer.peer_id} is gone; re-register", reason=Reason.PEER_GONE,
                                      metadata={"peerId": peer.peer_id})
        return NotFoundError(f"peer {peer.peer_id!r} was deregistered or replaced by a new registration",
                             reason=Reason.PEER_NOT_FOUND, metadata={"peerId": peer.peer_id})

    def subscribe(self, peer: Peer, feed: StatusSink, rooms: Collection[int] = ()) -> tuple[Snapshot, bool]:
        """Add a status stream to ``peer``: its snapshot (of ``rooms``, if given), taken in the same step
        (nothing missed or sent twice), and whether the peer's streams have ended already (then it is not
        added).

        Raises TOO_MANY_STREAMS at ``max_streams_per_peer`` (WatchStatus and Session streams together).
        """
        if len(peer.feeds) >= self.limits.max_streams_per_peer:
            raise ResourceLimitError(
                f"peer {peer.peer_id} has {len(peer.feeds)} status streams open "
                f"(limit {self.limits.max_streams_per_peer})",
                reason=Reason.TOO_MANY_STREAMS,
                metadata={"limit": self.limits.max_streams_per_peer, "streams": len(peer.feeds)})
        ended = peer.streams_ended or self._streams_closed
        self.draw_snapshot(peer, peer.snapshot_size(rooms), "a new stream's snapshot")
        if not ended:
            peer.feeds.add(feed)
        return peer.snapshot(rooms), ended

    def draw_snapshot(self, peer: Peer | None, statuses: int, what: str) -> None:
        """Charge ``statuses`` about to be sent to the peer's allowance (``anonymous`` for None).

        Sending a snapshot costs the server far more than asking for one (4,096 statuses: 5 to
        15 ms of CPU), so a peer opening streams, or asking ``Describe`` for its statuses, in a
        loop would take the loop from everyone else. Raises TOO_MANY_STREAMS, with the seconds
        to wait, past ``Limits.snapshot_rate``.
        """
        if not statuses or self.limits.snapshot_rate <= 0:
            return
        capacity, rate = self.limits.snapshot_allowance
        allowance = self.anonymous if peer is None else peer.snapshots
        wait = allowance.take(statuses, capacity, rate, time.monotonic())
        if wait:
            self.metrics.snapshots_refused.inc()
            if peer is not None:
                peer.snapshots_refused += 1
            who, whom = ("callers without a peer credential", "they") if peer is None else \
                (f"peer {peer.peer_id}", "the peer")
            raise ResourceLimitError(
                f"{who} asked for statuses faster than the server sends them ({what}: {statuses} statuses); "
                f"{whom} may be sent {capacity:.0f} at once and {rate:.0f} per second "
                f"(--snapshot-rate {self.limits.snapshot_rate:g} full snapshots of {self.limits.kept_per_peer}); "
                f"retry in {wait:.2f} s",
                reason=Reason.TOO_MANY_STREAMS, metadata={"statuses": statuses, "retryAfterMs": _retry_after_ms(wait)})

    def peer(self, peer_id: str, credential: bytes) -> Peer:
        """The registered peer whose credential this is; NOT_FOUND otherwise.

        An unknown id, a missing credential and another peer's credential get one answer, so a
        caller learns nothing about peers it did not register.
        """
        peer = self.registry.authorized(peer_id, credential)
        if peer is None:
            raise NotFoundError(f"peer {peer_id!r} is not registered, or the call does not carry its "
                                "credential (RegisterResponse.peer_credential)",
                                reason=Reason.PEER_NOT_FOUND, metadata={"peerId": peer_id})
        return peer

    def _spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[object]:
        """A background task the core owns (``close`` waits for it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- Register / Deregister -------------------------------------------------

    async def register(self, request: hs.RegisterRequest, origin: str = "") -> hs.RegisterResponse:
        """Negotiate, replace a restarted peer's stale state, connect the executor, admit.

        The response carries the new peer's credential, which every later call for it must present.
        ``origin`` is the gRPC peer string of the call (validation reads where it came from).
        """
        try:
            result = await self._register(request, origin)
        except PdprotoError as exc:
            self.metrics.registered(exc.reason.code)
            raise
        self.metrics.registered("ACCEPTED")
        return result

    async def _register(self, request: hs.RegisterRequest, origin: str) -> hs.RegisterResponse:
        self._accepting()
        verdict = None
        entries = registration_entries(request.registration)
        if entries > HEAVY_ENTRIES:
            self._judge_room(entries)
            self.judged += 1
            try:
                reg, verdict = await asyncio.wrap_future(self._judge.submit(self._check_and_negotiate, request, origin))
            finally:
                self.judged -= 1
            self._accepting()
        else:
            reg = check_registration(request, origin)
        return await self._admit(reg, verdict or self._negotiate(reg))

    def _judge_room(self, entries: int) -> None:
        """Raise TOO_MANY_REGISTRATIONS, with the seconds to wait, unless the judge takes ``entries`` more."""
        wait = self.judged * self._judge_s if self.judged >= MAX_JUDGED else \
            self._judging.take(entries, JUDGE_BURST, JUDGE_RATE, time.monotonic())
        if wait:
            why = (f"{self.judged} are being checked or wait for it (limit {MAX_JUDGED})" if self.judged >= MAX_JUDGED
                   else f"their checks may take {JUDGE_RATE} buffers and tensors per second, and this one lists "
                        f"{entries}")
            raise ResourceLimitError(
                f"registrations of more than {HEAVY_ENTRIES} buffers and tensors arrive faster than the server "
                f"checks them: {why}; retry in {wait:.2f} s",
                reason=Reason.TOO_MANY_REGISTRATIONS,
                metadata={"entries": entries, "judged": self.judged, "retryAfterMs": _retry_after_ms(wait)})

    def _negotiate(self, reg: registration_pb2.KvRegistration) -> Verdict:
        """The verdict on ``reg`` with its shared ``NegotiationResult``; a rejection raises its typed error."""
        started = time.perf_counter()
        verdict, result, remembered = self.verdicts.of(self.info, reg)
        self.metrics.negotiated(time.perf_counter() - started, remembered=remembered)
        if isinstance(verdict, Rejection):
            raise verdict.to_error()
        return verdict, result

    def _check_and_negotiate(self, request: hs.RegisterRequest,
                             origin: str) -> tuple[registration_pb2.KvRegistration, Verdict]:
        """``check_registration`` and ``_negotiate`` together (on the judge's thread)."""
        started = time.perf_counter()
        try:
            reg = check_registration(request, origin)
            return reg, self._negotiate(reg)
        finally:
            self._judge_s = 0.5 * self._judge_s + 0.5 * (time.perf_counter() - started)

    async def _admit(self, reg: registration_pb2.KvRegistration, verdict: Verdict) -> hs.RegisterResponse:
        """Connect the executor (on the peer's lane) and add the peer, as ``verdict`` says."""
        identity = identity_of(reg)
        # Registrations of one decode rank run one at a time, so concurrent ones leave one peer.
        async with self.registry.serialized(identity):
            self._accepting()
            stale = self.registry.stale_for(identity)
            await self._refuse_live(stale, identity)
            self._accepting()  # a drain may have begun while it waited for a closing client's streams
            self.registry.check_capacity(self._registering - len(stale))
            for old in stale:
                # Same notify endpoint or engine identity: the decode restarted. Its old
                # requests can never complete; fail them and drop its engine connection.
                log.info("peer %s re-registered as a new peer; dropping stale state", old.peer_id)
                await self._drop(old, Reason.PEER_GONE, "the decode re-registered (restart)")
            self.registry.check_capacity(self._registering)
            self._registering += 1
            try:
                peer_id = self.registry.new_id()
                decision, shared = verdict
                peer = Peer(peer_id=peer_id, registration=reg, decision=decision, result=result_for(shared, peer_id),
                            identity=identity, lane=Lane(self.pool, peer_id),
                            credential=self.registry.new_credential())
                peer.page_limit = page_limit(peer)
                try:
                    await peer.lane.run(self.engine.executor.connect, peer_id, reg,
                                        timeout=self.limits.engine_timeout, what=f"connect {peer_id}")
                except BaseException:
                    # Never admitted; its connect (maybe still running) is undone in the background.
                    self.registry.remove(peer)
                    self._disconnect_later(peer)
                    raise
                self.registry.add(peer)
            finally:
                self._registering -= 1
        return hs.RegisterResponse(result=peer.result, peer_credential=peer.credential)

    @staticmethod
    async def _refuse_live(stale: list[Peer], identity: tuple[str, ...]) -> None:
        """Refuse to replace a peer whose decode still reads a stream: that is a live decode, not a restart.

        A decode's exit closes its streams, so a restarted one finds them closed; one that
        is still reading them is alive, and whoever names its endpoint or engine is not it
        (docs/security.md). Streams a client has just closed may take a moment to end
        here, so the check waits up to ``IDENTITY_GRACE_S`` for them.
        """
        for poll in range(IDENTITY_POLLS + 1):
            live = [p for p in stale if not p.closed and p.gone_at is None and p.attached()]
            if not live:
                return
            if poll < IDENTITY_POLLS:
                await asyncio.sleep(IDENTITY_GRACE_S / IDENTITY_POLLS)
        old = live[0]
        keys = sorted(set(identity) & set(old.identity))
        log.warning("refused a registration naming %s of live peer %s", ", ".join(keys), old.peer_id)
        raise IdentityInUseError(
            f"a registered decode with {', '.join(keys)} still reads its status stream: it is alive, so this "
            "is not its restart. A restarted decode can register once its old process is gone (its streams "
            "close with it); otherwise give this decode its own notify endpoint and engine",
            reason=Reason.IDENTITY_IN_USE, metadata={"identity": ",".join(keys)})

    async def deregister(self, request: hs.DeregisterRequest) -> int:
        """Fail the peer's open requests with PEER_GONE, cancel them, disconnect, forget it."""
        peer = self.peer(request.peer_id, request.peer_credential)
        return await self._drop(peer, Reason.PEER_GONE, "the decode deregistered")

    async def evict(self, request: hs.EvictRequest) -> int:
        """Drop a peer for the operator (the caller checked the operator token); like ``deregister``."""
        peer = self.registry.peers.get(request.peer_id)
        if peer is None or peer.closed:
            raise NotFoundError(f"peer {request.peer_id!r} is not registered", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peerId": request.peer_id})
        log.warning("the operator evicted peer %s", peer.peer_id)
        return await self._drop(peer, Reason.PEER_GONE, "the operator evicted the peer")

    async def _drop(self, peer: Peer, reason: Reason, message: str) -> int:
        """Remove a peer and free everything it held; returns how many requests were failed.

        Its open requests end FAILED with ``reason`` (after their in-flight chunk drained,
        unless the peer's engine is stuck), its streams end after sending that, and its
        engine connection is dropped through its lane. The peer counts toward ``max_peers``
        until that disconnect has returned.
        """
        if peer.closed:
            return 0
        peer.closed = True
        self.registry.remove(peer)
        open_requests = peer.open_requests()
        await asyncio.gather(*(self.runner.stop(peer, r, reason, message) for r in open_requests))
        peer.end_streams()
        done = self._disconnect_later(peer)
        if not peer.lane.stuck:
            await asyncio.wait([done], timeout=self.limits.drain_timeout)
        return len(open_requests)

    def _disconnect_later(self, peer: Peer) -> asyncio.Task[object]:
        """Drop the peer's engine connection once its lane is free; then it stops counting."""

        async def disconnect() -> None:
            try:
                await peer.lane.run(self.engine.executor.disconnect, peer.peer_id, cleanup=True,
                                    timeout=self.limits.engine_timeout, what=f"disconnect {peer.peer_id}")
            except PdprotoError as exc:
                log.warning("disconnect of %s failed: %s", peer.peer_id, exc)
            finally:
                peer.lane.when_idle(lambda: self.registry.release(peer))

        return self._spawn(disconnect(), f"disconnect-{peer.peer_id}")

    def _peer_gone(self, peer: Peer) -> None:
        """The executor found the peer dead: free it in the background (once)."""
        if peer.closed or peer.gone_at is not None:
            return
        peer.gone_at = time.monotonic()
        self.deadlines.add(peer.gone_at + self.limits.keep_finished, peer)
        log.warning("peer %s is gone (engine reported PEER_GONE); freeing its state", peer.peer_id)
        self._spawn(self._release_gone(peer), f"gone-{peer.peer_id}")

    async def _release_gone(self, peer: Peer) -> int:
        """Fail a dead peer's open requests and drop its engine connection, but keep its record.

        The record (final statuses) stays visible, and counts toward ``max_peers``, until the
        decode re-registers (which replaces it) or ``keep_finished`` passes; it admits no new work.
        """
        open_requests = peer.open_requests()
        await asyncio.gather(*(self.runner.stop(peer, r, Reason.PEER_GONE, "the decode process is gone")
                               for r in open_requests))
        peer.end_streams()
        self._disconnect_later(peer)
        return len(open_requests)

    # -- SubmitTransfer / Abort --------------------------------------------------

    async def submit(self, request: hs.SubmitTransferRequest) -> transfer_pb2.TransferStatus:
        """Admit one request generation and start moving its chunks as they arrive."""
        self._accepting()
        peer = self.peer(request.peer_id, request.peer_credential)
        if not request.HasField("transfer"):
            raise InvalidFieldError.of([("transfer", "required")])
        return await self.submit_to(peer, request.transfer)

    async def submit_to(self, peer: Peer, info: transfer_pb2.TransferInfo) -> transfer_pb2.TransferStatus:
        """``submit`` for a peer whose credential was already checked (a session stream checks it once)."""
        self._accepting()
        _check_alive(peer)
        pages = check_transfer(info, peer)
        current = peer.generation_of(info.room)
        if current is not None:
            if info.generation == current:
                raise DuplicateRequestError(
                    f"room {info.room} generation {info.generation} was already submitted",
                    reason=Reason.DUPLICATE_REQUEST, metadata={"room": info.room, "generation": info.generation})
            if info.generation < current:
                raise _stale(info.room, info.generation, current)
        old = peer.open.get(info.room)
        if old is not None:
            # A newer generation supersedes the old one (retraction, retry).
            await self.runner.stop(peer, old, Reason.ABORTED, f"superseded by generation {info.generation}")
        open_count = len(peer.open)
        if open_count >= self.limits.max_inflight_per_peer:
            raise ResourceLimitError(
                f"peer {peer.peer_id} has {open_count} requests in flight (limit {self.limits.max_inflight_per_peer})",
                reason=Reason.TOO_MANY_REQUESTS,
                metadata={"limit": self.limits.max_inflight_per_peer, "inflight": open_count})
        if peer.closed or self.registry.peers.get(peer.peer_id) is not peer:
            raise NotFoundError(f"peer {peer.peer_id!r} went away", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peerId": peer.peer_id})
        _check_alive(peer)
        # The planner reads the whole list at every chunk: a long one is converted for it once, here.
        dst_pages = pages if len(pages) < LARGE_PAGE_LIST else np.asarray(pages, dtype=np.int64)
        req = Request(peer_id=peer.peer_id, room=info.room, generation=info.generation, transfer=info,
                      dst_pages=dst_pages, prefix_len=info.decode_prefix_len,
                      prefill_rank=self.engine.prefill_rank)
        self.runner.start(peer, req)
        # The status right after admission travels in this response (a request whose chunks were
        # all there may be over already); streams report changes from here on.
        return req.final or req.status()

    async def abort(self, request: hs.AbortRequest) -> transfer_pb2.AbortAck:
        """Abort a request generation; answers once its in-flight chunk has drained.

        If the chunk is still inside the engine after ``drain_timeout`` (a stuck peer), the
        request is FAILED all the same but the call answers DEADLINE_EXCEEDED: its pages are
        not safe to reuse until the engine returns (Abort again later to learn when).
        """
        return await self.abort_for(self.peer(request.peer_id, request.peer_credential), request.abort)

    async def abort_for(self, peer: Peer, note: transfer_pb2.AbortNotification) -> transfer_pb2.AbortAck:
        """``abort`` for a peer whose credential was already checked."""
        current = peer.generation_of(note.room)
        if current is None:
            raise NotFoundError(f"room {note.room} is unknown for peer {peer.peer_id}",
                                reason=Reason.REQUEST_NOT_FOUND, metadata={"room": note.room})
        if note.HasField("generation") and note.generation != current:
            if note.generation < current:
                raise _stale(note.room, note.generation, current)
            raise NotFoundError(f"room {note.room} generation {note.generation} was never submitted",
                                reason=Reason.REQUEST_NOT_FOUND,
                                metadata={"room": note.room, "generation": note.generation})
        req = peer.open.get(note.room)
        if req is not None:
            safe = await self.runner.stop(peer, req, Reason.ABORTED, "aborted by the decode")
        else:  # finished, maybe while its chunk was still inside the engine (DEADLINE_EXCEEDED)
            safe = await drained(peer, note.room, current, self.limits.drain_timeout)
        safe = safe and await self._quiet(peer)
        if not safe:
            raise DeadlineExceededError(
                f"room {note.room} is aborted, but a chunk is still inside the transfer engine after "
                f"{self.limits.drain_timeout:g} s; its pages may still be written until the engine returns",
                reason=Reason.DEADLINE_EXCEEDED, metadata={"room": note.room, "generation": current})
        return transfer_pb2.AbortAck(room=note.room, prefill_rank=self.engine.prefill_rank, generation=current)

    async def _quiet(self, peer: Peer) -> bool:
        """True once no engine call for the peer is inside the engine; False after the drain timeout.

        The executor may have given a call up at its own deadline while the engine still runs
        it. The wait holds no thread: a frozen peer's aborts, however many, cannot take the
        threads another peer's abort needs (as ``asyncio.to_thread`` on the loop's shared
        executor did). A process that is exiting cannot say (``ShuttingDownError``, never an
        acknowledgement).
        """
        marker = self.engine.executor.drained(peer.peer_id)
        if marker is None:
            return True
        try:
            # Shielded: the marker may be the peer's queued disconnect, which must still run.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(marker)), self.limits.drain_timeout)
        except TimeoutError:
            return False
        except PdprotoError:
            pass  # the call failed, and it has left the engine
        return True

    # -- WatchStatus ------------------------------------------------------------

    async def watch(self, request: hs.WatchStatusRequest) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """Current statuses of the peer's (matching) requests, then every change until the peer goes.

        Each request's terminal status is sent exactly once per stream (``pdproto_server/feed.py``).
        """
        peer = self.peer(request.peer_id, request.peer_credential)
        most = self.limits.kept_per_peer
        if len(request.rooms) > most:
            # More rooms than the peer can have open and kept: a filter that large only costs the loop
            # time and memory to build (1.3 million rooms: 0.2 s and 110 MB, for as long as the stream).
            raise InvalidFieldError("rooms", f"{len(request.rooms)} rooms, more than the {most} a peer can have "
                                    "open and kept (--max-inflight + --max-finished)",
                                    metadata={"rooms": len(request.rooms), "limit": most})
        task = asyncio.current_task()
        delivered = False

        def cut() -> None:
            # The peer is over and so counts toward no limit: a client that reads nothing
            # must not keep its stream (and its handler) after drain_timeout.
            if not delivered and task is not None and not task.done():
                log.info("a status stream of peer %s took nothing for %.0f s after the peer ended; cutting it",
                         peer.peer_id, self.limits.drain_timeout)
                task.cancel()

        def cut_later() -> None:
            asyncio.get_running_loop().call_later(self.limits.drain_timeout, cut)

        def cut_now() -> None:
            log.warning("a status stream of peer %s left more than %d statuses unread; ending it",
                        peer.peer_id, self.limits.max_unread)
            peer.feeds.discard(feed)
            # A stream waiting for a status ends with the feed's reason once woken; one stuck in a
            # write the client never takes is cancelled.
            if not feed.waiting and task is not None and task is not asyncio.current_task() and not task.done():
                task.cancel()

        feed = StatusFeed(request.rooms, on_close=cut_later, unread=self.limits.max_unread, on_behind=cut_now)
        snapshot, ended = self.subscribe(peer, feed, request.rooms)
        feed.finals(snapshot.finished)
        for status in snapshot.open:
            feed.push(status)
        if ended:
            feed.close()
        try:
            async for status in feed:
                yield status
            delivered = True
        finally:
            peer.feeds.discard(feed)

    # -- housekeeping and shutdown ---------------------------------------------

    async def _housekeeping(self) -> None:
        """Expire orphan rooms, old finished statuses and released gone peers, once a second."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._expire()
            except Exception:  # noqa: BLE001 - housekeeping must outlive one bad tick
                log.exception("housekeeping failed; retrying next tick")

    async def _expire(self, now: float | None = None) -> None:
        """One tick: drop what fell due (rooms, final statuses, gone peers, detached sessions), nothing else."""
        dropped = self.engine.expire(now)
        if dropped:
            log.warning("dropped %d prefill rooms no decode claimed, or the prefill never finished, in time: %s",
                        len(dropped), dropped[:8])
        now = time.monotonic() if now is None else now
        keep = self.limits.keep_finished
        for peer in self.deadlines.take_due(now):
            if peer.closed:
                continue
            if peer.gone_at is not None and now - peer.gone_at >= keep:
                if not peer.open:
                    await self._drop(peer, Reason.PEER_GONE, "the decode process is gone")
                    continue
                self.deadlines.add(now + 1.0, peer)  # its requests are still being failed
            peer.expire_finished(now - keep)
            if peer.finished:
                self.deadlines.add(next(iter(peer.finished.values())).at + keep, peer)
        for tick in self.on_tick:
            tick(now)

    def open_requests(self) -> list[tuple[Peer, Request]]:
        """Every open request of every peer."""
        return [(p, r) for p in self.registry.peers.values() for r in p.open_requests()]

    async def drain(self, timeout: float) -> None:
        """Stop admitting work, let open requests finish (up to ``timeout``), fail the rest."""
        self.shutting_down = True
        if self.runner.open:
            log.info("draining %d in-flight requests (up to %.1fs)", self.runner.open, timeout)
            await self.runner.idle(timeout)
        leftovers = self.open_requests()
        await asyncio.gather(*(self.runner.stop(p, r, Reason.SHUTTING_DOWN, "the prefill shut down")
                               for p, r in leftovers))
        self._streams_closed = True
        for peer in self.registry.peers.values():
            peer.end_streams()

    async def close(self) -> None:
        """Drop every peer and release the lanes (a thread stuck in an engine is left behind)."""
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        for peer in list(self.registry.peers.values()):
            await self._drop(peer, Reason.SHUTTING_DOWN, "the prefill shut down")
        await self.runner.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.limits.drain_timeout)
        stuck = [p.peer_id for p in self.registry.retired.values() if p.lane.busy]
        if stuck:
            log.warning("closing with engine calls still out for %d peers: %s", len(stuck), stuck[:8])
        self.pool.shutdown(wait=False)
        self._judge.shutdown(wait=False, cancel_futures=True)


def _check_alive(peer: Peer) -> None:
    """A peer whose process is gone admits no new work (it must re-register)."""
    if peer.gone_at is not None:
        raise RequestFailedError(f"peer {peer.peer_id} is gone; re-register", reason=Reason.PEER_GONE,
                                 metadata={"peerId": peer.peer_id})


def _stale(room: int, got: int, current: int) -> RequestFailedError:
    return RequestFailedError(f"room {room}: generation {got} is older than the current {current}",
                              reason=Reason.STALE_GENERATION,
                              metadata={"room": room, "generation": got, "currentGeneration": current})


__all__ = ["HandshakeCore"]
