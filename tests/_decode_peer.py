"""A decode rank for tests: its own shared-memory KV pool (local executor), registration, byte checks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR
from pdproto.transfer import Buffer, TransferExecutor, create_executor, set_endpoint
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2
from pdproto_server.synthetic import SyntheticSpec, expected_rows

BACKGROUND = 0xA5
_ports = itertools.count(41000)


@dataclass
class DecodePeer:
    """One decode rank of a DCP group (size 1 = plain TP) with ``pages`` pages per layer."""

    spec: SyntheticSpec
    dcp_size: int = 1
    dcp_rank: int = 0
    pages: int = 64
    backend: str = "local"
    kv_dtype: str = "bfloat16"
    attention: int = common_pb2.ATTENTION_KIND_MLA
    executor: TransferExecutor = field(init=False)
    buffers: list[Buffer] = field(init=False)
    notify_port: int = field(default_factory=lambda: next(_ports))

    def __post_init__(self) -> None:
        rows = self.pages * self.spec.page_size
        self.executor = create_executor(self.backend,
                                        arena_bytes=self.spec.layers * rows * self.spec.row_bytes + (1 << 20))
        self.buffers = [self.executor.allocate(rows * self.spec.row_bytes) for _ in range(self.spec.layers)]
        self.executor.register_memory(self.buffers)  # a no-op for local arena buffers
        for b in self.buffers:
            b.array[:] = BACKGROUND

    def registration(self) -> registration_pb2.KvRegistration:
        """The KvRegistration of this rank."""
        s = self.spec
        reg = registration_pb2.KvRegistration(
            version=common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR),
            notify_endpoint=common_pb2.Endpoint(host="127.0.0.1", port=self.notify_port),
            attn_tp=common_pb2.ParallelGroup(size=1, rank=0),
            dcp=common_pb2.ParallelGroup(size=self.dcp_size, rank=self.dcp_rank),
            pp=common_pb2.ParallelGroup(size=1, rank=0),
            page_size=s.page_size, kv_cache_dtype=self.kv_dtype, model_id=s.model_id,
            attention_kind=self.attention,  # type: ignore[arg-type]
        )
        set_endpoint(reg, self.executor.endpoint())
        reg.kv_buffers.extend(b.kv_buffer(item_len=s.row_bytes * s.page_size) for b in self.buffers)
        return reg

    def pages_for(self, tokens: int, first_page: int = 0) -> list[int]:
        """Destination pages this rank needs for ``tokens`` global tokens (reversed, to be non-trivial)."""
        local = -(-tokens // self.dcp_size)
        n = -(-local // self.spec.page_size)
        return list(range(first_page + n - 1, first_page - 1, -1))

    def transfer(self, room: int, pages: list[int], generation: int = 0) -> transfer_pb2.TransferInfo:
        """The TransferInfo for one request."""
        return transfer_pb2.TransferInfo(room=room, generation=generation, dst_kv_pages=pages,
                                         notify_endpoint=common_pb2.Endpoint(host="127.0.0.1",
                                                                             port=self.notify_port),
                                         decode_prefix_len=0)

    def verify(self, rooms: dict[int, list[int]]) -> int:
        """Assert every byte of every layer: planned rows hold the room's tokens, the rest background."""
        s = self.spec
        checked = 0
        for entry, buf in enumerate(self.buffers):
            want = np.full_like(buf.array, BACKGROUND).reshape(-1, s.row_bytes)
            for room, pages in rooms.items():
                tokens = np.arange(self.dcp_rank, s.prompt_tokens, self.dcp_size, dtype=np.int64)
                local = tokens // self.dcp_size
                rows = np.asarray(pages, dtype=np.int64)[local // s.page_size] * s.page_size + local % s.page_size
                want[rows] = expected_rows(entry, room, tokens, s)
            got = buf.array.reshape(-1, s.row_bytes)
            bad = np.flatnonzero((got != want).any(axis=1))
            assert bad.size == 0, f"entry {entry}: {bad.size} rows differ (first {bad[:5].tolist()})"
            checked += got.nbytes
        return checked

    def close(self) -> None:
        """Release the arena."""
        self.executor.close()


__all__ = ["BACKGROUND", "DecodePeer"]
