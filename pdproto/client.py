"""Decode-side gRPC client of ``pdproto.v1.HandshakeService`` (sync and asyncio).

Register returns a peer credential with the peer id; the client keeps it and sends it with
every later call for that peer (``credential(peer_id)`` hands it to another process,
``adopt`` takes one in). Every call carries a deadline; every non-OK status is raised as the
``pdproto.errors`` class of its ``google.rpc.ErrorInfo`` reason (``error_class``), with
the metadata attached and the original ``grpc.RpcError`` as ``__cause__``. Only errors
whose class is declared retryable (the UNAVAILABLE ones: ``UnavailableError``,
``ShuttingDownError``) are retried, with exponential backoff inside the call's deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.rpc import error_details_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status

from pdproto import errors as E
from pdproto.errors import PdprotoError, Reason, UnavailableError, error_class, error_for
from pdproto.v1 import (
    SERVICE_NAME,
    common_pb2,
    handshake_service_pb2 as hs,
    handshake_service_pb2_grpc as hs_grpc,
    registration_pb2,
    server_info_pb2,
    transfer_pb2,
)

DOMAIN = "pdproto"
TERMINAL_STATES = frozenset({common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED})


@dataclass(frozen=True)
class ChannelConfig:
    """Transport options that must agree between server and client (keepalive, sizes)."""

    max_message_bytes: int = 4 << 20
    """Largest message either side sends or accepts (control messages are small)."""
    keepalive_time_ms: int = 30_000
    """Client ping interval; must be >= the server's ``min_ping_interval_ms``."""
    keepalive_timeout_ms: int = 10_000
    """How long a ping may go unanswered before the connection is considered dead."""
    min_ping_interval_ms: int = 10_000
    """Server: the most frequent ping it tolerates (else GOAWAY too_many_pings)."""
    permit_without_calls: bool = True
    """Ping idle connections too, so a dead peer is noticed before the next call."""

    def _common(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.permit_without_calls)),
        ]

    def client_options(self) -> list[tuple[str, Any]]:
        """Channel arguments for the client."""
        # gRPC's own retry layer stays off: ours retries only UNAVAILABLE, inside the deadline.
        # Short reconnect backoff: after a prefill restart the default (1 s growing to 120 s)
        # outlived whole deadlines, so a re-registering decode never reached the new server.
        return [*self._common(), ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]

    def server_options(self) -> list[tuple[str, Any]]:
        """Server arguments matching ``client_options``."""
        return [
            *self._common(),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]


@dataclass(frozen=True)
class RetryConfig:
    """Backoff for retryable errors (UNAVAILABLE); others are never retried."""

    attempts: int | None = None
    """Total tries including the first; None keeps retrying until the call's deadline."""
    initial_backoff: float = 0.05
    """Seconds before the second try."""
    max_backoff: float = 1.0
    """Upper bound of one sleep."""
    multiplier: float = 2.0
    """Growth of the sleep per try."""


# Statuses without an ErrorInfo come from the transport or gRPC itself: read each code as
# the reason it stands for (the class and retryability then follow from pdproto.errors).
_BARE_CODES: Mapping[grpc.StatusCode, Reason] = {
    grpc.StatusCode.UNAVAILABLE: Reason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.MESSAGE_TOO_LARGE,
    grpc.StatusCode.CANCELLED: Reason.ABORTED,
}


def error_from_rpc(exc: grpc.RpcError) -> PdprotoError:
    """Turn a failed call into the typed error of its ErrorInfo reason (BadRequest -> field)."""
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    status = rpc_status.from_call(exc)
    info: error_details_pb2.ErrorInfo | None = None
    violations: list[tuple[str, str]] = []
    for any_msg in status.details if status is not None else ():
        if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and info is None:
            info = error_details_pb2.ErrorInfo()
            any_msg.Unpack(info)
        elif any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    metadata: dict[str, str] = {"grpcCode": code.name}
    if info is not None and info.domain == DOMAIN and info.reason in Reason.__members__:
        reason = Reason[info.reason]
        metadata.update(info.metadata)
    else:
        reason = _BARE_CODES.get(code, Reason.INTERNAL)
        if info is not None:
            metadata.update(info.metadata, foreignReason=info.reason, foreignDomain=info.domain)
    if issubclass(error_class(reason), E.InvalidFieldError):
        field_name = violations[0][0] if violations else metadata.get("field", "")
        return E.InvalidFieldError(field_name, details, reason=reason, metadata=metadata,
                                   violations=violations or None)
    return error_for(reason, details, metadata)


