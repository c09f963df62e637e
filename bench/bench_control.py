"""Control-plane benchmark: negotiation latency, and submit+status throughput vs an SGLang-style ZMQ baseline.

Both systems run their prefill side in a subprocess on loopback and the decode peers in
this process (asyncio), doing the same work per request: send one request's destination
(room, pages, prefix), then receive its terminal status. The requests are dummies (no
KV bytes move), so only the control plane is measured.

* pdproto: ``pdproto serve`` (gRPC aio; Register negotiates, SubmitTransfer, WatchStatus
  stream per peer; each room is matched with the synthetic engine's chunks).
* baseline: SGLang 0.5.23's positional frames (wire inventory 1.2 registration, 1.5
  Mooncake TransferInfo, 1.6 status) over ZMQ PUSH/PULL, parsed by one listener thread
  the way SGLang's bootstrap thread does, and answered on a cached PUSH per endpoint.

Run: ``python -m bench bench_control`` (about a minute on two cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from pdproto.client import AsyncHandshakeClient
from pdproto.topology import negotiate
from pdproto.registration import DecodeLayout, Region, kv_entries, make_registration
from pdproto.transfer import create_executor
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32)
SECONDS = float(os.environ.get("BENCH_CONTROL_SECONDS", "3"))
PAGE_SIZE = 16
PAGES = [5, 9, 2, 7]  # a 64-token request's destination pages

# -- SGLang-style frames (inventory 1.2, 1.5, 1.6) -----------------------------------------


def _a(v: int) -> bytes:
    return str(v).encode("ascii")


def registration_frames(session: str, host: str, port: int, kv_ptrs: list[int], item_len: int) -> list[bytes]:
    """Mooncake KVArgsRegisterInfo, 20 frames, slot order of inventory 1.2."""
    return [
        b"None", host.encode(), _a(port), session.encode(),           # 0-3
        struct.pack(f"{len(kv_ptrs)}Q", *kv_ptrs), struct.pack("Q", 0), b"",  # 4 kv, 5 aux, 6 state ptrs
        _a(0), _a(1), _a(item_len),                                   # 7 tp rank, 8 attn tp size, 9 item len
        b"", b"", b"", b"",                                           # 10-13 state lens/dims, layer ids
        b"", b"",                                                     # 14-15 staging base/size
        _a(4), _a(port % 4),                                          # 16-17 dcp size/rank
        b"", struct.pack("Q", item_len),                              # 18 slot ids, 19 kv item lens
    ]


def transfer_frames(room: int, host: str, port: int, session: str, pages: list[int]) -> list[bytes]:
    """Mooncake TransferInfo, 10 frames (inventory 1.5)."""
    return [_a(room), host.encode(), _a(port), session.encode(), np.asarray(pages, np.int32).tobytes(),
            _a(0), b"", _a(1), _a(0), b""]


def baseline_server(port_file: str) -> int:
    """The ZMQ prefill: one PULL listener thread parsing positional frames, statuses on cached PUSHes."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    peers: dict[str, dict[str, object]] = {}
    pushes: dict[str, zmq.Socket[bytes]] = {}
    while True:
        msg = pull.recv_multipart()
        if msg[0] == b"STOP":
            break
        if msg[0] == b"None":  # registration: parse the slots SGLang parses
            session = msg[3].decode()
            peers[session] = {
                "endpoint": msg[1].decode(), "port": int(msg[2].decode("ascii")),
                "kv_ptrs": list(struct.unpack(f"{len(msg[4]) // 8}Q", msg[4])),
                "tp_rank": int(msg[7]), "tp_size": int(msg[8]), "item_len": int(msg[9]),
                "dcp_size": int(msg[16]) if len(msg) > 16 and msg[16] else 1,
                "dcp_rank": int(msg[17]) if len(msg) > 17 and msg[17] else 0,
            }
            continue
        room = int(msg[0].decode("ascii"))
        endpoint, dst_port, session = msg[1].decode(), int(msg[2].decode("ascii")), msg[3].decode()
        _pages = np.frombuffer(msg[4], dtype=np.int32)
        _required = int(msg[7].decode("ascii"))
        _prefix = int(msg[8].decode("ascii")) if len(msg) > 8 and msg[8] else None
        ok = session in peers
        key = f"{endpoint}:{dst_port}"
        sock = pushes.get(key)
        if sock is None:
            sock = pushes[key] = ctx.socket(zmq.PUSH)
            sock.connect(f"tcp://{key}")
        sock.send_multipart([_a(room), _a(4 if ok else 0), _a(0)])  # [room, KVPoll, prefill_rank]
    for s in pushes.values():
        s.close(0)
    pull.close(0)
    ctx.term()
    return 0


