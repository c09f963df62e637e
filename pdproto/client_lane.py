"""The session lane's framing, and the client's end of a lane connection.

The lane carries a Session stream's ``SessionRequest`` and ``SessionResponse`` messages
over a plain TCP (or TLS) connection instead of a gRPC call: the client's 8-byte
``PREFACE``, then frames each way, each a 4-byte big-endian length and one message
(docs/protocol.md, section 2c). The bearer token travels in ``SessionOpen``; the
server's last frame carries ``end`` when it ends the stream for a reason.

``LaneCall`` has the shape of the grpc.aio call ``PeerSession`` drives (``write``,
``read``, ``cancel``), so the session's numbering, windows and resume are the same on
both. A server tells its lane's port in ``SessionOpened.lane_port``; ``PeerSession``
then resumes the session on the lane, and stays on gRPC if the lane cannot be reached
(and so do the client's other sessions: ``LaneDialer.unreachable``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from dataclasses import dataclass, field

import grpc.aio
from google.protobuf.message import DecodeError, Message

from pdproto.errors import MessageTooLargeError, UnavailableError
from pdproto.v1 import handshake_service_pb2 as hs

from .client_rpc import Settings, error_from_command

PREFACE = b"PDSL/1\r\n"
"""What a lane client sends first: a gRPC client or a stray connection is told apart at once."""
HEADER = struct.Struct(">I")
"""A frame's length prefix."""
HIGH_WATER = 1 << 20
"""Bytes queued on a connection above which a write waits for the peer to read (TCP flow control)."""


