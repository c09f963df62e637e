"""The in-process engine API: a real server in this process, chunks reported from another thread."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from prometheus_client import generate_latest

from pdproto import errors as E
from pdproto.client import AsyncHandshakeClient
from pdproto.dcp import DcpLayout, RelayoutPlan
from pdproto.errors import Reason
from pdproto.transfer import create_executor
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import build_source, room_pages
from pdproto_server.app import RunningServer, ServerConfig, start_server
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import Chunk, PrefillEngine
from pdproto_server.registry import Limits
from pdproto_server.runner import COALESCE
from pdproto_server.transfers import chunk_plans

from ._server_harness import REPO, SPEC, metric_samples

pytestmark = pytest.mark.process

Scenario = Callable[[PrefillEngine, AsyncHandshakeClient, DecodeRank], Awaitable[None]]


def _run(scenario: Scenario, limits: Limits | None = None,
         cores: list[HandshakeCore] | None = None) -> None:
    """Run ``scenario`` against an in-process server; its core is appended to ``cores`` when given."""
    executor = create_executor("local", arena_bytes=1 << 20)
    peer = DecodeRank.for_spec(SPEC, dcp_size=2, dcp_rank=0, pages=32)

    async def main() -> None:
        engine = PrefillEngine(build_source(SPEC, executor), executor)
        core = HandshakeCore(engine, limits=limits)
        if cores is not None:
            cores.append(core)
        running: RunningServer = await start_server(core, ServerConfig())
        try:
            async with AsyncHandshakeClient(f"127.0.0.1:{running.port}", timeout=10) as client:
                await scenario(engine, client, peer)
        finally:
            await running.shutdown()

    try:
        asyncio.run(asyncio.wait_for(main(), 40))
    finally:
        peer.close()
        executor.close()


def test_an_embedder_cannot_give_the_operator_the_decodes_token() -> None:
    """start_server refuses operator_token == token, as ``pdproto serve`` and the SGLang settings do."""
    executor = create_executor("local", arena_bytes=1 << 20)

    async def main() -> None:
        core = HandshakeCore(PrefillEngine(build_source(SPEC, executor), executor))
        try:
            with pytest.raises(E.ConfigError) as refused:
                await start_server(core, ServerConfig(token="shared", operator_token="shared"))
            assert refused.value.metadata["setting"] == "operator_token"
            running = await start_server(core, ServerConfig(token="shared", operator_token="other"))
            await running.shutdown()
        finally:
            await core.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 40))
    finally:
        executor.close()


def _engine_thread(engine: PrefillEngine, room: int, chunk_tokens: int = 32) -> threading.Thread:
    """The prefill scheduler: reports a room's chunks from its own thread."""

    def produce() -> None:
        pages = room_pages(room, SPEC)
        done = 0
        while done < SPEC.prompt_tokens:
            n = min(chunk_tokens, SPEC.prompt_tokens - done)
            first = done // SPEC.page_size
            engine.submit_chunk(room, pages[first:first + -(-n // SPEC.page_size)], n,
                                last_chunk=done + n >= SPEC.prompt_tokens)
            done += n

    return threading.Thread(target=produce)


async def _final(client: AsyncHandshakeClient, peer_id: str, room: int) -> transfer_pb2.TransferStatus:
    async for status in client.watch_status(peer_id, [room], timeout=20):
        if status.state in (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED):
            return status
    raise AssertionError("stream ended without a terminal status")


def test_decode_first_then_engine_chunks_from_a_thread() -> None:
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        await client.submit_transfer(peer_id, peer.transfer_info(11, pages))
        producer = _engine_thread(engine, 11)
        producer.start()
        status = await _final(client, peer_id, 11)
        producer.join(10)
        assert status.state == common_pb2.TRANSFER_STATE_SUCCESS, status
        assert status.chunks_done == -(-SPEC.prompt_tokens // 32)
        peer.verify({11: pages}, SPEC.prompt_tokens)

    _run(scenario)


def test_engine_first_then_decode() -> None:
    """Chunks that arrived before the request move together: at most COALESCE per engine call."""
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        producer = _engine_thread(engine, 12, chunk_tokens=48)
        producer.start()
        producer.join(10)
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        jobs = engine.executor.stats.jobs
        await client.submit_transfer(peer_id, peer.transfer_info(12, pages))
        status = await _final(client, peer_id, 12)
        assert status.state == common_pb2.TRANSFER_STATE_SUCCESS
        chunks = -(-SPEC.prompt_tokens // 48)
        assert status.chunks_done == chunks == COALESCE + 1
        assert engine.executor.stats.jobs - jobs == 2  # four chunks in one call, then the last
        peer.verify({12: pages}, SPEC.prompt_tokens)

    _run(scenario)


def test_chunks_at_explicit_page_positions_land_at_those_decode_pages() -> None:
    """A CP rank's share (SGLang ``filter_kv_indices_for_cp_rank``): chunks name their page position,
    out of order and empty ones included; the accumulated count would put the first at page 0."""
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        await client.submit_transfer(peer_id, peer.transfer_info(13, pages))
        src, ps = room_pages(13, SPEC), SPEC.page_size
        n = -(-SPEC.prompt_tokens // ps)
        with pytest.raises(E.InvalidFieldError):
            engine.submit_chunk(13, src[4:8], 4 * ps, last_chunk=False, page_offset=-1)
        with pytest.raises(E.InvalidFieldError):  # positions must increase, one per page
            engine.submit_chunk(13, [src[6], src[4]], 2 * ps, last_chunk=False, page_offset=[6, 4])
        # A KV-shard rank's every other page, each at its own position (pages 4, 6, then 5, 7).
        for positions in ([4, 6], [5, 7]):
            engine.submit_chunk(13, [src[p] for p in positions], 2 * ps, last_chunk=False, page_offset=positions)
        for first, stop in ((0, 4), (8, 8)):
            engine.submit_chunk(13, src[first:stop], (stop - first) * ps, last_chunk=False, page_offset=first)
        engine.submit_chunk(13, src[8:n], SPEC.prompt_tokens - 8 * ps, last_chunk=True, page_offset=8)
        assert (await _final(client, peer_id, 13)).state == common_pb2.TRANSFER_STATE_SUCCESS
        peer.verify({13: pages}, SPEC.prompt_tokens)

    _run(scenario)


def test_unmatched_request_fails_with_match_timeout_and_bad_chunks_are_refused() -> None:
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        peer_id = (await client.register(peer.registration())).peer_id
        await client.submit_transfer(peer_id, peer.transfer_info(13, peer.pages_for(SPEC.prompt_tokens)))
        status = await _final(client, peer_id, 13)
        assert (status.state, status.failure_code) == (common_pb2.TRANSFER_STATE_FAILED, "MATCH_TIMEOUT")
        # The engine reads the same reason for the room, from its own thread.
        room = await asyncio.to_thread(engine.status, 13)
        assert (room.state, room.failure_code, room.failure_reason) == (
            common_pb2.TRANSFER_STATE_FAILED, "MATCH_TIMEOUT", status.failure_reason)
        with pytest.raises(E.PlanError) as info:
            engine.submit_chunk(14, [SPEC.pages + 5], 16, last_chunk=True)
        assert info.value.reason is Reason.PLAN_BAD_OFFSET
        with pytest.raises(E.PlanError):
            engine.submit_chunk(14, [0, 1], 20, last_chunk=False)  # a non-last chunk must fill its pages

    _run(scenario, Limits(match_timeout=0.5))


def test_the_engine_polls_a_room_through_its_life_cycle_and_reads_the_decode_prefix() -> None:
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        room = 15
        assert engine.poll(room) == common_pb2.TRANSFER_STATE_BOOTSTRAPPING
        assert engine.decode_prefix_len(room) is None  # allocate nothing until a decode says
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        await client.submit_transfer(peer_id, peer.transfer_info(room, pages))
        for _ in range(100):
            if engine.poll(room) != common_pb2.TRANSFER_STATE_BOOTSTRAPPING:
                break
            await asyncio.sleep(0.01)
        assert engine.poll(room) == common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT
        assert engine.decode_prefix_len(room) == 0
        producer = _engine_thread(engine, room)
        producer.start()
        final = await _final(client, peer_id, room)
        assert final.state == common_pb2.TRANSFER_STATE_SUCCESS
        producer.join(10)
        assert engine.poll(room) == common_pb2.TRANSFER_STATE_SUCCESS
        status = engine.status(room)
        assert (status.requests, status.failure_code, status.failure_reason) == (1, "", "")
        assert status.kv_bytes == final.bytes_transferred > 0  # what the decode was told moved

    _run(scenario)


def test_the_engine_aborts_a_room_and_the_decode_sees_its_reason() -> None:
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        await client.submit_transfer(peer_id, peer.transfer_info(16, pages))
        await asyncio.to_thread(engine.abort, 16, "out of KV pages")
        assert engine.poll(16) == common_pb2.TRANSFER_STATE_FAILED  # at once, from the engine's thread
        aborted = engine.status(16)
        assert aborted.failure_code == "ABORTED" and "out of KV pages" in aborted.failure_reason
        status = await _final(client, peer_id, 16)
        assert (status.state, status.failure_code) == (common_pb2.TRANSFER_STATE_FAILED, "ABORTED")
        assert "out of KV pages" in status.failure_reason
        # A decode that submits after the abort fails at once, with the same reason.
        await client.submit_transfer(peer_id, peer.transfer_info(16, pages, generation=1))
        late = await _final(client, peer_id, 16)
        assert late.failure_code == "ABORTED" and "out of KV pages" in late.failure_reason

    _run(scenario)


def test_aux_and_state_slots_travel_with_the_last_chunk_only() -> None:
    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        with pytest.raises(E.InvalidFieldError) as info:
            engine.submit_chunk(17, [0, 1], 2 * SPEC.page_size, last_chunk=False, aux_slot=1)
        assert info.value.field == "aux_slot"
        with pytest.raises(E.InvalidFieldError):  # this source has no state entries
            engine.submit_chunk(17, [0], 8, last_chunk=True, state_slots=[[1]])

    _run(scenario)


def test_a_chunk_reported_as_the_peers_mover_winds_down_is_still_moved() -> None:
    """The next chunk arrives on the loop after the peer's move task took its last step and before
    that task was marked done: it must start a new mover. It used to be queued behind the finished
    task and never moved, so the request hung in TRANSFERRING (one lost request in a few hundred
    in ``make reliability``'s load row and in the demo)."""
    cores: list[HandshakeCore] = []
    room, step = 16, 32
    bounds = [(a, min(a + step, SPEC.prompt_tokens)) for a in range(0, SPEC.prompt_tokens, step)]

    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        loop = asyncio.get_running_loop()
        src = room_pages(room, SPEC)
        reported: set[int] = set()

        def report(k: int) -> None:
            if k in reported or k >= len(bounds):
                return
            reported.add(k)
            a, b = bounds[k]
            engine.submit_chunk(room, src[a // SPEC.page_size: -(-b // SPEC.page_size)], b - a,
                                last_chunk=k == len(bounds) - 1)

        class NextChunkWhenOneMoved:
            """A status subscriber that plays the prefill: chunk k+1 is computed as chunk k lands."""

            def push(self, status: transfer_pb2.TransferStatus) -> None:
                if status.room == room and status.state == common_pb2.TRANSFER_STATE_TRANSFERRING:
                    loop.call_soon(report, status.chunks_done)  # runs after the mover's current step

            def close(self) -> None:
                """Nothing to end."""

        peer_id = (await client.register(peer.registration())).peer_id
        cores[0].subscribe(cores[0].peer(peer_id, client.credential(peer_id)), NextChunkWhenOneMoved())
        pages = peer.pages_for(SPEC.prompt_tokens)
        await client.submit_transfer(peer_id, peer.transfer_info(room, pages))
        report(0)
        final = await _final(client, peer_id, room)
        assert (final.state, final.chunks_done) == (common_pb2.TRANSFER_STATE_SUCCESS, len(bounds)), final
        peer.verify({room: pages}, SPEC.prompt_tokens)

    _run(scenario, cores=cores)


def test_requests_and_inflight_metrics_follow_the_requests() -> None:
    """``pdproto_requests_inflight`` counts an open request, then none; ``pdproto_requests`` its outcome."""
    cores: list[HandshakeCore] = []

    def scrape() -> dict[str, float]:
        return metric_samples(generate_latest(cores[0].metrics.registry).decode())

    async def scenario(engine: PrefillEngine, client: AsyncHandshakeClient, peer: DecodeRank) -> None:
        peer_id = (await client.register(peer.registration())).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        for room in (21, 22):
            await client.submit_transfer(peer_id, peer.transfer_info(room, pages if room == 21 else pages[:1]))
        assert scrape()["pdproto_requests_inflight"] == 2  # no chunk reported yet: both are open
        await client.abort(peer_id, 22)
        producer = _engine_thread(engine, 21)
        producer.start()
        assert (await _final(client, peer_id, 21)).state == common_pb2.TRANSFER_STATE_SUCCESS
        producer.join(10)
        after = scrape()
        assert after["pdproto_requests_inflight"] == 0
        assert after['pdproto_requests_total{outcome="SUCCESS"}'] == 1
        assert after['pdproto_requests_total{outcome="ABORTED"}'] == 1

    _run(scenario, cores=cores)


_EXITING_HOST = """
import atexit, dataclasses, json, sys
from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError
from pdproto.transfer import create_executor
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import SyntheticProducer, build_source
from pdproto_server.app import ServerConfig, ServiceThread
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import PrefillEngine
from tests._server_harness import SPEC

backend = sys.argv[1]
spec = dataclasses.replace(SPEC, backend=backend)
executor = create_executor(backend, arena_bytes=1 << 20)
engine = PrefillEngine(build_source(spec, executor), executor)
SyntheticProducer(engine, spec)
service = ServiceThread(HandshakeCore(engine), ServerConfig(listen="127.0.0.1:0"))
decode = DecodeRank.for_spec(spec, pages=32, backend=backend)
client = HandshakeClient(f"127.0.0.1:{service.start()}", timeout=10)
pid = client.register(decode.registration()).peer_id
client.submit_transfer(pid, decode.transfer_info(1, decode.pages_for(spec.prompt_tokens)))
print(json.dumps({"done": client.wait_for(pid, [1])[1].state}), flush=True)


def abort_while_exiting():
    try:
        client.abort(pid, 1)
        print(json.dumps({"abort": "ACKNOWLEDGED"}), flush=True)
    except PdprotoError as exc:
        print(json.dumps({"abort": exc.reason.name, "message": exc.message}), flush=True)


atexit.register(abort_while_exiting)  # runs once concurrent.futures takes no more work
sys.exit(0)
"""


@pytest.mark.parametrize("backend,answer", [("local", "ACKNOWLEDGED"), ("mooncake", "SHUTTING_DOWN")])
def test_an_abort_reaching_a_host_that_exits_is_answered_typed(backend: str, answer: str) -> None:
    """A scheduler's ``SystemExit`` with the service on its daemon thread, then an abort: no thread is
    needed to wait for the engine, so the local backend (whose copies end with their call) acknowledges
    it; an engine's peer worker takes no marker once the interpreter exits, so Mooncake answers SHUTTING_DOWN,
    typed and never acknowledged. Before, both were INTERNAL and a traceback in the log."""
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine not installed")
    run = subprocess.run([sys.executable, "-c", _EXITING_HOST, backend], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"done": common_pb2.TRANSFER_STATE_SUCCESS}, (run.stdout, run.stderr[-3000:])
    assert lines[1]["abort"] == answer, (lines, run.stderr[-3000:])
    if answer == "SHUTTING_DOWN":
        assert "exiting" in lines[1]["message"]
    assert "abort failed unexpectedly" not in run.stderr, run.stderr[-3000:]


def test_a_kv_shard_ranks_scattered_pages_plan_row_for_row_as_their_runs() -> None:
    """Pages at positions 1, 3, 4 (the last holding 5 tokens): one plan into the destination pages at those
    positions on one dense layout, a plan per run of consecutive positions otherwise; the same rows."""
    chunk = Chunk(0, np.array([7, 2, 9]), 2 * 16 + 5, 1, True, positions=np.array([1, 3, 4]))
    dst_pages = [10, 11, 12, 13, 14]

    def rows(plans: list[RelayoutPlan]) -> list[tuple[int, int]]:
        return sorted((int(s), int(d)) for p in plans for s, d in zip(*p.expand(), strict=True))

    def expected(dst_page: int, pages: list[int]) -> list[tuple[int, int]]:
        tokens = ((src, 16 * at + t) for src, at, n in ((7, 1, 16), (2, 3, 16), (9, 4, 5)) for t in range(n))
        return sorted((src * 16 + g % 16, pages[g // dst_page] * dst_page + g % dst_page) for src, g in tokens)

    dense = chunk_plans(DcpLayout(16), DcpLayout(16), chunk, dst_pages, prefix_len=0, include_draft=False)
    assert len(dense) == 1 and rows(dense) == expected(16, dst_pages)
    # Destination pages of 8 tokens: each run planned at its position, the same tokens.
    small = list(range(20, 30))
    split = chunk_plans(DcpLayout(16), DcpLayout(8), chunk, small, prefix_len=0, include_draft=False)
    assert len(split) == 2 and rows(split) == expected(8, small)
