"""Control-plane benchmark: Register latency against a bare unary echo, and submit+status
throughput of the session stream against SGLang-style ZMQ frames and a bare stream echo.

Every system runs its prefill side in a subprocess on loopback and its decode peers in
this process (asyncio), one request in flight per peer: send one request's destination
(room, pages, prefix), then receive its terminal status. The requests are dummies (no
KV bytes move), so only the control plane is measured.

* pdproto: ``pdproto serve``; each peer registers, then submits on its session (the gRPC
  ``Session`` RPC) and waits for the room's terminal status (``AsyncHandshakeClient`` defaults).
* ZMQ: SGLang 0.5.23's positional frames over PUSH/PULL (``bench/_control_baselines.py``).
* echo: a gRPC stream that sends each message straight back: what gRPC itself costs.

The three run in turn at each concurrency, three times, so a shared machine's noise hits
them alike; each ratio is taken within one repetition. Then the session and ZMQ
again with several requests in flight per peer (``DEPTH``, as a scheduler step submits
them), the ZMQ peer with one reader handing each status to its request. CPU per request
is each process's user+system time over the measured window divided by the requests it
completed: the server from ``/proc/<pid>/stat``, the clients (this process) from
``getrusage``.

Register: 300 calls, each a new peer (deregistered after), against unary echoes of the same
request bytes. Their registrations cycle through four DCP ranks; ``negotiate() in process`` is
the negotiation's share of a Register. Each call includes the prefill fetching the decode's
arena (the local backend's handover).

Run: ``python -m bench bench_control`` (about two minutes on two cores).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import zmq
import zmq.asyncio

from pdproto.client import AsyncHandshakeClient
from pdproto.negotiation.registration import DecodeLayout, Region, kv_entries, make_registration
from pdproto.negotiation.topology import negotiate
from pdproto.transfer import create_executor
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, registration_pb2, transfer_pb2

from ._control_baselines import PAGE_SIZE, PAGES, EchoPeer, ZmqPeer, unary_echo_latencies

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32)
REPETITIONS = 3
SECONDS = float(os.environ.get("BENCH_CONTROL_SECONDS", "3"))
REGISTER_CALLS = 300
DEEP_PEERS, DEPTH = 8, 8
"""The pipelined cell: peers, and requests each keeps in flight (a scheduler step's worth)."""


def _registration(executor_endpoint: registration_pb2.LocalEndpoint, index: int) -> registration_pb2.KvRegistration:
    # Four entries at made-up offsets of the arena: dummy requests never write to them.
    layout = DecodeLayout(page_size=PAGE_SIZE, kv=kv_entries(4, 1152, layer_ids=False), kv_cache_dtype="bfloat16",
                          attention_kind=common_pb2.ATTENTION_KIND_MLA, dcp_size=4, dcp_rank=index % 4,
                          model_id="synthetic", notify_host="127.0.0.1", notify_port=20000 + index)
    regions = [Region(4096 * i, 1 << 20, common_pb2.MEMORY_KIND_DRAM) for i in range(4)]
    return make_registration(layout, executor_endpoint, regions)


class Peer(Protocol):
    """One decode peer of any system: set up, then one request at a time."""

    async def setup(self) -> None: ...
    async def request(self) -> None: ...


class PdprotoPeer:
    """A decode rank with its own arena (a shared one would make the peers one identity)."""

    def __init__(self, target: str, index: int) -> None:
        self.executor = create_executor("local", arena_bytes=4 << 20)
        self.executor.allocate(1 << 20)
        endpoint = self.executor.endpoint()
        assert isinstance(endpoint, registration_pb2.LocalEndpoint)
        self.registration = _registration(endpoint, index)
        self.client = AsyncHandshakeClient(target, timeout=10)
        self.peer_id = ""
        self.room = index * 10_000_000

    async def setup(self) -> None:
        """Register, and open the session with a first request."""
        self.peer_id = (await self.client.register(self.registration)).peer_id
        await self.request()

    async def request(self) -> None:
        """Submit one dummy request on the session and wait for its terminal status."""
        self.room += 1
        await self.request_room(self.room)

    async def request_room(self, room: int) -> None:
        """``request`` for a given room (several may be in flight)."""
        await self.client.submit_transfer(self.peer_id, transfer_pb2.TransferInfo(
            room=room, dst_kv_pages=PAGES, decode_prefix_len=0, is_dummy=True))
        done = await self.client.wait_for(self.peer_id, [room])
        assert done[room].state == common_pb2.TRANSFER_STATE_SUCCESS, done[room]

    async def close(self) -> None:
        """Deregister and release everything."""
        if self.peer_id:
            await self.client.deregister(self.peer_id)
        await self.client.close()
        self.executor.close()


@dataclass(frozen=True)
class Sample:
    """One measured window."""

    rate: float
    """Requests per second."""
    server_us: float
    """Server CPU microseconds per request."""
    client_us: float
    """Client (this process) CPU microseconds per request."""


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(peers: Sequence[Peer], server_pid: int) -> Sample:
    """Run every peer's request loop for SECONDS; requests/s and CPU per request of both sides."""
    return await _measure([p.request for p in peers], server_pid)


async def measure_deep(requests: Sequence[Callable[[int], Awaitable[None]]], server_pid: int) -> Sample:
    """``measure`` with DEPTH request loops per peer, each on rooms of its own."""
    def looping(request: Callable[[int], Awaitable[None]], rooms: Iterator[int]) -> Callable[[], Awaitable[None]]:
        return lambda: request(next(rooms))

    loops = [looping(request, itertools.count(500_000_000 + (i * DEPTH + j) * 1_000_000))
             for i, request in enumerate(requests) for j in range(DEPTH)]
    return await _measure(loops, server_pid)


async def _measure(loops: Sequence[Callable[[], Awaitable[None]]], server_pid: int) -> Sample:
    stop = False
    counts = [0] * len(loops)

    async def loop(i: int, request: Callable[[], Awaitable[None]]) -> None:
        while not stop:
            await request()
            counts[i] += 1

    s0, c0, t0 = _proc_cpu(server_pid), _self_cpu(), time.monotonic()
    tasks = [asyncio.create_task(loop(i, r)) for i, r in enumerate(loops)]
    await asyncio.sleep(SECONDS)
    stop = True
    await asyncio.gather(*tasks)
    t1, s1, c1 = time.monotonic(), _proc_cpu(server_pid), _self_cpu()
    n = max(sum(counts), 1)
    return Sample(n / (t1 - t0), (s1 - s0) / n * 1e6, (c1 - c0) / n * 1e6)


@contextmanager
def _process(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int]]]:
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield proc, json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


