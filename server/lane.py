"""The session lane: the Session stream over length-prefixed frames on a plain TCP (or TLS) socket.

gRPC's Python stack costs a session about twice pdproto's own work per message
(docs/protocol.md, sections 2b and 2c). The lane carries the same ``SessionRequest`` and
``SessionResponse`` messages through the same ``SessionHub``, so numbering, windows,
resume and credentials are the session's, not the lane's. What the lane adds is the
framing, the bearer token in ``SessionOpen`` (no call metadata here), and the limits a
listening socket needs before anyone has authenticated: an open deadline and a cap on
connections that have not opened a session yet.

The framing (``PREFACE``, length-prefixed frames, the ``end`` frame) is in
``pdproto.client_lane``, which both ends share.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc.aio

from pdproto.client_lane import HIGH_WATER, PREFACE, FrameReader, keepalive, write_frame
from pdproto.errors import AuthError, DeadlineExceededError, PdprotoError, Reason
from pdproto.v1 import handshake_service_pb2 as hs, session_pb2

from ._status import command_error, tolerant
from .session import SessionHub

log = logging.getLogger("pdproto_server.lane")

_parse = tolerant(hs.SessionRequest.FromString, "pdproto.v1.SessionRequest")
"""A request, or ``Malformed`` (the hub answers it typed), as the gRPC service's deserializer does."""

OPEN_LIMIT = 64 << 10
"""Bytes a connection's first frame may have: SessionOpen is small, and nobody is authenticated yet
(64 unopened connections then hold 4 MiB, not 64 times ``--max-message-bytes``)."""


class LaneContext:
    """What ``SessionHub.serve`` uses of a gRPC stream context (``read``, ``write``), over one connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, token: str | None,
                 max_bytes: int, open_by: float, on_open: Callable[[], None]) -> None:
        self.frames = FrameReader(reader)
        self.writer = writer
        self.token = token
        self.max_bytes = max_bytes
        self.open_by = open_by
        """Loop time by which the first message must have arrived."""
        self.opened = False
        self.answered = False
        """A response went out: the session opened (SessionOpened is always the first)."""
        self.on_open = on_open
        """Called once the first message arrived (whatever it holds): the connection stops counting as unopened."""

    async def read(self) -> object:
        """The next request (``Malformed`` if it does not parse), or ``grpc.aio.EOF``."""
        if self.opened:
            return _request(await self.frames.next(self.max_bytes))
        try:
            async with asyncio.timeout_at(self.open_by):
                body = await self.frames.next(min(self.max_bytes, OPEN_LIMIT))
        except TimeoutError:
            raise DeadlineExceededError("no SessionOpen arrived in time after connecting to the session lane",
                                        reason=Reason.DEADLINE_EXCEEDED) from None
        message = _request(body)
        self.opened = True
        self.on_open()
        if self.token is not None and message is not grpc.aio.EOF:
            # The token comes before anything else is looked at, as the gRPC interceptor checks it.
            presented = message.open.bearer_token if isinstance(message, hs.SessionRequest) else ""
            if not presented:
                raise AuthError("missing bearer token (SessionOpen.bearer_token)")
            if not hmac.compare_digest(presented.encode(), self.token.encode()):
                raise AuthError("invalid bearer token")
        return message

    async def write(self, message: hs.SessionResponse) -> None:
        """Send one response; waits only while the peer has more than ``HIGH_WATER`` bytes unread."""
        if self.writer.is_closing():
            raise ConnectionResetError("the session lane connection is closed")
        self.answered = True
        write_frame(self.writer, message)
        if self.writer.transport.get_write_buffer_size() > HIGH_WATER:
            await self.writer.drain()


def _request(body: bytes | None) -> object:
    """A frame's request, or ``grpc.aio.EOF`` when the connection ended."""
    return grpc.aio.EOF if body is None else _parse(body)


