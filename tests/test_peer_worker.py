"""Peer workers and status feeds on their own: real threads and a real event loop, no server.

A peer's worker (``pdproto.transfer.worker``, awaited by the server) runs a peer's blocking calls
one at a time and never lets a stuck call hold more than its own thread; a feed sends every
request's terminal status exactly once however far its reader falls behind.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdproto import errors as E
from pdproto.errors import Reason
from pdproto.transfer.worker import PeerWorker
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_server.feed import StatusFeed

FAILED, SUCCESS, MOVING = (common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_SUCCESS,
                           common_pb2.TRANSFER_STATE_TRANSFERRING)


def _status(room: int, state: int, generation: int = 0) -> transfer_pb2.TransferStatus:
    return transfer_pb2.TransferStatus(room=room, generation=generation, state=state)  # type: ignore[arg-type]


def test_stuck_call_fails_its_queue_and_frees_the_worker_when_it_returns() -> None:
    release = threading.Event()
    stuck, other = PeerWorker("stuck", 0.2), PeerWorker("other", 5)

    async def main() -> None:
        blocked = asyncio.wrap_future(stuck.submit(release.wait, what="chunk 0"))
        await asyncio.sleep(0)
        queued = [asyncio.wrap_future(stuck.submit(lambda: 1, what=f"chunk {i}")) for i in (1, 2)]
        with pytest.raises(E.DeadlineExceededError) as first:
            await blocked
        assert first.value.reason is Reason.DEADLINE_EXCEEDED and stuck.stuck and stuck.busy
        for q in queued:  # queued behind the stuck call: refused at once, not after their own deadline
            with pytest.raises(E.DeadlineExceededError, match="not started"):
                await q
        # Another peer's worker is untouched; a cleanup call waits behind the stuck one.
        assert await asyncio.wrap_future(other.submit(lambda: "ok", what="x")) == "ok"
        cleanup = asyncio.wrap_future(stuck.submit(lambda: "gone", what="disconnect", cleanup=True))
        await asyncio.sleep(0.05)
        assert not cleanup.done()
        release.set()
        assert await cleanup == "gone"
        assert not stuck.stuck and not stuck.busy
        assert await asyncio.wrap_future(stuck.submit(lambda: 2, what="later")) == 2  # served again

    try:
        asyncio.run(main())
    finally:
        release.set()
        stuck.shutdown()
        other.shutdown()


def test_worker_runs_calls_one_at_a_time_in_arrival_order() -> None:
    worker = PeerWorker("p", 5)
    order: list[int] = []
    inside = 0
    most = 0
    lock = threading.Lock()

    def call(i: int) -> int:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        threading.Event().wait(0.002)
        with lock:
            inside -= 1
            order.append(i)
        return i

    async def main() -> list[int]:
        return list(await asyncio.gather(*(asyncio.wrap_future(worker.submit(call, i, what="c")) for i in range(20))))

    try:
        assert asyncio.run(main()) == list(range(20))
    finally:
        worker.shutdown()
    assert order == list(range(20)) and most == 1


def test_a_call_cancelled_while_queued_never_runs_and_a_call_from_the_worker_runs_in_place() -> None:
    """What the runner relies on when a request stops while its chunk waits behind another call, and
    what an executor relies on when a call running on the worker calls the executor again."""
    worker = PeerWorker("p", 5)
    release = threading.Event()
    ran: list[str] = []
    try:
        first = worker.submit(release.wait, what="first")
        queued = worker.submit(ran.append, "queued", what="queued")
        assert queued.cancel() and queued.returned.done()  # it will never run: nothing to wait for
        outer = worker.submit(lambda: worker.submit(ran.append, "inner", what="inner").result(), what="outer")
        release.set()
        outer.result(timeout=5)
        assert first.result(timeout=5) is True and ran == ["inner"] and not worker.busy
    finally:
        release.set()
        worker.shutdown()


def test_feed_coalesces_progress_but_never_a_terminal_status() -> None:
    async def main() -> list[transfer_pb2.TransferStatus]:
        feed = StatusFeed(limit=8)
        for room in range(50):
            for _ in range(5):
                feed.push(_status(room, MOVING))
            feed.push(_status(room, SUCCESS if room % 2 else FAILED))
        feed.push(_status(7, MOVING, generation=1))  # a newer generation of a finished room
        assert feed.pending <= 2 * 51
        feed.close()
        return [s async for s in feed]

    got = asyncio.run(main())
    terminal = [(s.room, s.generation) for s in got if s.state in (SUCCESS, FAILED)]
    assert sorted(terminal) == [(r, 0) for r in range(50)]
    assert (7, 1) in {(s.room, s.generation) for s in got}


def test_feed_filters_rooms_and_ends_after_what_was_queued() -> None:
    async def main() -> list[int]:
        feed = StatusFeed(rooms=[2, 3])
        for room in range(5):
            feed.push(_status(room, FAILED))
        feed.close()
        feed.push(_status(3, SUCCESS, generation=1))  # after close: dropped
        return [s.room async for s in feed]

    assert asyncio.run(main()) == [2, 3]


def test_feed_sends_its_snapshots_kept_finals_first_and_counts_them_toward_falling_behind() -> None:
    """A snapshot's kept final statuses queue serialized (parsed only as sent, so a stream dropped
    at once costs next to nothing for thousands of them) and go out before every later push; a
    reader that takes none of them falls behind as if they were parsed."""
    finals = [_status(room, SUCCESS) for room in range(3)]

    async def read() -> list[transfer_pb2.TransferStatus]:
        feed = StatusFeed()
        feed.finals(s.SerializeToString() for s in finals)
        feed.push(_status(9, MOVING))
        assert feed.pending == 4
        feed.close()
        return [s async for s in feed]

    assert asyncio.run(read()) == [*finals, _status(9, MOVING)]

    async def fall_behind() -> E.PdprotoError | None:
        behind: list[bool] = []
        feed = StatusFeed(unread=4, on_behind=lambda: behind.append(True))
        feed.finals(s.SerializeToString() for s in finals)
        feed.push(_status(9, MOVING))
        assert not behind
        feed.push(_status(10, MOVING))  # five queued, none read
        assert behind and feed.pending == 0
        with pytest.raises(E.UnavailableError):
            _ = [s async for s in feed]
        return feed.behind

    assert asyncio.run(fall_behind()) is not None
