"""A synthetic prefill for ``pdproto serve``: deterministic KV rows and chunks on demand.

Every source row holds ``data.token_rows`` of (entry, source row), and every room's pages
are a function of the room, so a decode can verify each received byte from first
principles (``SyntheticSpec.rows``, a ``data.Reference``) without trusting the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass

import numpy as np

from pdproto import backends
from pdproto.negotiation.topology import example_server_info
from pdproto.transfer import TransferExecutor, allocate
from pdproto.v1 import common_pb2, server_info_pb2

from pdproto_server.engine import KvSource, PrefillEngine

from .data import I64, U8, token_rows

log = logging.getLogger("pdproto_demo.synthetic")

_ATTENTION = {"mla": common_pb2.ATTENTION_KIND_MLA, "mha": common_pb2.ATTENTION_KIND_MHA,
              "hybrid-mla": common_pb2.ATTENTION_KIND_HYBRID_MLA}


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the synthetic KV pool and of the requests it produces."""

    layers: int = 4
    """Target KV entries (one per layer)."""
    row_bytes: int = 1152
    """Bytes per token per layer (576 bf16: an MLA latent row)."""
    pages: int = 256
    """Pages per entry."""
    page_size: int = 16
    """Tokens per page."""
    prompt_tokens: int = 200
    """Tokens every room's prefill produces."""
    chunk_tokens: int = 64
    """Tokens per chunk (rounded down to whole pages; the last chunk takes the rest)."""
    chunk_delay: float = 0.0
    """Seconds between chunks (models compute time; lets tests catch requests in flight)."""
    backend: str = "local"
    """Transfer backend served."""
    attention: str = "mla"
    """KV pool family: mla, mha or hybrid-mla."""
    kv_cache_dtype: str = "bfloat16"
    """KV dtype string."""
    model_id: str = "synthetic"
    """Model identity published to decodes."""

    @property
    def pages_per_room(self) -> int:
        """Pages one room's prompt occupies."""
        return -(-self.prompt_tokens // self.page_size)

    def rows(self, layer: int, room: int, tokens: I64) -> U8:
        """What a decode must hold for ``tokens`` (positions in the room's prompt) of an entry."""
        t = np.asarray(tokens, dtype=np.int64)
        pages = room_pages(room, self)
        return token_rows(layer, pages[t // self.page_size] * self.page_size + t % self.page_size,
                          self.row_bytes)


def room_pages(room: int, spec: SyntheticSpec) -> I64:
    """Source pages of a room's prompt, in token order (distinct within a room); read-only."""
    return _pages_from((room * 7919) % spec.pages, spec.pages_per_room, spec.pages)


@functools.lru_cache(maxsize=256)
def _pages_from(start: int, n: int, pages: int) -> I64:
    # Shared between rooms (hence read-only): building it costs a few numpy calls per room,
    # a visible share of the server's CPU in the control-plane benchmark.
    out = (start + np.arange(n, dtype=np.int64)) % pages
    out.flags.writeable = False
    return out


def server_info(spec: SyntheticSpec) -> server_info_pb2.PrefillServerInfo:
    """The PrefillServerInfo of a dense (TP 1, DCP 1) synthetic prefill."""
    info = example_server_info(page_size=spec.page_size, num_layers=spec.layers, token_bytes=spec.row_bytes,
                               dtype=spec.kv_cache_dtype, attention=_ATTENTION[spec.attention],
                               backends=[backends.by_name(spec.backend).enum], model_id=spec.model_id)
    info.capabilities.append("dcp-relayout")
    return info


def build_source(spec: SyntheticSpec, executor: TransferExecutor) -> KvSource:
    """Allocate, fill and register the synthetic KV pool."""
    rows_per_entry = spec.pages * spec.page_size
    buffers = []
    for entry in range(spec.layers):
        buf = allocate(rows_per_entry * spec.row_bytes)
        view = buf.array.reshape(rows_per_entry, spec.row_bytes)
        step = max(1, (4 << 20) // (spec.row_bytes * 4))  # bound the uint32 temporaries
        for lo in range(0, rows_per_entry, step):
            hi = min(lo + step, rows_per_entry)
            view[lo:hi] = token_rows(entry, np.arange(lo, hi, dtype=np.int64), spec.row_bytes)
        buffers.append(buf)
    executor.register_memory(buffers)
    return KvSource(buffers=tuple(buffers), info=server_info(spec))


class SyntheticProducer:
    """Plays the prefill scheduler: when a decode claims a room, emit its chunks."""

    def __init__(self, engine: PrefillEngine, spec: SyntheticSpec) -> None:
        self.engine = engine
        self.spec = spec
        self._tasks: set[asyncio.Task[None]] = set()
        engine.on_claim = self._claimed

    def _claimed(self, room: int) -> None:
        if not self.spec.chunk_delay:
            # Computed already (no delay): report every chunk now, as an engine that ran ahead would.
            for chunk in self._chunks(room):
                self.engine.submit_chunk(room, *chunk)
            return
        task = asyncio.get_running_loop().create_task(self._produce(room), name=f"synthetic-{room}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("synthetic producer failed", exc_info=task.exception())

    def _chunks(self, room: int) -> list[tuple[I64, int, bool]]:
        """The room's chunks in order: (pages, tokens, last)."""
        spec = self.spec
        pages = room_pages(room, spec)
        per_chunk = max(spec.page_size, spec.chunk_tokens // spec.page_size * spec.page_size)
        out = []
        done = 0
        while done < spec.prompt_tokens:
            n = min(per_chunk, spec.prompt_tokens - done)
            first = done // spec.page_size
            done += n
            out.append((pages[first:first + -(-n // spec.page_size)], n, done >= spec.prompt_tokens))
        return out

    async def _produce(self, room: int) -> None:
        for pages, n, last in self._chunks(room):
            await asyncio.sleep(self.spec.chunk_delay)
            self.engine.submit_chunk(room, pages, n, last_chunk=last)

    async def close(self) -> None:
        """Cancel chunk production."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


__all__ = ["SyntheticProducer", "SyntheticSpec", "build_source", "room_pages", "server_info"]
