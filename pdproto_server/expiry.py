"""Things to look at again at a given time, so that housekeeping costs what falls due, not what is kept.

The service keeps finished rooms, final statuses, gone peers and detached sessions for a
while; a tick that walked all of them would cost in proportion to everything retained (at
180,000 retained requests a tick took about 200 ms of the event loop). Instead each thing
is entered once, with the time it falls due, and a tick takes only the entries whose time
has come; it then looks at each one again (it may have changed: a room replaced, a
session resumed) and drops it or enters it again for later. ``work`` counts the entries
taken, so tests can check that a tick's cost follows what expired.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    """A heap of (due time, item): ``take_due`` pops exactly the items due by then."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._order = itertools.count()
        self.work = 0
        """Entries taken so far (each taken once)."""

    def add(self, due: float, item: T) -> None:
        """Look at ``item`` again at ``due`` (monotonic seconds)."""
        heapq.heappush(self._heap, (due, next(self._order), item))

    def take_due(self, now: float) -> list[T]:
        """Every item due at or before ``now``, oldest first, removed from the heap."""
        out: list[T] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        self.work += len(out)
        return out

    def __len__(self) -> int:
        return len(self._heap)


__all__ = ["Deadlines"]
