"""Housekeeping costs what expires, not what is kept: counted work, no clocks.

A tick used to walk every retained room and request (about 200 ms of the event loop at
180,000 retained requests). Now each thing is looked at when it falls due (``Deadlines``
in ``pdproto_server/engine.py``); the tests keep 100,000 finished requests and rooms, let a
handful expire, and check how many entries one tick took.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pdproto.transfer import create_executor
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, transfer_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import SyntheticSpec, build_source
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import PrefillEngine
from pdproto_server.engine import Deadlines
from pdproto_server.registry import Limits

SPEC = SyntheticSpec(layers=1, row_bytes=64, pages=64, page_size=16, prompt_tokens=16, chunk_tokens=16)
KEPT = 100_000
OLD = 50


def test_deadlines_take_only_what_is_due() -> None:
    d: Deadlines[str] = Deadlines()
    for i in range(1000):
        d.add(100.0 + i, f"late-{i}")
    d.add(5.0, "early")
    d.add(1.0, "earliest")
    assert d.take_due(10.0) == ["earliest", "early"]
    assert d.work == 2 and len(d) == 1000
    assert d.take_due(10.0) == [] and d.work == 2
    assert d.take_due(101.5) == ["late-0", "late-1"] and d.work == 4


@pytest.mark.process  # an in-process engine (the local executor's shared memory), no subprocess
def test_a_tick_with_100k_kept_requests_takes_only_the_expired() -> None:
    executor = create_executor("local", arena_bytes=1 << 20)
    peer = DecodeRank.for_spec(SPEC, pages=64)
    keep = 60.0

    async def run() -> None:
        engine = PrefillEngine(build_source(SPEC, executor), executor)
        core = HandshakeCore(engine, limits=Limits(keep_finished=keep, match_timeout=keep,
                                                   max_finished_per_peer=2 * KEPT))
        engine.attach(asyncio.get_running_loop())
        reg = await core.register(hs.RegisterRequest(registration=peer.registration()))
        me = core.peer(reg.result.peer_id, reg.peer_credential)

        def finish(room: int) -> None:
            # The prefill computed the room; the decode's dummy request for it ends at once.
            engine.submit_chunk(room, [room % SPEC.pages], SPEC.prompt_tokens, True)

        async def request(room: int) -> None:
            finish(room)
            status = await core.submit_to(me, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))
            assert status.state == common_pb2.TRANSFER_STATE_SUCCESS

        for room in range(OLD):
            await request(room)
        midway = time.monotonic()
        for room in range(OLD, OLD + KEPT):
            await request(room)
        assert len(me.finished) == OLD + KEPT and len(engine.rooms) == OLD + KEPT

        before = (core.deadlines.work, engine.deadlines.work)
        await core.expire(now=midway + keep)  # what the janitor runs once a second
        work = core.deadlines.work - before[0] + engine.deadlines.work - before[1]

        assert len(me.finished) == KEPT and len(engine.rooms) == KEPT, "exactly the old ones expired"
        assert min(me.finished) == OLD and min(engine.rooms) == OLD
        # Each old room is looked at twice (as created, as finished), the peer once: nothing kept is walked.
        assert work <= 2 * OLD + 1, work
        # The next tick finds nothing due: its work is zero, whatever is kept.
        before = (core.deadlines.work, engine.deadlines.work)
        await core.expire(now=midway + keep)
        assert (core.deadlines.work, engine.deadlines.work) == before
        await core.close()

    try:
        asyncio.run(run())
    finally:
        peer.close()
        executor.close()
