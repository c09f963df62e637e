"""Errors to gRPC statuses (codes from ``pdproto.errors``), and the one wrapper every handler uses.

Every non-OK status the service sends carries exactly one ``google.rpc.ErrorInfo``
(reason, domain ``pdproto``, metadata) and, for invalid fields, one
``google.rpc.BadRequest``. Nothing escapes a handler as UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status

from pdproto.errors import GRPC_CODE_NAMES, InvalidFieldError, PdprotoError, Reason, WireError
from pdproto.v1 import session_pb2

log = logging.getLogger("pdproto_server.status")

DOMAIN = "pdproto"


def grpc_code(reason: Reason) -> grpc.StatusCode:
    """The gRPC status code a reason is answered with (declared on its error class)."""
    code: grpc.StatusCode = getattr(grpc.StatusCode, GRPC_CODE_NAMES[reason])
    return code


_CAMEL = re.compile(r"_([a-z0-9])")


def _camel(key: str) -> str:
    """lowerCamelCase a metadata key (AIP-193); keys already camel stay as they are."""
    return _CAMEL.sub(lambda m: m.group(1).upper(), key)


def build_status(
    reason: Reason,
    message: str,
    metadata: Mapping[str, object] | None = None,
    *,
    field_violations: Sequence[tuple[str, str]] = (),
    code: grpc.StatusCode | None = None,
) -> grpc.Status:
    """A grpc.Status with one ErrorInfo and, when fields are named, one BadRequest."""
    info = error_details_pb2.ErrorInfo(
        reason=reason.code,
        domain=DOMAIN,
        metadata={_camel(k): str(v) for k, v in (metadata or {}).items()},
    )
    details: list[any_pb2.Any] = []
    packed = any_pb2.Any()
    packed.Pack(info)
    details.append(packed)
    if field_violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in field_violations
            ]
        )
        packed_bad = any_pb2.Any()
        packed_bad.Pack(bad)
        details.append(packed_bad)
    status_code = code if code is not None else grpc_code(reason)
    proto = status_pb2.Status(
        code=getattr(code_pb2, status_code.name),
        message=message,
        details=details,
    )
    result: grpc.Status = rpc_status.to_status(proto)
    return result


def command_error(error: PdprotoError) -> session_pb2.CommandError:
    """What a unary call would answer for ``error``, as a session CommandError (same code, reason, metadata)."""
    violations = error.violations if isinstance(error, InvalidFieldError) else ()
    return session_pb2.CommandError(
        code=grpc_code(error.reason).value[0], reason=error.reason.code, message=error.message,
        metadata={_camel(k): str(v) for k, v in error.metadata.items()},
        field_violations=[session_pb2.FieldViolation(field=f, description=d) for f, d in violations])


def status_for(error: PdprotoError) -> grpc.Status:
    """The status for a typed pdproto error (BadRequest added for InvalidFieldError)."""
    violations = error.violations if isinstance(error, InvalidFieldError) else ()
    return build_status(error.reason, error.message, error.metadata, field_violations=violations)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException, rpc: str) -> None:
    """Abort the RPC with the status for exc; unexpected errors become INTERNAL."""
    if isinstance(exc, PdprotoError):
        await context.abort_with_status(status_for(exc))
    # Unexpected: log with traceback, never leak internals to the peer.
    log.error("unexpected error in %s", rpc, exc_info=exc)
    await context.abort_with_status(
        build_status(Reason.INTERNAL, f"internal error in {rpc}", {"rpc": rpc})
    )


class Malformed:
    """A request body that did not parse: handed to the handler, whose wrapper answers it typed.

    grpc answers a deserializer's exception with a bare UNKNOWN before any handler runs, so the
    service's deserializers return this instead (``tolerant``).
    """

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def raise_error(self) -> None:
        """Raise the typed error the call is answered with (INVALID_ARGUMENT, WIRE_MALFORMED)."""
        raise WireError(f"the request is not a valid {self.message_type}: {self.error}",
                        reason=Reason.WIRE_MALFORMED, metadata={"messageType": self.message_type})


def tolerant(parse: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    """A request deserializer that returns ``Malformed`` for bytes that are not the message."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and anything a parser raises
            return Malformed(message_type, exc)

    return deserialize


def with_tolerant_requests(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """The same method handler, its request deserializer made ``tolerant``."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    replaced: grpc.RpcMethodHandler[Any, Any] = handler._replace(  # type: ignore[attr-defined]
        request_deserializer=tolerant(parse, name.full_name if name is not None else "request"))
    return replaced


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
            if isinstance(request, Malformed):
                request.raise_error()
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
            if isinstance(request, Malformed):
                request.raise_error()
            async for item in fn(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, fn.__name__)

    return wrapper


__all__ = [
    "DOMAIN",
    "GRPC_CODE_NAMES",
    "Malformed",
    "build_status",
    "command_error",
    "grpc_code",
    "status_for",
    "stream",
    "tolerant",
    "unary",
    "with_tolerant_requests",
]
