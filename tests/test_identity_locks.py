"""The identity locks that serialize registrations of one decode rank (``PeerRegistry.serialized``)."""

from __future__ import annotations

import asyncio

from pdproto_server.registry import Limits, PeerRegistry


def test_registrations_sharing_a_key_run_one_at_a_time_and_leave_no_lock_behind() -> None:
    async def main() -> None:
        registry = PeerRegistry(Limits())
        order: list[str] = []
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def first() -> None:
            async with registry.serialized(("notify:h:1", "local:a")):
                order.append("first in")
                first_in.set()
                await release_first.wait()
                order.append("first out")

        async def second() -> None:
            await first_in.wait()
            async with registry.serialized(("local:a",)):  # shares one key with the first
                order.append("second in")

        async def unrelated() -> None:
            await first_in.wait()
            async with registry.serialized(("notify:h:2",)):
                order.append("unrelated in")

        tasks = [asyncio.create_task(c()) for c in (first, second, unrelated)]
        await first_in.wait()
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["first in", "unrelated in"], order  # the second waits; a stranger does not
        release_first.set()
        await asyncio.gather(*tasks)
        assert order == ["first in", "unrelated in", "first out", "second in"], order
        assert registry._identity_locks == {}

    asyncio.run(main())


def test_a_registration_cancelled_while_it_waits_takes_its_keys_back_and_blocks_nobody() -> None:
    async def main() -> None:
        registry = PeerRegistry(Limits())
        holding = asyncio.Event()
        done = asyncio.Event()

        async def holder() -> None:
            async with registry.serialized(("local:a",)):
                holding.set()
                await done.wait()

        async def waiter() -> None:
            async with registry.serialized(("local:a", "notify:h:1")):
                raise AssertionError("never entered: it was cancelled while waiting")

        held = asyncio.create_task(holder())
        await holding.wait()
        waiting = asyncio.create_task(waiter())
        for _ in range(5):
            await asyncio.sleep(0)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        # The cancelled waiter's own key went with it; the holder's stays until it leaves.
        assert set(registry._identity_locks) == {"local:a"}
        done.set()
        await held
        assert registry._identity_locks == {}
        async with registry.serialized(("local:a", "notify:h:1")):  # free again
            pass
        assert registry._identity_locks == {}

    asyncio.run(main())
