"""A decode never hands its token or its buffer addresses to a rank that has not proven the token.

Attackers are real gRPC servers on loopback, at the address a decode is pointed at (as a
process that published a rank in SGLang's unauthenticated bootstrap server would be): one
without the token, one that relays the decode's challenge to a real rank (as it is, and with
the real rank's address put in), a real ``pdproto serve`` holding another token or none. Each
gets an ``Authenticate`` and nothing else, never the token; the decode raises ``AuthError``
(``RANK_UNPROVEN``). The real pair works through ``DecodePeer``, a stale proof (the server
restarted) is renewed by itself, and a flood of ``Authenticate`` leaves nothing behind on the
server, nor evicts a proof given before it (docs/security.md, "Proving the token").
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import grpc.aio
import pytest

from pdproto.client import DecodePeer, HandshakeClient
from pdproto.errors import AuthError, PdprotoError, Reason
from pdproto.rpc.loop import LoopThread
from pdproto.rpc import proof
from pdproto.rpc.proof import canonical_address
from pdproto.v1 import common_pb2
from pdproto.v1 import handshake_service_pb2 as hs
from pdproto.v1 import handshake_service_pb2_grpc as hs_grpc
from pdproto_demo.decode import DecodeRank
from pdproto_server.auth import ServedNames, TokenProof
from tests._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

TOKEN = "the-deployment-token-4f9a"
OPERATOR = "the-operator-token-77c1"
AUTHENTICATE = "/pdproto.v1.HandshakeService/Authenticate"

Answer = Callable[[str, bytes], bytes]
"""A fake rank's answer to a call: (method, request bytes) -> response bytes; raising aborts the call."""


