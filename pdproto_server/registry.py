"""Registered decode peers, their open requests, finished statuses and status streams, with limits.

What the service keeps, for how long, and what bounds it: ``docs/security.md``, "Memory and threads".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from pdproto import backends
from pdproto.errors import NotFoundError, Reason, ResourceLimitError
from pdproto.negotiation.topology import Decision
from pdproto.v1 import registration_pb2, server_info_pb2, transfer_pb2

from pdproto.transfer.worker import Call, PeerWorker

from .engine import Outcome, RoomLog



SNAPSHOT_BURST = 4
"""Full snapshots a peer's streams may take back to back: a client opening its session and a few watches
together, or opening them again after a break, is never refused."""


@dataclass
class Allowance:
    """A token bucket, kept as a schedule (the generic cell rate algorithm): how much costly work a peer
    may still ask for now, refilled at a steady rate."""

    due: float = 0.0
    """When the bucket is full again (monotonic; in the past: full)."""

    def take(self, units: float, capacity: float, rate: float, now: float, hold: float = 0.0) -> float:
        """Draw ``units`` (at most ``capacity``: one full burst always fits): the seconds until they are
        there (0.0: now). They are drawn when that is at most ``hold`` (the caller waits that long first),
        else nothing is drawn."""
        need = min(units, capacity)
        due = max(self.due, now)
        wait = max(0.0, due + (need - capacity) / rate - now)
        if wait <= hold:
            self.due = due + need / rate
        return wait


CALL_BURST_S = 2.0
"""Seconds' worth of ``Limits.call_rate`` a peer may call at once: a decode submitting a batch together is
never held."""
CALL_HOLD_S = 1.0
"""Longest a call past a peer's call rate is held (until the rate has room) before it is refused instead:
a flooder waiting for its answers is slowed to the rate at no cost to anyone; one sending more at once than
this holds is refused, each refusal costing the server a call's worth of gRPC work."""


def retry_after_ms(wait: float) -> int:
    """A refusal's ``retryAfterMs`` for ``wait`` seconds, rounded up: a client back after exactly that
    long finds the room there, not a second refusal."""
    return max(1, math.ceil(wait * 1000))


@dataclass(frozen=True)
class Limits:
    """Admission limits; exceeding one answers RESOURCE_EXHAUSTED with an ErrorInfo."""

    max_peers: int = 256
    """Decode peers held at once: registered, gone but not yet released, or with an engine call out."""
    max_inflight_per_peer: int = 1024
    """Open (non-terminal) requests per peer."""
    max_finished_per_peer: int = 4096
    """Final statuses kept per peer for late queries; the oldest goes first."""
    max_streams_per_peer: int = 8
    """Open WatchStatus streams per peer."""
    match_timeout: float = 30.0
    """Seconds a request waits for the prefill's next chunk (and a chunk for a decode)."""
    keep_finished: float = 60.0
    """Seconds finished statuses, gone peers and rooms stay queryable."""
    drain_timeout: float = 10.0
    """Seconds Abort/Deregister/shutdown wait for in-flight chunks to drain."""
    snapshot_rate: float = 1.0
    """Full status snapshots per second a peer's new streams may be sent (a full one: ``kept_per_peer``
    statuses), up to ``SNAPSHOT_BURST`` at once; a resumed session's unacknowledged events and the views
    a ``Describe`` lists count alike.
    0 lifts the limit."""
    call_rate: float = 1000.0
    """Calls per second one peer's credential may make (``CALL_BURST_S`` seconds' worth at once); more
    are held until the rate has room, or refused TOO_MANY_CALLS with ``retryAfterMs`` past ``CALL_HOLD_S``
    of holding. 0 lifts the limit."""

    @property
    def kept_per_peer(self) -> int:
        """Requests a peer can have open and kept at once: the most a status snapshot, a room filter
        or a ``Describe`` response ever needs for one peer."""
        return self.max_inflight_per_peer + self.max_finished_per_peer

    @property
    def snapshot_allowance(self) -> tuple[float, float]:
        """(statuses a peer may be sent at once by streams it opens, statuses per second refilled)."""
        return SNAPSHOT_BURST * self.kept_per_peer, self.snapshot_rate * self.kept_per_peer

    @property
    def max_unread(self) -> int:
        """Statuses a status stream may leave unread before it is ended: twice what a peer can have
        open and kept (a new stream's snapshot), so only a client that reads nothing reaches it."""
        return 2 * self.kept_per_peer


