"""Each peer's worker: one daemon thread that runs the peer's calls one at a time, each with a deadline.

How executors and the prefill service use it, and what *stuck* means, is in this package's README
(reading order, item 3; "Prefill side"). Two details it leaves out: a call submitted from the
worker's own thread runs in place, under the deadline of the call running; and like
``concurrent.futures`` pools a worker takes no new work once the interpreter is exiting, as whether
a call still runs can then no longer be answered. A stuck worker does not write its peer off: an
engine can stall every peer at once (Mooncake does while one P2P handshake hangs).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pdproto.errors import DeadlineExceededError, NotFoundError, PdprotoError, Reason, ShuttingDownError

if TYPE_CHECKING:
    from .base import Notification

_T = TypeVar("_T")
_P = TypeVar("_P")
log = logging.getLogger("pdproto.transfer.worker")

_exiting = threading.Event()


def _on_exit() -> None:
    _exiting.set()


try:
    # The hook concurrent.futures uses: it runs when the main thread ends, before atexit handlers.
    threading._register_atexit(_on_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other interpreters, or imported during exit
    atexit.register(_on_exit)


class Call(Future[_T]):
    """One call on a peer's worker: its outcome (or DEADLINE_EXCEEDED), and ``returned``."""

    def __init__(self, fn: Callable[..., _T], args: tuple[Any, ...], what: str, cleanup: bool,
                 deadline: float | None) -> None:
        super().__init__()
        self.fn, self.args, self.what, self.cleanup = fn, args, what, cleanup
        self.deadline = deadline
        """``time.monotonic()`` by which it must return (a cleanup call's is set when it starts)."""
        self.overran = False
        """Failed by its deadline while it ran (its waiter was told; the thread may still be inside)."""
        self.returned: Future[None] = Future()
        """Done once the call's thread is back, or once the call will never run."""

    def cancel(self) -> bool:
        """Cancel a call that has not started: it never runs (False once it runs)."""
        if not super().cancel():
            return False
        _settle(self.returned, None)
        return True


