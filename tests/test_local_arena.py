"""The local backend cannot be turned against the prefill's host, and a decode that breaks its arena cannot crash it.

Real processes: a hostile decode (``tests._arena_peer``) serves descriptors of every kind a
prefill must refuse, and a real ``pdproto serve`` runs while a real decode rank tries to
shrink and then drops its arena. The prefill never opens, follows, creates or deletes a
file by name, so none of the old name-based attacks has anything to aim at.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import secrets
import signal
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import DeadlineExceededError, InvalidFieldError, PdprotoError, Reason, RequestFailedError
from pdproto.transfer import LayerSpan, TransferJob, create_executor
from pdproto.transfer.local import LocalExecutor
from pdproto.v1 import common_pb2, registration_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.proc import Child

from ._arena_peer import spawned
from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def hostile() -> Iterator[Child]:
    with spawned() as child:
        yield child


@pytest.fixture
def prefill() -> Iterator[LocalExecutor]:
    ex = create_executor("local", arena_bytes=1 << 20, connect_timeout_s=5)
    assert isinstance(ex, LocalExecutor)
    yield ex
    ex.close()


def _registration(reply: dict[str, object]) -> registration_pb2.KvRegistration:
    return registration_pb2.KvRegistration.FromString(bytes.fromhex(str(reply["registration"])))


def _open_fds() -> int:
    gc.collect()  # what earlier tests left to the collector closes now, not between two counts
    return len(os.listdir("/proc/self/fd"))


def _four_rows(ex: LocalExecutor, dst_ptr: int = 0) -> TransferJob:
    """A job writing four 64-byte rows of 7s to ``dst_ptr`` of the peer's arena."""
    buf = ex.allocate(4096)
    ex.register_memory([buf])
    buf.array[:] = 7
    return TransferJob.of_runs([LayerSpan(buf.addr, dst_ptr, 64)], np.array([[0, 1, 0, 1, 4]], dtype=np.int64))


