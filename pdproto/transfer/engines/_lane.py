"""A peer's lane: one daemon thread that runs the peer's engine calls, one at a time, in order.

``concurrent.futures`` pools join their worker threads when the interpreter exits, so a
call stuck in native engine code (a frozen peer) would keep a process that has shut down
alive until the engine gives the call up. A lane's thread is a daemon, as the server's
lanes are (``pdproto_server/lanes.py``), so exit never waits for it. Like those pools, a lane
takes no new work once the interpreter is exiting: whether a call still runs can then no
longer be answered by a marker queued behind it.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")

_exiting = threading.Event()


def _on_exit() -> None:
    _exiting.set()


try:
    # The hook concurrent.futures uses: it runs when the main thread ends, before atexit handlers.
    threading._register_atexit(_on_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other interpreters, or imported during exit
    atexit.register(_on_exit)


class Lane:
    """One daemon worker thread with a FIFO queue; ``submit`` returns a ``Future`` like an executor's."""

    def __init__(self, name: str = "pdproto-peer") -> None:
        """Start the worker thread."""
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._shut = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Queue ``fn(*args)``; RuntimeError once the lane was shut down or the interpreter is exiting."""
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _exiting.is_set():
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            future: Future[_T] = Future()
            self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = False) -> None:
        """Take no more work; the thread ends after what is queued (``wait``: join it)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                self._queue.put(None)
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as an executor does
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args, item


__all__ = ["Lane"]
