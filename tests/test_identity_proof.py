"""Identity squatting: a decode that binds its credential to its engine cannot be kept out or replaced.

A real ``pdproto serve`` (Mooncake and NIXL) and real decode ranks. The victim's registration
names a ``credential_buffer``; part of its credential arrives through the transfer engine. A
token holder copies the victim's registration (engine identity, buffers) as an attacker who
guessed them would:

* with the buffer, it is answered with half a credential: the rest went into the victim's
  memory, so the squatter can neither open a stream nor submit, and the victim registers over it;
* without the buffer (an unbound registration), it holds a status stream, and still the victim,
  which proves its engine, takes the identity over; the squatter's credential dies with it;
* once the victim is registered and reading its stream, every later claim is refused
  ``IDENTITY_IN_USE``, bound or not, and the victim's transfers land byte-exact.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import common_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

TOKEN = "shared-deployment-token"


def _watch_until_ended(client: HandshakeClient, peer_id: str, ended: threading.Event) -> None:
    """Read the peer's status stream (the mark of a live decode) until the server ends it."""
    try:
        for _ in client.watch_status(peer_id, [], timeout=60):
            pass
    except E.PdprotoError:
        pass
    ended.set()


def _moves(rank: DecodeRank, room: int) -> int:
    """One request through the rank's own ``DecodePeer``; the bytes checked."""
    pages = rank.pages_for(SPEC.prompt_tokens)
    rank.request(room, 0, SPEC.prompt_tokens, [], pages)
    assert rank.peer is not None
    outcome = rank.peer.wait(room, timeout=60)
    assert outcome.state == common_pb2.TRANSFER_STATE_SUCCESS, outcome
    return rank.verify({room: pages}, SPEC.prompt_tokens)


@pytest.fixture(params=["mooncake", "nixl"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_a_squatter_cannot_complete_a_credential_bound_to_another_decodes_engine(backend: str) -> None:
    victim = DecodeRank.for_spec(SPEC, pages=32, backend=backend)
    try:
        with running_server(*SERVE_ARGS, "--backend", backend, token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as squatter:
            claimed = victim.registration(bound=True)
            before = victim.credential.read(16)
            sid = squatter.register(claimed, read_credential=lambda n: bytes(n)).peer_id
            # The engine half landed in the victim's memory, not with the squatter.
            assert victim.credential.read(16) != before
            for call in (lambda: list(squatter.watch_status(sid, [], timeout=5)),
                         lambda: squatter.submit_transfer(sid, victim.transfer_info(7, victim.pages_for(64)))):
                with pytest.raises(E.NotFoundError) as info:
                    call()
                assert info.value.reason is Reason.PEER_NOT_FOUND
            # The owner of the engine registers over the squatter's peer: it could open no stream.
            victim.connect([srv.target], token=TOKEN)
            assert victim.peer is not None and victim.peer.ranks[0].peer_id != sid
            assert _moves(victim, 21) > 0
    finally:
        victim.close()


def test_an_unbound_squatter_holding_a_stream_gives_way_to_the_decode_that_proves_its_engine(backend: str) -> None:
    victim = DecodeRank.for_spec(SPEC, pages=32, backend=backend)
    try:
        with running_server(*SERVE_ARGS, "--backend", backend, token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as squatter:
            copied = victim.registration()  # the victim's engine and buffers, no credential_buffer
            sid = squatter.register(copied).peer_id
            ended = threading.Event()
            watcher = threading.Thread(target=_watch_until_ended, args=(squatter, sid, ended), daemon=True)
            watcher.start()
            victim.connect([srv.target], token=TOKEN)  # takes the identity over
            assert ended.wait(30), "the squatter's stream should end when its peer is dropped"
            with pytest.raises(E.NotFoundError):
                squatter.submit_transfer(sid, victim.transfer_info(8, victim.pages_for(64)))
            # The victim is live now: neither kind of claim displaces it.
            for claim, reader in ((victim.registration(), None),
                                  (victim.registration(bound=True), lambda n: bytes(n))):
                with pytest.raises(E.IdentityInUseError) as info:
                    squatter.register(claim, read_credential=reader)
                assert info.value.reason is Reason.IDENTITY_IN_USE
            assert _moves(victim, 22) > 0
    finally:
        victim.close()


def test_a_bound_registration_refuses_a_credential_buffer_of_another_memory_kind_or_too_small() -> None:
    victim = DecodeRank.for_spec(SPEC, pages=8, backend="mooncake")
    try:
        with running_server(*SERVE_ARGS, "--backend", "mooncake", token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as client:
            reg = victim.registration(bound=True)
            reg.credential_buffer.length = 8
            with pytest.raises(E.InvalidFieldError) as info:
                client.register(reg, read_credential=victim.credential.read)
            assert info.value.field == "registration.credential_buffer.length"
            reg = victim.registration(bound=True)
            reg.credential_buffer.ptr = 64  # no memory of the victim's engine lies there
            with pytest.raises(E.InvalidFieldError) as info:
                client.register(reg, read_credential=victim.credential.read)
            assert info.value.field == "registration.credential_buffer"
            with pytest.raises(E.ConfigError):
                client.register(victim.registration(bound=True))  # nothing to read the engine's half with
    finally:
        victim.close()
