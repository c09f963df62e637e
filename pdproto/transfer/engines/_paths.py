"""How an engine executor moves a job's units: per-row, or packed through staging (inline or pipelined).

``EngineExecutor`` (``_engine.py``) checks a job, picks one of these paths and keeps the
books; the paths turn units (one layer of one segment each) into descriptor batches for
the engine hooks ``_submit`` and ``_wait``. Every path waits out what it submitted before
it returns or raises, so no engine read outlives the call. The paths themselves, groups,
inline and pipelined: this package's README, "Packing".
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pdproto.dcp.runs import source_rows
from pdproto.errors import DeadlineExceededError, PdprotoError, Reason

from ..base import Buffer, LayerSpan, MemoryKind, Runs, Segment
from ..packing import Descs, Gatherer, packed_layers, row_layers

if TYPE_CHECKING:
    from ._engine import PeerState

Inflight = collections.deque[tuple[Any, int, int, int]]
"""Submitted batches: (engine handle, first staging byte read, end byte, descriptors)."""

Units = list[tuple[Segment, LayerSpan]]

INLINE_BYTES = 4 << 20
"""Default ``inline_bytes``: up to 4 MiB, packing inline was never slower than the pipeline on
Mooncake TCP or NIXL UCX, for 4 to 32 layers; at 8 MiB a 4-layer job was (docs/transfer.md, "Small chunks")."""


def _segment_spans(units: Units) -> list[tuple[int, int]]:
    """Unit ranges [a, b) of one segment each: ``TransferJob.units`` lists a segment's layers together."""
    spans: list[tuple[int, int]] = []
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i][0] is not units[i - 1][0]:
            spans.append((spans[-1][1] if spans else 0, i))
    return spans


class _Cuts:
    """A job's gather indexes and descriptors, each made once per segment when first needed.

    Made lazily, a later segment's (a later chunk's, the state's) cost lands while earlier
    groups are in flight instead of before the first byte moves.
    """

    def __init__(self, units: Units, starts: Sequence[int]) -> None:
        self.units, self.starts = units, starts
        self._index: dict[int, Runs] = {}
        self._descs: list[Descs | None] = [None] * len(units)
        self._span = [span for span in _segment_spans(units) for _ in range(*span)]

    def index(self, seg: Segment) -> Runs:
        """The segment's gather index (``source_rows``), shared by its layers."""
        if id(seg) not in self._index:
            self._index[id(seg)] = source_rows(seg.runs)
        return self._index[id(seg)]

    def descs(self, a: int, b: int) -> Descs:
        """Descriptors of units [a, b), as one array; each segment's units are cut together."""
        for i in range(a, b):
            if self._descs[i] is None:
                first, end = self._span[i]
                self._descs[first:end] = packed_layers(self.starts[first:end],
                                                       [layer for _, layer in self.units[first:end]],
                                                       self.units[first][0].runs)
        parts = [d for d in self._descs[a:b] if d is not None]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def counts(self) -> list[int]:
        """Descriptors per unit (units never cut count 0: their job failed first)."""
        return [0 if d is None else len(d) for d in self._descs]


