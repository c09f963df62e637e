"""The memory row (local): finished requests and gone peers stay inside the documented limits.

Against a real ``pdproto serve`` (``--max-peers 4 --max-finished 200 --keep-finished 2``):

* **finished requests**: one peer runs 1,000 requests whose ``TransferInfo`` is 64 KB each
  (dummy: no KV moves; a finished request keeps only its final status). The server's
  resident memory is read (``/proc/PID/status``) after a warm-up of ``WARMUP`` requests and
  at the end, and the peer keeps at most ``--max-finished`` final statuses (``Describe``).
* **gone peers**: thirty decodes in turn register, move a request byte-exact and drop their
  arena, so their next request fails ``PEER_GONE`` and the server holds them as gone. Gone
  peers count toward ``--max-peers``: a registration past it is refused ``TOO_MANY_PEERS``
  until ``--keep-finished`` releases them, and the server never holds more than the limit.
  Resident memory is read again after the thirty cycles.

The row fails when resident memory grows by more than ``GROWTH_LIMIT`` over either phase.
"""

from __future__ import annotations

import time
from pathlib import Path

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from tests._server_harness import SERVE_ARGS, SPEC, running_server

from .harness import Outcome

MAX_PEERS, MAX_FINISHED, KEEP_S = 4, 40, 2.0
GROWTH_LIMIT = 32 << 20
"""Resident growth allowed per phase: allocator slack, not what was kept (1,000 kept requests were about 1 GB)."""
REQUESTS, BATCH, INFO_PAGES = 1000, 50, 1 << 16
WARMUP = 1000
"""Requests before the first reading. The server's resident memory climbs over its first 800-900
requests of this size, then stays flat: the allocator's heaps reaching their working size (about half
the climb goes with ``MALLOC_ARENA_MAX=1``). Read after one batch, that climb alone measured 7-34 MiB
from run to run; after 1,000 the measured 1,000 grow a few MiB. A server keeping each request's 64 KB
would still grow 64 MiB over them."""
CYCLES = 30
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
"""glibc otherwise raises its mmap threshold after the first big free and keeps later ones in
the heap: a row would measure the allocator's slack, not what the process keeps."""
SUCCESS, FAILED = common_pb2.TRANSFER_STATE_SUCCESS, common_pb2.TRANSFER_STATE_FAILED


def rss(pid: int) -> int:
    """Resident set size of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS line for pid {pid}")


def _finished_requests(out: Outcome, client: HandshakeClient, pid: int, peer: str) -> None:
    """``REQUESTS`` dummy requests of 64 KB each; resident memory and kept statuses stay bounded."""
    pages = [i % 64 for i in range(INFO_PAGES)]

    def batch(first: int) -> None:
        rooms = range(first, first + BATCH)
        for room in rooms:
            client.submit_transfer(peer, transfer_pb2.TransferInfo(room=room, dst_kv_pages=pages, is_dummy=True))
        out.succeeded(client.wait_for(peer, rooms, timeout=60))

    for first in range(100_000, 100_000 + WARMUP, BATCH):
        batch(first)
    before = rss(pid)
    for first in range(0, REQUESTS, BATCH):
        batch(first)
    grown = rss(pid) - before
    kept = len(client.describe(peer_id=peer, include_finished=True, request_limit=100_000).peers[0].finished)
    out.notes.append(f"{REQUESTS} finished requests of 64 KB: resident memory {grown / 2**20:+.1f} MiB, "
                     f"{kept} final statuses kept (--max-finished {MAX_FINISHED})")
    out.expect(grown < GROWTH_LIMIT, f"resident memory grew {grown >> 20} MiB over {REQUESTS} finished requests")
    out.expect(kept <= MAX_FINISHED, f"{kept} final statuses kept, past --max-finished {MAX_FINISHED}")


def _register_when_it_fits(out: Outcome, client: HandshakeClient, rank: DecodeRank) -> str:
    """Register ``rank``; each TOO_MANY_PEERS (gone peers not released yet) is counted, then retried."""
    refused = False
    deadline = time.monotonic() + KEEP_S * 10
    while True:
        try:
            return client.register(rank.registration()).peer_id
        except E.ResourceLimitError as exc:
            if exc.reason is not Reason.TOO_MANY_PEERS or time.monotonic() > deadline:
                raise
            if not refused:
                refused = True
                out.runs += 1
                out.faults += 1
                out.failed_expected += 1
            time.sleep(0.25)


def _gone_peers(out: Outcome, client: HandshakeClient, pid: int) -> None:
    """Decodes that vanish after one request: held as gone, counted toward --max-peers, then released."""
    before = rss(pid)
    most = 0
    refusals = out.failed_expected
    for cycle in range(CYCLES):
        rank = DecodeRank.for_spec(SPEC, pages=16)
        try:
            peer = _register_when_it_fits(out, client, rank)
            pages = rank.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(peer, rank.transfer_info(1, pages))
            out.runs += 1
            if client.wait_for(peer, [1], timeout=30)[1].state == SUCCESS:
                out.ok += 1
                out.bytes_verified += rank.verify({1: pages}, SPEC.prompt_tokens)
            else:
                out.lost += 1
                out.problems.append(f"cycle {cycle}: the request failed")
            rank.executor.close()  # the decode drops its memory: the next transfer finds it gone
            out.faults += 1
            out.runs += 1
            try:
                client.submit_transfer(peer, rank.transfer_info(2, pages))
                st = client.wait_for(peer, [2], timeout=30)[2]
            except E.RequestFailedError as exc:
                # The server saw the arena go first (its socket closed) and refused the submit: the same end.
                if exc.reason is not Reason.PEER_GONE:
                    raise
                st = transfer_pb2.TransferStatus(state=FAILED, failure_code=exc.reason.code)
            if st.state == FAILED and st.failure_code == "PEER_GONE":
                out.failed_expected += 1
            else:
                out.lost += 1
                out.problems.append(f"cycle {cycle}: a vanished decode's request ended {st.state} {st.failure_code}")
        finally:
            rank.close()
        most = max(most, len(client.describe().peers))
    grown = rss(pid) - before
    out.notes.append(f"{CYCLES} decodes gone after one request: held at most {most} peers (--max-peers "
                     f"{MAX_PEERS}), {out.failed_expected - refusals - CYCLES} registrations refused "
                     f"TOO_MANY_PEERS until released; resident memory {grown / 2**20:+.1f} MiB")
    out.expect(most <= MAX_PEERS, f"the server held {most} peers under --max-peers {MAX_PEERS}")
    out.expect(out.failed_expected - refusals > CYCLES, "no registration was refused while gone peers were held")
    out.expect(grown < GROWTH_LIMIT, f"resident memory grew {grown >> 20} MiB over {CYCLES} gone peers")


def memory_limits(backend: str = "local") -> Outcome:
    """The memory row (see the module doc)."""
    out = Outcome("memory under the limits", backend)
    env = FIXED_MMAP_THRESHOLD
    resident = DecodeRank.for_spec(SPEC, pages=64)
    try:
        with running_server(*SERVE_ARGS, "--backend", backend, "--max-peers", str(MAX_PEERS),
                            "--max-finished", str(MAX_FINISHED), "--keep-finished", str(KEEP_S),
                            "--max-inflight", str(BATCH), env=env) as srv, \
                HandshakeClient(srv.target, timeout=30) as client:
            peer = client.register(resident.registration()).peer_id
            _finished_requests(out, client, srv.proc.pid, peer)
            _gone_peers(out, client, srv.proc.pid)
            out.expect(srv.proc.poll() is None, f"the server died: {srv.proc.returncode}")
    finally:
        resident.close()
    return out
