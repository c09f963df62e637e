"""Negotiation verdicts by registration layout, so a decode rank shape is negotiated once.

A fleet's decode ranks share a few shapes (one per TP and DCP rank of each decode
configuration), and a restarted decode registers the shape it had. ``negotiate`` is the
larger part of a Register's own cost (60 to 120 µs for a 4-entry MLA registration, several
ms for a 61-layer one); ``pdproto.topology.layout_of`` strips what differs between ranks
of one shape (pointers, endpoints), and the verdict on that layout is the verdict on every
registration with it. Computing it on the layout, not on the registration, makes the
cache exact: the stored verdict is a function of its key alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdproto.topology import Decision, Rejection, layout_of, negotiate
from pdproto.v1 import registration_pb2, server_info_pb2

MAX_LAYOUTS = 256
"""Layouts kept; past it the least recently used goes. A peer cycling through made-up layouts
only makes its own Registers pay for ``negotiate`` again."""


class Verdicts:
    """``negotiate(info, layout_of(reg))``, remembered by layout (least recently used out first).

    Safe from the loop and the judge thread together.
    """

    def __init__(self, size: int = MAX_LAYOUTS) -> None:
        """An empty memory of at most ``size`` layouts."""
        self._info: server_info_pb2.PrefillServerInfo | None = None
        self._size = size
        self._known: OrderedDict[bytes, tuple[Decision | Rejection, server_info_pb2.NegotiationResult]] = OrderedDict()
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
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                return (*known, True)
        verdict = negotiate(info, layout)
        known = verdict, verdict.to_proto()
        with self._lock:
            if info is self._info:
                self._known[key] = known
            if len(self._known) > self._size:
                self._known.popitem(last=False)
        return (*known, False)


def result_for(shared: server_info_pb2.NegotiationResult, peer_id: str) -> server_info_pb2.NegotiationResult:
    """A peer's own copy of a remembered ``NegotiationResult``, with its id."""
    result = server_info_pb2.NegotiationResult()
    result.CopyFrom(shared)
    result.peer_id = peer_id
    return result


__all__ = ["MAX_LAYOUTS", "Verdicts", "result_for"]
