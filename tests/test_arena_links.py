"""A decode keeps one connection, its link, to a prefill's inbox and sends every later push on it
(``pdproto/transfer/inbox.py``).

Each push after the first then costs the decode one ``sendmsg``. The link is every lease's
liveness channel: a lease dropped leaves it to the others, the decode closing it ends them
all. Whatever a link carries is bounded and checked as a push on a connection of its own;
something malformed on it shuts it. Real processes: ``pdproto serve``, demo decode ranks,
and a hostile local peer (``tests._arena_peer``) that sends what a test asks for.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pdproto.client import HandshakeClient
from pdproto.errors import InvalidFieldError, Reason, RequestFailedError
from pdproto.transfer import LayerSpan, TransferJob, inbox, offer
from pdproto.transfer.local import LocalExecutor
from pdproto.v1 import common_pb2, registration_pb2, server_info_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.proc import Child

from ._server_harness import SERVE_ARGS, SPEC, running_server
from .test_arena_push import _inbox, _server, hostile, prefill  # noqa: F401 (fixtures: one hostile child each)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _registrations(reply: dict[str, object]) -> list[registration_pb2.KvRegistration]:
    found = reply["registrations"]
    assert isinstance(found, list)
    return [registration_pb2.KvRegistration.FromString(bytes.fromhex(h)) for h in found]


def _job(ex: LocalExecutor) -> TransferJob:
    """Four 4 KiB rows into the start of the peer's arena (the hostile registration's one buffer)."""
    src = ex.allocate(16 << 10)
    return TransferJob.of_runs([LayerSpan(src.addr, 0, 4096)], np.array([[0, 1, 0, 1, 4]], dtype=np.int64))


def _gone(ex: LocalExecutor, peer: str, job: TransferJob) -> None:
    with pytest.raises(RequestFailedError) as caught:
        ex.execute(peer, job)
    assert caught.value.reason == Reason.PEER_GONE, caught.value


def test_every_register_after_the_first_pushes_on_the_link_and_moves_bytes() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with running_server(*SERVE_ARGS) as srv, HandshakeClient(srv.target, timeout=30) as client:
            info = client.get_server_info()
            assert info.local_inbox.links
            for room in (11, 12, 13):
                assert offer(rank.executor, info)
                peer_id = client.register(rank.registration()).peer_id
                pages = rank.pages_for(SPEC.prompt_tokens)
                client.submit_transfer(peer_id, rank.transfer_info(room, pages))
                done = client.wait_for(peer_id, [room], timeout=30)
                assert done[room].state == common_pb2.TRANSFER_STATE_SUCCESS, done[room]
                rank.verify({room: pages}, SPEC.prompt_tokens)
                client.deregister(peer_id)  # closes that peer's lease, not the link the next push takes
        server = _server(rank)
        assert (server.pushed, server.asked, len(server._links)) == (3, 0, 1)
    finally:
        rank.close()


def test_leases_on_one_link_outlive_each_other_and_end_with_it(hostile: Child, prefill: LocalExecutor) -> None:
    name = _inbox(prefill)
    a, b = _registrations(hostile.call("link", kind="good", inbox=name, count=2))
    prefill.connect("a", a)
    prefill.connect("b", b)
    (c,) = _registrations(hostile.call("link", kind="good", inbox=name))
    job = _job(prefill)
    # A push waiting unread on the link is not its leases' hang-up.
    prefill.execute("a", job)
    prefill.execute("b", job)
    prefill.disconnect("a")  # closes a's copy of the link only
    prefill.execute("b", job)
    prefill.connect("c", c)
    assert prefill.stats.arenas_pushed == 3
    assert hostile.call("link_state", inbox=name)["hung_up"] is False
    hostile.call("unlink", inbox=name)  # what a decode's exit or closed executor does
    _gone(prefill, "b", job)
    _gone(prefill, "c", job)


def test_pushes_queued_on_a_link_are_read_one_message_each(hostile: Child, prefill: LocalExecutor) -> None:
    """No loop reads this inbox: each Register reads what waits, and messages that came together
    (each with its descriptor) are still one push each."""
    regs = _registrations(hostile.call("link", kind="good", inbox=_inbox(prefill), count=5))
    for i, reg in enumerate(reversed(regs)):
        prefill.connect(f"p{i}", reg)
    assert prefill.stats.arenas_pushed == 5


def test_a_flooded_link_keeps_its_places_and_others_still_push(hostile: Child, prefill: LocalExecutor) -> None:
    name = _inbox(prefill)
    flood = hostile.call("link", kind="good", inbox=name, count=3 * inbox.MAX_PUSHED_PER_PID)
    regs = _registrations(flood)
    assert len(regs) == 3 * inbox.MAX_PUSHED_PER_PID
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        assert offer(rank.executor, server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox()))
        prefill.connect("mine", rank.registration())
        assert _server(rank).asked == 0
        # The link and its first push take one place, its next pushes the rest of its share; the
        # others were closed.
        kept = inbox.MAX_PUSHED_PER_PID
        for i, reg in enumerate(regs[:kept]):
            prefill.connect(f"flood{i}", reg)
        for reg in (regs[kept], regs[-1]):
            with pytest.raises(RequestFailedError):  # not pushed any more, and nobody listens to ask
                prefill.connect("late", reg)
        assert prefill.stats.arenas_pushed == 1 + kept
        assert hostile.call("link_state", inbox=name)["hung_up"] is False  # a bound closes pushes, not the link
    finally:
        rank.close()


def test_a_process_with_a_link_per_executor_pushes_on_each_up_to_its_share(prefill: LocalExecutor) -> None:
    """Each link's waiting push rides the link's place, so one process's share of places is links."""
    info = server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox())
    ranks = [DecodeRank.for_spec(SPEC, pages=8) for _ in range(inbox.MAX_PUSHED_PER_PID + 1)]
    try:
        for turn in range(2):  # links made, then every push on a link a lease still holds
            for i, rank in enumerate(ranks[:-1]):
                assert offer(rank.executor, info)
                prefill.connect(f"r{i}.{turn}", rank.registration())
        assert prefill.stats.arenas_pushed == 2 * inbox.MAX_PUSHED_PER_PID
        assert [_server(rank).asked for rank in ranks[:-1]] == [0] * inbox.MAX_PUSHED_PER_PID
        # A link more is past the process's share: closed at once, and that decode is asked instead.
        offer(ranks[-1].executor, info)
        prefill.connect("past", ranks[-1].registration())
        assert (prefill.stats.arenas_pushed, _server(ranks[-1]).asked) == (2 * inbox.MAX_PUSHED_PER_PID, 1)
    finally:
        for rank in ranks:
            rank.close()


