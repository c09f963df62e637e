"""Token authentication: ``Authenticate``'s proofs and the interceptor that checks every call's (health,
reflection and ``Authenticate`` exempt)."""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from pdproto.errors import AuthError, ConfigError, Reason
from pdproto.negotiation import reach
from pdproto.negotiation.reach import ADVERTISE_ENV
from pdproto.rpc import proof
from pdproto.rpc.proof import canonical_address, canonical_host
from pdproto.rpc.status import build_status
from pdproto.transfer.address import interface_addresses
from pdproto.v1 import handshake_service_pb2 as hs

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
AUTHENTICATE = "/pdproto.v1.HandshakeService/Authenticate"
"""Open to every caller: it is how a caller that holds the token proves it (and learns the server does)."""
PROOF_TTL_S = 3600.0
"""How long a client's proof (its session's nonces) is accepted; the client then authenticates again."""
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


class Role(enum.Enum):
    """Which token a call proved."""

    PEER = "the deployment's token"
    OPERATOR = "the operator token"


@dataclass(frozen=True)
class ServedNames:
    """The addresses a server answers at, which it proves its token for (and no other)."""

    hosts: frozenset[str]
    """Canonical hosts, loopback ones aside."""
    port: int
    loopback: bool
    """The server listens on loopback too; a loopback name is proven only to a caller on this host."""

    @classmethod
    def of(cls, listen: str, port: int, advertise: str | None = None) -> ServedNames:
        """The names of a server listening on ``listen`` (bound to ``port``): its listen host, or every
        IPv4 interface address for a wildcard; plus ``advertise`` (default ``PDPROTO_ADVERTISE_HOST``)."""
        host = listen.rpartition(":")[0].strip("[]")
        wildcard = host in WILDCARDS
        hosts = [a for _, a in interface_addresses()] if wildcard else [host]
        advertise = advertise or os.environ.get(ADVERTISE_ENV, "").strip()
        hosts += [advertise] if advertise else []
        canonical = {canonical_host(h) for h in hosts}
        return cls(frozenset(h for h in canonical if not reach.is_loopback(h)), port,
                   loopback=wildcard or reach.is_loopback(host))

    def serves(self, address: str, caller: str) -> bool:
        """True when ``address`` (canonical) is one of these names, for the gRPC peer ``caller``."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if port != str(self.port):
            return False
        if reach.is_loopback(host):
            return self.loopback and reach.is_loopback(reach.grpc_peer_host(caller) or "")
        return host in self.hosts


class TokenProof:
    """The server's side of ``Authenticate`` (``pdproto.rpc.proof``): it proves its tokens for the
    names it serves, and reads which token a call's ``authorization`` proves.

    Nothing is kept per caller: a server nonce is its issue time, 16 random bytes and a MAC of
    both and the client's nonce under a key of this process, so the calls that name it are checked
    against the nonce itself, and a flood of ``Authenticate`` calls holds no memory.
    """

    def __init__(self, token: str | None, operator: str | None) -> None:
        self._tokens = {role: t for role, t in ((Role.PEER, token), (Role.OPERATOR, operator)) if t is not None}
        for role, t in self._tokens.items():
            if not t:
                raise ConfigError(f"empty {role.value}", metadata={"setting": role.name.lower() + "_token"})
        self.names: ServedNames | None = None
        """Set once the server is bound (``start_server``); until then nothing is proven."""
        self._key = secrets.token_bytes(32)

    def _tag(self, issued: bytes, random: bytes, client_nonce: bytes) -> bytes:
        return hmac.new(self._key, issued + random + client_nonce, hashlib.sha256).digest()[:16]

    def authenticate(self, request: hs.AuthenticateRequest, caller: str) -> hs.AuthenticateResponse:
        """Prove the token ``request`` asks for, for the address it dialed; raises ``AuthError`` when
        this server does not hold that token or does not answer at that address."""
        role = Role.OPERATOR if request.operator else Role.PEER
        token = self._tokens.get(role)
        if token is None:
            raise AuthError(f"this server holds no {role.value}", metadata={"address": request.address[:256]})
        if not proof.NONCE_BYTES <= len(request.client_nonce) <= proof.MAX_NONCE_BYTES:
            raise AuthError(f"client_nonce must hold {proof.NONCE_BYTES} to {proof.MAX_NONCE_BYTES} bytes",
                            metadata={"length": str(len(request.client_nonce))})
        address = canonical_address(request.address[:300])
        if self.names is None or not self.names.serves(address, caller):
            raise AuthError(f"this server does not answer at {address}: dial the address it listens on "
                            f"(or PDPROTO_ADVERTISE_HOST there)", metadata={"address": address})
        issued, random = int(time.time()).to_bytes(8, "big"), secrets.token_bytes(16)
        server_nonce = issued + random + self._tag(issued, random, request.client_nonce)
        return hs.AuthenticateResponse(
            server_nonce=server_nonce,
            server_proof=proof.server_proof(token, request.client_nonce, server_nonce, address))

    def role(self, metadata: Any) -> Role | None:
        """The token the call's ``authorization`` proves (a nonce this process issued, not expired, and the
        client's MAC, compared in constant time); None for anything else."""
        presented = _presented(metadata)
        parsed = proof.parse_header(presented) if presented is not None else None
        if parsed is None:
            return None
        server_nonce, client_nonce, mac = parsed
        issued, random, tag = server_nonce[:8], server_nonce[8:24], server_nonce[24:]
        if len(server_nonce) != 40 or not hmac.compare_digest(tag, self._tag(issued, random, client_nonce)):
            return None
        if time.time() - int.from_bytes(issued, "big") > PROOF_TTL_S:
            return None
        for role, token in self._tokens.items():
            if hmac.compare_digest(mac, proof.client_proof(token, server_nonce, client_nonce)):
                return role
        return None


