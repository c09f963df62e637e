"""The legacy listener (``pdproto_server/legacy.py``) on its own: a real service over the synthetic pool on
a Mooncake engine, SGLang 0.5.23 Mooncake frames pushed at its port as SGLang's decode builds them, and
what comes back read from a PULL socket where that decode would read it. SGLang's own decode processes
against it: ``tests/sglang/test_harness.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import pytest
import zmq

from pdproto.client import HandshakeClient
from pdproto.legacy import mooncake, nixl
from pdproto.negotiation.topology import example_registration
from pdproto.transfer import create_executor
from pdproto.v1 import (BACKEND_MOONCAKE, BACKEND_NIXL, MEMORY_KIND_DRAM, AbortNotification, KvRegistration,
                        TransferInfo)
from pdproto_demo.synthetic import SyntheticProducer, build_source, room_pages
from pdproto_server.app import ServerConfig, ServiceThread
from pdproto_server.cmd_status import render
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import PrefillEngine
from pdproto_server.legacy import MAX_FRAME_BYTES, PROTOCOL
from tests._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

FAILED = b"0"  # KVPoll.Failed
MOONCAKE = PROTOCOL.format("mooncake")


@contextlib.contextmanager
def _prefill(serve: bool, backend: str = "mooncake", produce: bool = False) -> Iterator[ServiceThread]:
    """A prefill rank over the synthetic pool; ``produce``: it computes every room a decode asks for."""
    executor = create_executor(backend, arena_bytes=1 << 20, host="127.0.0.1", staging_bytes=0)
    spec = dataclasses.replace(SPEC, backend=backend, chunk_delay=0.0)
    engine = PrefillEngine(build_source(spec, executor), executor)
    service = ServiceThread(HandshakeCore(engine), ServerConfig(listen="127.0.0.1:0", legacy_listen="127.0.0.1:0",
                                                                legacy_serve=serve))
    producer = SyntheticProducer(engine, spec) if produce else None
    service.start()
    try:
        yield service
    finally:
        if producer is not None:
            service.call(producer.close())
        service.stop()
        executor.close()


class _Decode:
    """An SGLang decode rank as the prefill sees it: its engine and pool, its PULL socket (where statuses go),
    and the frames SGLang's builders make (``codec``: Mooncake's layout or NIXL's)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], prefill_port: int, codec: ModuleType) -> None:
        self.codec = codec
        self.pull = ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{prefill_port}")
        # An engine of its own with memory in it: the prefill connects to what a registration names.
        self.engine = create_executor(codec.__name__.rpartition(".")[2], arena_bytes=1 << 20, host="127.0.0.1",
                                      staging_bytes=0)
        self.pool = self.engine.allocate(2 * SPEC.layers * SPEC.pages * SPEC.page_size * SPEC.row_bytes)
        self.engine.register_memory([self.pool])
        self.identity = self.engine.endpoint()

    def register(self, token_bytes: int = SPEC.row_bytes) -> None:
        self.push.send_multipart(self.codec.build_registration(self.registration(token_bytes)))

    def registration(self, token_bytes: int = SPEC.row_bytes) -> KvRegistration:
        reg = example_registration(backend=BACKEND_NIXL if self.codec is nixl else BACKEND_MOONCAKE,
                                   num_layers=SPEC.layers, token_bytes=token_bytes, page_size=SPEC.page_size,
                                   port=self.port, num_pages=SPEC.pages, base_ptr=self.pool.ptr,
                                   memory_kind=MEMORY_KIND_DRAM)  # NIXL's frames say where it is
        getattr(reg, "nixl" if self.codec is nixl else "mooncake").CopyFrom(self.identity)
        return reg

    def submit(self, room: int, pages: tuple[int, ...] = (1, 2), required: int = 1) -> None:
        name = getattr(self.identity, "agent_name" if self.codec is nixl else "session_id")
        info = TransferInfo(room=room, peer_name=name, required_dst_info_num=required, dst_aux_index=0)
        info.notify_endpoint.host, info.notify_endpoint.port = "127.0.0.1", self.port
        info.dst_kv_pages.extend(pages)
        self.push.send_multipart(self.codec.build_transfer_info(info))

    def abort(self, room: int, generation: int) -> None:
        note = AbortNotification(room=room, generation=generation)
        note.reply_endpoint.host, note.reply_endpoint.port = "127.0.0.1", self.port
        self.push.send_multipart(self.codec.build_abort(note))

    def next(self, timeout_s: float = 10.0) -> list[bytes] | None:
        return self.pull.recv_multipart() if self.pull.poll(int(timeout_s * 1000)) else None


Decodes = Callable[..., _Decode]


