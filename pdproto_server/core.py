"""The handshake service's state machine, free of gRPC: its concerns, and the server's life.

``admission.py`` (Register, Deregister, Evict, identities, removal), ``requests.py``
(SubmitTransfer, Abort) and ``streams.py`` (WatchStatus, subscriptions, snapshot allowance)
share the registry and the runner through this core. The core itself says whether work is
admitted, owns the background tasks, and runs the once-a-second expiry, the drain and the
close; the servicer, the session hub and ``Describe`` call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pdproto.errors import Reason, ShuttingDownError
from pdproto.v1 import server_info_pb2

from .admission import Admission
from .engine import Deadlines, PrefillEngine
from .metrics import ServiceMetrics
from .registry import Limits, Peer, PeerRegistry
from .requests import Requests
from .runner import TransferRunner
from .streams import Streams

log = logging.getLogger("pdproto_server.core")


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
        self.shutting_down = False
        """A drain began: no new registration or request is admitted."""
        self.streams_closed = False
        """The drain is over: every status stream was told so, and a new one ends after its snapshot."""
        self.on_tick: list[Callable[[float], None]] = []
        """Also called on each housekeeping tick, with the time (the sessions' expiry)."""
        self._background: set[asyncio.Task[object]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self.admission = Admission(self)
        self.requests = Requests(self)
        self.streams = Streams(self)
        # What the servicer, the session hub and Describe call, by concern.
        self.register, self.deregister, self.evict = (self.admission.register, self.admission.deregister,
                                                      self.admission.evict)
        self.peer = registry.peer
        self.submit, self.submit_to = self.requests.submit, self.requests.submit_to
        self.abort, self.abort_for = self.requests.abort, self.requests.abort_for
        self.watch, self.subscribe = self.streams.watch, self.streams.subscribe
        self.draw_snapshot, self.ended_reason = self.streams.draw_snapshot, self.streams.ended_reason

    @property
    def info(self) -> server_info_pb2.PrefillServerInfo:
        """The published topology."""
        return self.engine.source.info

    def accepting(self) -> None:
        """Raise SHUTTING_DOWN once a drain began."""
        if self.shutting_down:
            raise ShuttingDownError("the prefill is shutting down and takes no new work")

    def spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[object]:
        """A background task the server owns (``close`` waits for it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def pace(self, peer_id: str, credential: bytes) -> None:
        """Hold a call made with a peer's credential until its call rate has room (``PeerRegistry.pace``)."""
        wait = self.registry.pace(peer_id, credential)
        if wait:
            await asyncio.sleep(wait)

    async def start(self) -> None:
        """Attach the engine to this loop and start the once-a-second housekeeping tick."""
        self.engine.attach(asyncio.get_running_loop())
        self._janitor = asyncio.get_running_loop().create_task(self._tick(), name="janitor")

    async def _tick(self) -> None:
        """Expire orphan rooms, old finished statuses and released gone peers, once a second."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.expire()
            except Exception:  # noqa: BLE001 - housekeeping must outlive one bad tick
                log.exception("housekeeping failed; retrying next tick")

    async def expire(self, now: float | None = None) -> None:
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
                    await self.admission.drop(peer, Reason.PEER_GONE, "the decode process is gone")
                    continue
                self.deadlines.add(now + 1.0, peer)  # its requests are still being failed
            peer.expire_finished(now - keep)
            if peer.finished:
                self.deadlines.add(next(iter(peer.finished.values())).at + keep, peer)
        for tick in self.on_tick:
            tick(now)

    async def drain(self, timeout: float) -> None:
        """Stop admitting work, let open requests finish (up to ``timeout``), fail the rest."""
        self.shutting_down = True
        if self.runner.open:
            log.info("draining %d in-flight requests (up to %.1fs)", self.runner.open, timeout)
            await self.runner.idle(timeout)
        leftovers = [(p, r) for p in self.registry.peers.values() for r in list(p.open.values())]
        await asyncio.gather(*(self.runner.stop(p, r, Reason.SHUTTING_DOWN, "the prefill shut down")
                               for p, r in leftovers))
        self.streams_closed = True
        for peer in self.registry.peers.values():
            peer.end_streams()

    async def close(self) -> None:
        """Drop every peer and stop the tick; an engine call stuck in an engine is left behind."""
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        for peer in list(self.registry.peers.values()):
            await self.admission.drop(peer, Reason.SHUTTING_DOWN, "the prefill shut down")
        await self.runner.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.limits.drain_timeout)
        self.admission.close()


__all__ = ["HandshakeCore"]