def _outcome(call: Call[Any]) -> tuple[Any, BaseException | None]:
    """Run the call: (result, None), or (None, what it raised) for its waiter."""
    try:
        return call.fn(*call.args), None
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as an executor does
        return None, exc


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless something else (the deadline, a cancel) completed it first."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class PeerWorker:
    """One peer's calls: a daemon thread, FIFO, each call with a deadline; stuck detection."""

    def __init__(self, name: str, deadline_s: float) -> None:
        """Start the thread; ``deadline_s`` bounds every call (``name`` labels errors and the thread)."""
        self.name = name
        self.deadline_s = deadline_s
        self.on_done: Callable[[BaseException | None], None] | None = None
        """Called with the outcome (None, or the error) of each call submitted from another thread, not a
        cleanup call, before its waiter hears of it: an executor counts failures and timeouts there, once
        per call, whoever submitted it."""
        self.stuck_since: float | None = None
        """When the running call ran past its deadline (monotonic); None once it returned."""
        self._queue: collections.deque[Call[Any]] = collections.deque()
        self._lock = threading.Condition()
        self._current: Call[Any] | None = None
        self._armed = float("inf")
        self._shut = False
        self._thread = threading.Thread(target=self._work, name=name[:64], daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A call is running or queued."""
        return self._current is not None or bool(self._queue)

    @property
    def stuck(self) -> bool:
        """The running call ran past its deadline and has not returned."""
        return self.stuck_since is not None

    @property
    def deadline(self) -> float:
        """The running call's deadline (what engine waits inside it read); the worker's own span outside one."""
        current = self._current
        if current is not None and current.deadline is not None:
            return current.deadline
        return time.monotonic() + self.deadline_s

    def on_thread(self) -> bool:
        """True on the worker's own thread (inside one of its calls)."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., _T], *args: Any, what: str, cleanup: bool = False) -> Call[_T]:
        """Queue ``fn(*args)``; ``what`` names it in errors. A ``cleanup`` call waits behind a stuck one.

        Raises DEADLINE_EXCEEDED at once while the worker is stuck (not for cleanup),
        PEER_NOT_FOUND once it was shut down and SHUTTING_DOWN while the interpreter exits.
        """
        if self.on_thread():
            call: Call[_T] = Call(fn, args, what, cleanup, self.deadline)
            call.set_running_or_notify_cancel()
            _settle(call, *_outcome(call))
            _settle(call.returned)
            return call
        with self._lock:
            if self._shut:
                raise NotFoundError(f"{what}: the peer is not connected", reason=Reason.PEER_NOT_FOUND,
                                    metadata={"peer": self.name})
            if _exiting.is_set():
                raise ShuttingDownError(f"{what}: the process is exiting and runs no more engine calls",
                                        reason=Reason.SHUTTING_DOWN, metadata={"peer": self.name})
            if self.stuck and not cleanup:
                raise self._stuck_error(what)
            call = Call(fn, args, what, cleanup, None if cleanup else time.monotonic() + self.deadline_s)
            self._queue.append(call)
            self._lock.notify()
            if call.deadline is not None:
                self._arm(call.deadline)
        return call

    def idle(self) -> Call[None]:
        """A marker done once every call submitted so far has returned (a cleanup call: it waits out a stuck one)."""
        return self.submit(_nothing, what="a drain marker", cleanup=True)

    def shutdown(self) -> None:
        """Take no more work; the thread ends after what is queued."""
        with self._lock:
            self._shut = True
            self._lock.notify()

    def _stuck_error(self, what: str) -> DeadlineExceededError:
        held = time.monotonic() - (self.stuck_since or time.monotonic())
        return DeadlineExceededError(
            f"{what}: not started, the peer's previous engine call is stuck ({held:.1f} s past its deadline: "
            "the peer is frozen or not answering); the peer is served again once the engine returns it",
            reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": self.name, "stuckSeconds": round(held, 1)})

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._shut:
                    self._lock.wait()
                if not self._queue:
                    return
                call = self._queue.popleft()
                if call.cancelled():
                    with contextlib.suppress(RuntimeError):
                        call.set_running_or_notify_cancel()  # wakes concurrent.futures.wait on it
                elif not call.done() and call.set_running_or_notify_cancel():
                    self._current = call
                    if call.deadline is None:
                        call.deadline = time.monotonic() + self.deadline_s
                        self._arm(call.deadline)
            if self._current is not call:
                _settle(call.returned)  # cancelled or failed while queued: it never runs
                continue
            outcome = _outcome(call)
            call.fn, call.args = _nothing, ()  # a call kept by its waiter keeps no job alive
            with self._lock:  # idle before the waiter hears of it
                self._current = None
                self.stuck_since = None
                told = call.overran
            if not told:
                self._done(call, outcome[1])
            _settle(call.returned)
            _settle(call, *outcome)
            del call, outcome

    def _arm(self, when: float) -> None:
        """Have the watchdog look at this worker at ``when`` (held lock; one entry per earliest deadline)."""
        if when < self._armed:
            self._armed = when
            _WATCHDOG.add(when, self)

    def expire(self, now: float) -> None:
        """Fail what is past its deadline (the watchdog calls this); re-arm for the next deadline."""
        failed: list[tuple[Call[Any], DeadlineExceededError]] = []
        with self._lock:
            self._armed = float("inf")
            current = self._current
            if (current is not None and not current.done() and current.deadline is not None
                    and current.deadline <= now):
                self.stuck_since = now
                current.overran = True
                failed.append((current, DeadlineExceededError(
                    f"{current.what}: the transfer engine did not return within {self.deadline_s:g} s (the peer is "
                    "frozen, overloaded or not answering); the destination may still be written until it does",
                    reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": self.name, "timeoutSeconds": self.deadline_s})))
            for call in self._queue:
                if call.cleanup or call.done():
                    continue
                if self.stuck:
                    failed.append((call, self._stuck_error(call.what)))
                elif call.deadline is not None and call.deadline <= now:
                    failed.append((call, DeadlineExceededError(
                        f"{call.what}: waited {self.deadline_s:g} s behind earlier calls to this peer and never "
                        "started", reason=Reason.DEADLINE_EXCEEDED,
                        metadata={"peer": self.name, "timeoutSeconds": self.deadline_s})))
            gone = {id(c) for c, _ in failed if c is not current}
            if gone:
                self._queue = collections.deque(c for c in self._queue if id(c) not in gone)
            pending = [c.deadline for c in (current, *self._queue)
                       if c is not None and not c.done() and c.deadline is not None and c.deadline > now]
            if pending:
                self._arm(min(pending))
        for call, error in failed:
            self._done(call, error)
            if call is not current:
                _settle(call.returned)
            _settle(call, error=error)

    def _done(self, call: Call[Any], error: BaseException | None) -> None:
        if self.on_done is not None and not call.cleanup:
            self.on_done(error)


def _nothing() -> None:
    """A drain marker's call."""


class _Watchdog:
    """One daemon thread for every worker's deadlines: each worker is entered at its earliest one."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, PeerWorker]] = []
        self._lock = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, when: float, worker: PeerWorker) -> None:
        with self._lock:
            heapq.heappush(self._heap, (when, next(self._seq), worker))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdproto-deadlines", daemon=True)
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._heap or self._heap[0][0] > (now := time.monotonic()):
                    self._lock.wait(self._heap[0][0] - now if self._heap else None)
                _, _, worker = heapq.heappop(self._heap)
            try:
                worker.expire(now)
            except Exception:  # noqa: BLE001 - one worker's failure must not stop every deadline
                log.exception("deadline check of %s failed", worker.name)


_WATCHDOG = _Watchdog()


class PeerWorkers:
    """An executor's workers by peer id: created on first use, retired with the peer's disconnect."""

    def __init__(self, deadline_s: float, on_done: Callable[[BaseException | None], None] | None = None) -> None:
        """Workers bound every call by ``deadline_s``; ``on_done`` sees each call (``PeerWorker.on_done``)."""
        self.deadline_s = deadline_s
        self._on_done = on_done
        self._workers: dict[str, PeerWorker] = {}
        self._lock = threading.Lock()

    def worker(self, peer_id: str) -> PeerWorker:
        """The peer's worker, started on first use."""
        with self._lock:
            worker = self._workers.get(peer_id)
            if worker is None:
                worker = self._workers[peer_id] = PeerWorker(f"pdproto-peer-{peer_id}", self.deadline_s)
                worker.on_done = self._on_done
            return worker

    def get(self, peer_id: str) -> PeerWorker | None:
        """The peer's worker, if it has one."""
        return self._workers.get(peer_id)

    def retire(self, peer_id: str | None = None) -> None:
        """Forget the peer's worker (every worker: None) and let its thread end after what is queued."""
        with self._lock:
            gone = list(self._workers) if peer_id is None else [peer_id]
            workers = [w for w in (self._workers.pop(p, None) for p in gone) if w is not None]
        for worker in workers:
            worker.shutdown()


class PeerCalls(Generic[_P]):
    """What every executor keeps per peer: its connected state and its worker, and the waits built on them.

    The executor supplies ``_lock``, ``_peers``, ``_workers`` and ``drained``.
    """

    _lock: threading.Lock
    _peers: dict[str, _P]
    _workers: PeerWorkers

    def drained(self, peer_id: str) -> Future[Any] | None:
        """A future done once every call for the peer made so far has left the engine; None when none can be in it."""
        raise NotImplementedError

    def worker(self, peer_id: str) -> PeerWorker:
        """The peer's own worker (started on first use): its calls run there, one at a time."""
        return self._workers.worker(peer_id)

    def quiesce(self, peer_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` until no call for the peer is inside the engine (``drained``); True once none is.

        A call that overran its deadline may still be writing into the peer's pages; a caller that
        lets the decode reuse them (an Abort acknowledgement) waits here first. False when the
        process is exiting and a live peer's worker can no longer say.
        """
        try:
            marker = self.drained(peer_id)
        except ShuttingDownError:
            return False
        if marker is None:
            return True
        try:
            marker.result(timeout=max(0.0, timeout))
        except FutureTimeout:
            return False
        except PdprotoError:
            pass  # the call failed, and it has left the engine
        return True

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call (decode side); empty unless the engine has them
        (NIXL): elsewhere completion travels over the control plane."""
        return []

    def _peer(self, peer_id: str) -> _P:
        """The connected peer; PEER_NOT_FOUND otherwise."""
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise NotFoundError("peer is not connected", reason=Reason.PEER_NOT_FOUND, metadata={"peer": peer_id})
        return peer


__all__ = ["Call", "PeerCalls", "PeerWorker", "PeerWorkers"]
