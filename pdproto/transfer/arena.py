"""A decode's local arena, handed to a prefill on the same host as a sealed memfd over a Unix socket.

The prefill never opens a file by name. The decode creates its arena with
``memfd_create``, sizes it, and seals it against shrinking, growing and further seals
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): no process can ever make it smaller than
a mapping of it, so the SIGBUS a truncated ``/dev/shm`` file caused cannot happen, and
no process can add a write seal under the prefill either. The decode then listens on an
abstract Unix socket (no file to clean up, no path to follow) and hands the descriptor,
with ``SCM_RIGHTS``, to a client that presents the registration's secret.

The prefill (``fetch``) checks the descriptor before mapping it: a regular file, a
memfd carrying those seals and no write seal, open read-write, not empty, not on huge
pages. Whatever the peer hands over, the prefill can then only write into memory the
peer itself holds and offered. The connection stays open as a liveness channel: when
the decode exits or closes its executor, the prefill's end reports a hang-up, and that
peer's transfers fail with ``PEER_GONE``.
"""

from __future__ import annotations

import array
import fcntl
import hmac
import mmap
import os
import re
import secrets
import select
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass

from pdproto.errors import DeadlineExceededError, InvalidFieldError, Reason, RequestFailedError
from pdproto.v1 import registration_pb2

HELLO = b"PDARENA1"
"""First bytes of the client's request and of the server's answer."""
SECRET_BYTES = 32
"""Length of the secret a decode generates (a prefill accepts 16 or more)."""
SOCKET_NAME = re.compile(r"pdproto-arena-[0-9]{1,10}-[0-9a-f]{32}")
"""Every name a decode listens on; a prefill connects to no other socket."""
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_ANSWER = struct.Struct("<8sQ")
_UCRED = struct.Struct("3i")
_PRUNE_AT = 16
"""Held connections at which the decode first looks for prefills that hung up."""
_HANDOVER_S = 2.0
"""How long the decode gives a client, in all, to present its secret and take the arena."""
_FIELD = "registration.local"
_CTRUNC = int(socket.MSG_CTRUNC)