class FakeRank:
    """A gRPC server that answers every method of any service and records what it was sent."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.calls: list[tuple[str, dict[str, str], bytes]] = []
        self.loop = LoopThread("fake-rank")
        self.port = self.loop.run(self._start(), 10)

    async def _start(self) -> int:
        fake = self

        class Everything(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
                method = details.method or ""

                async def handle(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
                    fake.calls.append((method, {k: str(v) for k, v in context.invocation_metadata() or ()}, request))
                    try:
                        return await asyncio.get_running_loop().run_in_executor(None, fake.answer, method, request)
                    except grpc.RpcError as exc:
                        await context.abort(exc.code(), str(exc.details()),  # type: ignore[attr-defined]
                                            trailing_metadata=exc.trailing_metadata())  # type: ignore[attr-defined]
                        raise
                    except LookupError:
                        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no such method")
                        raise

                return grpc.unary_unary_rpc_method_handler(handle)

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((Everything(),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    @property
    def target(self) -> str:
        """Where a decode is pointed at."""
        return f"127.0.0.1:{self.port}"

    def methods(self) -> list[str]:
        """The methods called, in order."""
        return [m for m, _, _ in self.calls]

    def assert_got_nothing_secret(self) -> None:
        """Only Authenticate was called, without credentials, and the token is nowhere in what arrived."""
        assert self.calls and set(self.methods()) == {AUTHENTICATE}, self.methods()
        for _, metadata, body in self.calls:
            assert "authorization" not in metadata, metadata
            assert TOKEN.encode() not in body and TOKEN not in repr(metadata)
            assert hs.AuthenticateRequest.FromString(body).address == canonical_address(self.target)

    def close(self) -> None:
        """Stop the server and its loop."""
        self.loop.run(self.server.stop(0), 10)
        self.loop.stop()


@contextmanager
def fake_rank(answer: Answer) -> Iterator[FakeRank]:
    """A ``FakeRank`` for the block."""
    rank = FakeRank(answer)
    try:
        yield rank
    finally:
        rank.close()


def _unimplemented(method: str, body: bytes) -> bytes:
    raise LookupError(method)


def _made_up_proof(method: str, body: bytes) -> bytes:
    if method != AUTHENTICATE:
        return hs.RegisterResponse().SerializeToString()  # it would accept anything, if asked
    return hs.AuthenticateResponse(server_nonce=b"n" * 40, server_proof=b"p" * 32).SerializeToString()


def _connect_refused(target: str) -> AuthError:
    """A DecodePeer pointed at ``target`` fails typed (RANK_UNPROVEN), naming the address."""
    rank = DecodeRank.for_spec(SPEC, pages=16)
    peer = DecodePeer(rank.registration(), token=TOKEN, timeout=5.0)
    try:
        with pytest.raises(AuthError) as info:
            peer.connect(target)
        assert peer.ranks == []
    finally:
        peer.close()
        rank.close()
    error = info.value
    assert error.reason is Reason.RANK_UNPROVEN and error.metadata["address"] == canonical_address(target), error
    assert "sent nothing" in error.message and "same token" in error.message
    return error


@pytest.mark.parametrize("answer", [_unimplemented, _made_up_proof], ids=["plain server", "made-up proof"])
def test_a_rank_without_the_token_gets_one_authenticate_and_no_token_or_register(answer: Answer) -> None:
    with fake_rank(answer) as fake:
        error = _connect_refused(fake.target)
        fake.assert_got_nothing_secret()
    assert ("UNIMPLEMENTED" in error.message or "INTERNAL" in error.message) if answer is _unimplemented \
        else "does not match" in error.message


def _relay(real: str, rewrite: bool) -> Answer:
    """Forwards Authenticate to the real rank (the address as sent, or the real rank's own)."""
    def answer(method: str, body: bytes) -> bytes:
        if method != AUTHENTICATE:
            raise LookupError(method)
        request = hs.AuthenticateRequest.FromString(body)
        if rewrite:
            request.address = real
        with grpc.insecure_channel(real) as channel:
            return hs_grpc.HandshakeServiceStub(channel).Authenticate(request, timeout=5).SerializeToString()
    return answer


@pytest.mark.parametrize("rewrite", [False, True], ids=["as sent", "real address put in"])
def test_a_relay_to_a_real_rank_fails_the_address_binding(rewrite: bool) -> None:
    with running_server(*SERVE_ARGS, token=TOKEN, operator_token=OPERATOR) as srv:
        with fake_rank(_relay(srv.target, rewrite)) as relay:
            error = _connect_refused(relay.target)
            relay.assert_got_nothing_secret()
        # As sent, the real rank refuses to prove for an address it does not answer at; with its own
        # address put in, it proves for that address, which is not the one the decode dialed.
        assert ("does not answer at" in error.message) if not rewrite else ("does not match" in error.message)
        with HandshakeClient(srv.target, token=OPERATOR) as operator:
            assert list(operator.describe().peers) == []  # the relay registered nothing there either


@pytest.mark.parametrize("served", [("other-token", None), (None, None)], ids=["another token", "no token"])
def test_a_real_rank_that_cannot_prove_this_token_gets_no_register(served: tuple[str | None, str | None]) -> None:
    token, operator = served
    with running_server(*SERVE_ARGS, token=token, operator_token=operator) as srv:
        _connect_refused(srv.target)
        with HandshakeClient(srv.target, token=token) as look:
            assert list(look.describe().peers) == []


def test_the_real_pair_works_through_decode_peer_and_renews_a_stale_proof() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS, token=TOKEN, operator_token=OPERATOR) as srv:
            peer = DecodePeer(rank.registration(), token=TOKEN, timeout=10.0)
            try:
                only = peer.connect(srv.target)
                pages = {5: rank.pages_for(SPEC.prompt_tokens)}
                peer.submit(5, [srv.target], lambda r: rank.transfer_info(5, pages[5]))
                assert peer.wait(5, 30.0).state == common_pb2.TRANSFER_STATE_SUCCESS
                rank.verify(pages, SPEC.prompt_tokens)
                with HandshakeClient(srv.target, token=OPERATOR) as operator:
                    assert [p.peer_id for p in operator.describe().peers] == [only.peer_id]
                    # The operator's proof opens looking only.
                    with pytest.raises(AuthError) as looking:
                        operator.register(rank.registration())
                    assert looking.value.reason is Reason.UNAUTHENTICATED
            finally:
                peer.close()
            client = HandshakeClient(srv.target, token=TOKEN, timeout=10)
            client.get_server_info()
            port = srv.port
        # A restarted server (a new process key) refuses the old proof: the client authenticates again.
        try:
            with running_server(*SERVE_ARGS, "--listen", f"127.0.0.1:{port}", token=TOKEN):
                assert client.register(rank.registration()).peer_id
        finally:
            client.close()
    finally:
        rank.close()


