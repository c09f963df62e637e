"""The server's life: whether it admits work, the tasks it owns, the once-a-second expiry, drain and close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pdproto.errors import Reason, ShuttingDownError

from .admission import Admission
from .engine import PrefillEngine
from .expiry import Deadlines
from .registry import Limits, Peer, PeerRegistry
from .runner import TransferRunner

log = logging.getLogger("pdproto_server.housekeeping")


class Lifecycle:
    """Whether the server still admits work and whether its streams have ended; the tasks it owns."""

    def __init__(self) -> None:
        self.shutting_down = False
        """A drain began: no new registration or request is admitted."""
        self.streams_closed = False
        """The drain is over: every status stream was told so, and a new one ends after its snapshot."""
        self._background: set[asyncio.Task[object]] = set()

    def accepting(self) -> None:
        """Raise SHUTTING_DOWN once a drain began."""
        if self.shutting_down:
            raise ShuttingDownError("the prefill is shutting down and takes no new work")

    def spawn(self, coro: Coroutine[Any, Any, object], name: str) -> asyncio.Task[object]:
        """A background task the server owns (``settle`` waits for it)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the background tasks."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)


class Housekeeping:
    """Expiry once a second (only what fell due), the drain, and the close that frees everything."""

    def __init__(self, engine: PrefillEngine, limits: Limits, registry: PeerRegistry, runner: TransferRunner,
                 deadlines: Deadlines[Peer], life: Lifecycle, admission: Admission) -> None:
        self.engine = engine
        self.limits = limits
        self.registry = registry
        self.runner = runner
        self.deadlines = deadlines
        """When to look at a peer again: its oldest kept final status expires, or it is gone long enough."""
        self.life = life
        self.admission = admission
        self.on_tick: list[Callable[[float], None]] = []
        """Also called on each tick, with the time (the sessions' expiry)."""
        self._janitor: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the once-a-second tick on the running loop."""
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
        self.life.shutting_down = True
        if self.runner.open:
            log.info("draining %d in-flight requests (up to %.1fs)", self.runner.open, timeout)
            await self.runner.idle(timeout)
        leftovers = [(p, r) for p in self.registry.peers.values() for r in p.open_requests()]
        await asyncio.gather(*(self.runner.stop(p, r, Reason.SHUTTING_DOWN, "the prefill shut down")
                               for p, r in leftovers))
        self.life.streams_closed = True
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
        await self.life.settle(self.limits.drain_timeout)
        self.admission.close()


__all__ = ["Housekeeping", "Lifecycle"]
