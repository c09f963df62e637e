"""How an engine executor moves a job's units: per-row, the packed pipeline, or packed inline.

``EngineExecutor`` (``_engine.py``) checks a job, picks one of these paths and keeps the
books; the paths turn units (one layer of one segment each) into descriptor batches for
the engine hooks ``_submit`` and ``_wait``. Every path waits out what it submitted before
it returns or raises, so no engine read outlives the call.

* per-row (``_run_rows``): descriptors straight from the source buffers, one batch per unit.
* pipelined (``_run_packed``): a pack thread gathers unit i+1 into staging while unit i
  is in flight; one batch per unit.
* inline (``_run_inline``): jobs of at most ``inline_bytes`` are gathered on the calling
  thread and go out as one batch with one wait (``docs/transfer.md``, "Small chunks").
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pdproto.dcp.runs import source_rows
from pdproto.errors import DeadlineExceededError, PdprotoError, Reason

from ..base import Buffer, LayerSpan, MemoryKind, Runs, Segment
from ..packing import Descs, Gatherer, packed_units, row_descriptors

if TYPE_CHECKING:
    from ._engine import PeerState

Inflight = collections.deque[tuple[Any, int, int, int]]
"""Submitted batches: (engine handle, first staging byte read, end byte, descriptors)."""

Units = list[tuple[Segment, LayerSpan]]

INLINE_BYTES = 4 << 20
"""Default ``inline_bytes``: up to 4 MiB, packing inline was never slower than the pipeline on
Mooncake TCP or NIXL UCX, for 4 to 32 layers; at 8 MiB a 4-layer job was (docs/transfer.md, "Small chunks")."""


def gather_indexes(units: Units) -> dict[int, Runs]:
    """The gather index of each segment (by ``id``), built once and shared by its layers."""
    indexes: dict[int, Runs] = {}
    for seg, _ in units:
        if id(seg) not in indexes:
            indexes[id(seg)] = source_rows(seg.runs)
    return indexes


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

    def _push(self, peer: PeerState, inflight: Inflight, descs: Descs, mem: tuple[MemoryKind, int],
              lo: int = 0, hi: int = 0) -> None:
        """Submit ``descs`` in engine-sized batches, first waiting out what would overflow the queue."""
        cap = self._max_inflight_descs()
        for i in range(0, len(descs), self.max_batch):
            chunk = descs[i:i + self.max_batch]
            while inflight and sum(e[3] for e in inflight) + len(chunk) > cap:
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
            inflight.append((handle, lo, hi, len(chunk)))

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

    def _run_rows(self, peer: PeerState, units: Units) -> int:
        """Per-row (run-merged) descriptors straight from the source buffers."""
        total = 0
        with self._inflight(peer) as inflight:
            for seg, layer in units:
                descs = row_descriptors(layer, seg.runs)
                self._push(peer, inflight, descs, self._kind_of(layer.src_ptr))
                total += len(descs)
        return total

    def _run_packed(self, peer: PeerState, units: Units,
                    extent: tuple[int, int]) -> tuple[int, float]:
        """Pack unit i+1 on the pack thread while unit i is transferred from another part of the extent.

        Units (one layer of one segment each) take consecutive byte ranges of the job's
        staging extent and wrap to its start when the next does not fit; a range is packed
        again only after every transfer that read any byte of it completed. An extent that
        holds two units' rows gives full overlap; one that holds only one, none.
        """
        staging = self._staging
        assert staging is not None  # checked by the caller
        base, length = extent
        places: list[tuple[int, int]] = []
        cursor = 0
        for seg, layer in units:
            size = seg.num_rows * layer.nbytes
            if cursor + size > length:
                cursor = 0
            places.append((cursor, cursor + size))
            cursor += size
        indexes = gather_indexes(units)

        def pack(i: int) -> float:
            """Gather unit i into its range (runs on the pack thread); returns seconds."""
            seg, layer = units[i]
            tp = time.perf_counter()
            lo, hi = places[i]
            self._gather(seg, layer, base + lo, base + hi, indexes[id(seg)])
            return time.perf_counter() - tp

        def overlaps(i: int, entry: tuple[Any, int, int, int]) -> bool:
            return entry[1] < places[i][1] and places[i][0] < entry[2]

        total = 0
        pack_s = 0.0
        mem = (staging.kind, staging.device)
        pending: Future[float] | None = None
        with self._inflight(peer) as inflight:
            try:
                pending = self._pack_pool().submit(pack, 0)
                # Cut while unit 0 is packed: once per segment, not once per unit.
                unit_descs = packed_units(units, [staging.addr + base + lo for lo, _ in places])
                for i in range(len(units)):
                    current, pending = pending, None
                    assert current is not None  # every iteration starts with unit i being packed
                    pack_s += current.result()
                    lo, hi = places[i]
                    descs = unit_descs[i]
                    total += len(descs)
                    nxt = i + 1
                    # Engines that copy inside the submit call overlap it with packing unit i+1,
                    # unless i+1 reuses i's bytes; async engines get unit i moving first.
                    late = self.submit_blocks and nxt < len(units) and not (
                        places[nxt][0] < hi and lo < places[nxt][1])
                    if not late:
                        self._push(peer, inflight, descs, mem, lo, hi)
                    if nxt < len(units):
                        while any(overlaps(nxt, e) for e in inflight):
                            self._finish(peer, inflight.popleft()[0])
                        pending = self._pack_pool().submit(pack, nxt)
                    if late:
                        self._push(peer, inflight, descs, mem, lo, hi)
            finally:
                if pending is not None:
                    pending.exception()  # never leave the pack thread writing staging behind us
        return total, pack_s

    def _gather(self, seg: Segment, layer: LayerSpan, lo: int, hi: int, index: Runs, *, sync: bool = True) -> None:
        """Gather one unit's source rows into staging bytes [lo, hi) (``sync``: see ``Gatherer.gather``)."""
        staging = self._staging
        assert staging is not None
        _, smax, _, _ = seg.extents
        src = self._view(layer.src_ptr + layer.src_offset, smax * layer.row_bytes + layer.nbytes)
        out = staging.array[lo:hi].reshape(seg.num_rows, layer.nbytes)
        self._gatherer.gather(src, layer.row_bytes, seg.runs, out, index, sync=sync)

    def _run_inline(self, peer: PeerState, units: Units,
                    extent: tuple[int, int]) -> tuple[int, float]:
        """Pack every unit here, back to back in the extent, then send them all as one engine call.

        Below ``inline_bytes`` the pipeline's per-unit costs (a hop to the pack thread, an
        engine handle and a wait per unit) outweigh what overlapping pack and transfer
        saves (``docs/transfer.md``, "Small chunks").
        """
        staging = self._staging
        assert staging is not None  # checked by the caller
        tp = time.perf_counter()
        indexes = gather_indexes(units)
        starts: list[int] = []
        cursor = extent[0]
        for i, (seg, layer) in enumerate(units):
            size = seg.num_rows * layer.nbytes
            # One stream carries every gather: waiting for the last waits for them all.
            self._gather(seg, layer, cursor, cursor + size, indexes[id(seg)], sync=i == len(units) - 1)
            starts.append(staging.addr + cursor)
            cursor += size
        pack_s = time.perf_counter() - tp
        parts = packed_units(units, starts)
        descs = parts[0] if len(parts) == 1 else np.concatenate(parts)
        with self._inflight(peer) as inflight:
            self._push(peer, inflight, descs, (staging.kind, staging.device))
        return len(descs), pack_s

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


__all__ = ["INLINE_BYTES", "Inflight", "JobPaths", "Units", "gather_indexes"]
