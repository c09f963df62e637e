"""Negotiation verdicts by registration layout, so a decode rank shape is negotiated once.

A fleet's decode ranks share a few shapes (one per TP and DCP rank of each decode
configuration), and a restarted decode registers the shape it had. ``negotiate`` is the
larger part of a Register's own cost (60 to 120 µs for a 4-entry MLA registration, 0.4 ms for
a 61-layer one, 4 ms with 48 state entries of 12 tensors each, all on the event loop);
``pdproto.negotiation.topology.layout_of`` strips what differs between ranks
of one shape (pointers, endpoints), and the verdict on that layout is the verdict on every
registration with it. Computing it on the layout, not on the registration, makes the
cache exact: the stored verdict is a function of its key alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdproto.negotiation.topology import Decision, Rejection, layout_of, negotiate
from pdproto.v1 import registration_pb2, server_info_pb2

MAX_LAYOUTS = 256
"""Layouts kept; past it the least recently used goes. A peer cycling through made-up layouts
pushes others' out, and they pay for ``negotiate`` again: nothing else."""
MAX_BYTES = 1 << 20
"""What the kept verdicts may weigh in all, counted as each layout's bytes plus its result's
serialized bytes; in memory a verdict takes 11 to 18 times that (its ``Decision``'s plans as
Python objects: about 190 KB for a 61-layer rank with 48 state entries, 8 MB for one with
2,000), so this keeps the memory to about 20 MB whatever peers register. A verdict weighing
more than an eighth of it (from about 400 state entries of 12 tensors) is not kept, so a few
of them cannot push out every other."""

_Known = tuple[Decision | Rejection, server_info_pb2.NegotiationResult, int]


class Verdicts:
    """``negotiate(info, layout_of(reg))``, remembered by layout (least recently used out first).

    Safe from the loop and the judge thread together.
    """

    def __init__(self, size: int = MAX_LAYOUTS, budget: int = MAX_BYTES) -> None:
        """An empty memory of at most ``size`` layouts weighing at most ``budget`` bytes (``MAX_BYTES``)."""
        self._info: server_info_pb2.PrefillServerInfo | None = None
        self._size = size
        self._budget = budget
        self._weight = 0
        self._known: OrderedDict[bytes, _Known] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, info: server_info_pb2.PrefillServerInfo, registration: registration_pb2.KvRegistration
           ) -> tuple[Decision | Rejection, server_info_pb2.NegotiationResult, bool]:
        """The verdict on ``registration`` against ``info``, its ``NegotiationResult`` without a peer id
        (shared: copy it), and whether it was remembered.

        Raises what ``negotiate`` raises for malformed input (nothing is remembered then). A
        different ``info`` object than last time forgets every verdict.
        """
        layout = layout_of(registration)
        key = layout.SerializeToString(deterministic=True)
        with self._lock:
            if info is not self._info:
                self._info = info
                self._known.clear()
                self._weight = 0
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                return known[0], known[1], True
        verdict = negotiate(info, layout)
        result = verdict.to_proto()
        weight = len(key) + result.ByteSize()
        with self._lock:
            if info is self._info and key not in self._known and weight <= self._budget // 8:
                self._known[key] = (verdict, result, weight)
                self._weight += weight
                while len(self._known) > self._size or self._weight > self._budget:
                    self._weight -= self._known.popitem(last=False)[1][2]
        return verdict, result, False

    @property
    def weight(self) -> int:
        """What the kept verdicts weigh (``MAX_BYTES``'s measure)."""
        return self._weight

    def __len__(self) -> int:
        """Layouts kept."""
        return len(self._known)


def result_for(shared: server_info_pb2.NegotiationResult, peer_id: str) -> server_info_pb2.NegotiationResult:
    """A peer's own copy of a remembered ``NegotiationResult``, with its id."""
    result = server_info_pb2.NegotiationResult()
    result.CopyFrom(shared)
    result.peer_id = peer_id
    return result


__all__ = ["MAX_BYTES", "MAX_LAYOUTS", "Verdicts", "result_for"]
