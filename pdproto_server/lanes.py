"""Per-peer engine lanes: each peer's blocking engine calls, one at a time, each with a deadline.

Engine calls block a thread (``execute``, ``connect``, ``disconnect``), and a peer that
stops answering (a frozen decode, a session that accepts and never replies) can hold one
for as long as the engine lets it. So every peer gets a lane:

* its calls run one after another, first come first served, on a pool with a thread for
  every peer the registry may hold (``Limits.max_peers``, ``LanePool``): a stuck peer
  holds one thread, never another peer's;
* each call is awaited with a deadline. A call that outlives it fails its caller with
  DEADLINE_EXCEEDED and marks the lane **stuck**: the calls queued behind it fail at once
  with the same reason, and so does every new one, instead of piling up;
* the lane stays taken until the engine call really returns; then it is no longer stuck
  and the peer works again. The registry counts a removed peer toward ``max_peers`` until
  its lane is idle, so the number of threads stays bounded.

A stuck lane does not write its peer off: an engine can stall every peer at once (Mooncake
does while one P2P handshake hangs), and healthy peers must come back when it recovers.
A peer is written off only when the engine says it is gone (PEER_GONE).
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from pdproto.errors import DeadlineExceededError, Reason, RequestFailedError

_T = TypeVar("_T")


class CallNotWantedError(RequestFailedError):
    """An engine call not run: its request was stopped while the call waited for the lane."""


class Lane:
    """One peer's engine calls: at most one in flight, FIFO, each awaited with a deadline."""

    def __init__(self, pool: Executor, name: str) -> None:
        self._pool = pool
        self.name = name
        self._taken = False
        self._waiters: collections.deque[tuple[asyncio.Future[None], bool]] = collections.deque()
        """Calls waiting for the lane, in arrival order, each with whether it is a cleanup call."""
        self.call: asyncio.Future[Any] | None = None
        """The engine call in flight (done once its thread returned), if any."""
        self.tag: Hashable = None
        """What the call in flight is for (the runner tags a chunk with its room and generation)."""
        self.stuck_since: float | None = None
        """When the call in flight ran past its deadline (monotonic); None once it returned."""
        self._idle_waiters: list[asyncio.Future[None]] = []

    @property
    def busy(self) -> bool:
        """An engine call's thread has not returned yet."""
        return self.call is not None and not self.call.done()

    @property
    def stuck(self) -> bool:
        """The call in flight ran past its deadline and has not returned."""
        return self.stuck_since is not None

    def _stuck_error(self, what: str) -> DeadlineExceededError:
        assert self.stuck_since is not None
        held = time.monotonic() - self.stuck_since
        return DeadlineExceededError(
            f"{what}: not started, the peer's previous engine call is stuck ({held:.1f} s past its "
            "deadline); the peer is served again once the engine returns it",
            reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": self.name, "stuckSeconds": round(held, 1)})

    async def _acquire(self, what: str, cleanup: bool) -> None:
        """Take the lane in arrival order; a stuck lane refuses at once (a cleanup call still queues)."""
        if self.stuck and not cleanup:
            raise self._stuck_error(what)
        if not self._taken and not self._waiters:
            self._taken = True
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(_retrieve)
        self._waiters.append((waiter, cleanup))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._hand_on()  # handed the lane as we left: pass it to the next in line
            else:
                waiter.cancel()
            raise
        if self.stuck and not cleanup:  # handed over while stuck (a cleanup call went first)
            self._hand_on()
            raise self._stuck_error(what)

    def _hand_on(self) -> None:
        """Give the lane to the first live waiter, or free it."""
        while self._waiters:
            waiter, _ = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._taken = False

    def _mark_stuck(self, what: str) -> None:
        """The call in flight missed its deadline: every call queued behind it fails now (cleanup waits)."""
        self.stuck_since = time.monotonic()
        error = self._stuck_error(what)
        for waiter, cleanup in self._waiters:
            if not cleanup and not waiter.done():
                waiter.set_exception(error)
        self._waiters = collections.deque((w, c) for w, c in self._waiters if not w.done())

    async def run(self, fn: Callable[..., _T], *args: object, timeout: float, what: str,
                  drain: float = 0.0, cleanup: bool = False, tag: Hashable = None,
                  wanted: Callable[[], bool] | None = None) -> _T:
        """Run ``fn(*args)`` on the pool once the lane is free; ``what`` names it in errors.

        Raises DEADLINE_EXCEEDED when the call does not return within ``timeout`` seconds
        (the lane is stuck until it does), or without running it when the lane is stuck
        already. If the caller is cancelled while the call runs, it waits up to ``drain``
        seconds for the call to return before re-raising, so that a copy in progress is
        not abandoned under an Abort that promised it drained. A ``cleanup`` call
        (disconnect) waits behind a stuck call instead of failing. ``tag`` labels the call
        (``tag`` attribute) while it is out. ``wanted`` is asked once the lane is ours: when it
        says no (its request was stopped while queued), the call does not run and
        ``CallNotWantedError`` is raised.
        """
        await self._acquire(what, cleanup)
        if wanted is not None and not wanted():
            self._hand_on()
            raise CallNotWantedError(f"{what}: not run, its request ended while it waited for the lane",
                                     reason=Reason.ABORTED, metadata={"peer": self.name})
        # From here the lane is taken until the thread returns, whoever stops waiting for it.
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except BaseException:
            self._hand_on()
            raise
        self.call, self.tag = fut, tag
        fut.add_done_callback(self._returned)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if not fut.done():
                self._mark_stuck(what)
            raise DeadlineExceededError(
                f"{what}: the transfer engine did not return within {timeout:g} s; the destination "
                "may still be written until it does (Abort answers once it has)",
                reason=Reason.DEADLINE_EXCEEDED,
                metadata={"peer": self.name, "timeoutSeconds": timeout}) from None
        except asyncio.CancelledError:
            if drain > 0 and not fut.done():
                await asyncio.wait([fut], timeout=drain)
            raise

    def _returned(self, fut: asyncio.Future[Any]) -> None:
        """The call's thread is back: the lane is no longer stuck; the next call may run."""
        if not fut.cancelled():
            fut.exception()  # retrieved: a caller that gave up on it must not leave a loop warning
        self.stuck_since = None
        self.tag = None
        self._hand_on()
        waiters, self._idle_waiters = self._idle_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no engine call is in flight; True when idle."""
        if not self.busy:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(waiter)
        done, _ = await asyncio.wait([waiter], timeout=timeout)
        return bool(done)

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) once no engine call is in flight; at once when idle."""
        if not self.busy:
            callback()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(lambda _: callback())
        self._idle_waiters.append(waiter)


def _retrieve(fut: asyncio.Future[None]) -> None:
    """Mark a waiter's exception as seen (its task may have been cancelled meanwhile)."""
    if not fut.cancelled():
        fut.exception()


class LanePool(Executor):
    """Daemon threads, started on demand up to ``max_workers``, for engine calls.

    Unlike ``ThreadPoolExecutor``, whose threads the interpreter joins at exit, a thread
    stuck inside an engine here cannot keep a shut-down server's process alive.
    """

    def __init__(self, max_workers: int, name: str = "pdproto-lane") -> None:
        self._max = max(1, max_workers)
        self._name = name
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._busy = 0
        self._pending = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        """Run ``fn(*args)`` on a pool thread; a thread starts when every one is busy and the cap allows."""
        fut: Future[_T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("lane pool is shut down")
            self._pending += 1
            self._work.put((fut, lambda: fn(*args, **kwargs)))
            if self._threads - self._busy < self._pending and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._worker, name=f"{self._name}-{self._threads}", daemon=True).start()
        return fut

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fut, call = item
            with self._lock:
                self._pending -= 1
                self._busy += 1
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(call())
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; idle threads exit, a thread stuck in an engine is left behind (daemon)."""
        with self._lock:
            self._shutdown = True
            threads = self._threads
        for _ in range(threads):
            self._work.put(None)


__all__ = ["CallNotWantedError", "Lane", "LanePool"]