REFUSED = {
    "unsealed": "F_SEAL_SHRINK",
    "no_seal_seal": "F_SEAL_SEAL",
    "write_sealed": "sealed against writes",
    "empty": "empty",
    "fifo": "FIFO",
    "shm_file": "F_SEAL_SHRINK",  # a tmpfs file carries only F_SEAL_SEAL
    "disk_file": "not a memfd",
    "readonly": "reading and writing",
    "two_fds": "exactly one descriptor",
    "no_fd": "exactly one descriptor",
    "wrong_answer": "exactly one descriptor",
    "huge_pages": "huge pages",
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_an_arena_that_is_not_a_sealed_memfd_is_refused_with_a_reason(hostile: Child, prefill: LocalExecutor,
                                                                    kind: str) -> None:
    reg = _registration(hostile.call("serve", kind=kind))
    before = _open_fds()
    with pytest.raises(InvalidFieldError) as info:
        prefill.connect("p", reg)
    assert info.value.reason is Reason.INVALID_FIELD
    assert REFUSED[kind] in info.value.message, info.value.message
    assert _open_fds() == before, "a refused arena left a descriptor open"


def _bad_endpoint(ep: registration_pb2.LocalEndpoint, case: str) -> str:
    """Break one field of a good endpoint; returns the field the error must name."""
    if case == "nul_in_socket":
        ep.socket = ep.socket[:20] + "\0" + ep.socket[21:]
    elif case == "foreign_socket":
        ep.socket = "/run/dbus/system_bus_socket"
    elif case == "no_socket":  # an old decode: only a /dev/shm name
        ep.socket, ep.shm_name = "", "../../etc/passwd"
    elif case == "short_secret":
        ep.secret = b"x" * 8
    elif case == "wrong_secret":
        ep.secret = bytes(32)
        return "registration.local.secret"
    elif case == "wrong_pid":
        ep.pid = 1
        return "registration.local.pid"
    elif case == "wrong_size":
        ep.size = 12345
        return "registration.local.size"
    return "registration.local." + ("secret" if "secret" in case else "socket")


@pytest.mark.parametrize("case", ["nul_in_socket", "foreign_socket", "no_socket", "short_secret", "wrong_secret",
                                  "wrong_pid", "wrong_size"])
def test_bad_endpoint_fields_are_typed_errors(hostile: Child, prefill: LocalExecutor, case: str) -> None:
    reg = _registration(hostile.call("serve", kind="good"))
    field = _bad_endpoint(reg.local, case)
    with pytest.raises(InvalidFieldError) as info:
        prefill.connect("p", reg)
    assert info.value.field == field, info.value


@pytest.mark.parametrize(("length", "ptr", "field"), [(2 << 20, 0, "registration.kv_buffers"),
                                                     (0, 2 << 20, "registration.kv_buffers[0].ptr")])
def test_buffers_outside_the_arena_are_refused(hostile: Child, prefill: LocalExecutor, length: int, ptr: int,
                                               field: str) -> None:
    reg = _registration(hostile.call("serve", kind="good", length=length))
    reg.kv_buffers[0].ptr = ptr
    with pytest.raises(InvalidFieldError) as info:
        prefill.connect("p", reg)
    assert info.value.field == field


def _arena_mappings() -> list[int]:
    """Sizes of this process's mappings of a hostile peer's memfd."""
    sizes = []
    for line in open("/proc/self/maps").read().splitlines():
        if "memfd:hostile" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(end - start)
    return sizes


def test_only_the_bytes_the_buffers_cover_are_mapped(hostile: Child, prefill: LocalExecutor) -> None:
    reg = _registration(hostile.call("serve", kind="good", length=64 << 10))
    assert [b.length for b in reg.kv_buffers] == [64 << 10]  # of a 1 MiB arena
    before = _arena_mappings()
    prefill.connect("p", reg)
    try:
        assert _arena_mappings() == [*before, 64 << 10]  # not the whole 1 MiB arena
    finally:
        prefill.disconnect("p")


def test_nothing_listening_is_peer_gone(prefill: LocalExecutor) -> None:
    reg = registration_pb2.KvRegistration()
    reg.local.CopyFrom(registration_pb2.LocalEndpoint(arena_name="x", socket=f"pdproto-arena-1-{'0' * 32}",
                                                      secret=bytes(32)))
    with pytest.raises(RequestFailedError) as info:
        prefill.connect("p", reg)
    assert info.value.reason is Reason.PEER_GONE


def _silent_listener() -> tuple[socket.socket, str]:
    """An arena socket that accepts connections (the kernel does) and never answers: a frozen decode."""
    name = f"pdproto-arena-1-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    return listener, name


@pytest.fixture
def silent() -> Iterator[str]:
    """The name of a silent arena socket."""
    listener, name = _silent_listener()
    yield name
    listener.close()


def _silenced(rank: DecodeRank, name: str) -> registration_pb2.KvRegistration:
    """The rank's registration with its arena socket swapped for a silent one."""
    reg = rank.registration()
    reg.local.socket, reg.local.secret, reg.local.pid = name, secrets.token_bytes(32), 0
    return reg


def test_a_silent_decode_fails_at_the_connect_deadline(silent: str) -> None:
    rank = DecodeRank.for_spec(SPEC, pages=8)
    ex = LocalExecutor(arena_bytes=1 << 20, connect_timeout_s=0.5)
    try:
        with pytest.raises(DeadlineExceededError) as info:
            ex.connect("p", _silenced(rank, silent))
        assert info.value.reason is Reason.DEADLINE_EXCEEDED
        assert "hand its arena over in time" in info.value.message
    finally:
        ex.close()
        rank.close()


def test_a_silent_decode_does_not_stop_another_register(silent: str) -> None:
    """A Register whose decode never hands its arena over waits on its own engine thread, to the
    connect deadline; meanwhile another decode registers and moves its bytes."""
    peer, frozen = DecodeRank.for_spec(SPEC, pages=32), DecodeRank.for_spec(SPEC, pages=8)
    try:
        with running_server(*SERVE_ARGS, "--engine-timeout", "10") as srv, \
                HandshakeClient(srv.target, timeout=30) as client, HandshakeClient(srv.target, timeout=30) as other, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(other.register, _silenced(frozen, silent))
            # While that Register waits on the silent decode, this one is served in full.
            peer_id = client.register(peer.registration()).peer_id
            pages = peer.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(peer_id, peer.transfer_info(7, pages))
            done = client.wait_for(peer_id, [7], timeout=30)
            assert not waiting.done(), "the silent decode's Register ended before the healthy one's transfer"
            with pytest.raises(DeadlineExceededError) as info:
                waiting.result(timeout=60)
            assert "hand its arena over in time" in info.value.message, info.value.message
        assert done[7].state == common_pb2.TRANSFER_STATE_SUCCESS, done[7]
        peer.verify({7: pages}, SPEC.prompt_tokens)
    finally:
        peer.close()
        frozen.close()


def test_a_sealed_arena_cannot_shrink_under_the_prefill(prefill: LocalExecutor) -> None:
    hostile = Child.spawn("arena-peer", "tests._arena_peer", [])
    try:
        _shrink_then_die(hostile, prefill)
    finally:
        hostile.close()


def _shrink_then_die(hostile: Child, prefill: LocalExecutor) -> None:
    hostile.recv(60)
    reply = hostile.call("serve", kind="good")
    prefill.connect("p", _registration(reply))
    job = _four_rows(prefill)
    assert prefill.execute("p", job).bytes == 256
    # The decode tries what used to SIGBUS the prefill: the kernel refuses, the copy goes on.
    assert hostile.call("shrink", socket_name=reply["socket"]) == {"truncate": "Operation not permitted",
                                                                  "grow": "Operation not permitted"}
    assert prefill.execute("p", job).bytes == 256
    hostile.kill(signal.SIGKILL)
    hostile.proc.wait(timeout=10)
    with pytest.raises(RequestFailedError) as info:
        prefill.execute("p", job)
    assert info.value.reason is Reason.PEER_GONE


def _shrink(rank: DecodeRank) -> list[str]:
    """Everything a decode can do to shrink the arena it registered; what happened to each try."""
    tried = []
    ex = rank.executor
    fd = getattr(ex, "_arena_fd", -1)
    if fd >= 0:
        try:
            os.ftruncate(fd, 0)
            tried.append("memfd truncated")
        except OSError as exc:
            tried.append(f"memfd: {exc.strerror}")
    path = os.path.join("/dev/shm", rank.registration().local.arena_name)
    if os.path.exists(path):  # a name-based arena (what the prefill used to open)
        os.truncate(path, 0)
        tried.append("shm file truncated")
    return tried


def _wait(client: HandshakeClient, peer_id: str, room: int) -> tuple[int, str]:
    status = client.wait_for(peer_id, [room], timeout=20)[room]
    return int(status.state), status.failure_code


def test_a_decode_that_shrinks_then_drops_its_arena_fails_alone_and_never_crashes_the_server() -> None:
    shrinker = DecodeRank.for_spec(SPEC, pages=32)
    bystander = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=10) as client:
            ids = {r: client.register(r.registration()).peer_id for r in (shrinker, bystander)}
            tried = _shrink(shrinker)
            pages = shrinker.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(ids[shrinker], shrinker.transfer_info(1, pages))
            try:
                state, code = _wait(client, ids[shrinker], 1)
            except PdprotoError:
                pytest.fail(f"the server died (exit status {srv.proc.wait(10)}) after: {tried}")
            assert state == common_pb2.TRANSFER_STATE_SUCCESS, (tried, code)
            shrinker.verify({1: pages}, SPEC.prompt_tokens)
            # Now the decode drops its arena (closes its executor) and still submits.
            shrinker.executor.close()
            client.submit_transfer(ids[shrinker], shrinker.transfer_info(2, pages))
            assert _wait(client, ids[shrinker], 2) == (common_pb2.TRANSFER_STATE_FAILED, "PEER_GONE")
            other = bystander.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(ids[bystander], bystander.transfer_info(3, other))
            assert _wait(client, ids[bystander], 3) == (common_pb2.TRANSFER_STATE_SUCCESS, "")
            bystander.verify({3: other}, SPEC.prompt_tokens)
            assert srv.proc.poll() is None
    finally:
        shrinker.close()
        bystander.close()