def test_the_server_proves_only_the_names_it_answers_at() -> None:
    """A wildcard listener proves its interface addresses and PDPROTO_ADVERTISE_HOST's name, and a
    loopback name only to a caller on this host: a relay on another host cannot borrow it."""
    names = ServedNames.of("0.0.0.0:0", 7000, advertise="Prefill-0.Example")
    here, there = "ipv4:127.0.0.1:40000", "ipv4:10.9.8.7:40000"
    assert names.serves("prefill-0.example:7000", there)
    assert names.serves("127.0.0.1:7000", here) and names.serves("localhost:7000", here)
    assert not names.serves("127.0.0.1:7000", there) and not names.serves("[::1]:7000", there)
    assert not names.serves("prefill-0.example:7001", there) and not names.serves("10.200.0.1:7000", there)
    pinned = ServedNames.of("10.1.2.3:7000", 7000)
    assert pinned.serves("10.1.2.3:7000", there) and not pinned.serves("127.0.0.1:7000", here)


def test_an_authenticate_flood_keeps_nothing_and_evicts_no_proof() -> None:
    """50,000 Authenticate answers hold no memory (nothing is kept per caller); after 2,000 more over
    gRPC, a proof made before them (by hand, so no client renews it) still opens calls."""
    proofs = TokenProof(TOKEN, None)
    proofs.names = ServedNames.of("127.0.0.1:0", 7000)
    asked = hs.AuthenticateRequest(client_nonce=b"c" * 16, address="127.0.0.1:7000")
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(50_000):
            proofs.authenticate(asked, "ipv4:127.0.0.1:1")
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, f"{grown} bytes kept after 50,000 Authenticate answers"

    with running_server(*SERVE_ARGS, token=TOKEN) as srv:
        async def flood() -> None:
            async with grpc.aio.insecure_channel(srv.target) as channel:
                stub = hs_grpc.HandshakeServiceStub(channel)
                mine = hs.AuthenticateRequest(client_nonce=b"m" * 16, address=srv.target)
                answer = await stub.Authenticate(mine, timeout=10)
                assert answer.server_proof == proof.server_proof(TOKEN, mine.client_nonce, answer.server_nonce,
                                                                 srv.target)
                metadata = (("authorization", proof.header(TOKEN, answer.server_nonce, mine.client_nonce)),)
                await stub.GetServerInfo(hs.GetServerInfoRequest(), timeout=10, metadata=metadata)
                asked.address = srv.target
                for _ in range(20):
                    await asyncio.gather(*(stub.Authenticate(asked, timeout=30) for _ in range(100)))
                # The proof made before the flood still opens calls (it is not evicted: nothing is kept).
                await stub.GetServerInfo(hs.GetServerInfoRequest(), timeout=10, metadata=metadata)
            with pytest.raises(PdprotoError) as wrong:
                await stub_refusal(srv.target)
            assert wrong.value.reason is Reason.UNAUTHENTICATED

        LoopThread.shared().run(flood(), 120)


async def stub_refusal(target: str) -> None:
    """A call with a made-up proof header: refused UNAUTHENTICATED."""
    from pdproto.rpc import error_from_rpc

    async with grpc.aio.insecure_channel(target) as channel:
        try:
            await hs_grpc.HandshakeServiceStub(channel).GetServerInfo(
                hs.GetServerInfoRequest(), timeout=10,
                metadata=(("authorization", f"Pdproto-HMAC {'00' * 40} {'11' * 16} {'22' * 32}"),))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

