"""The client's side of ``Authenticate``: the server proves the token for the address dialed before
anything else is sent to it, and the calls then carry a proof of the client's own, never the token."""

from __future__ import annotations

import asyncio
import hmac
import secrets

import grpc

from pdproto.errors import AuthError, Reason
from pdproto.rpc import error_from_rpc
from pdproto.rpc.proof import NONCE_BYTES, canonical_address, header, server_proof
from pdproto.v1 import handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc

Metadata = tuple[tuple[str, str], ...]


class Proof:
    """A client's proof of its token to one server (docs/security.md): made on first use, renewed when
    the server no longer takes it (it restarted, or the proof expired)."""

    def __init__(self, token: str, target: str) -> None:
        self._token = token
        self.address = canonical_address(target)
        """The host:port dialed: the server must prove the token for exactly this address."""
        self._metadata: Metadata | None = None
        self._lock = asyncio.Lock()  # binds to the loop that first waits on it (the client's)

    async def metadata(self, stub: hs_grpc.HandshakeServiceAsyncStub, timeout: float) -> Metadata:
        """The ``authorization`` metadata of a call; ``Authenticate`` first when there is none. Raises
        ``AuthError`` (``RANK_UNPROVEN``) when the server does not prove the token, or the ``grpc.RpcError``
        of an ``Authenticate`` that may be retried (UNAVAILABLE) or ran past its deadline."""
        async with self._lock:
            if self._metadata is None:
                self._metadata = (("authorization", await self._prove(stub, timeout)),)
            return self._metadata

    def renew(self, used: Metadata) -> None:
        """The server refused ``used``: the next call authenticates again."""
        if self._metadata == used:
            self._metadata = None

    async def _prove(self, stub: hs_grpc.HandshakeServiceAsyncStub, timeout: float) -> str:
        refusals = []
        # The deployment's token first; else the operator's (pdproto status takes either).
        for operator in (False, True):
            nonce = secrets.token_bytes(NONCE_BYTES)
            request = hs.AuthenticateRequest(client_nonce=nonce, address=self.address, operator=operator)
            try:
                response: hs.AuthenticateResponse = await stub.Authenticate(request, timeout=timeout)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if error.retryable or error.reason is Reason.DEADLINE_EXCEEDED:
                    raise
                refusals.append(f"{error.reason.name}: {error.message}")
                continue
            expected = server_proof(self._token, nonce, response.server_nonce, self.address)
            if hmac.compare_digest(response.server_proof, expected):
                return header(self._token, response.server_nonce, nonce)
            refusals.append("its proof does not match: it holds another token, or answers at another address "
                            "and relays the challenge there")
        why = "; ".join(dict.fromkeys(refusals))
        raise AuthError(
            f"the server at {self.address} did not prove it holds this client's token, so it was sent nothing "
            f"else ({why}). Check that {self.address} is the prefill rank's own address (where it listens, or "
            f"PDPROTO_ADVERTISE_HOST there), that it runs pdproto with Authenticate, and that both hold the same "
            f"token", reason=Reason.RANK_UNPROVEN,
            metadata={"address": self.address, "grpcCode": "UNAUTHENTICATED"})


__all__ = ["Metadata", "Proof"]
