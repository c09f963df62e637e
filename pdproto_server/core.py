"""The handshake service's state machine, free of gRPC: one facade over its four concerns.

``admission.py`` (Register, Deregister, Evict, identities, removal), ``requests.py``
(SubmitTransfer, Abort), ``streams.py`` (WatchStatus, subscriptions, snapshot allowance) and
``housekeeping.py`` (expiry, drain, close). They share the registry, the runner and one
``Lifecycle``; the servicer, the session hub and ``Describe`` call them through this class.
"""

from __future__ import annotations

import asyncio
import time

from pdproto.v1 import server_info_pb2

from .admission import Admission
from .engine import PrefillEngine
from .expiry import Deadlines
from .housekeeping import Housekeeping, Lifecycle
from .metrics import ServiceMetrics
from .registry import Limits, Peer, PeerRegistry
from .requests import Requests
from .runner import TransferRunner
from .streams import Streams


class HandshakeCore:
    """Everything the servicer does, as plain async methods raising ``PdprotoError``."""

    def __init__(self, engine: PrefillEngine, *, limits: Limits | None = None,
                 metrics: ServiceMetrics | None = None) -> None:
        self.engine = engine
        self.limits = limits = limits or Limits()
        self.metrics = metrics = metrics or ServiceMetrics()
        self.registry = registry = PeerRegistry(limits)
        # Read when scraped: setting the gauge on every Register and Deregister cost them a lock and a walk.
        metrics.peers.set_function(registry.live)
        metrics.legacy_peers.set_function(lambda: sum(1 for p in list(registry.peers.values()) if p.protocol))
        self.runner = runner = TransferRunner(engine, metrics, limits, registry.peers)
        engine.orphan_after, engine.keep_finished = limits.match_timeout, limits.keep_finished
        self.deadlines: Deadlines[Peer] = Deadlines()
        """When to look at a peer again: its oldest kept final status expires, or it is gone long enough."""
        runner.on_kept = lambda peer: self.deadlines.add(time.monotonic() + limits.keep_finished, peer)
        self.life = life = Lifecycle()
        self.admission = Admission(engine, limits, metrics, registry, runner, self.deadlines, life)
        self.requests = Requests(engine, limits, registry, runner, life)
        self.streams = Streams(limits, metrics, registry, life)
        self.housekeeping = Housekeeping(engine, limits, registry, runner, self.deadlines, life, self.admission)
        # What the servicer, the session hub and Describe call, by concern.
        self.register, self.deregister, self.evict = (self.admission.register, self.admission.deregister,
                                                      self.admission.evict)
        self.peer = registry.peer
        self.submit, self.submit_to = self.requests.submit, self.requests.submit_to
        self.abort, self.abort_for = self.requests.abort, self.requests.abort_for
        self.watch, self.subscribe = self.streams.watch, self.streams.subscribe
        self.draw_snapshot, self.ended_reason = self.streams.draw_snapshot, self.streams.ended_reason
        self.expire, self.drain, self.close = (self.housekeeping.expire, self.housekeeping.drain,
                                               self.housekeeping.close)
        self.on_tick = self.housekeeping.on_tick
        """Also called on each housekeeping tick, with the time (the sessions' expiry)."""

    @property
    def info(self) -> server_info_pb2.PrefillServerInfo:
        """The published topology."""
        return self.engine.source.info

    @property
    def shutting_down(self) -> bool:
        """A drain began: no new work is admitted."""
        return self.life.shutting_down

    @property
    def judged(self) -> int:
        """Registrations on or waiting for the judge thread."""
        return self.admission.judged

    async def pace(self, peer_id: str, credential: bytes) -> None:
        """Hold a call made with a peer's credential until its call rate has room (``PeerRegistry.pace``)."""
        wait = self.registry.pace(peer_id, credential)
        if wait:
            await asyncio.sleep(wait)

    async def start(self) -> None:
        """Attach the engine to this loop and start housekeeping."""
        self.engine.attach(asyncio.get_running_loop())
        self.housekeeping.start()


__all__ = ["HandshakeCore"]