def create(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes named ``name``, sealed so it can never shrink or grow."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ArenaServer:
    """The decode side: hands ``fd`` to every client that presents ``secret``, and holds the connections."""

    def __init__(self, fd: int, size: int) -> None:
        """Listen on a fresh abstract socket; a daemon thread answers clients one at a time."""
        self.size = size
        self.secret = secrets.token_bytes(SECRET_BYTES)
        # What every answer sends: built once, as the descriptor never changes.
        self._rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        self.name = f"pdproto-arena-{os.getpid()}-{secrets.token_hex(16)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(16)
        self._held: list[socket.socket] = []
        self._prune_at = _PRUNE_AT
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="pdproto-arena", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            try:
                self._answer(conn)
            except OSError:
                conn.close()  # a client that vanished or stalled costs nothing but its socket

    def _answer(self, conn: socket.socket) -> None:
        # One deadline for the whole handover, not one per recv: a client sending a byte at a
        # time just inside a per-recv timeout would hold this single-threaded server for minutes.
        deadline = time.monotonic() + _HANDOVER_S
        hello = _recv_exact(conn, len(HELLO) + len(self.secret), deadline)
        if hello[:len(HELLO)] != HELLO or not hmac.compare_digest(hello[len(HELLO):], self.secret):
            conn.close()
            return
        _time_left(conn, deadline)
        conn.sendmsg([_ANSWER.pack(HELLO, self.size)], self._rights)
        conn.settimeout(None)
        self._hold(conn)

    def _hold(self, conn: socket.socket) -> None:
        """Keep ``conn`` open while this arena is (its prefill sees the hang-up when it closes)."""
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._held.append(conn)
            if len(self._held) < self._prune_at:
                return
            # Connections whose prefill went away are dropped as new ones arrive, in batches: polling
            # every held connection on every handover would cost each handover more than it does.
            gone = [c for c in self._held if _hung_up(c)]
            for c in gone:
                c.close()
            self._held = [c for c in self._held if c not in gone]
            self._prune_at = max(_PRUNE_AT, 2 * len(self._held))

    def close(self) -> None:
        """Stop listening and close every handed-over connection (prefills see the hang-up)."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, []
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=_HANDOVER_S + 1.0)
        for conn in held:
            conn.close()


@dataclass
class Lease:
    """The prefill side of a handed-over arena: the mapping and the connection that says it is alive."""

    mapping: mmap.mmap
    size: int
    """Bytes of the arena (its sealed size); the mapping covers what the registration uses."""
    sock: socket.socket
    pid: int
    """The decode process, from the socket's credentials."""

    def alive(self) -> bool:
        """False once the decode closed its end (it exited, or closed its executor)."""
        return not _hung_up(self.sock)

    def close(self) -> None:
        """Drop the connection and the mapping (the memory stays the decode's)."""
        self.sock.close()
        try:
            self.mapping.close()
        except BufferError:
            pass  # views still reference it; it is unmapped when the last one goes


def fetch(endpoint: registration_pb2.LocalEndpoint, need: int, *, timeout: float) -> Lease:
    """Connect to the decode's arena socket, receive and check its memfd, map ``need`` bytes of it.

    Raises ``InvalidFieldError`` for an endpoint or arena this prefill does not accept,
    ``RequestFailedError`` (PEER_GONE) when nothing listens on the socket, and
    ``DeadlineExceededError`` when the decode does not answer within ``timeout``.
    """
    _check_endpoint(endpoint)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd, pid = _handover(sock, endpoint, timeout)
        return _lease(sock, fd, pid, endpoint, need)
    except BaseException:
        sock.close()
        raise


def _check_endpoint(endpoint: registration_pb2.LocalEndpoint) -> None:
    """``InvalidFieldError`` for an endpoint this prefill does not connect to."""
    if not endpoint.socket:
        raise InvalidFieldError(f"{_FIELD}.socket", "required: the decode hands its arena over on a Unix "
                                "socket; a prefill no longer opens /dev/shm files by name (upgrade the decode)",
                                metadata={"arena": endpoint.arena_name})
    if not SOCKET_NAME.fullmatch(endpoint.socket):
        raise InvalidFieldError(f"{_FIELD}.socket", "not an arena socket name (pdproto-arena-<pid>-<32 hex>)",
                                metadata={"socket": endpoint.socket[:80]})
    if len(endpoint.secret) < 16:
        raise InvalidFieldError(f"{_FIELD}.secret", "at least 16 random bytes are required",
                                metadata={"bytes": len(endpoint.secret)})


def _lease(sock: socket.socket, fd: int, pid: int, endpoint: registration_pb2.LocalEndpoint, need: int) -> Lease:
    """Check the handed-over descriptor, map ``need`` bytes of it, and close it (the mapping stays)."""
    try:
        size = check(fd)
        if endpoint.size and endpoint.size != size:
            raise InvalidFieldError(f"{_FIELD}.size", f"the arena has {size} bytes, not {endpoint.size}",
                                    metadata={"size": endpoint.size, "arena": size})
        if need > size:
            raise InvalidFieldError("registration.kv_buffers",
                                    f"buffers reach byte {need} of a {size}-byte arena",
                                    metadata={"end": need, "arena": size})
        try:
            mapping = mmap.mmap(fd, need or size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:
            raise InvalidFieldError(_FIELD, f"the {need or size}-byte arena could not be mapped",
                                    metadata={"error": exc}) from exc
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed any more
    return Lease(mapping=mapping, size=size, sock=sock, pid=pid)


def _handover(sock: socket.socket, endpoint: registration_pb2.LocalEndpoint, timeout: float) -> tuple[int, int]:
    """(descriptor, decode pid) from the decode's socket."""
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + endpoint.socket)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise RequestFailedError("nothing listens on the decode's arena socket: the decode is gone or "
                                 "closed its executor", reason=Reason.PEER_GONE,
                                 metadata={"socket": endpoint.socket}) from exc
    except TimeoutError as exc:
        raise DeadlineExceededError("the decode's arena socket did not accept in time",
                                    reason=Reason.DEADLINE_EXCEEDED,
                                    metadata={"socket": endpoint.socket, "timeout_s": timeout}) from exc
    # The process at the other end of the connected socket; it must be the endpoint's.
    pid = int(_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0])
    if endpoint.pid and endpoint.pid != pid:
        raise InvalidFieldError(f"{_FIELD}.pid", f"the arena socket belongs to process {pid}, not {endpoint.pid}",
                                metadata={"pid": endpoint.pid, "socket_pid": pid})
    try:
        sock.sendall(HELLO + endpoint.secret)
        # The answer's header and up to four descriptors (one is expected; more are refused).
        msg, ancdata, flags, _ = sock.recvmsg(_ANSWER.size, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC)
    except TimeoutError as exc:
        raise DeadlineExceededError("the decode did not hand its arena over in time", reason=Reason.DEADLINE_EXCEEDED,
                                    metadata={"socket": endpoint.socket, "timeout_s": timeout}) from exc
    except OSError as exc:
        raise RequestFailedError("the decode's arena socket failed", reason=Reason.PEER_GONE,
                                 metadata={"socket": endpoint.socket, "error": exc}) from exc
    fd = _received(msg, ancdata, flags, endpoint)
    sock.settimeout(None)
    return fd, pid


