"""Bearer-token authentication as a grpc.aio server interceptor (health and reflection exempt)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from pdproto.errors import ConfigError, Reason
from pdproto.rpc.status import build_status

# Probes and debugging tools must work without credentials (load balancers, grpcurl).
EXEMPT_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def _deny_handler(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that answers UNAUTHENTICATED with an ErrorInfo, for any request shape."""

    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(build_status(Reason.UNAUTHENTICATED, message))

    # The request body is never parsed: an unauthenticated caller gets no parser time.
    return grpc.unary_unary_rpc_method_handler(deny, request_deserializer=lambda b: b)


# What the operator token opens: looking, and evicting a peer; never acting as a decode.
OPERATOR_METHODS = frozenset(f"/pdproto.v1.HandshakeService/{name}"
                             for name in ("GetServerInfo", "Describe", "Evict"))


def _bearer(token: str, setting: str) -> bytes:
    if not token:
        raise ConfigError(f"empty {setting}", metadata={"setting": setting})
    return f"Bearer {token}".encode()


def _presented(metadata: Any) -> bytes | None:
    """The ``authorization`` metadata value of a call, as bytes; None when it has none."""
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return None


class OperatorToken:
    """The operator's bearer token: ``Describe`` shows everything to a call that carries it."""

    def __init__(self, token: str) -> None:
        self._expected = _bearer(token, "operator token")

    def matches(self, metadata: Any) -> bool:
        """True when the call's ``authorization`` is ``Bearer <operator token>`` (constant-time)."""
        presented = _presented(metadata)
        return presented is not None and hmac.compare_digest(presented, self._expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>``; the operator
    token, when there is one, opens ``OPERATOR_METHODS`` only."""

    def __init__(self, token: str, *, operator: OperatorToken | None = None) -> None:
        self._expected = _bearer(token, "bearer token")
        self._operator = operator
        self._missing = _deny_handler("missing bearer token")
        self._wrong = _deny_handler("invalid bearer token")
        self._looking_only = _deny_handler("the operator token opens GetServerInfo, Describe and Evict only; "
                                           "a decode calls with the deployment's token")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Pass authenticated or exempt calls on; deny the rest before any handler runs."""
        method = handler_call_details.method or ""
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        presented = _presented(metadata)
        if presented is None:
            return self._missing
        # Constant-time compare so the token cannot be guessed byte by byte.
        if not hmac.compare_digest(presented, self._expected):
            if self._operator is None or not self._operator.matches(metadata):
                return self._wrong
            if method not in OPERATOR_METHODS:
                return self._looking_only
        return await continuation(handler_call_details)


def is_loopback(address: str) -> bool:
    """True when a listen address ("host:port") binds only to the loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_policy(address: str, token: str | None, *, allow_insecure: bool = False) -> None:
    """Refuse to serve a non-loopback address without a token (unless explicitly allowed)."""
    if token or allow_insecure or is_loopback(address):
        return
    raise ConfigError(
        f"refusing to listen on {address} without a bearer token; pass --token-file "
        "(or --allow-unauthenticated on a trusted network)",
        metadata={"listen": address},
    )


__all__ = ["EXEMPT_PREFIXES", "OPERATOR_METHODS", "BearerTokenInterceptor", "OperatorToken", "is_loopback",
           "require_token_policy"]