class SessionLane:
    """The lane's listening socket and its connections, each served by ``SessionHub.serve``."""

    def __init__(self, hub: SessionHub, *, token: str | None, max_bytes: int, open_timeout: float = 10.0,
                 max_unopened: int = 64) -> None:
        self.hub = hub
        self.token = token
        self.max_bytes = max_bytes
        self.open_timeout = open_timeout
        """Seconds a new connection has to send the preface and SessionOpen."""
        self.max_unopened = max_unopened
        """Connections without a session at once; more are closed on arrival (nobody authenticated holds them)."""
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        """Connections that have not opened a session: counted against ``max_unopened``, and a
        shutdown closes them at once."""
        self._warned_at = float("-inf")
        self._tls: ssl.SSLContext | None = None

    async def start(self, address: str, tls: ssl.SSLContext | None) -> int:
        """Listen on ``address`` ("host:port", port 0 picks one); returns the bound port."""
        host, _, port = address.rpartition(":")
        bind = host.strip("[]") or None
        # TLS starts inside _handle, not in the listener: a connection still in its handshake then
        # counts against max_unopened, and the open deadline covers the handshake too.
        self._tls = tls
        self._server = await asyncio.start_server(self._handle, bind, int(port), limit=1 << 16)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self, grace: float) -> None:
        """Stop listening; connections still open after ``grace`` seconds are cut."""
        if self._server is not None:
            self._server.close()
        for task in self._waiting:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _turned_away(self, why: str) -> None:
        self.hub.core.metrics.lane_turned_away.labels(why=why).inc()

    def _opened(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._waiting.discard(task)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        context: LaneContext | None = None
        try:
            if len(self._waiting) >= self.max_unopened:
                now = asyncio.get_running_loop().time()
                if now - self._warned_at >= 10.0:  # a crowd of connections must not flood the log too
                    self._warned_at = now
                    log.warning("session lane: %d connections have not opened a session; closing new ones "
                                "(the last from %s)", len(self._waiting), writer.get_extra_info("peername"))
                self._turned_away("crowded")
                return
            self._waiting.add(task)
            keepalive(writer.get_extra_info("socket"))
            open_by = asyncio.get_running_loop().time() + self.open_timeout
            try:
                async with asyncio.timeout_at(open_by):
                    if self._tls is not None:
                        await writer.start_tls(self._tls)
                    preface = await reader.readexactly(len(PREFACE))
            except TimeoutError:
                self._turned_away("silent")
                return
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                return  # it left, or spoke no TLS
            if preface != PREFACE:
                log.info("session lane: %s did not send the lane preface (a gRPC client on the wrong port?)",
                         writer.get_extra_info("peername"))
                self._turned_away("preface")
                return
            context = LaneContext(reader, writer, token=self.token, max_bytes=self.max_bytes, open_by=open_by,
                                  on_open=self._opened)
            await self.hub.serve(context, lane=True)
        except PdprotoError as exc:
            if context is None or not context.answered:  # its session never opened
                self._turned_away("silent" if exc.reason is Reason.DEADLINE_EXCEEDED else "refused")
            await _end(writer, command_error(exc))
        except (ConnectionError, ssl.SSLError):
            pass  # the peer went away: its session is kept for a resume (SessionHub.serve's finally)
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the listener
            log.exception("session lane: unexpected error")
            await _end(writer, command_error(PdprotoError("internal error in the session lane")))
        finally:
            self._tasks.discard(task)
            self._waiting.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()


async def _end(writer: asyncio.StreamWriter, error: session_pb2.CommandError) -> None:
    """Send the stream's last frame: why it ends."""
    with contextlib.suppress(Exception):
        write_frame(writer, hs.SessionResponse(end=error))
        async with asyncio.timeout(1.0):
            await writer.drain()


def server_tls(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A TLS server context from PEM bytes (the gRPC port's certificate and key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # ssl loads a chain only from files: a private directory, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="pdproto-lane-") as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert)
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        context.load_cert_chain(cert_path, key_path)
    return context


__all__ = ["LaneContext", "SessionLane", "server_tls"]
