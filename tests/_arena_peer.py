"""A hostile local-backend decode: serves whatever descriptor a test asks for on an arena socket.

Run as ``python -m tests._arena_peer`` through ``pdproto_demo.proc.Child``. Each ``serve``
command creates one arena of a given kind (a good sealed memfd, or something a prefill
must refuse: unsealed, a FIFO, a /dev/shm file, ...), listens for it on a fresh abstract
socket speaking the handover protocol of ``pdproto.transfer.arena`` (written out here, not
imported, so a change to the protocol shows up as a failing test), and answers with a
``KvRegistration`` naming it. ``shrink`` tries to truncate and grow an arena it served.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import secrets
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from pdproto.transfer.arena import HELLO, REQUIRED_SEALS
from pdproto.v1 import registration_pb2
from pdproto_demo.proc import Child, Reply, redirect_stdout_to_stderr, serve_commands

KINDS = ("good", "unsealed", "no_seal_seal", "write_sealed", "empty", "fifo", "shm_file", "disk_file",
         "readonly", "two_fds", "no_fd", "wrong_answer", "huge_pages")
"""Arena kinds ``serve`` makes; every one but ``good`` must be refused by a prefill."""
ARENA = 1 << 20


def _memfd(seals: int, size: int = ARENA, flags: int = 0) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _descriptors(kind: str, keep: list[str]) -> list[int]:
    """The descriptors a ``kind`` arena hands over."""
    if kind in ("good", "wrong_answer"):
        return [_memfd(REQUIRED_SEALS)]
    if kind == "unsealed":
        return [_memfd(0)]
    if kind == "no_seal_seal":
        return [_memfd(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)]
    if kind == "write_sealed":
        return [_memfd(REQUIRED_SEALS | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10))]
    if kind == "empty":
        return [_memfd(REQUIRED_SEALS, size=0)]
    if kind == "huge_pages":  # faults SIGBUS in the prefill once the huge-page pool runs dry
        return [_memfd(REQUIRED_SEALS, size=2 << 20, flags=os.MFD_HUGETLB)]
    if kind == "fifo":
        path = os.path.join(tempfile.mkdtemp(), "fifo")
        os.mkfifo(path)
        keep.append(path)
        return [os.open(path, os.O_RDWR | os.O_NONBLOCK)]
    if kind in ("shm_file", "disk_file"):
        fd, path = tempfile.mkstemp(dir="/dev/shm" if kind == "shm_file" else None)
        os.ftruncate(fd, ARENA)
        keep.append(path)
        return [fd]
    if kind == "readonly":
        fd = _memfd(REQUIRED_SEALS)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.close(fd)
        return [ro]
    if kind == "two_fds":
        return [_memfd(REQUIRED_SEALS), _memfd(REQUIRED_SEALS)]
    if kind == "no_fd":
        return []
    raise ValueError(f"unknown arena kind {kind!r}")


class HostilePeer:
    """Arenas served by this process, by socket name."""

    def __init__(self) -> None:
        self.fds: dict[str, list[int]] = {}
        self.listeners: list[socket.socket] = []
        self.paths: list[str] = []

    def serve(self, kind: str, length: int = ARENA, pid: int = 0, secret_hex: str = "") -> Reply:
        """Serve one arena; the registration claims one KV buffer of ``length`` bytes at offset 0."""
        fds = _descriptors(kind, self.paths)
        secret = bytes.fromhex(secret_hex) if secret_hex else secrets.token_bytes(32)
        name = f"pdproto-arena-{os.getpid()}-{secrets.token_hex(16)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + name)
        listener.listen(4)
        self.fds[name] = fds
        self.listeners.append(listener)
        threading.Thread(target=self._answer, args=(listener, fds, secret, kind), daemon=True).start()
        return _registration(kind, name, secret, pid or os.getpid(), length)

    @staticmethod
    def _answer(listener: socket.socket, fds: list[int], secret: bytes, kind: str) -> None:
        held = []
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            hello = conn.recv(len(HELLO) + len(secret), socket.MSG_WAITALL)
            if hello != HELLO + secret:
                conn.close()
                continue
            answer = struct.pack("<8sQ", b"NOTARENA" if kind == "wrong_answer" else HELLO, ARENA)
            conn.sendmsg([answer], _rights(fds))
            held.append(conn)

    def shrink(self, socket_name: str) -> Reply:
        """Try to truncate the arena to 0 and to grow it; report what the kernel said."""
        out: dict[str, Any] = {}
        for what, size in (("truncate", 0), ("grow", 4 * ARENA)):
            try:
                os.ftruncate(self.fds[socket_name][0], size)
                out[what] = "ok"
            except OSError as exc:
                out[what] = exc.strerror
        return out

    def close(self) -> None:
        """Close every listener, connection and descriptor and remove temporary files."""
        for sock in self.listeners:
            sock.close()
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        for path in self.paths:
            os.unlink(path)


@contextlib.contextmanager
def spawned() -> Iterator[Child]:
    """A hostile peer in a process of its own, ready for commands; closed on the way out."""
    child = Child.spawn("arena-peer", "tests._arena_peer", [])
    try:
        child.recv(60)
        yield child
    finally:
        child.close()


def _registration(kind: str, name: str, secret: bytes, pid: int, length: int) -> Reply:
    """The reply naming an arena: a registration of one KV buffer of ``length`` bytes at offset 0."""
    reg = registration_pb2.KvRegistration(page_size=1)
    reg.local.CopyFrom(registration_pb2.LocalEndpoint(arena_name=f"hostile-{kind}", pid=pid, socket=name,
                                                      secret=secret))
    reg.kv_buffers.add(ptr=0, item_len=64, length=length)
    return {"registration": reg.SerializeToString().hex(), "socket": name}


def _rights(fds: list[int]) -> list[tuple[int, int, array.array[int]]]:
    """The ``SCM_RIGHTS`` ancillary data carrying ``fds`` (none for an empty list)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def main() -> int:
    """Entry point: one ready line, then commands ``serve``, ``shrink``, ``ping``."""
    out = redirect_stdout_to_stderr()
    peer = HostilePeer()
    try:
        serve_commands({"serve": peer.serve, "shrink": peer.shrink, "ping": lambda: {"pong": True}}, out, {})
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
