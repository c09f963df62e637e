"""Decode-side fan-in (pdproto.negotiation.fanin): SUCCESS from every expected rank, FAILED with the first reason."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.negotiation.fanin import FanInTracker, KindTotals
from pdproto.v1 import common_pb2, transfer_pb2

S = common_pb2
OK, FAIL, MOVING = S.TRANSFER_STATE_SUCCESS, S.TRANSFER_STATE_FAILED, S.TRANSFER_STATE_TRANSFERRING


def status(rank: int, state: int, *, room: int = 7, gen: int = 1, code: str = "",
           reason: str = "", kv: int = 0, state_bytes: int = 0) -> transfer_pb2.TransferStatus:
    return transfer_pb2.TransferStatus(room=room, generation=gen, prefill_rank=rank, state=state,  # type: ignore[arg-type]
                                       failure_code=code, failure_reason=reason,
                                       bytes_transferred=kv, state_bytes=state_bytes)


def test_success_needs_every_expected_rank() -> None:
    t = FanInTracker()
    t.expect(7, 1, {0, 1})
    first = t.update(status(0, OK))
    assert first is not None and first.state == S.TRANSFER_STATE_BOOTSTRAPPING  # rank 1 not heard
    assert first.reported == {0} and not first.terminal
    done = t.update(status(1, OK))
    assert done is not None and done.state == OK and done.terminal


def test_one_failing_rank_fails_the_request_with_its_reason() -> None:
    t = FanInTracker()
    t.expect(7, 1, {0, 1})
    t.update(status(0, OK))
    out = t.update(status(1, FAIL, code="TRANSFER_FAILED", reason="rank 1 engine failed"))
    assert out is not None and out.state == FAIL
    assert (out.failure_code, out.failure_reason, out.failed_rank) == ("TRANSFER_FAILED", "rank 1 engine failed", 1)
    later = t.update(status(1, OK))  # nothing revives a failed request
    assert later is not None and later.state == FAIL


def test_dummies_other_rooms_and_stale_generations_are_ignored() -> None:
    t = FanInTracker()
    t.expect(7, 2, {0})
    assert t.update(status(3, FAIL)) is None           # a dummy or stranger
    assert t.update(status(0, FAIL, gen=1)) is None     # the previous generation
    assert t.update(status(0, OK, room=8)) is None      # a room not tracked
    out = t.update(status(0, OK, gen=2))
    assert out is not None and out.state == OK


def test_progress_is_the_least_advanced_rank() -> None:
    t = FanInTracker()
    t.expect(7, 1, {0, 1})
    out = t.update(status(0, MOVING))
    assert out is not None and out.state == S.TRANSFER_STATE_BOOTSTRAPPING  # rank 1 not heard yet
    out = t.update(status(1, S.TRANSFER_STATE_WAITING_FOR_INPUT))
    assert out is not None and out.state == S.TRANSFER_STATE_WAITING_FOR_INPUT


def test_totals_sum_the_latest_status_of_each_rank() -> None:
    t = FanInTracker()
    t.expect(7, 1, {0, 1})
    t.update(status(0, MOVING, kv=10))
    t.update(status(0, OK, kv=30, state_bytes=5))
    t.update(status(1, OK, state_bytes=7))
    assert KindTotals.of(t.statuses(7)) == KindTotals(kv_bytes=30, state_bytes=12)


def test_the_decode_can_fail_an_open_request_itself() -> None:
    t = FanInTracker()
    t.expect(7, 1, {0})
    out = t.fail(7, "DEADLINE_EXCEEDED", "no status in time")
    assert out is not None and out.state == FAIL and out.failed_rank is None
    assert t.fail(8, "X", "y") is None
    with pytest.raises(ValueError):
        t.expect(9, 1, set())


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([OK, FAIL, MOVING])), max_size=20))
def test_success_exactly_when_every_rank_succeeded_before_any_failed(events: list[tuple[int, int]]) -> None:
    t = FanInTracker()
    t.expect(7, 1, {0, 1, 2, 3})
    succeeded: set[int] = set()
    failed = False
    for rank, state in events:
        out = t.update(status(rank, state))
        assert out is not None
        if not failed and len(succeeded) < 4:
            if state == FAIL:
                failed = True
            elif state == OK:
                succeeded.add(rank)
            else:
                succeeded.discard(rank)
        assert (out.state == OK) == (not failed and len(succeeded) == 4)
        assert (out.state == FAIL) == failed


def test_senders_can_be_named_by_the_caller() -> None:
    t = FanInTracker()
    t.expect(7, 1, {10, 11})  # two DCP prefill ranks that both report prefill_rank 0
    assert t.update(status(0, OK), sender=10) is not None
    out = t.update(status(0, OK), sender=11)
    assert out is not None and out.state == OK
