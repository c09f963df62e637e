"""Server pieces checked without a network: RPC coverage, the status table, auth policy."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from pdproto.client import AsyncHandshakeClient, error_class
from pdproto.errors import GRPC_CODE_NAMES, ConfigError, PdprotoError, Reason
from pdproto import v1
from pdproto.rpc import build_status, grpc_code
from pdproto.v1 import handshake_service_pb2, handshake_service_pb2_grpc
from pdproto_server import _status
from pdproto_server.auth import require_token_policy
from pdproto_server.service import HandshakeServicer

from ._server_harness import REPO


def test_every_rpc_in_the_proto_is_implemented() -> None:
    service = handshake_service_pb2.DESCRIPTOR.services_by_name["HandshakeService"]
    assert service.full_name == v1.SERVICE_NAME == "pdproto.v1.HandshakeService"
    missing = [m.name for m in service.methods if m.name not in HandshakeServicer.__dict__]
    assert not missing, f"RPCs without an implementation: {missing}"


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_has_a_code_and_one_error_info(reason: Reason) -> None:
    code = grpc_code(reason)
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)
    assert GRPC_CODE_NAMES[reason] == code.name
    status = build_status(reason, "msg", {"some_key": 1}, field_violations=[("a.b", "bad")])
    proto = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    infos = [d for d in proto.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    bads = [d for d in proto.details if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)]
    assert len(infos) == 1 and len(bads) == 1
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (reason.name, "pdproto", {"someKey": "1"})
    assert issubclass(error_class(reason), PdprotoError)


def test_token_policy() -> None:
    for loopback in ("127.0.0.1:0", "[::1]:5", "localhost:1"):  # only loopback binds serve without a token
        require_token_policy(loopback, None)
    for public in ("0.0.0.0:50051", "[::]:1", "0.0.0.0:1"):
        with pytest.raises(ConfigError):
            require_token_policy(public, None)
    require_token_policy("0.0.0.0:1", "t")
    require_token_policy("0.0.0.0:1", None, allow_insecure=True)


@pytest.mark.process
def test_serve_refuses_public_address_without_token() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdproto_server.cli", "serve", "--listen", "0.0.0.0:0",
                           "--pages", "4", "--layers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0:0 without a deployment token" in proc.stderr


class _Exploding(HandshakeServicer):
    """A servicer whose handler hits a bug, to prove the wrapper maps it."""

    def __init__(self) -> None:
        pass

    @_status.unary
    async def GetServerInfo(self, request: object, context: object) -> object:  # type: ignore[override]
        raise RuntimeError("secret internal detail")


@pytest.mark.process
def test_unexpected_exception_becomes_internal_not_unknown() -> None:
    async def run() -> None:
        server = grpc.aio.server()
        handshake_service_pb2_grpc.add_HandshakeServiceServicer_to_server(_Exploding(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            client = AsyncHandshakeClient(f"127.0.0.1:{port}")
            with pytest.raises(PdprotoError) as info:
                await client.get_server_info()
            await client.close()
        finally:
            await server.stop(0)
        assert info.value.reason is Reason.INTERNAL
        assert info.value.metadata["grpcCode"] == "INTERNAL"
        assert "secret" not in info.value.message

    asyncio.run(asyncio.wait_for(run(), 20))


def test_peer_ids_and_credentials_are_random_and_secrets_are_compared_in_constant_time() -> None:
    """docs/security.md: ids ``p-`` and 16 hex digits, 32-byte credentials from ``secrets``, and the
    token and credentials compared with ``hmac.compare_digest``, an unknown id against a decoy.
    Time is not measured here (no timing assertions); the code that compares is read."""
    import inspect
    import re

    from pdproto_server.auth import TokenProof
    from pdproto_server.registry import CREDENTIAL_BYTES, Limits, PeerRegistry

    registry = PeerRegistry(Limits())
    ids = {registry.new_id() for _ in range(1000)}
    creds = {registry.new_credential() for _ in range(1000)}
    assert len(ids) == len(creds) == 1000 and CREDENTIAL_BYTES == 32
    assert all(re.fullmatch(r"p-[0-9a-f]{16}", i) for i in ids)
    assert all(len(c) == 32 for c in creds)
    assert registry.authorized(next(iter(ids)), next(iter(creds))) is None  # unknown id: refused
    authorized = inspect.getsource(PeerRegistry.authorized)
    assert "hmac.compare_digest(credential, expected)" in authorized and "self._decoy" in authorized
    assert "==" not in authorized.split('"""')[-1]
    role = inspect.getsource(TokenProof.role)
    assert role.count("hmac.compare_digest(") == 2  # the server nonce's tag, and the client's proof
