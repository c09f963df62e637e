"""The gRPC servicer of ``pdproto.v1.HandshakeService``: a thin adapter over ``HandshakeCore``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message_factory import GetMessageClass

from pdproto.errors import AuthError, Reason
from pdproto.v1 import handshake_service_pb2 as hs
from pdproto.v1 import handshake_service_pb2_grpc as hs_grpc

from . import _status
from .auth import Role, TokenProof
from .core import HandshakeCore
from .describe import describe
from .registry import Limits
from .session import SessionHub

Ctx = grpc.aio.ServicerContext[Any, Any]

SMALL_REQUEST_BYTES = 64 << 10
"""The most a request of GetServerInfo, Abort, Deregister, Describe, Evict or Authenticate may hold: a few ids and
numbers (under 200 bytes), the rest room for fields a newer minor version adds. Register, SubmitTransfer
and Session messages may approach the channel's ``max_message_bytes`` within ``validate.Bounds``, which
gRPC itself enforces before it buffers the body."""


def request_limits(limits: Limits) -> dict[str, int]:
    """Bytes each method's request may hold, checked before it is parsed (others: ``max_message_bytes``)."""
    small = dict.fromkeys(("GetServerInfo", "Abort", "Deregister", "Describe", "Evict", "Authenticate"),
                          SMALL_REQUEST_BYTES)
    # A WatchStatus room filter lists at most what a peer can have open and kept: 10 bytes a room at most.
    return {**small, "WatchStatus": SMALL_REQUEST_BYTES + 10 * limits.kept_per_peer}


class HandshakeServicer(hs_grpc.HandshakeServiceServicer):
    """Every handler goes through ``_status.unary``/``_status.stream``: no UNKNOWN ever leaves."""

    def __init__(self, core: HandshakeCore, *, proofs: TokenProof | None = None) -> None:
        self.core = core
        self.sessions = SessionHub(core)
        self.proofs = proofs
        """The server's tokens: ``Authenticate`` proves them; ``Describe`` shows every peer in full to a call
        that proves the operator token."""

    def _operator(self, context: Ctx) -> bool:
        return self.proofs is not None and self.proofs.role(context.invocation_metadata()) is Role.OPERATOR

    @_status.unary
    async def Authenticate(self, request: hs.AuthenticateRequest, context: Ctx) -> hs.AuthenticateResponse:
        """Prove the token the caller asks for, for the address it dialed (no credentials needed)."""
        if self.proofs is None:
            raise AuthError("this server runs without a token and can prove none: a client given a token "
                            "sends it nothing", reason=Reason.UNAUTHENTICATED)
        return self.proofs.authenticate(request, context.peer())

    @_status.unary
    async def GetServerInfo(self, request: hs.GetServerInfoRequest, context: Ctx) -> hs.GetServerInfoResponse:
        """The prefill rank's topology."""
        return hs.GetServerInfoResponse(info=self.core.info)

    @_status.unary
    async def Register(self, request: hs.RegisterRequest, context: Ctx) -> hs.RegisterResponse:
        """Negotiate a layout for one decode rank."""
        return await self.core.register(request, context.peer())

    @_status.unary
    async def SubmitTransfer(self, request: hs.SubmitTransferRequest, context: Ctx) -> hs.SubmitTransferResponse:
        """Admit one request's destination."""
        await self.core.pace(request.peer_id, request.peer_credential)
        return hs.SubmitTransferResponse(status=await self.core.submit(request))

    @_status.stream
    async def WatchStatus(self, request: hs.WatchStatusRequest, context: Ctx) -> AsyncIterator[hs.WatchStatusResponse]:
        """Stream a peer's request statuses until it deregisters or the server drains."""
        await self.core.pace(request.peer_id, request.peer_credential)
        async for status in self.core.watch(request):
            yield hs.WatchStatusResponse(status=status)

    @_status.unary
    async def Abort(self, request: hs.AbortRequest, context: Ctx) -> hs.AbortResponse:
        """Abort one request generation after its in-flight chunk drains."""
        await self.core.pace(request.peer_id, request.peer_credential)
        return hs.AbortResponse(ack=await self.core.abort(request))

    # A read/write-style handler (context.read, context.write): grpc.aio takes a coroutine
    # here, which the generated stub types as an iterator only.
    @_status.unary
    async def Session(self, request_iterator: AsyncIterator[hs.SessionRequest],  # type: ignore[override]
                      context: Ctx) -> None:
        """One decode peer's session stream: submits and aborts in, results and statuses out."""
        await self.sessions.serve(context)

    @_status.unary
    async def Describe(self, request: hs.DescribeRequest, context: Ctx) -> hs.DescribeResponse:
        """The server's state, for operators."""
        operator = self._operator(context)
        if not operator:
            await self.core.pace(request.peer_id, request.peer_credential)
        return describe(self.core, self.sessions, request, operator=operator)

    @_status.unary
    async def Evict(self, request: hs.EvictRequest, context: Ctx) -> hs.EvictResponse:
        """Drop a peer, for the operator token only (even on a server without a deployment token)."""
        if not self._operator(context):
            raise AuthError("Evict needs the operator token (pdproto serve --operator-token-file)",
                            reason=Reason.UNAUTHENTICATED, metadata={"method": "Evict"})
        return hs.EvictResponse(failed_requests=await self.core.evict(request))

    @_status.unary
    async def Deregister(self, request: hs.DeregisterRequest, context: Ctx) -> hs.DeregisterResponse:
        """Free everything the peer held."""
        await self.core.pace(request.peer_id, request.peer_credential)
        return hs.DeregisterResponse(failed_requests=await self.core.deregister(request))


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_to_server(servicer: HandshakeServicer, server: grpc.aio.Server) -> None:
    """Register the servicer's methods, as the generated code would, but with ``_status.tolerant`` deserializers.

    A body over its method's ``request_limits`` (RESOURCE_EXHAUSTED, MESSAGE_TOO_LARGE, never parsed)
    or one that does not parse (INVALID_ARGUMENT, WIRE_MALFORMED) reaches the handler's wrapper instead
    of failing in grpc's deserializer, which answers a bare UNKNOWN.
    """
    caps = request_limits(servicer.core.limits)
    service = hs.DESCRIPTOR.services_by_name["HandshakeService"]
    methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request, response = (GetMessageClass(t) for t in (method.input_type, method.output_type))
        handler: Any = _HANDLERS[method.client_streaming, method.server_streaming]
        methods[method.name] = handler(
            getattr(servicer, method.name), response_serializer=response.SerializeToString,
            request_deserializer=_status.tolerant(request.FromString, method.input_type.full_name, caps.get(method.name)))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, methods),))
    server.add_registered_method_handlers(service.full_name, methods)


__all__ = ["SMALL_REQUEST_BYTES", "HandshakeServicer", "add_to_server", "request_limits"]
