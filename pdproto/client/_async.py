"""The asyncio client, and the asyncio core both clients share (sessions by peer, unary calls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from pdproto.errors import PdprotoError
from pdproto.rpc import ChannelConfig, error_from_rpc
from pdproto.session import StatusBook
from pdproto.v1 import (
    handshake_service_pb2 as hs,
    handshake_service_pb2_grpc as hs_grpc,
    registration_pb2,
    server_info_pb2,
    session_pb2,
    transfer_pb2,
)

from ._rpc import (
    TERMINAL_STATES,
    Credentials,
    RetryConfig,
    Settings,
    abort_request,
    deadline_error,
    describe_request,
    make_settings,
    next_try,
)
from ._session import PeerSession, SessionUnsupportedError


def _aio_channel(s: Settings, secure: bool) -> grpc.aio.Channel:
    if secure:
        creds = grpc.ssl_channel_credentials(root_certificates=s.root_cert)
        return grpc.aio.secure_channel(s.target, creds, options=s.options())
    return grpc.aio.insecure_channel(s.target, options=s.options())


def _deadline_error(rooms: Iterable[int]) -> PdprotoError:
    return deadline_error("status stream ended before every room finished", rooms=sorted(rooms))


class _AsyncCore:
    """The asyncio half both clients share: sessions by peer, and the unary calls they fall back to."""

    def __init__(self, s: Settings, secure: bool, creds: Credentials, use_session: bool) -> None:
        self._s = s
        self._secure = secure
        self._creds = creds
        self.use_session = use_session
        self._channel: grpc.aio.Channel | None = None
        self._stub: hs_grpc.HandshakeServiceAsyncStub | None = None
        self._sessions: dict[str, PeerSession] = {}
        self._ending: set[PeerSession] = set()
        """Sessions of deregistered peers, still delivering their last statuses (closed with the client)."""

    @property
    def stub(self) -> hs_grpc.HandshakeServiceAsyncStub:
        """The aio stub (its channel is created on first use, on the running loop)."""
        if self._stub is None:
            self._channel = _aio_channel(self._s, self._secure)
            self._stub = hs_grpc.HandshakeServiceStub(self._channel)
        return self._stub

    async def call(self, fn: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        """One unary call with a deadline, retried only on UNAVAILABLE inside that deadline."""
        budget = self._s.timeout if timeout is None else timeout
        end = time.monotonic() + budget
        backoffs = self._s.backoffs()
        while True:
            try:
                return await fn(request, timeout=max(end - time.monotonic(), 0.001), metadata=self._s.metadata())
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                delay = next_try(error, backoffs)
                if delay is None or time.monotonic() + delay >= end:
                    raise error from exc
                await asyncio.sleep(delay)

    async def session(self, peer_id: str, credential: bytes | None, budget: float) -> PeerSession | None:
        """The peer's open session, or None when the unary calls must be used."""
        if not self.use_session:
            return None
        cred = self._creds.of(peer_id, credential)
        s = self._sessions.get(peer_id)
        if s is None or s.credential != cred:
            if s is not None:
                await s.close()
            s = self._sessions[peer_id] = PeerSession(self.stub, self._s, peer_id, cred)
        try:
            await s.open(budget)
        except SessionUnsupportedError:
            self.use_session = False
            return None
        return s

    async def submit(self, peer_id: str, transfer: transfer_pb2.TransferInfo, timeout: float | None,
                     credential: bytes | None) -> transfer_pb2.TransferStatus:
        budget = self._s.timeout if timeout is None else timeout
        s = await self.session(peer_id, credential, budget)
        if s is not None:
            out = s.outcome(await s.command(session_pb2.SessionCommand(submit=transfer), budget))
            assert isinstance(out, transfer_pb2.TransferStatus)
            return out
        req = hs.SubmitTransferRequest(peer_id=peer_id, transfer=transfer,
                                       peer_credential=self._creds.of(peer_id, credential))
        resp: hs.SubmitTransferResponse = await self.call(self.stub.SubmitTransfer, req, timeout)
        return resp.status

    async def abort(self, peer_id: str, room: int, generation: int | None, timeout: float | None,
                    credential: bytes | None) -> transfer_pb2.AbortAck:
        budget = self._s.timeout if timeout is None else timeout
        req = abort_request(peer_id, self._creds.of(peer_id, credential), room, generation)
        s = await self.session(peer_id, credential, budget)
        if s is not None:
            out = s.outcome(await s.command(session_pb2.SessionCommand(abort=req.abort), budget))
            assert isinstance(out, transfer_pb2.AbortAck)
            return out
        resp: hs.AbortResponse = await self.call(self.stub.Abort, req, timeout)
        return resp.ack

    async def watch_unary(self, peer_id: str, rooms: Iterable[int], timeout: float | None,
                          credential: bytes | None) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """WatchStatus, re-opened on UNAVAILABLE within the deadline; repeats are dropped."""
        wanted = list(rooms)
        end = time.monotonic() + (self._s.timeout if timeout is None else timeout)
        book = StatusBook()
        backoffs = self._s.backoffs()
        req = hs.WatchStatusRequest(peer_id=peer_id, rooms=wanted, peer_credential=self._creds.of(peer_id, credential))
        while True:
            call = self.stub.WatchStatus(req, timeout=max(end - time.monotonic(), 0.001), metadata=self._s.metadata())
            try:
                async for item in call:
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
            await asyncio.sleep(delay)

    async def wait_for(self, peer_id: str, rooms: Iterable[int], timeout: float | None,
                       credential: bytes | None) -> dict[int, transfer_pb2.TransferStatus]:
        pending = set(rooms)
        budget = self._s.timeout if timeout is None else timeout
        s = await self.session(peer_id, credential, budget)
        if s is not None:
            return await s.wait(pending, budget)
        done: dict[int, transfer_pb2.TransferStatus] = {}
        async for status in self.watch_unary(peer_id, pending, timeout, credential):
            if status.state in TERMINAL_STATES and status.room in pending:
                done[status.room] = status
                pending.discard(status.room)
                if not pending:
                    return done
        raise _deadline_error(pending)

    def forget(self, peer_id: str) -> None:
        """A deregistered peer: no new calls use its session; the server ends it once it sent everything."""
        s = self._sessions.pop(peer_id, None)
        if s is not None and s.error is None:
            self._ending.add(s)

    async def close(self) -> None:
        for s in [*self._sessions.values(), *self._ending]:
            await s.close()
        self._sessions.clear()
        self._ending.clear()
        if self._channel is not None:
            await self._channel.close()


