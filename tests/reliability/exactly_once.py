"""The exactly-once row (local): one terminal status per request on every stream, one live peer per decode.

Against a real ``pdproto serve``, each request's terminal status is counted on two streams
at once, a ``WatchStatus`` stream and a client ``Session``:

* **deregistration**: 1,000 open requests (their chunks never come); the peer deregisters
  while both streams are still sending their first snapshot: each room ends once,
  ``PEER_GONE``, on each stream;
* **server restart**: 50 open requests; SIGTERM (graceful drain): each ends once,
  ``SHUTTING_DOWN``, on each stream; a new server on the same port takes the decode's new
  registration and serves it byte-exact;
* **reconnect**: 24 requests move while the link between decode and server is cut again
  and again (``tests/_proxy.py``, which also loses what the server sent before each cut):
  each ends once, ``SUCCESS``, byte-exact;
* **concurrent registration**: 20 Registers of one decode identity at once leave one live
  peer (``Describe``), and only that one takes a request.

A room with no terminal status on a stream is lost; one with two is a problem.
"""

from __future__ import annotations

import collections
import concurrent.futures
import signal
import threading
import time
from collections.abc import Iterable

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.session import is_terminal
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from tests._proxy import CuttableProxy
from tests._server_harness import SERVE_ARGS, SPEC, running_server

from .harness import Outcome

HELD = (*SERVE_ARGS[:-4], "--chunk-delay-ms", "60000", "--match-timeout", "120")
"""Chunks come a minute after a claim: every request stays open until the row ends it."""
SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS


class _Streams:
    """A WatchStatus stream and a Session's watch of one peer, each collecting every status it is sent."""

    def __init__(self, target: str, peer_id: str, credential: bytes, timeout: float, *, snapshot: bool = True) -> None:
        self.seen: dict[str, list[transfer_pb2.TransferStatus]] = {"WatchStatus": [], "Session": []}
        self.clients = [HandshakeClient(target, timeout=timeout, session=False),
                        HandshakeClient(target, timeout=timeout)]
        self.threads = []
        for (name, statuses), client in zip(self.seen.items(), self.clients, strict=True):
            client.adopt(peer_id, credential)
            first = threading.Event()
            thread = threading.Thread(target=self._collect, args=(client, peer_id, timeout, statuses, first),
                                      daemon=True)
            thread.start()
            if snapshot:
                first.wait(timeout)  # the stream is open and sending its snapshot
            self.threads.append(thread)

    @staticmethod
    def _collect(client: HandshakeClient, peer_id: str, timeout: float, out: list[transfer_pb2.TransferStatus],
                 first: threading.Event) -> None:
        try:
            for status in client.watch_status(peer_id, timeout=timeout):
                out.append(status)
                first.set()
        except E.PdprotoError:
            pass  # the stream ends with the peer or the server: what it sent before counts
        finally:
            first.set()

    def wait_for_terminal(self, rooms: Iterable[int], timeout: float) -> None:
        """Until each stream has a terminal status for every room, or ``timeout`` s (``count`` judges)."""
        want, waited = set(rooms), time.monotonic()
        while time.monotonic() - waited < timeout and any(
                not want <= {s.room for s in list(statuses) if is_terminal(s)} for statuses in self.seen.values()):
            time.sleep(0.05)

    def close(self, timeout: float) -> None:
        """Wait for both streams to end, then close their clients."""
        for t in self.threads:
            t.join(timeout)
        for c in self.clients:
            c.close()

    def count(self, out: Outcome, rooms: Iterable[int], code: str, what: str) -> None:
        """Each room ends exactly once with ``code`` on each stream."""
        rooms = list(rooms)
        for name, statuses in self.seen.items():
            finals = [s for s in statuses if is_terminal(s)]
            counts = collections.Counter(s.room for s in finals)
            missing = [r for r in rooms if counts[r] == 0]
            twice = sorted(r for r, n in counts.items() if n > 1)
            wrong = sorted({s.failure_code or "SUCCESS" for s in finals} - {code})
            out.runs += len(rooms)
            out.lost += len(missing)
            ended = len(rooms) - len(missing)
            if code == "SUCCESS":
                out.ok += ended
            else:
                out.failed_expected += ended
            out.expect(not missing,
                       f"{what} ({name}): {len(missing)} rooms without a terminal status, e.g. {missing[:5]}")
            out.expect(not twice, f"{what} ({name}): rooms with two terminal statuses: {twice[:5]}")
            out.expect(not wrong, f"{what} ({name}): terminal statuses other than {code}: {wrong}")
        out.notes.append(f"{what}: {len(rooms)} rooms, each one {code} on WatchStatus and on a Session")


def _submit_held(client: HandshakeClient, peer_id: str, rooms: range) -> None:
    for room in rooms:
        client.submit_transfer(peer_id, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))