@dataclass(kw_only=True)
class Request(Outcome):
    """One request of one peer: destination, progress, and where it is on its way to a terminal status."""

    peer_id: str
    room: int
    generation: int
    transfer: transfer_pb2.TransferInfo
    dst_pages: Sequence[int] | npt.NDArray[np.int64]
    """Destination pages after the prefix: the TransferInfo's own list, or an int64 array when it is
    long (``LARGE_PAGE_LIST``: the planner reads the whole list at every chunk)."""
    prefix_len: int
    prefill_rank: int
    descriptors: int = 0
    aux_descriptors: int = 0
    state_descriptors: int = 0
    chunks_done: int = 0
    admitted_at: float = field(default_factory=time.monotonic)
    room_log: RoomLog | None = field(default=None, repr=False)
    """The room it takes its chunks from, until it ends (``pdproto_server/runner.py``)."""
    waiter: Callable[[], None] | None = field(default=None, repr=False)
    """Its callback on the room log's waiters, for the next chunk; taken off when it ends (kept, it
    kept the whole ended request, pages included, for as long as the room)."""
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    """Fails it with MATCH_TIMEOUT if the next chunk does not come in time."""
    moving: bool = False
    """A chunk of it is queued for, or inside, the engine."""
    cancel_reason: tuple[Reason, str] | None = None
    """Why it was stopped (ABORTED, PEER_GONE, SHUTTING_DOWN); it ends FAILED with this."""
    final: transfer_pb2.TransferStatus | None = None
    """Its terminal status, once it has one (the message every stream got)."""

    def status(self) -> transfer_pb2.TransferStatus:
        """The current status message."""
        return transfer_pb2.TransferStatus(
            room=self.room, generation=self.generation, state=self.state,  # type: ignore[arg-type]
            prefill_rank=self.prefill_rank, failure_reason=self.failure_reason,
            failure_code=self.failure_code, bytes_transferred=self.bytes,
            chunks_done=self.chunks_done, descriptors=self.descriptors, aux_bytes=self.aux_bytes,
            state_bytes=self.state_bytes, aux_descriptors=self.aux_descriptors,
            state_descriptors=self.state_descriptors)


class Finished(NamedTuple):
    """A finished request as kept for late queries: its final status, serialized (about 250 bytes)."""

    at: float
    """When it finished (monotonic)."""
    generation: int
    """Its generation (read without parsing ``blob``)."""
    blob: bytes
    """The serialized final ``TransferStatus``."""


class Snapshot(NamedTuple):
    """A peer's requests as a new status stream starts: kept final statuses (serialized, as kept:
    parsing thousands would hold the loop), then the open requests' statuses."""

    finished: list[bytes]
    open: list[transfer_pb2.TransferStatus]


class StatusSink(Protocol):
    """A subscriber to a peer's status changes: a WatchStatus feed or a session."""

    def push(self, status: transfer_pb2.TransferStatus) -> None:
        """A status changed."""

    def close(self) -> None:
        """No more changes (the peer is over, or the server drains): end after what is queued."""

    @property
    def attached(self) -> bool:
        """A client is reading this stream now (a session kept for a resume is not)."""