def test_places_in_all_are_bounded_with_a_link_and_its_first_push_one(prefill: LocalExecutor,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAX_PUSHED`` counted as ``MAX_PUSHED_PER_PID`` is (lowered here: one process reaches it)."""
    monkeypatch.setattr(inbox, "MAX_PUSHED", 4)
    info = server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox())
    ranks = [DecodeRank.for_spec(SPEC, pages=8) for _ in range(5)]
    try:
        for rank in ranks:
            assert offer(rank.executor, info)
        # Four links, each with its push waiting, fill the four places: the fifth link is closed at once.
        for i, rank in enumerate(ranks):
            prefill.connect(f"r{i}", rank.registration())
        assert [_server(rank).asked for rank in ranks] == [0, 0, 0, 0, 1]
        # A second push waiting on a link takes a place of its own: none is left, so it is closed.
        assert offer(ranks[0].executor, info) and offer(ranks[0].executor, info)
        prefill.connect("again", ranks[0].registration())
        prefill.connect("twice", ranks[0].registration())
        assert (prefill.stats.arenas_pushed, _server(ranks[0]).asked) == (5, 1)
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("malformed", ["garbage", "single_push_on_a_link", "no_descriptor"])
def test_a_link_carrying_something_malformed_is_shut_with_its_leases(
        hostile: Child, prefill: LocalExecutor, malformed: str) -> None:
    name = _inbox(prefill)
    (first,) = _registrations(hostile.call("link", kind="good", inbox=name))
    prefill.connect("a", first)
    (pending,) = _registrations(hostile.call("link", kind="good", inbox=name))  # not yet claimed
    if malformed == "single_push_on_a_link":
        (bad,) = _registrations(hostile.call("link", kind="good", inbox=name, magic="single"))
    else:
        head = b"NOTAPUSH" if malformed == "garbage" else b"PDPUSH02"
        hostile.call("link_raw", inbox=name, data_hex=(struct.pack("<8sH", head, 32) + bytes(32)).hex())
        bad = first
    bad.local.secret = bytes(range(32))  # nothing under it: this Register reads the link, then asks
    with pytest.raises(RequestFailedError):
        prefill.connect("x", bad)
    assert hostile.call("link_state", inbox=name)["hung_up"] is True
    _gone(prefill, "a", _job(prefill))
    with pytest.raises(RequestFailedError):  # a push read before the fault went with its link
        prefill.connect("p", pending)
    # The process may link again; what it sends on the new link is read.
    hostile.call("unlink", inbox=name)
    (again,) = _registrations(hostile.call("link", kind="good", inbox=name))
    prefill.connect("b", again)


def test_an_unsealed_arena_on_a_link_is_refused_and_the_link_goes_on(hostile: Child, prefill: LocalExecutor) -> None:
    name = _inbox(prefill)
    (bad,) = _registrations(hostile.call("link", kind="unsealed", inbox=name))
    (good,) = _registrations(hostile.call("link", kind="good", inbox=name))
    with pytest.raises(InvalidFieldError) as caught:
        prefill.connect("bad", bad)
    assert "F_SEAL_SHRINK" in caught.value.message
    prefill.connect("good", good)
    assert hostile.call("link_state", inbox=name)["hung_up"] is False


def test_an_inbox_that_reads_no_links_gets_a_connection_per_push(prefill: LocalExecutor) -> None:
    """An older prefill reads only a connection's first message; a decode links to no such inbox."""
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        older = server_info_pb2.LocalInbox()
        older.CopyFrom(prefill.inbox())
        older.ClearField("links")
        for peer in ("a", "b"):
            assert offer(rank.executor, server_info_pb2.PrefillServerInfo(local_inbox=older))
            prefill.connect(peer, rank.registration())
        server = _server(rank)
        assert (server.pushed, server.asked, server._links) == (2, 0, {})
    finally:
        rank.close()


def test_a_decode_links_anew_to_a_restarted_prefill_and_drops_the_dead_link() -> None:
    rank = DecodeRank.for_spec(SPEC, pages=8)
    try:
        for peer in ("first", "second"):
            prefill = LocalExecutor(arena_bytes=1 << 20, connect_timeout_s=2)
            try:
                assert offer(rank.executor, server_info_pb2.PrefillServerInfo(local_inbox=prefill.inbox()))
                prefill.connect(peer, rank.registration())
            finally:
                prefill.close()
        server = _server(rank)
        assert (server.pushed, server.asked, len(server._links)) == (2, 0, 1)
    finally:
        rank.close()