def test_the_local_backend_creates_nothing_under_dev_shm(prefill: LocalExecutor) -> None:
    before = set(os.listdir("/dev/shm"))
    decode = create_executor("local", arena_bytes=1 << 20)
    try:
        buf = decode.allocate(4096)
        reg = registration_pb2.KvRegistration()
        reg.local.CopyFrom(decode.endpoint())
        reg.kv_buffers.add(ptr=buf.ptr, length=buf.length)
        prefill.connect("d", reg)
        job = _four_rows(prefill, buf.ptr)
        prefill.execute("d", job)
        assert bytes(buf.array[:256]) == b"\x07" * 256
        assert set(os.listdir("/dev/shm")) - before == set()
    finally:
        decode.close()
    with pytest.raises(RequestFailedError):  # the decode closed its executor: its arena is gone
        prefill.execute("d", job)


def test_a_file_named_by_the_peer_is_never_opened_written_or_deleted(prefill: LocalExecutor,
                                                                    tmp_path: object) -> None:
    # What a hostile decode used to aim the prefill at: a symlink under /dev/shm to a file it
    # does not own, and another process's shared memory, with a dead pid so the prefill
    # would delete it on disconnect.
    victim = os.path.join(str(tmp_path), "victim")
    with open(victim, "wb") as f:
        f.write(b"v" * (1 << 16))
    link = f"/dev/shm/pdproto-test-link-{os.getpid()}"
    other = f"/dev/shm/pdproto-test-other-{os.getpid()}"
    os.symlink(victim, link)
    with open(other, "wb") as f:
        f.write(b"o" * (1 << 16))
    dead = Child.spawn("dead", "pdproto_demo.proc", [])
    dead.kill_and_reap()
    try:
        for name in (os.path.basename(link), os.path.basename(other)):
            reg = registration_pb2.KvRegistration()
            reg.local.CopyFrom(registration_pb2.LocalEndpoint(shm_name=name, size=1 << 16, pid=dead.proc.pid))
            reg.kv_buffers.add(ptr=0, length=1 << 16)
            with pytest.raises(InvalidFieldError) as info:
                prefill.connect(name, reg)
            assert info.value.field == "registration.local.socket"
            with pytest.raises(PdprotoError):
                prefill.execute(name, _four_rows(prefill))
            prefill.disconnect(name)
        assert open(victim, "rb").read() == b"v" * (1 << 16)
        assert open(other, "rb").read() == b"o" * (1 << 16)
    finally:
        os.unlink(link)
        if os.path.exists(other):
            os.unlink(other)
