"""The one wrapper every handler uses, and request deserializers that check sizes and never answer UNKNOWN.

Errors become statuses through ``pdproto.rpc.status`` (exactly one ``google.rpc.ErrorInfo``,
and a ``google.rpc.BadRequest`` for invalid fields), which the client reads back. Nothing
escapes a handler as UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from pdproto.errors import MessageTooLargeError, PdprotoError, Reason, WireError
from pdproto.rpc.status import build_status, status_for

log = logging.getLogger("pdproto_server.status")


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException, rpc: str) -> None:
    """Abort the RPC with the status for exc; unexpected errors become INTERNAL."""
    if isinstance(exc, PdprotoError):
        await context.abort_with_status(status_for(exc))
    # Unexpected: log with traceback, never leak internals to the peer.
    log.error("unexpected error in %s", rpc, exc_info=exc)
    await context.abort_with_status(
        build_status(Reason.INTERNAL, f"internal error in {rpc}", {"rpc": rpc})
    )


def tolerant(parse: Callable[[bytes], Any], message_type: str, limit: int | None = None) -> Callable[[bytes], Any]:
    """A request deserializer that returns, not raises, the typed error (MESSAGE_TOO_LARGE or WIRE_MALFORMED)
    for bytes over ``limit`` (unparsed) or not the message; the handler's wrapper raises it.

    grpc answers a deserializer's exception with a bare UNKNOWN before any handler runs.
    """

    def deserialize(data: bytes) -> Any:
        if limit is not None and len(data) > limit:
            return MessageTooLargeError(
                f"a {message_type} of {len(data)} bytes is larger than the {limit} this server reads",
                metadata={"messageType": message_type, "size": len(data), "limit": limit})
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and anything a parser raises
            return WireError(f"the request is not a valid {message_type}: {exc}", reason=Reason.WIRE_MALFORMED,
                             metadata={"messageType": message_type})

    return deserialize


_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Self = TypeVar("_Self")

UnaryHandler = Callable[[_Self, _Req, "grpc.aio.ServicerContext[_Req, _Resp]"], Awaitable[_Resp]]
StreamHandler = Callable[[_Self, _Req, "grpc.aio.ServicerContext[_Req, _Resp]"], AsyncIterator[_Resp]]


def unary(fn: UnaryHandler[_Self, _Req, _Resp]) -> UnaryHandler[_Self, _Req, _Resp]:
    """Wrap a unary handler so every exception leaves as a rich status, never UNKNOWN."""

    @functools.wraps(fn)
    async def wrapper(self: _Self, request: _Req, context: grpc.aio.ServicerContext[_Req, _Resp]) -> _Resp:
        try:
            if isinstance(request, PdprotoError):  # refused by ``tolerant``
                raise request
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one place that maps everything
            await _abort(context, exc, fn.__name__)
            raise  # unreachable: abort raises

    return wrapper


def stream(fn: StreamHandler[_Self, _Req, _Resp]) -> StreamHandler[_Self, _Req, _Resp]:
    """Wrap a server-streaming handler the same way as ``unary``."""

    @functools.wraps(fn)
    async def wrapper(
        self: _Self, request: _Req, context: grpc.aio.ServicerContext[_Req, _Resp]
    ) -> AsyncIterator[_Resp]:
        try:
            if isinstance(request, PdprotoError):  # refused by ``tolerant``
                raise request
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, fn.__name__)

    return wrapper


__all__ = [
    "stream",
    "tolerant",
    "unary",
]