async def _baseline_peer(ctx: zmq.asyncio.Context, prefill: str, index: int, until: float) -> int:
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(prefill)
    session = f"127.0.0.1:{port}"
    await push.send_multipart(registration_frames(session, "127.0.0.1", port, [4096 * i for i in range(4)],
                                                  PAGE_SIZE * 1152))
    done = 0
    room = index * 10_000_000
    try:
        while time.monotonic() < until:
            room += 1
            await push.send_multipart(transfer_frames(room, "127.0.0.1", port, session, PAGES))
            while True:
                frames = await pull.recv_multipart()
                if int(frames[0]) == room:
                    assert int(frames[1]) == 4
                    break
            done += 1
    finally:
        push.close(0)
        pull.close(0)
    return done


async def baseline_throughput(peers: int) -> float:
    """Requests/s of the ZMQ baseline with ``peers`` concurrent decode peers."""
    port_file = f"/tmp/pdproto-bench-zmq-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_control", "--zmq-server", port_file], cwd=REPO)
    ctx = zmq.asyncio.Context()
    try:
        for _ in range(300):
            if Path(port_file).exists() and Path(port_file).read_text():
                break
            await asyncio.sleep(0.05)
        prefill = f"tcp://127.0.0.1:{Path(port_file).read_text()}"
        start = time.monotonic()
        counts = await asyncio.gather(*(_baseline_peer(ctx, prefill, i, start + SECONDS) for i in range(peers)))
        elapsed = time.monotonic() - start
        stop = ctx.socket(zmq.PUSH)
        stop.connect(prefill)
        await stop.send_multipart([b"STOP"])
        stop.close(linger=1000)
        return sum(counts) / elapsed
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        ctx.term()
        Path(port_file).unlink(missing_ok=True)


# -- pdproto -----------------------------------------------------------------------------


def _registration(executor_endpoint: registration_pb2.LocalEndpoint, index: int) -> registration_pb2.KvRegistration:
    # Four entries at made-up offsets of the arena: dummy requests never write to them.
    layout = DecodeLayout(page_size=PAGE_SIZE, kv=kv_entries(4, 1152, layer_ids=False), kv_cache_dtype="bfloat16",
                          attention_kind=common_pb2.ATTENTION_KIND_MLA, dcp_size=4, dcp_rank=index % 4,
                          model_id="synthetic", notify_host="127.0.0.1", notify_port=20000 + index)
    regions = [Region(4096 * i, 1 << 20, common_pb2.MEMORY_KIND_DRAM) for i in range(4)]
    return make_registration(layout, executor_endpoint, regions)


async def _pdproto_peer(target: str, index: int, until: float) -> int:
    # Each decode rank has its own arena: a shared one would make them one identity (a restart).
    executor = create_executor("local", arena_bytes=4 << 20)
    executor.allocate(1 << 20)
    endpoint = executor.endpoint()
    assert isinstance(endpoint, registration_pb2.LocalEndpoint)
    try:
        return await _pdproto_peer_loop(target, index, until, endpoint)
    finally:
        executor.close()