def _read(value: bytes | str | Path | None) -> bytes | None:
    """Certificate bytes from bytes or a file path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True)
class _Settings:
    """What both client flavours share: target, credentials, deadlines, options."""

    target: str
    token: str | None
    root_cert: bytes | None
    timeout: float
    retry: RetryConfig
    channel: ChannelConfig
    server_name: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, when set."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self) -> list[tuple[str, Any]]:
        """Channel arguments."""
        opts = self.channel.client_options()
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return opts

    def backoffs(self) -> Iterator[float]:
        """Sleeps between UNAVAILABLE retries."""
        delay = self.retry.initial_backoff
        tries = itertools.count() if self.retry.attempts is None else range(self.retry.attempts - 1)
        for _ in tries:
            yield delay
            delay = min(delay * self.retry.multiplier, self.retry.max_backoff)


def _settings(target: str, token: str | None, root_cert: bytes | str | Path | None, timeout: float,
              retry: RetryConfig | None, channel: ChannelConfig | None, server_name: str | None,
              tls: bool) -> tuple[_Settings, bool]:
    s = _Settings(target=target, token=token, root_cert=_read(root_cert), timeout=timeout,
                  retry=retry or RetryConfig(), channel=channel or ChannelConfig(),
                  server_name=server_name)
    return s, tls or s.root_cert is not None


class _Credentials:
    """The credential of each peer this client registered (or was handed), by peer id."""

    def __init__(self) -> None:
        self._by_peer: dict[str, bytes] = {}

    def keep(self, response: hs.RegisterResponse) -> server_info_pb2.NegotiationResult:
        """Remember the credential of a Register answer; returns its result."""
        self._by_peer[response.result.peer_id] = response.peer_credential
        return response.result

    def of(self, peer_id: str, given: bytes | None) -> bytes:
        """The credential to send for ``peer_id``: the one given, else the one kept, else none."""
        return given if given is not None else self._by_peer.get(peer_id, b"")

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Use ``credential`` for ``peer_id`` from now on."""
        self._by_peer[peer_id] = credential

    def forget(self, peer_id: str) -> None:
        """Drop a deregistered peer's credential."""
        self._by_peer.pop(peer_id, None)


def _abort_request(peer_id: str, credential: bytes, room: int, generation: int | None) -> hs.AbortRequest:
    """An AbortRequest for one room (and generation, when given)."""
    note = transfer_pb2.AbortNotification(room=room)
    if generation is not None:
        note.generation = generation
    return hs.AbortRequest(peer_id=peer_id, abort=note, peer_credential=credential)


_T = TypeVar("_T")


