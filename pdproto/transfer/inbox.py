"""The prefill's inbox: local arenas that decodes push ahead of their Register (``arena.ArenaServer.push``).

The prefill publishes the inbox in ``PrefillServerInfo.local_inbox`` (its abstract socket
and pid). A push is one message on a fresh connection: ``arena.PUSH``, the registration's
secret and the memfd. ``Inbox.claim`` hands a Register the push filed under its secret,
checked exactly as a fetched arena (``arena.check``); the connection stays open as the
lease's liveness channel. What a push may hold is bounded (``MAX_PUSHED``,
``MAX_PUSHED_PER_PID``, ``PUSH_TTL_S``), since any local process can connect.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from pdproto.errors import InvalidFieldError
from pdproto.v1 import registration_pb2, server_info_pb2

# The wire format and the checks are the arena's: a push carries what a fetch would receive.
from .arena import (_CTRUNC, _FIELD, _MAX_SECRET, _PUSH, PUSH, Lease, _check_endpoint, _descriptors, _lease, check,
                    peer_pid)

MAX_PUSHED = 64
"""Pushes an inbox holds unclaimed; more are closed (their decodes' Registers fetch instead)."""
MAX_PUSHED_PER_PID = 8
"""Unclaimed pushes one process may have waiting, so one process cannot take every place."""
PUSH_TTL_S = 10.0
"""How long a push waits for its Register before the inbox closes it."""


@dataclass
class _Pushed:
    """A decode's push: its connection, then (once read) the arena descriptor it carried."""

    sock: socket.socket
    pid: int
    at: float
    fd: int = -1
    checked: int | InvalidFieldError | None = None
    """What ``check`` said of the descriptor when it was read: its size, or why it is refused. It
    cannot change after: the seals it requires fix the size and forbid new seals, and the access
    mode of an open descriptor is fixed."""
    watched: bool = False
    """A loop reader waits for the message (it came after the connection)."""

    def close(self) -> None:
        """Drop the descriptor and the connection (the decode sees the hang-up)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.sock.close()


class Inbox:
    """The prefill side of a push: arenas decodes hand over ahead of their Register, found by secret.

    A decode's push completes (connect and send) before it sends Register, so ``claim`` finds
    it by accepting and reading what waits; on an event loop (``watch``) pushes are read as
    they arrive, while the Register is still on its way. Pushes are bounded in number, per
    process and in age; one that does not fit is closed, and its Register fetches instead.
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
        self._unread: dict[int, _Pushed] = {}
        """Accepted connections whose push has not arrived yet, by descriptor."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.refused = 0
        """Pushes closed unclaimed: malformed, over a bound, or not claimed within ``PUSH_TTL_S``."""

    def endpoint(self) -> server_info_pb2.LocalInbox:
        """What ``PrefillServerInfo.local_inbox`` publishes."""
        return server_info_pb2.LocalInbox(socket=self.name, pid=os.getpid())

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read pushes on ``loop`` as they arrive (call on that loop's thread); a later loop takes over
        only once the first is closed (a server started again in the same process)."""
        with self._lock:
            if self._closed or (self._loop is not None and not self._loop.is_closed()):
                return
            for pushed in self._unread.values():
                pushed.watched = False  # the closed loop's readers went with it
            self._loop = loop
            loop.add_reader(self._listener.fileno(), self._acceptable)
            for fd in self._unread:
                loop.add_reader(fd, self._readable, fd)
                self._unread[fd].watched = True

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
            return _lease(pushed.sock, fd, pushed.pid, endpoint, need, pushed.checked)
        except BaseException:
            pushed.sock.close()  # _lease closed the descriptor
            raise

    def _acceptable(self) -> None:
        """The loop's callback for the listener: accept one connection (the loop calls again while
        more wait, so no call ends in a refused ``accept``)."""
        with self._lock:
            if not self._closed:
                self._accept(time.monotonic(), most=1)

    def _readable(self, fd: int) -> None:
        """The loop's callback for an accepted connection: read its push."""
        with self._lock:
            pushed = self._unread.get(fd)
            if pushed is not None:
                self._read(pushed)

    def _take(self, now: float) -> None:
        """Read the pushes that arrived since, and accept new ones."""
        for pushed in list(self._unread.values()):
            self._read(pushed)
        self._accept(now)

    def _sweep(self, now: float) -> None:
        """Close pushes not claimed within ``PUSH_TTL_S``."""
        if not self._unread and not self._pushed:
            return
        for pushed in [*self._unread.values(), *(p for v in self._pushed.values() for p in v)]:
            if now - pushed.at >= PUSH_TTL_S:
                self._refuse(pushed)
        self._pushed = {secret: kept for secret, waiting in self._pushed.items()
                        if (kept := [p for p in waiting if p.sock.fileno() >= 0])}

    def _accept(self, now: float, most: int = 2 * MAX_PUSHED) -> None:
        """Accept what waits, up to ``most`` (so a process connecting in a loop cannot keep this going),
        reading each push that came with its connection."""
        self._sweep(now)
        for _ in range(most):
            try:
                conn, _ = self._listener.accept()
                conn.setblocking(False)
                pid = peer_pid(conn)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed under us (close())
            pushed = _Pushed(sock=conn, pid=pid, at=now)
            if len(self._unread) + sum(map(len, self._pushed.values())) >= MAX_PUSHED_PER_PID and \
                    self._over_bounds(pid):  # under that count, no bound can be reached: skip the walk
                self.refused += 1
                conn.close()
                continue
            self._unread[conn.fileno()] = pushed
            self._read(pushed)
            if self._loop is not None and conn.fileno() in self._unread:  # a decode between connect and send
                self._loop.add_reader(conn.fileno(), self._readable, conn.fileno())
                pushed.watched = True

    def _over_bounds(self, pid: int) -> bool:
        """True when the inbox holds ``MAX_PUSHED`` pushes, or ``MAX_PUSHED_PER_PID`` from ``pid``."""
        held = [*self._unread.values(), *(p for v in self._pushed.values() for p in v)]
        return len(held) >= MAX_PUSHED or sum(p.pid == pid for p in held) >= MAX_PUSHED_PER_PID

    def _read(self, pushed: _Pushed) -> None:
        """Read ``pushed``'s message if it has come: file it by secret, or refuse it if malformed."""
        try:
            msg, ancdata, flags, _ = pushed.sock.recvmsg(_PUSH.size + _MAX_SECRET, socket.CMSG_SPACE(4 * 4),
                                                         socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return  # a decode between its connect and its send: read when it sends
        except OSError:
            msg, ancdata, flags = b"", [], 0
        self._forget(pushed)
        fds = _descriptors(ancdata)
        ok = len(msg) >= _PUSH.size and len(fds) == 1 and not flags & _CTRUNC
        if ok:
            magic, length = _PUSH.unpack_from(msg)
            ok = magic == PUSH and 16 <= length <= _MAX_SECRET and len(msg) == _PUSH.size + length
        if not ok:
            for fd in fds:
                os.close(fd)
            self._refuse(pushed)
            return
        pushed.fd = fds[0]  # the socket stays non-blocking: the lease only polls it for the hang-up
        try:
            pushed.checked = check(pushed.fd)  # here, while the Register is still on its way
        except InvalidFieldError as exc:
            pushed.checked = exc
        self._pushed.setdefault(msg[_PUSH.size:], []).append(pushed)

    def _forget(self, pushed: _Pushed) -> None:
        """Stop waiting for ``pushed``'s message."""
        fd = pushed.sock.fileno()
        self._unread.pop(fd, None)
        if pushed.watched and self._loop is not None:
            self._loop.remove_reader(fd)
            pushed.watched = False

    def _refuse(self, pushed: _Pushed) -> None:
        self._forget(pushed)
        pushed.close()
        self.refused += 1

    def close(self) -> None:
        """Stop listening and close every unclaimed push."""
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
            for pushed in [*self._unread.values(), *(p for v in self._pushed.values() for p in v)]:
                self._forget(pushed)
                pushed.close()
            self._pushed.clear()
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