def _received(msg: bytes, ancdata: list[tuple[int, int, bytes]], flags: int,
              endpoint: registration_pb2.LocalEndpoint) -> int:
    """The one descriptor the decode's answer carries; ``InvalidFieldError`` for any other answer."""
    fds = _descriptors(ancdata)
    if len(msg) != _ANSWER.size or _ANSWER.unpack(msg)[0] != HELLO or len(fds) != 1 or flags & _CTRUNC:
        for fd in fds:
            os.close(fd)
        if not msg:
            raise InvalidFieldError(f"{_FIELD}.secret", "the decode's arena socket refused the secret",
                                    metadata={"socket": endpoint.socket})
        raise InvalidFieldError(_FIELD, "the decode's arena socket did not hand over exactly one descriptor",
                                metadata={"socket": endpoint.socket, "descriptors": len(fds)})
    return fds[0]


def _descriptors(ancdata: list[tuple[int, int, bytes]]) -> array.array[int]:
    """Every descriptor an ``SCM_RIGHTS`` message carried (each now open in this process)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return fds


def check(fd: int) -> int:
    """The arena's size if ``fd`` is a usable arena; ``InvalidFieldError`` naming what is wrong otherwise."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a directory" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise InvalidFieldError(_FIELD, f"the arena is {kind}, not a sealed memfd", metadata={"mode": oct(st.st_mode)})
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise InvalidFieldError(_FIELD, "the arena is not a memfd (it cannot carry seals)",
                                metadata={"error": exc}) from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise InvalidFieldError(_FIELD, "the arena must be sealed with F_SEAL_SHRINK, F_SEAL_GROW and "
                                "F_SEAL_SEAL, so it can never shrink under the prefill",
                                metadata={"seals": hex(seals)})
    if seals & _WRITE_SEALS:
        raise InvalidFieldError(_FIELD, "the arena is sealed against writes", metadata={"seals": hex(seals)})
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidFieldError(_FIELD, "the arena descriptor is not open for reading and writing")
    if st.st_size == 0:
        raise InvalidFieldError(_FIELD, "the arena is empty")
    if st.st_blksize != mmap.PAGESIZE:
        # A huge-page memfd faults SIGBUS when the huge-page pool runs dry.
        raise InvalidFieldError(_FIELD, "the arena is on huge pages; use an ordinary memfd",
                                metadata={"block": st.st_blksize})
    return st.st_size


def _time_left(conn: socket.socket, deadline: float) -> None:
    """Give ``conn``'s next call what is left until ``deadline``; TimeoutError once nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the client did not complete the handover in time")
    conn.settimeout(left)


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes (fewer if the client closes), all received before ``deadline`` (else TimeoutError)."""
    buf = b""
    while len(buf) < n:
        _time_left(conn, deadline)
        part = conn.recv(n - len(buf))
        if not part:
            break
        buf += part
    return buf


_GONE = select.POLLHUP | select.POLLERR | select.POLLRDHUP


def _hung_up(sock: socket.socket) -> bool:
    """True when the other end closed or sent something (which the protocol never does after a
    handover), or this end was closed."""
    if sock.fileno() < 0:
        return True  # closed here (Lease.close): nothing can come through it any more
    poller = select.poll()
    poller.register(sock, _GONE | select.POLLIN)
    try:
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


__all__ = ["ArenaServer", "HELLO", "Lease", "REQUIRED_SEALS", "SOCKET_NAME", "check", "create", "fetch"]
