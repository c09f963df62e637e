"""Transfers that outlive their call: an engine executor's *unsettled* peers.

An engine may return from a call before it let go of a transfer (NIXL: a handle it would
not release yet, its cancel under way). Until it does, the transfer may still read the
job's staging extent and write the peer's pages, so the extent stays reserved and
``drained``/``quiesce`` for that peer wait; a daemon thread keeps asking the engine while
no caller comes to ask (``EngineExecutor`` mixes this in; ``nixl.py`` implements ``_settle``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..packing import StagingExtents

if TYPE_CHECKING:
    from ._engine import PeerState


def all_done(futures: Sequence[Future[Any]]) -> Future[None]:
    """A future done once every one of ``futures`` is (how each ended does not matter: it left the engine)."""
    out: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and out.set_running_or_notify_cancel():
            out.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return out


class Settling:
    """Bookkeeping of unsettled peers; the executor supplies the lock, peers and staging extents."""

    _lock: threading.Lock
    _peers: dict[str, PeerState]
    _winding: dict[int, PeerState]
    _settler: threading.Thread | None
    _extents: StagingExtents | None

    def _settle(self, peer: PeerState, until: float) -> bool:
        """Ask the engine until ``until`` (monotonic) to let go of the peer's outliving transfers; True once none is."""
        return peer.unsettled is None

    def _hold(self, peer: PeerState) -> None:
        """The engine still holds a transfer of ``peer`` that its call gave up: the peer is unsettled."""
        with self._lock:
            if peer.unsettled is None:
                peer.unsettled = Future()
            settler = None
            if self._settler is None:
                settler = self._settler = threading.Thread(target=self._settle_later, name="pdproto-settle",
                                                           daemon=True)
        if settler is not None:
            settler.start()

    def _settle_later(self) -> None:
        """Until no peer is unsettled, ask the engine again now and then (no caller may come to ask)."""
        delay = 0.01
        while True:
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            with self._lock:
                peers = [p for p in (*self._peers.values(), *self._winding.values()) if p.unsettled is not None]
                if not peers:
                    self._settler = None
                    return
            for peer in peers:
                self._settle(peer, 0.0)

    def _let_go(self, peer: PeerState) -> None:
        """The engine let go of every outliving transfer of ``peer``: release what waited for that."""
        with self._lock:
            done, peer.unsettled = peer.unsettled, None
        if done is not None and done.set_running_or_notify_cancel():
            done.set_result(None)

    def _unsettled(self, peer: PeerState) -> Future[None] | None:
        """After one more try to settle the peer, the future its outliving transfers hold (None: none)."""
        if peer.unsettled is None:
            return None
        self._settle(peer, 0.0)
        with self._lock:
            return peer.unsettled

    def _give_back(self, peer: PeerState, extent: tuple[int, int], settled: bool) -> None:
        """Return a job's staging extent, or, while the engine may still read it, once it let go."""
        extents = self._extents
        assert extents is not None
        with self._lock:
            pending = None if settled else peer.unsettled
        if pending is None:
            extents.release(*extent)
        else:
            # Another peer's job packing into bytes UCX may still read would send garbage.
            pending.add_done_callback(lambda _: extents.release(*extent))


__all__ = ["Settling", "all_done"]
