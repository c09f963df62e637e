"""Baselines for the control-plane bench: SGLang-style ZMQ frames, and bare gRPC echoes.

* ZMQ: SGLang 0.5.23's positional frames (wire inventory 1.2 registration, 1.5 Mooncake
  TransferInfo, 1.6 status) over PUSH/PULL, parsed by one listener thread the way
  SGLang's bootstrap thread does, and answered on a cached PUSH per endpoint.
* echo: a gRPC aio server that answers each message with the same bytes, no parsing: a
  unary method (the floor under Register) and a bidirectional stream (the floor under
  a session's submit and status).

Each server runs in its own process (``python -m bench._control_baselines zmq|echo``) and
prints its port on stdout.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio
import numpy as np
import zmq
import zmq.asyncio

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


def zmq_server() -> int:
    """The ZMQ prefill: one PULL listener thread parsing positional frames, statuses on cached PUSHes."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"port": port}), flush=True)
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


Loop = Callable[[], Awaitable[None]]
"""One request: send it, wait for its answer."""


class ZmqPeer:
    """One decode peer of the ZMQ baseline: registers, then sends a request and waits for its status."""

    def __init__(self, ctx: zmq.asyncio.Context, prefill: str, index: int) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(prefill)
        self.session = f"127.0.0.1:{self.port}"
        self.room = index * 10_000_000

    async def setup(self) -> None:
        """Register (a one-way PUSH, as SGLang does)."""
        await self.push.send_multipart(registration_frames(
            self.session, "127.0.0.1", self.port, [4096 * i for i in range(4)], PAGE_SIZE * 1152))

    async def request(self) -> None:
        """One request: TransferInfo frames out, the room's status frames back."""
        self.room += 1
        await self.push.send_multipart(transfer_frames(self.room, "127.0.0.1", self.port, self.session, PAGES))
        while True:
            frames = await self.pull.recv_multipart()
            if int(frames[0]) == self.room:
                assert int(frames[1]) == 4
                return

    def pipelined(self) -> PipelinedZmqPeer:
        """This peer with one reader for its statuses, so several requests can be in flight."""
        return PipelinedZmqPeer(self)

    def close(self) -> None:
        """Close both sockets."""
        self.push.close(0)
        self.pull.close(0)


class PipelinedZmqPeer:
    """A ``ZmqPeer`` whose statuses one reader task hands to each waiting request by room."""

    def __init__(self, peer: ZmqPeer) -> None:
        self.peer = peer
        self._waiting: dict[int, asyncio.Future[int]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.peer.pull.recv_multipart()
            waiter = self._waiting.pop(int(frames[0]), None)
            if waiter is not None:
                waiter.set_result(int(frames[1]))

    async def request(self, room: int) -> None:
        """Send ``room``'s TransferInfo frames and wait for its status."""
        waiter = self._waiting[room] = asyncio.get_running_loop().create_future()
        await self.peer.push.send_multipart(transfer_frames(room, "127.0.0.1", self.peer.port, self.peer.session,
                                                            PAGES))
        assert await waiter == 4

    async def close(self) -> None:
        """Stop the reader (the sockets stay the peer's)."""
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass


# -- bare gRPC echo -------------------------------------------------------------------


def _same(data: bytes) -> bytes:
    return data


async def _echo_serve() -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    async def stream(context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        while True:
            message = await context.read()
            if not isinstance(message, bytes):
                return
            await context.write(message)

    async def stream_handler(_: object, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        await stream(context)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=_same, response_serializer=_same),
        "Stream": grpc.stream_stream_rpc_method_handler(stream_handler, request_deserializer=_same,
                                                        response_serializer=_same),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


async def unary_echo_latencies(target: str, payload: bytes, n: int) -> list[float]:
    """Seconds per bare unary round trip of ``payload`` (reused channel, as HandshakeClient does)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/bench.Echo/Unary", request_serializer=_same, response_deserializer=_same)
        await call(payload)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call(payload, timeout=10)
            out.append(time.perf_counter() - t0)
        return out


class EchoPeer:
    """One bidirectional echo stream: each request is one message out and the same one back."""

    def __init__(self, target: str, payload: bytes) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.payload = payload
        self.call: grpc.aio.StreamStreamCall[bytes, bytes] | None = None

    async def setup(self) -> None:
        """Open the stream (and warm it up)."""
        make = self.channel.stream_stream("/bench.Echo/Stream", request_serializer=_same,
                                          response_deserializer=_same)
        self.call = make()
        await self.request()

    async def request(self) -> None:
        """One message out, one back."""
        assert self.call is not None
        await self.call.write(self.payload)
        await self.call.read()

    async def close(self) -> None:
        """End the stream and the channel."""
        if self.call is not None:
            await self.call.done_writing()
        await self.channel.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["zmq"]:
        sys.exit(zmq_server())
    if sys.argv[1:] == ["echo"]:
        asyncio.run(_echo_serve())
        sys.exit(0)
    sys.exit("usage: python -m bench._control_baselines zmq|echo")