def _presented(metadata: Any) -> str | None:
    """The ``authorization`` metadata value of a call; None when it has none."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else bytes(value).decode("ascii", errors="replace")
    return None


class TokenProofInterceptor(grpc.aio.ServerInterceptor):
    """Lets through a call that proves the deployment's token (``TokenProof.role``), or the operator
    token for ``OPERATOR_METHODS``, and ``Authenticate``, health and reflection; denies the rest
    before any handler runs or any body is parsed."""

    def __init__(self, proofs: TokenProof) -> None:
        self._proofs = proofs
        self._missing = _deny_handler("no proof of the token: call Authenticate, then send "
                                      "authorization: Pdproto-HMAC (pdproto.client does)")
        self._wrong = _deny_handler("the proof of the token is wrong or expired (or the server restarted): "
                                    "authenticate again")
        self._looking_only = _deny_handler("the operator token opens GetServerInfo, Describe and Evict only; "
                                           "a decode calls with the deployment's token")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Pass authenticated or exempt calls on; deny the rest before any handler runs."""
        method = handler_call_details.method or ""
        if method.startswith(EXEMPT_PREFIXES) or method == AUTHENTICATE:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        role = self._proofs.role(metadata)
        if role is None:
            return self._missing if _presented(metadata) is None else self._wrong
        if role is Role.OPERATOR and method not in OPERATOR_METHODS:
            return self._looking_only
        return await continuation(handler_call_details)


def require_token_policy(address: str, token: str | None, *, allow_insecure: bool = False) -> None:
    """Refuse to serve a non-loopback address without a token (unless explicitly allowed)."""
    if token or allow_insecure or reach.is_loopback(address.rsplit(":", 1)[0]):
        return
    raise ConfigError(
        f"refusing to listen on {address} without a deployment token; pass --token-file "
        "(or --allow-unauthenticated on a trusted network)",
        metadata={"listen": address},
    )


__all__ = ["AUTHENTICATE", "EXEMPT_PREFIXES", "OPERATOR_METHODS", "PROOF_TTL_S", "Role", "ServedNames", "TokenProof",
           "TokenProofInterceptor", "require_token_policy"]
