"""The gRPC servicer of ``pdproto.v1.HandshakeService``: a thin adapter over ``HandshakeCore``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc.aio

from pdproto.v1 import handshake_service_pb2 as hs
from pdproto.v1 import handshake_service_pb2_grpc as hs_grpc

from . import _status
from .core import HandshakeCore

Ctx = grpc.aio.ServicerContext[Any, Any]


class HandshakeServicer(hs_grpc.HandshakeServiceServicer):
    """Every handler goes through ``_status.unary``/``_status.stream``: no UNKNOWN ever leaves."""

    def __init__(self, core: HandshakeCore) -> None:
        self.core = core

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
        return hs.SubmitTransferResponse(status=await self.core.submit(request))

    @_status.stream
    async def WatchStatus(self, request: hs.WatchStatusRequest, context: Ctx) -> AsyncIterator[hs.WatchStatusResponse]:
        """Stream a peer's request statuses until it deregisters or the server drains."""
        async for status in self.core.watch(request):
            yield hs.WatchStatusResponse(status=status)

    @_status.unary
    async def Abort(self, request: hs.AbortRequest, context: Ctx) -> hs.AbortResponse:
        """Abort one request generation after its in-flight chunk drains."""
        return hs.AbortResponse(ack=await self.core.abort(request))

    @_status.unary
    async def Deregister(self, request: hs.DeregisterRequest, context: Ctx) -> hs.DeregisterResponse:
        """Free everything the peer held."""
        return hs.DeregisterResponse(failed_requests=await self.core.deregister(request))


__all__ = ["HandshakeServicer"]