class AsyncHandshakeClient:
    """asyncio client; create and use it on one event loop."""

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None,
                 session: bool = True) -> None:
        self._s, secure = make_settings(target, token, root_cert, timeout, retry, channel, server_name, tls)
        self._creds = Credentials()
        self._core = _AsyncCore(self._s, secure, self._creds, session)

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none)."""
        return self._creds.of(peer_id, None)

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._creds.adopt(peer_id, credential)

    async def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        resp: hs.GetServerInfoResponse = await self._core.call(self._core.stub.GetServerInfo,
                                                               hs.GetServerInfoRequest(), timeout)
        return resp.info

    async def describe(self, *, peer_id: str = "", request_limit: int = 0, include_finished: bool = False,
                       timeout: float | None = None, credential: bytes | None = None) -> hs.DescribeResponse:
        """The server's state for operators: peers, open requests, limits (as ``HandshakeClient.describe``)."""
        req = describe_request(peer_id, request_limit, include_finished, self._creds.of(peer_id, credential))
        resp: hs.DescribeResponse = await self._core.call(self._core.stub.Describe, req, timeout)
        return resp

    async def evict(self, peer_id: str, *, timeout: float | None = None) -> int:
        """Drop another peer, as the operator (as ``HandshakeClient.evict``)."""
        resp: hs.EvictResponse = await self._core.call(self._core.stub.Evict, hs.EvictRequest(peer_id=peer_id),
                                                       timeout)
        return int(resp.failed_requests)

    async def register(self, registration: registration_pb2.KvRegistration, *,
                       timeout: float | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential)."""
        resp: hs.RegisterResponse = await self._core.call(
            self._core.stub.Register, hs.RegisterRequest(registration=registration), timeout)
        return self._creds.keep(resp)

    async def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                              timeout: float | None = None,
                              credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination; returns the status right after."""
        return await self._core.submit(peer_id, transfer, timeout, credential)

    async def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                           credential: bytes | None = None) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """Stream status changes until the deadline (``DeadlineExceededError``; ``UnavailableError`` when the
        session's stream is broken then) or the peer's removal."""
        budget = self._s.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        wanted = frozenset(rooms)
        s = await self._core.session(peer_id, credential, budget)
        if s is None:
            async for status in self._core.watch_unary(peer_id, wanted, timeout, credential):
                yield status
            return
        items: asyncio.Queue[transfer_pb2.TransferStatus | None] = asyncio.Queue()
        stop = s.watch(wanted, items.put_nowait)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await items.get()
                except TimeoutError:
                    # UNAVAILABLE with the cause when the stream was broken at the deadline (a dead prefill).
                    raise s.late_error("the watch reached its deadline") from None
                if item is None:
                    return
                yield item
        finally:
            stop()

    async def wait_for(self, peer_id: str, rooms: Iterable[int], *, timeout: float | None = None,
                       credential: bytes | None = None) -> dict[int, transfer_pb2.TransferStatus]:
        """Wait until every room is SUCCESS or FAILED; returns the terminal statuses."""
        return await self._core.wait_for(peer_id, rooms, timeout, credential)

    async def abort(self, peer_id: str, room: int, generation: int | None = None, *,
                    timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation; returns once its in-flight chunks drained."""
        return await self._core.abort(peer_id, room, generation, timeout, credential)

    async def deregister(self, peer_id: str, *, timeout: float | None = None,
                         credential: bytes | None = None) -> int:
        """Remove this peer."""
        req = hs.DeregisterRequest(peer_id=peer_id, peer_credential=self._creds.of(peer_id, credential))
        resp: hs.DeregisterResponse = await self._core.call(self._core.stub.Deregister, req, timeout)
        self._core.forget(peer_id)
        self._creds.forget(peer_id)
        return int(resp.failed_requests)

    async def close(self) -> None:
        """Close the sessions and the channel."""
        await self._core.close()

    async def __aenter__(self) -> AsyncHandshakeClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


__all__ = ["AsyncHandshakeClient"]
