"""The blocking client: the unary calls on a channel of its own, sessions on the shared loop thread."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from pdproto.rpc import ChannelConfig, error_from_rpc
from pdproto.session import StatusBook
from pdproto.v1 import (
    handshake_service_pb2 as hs,
    handshake_service_pb2_grpc as hs_grpc,
    registration_pb2,
    server_info_pb2,
    transfer_pb2,
)

from ._async import _AsyncCore, _deadline_error
from ._rpc import TERMINAL_STATES, Credentials, RetryConfig, abort_request, describe_request, make_settings, next_try
from pdproto.rpc.loop import LoopThread

_T = TypeVar("_T")


class HandshakeClient:
    """Blocking client; reuse one per prefill rank (the channel is long-lived).

    Its sessions run on one event loop thread the process's blocking clients share.
    """

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None,
                 session: bool = True) -> None:
        self._s, secure = make_settings(target, token, root_cert, timeout, retry, channel, server_name, tls)
        if secure:
            creds = grpc.ssl_channel_credentials(root_certificates=self._s.root_cert)
            self._channel = grpc.secure_channel(target, creds, options=self._s.options())
        else:
            self._channel = grpc.insecure_channel(target, options=self._s.options())
        self._stub = hs_grpc.HandshakeServiceStub(self._channel)
        self._creds = Credentials()
        self._aio = _AsyncCore(self._s, secure, self._creds, session)
        self._loop: LoopThread | None = None

    def _run(self, coro_fn: Callable[[], Any]) -> Any:
        if self._loop is None:
            self._loop = LoopThread.shared()
        return self._loop.run(coro_fn())

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none): hand it to another process."""
        return self._creds.of(peer_id, None)

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._creds.adopt(peer_id, credential)

    def _call(self, fn: Callable[..., _T], request: Any, timeout: float | None) -> _T:
        """One unary call with a deadline, retried only on UNAVAILABLE inside that deadline."""
        budget = self._s.timeout if timeout is None else timeout
        end = time.monotonic() + budget
        backoffs = self._s.backoffs()
        while True:
            try:
                return fn(request, timeout=max(end - time.monotonic(), 0.001), metadata=self._s.metadata())
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                delay = next_try(error, backoffs)
                if delay is None or time.monotonic() + delay >= end:
                    raise error from exc
                time.sleep(delay)

    def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        return self._call(self._stub.GetServerInfo, hs.GetServerInfoRequest(), timeout).info

    def describe(self, *, peer_id: str = "", request_limit: int = 0, include_finished: bool = False,
                 timeout: float | None = None, credential: bytes | None = None) -> hs.DescribeResponse:
        """The server's state for operators: peers, open requests, limits (``pdproto status``).

        ``peer_id``'s credential (given, or kept from its Register) goes along, so that peer is
        shown in full; other peers' rooms and engine identities need the operator token.
        """
        return self._call(self._stub.Describe, describe_request(peer_id, request_limit, include_finished,
                                                                self._creds.of(peer_id, credential)), timeout)

    def evict(self, peer_id: str, *, timeout: float | None = None) -> int:
        """Drop another peer, as the operator (the client's token must be the operator token);
        returns how many open requests were failed with PEER_GONE (``pdproto evict``)."""
        return int(self._call(self._stub.Evict, hs.EvictRequest(peer_id=peer_id), timeout).failed_requests)

    def register(self, registration: registration_pb2.KvRegistration, *,
                 timeout: float | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential); raises ``TopologyError`` (or another class)
        on rejection."""
        return self._creds.keep(self._call(self._stub.Register, hs.RegisterRequest(registration=registration),
                                           timeout))

    def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                        timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination; returns the status right after."""
        if not self._aio.use_session:
            req = hs.SubmitTransferRequest(peer_id=peer_id, transfer=transfer,
                                           peer_credential=self._creds.of(peer_id, credential))
            return self._call(self._stub.SubmitTransfer, req, timeout).status
        out: transfer_pb2.TransferStatus = self._run(
            lambda: self._aio.submit(peer_id, transfer, timeout, credential))
        return out

    def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                     credential: bytes | None = None) -> Iterator[transfer_pb2.TransferStatus]:
        """Stream status changes (first the current state of matching requests) until the deadline.

        Raises ``DeadlineExceededError`` at the deadline (``UnavailableError`` when the session's stream
        is broken then); ends when the peer is removed.
        """
        budget = self._s.timeout if timeout is None else timeout
        end = time.monotonic() + budget
        wanted = frozenset(rooms)
        s = self._run(lambda: self._aio.session(peer_id, credential, budget)) if self._aio.use_session else None
        if s is None:
            yield from self._watch_unary(peer_id, wanted, end, credential)
            return
        assert self._loop is not None
        items: queue.SimpleQueue[transfer_pb2.TransferStatus | None] = queue.SimpleQueue()
        stop = self._loop.call(lambda: s.watch(wanted, items.put))
        try:
            while True:
                try:
                    item = items.get(timeout=max(end - time.monotonic(), 0.0))
                except queue.Empty:
                    # UNAVAILABLE with the cause when the stream was broken at the deadline (a dead prefill).
                    raise self._loop.call(lambda: s.late_error("the watch reached its deadline")) from None
                if item is None:
                    return
                yield item
        finally:
            if self._loop is not None:
                self._loop.call(stop)

    def _watch_unary(self, peer_id: str, rooms: frozenset[int], end: float,
                     credential: bytes | None) -> Iterator[transfer_pb2.TransferStatus]:
        """WatchStatus, re-opened on UNAVAILABLE within the deadline; repeats are dropped."""
        req = hs.WatchStatusRequest(peer_id=peer_id, rooms=list(rooms),
                                    peer_credential=self._creds.of(peer_id, credential))
        book = StatusBook()
        backoffs = self._s.backoffs()
        while True:
            call = self._stub.WatchStatus(req, timeout=max(end - time.monotonic(), 0.001),
                                          metadata=self._s.metadata())
            try:
                for item in call:
                    if book.update(item.status):
                        yield item.status
                return
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                delay = next_try(error, backoffs)
                if delay is None or time.monotonic() + delay >= end:
                    raise error from exc
            finally:
                call.cancel()
            time.sleep(delay)

    def wait_for(self, peer_id: str, rooms: Iterable[int], *, timeout: float | None = None,
                 credential: bytes | None = None) -> dict[int, transfer_pb2.TransferStatus]:
        """Block until every room is SUCCESS or FAILED; returns the terminal statuses."""
        wanted = list(rooms)
        if self._aio.use_session:
            done: dict[int, transfer_pb2.TransferStatus] = self._run(
                lambda: self._aio.wait_for(peer_id, wanted, timeout, credential))
            return done
        pending = set(wanted)
        done = {}
        for status in self.watch_status(peer_id, pending, timeout=timeout, credential=credential):
            if status.state in TERMINAL_STATES and status.room in pending:
                done[status.room] = status
                pending.discard(status.room)
                if not pending:
                    return done
        raise _deadline_error(pending)

    def abort(self, peer_id: str, room: int, generation: int | None = None, *,
              timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation; returns once its in-flight chunks drained."""
        if not self._aio.use_session:
            req = abort_request(peer_id, self._creds.of(peer_id, credential), room, generation)
            return self._call(self._stub.Abort, req, timeout).ack
        ack: transfer_pb2.AbortAck = self._run(
            lambda: self._aio.abort(peer_id, room, generation, timeout, credential))
        return ack

    def deregister(self, peer_id: str, *, timeout: float | None = None, credential: bytes | None = None) -> int:
        """Remove this peer; returns how many open requests were failed with PEER_GONE."""
        req = hs.DeregisterRequest(peer_id=peer_id, peer_credential=self._creds.of(peer_id, credential))
        resp = self._call(self._stub.Deregister, req, timeout)
        if self._loop is not None:
            self._loop.call(lambda: self._aio.forget(peer_id))
        self._creds.forget(peer_id)
        return int(resp.failed_requests)

    def close(self) -> None:
        """Close the sessions and the channels."""
        if self._loop is not None:
            self._run(self._aio.close)
            self._loop = None
        self._channel.close()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["HandshakeClient"]