class HandshakeClient:
    """Blocking client; reuse one per prefill rank (the channel is long-lived)."""

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None) -> None:
        self._s, secure = _settings(target, token, root_cert, timeout, retry, channel, server_name, tls)
        if secure:
            creds = grpc.ssl_channel_credentials(root_certificates=self._s.root_cert)
            self._channel = grpc.secure_channel(target, creds, options=self._s.options())
        else:
            self._channel = grpc.insecure_channel(target, options=self._s.options())
        self._stub = hs_grpc.HandshakeServiceStub(self._channel)
        self._creds = _Credentials()

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
                delay = next(backoffs, None) if error.retryable else None
                if delay is None or time.monotonic() + delay >= end:
                    raise error from exc
                time.sleep(delay)

    def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        return self._call(self._stub.GetServerInfo, hs.GetServerInfoRequest(), timeout).info

    def register(self, registration: registration_pb2.KvRegistration, *,
                 timeout: float | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential); raises ``TopologyError`` (or another class) on rejection."""
        return self._creds.keep(self._call(self._stub.Register, hs.RegisterRequest(registration=registration),
                                           timeout))

    def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                        timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination; returns the status right after."""
        req = hs.SubmitTransferRequest(peer_id=peer_id, transfer=transfer,
                                       peer_credential=self._creds.of(peer_id, credential))
        return self._call(self._stub.SubmitTransfer, req, timeout).status

    def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                     credential: bytes | None = None) -> Iterator[transfer_pb2.TransferStatus]:
        """Stream status changes (first the current state of matching requests) until the deadline."""
        req = hs.WatchStatusRequest(peer_id=peer_id, rooms=list(rooms),
                                    peer_credential=self._creds.of(peer_id, credential))
        call = self._stub.WatchStatus(req, timeout=self._s.timeout if timeout is None else timeout,
                                      metadata=self._s.metadata())
        try:
            for item in call:
                yield item.status
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        finally:
            call.cancel()

    def wait_for(self, peer_id: str, rooms: Iterable[int], *, timeout: float | None = None,
                 credential: bytes | None = None) -> dict[int, transfer_pb2.TransferStatus]:
        """Block until every room is SUCCESS or FAILED; returns the terminal statuses."""
        pending = set(rooms)
        done: dict[int, transfer_pb2.TransferStatus] = {}
        for status in self.watch_status(peer_id, pending, timeout=timeout, credential=credential):
            if status.state in TERMINAL_STATES and status.room in pending:
                done[status.room] = status
                pending.discard(status.room)
                if not pending:
                    break
        if pending:
            raise E.DeadlineExceededError("status stream ended before every room finished",
                                          reason=Reason.DEADLINE_EXCEEDED,
                                          metadata={"rooms": sorted(pending)})
        return done

    def abort(self, peer_id: str, room: int, generation: int | None = None, *,
              timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation; returns once its in-flight chunks drained."""
        req = _abort_request(peer_id, self._creds.of(peer_id, credential), room, generation)
        return self._call(self._stub.Abort, req, timeout).ack

    def deregister(self, peer_id: str, *, timeout: float | None = None, credential: bytes | None = None) -> int:
        """Remove this peer; returns how many open requests were failed with PEER_GONE."""
        req = hs.DeregisterRequest(peer_id=peer_id, peer_credential=self._creds.of(peer_id, credential))
        resp = self._call(self._stub.Deregister, req, timeout)
        self._creds.forget(peer_id)
        return int(resp.failed_requests)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncHandshakeClient:
    """asyncio client; create and use it on one event loop."""

    def __init__(self, target: str, *, token: str | None = None, root_cert: bytes | str | Path | None = None,
                 tls: bool = False, timeout: float = 5.0, retry: RetryConfig | None = None,
                 channel: ChannelConfig | None = None, server_name: str | None = None) -> None:
        self._s, secure = _settings(target, token, root_cert, timeout, retry, channel, server_name, tls)
        if secure:
            creds = grpc.ssl_channel_credentials(root_certificates=self._s.root_cert)
            self._channel = grpc.aio.secure_channel(target, creds, options=self._s.options())
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self._s.options())
        self._stub = hs_grpc.HandshakeServiceStub(self._channel)
        self._creds = _Credentials()

    def credential(self, peer_id: str) -> bytes:
        """The credential this client holds for ``peer_id`` (empty if none)."""
        return self._creds.of(peer_id, None)

    def adopt(self, peer_id: str, credential: bytes) -> None:
        """Act for a peer that another client registered, with the credential it was given."""
        self._creds.adopt(peer_id, credential)

    async def _call(self, fn: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        """Async twin of ``HandshakeClient._call``."""
        budget = self._s.timeout if timeout is None else timeout
        end = time.monotonic() + budget
        backoffs = self._s.backoffs()
        while True:
            try:
                return await fn(request, timeout=max(end - time.monotonic(), 0.001),
                                metadata=self._s.metadata())
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                delay = next(backoffs, None) if error.retryable else None
                if delay is None or time.monotonic() + delay >= end:
                    raise error from exc
                await asyncio.sleep(delay)

    async def get_server_info(self, *, timeout: float | None = None) -> server_info_pb2.PrefillServerInfo:
        """The prefill rank's topology."""
        resp: hs.GetServerInfoResponse = await self._call(self._stub.GetServerInfo, hs.GetServerInfoRequest(), timeout)
        return resp.info

    async def register(self, registration: registration_pb2.KvRegistration, *,
                       timeout: float | None = None) -> server_info_pb2.NegotiationResult:
        """Register this decode rank (keeping its credential)."""
        resp: hs.RegisterResponse = await self._call(
            self._stub.Register, hs.RegisterRequest(registration=registration), timeout)
        return self._creds.keep(resp)

    async def submit_transfer(self, peer_id: str, transfer: transfer_pb2.TransferInfo, *,
                              timeout: float | None = None,
                              credential: bytes | None = None) -> transfer_pb2.TransferStatus:
        """Hand the prefill one request's destination."""
        req = hs.SubmitTransferRequest(peer_id=peer_id, transfer=transfer,
                                       peer_credential=self._creds.of(peer_id, credential))
        resp: hs.SubmitTransferResponse = await self._call(self._stub.SubmitTransfer, req, timeout)
        return resp.status

    async def watch_status(self, peer_id: str, rooms: Iterable[int] = (), *, timeout: float | None = None,
                           credential: bytes | None = None) -> AsyncIterator[transfer_pb2.TransferStatus]:
        """Stream status changes until the deadline."""
        req = hs.WatchStatusRequest(peer_id=peer_id, rooms=list(rooms),
                                    peer_credential=self._creds.of(peer_id, credential))
        call = self._stub.WatchStatus(req, timeout=self._s.timeout if timeout is None else timeout,
                                      metadata=self._s.metadata())
        try:
            async for item in call:
                yield item.status
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        finally:
            call.cancel()

    async def abort(self, peer_id: str, room: int, generation: int | None = None, *,
                    timeout: float | None = None, credential: bytes | None = None) -> transfer_pb2.AbortAck:
        """Abort a request generation."""
        req = _abort_request(peer_id, self._creds.of(peer_id, credential), room, generation)
        resp: hs.AbortResponse = await self._call(self._stub.Abort, req, timeout)
        return resp.ack

    async def deregister(self, peer_id: str, *, timeout: float | None = None,
                         credential: bytes | None = None) -> int:
        """Remove this peer."""
        req = hs.DeregisterRequest(peer_id=peer_id, peer_credential=self._creds.of(peer_id, credential))
        resp: hs.DeregisterResponse = await self._call(self._stub.Deregister, req, timeout)
        self._creds.forget(peer_id)
        return int(resp.failed_requests)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncHandshakeClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


__all__ = [
    "AsyncHandshakeClient",
    "ChannelConfig",
    "HandshakeClient",
    "RetryConfig",
    "SERVICE_NAME",
    "TERMINAL_STATES",
    "UnavailableError",
    "error_class",
    "error_from_rpc",
]
