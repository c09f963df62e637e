"""Decode-side fan-in: one request's outcome from the statuses of every prefill rank feeding it.

A decode rank fed by several prefill ranks (``pdproto.negotiation.senders``) receives one status stream
per rank. ``FanInTracker`` folds them into one outcome per request, as SGLang's decode does
with ``prefill_response_tracker`` (``common/conn.py:921-977``), with two differences: a
failure keeps the failing rank's reason code and text, and statuses of another generation
of the room are ignored instead of counted.

* SUCCESS only when every expected (non-dummy) rank reported SUCCESS;
* FAILED as soon as any expected rank reports FAILED, with that rank's reason (the first
  failure wins; later statuses change nothing);
* otherwise the least advanced state among the expected ranks (a rank not heard from yet
  counts as BOOTSTRAPPING), as SGLang MIN-reduces its polls.

Statuses from ranks the request does not wait for (dummies) are ignored. Plain Python with
no locking: one owner (a decode scheduler thread, or an event loop) feeds it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from pdproto.v1 import common_pb2, transfer_pb2

_TERMINAL = {common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED}
_ORDER = {
    common_pb2.TRANSFER_STATE_UNSPECIFIED: 0,
    common_pb2.TRANSFER_STATE_BOOTSTRAPPING: 1,
    common_pb2.TRANSFER_STATE_WAITING_FOR_INPUT: 2,
    common_pb2.TRANSFER_STATE_TRANSFERRING: 3,
    common_pb2.TRANSFER_STATE_SUCCESS: 4,
}


@dataclass(frozen=True)
class KindTotals:
    """Bytes and descriptors per kind, summed over a request's prefill ranks."""

    kv_bytes: int = 0
    aux_bytes: int = 0
    state_bytes: int = 0
    kv_descriptors: int = 0
    aux_descriptors: int = 0
    state_descriptors: int = 0

    @classmethod
    def of(cls, statuses: Iterable[transfer_pb2.TransferStatus]) -> KindTotals:
        """The sums over ``statuses``."""
        s = list(statuses)
        return cls(sum(x.bytes_transferred for x in s), sum(x.aux_bytes for x in s),
                   sum(x.state_bytes for x in s), sum(x.descriptors for x in s),
                   sum(x.aux_descriptors for x in s), sum(x.state_descriptors for x in s))


@dataclass(frozen=True)
class Outcome:
    """A request's combined state over its prefill ranks."""

    state: int
    """``TransferState`` value."""
    failure_code: str = ""
    """The failing rank's reason code; empty unless FAILED."""
    failure_reason: str = ""
    """The failing rank's reason text; empty unless FAILED."""
    failed_rank: int | None = None
    """The prefill rank whose failure ended the request."""
    reported: frozenset[int] = frozenset()
    """Expected prefill ranks that reported SUCCESS so far."""

    @property
    def terminal(self) -> bool:
        """SUCCESS or FAILED: nothing changes it any more."""
        return self.state in _TERMINAL


@dataclass
class _Room:
    generation: int
    expected: frozenset[int]
    latest: dict[int, transfer_pb2.TransferStatus] = field(default_factory=dict)
    outcome: Outcome = field(default_factory=lambda: Outcome(common_pb2.TRANSFER_STATE_BOOTSTRAPPING))


class FanInTracker:
    """Folds the per-rank statuses of many requests into one outcome each (module docstring)."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Room] = {}

    def expect(self, room: int, generation: int, prefill_ranks: Collection[int]) -> None:
        """Start (or restart, for a new generation) tracking ``room`` over ``prefill_ranks``."""
        if not prefill_ranks:
            raise ValueError(f"room {room}: a request must wait for at least one prefill rank")
        self._rooms[room] = _Room(generation, frozenset(prefill_ranks))

    def update(self, status: transfer_pb2.TransferStatus, *, sender: int | None = None) -> Outcome | None:
        """Apply one prefill rank's status; the room's new outcome, or None if it was ignored.

        ``sender`` names the rank when its ``prefill_rank`` does not tell the senders apart
        (e.g. a DCP prefill group whose ranks share one TP rank); it must match ``expect``.
        """
        key = status.prefill_rank if sender is None else sender
        r = self._rooms.get(status.room)
        if r is None or status.generation != r.generation or key not in r.expected:
            return None
        if r.outcome.terminal:
            return r.outcome
        r.latest[key] = status
        if status.state == common_pb2.TRANSFER_STATE_FAILED:
            r.outcome = Outcome(common_pb2.TRANSFER_STATE_FAILED, status.failure_code,
                                status.failure_reason, key, r.outcome.reported)
            return r.outcome
        done = frozenset(k for k, s in r.latest.items() if s.state == common_pb2.TRANSFER_STATE_SUCCESS)
        if done == r.expected:
            r.outcome = Outcome(common_pb2.TRANSFER_STATE_SUCCESS, reported=done)
            return r.outcome
        least = min(r.expected, key=lambda k: _ORDER.get(
            r.latest[k].state if k in r.latest else common_pb2.TRANSFER_STATE_BOOTSTRAPPING, 0))
        state = r.latest[least].state if least in r.latest else common_pb2.TRANSFER_STATE_BOOTSTRAPPING
        r.outcome = Outcome(state, reported=done)
        return r.outcome

    def fail(self, room: int, code: str, reason: str) -> Outcome | None:
        """Fail an open request from the decode's side (a stream lost, a deadline); None if unknown."""
        r = self._rooms.get(room)
        if r is None:
            return None
        if not r.outcome.terminal:
            r.outcome = Outcome(common_pb2.TRANSFER_STATE_FAILED, code, reason, None, r.outcome.reported)
        return r.outcome

    def statuses(self, room: int) -> list[transfer_pb2.TransferStatus]:
        """The latest status of each expected rank heard from (empty when the room is not tracked)."""
        r = self._rooms.get(room)
        return list(r.latest.values()) if r is not None else []

    def forget(self, room: int) -> None:
        """Stop tracking ``room``."""
        self._rooms.pop(room, None)


__all__ = ["FanInTracker", "KindTotals", "Outcome"]
