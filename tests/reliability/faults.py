"""Fault injection with real processes and engines: kills, restarts, deadlines, slow peers, aborts.

Each scenario starts a dense prefill and two DCP 2 decode ranks, runs a baseline request,
injects one fault into a request that is mid-transfer (its last chunk not yet reported, so
it cannot have finished), then checks: the affected request ends FAILED with a reason, the
other rank's request completes byte-exact, the server still serves new requests byte-exact,
and it no longer holds the dead peer's requests, tasks or registration.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError, Reason
from pdproto.v1 import common_pb2
from pdproto_demo.cluster import Cluster
from pdproto_demo.proc import ChildError

from .harness import DENSE_TO_DCP2, Outcome, prefill_stats, request_state, small_cluster, wait_until

FAILED = common_pb2.TRANSFER_STATE_FAILED
DEADLINE = 30.0
"""Seconds an affected request may take to be reported FAILED (the server's match timeout is 30 s)."""


def _failures(c: Cluster) -> dict[str, float]:
    """Failed-request counts by reason on the prefill (its metrics)."""
    return {k: v for k, v in prefill_stats(c)["outcomes"].items() if k != "SUCCESS"}


def _victim_failed(c: Cluster, room: int, peer: str, out: Outcome, before: dict[str, float]) -> None:
    """Wait for the server to fail the victim's request; count it as failed-as-expected or lost.

    The request's own record says FAILED and why; if the server already dropped the dead
    peer's record, its failure counters must have grown instead.
    """
    def probe() -> str | None:
        st = request_state(c, room).get(peer)
        if st is not None:
            return str(st[2]) if st[1] == FAILED else None
        grown = {k for k, v in _failures(c).items() if v > before.get(k, 0)}
        return ",".join(sorted(grown)) or None

    reason = wait_until(probe, DEADLINE)
    out.runs += 1
    if reason:
        out.failed_expected += 1
        out.notes.append(f"victim room {room}: {reason}")
    else:
        out.lost += 1
        out.problems.append(f"victim room {room}: not FAILED within {DEADLINE:.0f} s: {request_state(c, room)}")


def _healthy(c: Cluster, out: Outcome, *, expect_peers: int) -> None:
    """The server still serves byte-exact, holds no open work, and only the live peers."""
    out.count(c.run_request(4096, 256))

    def idle() -> dict[str, object] | None:
        s = prefill_stats(c)
        return s if s["open_requests"] == 0 and s["engine_calls"] == 0 else None

    st = wait_until(idle, 15) or prefill_stats(c)
    out.expect(st["open_requests"] == 0, f"open requests left: {st['open_requests']}")
    out.expect(st["engine_calls"] == 0, f"engine calls left: {st['engine_calls']}")
    out.extra["peers_after"] = st["peers"]
    if st["peers"] != expect_peers:
        out.notes.append(f"server holds {st['peers']} peers, {expect_peers} alive")


def _restart_decode(c: Cluster, d: int) -> None:
    """Close decode rank ``d`` (if alive) and start a fresh process on the same notify endpoint."""
    c.decodes[d].close(timeout=5)
    c.decodes[d] = c.spawn_decode(d)
    c.decodes[d].await_ready(120)


def _restart_prefill(c: Cluster, ns: int, r: int) -> None:
    """Stop prefill rank ``r`` of group ``ns`` (if alive) and start a fresh one on the same port."""
    c.prefills[ns][r].close(timeout=15)
    c.prefills[ns][r] = c.spawn_prefill(ns, r, c.ports[ns][r])
    c.ports[ns][r] = int(c.prefills[ns][r].recv(120)["port"])


def decode_killed(backend: str) -> Outcome:
    """SIGKILL one decode rank while its request is mid-transfer; the survivor completes."""
    out = Outcome("decode killed mid-transfer", backend)
    c = small_cluster(backend)
    try:
        out.count(c.run_request(4096, 0))
        f = c.begin(8192, 256)
        c.send_chunks(f, upto=1)
        victim = c.peer_ids[1][0]
        before = _failures(c)
        c.decodes[1].kill_and_reap()
        out.faults += 1
        c.send_chunks(f)
        out.count(c.finish(f, skip=[1]))
        _victim_failed(c, f.room, victim, out, before)
        # The dead peer's engine connection and requests are released without waiting for a restart.
        freed = wait_until(lambda: prefill_stats(c)["live_peers"] == 1, DEADLINE)
        out.expect(bool(freed), f"dead peer still held as live: {prefill_stats(c)['live_peers']} live peers")
        # The restarted rank registers from the same address: stale state is replaced.
        _restart_decode(c, 1)
        c.connect(DENSE_TO_DCP2, ranks=[1])
        _healthy(c, out, expect_peers=2)
    finally:
        c.close()
    return out


def decode_restart_same_address(backend: str) -> Outcome:
    """A decode restarts on the same address with requests open: the old peer is dropped, not reused."""
    out = Outcome("decode restart, same address", backend)
    c = small_cluster(backend)
    try:
        out.count(c.run_request(2048, 0))
        old = c.peer_ids[1][0]
        f = c.begin(8192, 256, decodes=[1])
        c.send_chunks(f, upto=1)
        _restart_decode(c, 1)  # closes the old process first: a crash-restart
        out.faults += 1
        c.connect(DENSE_TO_DCP2, ranks=[1])
        new = c.peer_ids[1][0]
        out.expect(new != old, "restarted decode got the old peer id")
        c.send_chunks(f)
        # The stale peer is gone with its requests; its open request was counted as failed.
        outcomes = prefill_stats(c)["outcomes"]
        failed = {k: v for k, v in outcomes.items() if k != "SUCCESS" and v}
        out.runs += 1
        if failed:
            out.failed_expected += 1
            out.notes.append(f"stale peer's request failed: {', '.join(sorted(failed))}")
        else:
            out.lost += 1
            out.problems.append(f"stale peer's request not failed: {prefill_stats(c)['outcomes']}")
        st = prefill_stats(c)
        out.expect(old not in st["peer_ids"], f"stale peer {old} still registered")
        _healthy(c, out, expect_peers=2)
    finally:
        c.close()
    return out


def _expect_failed_waits(c: Cluster, out: Outcome, problem: str) -> None:
    """Collect every decode's pending ``wait`` reply; each must be a failure with a reason."""
    for d in range(len(c.decodes)):
        r = c.decodes[d].recv(DEADLINE + 30)
        out.runs += 1
        if r["ok"] or not r["failures"]:
            out.lost += 1
            out.problems.append(f"decode {d}: {problem}: {r}")
        else:
            out.failed_expected += 1
            out.notes.append(f"decode {d}: {r['failures'][0]}")


def prefill_killed(backend: str) -> Outcome:
    """SIGKILL the prefill mid-transfer: decodes learn within the deadline, a new prefill serves."""
    out = Outcome("prefill killed mid-transfer", backend)
    c = small_cluster(backend)
    try:
        out.count(c.run_request(4096, 0))
        f = c.begin(8192, 256)
        c.send_chunks(f, upto=1)
        c.prefills[1][0].kill_and_reap()
        out.faults += 1
        # Both decode ranks were waiting on the dead prefill: each must see a failure.
        for d in range(len(c.decodes)):
            c.decodes[d].send("wait", room=f.room, timeout=DEADLINE)
        _expect_failed_waits(c, out, "request survived a dead prefill")
        _restart_prefill(c, 1, 0)
        c.connect(DENSE_TO_DCP2)
        _healthy(c, out, expect_peers=2)
    finally:
        c.close()
    return out


def server_restart(backend: str) -> Outcome:
    """Graceful stop with a request in flight, restart on the same port, decodes re-register."""
    out = Outcome("server stopped and restarted", backend)
    c = small_cluster(backend)
    try:
        out.count(c.run_request(4096, 0))
        f = c.begin(8192, 256)
        c.send_chunks(f, upto=1)
        for d in range(len(c.decodes)):
            c.decodes[d].send("wait", room=f.room, timeout=DEADLINE)
        _restart_prefill(c, 1, 0)  # quit: drain, then a new process on the port
        out.faults += 1
        _expect_failed_waits(c, out, "unfinished request reported ok")
        c.connect(DENSE_TO_DCP2)
        _healthy(c, out, expect_peers=2)
    finally:
        c.close()
    return out


def handshake_deadline(backend: str) -> Outcome:
    """A server that accepts TCP but never answers, and a frozen prefill: calls end at their deadline."""
    out = Outcome("handshake never answers (deadline)", backend)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])  # accept and never answer
            except OSError:
                continue

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    c = small_cluster(backend)
    try:
        targets = [f"127.0.0.1:{silent.getsockname()[1]}", f"127.0.0.1:{c.ports[1][0]}"]
        c.prefills[1][0].kill(signal.SIGSTOP)  # the real prefill, frozen
        for target in targets:
            out.faults += 1
            out.runs += 1
            started = time.monotonic()
            try:
                with HandshakeClient(target, timeout=2.0) as client:
                    client.get_server_info()
                out.lost += 1
                out.problems.append(f"{target}: a silent server answered")
            except PdprotoError as exc:
                took = time.monotonic() - started
                if exc.reason in (Reason.DEADLINE_EXCEEDED, Reason.UNAVAILABLE):
                    out.failed_expected += 1
                    out.notes.append(f"{target}: {exc.reason.name} after {took:.1f} s (deadline 2 s)")
                else:
                    out.problems.append(f"{target}: unexpected {exc.reason.name}")
        c.prefills[1][0].kill(signal.SIGCONT)
        _healthy(c, out, expect_peers=2)
    finally:
        stop.set()
        t.join(2)
        for s in held:
            s.close()
        silent.close()
        c.close()
    return out