@pytest.fixture
def decodes() -> Iterator[Decodes]:
    """Makes decode ranks that dial a legacy port; closes their sockets and engines after the test."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[_Decode] = []

    def make(port: int, codec: ModuleType = mooncake) -> _Decode:
        made.append(_Decode(ctx, port, codec))
        return made[-1]

    yield make
    for decode in made:
        decode.engine.close()


def _peers(service: ServiceThread) -> list[tuple[str, int]]:
    """(protocol, open requests) of each peer, as ``pdproto status`` reads them."""
    with HandshakeClient(f"127.0.0.1:{service.port}", session=False) as client:
        return [(p.protocol, p.open_requests) for p in client.describe().peers]


def test_off_every_request_is_answered_failed_naming_the_setting(decodes: Decodes) -> None:
    """The listener is off by default: an SGLang decode pointed at the port fails at once, told what to set,
    and its abort is acknowledged (nothing here writes its pages)."""
    with _prefill(serve=False) as service:
        decode = decodes(service.legacy_port)
        decode.register()
        decode.submit(7)
        room, state, rank, reason = decode.next() or []
        assert (room, state, rank) == (b"7", FAILED, b"0")
        assert b"PDPROTO_LEGACY=1" in reason and reason.startswith(b"CONFIG_INVALID: "), reason
        decode.abort(7, generation=3)
        assert decode.next() == [b"ABORT_ACK", b"7", b"0", b"3"]
        assert _peers(service) == []


def test_a_room_is_bound_to_the_first_decode_that_claims_it(decodes: Decodes) -> None:
    """SGLang's frames carry no credential, only the room id: a second decode claiming a room is refused
    (its request fails with why), its ABORT does not touch the first decode's request; the first decode's
    own ABORT does, and is acknowledged without a status (the decode recorded its own reason)."""
    with _prefill(serve=True) as service:
        first, second = decodes(service.legacy_port), decodes(service.legacy_port)
        first.register()
        second.register()
        first.submit(7)
        deadline = time.monotonic() + 10
        while _peers(service) != [(MOONCAKE, 1), (MOONCAKE, 0)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(_peers(service)) == [(MOONCAKE, 0), (MOONCAKE, 1)]  # the first decode's request is open
        with HandshakeClient(f"127.0.0.1:{service.port}", session=False) as client:
            table = render(client.describe())
        assert table.count(f" {MOONCAKE} ") == 2, table  # pdproto status names the protocol of each peer
        second.submit(7)
        room, state, _, reason = second.next() or []
        assert (room, state) == (b"7", FAILED) and reason.startswith(b"DUPLICATE_REQUEST: room 7 is claimed"), reason
        second.abort(7, generation=1)
        assert second.next() == [b"ABORT_ACK", b"7", b"0", b"1"]
        assert sorted(_peers(service)) == [(MOONCAKE, 0), (MOONCAKE, 1)]  # untouched
        first.abort(7, generation=2)
        assert first.next() == [b"ABORT_ACK", b"7", b"0", b"2"]
        assert first.next(0.5) is None  # no Failed status: the decode aborted it itself
        assert sorted(_peers(service)) == [(MOONCAKE, 0), (MOONCAKE, 0)]


def test_what_is_not_served_is_refused_with_why(decodes: Decodes) -> None:
    """SGLang's staging buffer (a decode of another attention TP size waiting for CHUNK_READY) and the
    prefill_complete allocation policy (BOOTSTRAP) are not served: the decode is told so at once."""
    with _prefill(serve=True) as service:
        decode = decodes(service.legacy_port)
        reg = decode.registration()
        reg.attn_tp.size, reg.staging.base_ptr, reg.staging.total_size = 2, decode.pool.ptr, 4096
        decode.push.send_multipart(mooncake.build_registration(reg))
        decode.submit(4)
        room, state, _, reason = decode.next() or []
        assert (room, state) == (b"4", FAILED) and b"SGLANG_DISAGG_STAGING_BUFFER=0" in reason, reason
        decode.push.send_multipart([b"BOOTSTRAP", b"8", b"127.0.0.1", str(decode.port).encode()])
        room, state, _, reason = decode.next() or []
        assert (room, state) == (b"8", FAILED) and b"prefill_complete" in reason, reason
        assert _peers(service) == []


def test_frames_never_replace_a_grpc_peer(decodes: Decodes) -> None:
    """Unauthenticated frames naming the engine of a decode registered over gRPC are refused (its restart
    registers over gRPC); the gRPC peer keeps its registration."""
    with _prefill(serve=True) as service:
        decode = decodes(service.legacy_port)
        with HandshakeClient(f"127.0.0.1:{service.port}", session=False) as client:
            client.register(decode.registration())
            decode.register()
            decode.submit(5)
            room, state, _, reason = decode.next() or []
            assert (room, state) == (b"5", FAILED) and reason.startswith(b"IDENTITY_IN_USE: "), reason
            assert _peers(service) == [("", 0)]


def test_hostile_frames_are_refused_and_the_listener_keeps_serving(decodes: Decodes) -> None:
    """An oversized frame, a flood of garbage and malformed messages: each refused (counted by reason), none
    reaches the core; then a decode whose model pdproto refuses still gets a Failed status naming why."""
    with _prefill(serve=True) as service:
        frames = service.core.metrics.legacy_frames

        def refused() -> dict[tuple[str, ...], float]:
            return {tuple(s.labels.values()): s.value for m in frames.collect() for s in m.samples
                    if s.name.endswith("_total")}

        ctx = zmq.Context.instance()
        for messages in ([[b"None", b"x" * (MAX_FRAME_BYTES + 1)]],  # ZMQ drops it (and the connection) unread
                         [[b"\xff" * (i % 7)] * (1 + i % 12) for i in range(300)]):
            hostile = ctx.socket(zmq.PUSH)
            hostile.connect(f"tcp://127.0.0.1:{service.legacy_port}")
            for message in messages:
                hostile.send_multipart(message)
            hostile.close(linger=5000)
        deadline = time.monotonic() + 10
        while sum(refused().values()) < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = refused()
        assert sum(n for (_, outcome), n in counts.items() if outcome.startswith("LEGACY_")) == 300, counts
        decode = decodes(service.legacy_port)
        decode.register(token_bytes=2 * SPEC.row_bytes)  # rows of another model
        decode.submit(9)
        room, state, _, reason = decode.next() or []
        assert (room, state) == (b"9", FAILED) and reason.startswith(b"TOPOLOGY_ROW_SIZE_MISMATCH: "), reason
        assert refused()[("registration", "TOPOLOGY_ROW_SIZE_MISMATCH")] == 1
        assert _peers(service) == []


@pytest.mark.parametrize("codec", [mooncake, nixl], ids=["mooncake", "nixl"])
def test_a_decode_of_either_sglang_backend_gets_its_rows_and_success(decodes: Decodes, codec: ModuleType) -> None:
    """A decode speaking SGLang's Mooncake frames (a Mooncake prefill) or NIXL's (a NIXL prefill) gets every
    row of its request where its pages are, and the Success status in its backend's layout. (SGLang's own
    NIXL decode does not run on CPU: it registers its pool as VRAM; docs/migration.md.)"""
    backend = "nixl" if codec is nixl else "mooncake"
    with _prefill(serve=True, backend=backend, produce=True) as service:
        decode = decodes(service.legacy_port, codec)
        decode.register()
        pages = tuple(range(SPEC.pages - 1, SPEC.pages - 1 - SPEC.pages_per_room, -1))
        decode.submit(11, pages)
        status = decode.next()
        assert status == ([b"KV_STATUS", b"11", b"4", b"0", b""] if codec is nixl else [b"11", b"4", b"0"]), status
        rows = SPEC.pages * SPEC.page_size
        held = decode.pool.array[:SPEC.layers * rows * SPEC.row_bytes].reshape(SPEC.layers, rows, SPEC.row_bytes)
        tokens = np.arange(SPEC.prompt_tokens)
        at = np.asarray(pages)[tokens // SPEC.page_size] * SPEC.page_size + tokens % SPEC.page_size
        for layer in range(SPEC.layers):
            assert np.array_equal(held[layer, at], SPEC.rows(layer, 11, tokens)), layer
        assert not held[:, np.setdiff1d(np.arange(rows), at)].any()  # nothing else written
        assert room_pages(11, SPEC).size == SPEC.pages_per_room


def test_pdproto_serve_legacy_port() -> None:
    """``pdproto serve --legacy-port``: the port answers SGLang's frames; a decode it never registered is
    told so on its first request (a prefill that restarted under it), not left waiting."""
    with running_server(*SERVE_ARGS, "--legacy-port", "0") as srv:
        ctx = zmq.Context.instance()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{srv.ready['legacy_port']}")
        info = TransferInfo(room=3, peer_name="127.0.0.1:1", required_dst_info_num=1, dst_aux_index=0)
        info.notify_endpoint.host, info.notify_endpoint.port = "127.0.0.1", port
        info.dst_kv_pages.append(1)
        push.send_multipart(mooncake.build_transfer_info(info))
        assert pull.poll(10_000), srv.stderr()
        room, state, _, reason = pull.recv_multipart()
        assert (room, state) == (b"3", FAILED) and reason.startswith(b"PEER_NOT_FOUND: no registration"), reason
        pull.close(linger=0)
        push.close(linger=0)
