"""A hand-driven session lane connection, for tests that write exactly the bytes an attacker would."""

from __future__ import annotations

import socket

from pdproto.client_lane import HEADER, PREFACE
from pdproto.v1 import handshake_service_pb2 as hs, session_pb2


class Raw:
    """A hand-driven lane connection: exactly the bytes a test writes."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    @classmethod
    def opening(cls, port: int, first: hs.SessionRequest) -> Raw:
        """A connection that sent the lane's preface and ``first`` (a session's opening frame)."""
        raw = cls(port)
        raw.send(PREFACE)
        raw.frame(first)
        return raw

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, message: hs.SessionRequest) -> None:
        body = message.SerializeToString()
        self.send(HEADER.pack(len(body)) + body)

    def read(self) -> hs.SessionResponse | None:
        """The next frame, or None when the server closed the connection."""
        head = self._exactly(HEADER.size)
        if head is None:
            return None
        body = self._exactly(HEADER.unpack(head)[0])
        assert body is not None
        return hs.SessionResponse.FromString(body)

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def open_request(peer_id: str, credential: bytes, token: str = "", resume: str = "") -> hs.SessionRequest:
    """A first frame opening (or resuming) a session."""
    return hs.SessionRequest(open=session_pb2.SessionOpen(peer_id=peer_id, peer_credential=credential,
                                                          bearer_token=token, resume_session_id=resume))


def ended(raw: Raw) -> session_pb2.CommandError:
    """The end frame the server closed the connection with."""
    last = raw.read()
    assert last is not None and last.HasField("end"), last
    assert raw.read() is None
    return last.end


__all__ = ["Raw", "ended", "open_request"]
