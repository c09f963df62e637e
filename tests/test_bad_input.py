"""Every bad size, rank and name reaching the service is refused at the call that carries it.

Against a real ``pdproto serve``: each registration or request below used to be accepted
and fail every transfer later (DCP size 2^31, a decode prefix past the planner's range),
or answered INTERNAL (an arena name with a NUL byte). Each now answers INVALID_ARGUMENT
naming the field, and a good peer still moves its KV byte-exact afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.rpc import error_from_rpc
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, ServerProcess, running_server

pytestmark = pytest.mark.process

Reg = registration_pb2.KvRegistration
Info = transfer_pb2.TransferInfo


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(*SERVE_ARGS) as srv:
        yield srv
        assert srv.proc.poll() is None, srv.stderr()


@pytest.fixture(scope="module")
def peer() -> Iterator[DecodeRank]:
    rank = DecodeRank.for_spec(SPEC, pages=64)
    yield rank
    rank.close()


def _set(path: str, value: object) -> Callable[[Reg], None]:
    """A mutation setting a (dotted) field of the registration."""
    *parents, name = path.split(".")

    def apply(reg: Reg) -> None:
        target: object = reg
        for p in parents:
            target = getattr(target, p)
        setattr(target, name, value)

    return apply


REGISTRATIONS: dict[str, tuple[Callable[[Reg], None], str]] = {
    "DCP size 2^31": (_set("dcp.size", 1 << 31), "registration.dcp.size"),
    "TP size 2^32-1": (_set("attn_tp.size", (1 << 32) - 1), "registration.attn_tp.size"),
    "page size 2^31": (_set("page_size", 1 << 31), "registration.page_size"),
    "arena name with a NUL byte": (_set("local.arena_name", "pdproto-1-\x00x"), "registration.local.arena_name"),
    "old arena name with a NUL byte": (_set("local.shm_name", "pdproto-1-\x00x"), "registration.local.shm_name"),
    "model id of 64 KB": (_set("model_id", "m" * 65536), "registration.model_id"),
    "100,000 capabilities": (lambda r: r.capabilities.extend(["c"] * 100_000), "registration.capabilities"),
    "KV buffer past the address space": (lambda r: setattr(r.kv_buffers[0], "ptr", (1 << 64) - 1),
                                         "registration.kv_buffers[0].length"),
    "2^31 KV heads": (_set("total_kv_heads", 1 << 31), "registration.total_kv_heads"),
}


@pytest.mark.parametrize("case", list(REGISTRATIONS))
def test_bad_registration_is_refused_at_register(server: ServerProcess, peer: DecodeRank, case: str) -> None:
    mutate, field = REGISTRATIONS[case]
    reg = peer.registration()
    mutate(reg)
    with HandshakeClient(server.target) as client, pytest.raises(E.InvalidFieldError) as info:
        client.register(reg)
    assert info.value.reason is Reason.INVALID_FIELD
    assert info.value.metadata["grpcCode"] == "INVALID_ARGUMENT"
    assert field in {f for f, _ in info.value.violations}, info.value.violations


TRANSFERS: dict[str, tuple[Callable[[Info], None], str]] = {
    "decode prefix 2^63": (lambda t: setattr(t, "decode_prefix_len", 1 << 63), "transfer.decode_prefix_len"),
    "2^32-1 required ranks": (lambda t: setattr(t, "required_dst_info_num", (1 << 32) - 1),
                              "transfer.required_dst_info_num"),
    "peer name with a NUL byte": (lambda t: setattr(t, "peer_name", "d\x00"), "transfer.peer_name"),
}


def test_bad_requests_are_refused_at_submit_and_the_server_keeps_serving(server: ServerProcess,
                                                                          peer: DecodeRank) -> None:
    with HandshakeClient(server.target, timeout=30) as client:
        pid = client.register(peer.registration()).peer_id
        pages = peer.pages_for(SPEC.prompt_tokens)
        for room, (mutate, field) in enumerate(TRANSFERS.values(), start=1):
            info = peer.transfer_info(room, pages)
            mutate(info)
            with pytest.raises(E.InvalidFieldError) as bad:
                client.submit_transfer(pid, info)
            assert field in {f for f, _ in bad.value.violations}, bad.value.violations
        client.submit_transfer(pid, peer.transfer_info(99, pages))
        assert client.wait_for(pid, [99], timeout=30)[99].state == common_pb2.TRANSFER_STATE_SUCCESS
        peer.verify({99: pages}, SPEC.prompt_tokens)
        client.deregister(pid)


@pytest.mark.parametrize("method", ["GetServerInfo", "Register", "SubmitTransfer", "WatchStatus", "Abort",
                                    "Deregister", "Describe", "Session"])
def test_bytes_that_are_no_message_are_refused_typed(server: ServerProcess, method: str) -> None:
    """A body that does not parse answers INVALID_ARGUMENT with reason WIRE_MALFORMED (grpc's bare
    UNKNOWN before: the deserializer failed before any handler ran), and the server keeps serving."""
    garbage = b"\xff\xff\xff\xff\x0f" + bytes(range(64))
    with grpc.insecure_channel(server.target) as chan:
        path = f"/pdproto.v1.HandshakeService/{method}"
        if method == "WatchStatus":
            call: Callable[[], object] = lambda: list(chan.unary_stream(path)(garbage, timeout=10))
        elif method == "Session":
            call = lambda: list(chan.stream_stream(path)(iter([garbage]), timeout=10))
        else:
            call = lambda: chan.unary_unary(path)(garbage, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            call()
    error = error_from_rpc(info.value)
    assert (info.value.code(), error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.WIRE_MALFORMED), error
    with HandshakeClient(server.target) as client:
        assert client.get_server_info().page_size == SPEC.page_size
