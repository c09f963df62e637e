"""A registered peer is still untrusted: its credential acts on its own peer only.

Two decode ranks register with a real ``pdproto serve`` (token-protected: both hold the
shared token). The hostile one knows the victim's peer id and tries, with its own
credential, with none and with a guess, to write into the victim's pages, abort and watch
its requests and deregister it. Every attempt answers PEER_NOT_FOUND, and the victim's
transfers land byte-exact.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import common_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_server.registry import CREDENTIAL_BYTES

from ._server_harness import SERVE_ARGS, SPEC, running_server

pytestmark = pytest.mark.process

TOKEN = "shared-deployment-token"


def _refused(call: Callable[..., object], *args: object, **kwargs: object) -> None:
    """The call answers PEER_NOT_FOUND (NOT_FOUND), whatever the other peer's state."""
    with pytest.raises(E.NotFoundError) as info:
        call(*args, **kwargs)
    assert info.value.reason is Reason.PEER_NOT_FOUND, info.value
    assert info.value.metadata["grpcCode"] == "NOT_FOUND"


def test_hostile_peer_cannot_touch_another_peers_requests() -> None:
    victim = DecodeRank.for_spec(SPEC, pages=64)
    hostile = DecodeRank.for_spec(SPEC, pages=64)
    args = [*SERVE_ARGS[:-4], "--chunk-delay-ms", "200", "--match-timeout", "10"]
    try:
        with running_server(*args, token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as vc, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as hc:
            vid = vc.register(victim.registration()).peer_id
            hid = hc.register(hostile.registration()).peer_id
            own = hc.credential(hid)
            assert len(vc.credential(vid)) == len(own) == CREDENTIAL_BYTES
            assert vc.credential(vid) != own and vid != hid
            placed = {room: victim.pages_for(SPEC.prompt_tokens, first_page=i * 16)
                      for i, room in enumerate((11, 12))}
            for room, pages in placed.items():
                vc.submit_transfer(vid, victim.transfer_info(room, pages))
            seen: list[tuple[int, int, str]] = []
            watcher = threading.Thread(target=lambda: seen.extend(
                (s.room, s.state, s.failure_code) for s in vc.watch_status(vid, placed, timeout=20)
                if s.state in (common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED)
                and len(seen) < 99))
            watcher.start()
            # The victim's requests are in flight (chunks 200 ms apart) while the hostile peer tries.
            guesses = {"its own credential": own, "no credential": b"", "a guess": bytes(CREDENTIAL_BYTES)}
            for credential in guesses.values():
                into_victim = victim.transfer_info(13, placed[11])
                _refused(hc.submit_transfer, vid, into_victim, credential=credential)
                _refused(hc.abort, vid, 11, credential=credential)
                _refused(lambda c=credential: list(hc.watch_status(vid, [11], timeout=2, credential=c)))
                _refused(hc.deregister, vid, credential=credential)
            # Its own peer still works with its own credential.
            hc.submit_transfer(hid, hostile.transfer_info(21, hostile.pages_for(SPEC.prompt_tokens)))
            assert hc.wait_for(hid, [21], timeout=20)[21].state == common_pb2.TRANSFER_STATE_SUCCESS
            done = vc.wait_for(vid, placed, timeout=20)
            assert {r: s.state for r, s in done.items()} == {r: common_pb2.TRANSFER_STATE_SUCCESS for r in placed}
            victim.verify(placed, SPEC.prompt_tokens)  # nothing else landed in the victim's pool
            hostile.verify({21: hostile.pages_for(SPEC.prompt_tokens)}, SPEC.prompt_tokens)
            old = vc.credential(vid)
            assert vc.deregister(vid) == 0
            watcher.join(20)
            assert sorted(seen) == [(11, common_pb2.TRANSFER_STATE_SUCCESS, ""),
                                    (12, common_pb2.TRANSFER_STATE_SUCCESS, "")], seen
            # A deregistered peer's credential is dead too, even for its own id.
            _refused(vc.submit_transfer, vid, victim.transfer_info(14, placed[12]), credential=old)
            # So is a replaced peer's: the same decode registering again once its old client (its
            # process, in a real restart) is gone is a restart.
            hc.close()
            with HandshakeClient(srv.target, token=TOKEN, timeout=10) as rc:
                again = rc.register(hostile.registration()).peer_id
                assert again != hid and rc.credential(again) != own
                _refused(rc.submit_transfer, hid, hostile.transfer_info(22, hostile.pages_for(SPEC.prompt_tokens)),
                         credential=own)
                assert rc.deregister(again) == 0
    finally:
        victim.close()
        hostile.close()


@contextlib.contextmanager
def _victim_and_stranger() -> Iterator[tuple[DecodeRank, HandshakeClient, HandshakeClient]]:
    """A decode rank, its client and another token holder's client, on one token-protected server."""
    victim = DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*SERVE_ARGS, token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as vc, \
                HandshakeClient(srv.target, token=TOKEN, timeout=10) as hc:
            yield victim, vc, hc
    finally:
        victim.close()


def test_a_registration_naming_a_decode_that_reads_its_stream_is_refused() -> None:
    """docs/security.md: naming the notify endpoint or engine of a decode that still reads its
    status stream is refused (IDENTITY_IN_USE), and that decode's requests go on; closing the
    stream, as a process's exit does, makes the same registration a restart."""
    with _victim_and_stranger() as (victim, vc, hc):
        vid = vc.register(victim.registration()).peer_id
        pages = victim.pages_for(SPEC.prompt_tokens)
        vc.submit_transfer(vid, victim.transfer_info(1, pages))  # opens the victim's session
        assert vc.wait_for(vid, [1], timeout=20)[1].state == common_pb2.TRANSFER_STATE_SUCCESS
        vc.submit_transfer(vid, victim.transfer_info(2, pages))  # in flight while the impostors try
        impostors = {"notify endpoint": victim.registration(), "engine": victim.registration()}
        impostors["notify endpoint"].local.socket = f"pdproto-arena-1-{'0' * 32}"
        impostors["engine"].notify_endpoint.port += 1
        for what, impostor in impostors.items():
            with pytest.raises(E.IdentityInUseError) as refused:
                hc.register(impostor)
            assert refused.value.reason is Reason.IDENTITY_IN_USE, (what, refused.value)
            assert refused.value.metadata["grpcCode"] == "ALREADY_EXISTS"
        # The victim was not touched: its open request lands, byte-exact.
        assert vc.wait_for(vid, [2], timeout=20)[2].state == common_pb2.TRANSFER_STATE_SUCCESS
        victim.verify({2: pages}, SPEC.prompt_tokens)
        vc.close()  # the victim's process exits: its streams close, and the same decode may come back
        restarted = hc.register(victim.registration()).peer_id
        assert restarted != vid
        _refused(hc.submit_transfer, vid, victim.transfer_info(3, pages), credential=vc.credential(vid))


def test_a_registration_naming_a_decode_without_a_stream_replaces_it_even_when_refused() -> None:
    """docs/security.md, what a token holder can still do: a decode that reads no status stream
    cannot be told from a restarted one, so naming its notify endpoint drops it, even when the new
    registration is then refused at connect (no arena behind it)."""
    with _victim_and_stranger() as (victim, vc, hc):
        vid = vc.register(victim.registration()).peer_id
        impostor = victim.registration()
        impostor.local.socket = f"pdproto-arena-1-{'0' * 32}"  # nothing listens there
        with pytest.raises(E.PdprotoError) as refused:
            hc.register(impostor)
        assert refused.value.reason is Reason.PEER_GONE, refused.value
        _refused(vc.submit_transfer, vid, victim.transfer_info(1, victim.pages_for(SPEC.prompt_tokens)))