async def _run_pdproto(target: str, n: int, pid: int, *, deep: bool = False) -> Sample:
    peers = [PdprotoPeer(target, 1000 + i) for i in range(n)]
    try:
        await asyncio.gather(*(p.setup() for p in peers))
        return await (measure_deep([p.request_room for p in peers], pid) if deep else measure(peers, pid))
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def _run_zmq(port: int, n: int, pid: int, *, deep: bool = False) -> Sample:
    ctx = zmq.asyncio.Context()
    peers = [ZmqPeer(ctx, f"tcp://127.0.0.1:{port}", i) for i in range(n)]
    try:
        for p in peers:
            await p.setup()
        await asyncio.gather(*(p.request() for p in peers))
        if not deep:
            return await measure(peers, pid)
        piped = [p.pipelined() for p in peers]
        try:
            return await measure_deep([p.request for p in piped], pid)
        finally:
            await asyncio.gather(*(p.close() for p in piped))
    finally:
        for p in peers:
            p.close()
        ctx.term()


async def _run_echo(target: str, n: int, pid: int, payload: bytes) -> Sample:
    peers = [EchoPeer(target, payload) for _ in range(n)]
    try:
        await asyncio.gather(*(p.setup() for p in peers))
        return await measure(peers, pid)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def register_latencies(target: str, echo: str) -> tuple[list[float], list[float], list[float]]:
    """Register round trips, the same with building each registration, and bare unary echoes of the same
    request bytes, in alternating blocks.

    The round trip starts from a built registration, as the echo starts from built bytes;
    building one (``make_registration``) is the decode's own preparation and is shown apart.
    """
    executor = create_executor("local", arena_bytes=8 << 20)
    executor.allocate(4 << 20)
    endpoint = executor.endpoint()
    assert isinstance(endpoint, registration_pb2.LocalEndpoint)
    payload = hs.RegisterRequest(registration=_registration(endpoint, 0)).SerializeToString()
    ours: list[float] = []
    built: list[float] = []
    bare: list[float] = []
    try:
        async with AsyncHandshakeClient(target) as client:
            await client.get_server_info()  # a decode reads its prefill's topology first
            for block in range(6):
                for i in range(REGISTER_CALLS // 6):
                    t0 = time.perf_counter()
                    registration = _registration(endpoint, block * 1000 + i)
                    t1 = time.perf_counter()
                    pid = (await client.register(registration)).peer_id
                    t2 = time.perf_counter()
                    ours.append(t2 - t1)
                    built.append(t2 - t0)
                    await client.deregister(pid)
                bare += await unary_echo_latencies(echo, payload, REGISTER_CALLS // 6)
    finally:
        executor.close()
    return ours, built, bare


def negotiation_latency(n: int = 3000) -> list[float]:
    """Seconds per pure ``negotiate()`` call (DCP 4 decode against the synthetic prefill)."""
    from pdproto_demo.synthetic import SyntheticSpec, server_info

    info = server_info(SyntheticSpec(page_size=PAGE_SIZE))
    ex = create_executor("local", arena_bytes=1 << 20)
    try:
        reg = _registration(ex.endpoint(), 1)  # type: ignore[arg-type]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            negotiate(info, reg)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        ex.close()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


Runner = Callable[[int], Awaitable[Sample]]


async def run_all() -> tuple[tuple[list[float], list[float], list[float]], dict[str, dict[int, list[Sample]]],
                             dict[str, list[Sample]]]:
    """Start the three servers, then measure Register and every system at every concurrency."""
    serve = ["-m", "pdproto_server.cli", "serve", "--listen", "127.0.0.1:0", "--layers", "4", "--row-bytes", "1152",
             "--pages", "64", "--page-size", str(PAGE_SIZE), "--prompt-tokens", "64", "--chunk-tokens", "64",
             "--max-inflight", "64"]
    payload = transfer_pb2.TransferInfo(room=10_000_001, dst_kv_pages=PAGES, decode_prefix_len=0,
                                        is_dummy=True).SerializeToString()
    with _process(*serve) as (pd, pd_port), _process("-m", "bench._control_baselines", "zmq") as (zq, zq_port), \
            _process("-m", "bench._control_baselines", "echo") as (ec, ec_port):
        target, echo = f"127.0.0.1:{pd_port['port']}", f"127.0.0.1:{ec_port['port']}"
        register = await register_latencies(target, echo)
        runners: dict[str, Runner] = {
            "pdproto": lambda n: _run_pdproto(target, n, pd.pid),
            "zmq": lambda n: _run_zmq(zq_port["port"], n, zq.pid),
            "echo": lambda n: _run_echo(echo, n, ec.pid, payload),
        }
        samples: dict[str, dict[int, list[Sample]]] = {name: {p: [] for p in CONCURRENCY} for name in runners}
        for peers in CONCURRENCY:
            for _ in range(REPETITIONS):
                for name, run in runners.items():
                    samples[name][peers].append(await run(peers))
        deep: dict[str, list[Sample]] = {"pdproto": [], "zmq": []}
        for _ in range(REPETITIONS):
            deep["pdproto"].append(await _run_pdproto(target, DEEP_PEERS, pd.pid, deep=True))
            deep["zmq"].append(await _run_zmq(zq_port["port"], DEEP_PEERS, zq.pid, deep=True))
        stop = zmq.Context.instance().socket(zmq.PUSH)
        stop.connect(f"tcp://127.0.0.1:{zq_port['port']}")
        stop.send_multipart([b"STOP"])
        stop.close(linger=1000)
        return register, samples, deep


def _med(samples: list[Sample], key: str) -> float:
    return statistics.median(getattr(s, key) for s in samples)


def main() -> int:
    """Run every measurement and print the tables; returns 0."""
    pure = negotiation_latency()
    (ours, built, bare), samples, deep = asyncio.run(run_all())
    reg, echo = _pct(ours, 50), _pct(bare, 50)
    print("negotiation latency")
    print(f"  negotiate() in process        p50 {_pct(pure, 50) * 1e6:8.1f} us   p99 {_pct(pure, 99) * 1e6:8.1f} us")
    print(f"  Register RPC round trip       p50 {reg * 1e3:8.3f} ms   p99 {_pct(ours, 99) * 1e3:8.3f} ms")
    print(f"  bare unary echo, same bytes   p50 {echo * 1e3:8.3f} ms   p99 {_pct(bare, 99) * 1e3:8.3f} ms")
    print(f"  Register / bare echo (p50)    {reg / echo:6.2f}x   (target <= 1.5; SGLang: one-way PUSH, no answer)")
    block = REGISTER_CALLS // 6
    blocks = sorted(_pct(ours[i:i + block], 50) / _pct(bare[i:i + block], 50) for i in range(0, len(ours), block))
    print(f"  per block of {block} (each against the echoes right after it): min / median / max "
          f"{blocks[0]:.2f} / {statistics.median(blocks):.2f} / {blocks[-1]:.2f}x")
    print(f"  the same, building each registration first   p50 {_pct(built, 50) * 1e3:8.3f} ms   "
          f"{_pct(built, 50) / echo:6.2f}x")
    print(f"\ncontrol-plane throughput (submit + terminal status, dummy requests; {REPETITIONS} x {SECONDS:g} s per "
          "cell, systems interleaved)")
    print("  session: the default client, on the gRPC Session RPC")
    print(f"  {'peers':>5}  {'session req/s':>13}  {'ZMQ req/s':>9}  {'session/ZMQ min/med/max':>23}  "
          f"{'echo/ZMQ med':>12}")
    for p in CONCURRENCY:
        pd, zq = samples["pdproto"][p], samples["zmq"][p]
        ratios = sorted(a.rate / b.rate for a, b in zip(pd, zq, strict=True))
        spread = f"{ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f}"
        echo_ratio = statistics.median(a.rate / b.rate for a, b in zip(samples["echo"][p], zq, strict=True))
        print(f"  {p:>5}  {_med(pd, 'rate'):>13.0f}  {_med(zq, 'rate'):>9.0f}  {spread:>23}  {echo_ratio:>12.2f}")
    print("  (target: median session/ZMQ >= 1.0 at 8 and 32 peers; loopback, client and server share the cores)")
    print("\nCPU per request, microseconds (median over repetitions; server process / client process)")
    print(f"  {'peers':>5}  {'session srv/cli':>15}  {'ZMQ srv/cli':>11}  {'echo srv/cli':>12}")
    for p in CONCURRENCY:
        cells = [f"{_med(samples[n][p], 'server_us'):.0f} / {_med(samples[n][p], 'client_us'):.0f}"
                 for n in ("pdproto", "zmq", "echo")]
        print(f"  {p:>5}  {cells[0]:>15}  {cells[1]:>11}  {cells[2]:>12}")
    pd, zq = deep["pdproto"], deep["zmq"]
    ratios = sorted(a.rate / b.rate for a, b in zip(pd, zq, strict=True))
    print(f"\nseveral requests in flight: {DEEP_PEERS} peers x {DEPTH} each, session against ZMQ with one "
          f"status reader per peer; {REPETITIONS} x {SECONDS:g} s")
    print(f"  session {_med(pd, 'rate'):.0f} req/s, ZMQ {_med(zq, 'rate'):.0f} req/s; session/ZMQ min/med/max "
          f"{ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f}; CPU us srv/cli: session "
          f"{_med(pd, 'server_us'):.0f} / {_med(pd, 'client_us'):.0f}, ZMQ "
          f"{_med(zq, 'server_us'):.0f} / {_med(zq, 'client_us'):.0f}  (no target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