def keepalive(sock: socket.socket | None) -> None:
    """TCP keepalive on a lane socket: a peer whose host vanished is noticed in about half a minute."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class FrameReader:
    """Frames off a stream, taking whatever has arrived in one read.

    ``readexactly`` for the header and again for the body cost two awaits per frame; a
    read of what is buffered costs one per arrival, however many frames it holds (on the
    server, about 5 % of a request's CPU at 32 peers; docs/protocol.md, section 2c). Bytes
    read stay here between calls, so a call cancelled while waiting loses no frame.
    """

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self._buf = bytearray()
        self._ended = False

    async def next(self, max_bytes: int) -> bytes | None:
        """One frame's body, or None at the end of the stream; a length over ``max_bytes`` is refused unread."""
        buf = self._buf
        while True:
            want = HEADER.size
            if len(buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(buf)
                if size > max_bytes:
                    raise MessageTooLargeError(f"a session lane frame of {size} bytes exceeds the limit of "
                                               f"{max_bytes}", metadata={"bytes": size, "limit": max_bytes})
                want += size
                if len(buf) >= want:
                    body = bytes(buf[HEADER.size:want])
                    del buf[:want]
                    return body
            if self._ended:
                return None  # a frame cut short counts as the end, as a closed connection does
            try:
                data = await self.reader.read(max(want - len(buf), READ_BYTES))
            except ConnectionError:
                data = b""
            if not data:
                self._ended = True
            buf += data


READ_BYTES = 1 << 16
"""Bytes asked of the stream per read (it hands over what it has, up to this, or what a frame still needs)."""


def write_frame(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue one message as a frame."""
    data = message.SerializeToString()
    writer.write(HEADER.pack(len(data)) + data)


class LaneUnreachableError(UnavailableError):
    """The lane did not take a connection: the session goes on over gRPC."""


def lane_host(target: str) -> str | None:
    """The host of a ``host:port`` gRPC target (None for other forms: unix sockets, name resolvers)."""
    if "://" in target or target.startswith("unix:"):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass
class LaneDialer:
    """How a client reaches its server's lane: the host, TLS as on its channel, the token, the size limit.

    One per client, shared by its sessions: a port found unreachable is not tried again by the others.
    """

    host: str
    tls: ssl.SSLContext | None
    server_name: str | None
    token: str | None
    max_bytes: int
    connect_timeout: float
    unreachable: set[int] = field(default_factory=set)
    """Lane ports that took no connection right after the server named them (a firewall, a wrong forward)."""

    @classmethod
    def of(cls, s: Settings, secure: bool) -> LaneDialer | None:
        """The dialer for a client's settings, or None when its target names no host."""
        host = lane_host(s.target)
        if host is None:
            return None
        tls = None
        if secure:
            try:
                tls = ssl.create_default_context(cadata=s.root_cert.decode("ascii") if s.root_cert else None)
            except (ValueError, ssl.SSLError):
                return None  # not a PEM root: no lane; the gRPC channel reports the certificate, typed

        # asyncio takes a server name only with TLS.
        server_name = (s.server_name or host) if secure else None
        return cls(host, tls, server_name, s.token, s.channel.max_message_bytes, min(s.timeout, 3.0))

    def call(self, port: int) -> LaneCall:
        """A new (not yet connected) lane stream to ``port``."""
        return LaneCall(self, port)


class LaneCall:
    """One session stream on the lane, connected on its first write."""

    def __init__(self, dialer: LaneDialer, port: int) -> None:
        self.dialer = dialer
        self.port = port
        self._reader: FrameReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._answered = False

    async def _connect(self) -> asyncio.StreamWriter:
        d = self.dialer
        try:
            async with asyncio.timeout(d.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    d.host, self.port, ssl=d.tls, server_hostname=d.server_name, limit=1 << 16)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise LaneUnreachableError(f"the session lane at {d.host}:{self.port} took no connection: {exc!r}",
                                       metadata={"host": d.host, "port": self.port}) from exc
        keepalive(writer.get_extra_info("socket"))
        writer.write(PREFACE)
        self._reader = FrameReader(reader)
        self._writer = writer
        return writer

    async def write(self, request: hs.SessionRequest) -> None:
        """Send one request (the first one connects, and carries the token in its SessionOpen)."""
        writer = self._writer or await self._connect()
        if request.HasField("open") and self.dialer.token:
            request.open.bearer_token = self.dialer.token
        if writer.is_closing():
            raise UnavailableError("the session lane connection is closed")
        write_frame(writer, request)
        if writer.transport.get_write_buffer_size() > HIGH_WATER:
            try:
                await writer.drain()
            except ConnectionError as exc:
                raise UnavailableError(f"the session lane connection broke: {exc!r}") from exc

    async def read(self) -> object:
        """The next response, or ``grpc.aio.EOF`` when the connection ended without a reason.

        Raises the typed error the server ended the stream with (its ``end`` frame).
        """
        if self._reader is None:
            return grpc.aio.EOF
        try:
            if self._answered:
                body = await self._reader.next(self.dialer.max_bytes)
            else:
                body = await self._first()
        except MessageTooLargeError as exc:
            raise UnavailableError(f"the session lane sent an oversized frame: {exc.message}") from exc
        except LaneUnreachableError:
            raise  # an OSError too (a ConnectionError), but not a break: the lane is not there
        except OSError:  # TLS errors mid-stream: a break like any other
            return grpc.aio.EOF
        if body is None:
            return grpc.aio.EOF
        try:
            response = hs.SessionResponse.FromString(body)
        except DecodeError as exc:
            raise UnavailableError(f"the session lane sent a frame that is not a SessionResponse: {exc}") from exc
        if response.HasField("end"):
            raise error_from_command(response.end)
        return response

    async def _first(self) -> bytes | None:
        """The server's first frame, within the connect timeout: a port that takes connections but
        never answers (another service, a stuck middlebox) counts as unreachable, not as a wait forever."""
        assert self._reader is not None
        d = self.dialer
        try:
            async with asyncio.timeout(d.connect_timeout):
                body = await self._reader.next(d.max_bytes)
        except TimeoutError:
            raise LaneUnreachableError(f"the session lane at {d.host}:{self.port} did not answer within "
                                       f"{d.connect_timeout:g} s",
                                       metadata={"host": d.host, "port": self.port}) from None
        self._answered = True
        return body

    def cancel(self) -> None:
        """Close the connection (the server keeps the session for a resume)."""
        if self._writer is not None:
            self._writer.close()


__all__ = ["HEADER", "HIGH_WATER", "PREFACE", "FrameReader", "LaneCall", "LaneDialer", "LaneUnreachableError",
           "keepalive", "lane_host", "write_frame"]
