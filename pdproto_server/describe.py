"""``Describe``: the server's state for operators, read from the core in one step (no await).

It shows peer ids, negotiated decisions, open requests and limits, and never a credential or
a memory address. Room ids, final statuses, engine identities and notify endpoints are shown
only to the operator token, or for one peer to a caller with its credential (docs/security.md).
"""

from __future__ import annotations

import heapq
import time

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, backends
from pdproto.v1 import common_pb2, describe_pb2, handshake_service_pb2 as hs, transfer_pb2

from .core import HandshakeCore
from .registry import Limits, Peer
from .session import SessionHub

DEFAULT_REQUEST_LIMIT = 64
"""Open requests listed per peer when the caller names no limit."""


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def _peer_view(peer: Peer, hub: SessionHub, now: float, request_limit: int,
               finished_limit: int, full: bool) -> describe_pb2.PeerView:
    sessions = hub.of(peer)
    view = describe_pb2.PeerView(
        peer_id=peer.peer_id,
        state=describe_pb2.PEER_STATE_GONE if peer.gone_at is not None else describe_pb2.PEER_STATE_LIVE,
        result=peer.result,
        redacted=not full,
        age_ms=_ms(now - peer.registered_at),
        open_requests=len(peer.open),
        finished_kept=len(peer.finished),
        sessions_connected=sum(1 for s in sessions if s.stream is not None),
        sessions_detached=sum(1 for s in sessions if s.stream is None),
        watch_streams=len(peer.feeds) - len(sessions),
        events_unacknowledged=sum(s.log.unacknowledged for s in sessions),
        snapshots_refused=peer.snapshots_refused,
        calls_refused=peer.calls_refused,
        protocol=peer.protocol,
    )
    if full:
        view.engine_identity = backends.identity_key(peer.registration) or ""
        view.notify_endpoint.CopyFrom(peer.registration.notify_endpoint)
    oldest = heapq.nsmallest(request_limit, peer.open.values(), key=lambda r: r.admitted_at)
    view.requests.extend(
        describe_pb2.RequestView(room=r.room if full else 0, generation=r.generation,
                                 state=r.state,  # type: ignore[arg-type]
                                 bytes_transferred=r.bytes, chunks_done=r.chunks_done,
                                 age_ms=_ms(now - r.admitted_at), is_dummy=r.transfer.is_dummy)
        for r in oldest)
    if finished_limit and full:
        kept = list(peer.finished.values())[-finished_limit:]
        view.finished.extend(transfer_pb2.TransferStatus.FromString(f.blob) for f in kept)
    return view


def _shares(shown: list[Peer], limit: int, include_finished: bool, operator: bool, caller: Peer | None,
            limits: Limits) -> list[tuple[Peer, int, int, bool]]:
    """(peer, open request views, final statuses, shown in full) for each shown peer. The views of all
    of them together stop at what one peer can hold (``max_inflight`` + ``max_finished``), so no
    ``request_limit`` makes a call cost more than one snapshot."""
    budget = limits.kept_per_peer
    shares = []
    for peer in shown:
        full = operator or peer is caller
        opened = min(limit, budget, len(peer.open))
        finished = min(limit, budget - opened, len(peer.finished)) if include_finished and full else 0
        budget -= opened + finished
        shares.append((peer, opened, finished, full))
    return shares


def describe(core: HandshakeCore, hub: SessionHub, request: hs.DescribeRequest, *,
             operator: bool = False) -> hs.DescribeResponse:
    """Peers (one, when ``request.peer_id`` is set), their open requests, and the limits in use.

    ``operator``: the call carries the operator token, and every peer is shown in full. Else only
    the peer whose credential ``request`` carries is (a wrong one is PEER_NOT_FOUND, as on every call).
    """
    caller = core.peer(request.peer_id, request.peer_credential) if request.peer_credential else None
    now = time.monotonic()
    limit = request.request_limit or DEFAULT_REQUEST_LIMIT
    peers = list(core.registry.peers.values())
    shown = [p for p in peers if not request.peer_id or p.peer_id == request.peer_id]
    shares = _shares(shown, limit, request.include_finished, operator, caller, core.limits)
    if not operator:
        # As costly to build as a snapshot of as many statuses: drawn on the same allowance, before.
        core.draw_snapshot(caller, sum(o + f for _, o, f, _ in shares), "a Describe call's request views")
    most_open = max((len(p.open) for p in peers), default=0)
    held = [*peers, *core.registry.retired.values()]
    return hs.DescribeResponse(
        version=common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
        prefill_rank=core.engine.prefill_rank,
        backend=backends.by_name(core.engine.executor.backend).enum,
        uptime_ms=_ms(now - hub.started_at),
        draining=core.shutting_down,
        peers=[_peer_view(peer, hub, now, opened, finished, full) for peer, opened, finished, full in shares],
        limits=[
            describe_pb2.LimitUse(name="max_peers", limit=core.limits.max_peers, used=core.registry.held()),
            describe_pb2.LimitUse(name="max_inflight", limit=core.limits.max_inflight_per_peer, used=most_open),
            describe_pb2.LimitUse(name="max_finished", limit=core.limits.max_finished_per_peer,
                                  used=max((len(p.finished) for p in peers), default=0)),
            describe_pb2.LimitUse(name="max_streams", limit=core.limits.max_streams_per_peer,
                                  used=max((len(p.feeds) for p in peers), default=0)),
        ],
        open_requests=sum(len(p.open) for p in peers),
        outcomes=core.metrics.outcomes,
        rooms=len(core.engine.rooms),
        engine_calls=sum(1 for p in held if p.worker.busy),
        engine_calls_stuck=sum(1 for p in held if p.worker.stuck),
        registrations_judged=core.admission.judged,
    )


__all__ = ["DEFAULT_REQUEST_LIMIT", "describe"]
