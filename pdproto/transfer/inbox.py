"""The prefill's inbox: local arenas that decodes push ahead of their Register (``arena.ArenaServer.push``).

The prefill publishes the inbox in ``PrefillServerInfo.local_inbox`` (its abstract socket
and pid). A push is one message: ``arena.PUSH``, the registration's secret and the memfd.
``Inbox.claim`` hands a Register the push filed under its secret, checked exactly as a
fetched arena (``arena.check``); the connection stays open as the lease's liveness channel.

A push starting ``arena.PUSH`` comes on a connection of its own, which the lease then takes.
One starting ``arena.LINKED_PUSH`` makes its connection the decode's link: the inbox keeps
reading it, each later push on it costs the decode one ``sendmsg`` (no socket, connect or
credentials), and each lease holds a copy of it (``dup``), so the decode closing the link,
or exiting, ends every lease it carried. The inbox publishes that it reads links
(``LocalInbox.links``); a decode sends ``LINKED_PUSH`` to no other.

What pushes may hold is bounded (``MAX_PUSHED``, ``MAX_PUSHED_PER_PID``, ``PUSH_TTL_S``),
since any local process can connect: a connection not yet read, a link (with its first
unclaimed push) and each other unclaimed push take a place.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdproto.errors import InvalidFieldError
from pdproto.v1 import registration_pb2, server_info_pb2

# The wire format and the checks are the arena's: a push carries what a fetch would receive.
from .arena import (_CTRUNC, _FIELD, _MAX_SECRET, _PUSH, LINKED_PUSH, PUSH, Lease, _check_endpoint, _descriptors,
                    _lease, check, peer_pid)

MAX_PUSHED = 64
"""Places an inbox gives (connections not yet read, links with their first unclaimed push, other
unclaimed pushes); past it new ones are closed (their decodes' Registers fetch instead)."""
MAX_PUSHED_PER_PID = 8
"""Places one process may take, so one process cannot take every place."""
PUSH_TTL_S = 10.0
"""How long a push waits for its Register (and a connection for its first push) before the inbox
closes it."""
_READS_PER_LINK = MAX_PUSHED_PER_PID + 1
"""Pushes a Register reads from one link while looking for its own: more than its process may have
waiting, and a bound, so a link that keeps sending cannot keep the reader going."""


@dataclass
class _Conn:
    """An accepted connection the inbox reads: one whose first push has not come, or a link."""

    sock: socket.socket
    pid: int
    at: float
    linked: bool = False
    """Its first push was ``LINKED_PUSH``: the inbox reads it as long as it is open."""
    watched: bool = False
    """A loop reader waits for its next push."""


@dataclass
class _Pushed:
    """A decode's push, read: the arena descriptor it carried, and the connection it came on."""

    sock: socket.socket
    """Its own connection, or (``linked``) the link it came on, which the inbox keeps."""
    pid: int
    at: float
    linked: bool
    fd: int = -1
    checked: int | InvalidFieldError | None = None
    """What ``check`` said of the descriptor when it was read: its size, or why it is refused. It
    cannot change after: the seals it requires fix the size and forbid new seals, and the access
    mode of an open descriptor is fixed."""

    def close(self) -> None:
        """Drop the descriptor and its own connection (the decode sees the hang-up), not a link."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.linked:
            self.sock.close()


class Inbox:
    """The prefill side of a push: arenas decodes hand over ahead of their Register, found by secret.

    A decode's push completes (connect or link, and send) before it sends Register, so
    ``claim`` finds it by accepting and reading what waits; on an event loop (``watch``)
    pushes are read as they arrive, while the Register is still on its way. Places are
    bounded in number, per process and (unless a link) in age; a push that does not fit is
    closed, and its Register fetches instead.
    """

    def __init__(self) -> None:
        """Listen on a fresh abstract socket named after this process."""
        self.name = f"pdproto-inbox-{os.getpid()}-{secrets.token_hex(16)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(MAX_PUSHED)
        self._listener.setblocking(False)
        self._pushed: dict[bytes, list[_Pushed]] = {}
        """Read pushes by secret, oldest first."""
        self._conns: dict[int, _Conn] = {}
        """Accepted connections the inbox reads (first push not come yet, or links), by descriptor."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.refused = 0
        """Pushes and connections closed unclaimed: malformed, over a bound, or not claimed (or sent on)
        within ``PUSH_TTL_S``."""

    def endpoint(self) -> server_info_pb2.LocalInbox:
        """What ``PrefillServerInfo.local_inbox`` publishes."""
        return server_info_pb2.LocalInbox(socket=self.name, pid=os.getpid(), links=True)

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read pushes on ``loop`` as they arrive (call on that loop's thread); a later loop takes over
        only once the first is closed (a server started again in the same process)."""
        with self._lock:
            if self._closed or (self._loop is not None and not self._loop.is_closed()):
                return
            for conn in self._conns.values():
                conn.watched = False  # the closed loop's readers went with it
            self._loop = loop
            loop.add_reader(self._listener.fileno(), self._acceptable)
            for fd, conn in self._conns.items():
                loop.add_reader(fd, self._readable, fd)
                conn.watched = True

    def claim(self, endpoint: registration_pb2.LocalEndpoint, need: int) -> Lease | None:
        """The lease of the arena pushed under ``endpoint.secret``, checked as ``fetch`` checks it;
        None when none was pushed. The same ``InvalidFieldError`` as ``fetch`` for a bad one."""
        _check_endpoint(endpoint)
        with self._lock:
            if self._closed:
                return None
            waiting = self._pushed.get(endpoint.secret)
            if not waiting and (self._loop is None or _running(self._loop)):
                # Not read yet (no loop watches, or its callback has not run): read what waits now.
                # Off the watching loop's thread the loop's readers are not ours to touch.
                self._take(time.monotonic())
                waiting = self._pushed.get(endpoint.secret)
            if not waiting:
                return None
            pushed = waiting.pop(0)
            if not waiting:
                del self._pushed[endpoint.secret]
        if endpoint.pid and endpoint.pid != pushed.pid:
            pushed.close()
            raise InvalidFieldError(f"{_FIELD}.pid", f"the arena was pushed by process {pushed.pid}, "
                                    f"not {endpoint.pid}", metadata={"pid": endpoint.pid, "pusher": pushed.pid})
        fd, pushed.fd = pushed.fd, -1
        try:
            # A link's lease holds a copy of it: the lease closing it leaves the link to later pushes.
            sock = pushed.sock.dup() if pushed.linked else pushed.sock
        except OSError as exc:
            os.close(fd)
            raise InvalidFieldError(_FIELD, "the pushed arena's connection could not be held",
                                    metadata={"error": exc}) from exc
        try:
            return _lease(sock, fd, pushed.pid, endpoint, need, pushed.checked, linked=pushed.linked)
        except BaseException:
            sock.close()  # _lease closed the descriptor
            raise

    def _acceptable(self) -> None:
        """The loop's callback for the listener: accept one connection (the loop calls again while
        more wait, so no call ends in a refused ``accept``)."""
        with self._lock:
            if not self._closed:
                self._accept(time.monotonic(), most=1)

    def _readable(self, fd: int) -> None:
        """The loop's callback for a connection: read its next push (the loop calls again while more wait)."""
        with self._lock:
            conn = self._conns.get(fd)
            if conn is not None:
                self._read(conn, time.monotonic())

    def _take(self, now: float) -> None:
        """Read the pushes that arrived since, and accept new ones."""
        for conn in list(self._conns.values()):
            self._drain(conn, now)
        self._accept(now)

    def _drain(self, conn: _Conn, now: float) -> None:
        """Read what waits on ``conn``: its push, or up to ``_READS_PER_LINK`` on a link."""
        for _ in range(_READS_PER_LINK):
            if not self._read(conn, now) or not conn.linked:
                return

    def _sweep(self, now: float) -> None:
        """Close pushes not claimed, and connections not sent on, within ``PUSH_TTL_S``."""
        if not self._conns and not self._pushed:
            return
        for conn in list(self._conns.values()):
            if not conn.linked and now - conn.at >= PUSH_TTL_S:
                self._drop(conn)
                self.refused += 1
        self._refuse_pushes(lambda pushed: now - pushed.at >= PUSH_TTL_S)

    def _refuse_pushes(self, which: Callable[[_Pushed], bool]) -> None:
        """Close the unclaimed pushes ``which`` picks, counted as refused."""
        kept: dict[bytes, list[_Pushed]] = {}
        for secret, waiting in self._pushed.items():
            for pushed in waiting:
                if which(pushed):
                    pushed.close()
                    self.refused += 1
                else:
                    kept.setdefault(secret, []).append(pushed)
        self._pushed = kept

    def _accept(self, now: float, most: int = 2 * MAX_PUSHED) -> None:
        """Accept what waits, up to ``most`` (so a process connecting in a loop cannot keep this going),
        reading each push that came with its connection."""
        self._sweep(now)
        for _ in range(most):
            try:
                sock, _ = self._listener.accept()
                sock.setblocking(False)
                pid = peer_pid(sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed under us (close())
            if self._full(pid):
                self.refused += 1
                sock.close()
                continue
            conn = self._conns[sock.fileno()] = _Conn(sock=sock, pid=pid, at=now)
            self._drain(conn, now)
            if self._loop is not None and sock.fileno() in self._conns:  # a decode between connect and send, or a link
                self._loop.add_reader(sock.fileno(), self._readable, sock.fileno())
                conn.watched = True

    def _full(self, pid: int, *, room: int = 1) -> bool:
        """True when fewer than ``room`` places are left to ``pid``: of ``MAX_PUSHED``, or of its
        ``MAX_PUSHED_PER_PID``; ``room=0`` asks whether what is filed already is over a bound."""
        upper = len(self._conns) + sum(map(len, self._pushed.values()))
        if upper + room <= min(MAX_PUSHED, MAX_PUSHED_PER_PID):
            return False  # no bound can be reached under that count: no walk
        taken, mine = self._taken(pid)
        return taken + room > MAX_PUSHED or mine + room > MAX_PUSHED_PER_PID

    def _taken(self, pid: int) -> tuple[int, int]:
        """Places taken in all, and by ``pid``: each connection the inbox reads, and each unclaimed push
        but a link's first, which waits in its link's place (one decode process with several
        executors links each, and each link's push must not cost it a second place)."""
        taken = len(self._conns)
        mine = sum(c.pid == pid for c in self._conns.values())
        riding: set[socket.socket] = set()
        for waiting in self._pushed.values():
            for pushed in waiting:
                if pushed.linked and pushed.sock not in riding:
                    riding.add(pushed.sock)
                else:
                    taken += 1
                    mine += pushed.pid == pid
        return taken, mine

    def _read(self, conn: _Conn, now: float) -> bool:
        """Read ``conn``'s next push if it has come: file it by secret, or refuse it if malformed; True when
        something was read (a push, a refusal or the hang-up)."""
        try:
            msg, ancdata, flags, _ = conn.sock.recvmsg(_PUSH.size + _MAX_SECRET, socket.CMSG_SPACE(4 * 4),
                                                       socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return False  # a decode between its connect and its send, or an idle link
        except OSError:
            msg, ancdata, flags = b"", [], 0
        fds = _descriptors(ancdata)
        magic, length = _PUSH.unpack_from(msg) if len(msg) >= _PUSH.size else (b"", 0)
        linked = magic == LINKED_PUSH
        # A link carries linked pushes only; a connection's own push is its only message.
        ok = (linked or (magic == PUSH and not conn.linked)) and len(fds) == 1 and not flags & _CTRUNC and \
            16 <= length <= _MAX_SECRET and len(msg) == _PUSH.size + length
        if not ok:
            for fd in fds:
                os.close(fd)
            if msg or fds or not conn.linked:
                self.refused += 1  # malformed (a link's hang-up is no refusal)
            # A stream that carried something malformed cannot be read on: the link ends, and with
            # it every lease it carried (the decode that sent it sees the hang-up).
            self._drop(conn, shut=True)
            return True
        if linked:
            conn.linked = True
        else:
            self._forget(conn)  # the connection is this push's own: the lease takes it
        pushed = _Pushed(sock=conn.sock, pid=conn.pid, at=now, linked=linked, fd=fds[0])
        waiting = self._pushed.setdefault(msg[_PUSH.size:], [])
        waiting.append(pushed)
        # A link's first unclaimed push waits in the link's place; each more takes a place of its own.
        if linked and self._full(conn.pid, room=0):
            waiting.pop()
            if not waiting:
                del self._pushed[msg[_PUSH.size:]]
            self.refused += 1
            pushed.close()
            return True
        try:
            pushed.checked = check(pushed.fd)  # here, while the Register is still on its way
        except InvalidFieldError as exc:
            pushed.checked = exc
        return True

    def _forget(self, conn: _Conn) -> None:
        """Stop reading ``conn``."""
        fd = conn.sock.fileno()
        self._conns.pop(fd, None)
        if conn.watched and self._loop is not None:
            self._loop.remove_reader(fd)
            conn.watched = False

    def _drop(self, conn: _Conn, *, shut: bool = False) -> None:
        """Stop reading ``conn`` and close it; ``shut`` ends the connection itself, copies held by leases too.

        A link's unclaimed pushes go with it: a lease needs the link as its liveness channel.
        """
        self._forget(conn)
        if conn.linked:
            self._refuse_pushes(lambda pushed: pushed.sock is conn.sock)
        if shut:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        conn.sock.close()

    def close(self) -> None:
        """Stop listening and close every unclaimed push (the leases keep their connections)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop = self._loop
        if loop is not None and not loop.is_closed() and not _running(loop):
            # The watching loop closes what it watches: a descriptor closed under a loop could be
            # reused before the loop forgets it.
            try:
                loop.call_soon_threadsafe(self._shut)
                return
            except RuntimeError:
                pass  # that loop closed meanwhile
        self._shut()

    def _shut(self) -> None:
        """``close``, on the watching loop's thread (or where no open loop watches)."""
        with self._lock:
            if self._loop is not None and self._loop.is_closed():
                self._loop = None
            for waiting in self._pushed.values():
                for pushed in waiting:
                    pushed.close()
            self._pushed.clear()
            for conn in list(self._conns.values()):
                self._drop(conn)
            if self._listener.fileno() >= 0:
                if self._loop is not None:
                    self._loop.remove_reader(self._listener.fileno())
                self._listener.close()


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """True when ``loop`` runs on this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


__all__ = ["MAX_PUSHED", "MAX_PUSHED_PER_PID", "PUSH_TTL_S", "Inbox"]
