"""Registered decode peers, their open requests and status subscribers, with limits."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pdproto import backends
from pdproto.errors import Reason, ResourceLimitError
from pdproto.topology import Decision
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2, transfer_pb2

TERMINAL = frozenset({common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED})


@dataclass(frozen=True)
class Limits:
    """Admission limits; exceeding one answers RESOURCE_EXHAUSTED with an ErrorInfo."""

    max_peers: int = 256
    """Registered decode peers at once."""
    max_inflight_per_peer: int = 1024
    """Open (non-terminal) requests per peer."""
    match_timeout: float = 30.0
    """Seconds a request waits for the prefill's next chunk (and a chunk for a decode)."""
    keep_finished: float = 60.0
    """Seconds finished requests and rooms stay queryable."""
    drain_timeout: float = 10.0
    """Seconds Abort/Deregister/shutdown wait for in-flight chunks to drain."""


@dataclass
class Request:
    """One request of one peer: destination, progress and the task moving its chunks."""

    peer_id: str
    room: int
    generation: int
    transfer: transfer_pb2.TransferInfo
    dst_pages: npt.NDArray[np.int64]
    prefix_len: int
    prefill_rank: int
    state: int = common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT
    failure_code: str = ""
    failure_reason: str = ""
    bytes: int = 0
    descriptors: int = 0
    aux_bytes: int = 0
    state_bytes: int = 0
    aux_descriptors: int = 0
    state_descriptors: int = 0
    chunks_done: int = 0
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None
    cancel_reason: tuple[Reason, str] | None = None
    """Why the task was cancelled (ABORTED, PEER_GONE, SHUTTING_DOWN); set before cancelling."""

    @property
    def terminal(self) -> bool:
        """SUCCESS or FAILED."""
        return self.state in TERMINAL

    def status(self) -> transfer_pb2.TransferStatus:
        """The current status message."""
        return transfer_pb2.TransferStatus(
            room=self.room, generation=self.generation, state=self.state,  # type: ignore[arg-type]
            prefill_rank=self.prefill_rank, failure_reason=self.failure_reason,
            failure_code=self.failure_code, bytes_transferred=self.bytes,
            chunks_done=self.chunks_done, descriptors=self.descriptors, aux_bytes=self.aux_bytes,
            state_bytes=self.state_bytes, aux_descriptors=self.aux_descriptors,
            state_descriptors=self.state_descriptors)


@dataclass
class Peer:
    """A registered decode rank: its registration, negotiated decision and requests."""

    peer_id: str
    registration: registration_pb2.KvRegistration
    decision: Decision
    result: server_info_pb2.NegotiationResult
    identity: tuple[str, ...]
    credential: bytes = field(default=b"", repr=False)
    """The peer's capability (``RegisterResponse.peer_credential``); every later call must present it."""
    requests: dict[int, Request] = field(default_factory=dict)
    open: dict[int, Request] = field(default_factory=dict)
    """The non-terminal subset of ``requests`` (kept separately: admission must not scan history)."""
    watchers: set[asyncio.Queue[transfer_pb2.TransferStatus | None]] = field(default_factory=set)
    registered_at: float = field(default_factory=time.monotonic)
    closed: bool = False
    """Removed from the registry (deregistered, replaced or shut down)."""
    gone_at: float | None = None
    """When the engine reported the peer's process dead; its record stays for inspection."""

    def open_requests(self) -> list[Request]:
        """Requests not yet SUCCESS or FAILED."""
        return list(self.open.values())

    def publish(self, request: Request) -> None:
        """Push the request's current status to every subscriber of this peer."""
        status = request.status()
        for queue in self.watchers:
            queue.put_nowait(status)

    def close_watchers(self) -> None:
        """End every status stream of this peer."""
        for queue in self.watchers:
            queue.put_nowait(None)


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


class PeerRegistry:
    """Peers by id and by identity; enforces ``Limits.max_peers``; checks peer credentials."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.peers: dict[str, Peer] = {}
        self._by_identity: dict[str, str] = {}
        # Compared against when the peer id is unknown, so both refusals take the same time.
        self._decoy = secrets.token_bytes(CREDENTIAL_BYTES)

    def new_id(self) -> str:
        """A fresh peer id: random, so one peer's id says nothing about another's (ids are not secrets)."""
        while True:
            peer_id = f"p-{secrets.token_hex(8)}"
            if peer_id not in self.peers:
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
        return peer if match and peer is not None else None

    def stale_for(self, identity: tuple[str, ...]) -> list[Peer]:
        """Registered peers that share any identity key (a restarted decode rank)."""
        ids = {self._by_identity[k] for k in identity if k in self._by_identity}
        return [self.peers[i] for i in sorted(ids) if i in self.peers]

    def live(self) -> int:
        """Registered peers whose process is not known to be gone."""
        return sum(1 for p in self.peers.values() if p.gone_at is None)

    def check_capacity(self, replacing: int) -> None:
        """Raise TOO_MANY_PEERS unless one more peer fits (after ``replacing`` are removed)."""
        if self.live() - replacing >= self.limits.max_peers:
            raise ResourceLimitError(f"too many registered peers (limit {self.limits.max_peers})",
                                     reason=Reason.TOO_MANY_PEERS,
                                     metadata={"limit": self.limits.max_peers, "peers": len(self.peers)})

    def add(self, peer: Peer) -> None:
        """Insert a peer (capacity already checked)."""
        self.peers[peer.peer_id] = peer
        for key in peer.identity:
            self._by_identity[key] = peer.peer_id

    def remove(self, peer_id: str) -> Peer | None:
        """Remove a peer and its identity keys; None if unknown."""
        peer = self.peers.pop(peer_id, None)
        if peer is not None:
            for key in peer.identity:
                if self._by_identity.get(key) == peer_id:
                    del self._by_identity[key]
        return peer


__all__ = ["CREDENTIAL_BYTES", "Limits", "Peer", "PeerRegistry", "Request", "TERMINAL", "identity_of"]
