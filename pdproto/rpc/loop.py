"""An asyncio event loop on a thread of its own, for hosts that are not asyncio (who uses it: README.md here)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from pdproto.errors import DeadlineExceededError, Reason

_T = TypeVar("_T")


class LoopThread:
    """An event loop running forever on a daemon thread; ``run`` waits for a coroutine on it."""

    _shared: LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self, name: str = "pdproto-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def shared(cls) -> LoopThread:
        """The process's loop thread, started on first use and kept for the process's life.

        One loop serves every blocking client: gRPC's asyncio poller is per loop, and
        loops that come and go leave its callbacks behind.
        """
        with cls._lock:
            if cls._shared is None or not cls._shared.alive:  # not alive: a forked child's copy
                cls._shared = LoopThread("pdproto-session")
            return cls._shared

    @property
    def alive(self) -> bool:
        """Whether the loop's thread still runs."""
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Start ``coro`` on the loop; the caller may wait on the returned future or not."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None, what: str = "the call") -> _T:
        """Run ``coro`` on the loop and wait for its result (its exceptions are raised here).

        With a ``timeout``, a wait past it cancels ``coro`` and raises ``DeadlineExceededError``.
        Called from the loop's own thread (a blocking client used in a callback the loop runs),
        it raises ``RuntimeError`` at once: waiting there would hang the loop for good.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{what}: a blocking call made on the pdproto event loop's own thread would "
                               "wait on itself forever; use the asyncio client (AsyncHandshakeClient) there")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceededError(f"{what} did not finish on the event loop within {timeout:g} s",
                                        reason=Reason.DEADLINE_EXCEEDED) from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (not for the shared loop, which lives as long as the process)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


__all__ = ["LoopThread"]