FREEZE = 5.0
"""Seconds the slow peer stays frozen."""


def slow_peer(backend: str) -> Outcome:
    """One decode frozen (SIGSTOP) mid-transfer for a few seconds: the other rank is not held up."""
    out = Outcome("slow peer (frozen decode)", backend)
    c = small_cluster(backend)
    try:
        out.count(c.run_request(2048, 0))
        f = c.begin(8192, 256)
        c.send_chunks(f, upto=1)
        c.decodes[1].kill(signal.SIGSTOP)
        frozen_at = time.monotonic()
        out.faults += 1
        c.send_chunks(f)
        c.finish_start(f, skip=[1])
        time.sleep(max(0.0, FREEZE - (time.monotonic() - frozen_at)))
        c.decodes[1].kill(signal.SIGCONT)
        survivor = c.finish_collect(f)
        out.count(survivor)
        done_after = survivor.seconds
        # The healthy rank's request should not wait for the frozen one (no head-of-line blocking).
        out.extra["survivor_s"] = done_after
        out.notes.append(f"healthy rank finished {done_after:.2f} s after the first chunk "
                         f"(peer frozen {FREEZE:.0f} s)")
        out.expect(done_after < FREEZE * 0.8,
                   f"head-of-line blocking: the healthy rank waited {done_after:.1f} s for a peer frozen "
                   f"{FREEZE:.0f} s")
        c.decodes[1].send("wait", room=f.room, timeout=DEADLINE)
        r = c.decodes[1].recv(DEADLINE + 30)
        out.runs += 1
        if r["mismatch"]:
            out.corrupted += 1
            out.problems.append(f"slow peer bytes differ: {r['mismatch']}")
        elif r["ok"]:
            out.ok += 1
            out.bytes_verified += int(r["checked"])
            out.notes.append("slow peer: completed byte-exact after it resumed")
        else:
            # Paused for less than its deadline: it must finish, not fail (issue 37).
            out.lost += 1
            out.problems.append(f"slow peer, paused {FREEZE:.0f} s (under its deadline), did not finish: "
                                f"{r['failures'] or 'no terminal status'}")
        _healthy(c, out, expect_peers=2)
    finally:
        c.decodes[1].kill(signal.SIGCONT)
        c.close()
    return out