def _deregistration(out: Outcome, rank: DecodeRank) -> None:
    rooms = range(1, 1001)
    with running_server(*HELD, "--max-inflight", "2048") as srv, HandshakeClient(srv.target, timeout=60) as client:
        pid = client.register(rank.registration()).peer_id
        _submit_held(client, pid, rooms)
        streams = _Streams(srv.target, pid, client.credential(pid), 60)
        out.faults += 1
        client.deregister(pid)
        streams.close(60)
        streams.count(out, rooms, "PEER_GONE", "deregistered mid-snapshot")


def _restart(out: Outcome, rank: DecodeRank) -> None:
    rooms = range(10, 60)
    with running_server(*HELD, "--grace", "1") as srv:
        with HandshakeClient(srv.target, timeout=60) as client:
            pid = client.register(rank.registration()).peer_id
            _submit_held(client, pid, rooms)
            streams = _Streams(srv.target, pid, client.credential(pid), 60)
            out.faults += 1
            srv.proc.send_signal(signal.SIGTERM)
            streams.close(60)
            streams.count(out, rooms, "SHUTTING_DOWN", "graceful restart")
            out.expect(srv.proc.wait(timeout=30) == 0, f"the drained server exited {srv.proc.returncode}")
    with running_server(*SERVE_ARGS) as again, HandshakeClient(again.target, timeout=30) as client:
        pid = client.register(rank.registration()).peer_id  # the decode re-registers with the new server
        pages = rank.pages_for(SPEC.prompt_tokens)
        client.submit_transfer(pid, rank.transfer_info(1, pages))
        out.succeeded(client.wait_for(pid, [1], timeout=30))
        out.bytes_verified += rank.verify({1: pages}, SPEC.prompt_tokens)


def _reconnect(out: Outcome, rank: DecodeRank) -> None:
    rooms = list(range(100, 124))
    placed = {room: rank.pages_for(SPEC.prompt_tokens, first_page=(i % 8) * 16) for i, room in enumerate(rooms)}
    with running_server(*SERVE_ARGS) as srv:
        proxy = CuttableProxy(srv.port)
        stop = threading.Event()
        try:
            with HandshakeClient(proxy.target, timeout=30) as client:
                pid = client.register(rank.registration()).peer_id
                streams = _Streams(proxy.target, pid, client.credential(pid), 20, snapshot=False)
                cuts = proxy.cut_repeatedly(stop)
                for i, room in enumerate(rooms):
                    if i and i % 8 == 0:  # rooms share pages in groups of 8
                        client.wait_for(pid, rooms[i - 8:i], timeout=30)
                    client.submit_transfer(pid, rank.transfer_info(room, placed[room]))
                client.wait_for(pid, rooms, timeout=30)
                stop.set()
                cuts.join()
                # A watch cut at the end re-opens after a backoff: deregistering before then would
                # end it on PEER_NOT_FOUND, without the statuses the last cut lost. Wait (bounded).
                streams.wait_for_terminal(rooms, 30)
                client.deregister(pid)  # ends both streams once they sent everything
                streams.close(30)
                out.faults += proxy.cuts
                streams.count(out, rooms, "SUCCESS", f"link cut {proxy.cuts} times")
                out.bytes_verified += rank.verify({room: placed[room] for room in rooms[-8:]}, SPEC.prompt_tokens)
        finally:
            stop.set()
            proxy.close()


def _concurrent_registers(out: Outcome, rank: DecodeRank) -> None:
    with running_server(*SERVE_ARGS) as srv:
        clients = [HandshakeClient(srv.target, timeout=30) for _ in range(20)]
        try:
            go = threading.Barrier(len(clients))

            def register(client: HandshakeClient) -> str:
                go.wait()
                return client.register(rank.registration()).peer_id

            with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
                ids = list(pool.map(register, clients))
            out.faults += len(clients) - 1
            live = clients[0].describe().peers
            working = []
            for client, pid in zip(clients, ids, strict=True):
                try:
                    client.submit_transfer(pid, rank.transfer_info(1, rank.pages_for(SPEC.prompt_tokens)))
                    working.append((client, pid))
                except E.NotFoundError:
                    out.runs += 1
                    out.failed_expected += 1  # a replaced registration: PEER_NOT_FOUND
            out.expect(len(live) == 1 and len(working) == 1,
                       f"{len(clients)} concurrent Registers of one decode left {len(live)} peers, "
                       f"{len(working)} taking requests")
            for client, pid in working:
                out.succeeded(client.wait_for(pid, [1], timeout=30))
            out.notes.append(f"{len(clients)} concurrent Registers of one decode: {len(live)} live peer, "
                             f"{len(clients) - len(working)} replaced ones refused PEER_NOT_FOUND")
        finally:
            for c in clients:
                c.close()


def exactly_once(backend: str = "local") -> Outcome:
    """The exactly-once row (see the module doc)."""
    out = Outcome("exactly-once terminal statuses", backend)
    rank = DecodeRank.for_spec(SPEC, pages=128, backend=backend)
    try:
        _deregistration(out, rank)
        _restart(out, rank)
        _reconnect(out, rank)
        _concurrent_registers(out, rank)
    finally:
        rank.close()
    return out
