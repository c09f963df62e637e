"""A hand-driven gRPC ``Session`` call, for tests that send exactly the messages an attacker would."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from pdproto.rpc import error_from_rpc
from pdproto.errors import PdprotoError
from pdproto.v1 import handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc, session_pb2

_CLOSE = object()


class RawSession:
    """One Session call on a channel of its own: ``send`` what a test writes, ``read`` what comes back."""

    def __init__(self, target: str, *, timeout: float = 30.0) -> None:
        self.channel = grpc.insecure_channel(target)
        self._outgoing: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._call = hs_grpc.HandshakeServiceStub(self.channel).Session(self._requests(), timeout=timeout)
        self.error: PdprotoError | None = None
        """The status the call ended with (None while open, or when it ended OK)."""

    @classmethod
    def opening(cls, target: str, first: hs.SessionRequest) -> RawSession:
        """A call that sent ``first`` (a session's opening message)."""
        raw = cls(target)
        raw.send(first)
        return raw

    def _requests(self) -> Iterator[hs.SessionRequest]:
        while True:
            item = self._outgoing.get()
            if item is _CLOSE:
                return
            assert isinstance(item, hs.SessionRequest)
            yield item

    def send(self, message: hs.SessionRequest) -> None:
        """Queue one request on the call."""
        self._outgoing.put(message)

    def read(self) -> hs.SessionResponse | None:
        """The next response, or None once the call ended (its status, when not OK, in ``error``)."""
        try:
            response: hs.SessionResponse = next(self._call)
            return response
        except StopIteration:
            return None
        except grpc.RpcError as exc:
            if self.error is None and exc.code() is not grpc.StatusCode.CANCELLED:
                self.error = error_from_rpc(exc)
            return None

    def close(self) -> None:
        """Cancel the call (the server keeps the session for a resume) and close the channel."""
        self._outgoing.put(_CLOSE)
        self._call.cancel()
        self.channel.close()


def open_request(peer_id: str, credential: bytes, resume: str = "") -> hs.SessionRequest:
    """A first message opening (or resuming) a session."""
    return hs.SessionRequest(open=session_pb2.SessionOpen(peer_id=peer_id, peer_credential=credential,
                                                          resume_session_id=resume))


def ended(raw: RawSession) -> PdprotoError:
    """The typed error the server ended the call with (every response before it is skipped)."""
    while raw.read() is not None:
        pass
    assert raw.error is not None, "the call ended OK, not with an error"
    return raw.error


__all__ = ["RawSession", "ended", "open_request"]