@dataclass
class Peer:
    """A registered decode rank: its registration, negotiated decision, requests and streams."""

    peer_id: str
    registration: registration_pb2.KvRegistration
    decision: Decision
    result: server_info_pb2.NegotiationResult
    identity: tuple[str, ...]
    worker: PeerWorker
    """The executor's worker for the peer: its engine calls run there, one at a time, each with the
    executor's deadline (``pdproto/transfer/worker.py``)."""
    credential: bytes = field(default=b"", repr=False)
    """The peer's capability (``RegisterResponse.peer_credential``); every later call must present it."""
    bound: bool = False
    """Part of its credential went through its transfer engine (``admission.EngineCredentials``)."""
    proven: bool = False
    """A call carried its whole credential; for a bound peer, proof that it owns its engine."""
    open: dict[int, Request] = field(default_factory=dict)
    """Open (non-terminal) requests by room."""
    finished: dict[int, Finished] = field(default_factory=dict)
    """The final status of each finished room, oldest first: all a late query needs, not the request."""
    feeds: set[StatusSink] = field(default_factory=set)
    """Open status streams: WatchStatus feeds and sessions (``pdproto_server/session.py``)."""
    registered_at: float = field(default_factory=time.monotonic)
    closed: bool = False
    """Removed from the registry (deregistered, replaced or shut down)."""
    gone_at: float | None = None
    """When the engine reported the peer's process dead (or stuck); its record stays for inspection."""
    streams_ended: bool = False
    """Every request is terminal and every stream was told so; a new stream ends after its snapshot."""
    page_limit: tuple[int, int] = (-1, -1)
    """(pages, entry) of its smallest paired KV buffer of known length (-1: none): what a page must be below."""
    snapshots: Allowance = field(default_factory=Allowance)
    """Statuses its new streams, resumed sessions and ``Describe`` calls may still be sent at once
    (``Limits.snapshot_rate``)."""
    snapshots_refused: int = 0
    """Its calls ``snapshots`` refused (``PeerView.snapshots_refused``: which peer keeps asking)."""
    calls: Allowance = field(default_factory=Allowance)
    """Calls its credential may still make at once (``Limits.call_rate``)."""
    calls_refused: int = 0
    """Its calls ``calls`` refused (``PeerView.calls_refused``)."""
    moving: tuple[int, int, Call[Any]] | None = None
    """(room, generation, call) of the chunk last handed to the worker, until that call returned."""
    protocol: str = ""
    """The control protocol the decode speaks: "" for pdproto, else the legacy one (``pdproto_server/legacy.py``)."""

    def __hash__(self) -> int:
        return id(self)

    def generation_of(self, room: int) -> int | None:
        """The room's current generation (open or finished), None when the peer has no record of it."""
        req = self.open.get(room)
        if req is not None:
            return req.generation
        done = self.finished.get(room)
        return None if done is None else done.generation

    def snapshot(self, rooms: Collection[int] = ()) -> Snapshot:
        """The current status of every request the peer has a record of (of ``rooms`` only, if given)."""
        if not rooms:
            return Snapshot([f.blob for f in self.finished.values()], [r.status() for r in self.open.values()])
        finished = [f.blob for room in rooms if (f := self.finished.get(room)) is not None]
        return Snapshot(finished, [r.status() for room in rooms if (r := self.open.get(room)) is not None])

    def snapshot_size(self, rooms: Collection[int] = ()) -> int:
        """Statuses ``snapshot(rooms)`` holds, without building it (a refused open costs little)."""
        if not rooms:
            return len(self.finished) + len(self.open)
        return sum(1 for room in rooms if room in self.finished or room in self.open)

    def record_finished(self, status: transfer_pb2.TransferStatus, keep: int) -> bool:
        """Keep a finished request's final status (only that), at most ``keep`` of them, oldest out first.

        True when it is the only one kept now (the peer's expiry has to be scheduled).
        """
        first = not self.finished
        self.finished.pop(status.room, None)
        self.finished[status.room] = Finished(time.monotonic(), int(status.generation), status.SerializeToString())
        while len(self.finished) > keep:
            del self.finished[next(iter(self.finished))]
        return first

    def expire_finished(self, before: float) -> int:
        """Forget final statuses recorded before ``before``; walks only what expires (oldest are first)."""
        dropped = 0
        while self.finished:
            room = next(iter(self.finished))
            if self.finished[room].at > before:
                break
            del self.finished[room]
            dropped += 1
        return dropped

    def attached(self) -> bool:
        """Some client reads one of its streams now: the decode process is alive (its exit closes them)."""
        return any(feed.attached for feed in self.feeds)

    def publish(self, status: transfer_pb2.TransferStatus) -> None:
        """Push a status to every stream of this peer."""
        for feed in tuple(self.feeds):  # a stream that fell too far behind leaves the set as it is pushed to
            feed.push(status)

    def end_streams(self) -> None:
        """End every status stream once it sent what is queued; later streams end after their snapshot."""
        self.streams_ended = True
        for feed in list(self.feeds):  # a session kept for a resume leaves the set as it closes
            feed.close()