def abort_race(backend: str) -> Outcome:
    """Abort while chunks are in flight, then resubmit the room as a new generation to new pages."""
    out = Outcome("abort racing in-flight chunks", backend)
    c = small_cluster(backend)
    try:
        f = c.begin(4096, 256)
        c.send_chunks(f, upto=2)
        acks = [c.decodes[d].call("abort", room=f.room, generation=0, timeout=30) for d in range(2)]
        out.faults += 1
        out.expect(all(a["acks"] for a in acks), f"abort not acknowledged: {acks}")
        c.send_chunks(f)  # the prefill finishes computing anyway; nothing may land now
        out.count(c.finish(f, check=False), expect_ok=False)
        # Same room, generation 1, other destination pages: a stale write would show up there.
        g = c.begin(4096, 256, room=f.room, generation=1, dst_offset=34)
        c.send_chunks(g)
        out.count(c.finish(g))
        _healthy(c, out, expect_peers=2)
    finally:
        c.close()
    return out


SCENARIOS: dict[str, Callable[[str], Outcome]] = {
    "decode_killed": decode_killed,
    "prefill_killed": prefill_killed,
    "server_restart": server_restart,
    "handshake_deadline": handshake_deadline,
    "slow_peer": slow_peer,
    "decode_restart": decode_restart_same_address,
    "abort_race": abort_race,
}


def run(name: str, backend: str) -> Outcome:
    """Run one scenario; a crash of the harness itself is a FAIL row, not an exception."""
    try:
        return SCENARIOS[name](backend)
    except (ChildError, PdprotoError, OSError, TimeoutError) as exc:
        o = Outcome(name, backend)
        o.problems.append(f"scenario crashed: {exc}")
        return o