async def _pdproto_peer_loop(target: str, index: int, until: float,
                             endpoint: registration_pb2.LocalEndpoint) -> int:
    async with AsyncHandshakeClient(target, timeout=10) as client:
        peer_id = (await client.register(_registration(endpoint, index))).peer_id
        waiting: dict[int, asyncio.Future[int]] = {}

        async def reader() -> None:
            async for status in client.watch_status(peer_id, timeout=SECONDS + 30):
                fut = waiting.get(status.room)
                if fut is not None and status.state in (common_pb2.TRANSFER_STATE_SUCCESS,
                                                        common_pb2.TRANSFER_STATE_FAILED) and not fut.done():
                    fut.set_result(status.state)

        task = asyncio.create_task(reader())
        done, room = 0, index * 10_000_000
        try:
            while time.monotonic() < until:
                room += 1
                fut = waiting[room] = asyncio.get_running_loop().create_future()
                await client.submit_transfer(peer_id, transfer_pb2.TransferInfo(
                    room=room, dst_kv_pages=PAGES, decode_prefix_len=0, is_dummy=True))
                assert await asyncio.wait_for(fut, 10) == common_pb2.TRANSFER_STATE_SUCCESS
                del waiting[room]
                done += 1
        finally:
            await client.deregister(peer_id)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the stream ends with the peer
                pass
        return done


async def pdproto_run(peers_list: tuple[int, ...]) -> tuple[dict[int, float], list[float]]:
    """Throughput per concurrency and Register RPC latencies, against one ``pdproto serve``."""
    cmd = [sys.executable, "-m", "pdproto_server.cli", "serve", "--listen", "127.0.0.1:0", "--layers", "4",
           "--row-bytes", "1152", "--pages", "64", "--page-size", str(PAGE_SIZE), "--prompt-tokens", "64",
           "--chunk-tokens", "64", "--max-inflight", "64"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE)
    executor = create_executor("local", arena_bytes=8 << 20)
    executor.allocate(4 << 20)
    endpoint = executor.endpoint()
    assert isinstance(endpoint, registration_pb2.LocalEndpoint)
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        target = f"127.0.0.1:{port}"
        latencies: list[float] = []
        async with AsyncHandshakeClient(target) as client:
            for i in range(300):
                t0 = time.perf_counter()
                pid = (await client.register(_registration(endpoint, i))).peer_id
                latencies.append(time.perf_counter() - t0)
                await client.deregister(pid)
        out: dict[int, float] = {}
        for peers in peers_list:
            start = time.monotonic()
            counts = await asyncio.gather(*(_pdproto_peer(target, 1000 + i, start + SECONDS)
                                            for i in range(peers)))
            out[peers] = sum(counts) / (time.monotonic() - start)
        return out, latencies
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        executor.close()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


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


def main() -> int:
    """Run every measurement and print one table; returns 0."""
    pure = negotiation_latency()
    ours, register_rpc = asyncio.run(pdproto_run(CONCURRENCY))
    base = {p: asyncio.run(baseline_throughput(p)) for p in CONCURRENCY}
    print("negotiation latency")
    print(f"  negotiate() in process      p50 {_pct(pure, 50) * 1e6:8.1f} us   p99 {_pct(pure, 99) * 1e6:8.1f} us")
    print(f"  Register RPC round trip     p50 {_pct(register_rpc, 50) * 1e3:8.3f} ms   "
          f"p99 {_pct(register_rpc, 99) * 1e3:8.3f} ms   (SGLang: one-way PUSH, no answer)")
    print(f"\ncontrol-plane throughput (submit + terminal status, dummy requests, {SECONDS:.0f} s each)")
    print(f"  {'peers':>5}  {'pdproto gRPC req/s':>18}  {'SGLang-style ZMQ req/s':>22}  {'ratio':>6}")
    for p in CONCURRENCY:
        print(f"  {p:>5}  {ours[p]:>18.0f}  {base[p]:>22.0f}  {ours[p] / base[p]:>6.2f}")
    print("  (loopback, client and server share the host's cores; ratio = pdproto / baseline, higher is better)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--zmq-server":
        sys.exit(baseline_server(sys.argv[2]))
    sys.exit(main())
