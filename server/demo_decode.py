"""A decode rank as its own process: registered KV memory, the handshake client, byte checks.

Run as ``python -m pdproto_server.demo_decode --backend nixl --dcp-size 4 --dcp-rank 1 ...``;
it then answers JSON-line commands (see ``pdproto_server.demo_proc``): ``connect`` registers
with prefill ranks, ``request`` fills the decode prefix and submits the destination pages,
``wait`` waits for every prefill rank's terminal status and compares every byte of the pool
with the monolithic reference.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR
from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError, Reason
from pdproto.transfer import create_executor, set_endpoint
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2
from . import demo_data as data
from .demo_proc import Reply, redirect_stdout_to_stderr, serve_commands
from .transfers import notice_generation


# Field 9999, varint 1: what a newer schema generation would add; protobuf keeps it as unknown.
_UNKNOWN_FIELD = bytes([0xF8, 0xF0, 0x04, 0x01])


@dataclass
class Target:
    """One prefill rank this decode rank registered with."""

    address: str
    client: HandshakeClient
    peer_id: str
    mode: int


@dataclass
class Pending:
    """One submitted request and what the pool must hold once it completes."""

    prefix: int
    total: int
    prefix_pages: list[int]
    dst_pages: list[int]
    generation: int
    submitted: float = field(default_factory=time.monotonic)


def build_registration(backend_endpoint: Any, bufs: list[Any], *, page_size: int, dcp_size: int,
                       dcp_rank: int, notify_port: int, minor: int = PROTOCOL_MINOR) -> registration_pb2.KvRegistration:
    """The KvRegistration of a DCP-sharded MLA decode rank owning ``bufs`` (one per layer)."""
    reg = registration_pb2.KvRegistration(
        version=common_pb2.ProtocolVersion(major=PROTOCOL_MAJOR, minor=minor),
        capabilities=["dcp-relayout", "packed"],
        notify_endpoint=common_pb2.Endpoint(host="127.0.0.1", port=notify_port),
        attn_tp=common_pb2.ParallelGroup(size=1, rank=0),
        dcp=common_pb2.ParallelGroup(size=dcp_size, rank=dcp_rank),
        pp=common_pb2.ParallelGroup(size=1, rank=0),
        page_size=page_size,
        kv_cache_dtype="bfloat16",
        attention_kind=common_pb2.ATTENTION_KIND_MLA,
        kv_item_len=page_size * data.ROW_BYTES,
    )
    set_endpoint(reg, backend_endpoint)
    for layer, buf in enumerate(bufs):
        reg.kv_buffers.append(buf.kv_buffer(item_len=page_size * data.ROW_BYTES, layer_id=layer))
    return reg


class DecodeRank:
    """State of one decode rank process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shard = data.Shard(args.dcp_size, args.dcp_rank)
        rows = args.pages * args.page_size
        # The local backend names its /dev/shm arena itself (pid + uuid), so a restart never collides.
        self.executor = create_executor(args.backend, name=None if args.backend == "local" else args.name,
                                        arena_bytes=args.layers * rows * data.ROW_BYTES + (1 << 20))
        self.bufs = [self.executor.allocate(rows * data.ROW_BYTES) for _ in range(args.layers)]
        self.executor.register_memory(self.bufs)
        self.pool = [np.asarray(b.array).reshape(rows, data.ROW_BYTES) for b in self.bufs]
        for arr in self.pool:
            arr.fill(data.BACKGROUND)
        self.targets: list[Target] = []
        self.pending: dict[int, Pending] = {}
        self.notices: collections.Counter[tuple[int, int]] = collections.Counter()
        """Chunk-completion notices received through the engine, by (room, generation) (NIXL only)."""

    def connect(self, targets: list[str], token: str | None = None, minor: int = PROTOCOL_MINOR,
                timeout: float = 20.0, unknown_field: bool = False, root_cert: str | None = None) -> Reply:
        """Register with every prefill rank in ``targets`` (host:port); optionally as a newer build."""
        for old in self.targets:
            old.client.close()
        self.targets = []
        reg = build_registration(self.executor.endpoint(), self.bufs, page_size=self.args.page_size,
                                 dcp_size=self.args.dcp_size, dcp_rank=self.args.dcp_rank,
                                 notify_port=self.args.notify_port, minor=minor)
        if unknown_field:
            reg.MergeFromString(_UNKNOWN_FIELD)
        for address in targets:
            client = self._reach(address, token, timeout, root_cert)
            result = client.register(reg)
            self.targets.append(Target(address, client, result.peer_id, int(result.mode)))
        return {"peers": [t.peer_id for t in self.targets], "modes": [t.mode for t in self.targets]}

    @staticmethod
    def _reach(address: str, token: str | None, timeout: float, root_cert: str | None) -> HandshakeClient:
        """A client whose server answered GetServerInfo; keeps trying a restarting prefill until ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            client = HandshakeClient(address, token=token, timeout=min(timeout, 5.0), root_cert=root_cert,
                                     server_name="localhost" if root_cert else None)
            try:
                client.get_server_info()
                return client
            except PdprotoError as exc:
                client.close()
                if exc.reason is not Reason.UNAVAILABLE or time.monotonic() + 0.5 >= end:
                    raise
                time.sleep(0.5)

    def request(self, room: int, prefix: int, total: int, prefix_pages: list[int],
                dst_pages: list[int], generation: int = 0, timeout: float = 20.0) -> Reply:
        """Lay down the decode prefix and hand every prefill rank this request's destination."""
        data.fill_prefix(self.pool, self.shard, prefix_pages, prefix=prefix, page_size=self.args.page_size)
        self.pending[room] = Pending(prefix, total, prefix_pages, dst_pages, generation)
        states = []
        for t in self.targets:
            info = transfer_pb2.TransferInfo(
                room=room, generation=generation, peer_name=self.args.name,
                dst_kv_pages=dst_pages, required_dst_info_num=len(self.targets),
                decode_prefix_len=prefix)
            states.append(int(t.client.submit_transfer(t.peer_id, info, timeout=timeout).state))
        return {"states": states}

    def wait(self, room: int, timeout: float = 120.0, check: bool = True) -> Reply:
        """Wait for every prefill rank's terminal status of ``room``, then check every pool byte."""
        p = self.pending.pop(room)
        deadline = time.monotonic() + timeout
        nbytes = descriptors = chunks = 0
        failures: list[str] = []
        for t in self.targets:
            try:
                st = t.client.wait_for(t.peer_id, [room], timeout=max(deadline - time.monotonic(), 0.1))[room]
            except PdprotoError as exc:
                failures.append(f"{t.address}: {exc.reason.name}: {exc.message}")
                # Giving up is not enough: the prefill may still write into these pages.
                # Abort answers only after in-flight chunks drained, so the pages are safe to reuse.
                try:
                    t.client.abort(t.peer_id, room, p.generation, timeout=30.0)
                except PdprotoError as abort_exc:
                    failures.append(f"{t.address}: abort after timeout: {abort_exc.reason.name}")
                continue
            if st.state != common_pb2.TRANSFER_STATE_SUCCESS:
                failures.append(f"{t.address}: {st.failure_code}: {st.failure_reason}")
            nbytes += st.bytes_transferred
            descriptors += st.descriptors
            chunks += st.chunks_done
        done_at = time.monotonic()
        if not failures and self.args.backend == "nixl":
            # Every chunk must be announced through the engine, including chunks where this
            # rank owns no rows (e.g. the 1-token tail of a 65-token prompt on DCP 4).
            got = self._await_notices(room, p.generation, chunks, deadline)
            if got != chunks:
                failures.append(f"expected {chunks} chunk notices through NIXL, got {got}")
        seconds = done_at - p.submitted
        checked, bad = 0, None
        if check and not failures:
            checked, bad = data.verify(self.pool, self.shard, prefix_pages=p.prefix_pages,
                                       dst_pages=p.dst_pages, prefix=p.prefix, total=p.total,
                                       page_size=self.args.page_size)
        data.reset(self.pool, prefix_pages=p.prefix_pages, dst_pages=p.dst_pages,
                   page_size=self.args.page_size)
        return {"room": room, "ok": not failures and bad is None, "failures": failures,
                "mismatch": None if bad is None else bad.__dict__, "checked": checked,
                "bytes": nbytes, "descriptors": descriptors, "seconds": seconds, "done_at": done_at}

    def _await_notices(self, room: int, generation: int, expected: int, deadline: float) -> int:
        """Collect engine notices until this generation of ``room`` has ``expected`` or time runs out.

        Notices trail the data, and an aborted generation's chunks may still announce
        themselves after the room was reused, so they are counted per generation.
        """
        stop = min(deadline, time.monotonic() + 5.0)
        key = (room, generation)
        while True:
            for n in self.executor.notifications():
                self.notices[(n.room, notice_generation(n.payload))] += 1
            if self.notices[key] >= expected or time.monotonic() >= stop:
                got = self.notices.pop(key, 0)
                for stale in [k for k in self.notices if k[0] == room and k[1] < generation]:
                    del self.notices[stale]
                return got
            time.sleep(0.005)

    def abort(self, room: int, generation: int = 0, timeout: float = 20.0) -> Reply:
        """Abort a request generation on every prefill rank; returns once each acknowledged."""
        acks = [t.client.abort(t.peer_id, room, generation, timeout=timeout) for t in self.targets]
        return {"acks": [[a.room, a.generation] for a in acks]}

    def deregister(self) -> Reply:
        """Deregister from every prefill rank."""
        failed = sum(t.client.deregister(t.peer_id) for t in self.targets)
        return {"failed": failed}

    def close(self) -> None:
        """Close clients and the executor."""
        for t in self.targets:
            t.client.close()
        self.executor.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the decode rank process."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--name", default=f"decode-{os.getpid()}")
    ap.add_argument("--dcp-size", type=int, default=1)
    ap.add_argument("--dcp-rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--notify-port", type=int, default=0,
                    help="control endpoint port; the server knows a restarted decode by it (default: from the pid)")
    args = ap.parse_args(argv)
    if not args.notify_port:
        args.notify_port = 10000 + os.getpid() % 50000
    out = redirect_stdout_to_stderr()
    rank = DecodeRank(args)
    try:
        out.write('{"ready": true, "pid": %d}\n' % os.getpid())
        out.flush()
        serve_commands({"connect": rank.connect, "request": rank.request, "wait": rank.wait,
                        "deregister": rank.deregister, "abort": rank.abort, "ping": lambda: {"pong": True}}, out)
    finally:
        rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
