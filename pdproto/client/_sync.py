"""The blocking client: ``AsyncHandshakeClient`` run on the process's shared loop thread."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from pdproto.rpc import ChannelConfig
from pdproto.rpc.loop import LoopThread
from pdproto.v1 import handshake_service_pb2 as hs, registration_pb2, server_info_pb2, transfer_pb2

from ._async import AsyncHandshakeClient
from ._rpc import CredentialReader, RetryConfig

_T = TypeVar("_T")


async def _next(items: AsyncIterator[_T]) -> _T | None:
    return await anext(items, None)


class HandshakeClient:
    """Blocking client; reuse one per prefill rank (the channel is long-lived), from any threads.

    Each method runs the ``AsyncHandshakeClient`` method of the same name on one event loop
    thread that the process's blocking clients share (``LoopThread.shared``), and waits for it.
    """

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None,
                 session: bool = True) -> None:
        self._async = AsyncHandshakeClient(target, token=token, root_cert=root_cert, tls=tls, timeout=timeout,
                                           retry=retry, channel=channel, server_name=server_name, session=session)
        self._loop = LoopThread.shared()

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none): hand it to another process."""
        return self._async.credential(peer_id)

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._async.adopt(peer_id, credential)

    def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        return self._loop.run(self._async.get_server_info(timeout=timeout))

    def describe(self, *, peer_id: str = "", request_limit: int = 0, include_finished: bool = False,
                 timeout: float | None = None, credential: bytes | None = None) -> hs.DescribeResponse:
        """The server's state for operators (as ``AsyncHandshakeClient.describe``; ``pdproto status``)."""
        return self._loop.run(self._async.describe(peer_id=peer_id, request_limit=request_limit,
                                                   include_finished=include_finished, timeout=timeout,
                                                   credential=credential))

    def evict(self, peer_id: str, *, timeout: float | None = None) -> int:
        """Drop another peer, as the operator; returns how many open requests failed (``pdproto evict``)."""
        return self._loop.run(self._async.evict(peer_id, timeout=timeout))

    def register(self, registration: registration_pb2.KvRegistration, *, timeout: float | None = None,
                 read_credential: CredentialReader | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential); raises ``TopologyError`` (or another class)
        on rejection (``read_credential``: as ``AsyncHandshakeClient.register``)."""
        return self._loop.run(self._async.register(registration, timeout=timeout, read_credential=read_credential))

    def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                        timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination; returns the status right after."""
        return self._loop.run(self._async.submit_transfer(peer_id, transfer, timeout=timeout, credential=credential))

    def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                     credential: bytes | None = None) -> Iterator[transfer_pb2.TransferStatus]:
        """Stream status changes (first the current state of matching requests) until the deadline.

        Raises ``DeadlineExceededError`` at the deadline (``UnavailableError`` when the session's stream
        is broken then); ends when the peer is removed. Closing the iterator early ends the watch.
        """
        statuses = self._async.watch_status(peer_id, rooms, timeout=timeout, credential=credential)
        try:
            while (status := self._loop.run(_next(statuses))) is not None:
                yield status
        finally:
            self._loop.run(statuses.aclose())

    def wait_for(self, peer_id: str, rooms: Iterable[int], *, timeout: float | None = None,
                 credential: bytes | None = None) -> dict[int, transfer_pb2.TransferStatus]:
        """Block until every room is SUCCESS or FAILED; returns the terminal statuses."""
        return self._loop.run(self._async.wait_for(peer_id, list(rooms), timeout=timeout, credential=credential))

    def abort(self, peer_id: str, room: int, generation: int | None = None, *,
              timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation; returns once its in-flight chunks drained."""
        return self._loop.run(self._async.abort(peer_id, room, generation, timeout=timeout, credential=credential))

    def deregister(self, peer_id: str, *, timeout: float | None = None, credential: bytes | None = None) -> int:
        """Remove this peer; returns how many open requests were failed with PEER_GONE."""
        return self._loop.run(self._async.deregister(peer_id, timeout=timeout, credential=credential))

    def close(self) -> None:
        """Close the sessions and the channel (closing again does nothing)."""
        self._loop.run(self._async.close())

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["HandshakeClient"]
