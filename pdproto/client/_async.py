"""The asyncio client, the one implementation: the blocking ``HandshakeClient`` runs it on a loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from pdproto.errors import ConfigError, Reason
from pdproto.rpc import ChannelConfig
from pdproto.session import TERMINAL_STATES, StatusBook
from pdproto.v1 import (
    handshake_service_pb2 as hs,
    handshake_service_pb2_grpc as hs_grpc,
    registration_pb2,
    server_info_pb2,
    session_pb2,
    transfer_pb2,
)

from ._auth import Proof
from ._rpc import CredentialReader, RetryConfig, Settings, Tries, deadline_error
from ._session import PeerSession, SessionUnsupportedError


class AsyncHandshakeClient:
    """asyncio client; create and use it on one event loop.

    A peer's submits, aborts and waits travel on its session (``PeerSession``), or on the unary
    calls with ``session=False`` or against a server without sessions.
    """

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None,
                 session: bool = True) -> None:
        self._s = Settings(Proof(token, target) if token else None, timeout, retry or RetryConfig())
        cert = root_cert if root_cert is None or isinstance(root_cert, bytes) else Path(root_cert).read_bytes()
        options = (channel or ChannelConfig()).client_options()
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        # The channel itself is made on first use, on the loop that runs the client (``_stub``).
        self._open_channel: Callable[[], grpc.aio.Channel]
        if tls or cert is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=cert)
            self._open_channel = functools.partial(grpc.aio.secure_channel, target, creds, options=options)
        else:
            self._open_channel = functools.partial(grpc.aio.insecure_channel, target, options=options)
        self._creds: dict[str, bytes] = {}
        """The credential of each peer this client registered (or was handed)."""
        self._use_session = session
        self._channel: grpc.aio.Channel | None = None
        self._lazy_stub: hs_grpc.HandshakeServiceAsyncStub | None = None
        self._sessions: dict[str, PeerSession] = {}
        self._ending: set[PeerSession] = set()
        """Sessions of deregistered peers, still delivering their last statuses (closed with the client)."""

    @property
    def _stub(self) -> hs_grpc.HandshakeServiceAsyncStub:
        """The aio stub (its channel is created on first use, on the running loop)."""
        if self._lazy_stub is None:
            self._channel = self._open_channel()
            self._lazy_stub = hs_grpc.HandshakeServiceStub(self._channel)
        return self._lazy_stub

    def _budget(self, timeout: float | None) -> float:
        return self._s.timeout if timeout is None else timeout

    def _cred(self, peer_id: str, given: bytes | None) -> bytes:
        """The credential to send for ``peer_id``: the one given, else the one kept, else none."""
        return given if given is not None else self._creds.get(peer_id, b"")

    async def _call(self, fn: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        """One unary call with a deadline, retried (``Tries``) inside that deadline."""
        async for attempt in Tries(self._s, timeout):
            with attempt:
                return await fn(request, timeout=attempt.left(), metadata=await attempt.metadata(self._stub))
        raise AssertionError("a unary try returns or fails")

    async def _session(self, peer_id: str, credential: bytes | None, budget: float) -> PeerSession | None:
        """The peer's open session, or None when the unary calls must be used."""
        if not self._use_session:
            return None
        cred = self._cred(peer_id, credential)
        s = self._sessions.get(peer_id)
        if s is None or s.credential != cred:
            if s is not None:
                await s.close()
            s = self._sessions[peer_id] = PeerSession(self._stub, self._s, peer_id, cred)
        try:
            await s.open(budget)
        except SessionUnsupportedError:
            self._use_session = False
            return None
        return s

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none): hand it to another process."""
        return self._creds.get(peer_id, b"")

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._creds[peer_id] = credential

    async def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        resp: hs.GetServerInfoResponse = await self._call(self._stub.GetServerInfo, hs.GetServerInfoRequest(),
                                                          timeout)
        return resp.info

    async def describe(self, *, peer_id: str = "", request_limit: int = 0, include_finished: bool = False,
                       timeout: float | None = None, credential: bytes | None = None) -> hs.DescribeResponse:
        """The server's state for operators: peers, open requests, limits (``pdproto status``).

        ``peer_id``'s credential (given, or kept from its Register) goes along, so that peer is
        shown in full; other peers' rooms and engine identities need the operator token.
        """
        req = hs.DescribeRequest(peer_id=peer_id, request_limit=request_limit, include_finished=include_finished,
                                 peer_credential=self._cred(peer_id, credential) if peer_id else b"")
        resp: hs.DescribeResponse = await self._call(self._stub.Describe, req, timeout)
        return resp

    async def evict(self, peer_id: str, *, timeout: float | None = None) -> int:
        """Drop another peer, as the operator (the client's token must be the operator token);
        returns how many open requests were failed with PEER_GONE (``pdproto evict``)."""
        resp: hs.EvictResponse = await self._call(self._stub.Evict, hs.EvictRequest(peer_id=peer_id), timeout)
        return int(resp.failed_requests)

    async def register(self, registration: registration_pb2.KvRegistration, *,
                       timeout: float | None = None,
                       read_credential: CredentialReader | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential); raises ``TopologyError`` (or another class)
        on rejection.

        A registration with a ``credential_buffer`` needs ``read_credential``: the part of the
        credential the prefill wrote there through the engine is read back with it.
        """
        if registration.HasField("credential_buffer") and read_credential is None:
            raise ConfigError("this registration names a credential_buffer: pass read_credential, which reads "
                              "it back (pdproto.transfer.CredentialSlot.read)", reason=Reason.CONFIG_INVALID)
        resp: hs.RegisterResponse = await self._call(self._stub.Register, hs.RegisterRequest(registration=registration),
                                                     timeout)
        n = resp.credential_bytes_in_engine
        tail = read_credential(n) if n and read_credential is not None else b""  # the part in the engine
        self._creds[resp.result.peer_id] = resp.peer_credential + tail
        return resp.result

    async def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                              timeout: float | None = None,
                              credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination; returns the status right after."""
        budget = self._budget(timeout)
        s = await self._session(peer_id, credential, budget)
        if s is not None:
            out = s.outcome(await s.command(session_pb2.SessionCommand(submit=transfer), budget))
            assert isinstance(out, transfer_pb2.TransferStatus)
            return out
        req = hs.SubmitTransferRequest(peer_id=peer_id, transfer=transfer,
                                       peer_credential=self._cred(peer_id, credential))
        resp: hs.SubmitTransferResponse = await self._call(self._stub.SubmitTransfer, req, timeout)
        return resp.status

    async def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                           credential: bytes | None = None) -> AsyncGenerator[transfer_pb2.TransferStatus, None]:
        """Stream status changes (first the current state of matching requests) until the deadline.

        Raises ``DeadlineExceededError`` at the deadline (``UnavailableError`` when the session's stream
        is broken then); ends when the peer is removed. Without a session, a broken WatchStatus stream
        is re-opened within the deadline (``Tries``) and what it already delivered is dropped.
        """
        budget = self._budget(timeout)
        deadline = asyncio.get_running_loop().time() + budget
        wanted = frozenset(rooms)
        s = await self._session(peer_id, credential, budget)
        if s is None:
            req = hs.WatchStatusRequest(peer_id=peer_id, rooms=list(wanted),
                                        peer_credential=self._cred(peer_id, credential))
            book = StatusBook()
            async for attempt in Tries(self._s, timeout):
                with attempt:
                    call = self._stub.WatchStatus(req, timeout=attempt.left(),
                                                  metadata=await attempt.metadata(self._stub))
                    try:
                        async for response in call:
                            if book.update(response.status):
                                yield response.status
                    finally:
                        call.cancel()
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
        pending = set(rooms)
        budget = self._budget(timeout)
        s = await self._session(peer_id, credential, budget)
        if s is not None:
            return await s.wait(pending, budget)
        done: dict[int, transfer_pb2.TransferStatus] = {}
        async with contextlib.aclosing(self.watch_status(peer_id, pending, timeout=timeout,
                                                         credential=credential)) as statuses:
            async for status in statuses:
                if status.state in TERMINAL_STATES and status.room in pending:
                    done[status.room] = status
                    pending.discard(status.room)
                    if not pending:
                        return done
        raise deadline_error("status stream ended before every room finished", rooms=sorted(pending))

    async def abort(self, peer_id: str, room: int, generation: int | None = None, *,
                    timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation; returns once its in-flight chunks drained."""
        budget = self._budget(timeout)
        note = transfer_pb2.AbortNotification(room=room)
        if generation is not None:
            note.generation = generation
        s = await self._session(peer_id, credential, budget)
        if s is not None:
            out = s.outcome(await s.command(session_pb2.SessionCommand(abort=note), budget))
            assert isinstance(out, transfer_pb2.AbortAck)
            return out
        req = hs.AbortRequest(peer_id=peer_id, abort=note, peer_credential=self._cred(peer_id, credential))
        resp: hs.AbortResponse = await self._call(self._stub.Abort, req, timeout)
        return resp.ack

    async def deregister(self, peer_id: str, *, timeout: float | None = None, credential: bytes | None = None) -> int:
        """Remove this peer; returns how many open requests were failed with PEER_GONE."""
        req = hs.DeregisterRequest(peer_id=peer_id, peer_credential=self._cred(peer_id, credential))
        resp: hs.DeregisterResponse = await self._call(self._stub.Deregister, req, timeout)
        # No new call uses the peer's session; the server ends it once it sent everything.
        s = self._sessions.pop(peer_id, None)
        if s is not None and s.error is None:
            self._ending.add(s)
        self._creds.pop(peer_id, None)
        return int(resp.failed_requests)

    async def close(self) -> None:
        """Close the sessions and the channel (closing again does nothing)."""
        for s in [*self._sessions.values(), *self._ending]:
            await s.close()
        self._sessions.clear()
        self._ending.clear()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncHandshakeClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


__all__ = ["AsyncHandshakeClient"]