class JobPaths:
    """The execution paths of ``EngineExecutor``; it supplies the state declared here and the hooks."""

    max_batch = 1 << 20
    """Most descriptors one ``_submit`` call may carry."""
    submit_blocks = False
    """True when ``_submit`` itself moves the bytes (NIXL over UCX shared memory)."""
    inline_bytes: int
    _lock: threading.Lock
    _staging: Buffer | None
    _gatherer: Gatherer
    _pool: ThreadPoolExecutor | None
    _handles: int

    # ---- hooks for engine subclasses ------------------------------------------------------
    def _submit(self, peer: PeerState, descs: Descs, kind: MemoryKind, device: int) -> Any:
        raise NotImplementedError

    def _wait(self, peer: PeerState, handle: Any) -> None:
        raise NotImplementedError

    if TYPE_CHECKING:
        def _view(self, addr: int, nbytes: int) -> Any: ...

        def _kind_of(self, addr: int) -> tuple[MemoryKind, int]: ...

    # ---- paths -------------------------------------------------------------------------------
    def _max_inflight_descs(self) -> int:
        """Most descriptors queued at once per job; engines with a bounded queue lower it."""
        return 1 << 40

    def _queued(self, descs: Descs) -> int:
        """Descriptors a ``_submit`` of ``descs`` queues in the engine (more where the engine adds its own)."""
        return len(descs)

    def _push(self, peer: PeerState, inflight: Inflight, descs: Descs, mem: tuple[MemoryKind, int],
              lo: int = 0, hi: int = 0) -> None:
        """Submit ``descs`` in engine-sized batches, first waiting out what would overflow the queue."""
        cap = self._max_inflight_descs()
        for i in range(0, len(descs), self.max_batch):
            chunk = descs[i:i + self.max_batch]
            queued = self._queued(chunk)
            while inflight and sum(e[3] for e in inflight) + queued > cap:
                self._finish(peer, inflight.popleft()[0])
            # The caller was told DEADLINE_EXCEEDED at the deadline: a slow peer's job that
            # comes back from a wait after it must not write the pages of layers still to go.
            if time.monotonic() > peer.deadline:
                raise DeadlineExceededError(
                    "the transfer ran past its deadline; its remaining batches were not sent",
                    reason=Reason.DEADLINE_EXCEEDED, metadata={"peer": peer.peer_id})
            handle = self._submit(peer, chunk, mem[0], mem[1])
            with self._lock:
                self._handles += 1
            inflight.append((handle, lo, hi, queued))

    @contextlib.contextmanager
    def _inflight(self, peer: PeerState) -> Iterator[Inflight]:
        """The queue a path submits batches to: waited out when the block ends; when it raises, still
        waited out (errors ignored), so no engine read outlives its buffer."""
        inflight: Inflight = collections.deque()
        try:
            yield inflight
            while inflight:
                self._finish(peer, inflight.popleft()[0])
        finally:
            for handle, *_ in list(inflight):
                try:
                    self._finish(peer, handle)
                except PdprotoError:
                    pass

    def _run_rows(self, peer: PeerState, units: Units) -> list[int]:
        """Per-row (run-merged) descriptors straight from the source buffers; descriptors per unit.

        Consecutive units from the same kind of memory go out as one batch (split only at the
        engine's batch limit), so a job costs one submit and one wait, not one per layer.
        """
        parts: list[Descs] = []
        for a, b in _segment_spans(units):
            parts += row_layers([layer for _, layer in units[a:b]], units[a][0].runs)
        kinds = [self._kind_of(layer.src_ptr) for _, layer in units]
        with self._inflight(peer) as inflight:
            first = 0
            for i in range(1, len(units) + 1):
                if i == len(units) or kinds[i] != kinds[first]:
                    batch = parts[first] if i - first == 1 else np.concatenate(parts[first:i])
                    self._push(peer, inflight, batch, kinds[first])
                    first = i
        return [len(d) for d in parts]

    def _run_packed(self, peer: PeerState, units: Units,
                    extent: tuple[int, int]) -> tuple[list[int], float, bool]:
        """Pack through the job's staging extent in groups of units, one engine batch per group.

        Consecutive units join one group up to ``inline_bytes`` (never past the extent), so
        small units (a state slot's tensors, the aux row, short chunks) go out together and a
        large KV layer alone. A job within that size is gathered here and sent with one wait
        (the inline path, ``docs/transfer.md``, "Small chunks"); otherwise the pack thread
        gathers group g+1 while group g is in flight. Groups take consecutive byte ranges of the extent and
        wrap to its start when the next does not fit; a range is packed again only after every
        transfer that read any byte of it completed. Returns (descriptors per unit, pack
        seconds, inline).
        """
        staging = self._staging
        assert staging is not None  # checked by the caller
        base, length = extent
        sizes = [seg.num_rows * layer.nbytes for seg, layer in units]
        cap = min(self.inline_bytes, length)
        groups: list[tuple[int, int]] = []  # unit ranges [a, b)
        first, size = 0, 0
        for i, n in enumerate(sizes):
            if i > first and size + n > cap:
                groups.append((first, i))
                first, size = i, 0
            size += n
        groups.append((first, len(units)))
        places: list[tuple[int, int]] = []  # each group's staging bytes, relative to the extent
        starts: list[int] = []  # each unit's staging address
        cursor = 0
        for a, b in groups:
            size = sum(sizes[a:b])
            if cursor + size > length:
                cursor = 0
            places.append((cursor, cursor + size))
            for n in sizes[a:b]:
                starts.append(staging.addr + base + cursor)
                cursor += n
        cuts = _Cuts(units, starts)

        def pack(g: int) -> float:
            """Gather group g's units into their ranges, back to back; returns seconds."""
            tp = time.perf_counter()
            a, b = groups[g]
            for i in range(a, b):
                seg, layer = units[i]
                lo = starts[i] - staging.addr
                # One stream carries the group's gathers: waiting for the last waits for them all.
                self._gather(seg, layer, lo, lo + sizes[i], cuts.index(seg), sync=i == b - 1)
            return time.perf_counter() - tp

        def overlaps(g: int, entry: tuple[Any, int, int, int]) -> bool:
            return entry[1] < places[g][1] and places[g][0] < entry[2]

        mem = (staging.kind, staging.device)
        if sum(sizes) <= cap:  # one group and no transfer to overlap: no hop to the pack thread
            pack_s = pack(0)
            with self._inflight(peer) as inflight:
                self._push(peer, inflight, cuts.descs(0, len(units)), mem)
            return cuts.counts(), pack_s, True
        pack_s = 0.0
        pending: Future[float] | None = None
        with self._inflight(peer) as inflight:
            try:
                pending = self._pack_pool().submit(pack, 0)
                descs = cuts.descs(*groups[0])  # cut while group 0 is packed
                for g in range(len(groups)):
                    current, pending = pending, None
                    assert current is not None  # every iteration starts with group g being packed
                    pack_s += current.result()
                    lo, hi = places[g]
                    nxt = g + 1
                    # Engines that copy inside the submit call overlap it with packing group g+1,
                    # unless g+1 reuses g's bytes; async engines get group g moving first.
                    late = self.submit_blocks and nxt < len(groups) and not (
                        places[nxt][0] < hi and lo < places[nxt][1])
                    if not late:
                        self._push(peer, inflight, descs, mem, lo, hi)
                    if nxt < len(groups):
                        while any(overlaps(nxt, e) for e in inflight):
                            self._finish(peer, inflight.popleft()[0])
                        pending = self._pack_pool().submit(pack, nxt)
                    if late:
                        self._push(peer, inflight, descs, mem, lo, hi)
                    if nxt < len(groups):
                        descs = cuts.descs(*groups[nxt])  # cut while group g+1 is packed
            finally:
                if pending is not None:
                    pending.exception()  # never leave the pack thread writing staging behind us
        return cuts.counts(), pack_s, False

    def _gather(self, seg: Segment, layer: LayerSpan, lo: int, hi: int, index: Runs, *, sync: bool = True) -> None:
        """Gather one unit's source rows into staging bytes [lo, hi) (``sync``: see ``Gatherer.gather``)."""
        staging = self._staging
        assert staging is not None
        _, smax, _, _ = seg.extents
        src = self._view(layer.src_ptr + layer.src_offset, smax * layer.row_bytes + layer.nbytes)
        out = staging.array[lo:hi].reshape(seg.num_rows, layer.nbytes)
        self._gatherer.gather(src, layer.row_bytes, seg.runs, out, index, sync=sync)

    def _pack_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdproto-pack")
            return self._pool

    def _finish(self, peer: PeerState, handle: Any) -> None:
        """Wait for one submitted batch; it no longer counts as held, whatever the outcome."""
        try:
            self._wait(peer, handle)
        finally:
            with self._lock:
                self._handles -= 1


__all__ = ["INLINE_BYTES", "Inflight", "JobPaths", "Units"]