def identity_of(registration: registration_pb2.KvRegistration) -> tuple[str, ...]:
    """Keys that name the same decode rank across restarts: notify endpoint and engine identity."""
    keys: list[str] = []
    ep = registration.notify_endpoint
    if ep.host or ep.port:
        keys.append(f"notify:{ep.host}:{ep.port}")
    engine = backends.identity_key(registration)
    if engine is not None:
        keys.append(engine)
    return tuple(keys)


CREDENTIAL_BYTES = 32
"""Random bytes in a peer credential (256 bits; the issue asks for at least 128)."""
ENGINE_BYTES = 16
"""Credential bytes a bound peer's credential has written through its engine (128 bits: what the issue asks
of a credential; ``admission.EngineCredentials``)."""
RESPONSE_BYTES = 16
"""Credential bytes a bound peer gets in its ``RegisterResponse``."""


class PeerRegistry:
    """Peers by id and by identity; enforces ``Limits.max_peers``; checks peer credentials.

    ``peers`` holds registered peers, gone ones included until released. ``retired`` holds
    peers already removed whose worker still has an engine call out: they count toward
    ``max_peers`` until it returns, so stuck engine calls cannot pile up threads.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.peers: dict[str, Peer] = {}
        self.retired: dict[str, Peer] = {}
        self._by_identity: dict[str, str] = {}
        self._identity_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        """One lock per identity key, with its users: kept only while someone holds or waits for it."""
        # Compared against when the peer id is unknown, so both refusals take the same time.
        self._decoy = secrets.token_bytes(CREDENTIAL_BYTES)

    def new_id(self) -> str:
        """A fresh peer id: random, so one peer's id says nothing about another's (ids are not secrets)."""
        while True:
            peer_id = f"p-{secrets.token_hex(8)}"
            if peer_id not in self.peers and peer_id not in self.retired:
                return peer_id

    @staticmethod
    def new_credential() -> bytes:
        """A fresh peer credential from the OS's CSPRNG."""
        return secrets.token_bytes(CREDENTIAL_BYTES)

    def authorized(self, peer_id: str, credential: bytes) -> Peer | None:
        """The peer named ``peer_id`` if ``credential`` is its own; None otherwise (unknown or wrong).

        The comparison is constant-time, and an unknown id is compared against a decoy, so the
        answer's timing does not tell a caller whether the id exists or how much of a guess matched.
        """
        peer = self.peers.get(peer_id)
        expected = peer.credential if peer is not None else self._decoy
        match = hmac.compare_digest(credential, expected)
        if not match or peer is None:
            return None
        peer.proven = True
        return peer

    def peer(self, peer_id: str, credential: bytes) -> Peer:
        """The registered peer whose credential this is; NOT_FOUND otherwise.

        An unknown id, a missing credential and another peer's credential get one answer, so a
        caller learns nothing about peers it did not register.
        """
        peer = self.authorized(peer_id, credential)
        if peer is None:
            raise NotFoundError(f"peer {peer_id!r} is not registered, or the call does not carry its "
                                "credential (RegisterResponse.peer_credential)",
                                reason=Reason.PEER_NOT_FOUND, metadata={"peerId": peer_id})
        return peer

    def pace(self, peer_id: str, credential: bytes) -> float:
        """Seconds a call made with this peer's credential waits to keep to ``Limits.call_rate`` (0.0: none).

        Only a caller holding the credential is paced, so no one else can use up a peer's rate (a
        wrong one waits nothing; its call answers PEER_NOT_FOUND). A call that would wait more than
        ``CALL_HOLD_S`` is refused TOO_MANY_CALLS instead, with the seconds after which it would not.
        """
        peer = self.authorized(peer_id, credential)
        rate = self.limits.call_rate
        if peer is None or rate <= 0:
            return 0.0
        burst = max(1.0, CALL_BURST_S * rate)
        wait = peer.calls.take(1, burst, rate, time.monotonic(), CALL_HOLD_S)
        if wait > CALL_HOLD_S:
            peer.calls_refused += 1
            raise ResourceLimitError(
                f"peer {peer_id} calls faster than this server's call rate (--call-rate {rate:g} per second, "
                f"{burst:.0f} at once, then held up to {CALL_HOLD_S:g} s); retry in "
                f"{wait - CALL_HOLD_S:.3f} s", reason=Reason.TOO_MANY_CALLS,
                metadata={"peerId": peer_id, "callRate": f"{rate:g}",
                          "retryAfterMs": retry_after_ms(wait - CALL_HOLD_S)})
        return wait

    @contextlib.asynccontextmanager
    async def serialized(self, identity: tuple[str, ...]) -> AsyncIterator[None]:
        """Hold while registering ``identity``: registrations of one decode rank run one at a time.

        Every key's lock is taken in sorted order, so two registrations never wait on each other in a cycle.
        """
        keys = sorted(set(identity))
        entries = [self._identity_locks.setdefault(key, (asyncio.Lock(), [0])) for key in keys]
        for _, users in entries:
            users[0] += 1
        held: list[asyncio.Lock] = []
        try:
            for lock, _ in entries:
                await lock.acquire()
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()
            for key, (_, users) in zip(keys, entries, strict=True):
                users[0] -= 1
                if users[0] == 0:
                    del self._identity_locks[key]

    def stale_for(self, identity: tuple[str, ...]) -> list[Peer]:
        """Registered peers that share any identity key (a restarted decode rank)."""
        ids = {self._by_identity[k] for k in identity if k in self._by_identity}
        return [self.peers[i] for i in sorted(ids) if i in self.peers]

    def live(self) -> int:
        """Registered peers whose process is not known to be gone (safe from a scrape's thread: the
        peers are copied in one step before they are counted)."""
        return sum(1 for p in list(self.peers.values()) if p.gone_at is None)

    def held(self) -> int:
        """Peers counted toward ``max_peers``: registered (gone ones too) and retired with a call out."""
        return len(self.peers) + len(self.retired)

    def check_capacity(self, registering: int) -> None:
        """Raise TOO_MANY_PEERS unless one more peer fits beside the ``registering`` ones in progress."""
        held = self.held()
        if held + registering >= self.limits.max_peers:
            raise ResourceLimitError(
                f"too many decode peers held (limit {self.limits.max_peers}: {len(self.peers)} registered, "
                f"{len(self.retired)} released but with an engine call still out, {registering} registering)",
                reason=Reason.TOO_MANY_PEERS,
                metadata={"limit": self.limits.max_peers, "peers": len(self.peers),
                          "retired": len(self.retired), "registering": registering})

    def add(self, peer: Peer) -> None:
        """Insert a peer (capacity already checked)."""
        self.peers[peer.peer_id] = peer
        for key in peer.identity:
            self._by_identity[key] = peer.peer_id

    def remove(self, peer: Peer) -> None:
        """Take a peer out of service: no call finds it, but it counts as retired until ``release``."""
        if self.peers.get(peer.peer_id) is peer:
            del self.peers[peer.peer_id]
        for key in peer.identity:
            if self._by_identity.get(key) == peer.peer_id:
                del self._by_identity[key]
        peer.finished.clear()  # a removed peer answers no status query
        self.retired[peer.peer_id] = peer

    def release(self, peer: Peer) -> None:
        """A removed peer's engine connection is dropped: it no longer counts toward ``max_peers``."""
        if self.retired.get(peer.peer_id) is peer:
            del self.retired[peer.peer_id]


__all__ = ["Allowance", "CALL_BURST_S", "CALL_HOLD_S", "CREDENTIAL_BYTES", "ENGINE_BYTES", "Finished", "Limits", "Peer",
           "PeerRegistry", "RESPONSE_BYTES", "Request", "SNAPSHOT_BURST", "StatusSink", "identity_of", "retry_after_ms"]
