"""The one event-loop thread (``pdproto.rpc.loop.LoopThread``): results, deadlines, and no self-wait."""

from __future__ import annotations

import asyncio

import pytest

from pdproto.errors import DeadlineExceededError
from pdproto.rpc.loop import LoopThread


def test_run_returns_results_and_raises_the_coroutines_errors() -> None:
    lt = LoopThread("test-loop")
    try:
        async def double(x: int) -> int:
            await asyncio.sleep(0)
            return 2 * x

        async def boom() -> None:
            raise ValueError("boom")

        assert lt.run(double(21)) == 42
        with pytest.raises(ValueError, match="boom"):
            lt.run(boom())
    finally:
        lt.stop()
    assert not lt.alive


def test_a_wait_past_its_timeout_is_deadline_exceeded_and_cancels_the_coroutine() -> None:
    lt = LoopThread("test-loop")
    cancelled = asyncio.Event()
    try:
        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(DeadlineExceededError, match="within 0.05 s"):
            lt.run(forever(), timeout=0.05, what="forever")

        async def was_cancelled() -> bool:
            await asyncio.wait_for(cancelled.wait(), 5)
            return cancelled.is_set()

        assert lt.run(was_cancelled())
    finally:
        lt.stop()


def test_a_blocking_call_from_the_loops_own_thread_fails_at_once_instead_of_hanging() -> None:
    lt = LoopThread("test-loop")
    try:
        async def nested() -> str:
            async def inner() -> str:
                return "never"

            try:
                return lt.run(inner(), what="a nested call")
            except RuntimeError as exc:
                return str(exc)

        message = lt.run(nested(), timeout=10)
        assert "a nested call" in message and "wait on itself" in message
    finally:
        lt.stop()
