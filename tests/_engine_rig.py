"""Engine executors against stuck, black-holed and misregistered peers, in a process of their own.

``python -m tests._engine_rig SCENARIO BACKEND`` prints one JSON report on stdout
(everything else goes to stderr). It runs in its own process because NIXL wants one agent
per process, and because UCX must be told to use TCP (where a frozen peer really stalls a
transfer; over shared memory UCX writes into a stopped process at once) before its first
agent starts.

* ``frozen``: decodes A and B; A is SIGSTOPped; a transfer to A must fail with
  DEADLINE_EXCEEDED at ``transfer_timeout_s`` while a transfer to B, started after A's
  call entered the engine, completes; A's next call fails at once; once the engine gives
  A's call up, nothing is held (no engine handle, no staging byte); after SIGCONT, A is
  served byte-exact again.
* ``slow`` (Mooncake): a decode frozen past the deadline and thawed before the engine gives
  its batch up: the job fails DEADLINE_EXCEEDED and sends no layer after the one in flight.
* ``blackhole`` (Mooncake): a socket that accepts and never answers is registered as a
  session: ``connect`` fails with DEADLINE_EXCEEDED within ``connect_timeout_s``, and B is
  served while that connect is still waiting.
* ``identity`` (NIXL): registrations whose metadata loads another agent than the one they
  name, or an agent whose name is not UTF-8, are refused and leave nothing loaded; a
  registration naming another live peer's agent does not cut that peer off.
* ``shared`` (NIXL): two peers reaching one agent; one disconnects, the other is still served.
* ``bounds`` (NIXL): a peer whose ``KvBuffer.length`` says nothing (0) is sent a row past the
  memory it registered with NIXL: that job fails DESTINATION_OUT_OF_BOUNDS, the peer stays
  connected and its next job lands byte-exact.
* ``stuck_close`` (Mooncake, whose transport here gives a stuck batch up only after 600 s):
  a frozen peer's call times out, the peer is disconnected, then ``close()`` runs (as
  ``pdproto serve`` does): memory and engine stay while the call is inside the engine, and the
  process exits with the call still there (the decode is left frozen; the caller kills it).
* ``unreleased`` (NIXL): NIXL's release of a frozen peer's transfer fails as it does while a
  cancel is under way (REPOST_ACTIVE, injected at the agent's ``release_xfer_handle``): the
  job's staging extent stays reserved and the peer is not quiet until the release goes through.
* ``probes`` (Mooncake, one pending probe allowed): while a probe waits on a black-holed
  session, a registration is refused UNAVAILABLE (retry later), and a healthy peer whose batch
  fails is not written off (TRANSFER_FAILED, not PEER_GONE).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import numpy as np

from pdproto.errors import PdprotoError
from pdproto.transfer import LayerSpan, Segment, TransferJob, create_executor
from pdproto.transfer.engines._engine import EngineExecutor
from pdproto.v1 import registration_pb2
from pdproto_demo.decode import DecodeConfig, DecodeProcess
from pdproto_demo.proc import redirect_stdout_to_stderr

ROW, ROWS = 4096, 2048
TIMEOUT = 3.0
ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_TCP_SNDBUF": "262144", "UCX_TCP_RCVBUF": "262144",
       "MC_TCP_PROGRESS_TIMEOUT_SEC": "8", "MC_TRANSFER_TIMEOUT": "8"}
"""NIXL over TCP on loopback, in this process and in the decodes; Mooncake gives a stuck batch up
after 8 s, well after the executor's 3 s deadline (as an operator's own setting would).

UCX's socket buffers are capped at 256 KiB: left to the kernel, a loopback receive buffer
grows to 32 MB here (``tcp_rmem``), enough to take a whole 8 MB job from a frozen decode and
let NIXL report it done (a stuck-transfer scenario once saw that under load)."""
SCENARIO_ENV = {"stuck_close": {"MC_TCP_PROGRESS_TIMEOUT_SEC": "600", "MC_TRANSFER_TIMEOUT": "600"}}
"""This process's own overrides per scenario (the decodes keep ``ENV``)."""


def _freeze(child: DecodeProcess, timeout: float = 10.0) -> None:
    """SIGSTOP ``child`` and wait until every thread of it is stopped: one running elsewhere stops
    only when the kernel next looks at it, and a transfer started before that can still finish."""
    child.kill(signal.SIGSTOP)
    tasks = f"/proc/{child.proc.pid}/task"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(tasks):
            with contextlib.suppress(OSError), open(f"{tasks}/{tid}/stat") as fh:
                states.append(fh.read().rpartition(")")[2].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"{child.proc.pid} was not stopped {timeout} s after SIGSTOP")


def _outcome(fn: Any) -> dict[str, Any]:
    """Run ``fn``; what came of it (ok, or the error's class and reason) and how long it took."""
    t = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"ok": True}
    except PdprotoError as exc:
        out = {"ok": False, "error": type(exc).__name__, "reason": exc.reason.name, "message": exc.message}
    out["seconds"] = round(time.monotonic() - t, 3)
    return out


class Rig:
    """A prefill executor with one filled source buffer, and decode processes to write into."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        ex = create_executor(backend, staging_bytes=32 << 20, transfer_timeout_s=TIMEOUT, connect_timeout_s=2.0)
        assert isinstance(ex, EngineExecutor)
        self.ex = ex
        self.src = ex.allocate(ROWS * ROW)
        self.src.array[:] = np.random.default_rng(3).integers(0, 256, ROWS * ROW, dtype=np.uint8)
        ex.register_memory([self.src])
        self.peers: dict[str, DecodeProcess] = {}

    def add(self, name: str, log_dir: str | None = None) -> DecodeProcess:
        """Launch decode ``name`` and connect it (``log_dir``: its stderr goes there, not to ours)."""
        peer = DecodeProcess.launch(DecodeConfig(backend=self.backend, layers=1, pages=ROWS, page_size=1,
                                                 row_bytes=ROW, background=0), label=name, env=ENV, log_dir=log_dir)
        self.peers[name] = peer
        self.ex.connect(name, peer.registration)
        return peer

    def job(self, name: str) -> TransferJob:
        """Every source row into the same row of the peer, packed."""
        runs = np.array([[0, 1, 0, 1, ROWS]], dtype=np.int64)
        dst = self.peers[name].registration.kv_buffers[0].ptr
        return TransferJob.of_runs([LayerSpan(self.src.addr, dst, ROW)], runs, pack=True)

    def dumped(self, name: str) -> np.ndarray:
        """The peer's buffer, as it is now."""
        path = os.path.join(tempfile.mkdtemp(), "dump.bin")
        self.peers[name].call("dump", path=path)
        return np.fromfile(path, dtype=np.uint8)

    def exact(self, name: str) -> bool:
        """Whether the peer's buffer holds every source row."""
        return bool(np.array_equal(self.dumped(name), np.asarray(self.src.array)))

    def close(self) -> None:
        for peer in self.peers.values():
            peer.kill(signal.SIGCONT)
            peer.close()
        self.ex.close()


def _until_released(rig: Rig, timeout: float, poll: float) -> float:
    """Wait (bounded) until the executor holds no engine batch and no staging byte; seconds waited."""
    waited = time.monotonic()
    while rig.ex.held() != (0, 0) and time.monotonic() - waited < timeout:
        time.sleep(poll)
    return round(time.monotonic() - waited, 1)


def _thaw_and_resume(rig: Rig, report: dict[str, Any]) -> None:
    """SIGCONT decode A, clear its memory, and report whether its next job lands byte-exact."""
    rig.peers["A"].kill(signal.SIGCONT)
    rig.peers["A"].call("fill", value=0)
    # The engine may still be tearing the stuck call down: retry a few times.
    for _ in range(20):
        report["resumed"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
        if report["resumed"]["ok"]:
            break
        time.sleep(0.5)
    report["resumed_exact"] = rig.exact("A")


def _warm(rig: Rig, name: str) -> dict[str, Any]:
    """The first call to a peer (torch loads on the first pack, the engine opens its connection).

    On a loaded machine that first call alone can overrun the short deadline the scenarios
    test with; it is tried again once the engine has let go, up to three times.
    """
    for _ in range(3):
        out = _outcome(lambda: rig.ex.execute(name, rig.job(name)))
        if out["ok"] or not rig.ex.quiesce(name, 60):
            break
    return out


def frozen(rig: Rig, report: dict[str, Any]) -> None:
    """A frozen decode fails its own transfers at the deadline and holds nothing anyone else needs."""
    rig.add("A")
    rig.add("B")
    report["warm"] = [_warm(rig, n) for n in ("A", "B")]
    rig.peers["B"].call("fill", value=0)
    _freeze(rig.peers["A"])
    result: dict[str, Any] = {}
    stuck = threading.Thread(target=lambda: result.update(_outcome(lambda: rig.ex.execute("A", rig.job("A")))))
    stuck.start()
    time.sleep(0.5)  # A's call is inside the engine by now
    report["other"] = _outcome(lambda: rig.ex.execute("B", rig.job("B")))
    report["other_done_while_stuck"] = stuck.is_alive()
    report["other_exact"] = rig.exact("B")
    stuck.join(TIMEOUT + 30)
    report["stuck"] = result
    report["quiet_while_stuck"] = rig.ex.quiesce("A", 0.1)
    marker = rig.ex.drained("A")  # what the server's Abort awaits on its loop, holding no thread
    report["drained_while_stuck"] = marker is None or bool(futures.wait([marker], timeout=0.1).done)
    report["next"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
    report["quiet_later"] = rig.ex.quiesce("A", 120)
    report["drained_later"] = marker is None or marker.result(timeout=120) is None
    report["released_after_s"] = _until_released(rig, 120, 0.2)
    report["held_after"] = list(rig.ex.held())
    _thaw_and_resume(rig, report)
    report["stats_timeouts"] = rig.ex.stats.timeouts


def slow(rig: Rig, report: dict[str, Any]) -> None:
    """A decode that thaws after the deadline, before the engine gives its batch up, gets no later layer.

    Four units (segments) of 512 rows, one descriptor each, and one descriptor (and its sentinel)
    in flight at a time (``max_batch`` 1; the real cap, 2,047 and a sentinel, is reached the
    same way by a job of scattered rows): each unit is submitted once the one before
    completed. Unit 0 waits on the frozen decode past the deadline; the decode then thaws and
    unit 0 completes.
    """
    a = rig.add("A")
    report["warm"] = _warm(rig, "A")
    rig.peers["A"].call("fill", value=0)
    rig.ex.max_batch = 1
    quarter = ROWS // 4
    dst = a.registration.kv_buffers[0].ptr
    layer = (LayerSpan(rig.src.addr, dst, ROW),)
    job = TransferJob(segments=tuple(
        Segment(np.array([[i * quarter, 1, i * quarter, 1, quarter]], dtype=np.int64), layer) for i in range(4)),
        pack=False)
    _freeze(rig.peers["A"])
    report["slow"] = _outcome(lambda: rig.ex.execute("A", job))
    rig.peers["A"].kill(signal.SIGCONT)  # within Mooncake's own 8 s: its batch completes
    report["quiet"] = rig.ex.quiesce("A", 60)
    report["released_after_s"] = _until_released(rig, 60, 0.1)
    got = rig.dumped("A")[quarter * ROW:]
    report["later_layers_untouched"] = bool(not got.any())
    report["later_bytes_written"] = int(np.count_nonzero(got))
    report["next"] = _outcome(lambda: rig.ex.execute("A", job))


@contextlib.contextmanager
def _black_hole() -> Iterator[str]:
    """host:port of a socket that accepts every connection and never answers (closed on exit)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{silent.getsockname()[1]}"
    finally:
        silent.close()
        for s in held:
            s.close()


def blackhole(rig: Rig, report: dict[str, Any]) -> None:
    """A session that accepts connections and never answers is refused at connect; B is served meanwhile."""
    with _black_hole() as hole:
        rig.add("B")
        report["warm"] = _warm(rig, "B")
        rig.peers["B"].call("fill", value=0)
        reg = registration_pb2.KvRegistration()
        reg.mooncake.session_id = hole
        reg.kv_buffers.add(ptr=1 << 40, length=ROWS * ROW)
        result: dict[str, Any] = {}
        connecting = threading.Thread(target=lambda: result.update(_outcome(lambda: rig.ex.connect("hole", reg))))
        connecting.start()
        time.sleep(0.3)
        report["other"] = _outcome(lambda: rig.ex.execute("B", rig.job("B")))
        report["other_done_while_connecting"] = connecting.is_alive()
        report["other_exact"] = rig.exact("B")
        connecting.join(30)
        report["connect"] = result
        report["held_after"] = list(rig.ex.held())


def _refused(fn: Any) -> dict[str, Any]:
    """``_outcome`` plus the field an InvalidFieldError names."""
    try:
        fn()
    except PdprotoError as exc:
        return {"ok": False, "error": type(exc).__name__, "reason": exc.reason.name,
                "field": getattr(exc, "field", None), "message": exc.message}
    return {"ok": True}


def _loaded(rig: Rig, agent: str | bytes) -> bool:
    """Whether the prefill's NIXL agent still has ``agent``'s metadata loaded."""
    return bool(rig.ex._agent.check_remote_metadata(agent))  # type: ignore[attr-defined]


def identity(rig: Rig, report: dict[str, Any]) -> None:
    """A NIXL peer is the agent its metadata loads; mismatches and non-UTF-8 names are refused."""
    a = rig.add("A")
    own = a.registration.nixl.agent_name
    # Names another agent than the one its metadata loads (A's): refused, A untouched.
    liar = registration_pb2.KvRegistration()
    liar.CopyFrom(a.registration)
    liar.nixl.agent_name = "not-" + own
    report["mismatch"] = _refused(lambda: rig.ex.connect("liar", liar))
    rig.ex.disconnect("liar")
    report["a_after_mismatch"] = _warm(rig, "A")  # A's first call: it connects
    # Metadata of an agent nobody connected: refused and unloaded again.
    stranger = rig.add("S")
    rig.ex.disconnect("S")
    report["stranger_unloaded_on_disconnect"] = not _loaded(rig, stranger.registration.nixl.agent_name)
    odd = registration_pb2.KvRegistration()
    odd.CopyFrom(stranger.registration)
    odd.nixl.agent_name = "someone-else"
    report["mismatch_unknown"] = _refused(lambda: rig.ex.connect("odd", odd))
    report["mismatch_left_loaded"] = _loaded(rig, stranger.registration.nixl.agent_name)
    # The agent name inside the metadata is not UTF-8 (same length, so the metadata still parses).
    name = stranger.registration.nixl.agent_name.encode()
    bad_name = name[:-4] + b"\xff\xfe\xfd\xfc"
    mangled = registration_pb2.KvRegistration()
    mangled.CopyFrom(stranger.registration)
    mangled.nixl.agent_metadata = stranger.registration.nixl.agent_metadata.replace(name, bad_name)
    report["not_utf8"] = _refused(lambda: rig.ex.connect("mangled", mangled))
    report["not_utf8_left_loaded"] = _loaded(rig, bad_name)
    report["a_at_end"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
    report["a_exact"] = rig.exact("A")


def shared(rig: Rig, report: dict[str, Any]) -> None:
    """Two peers reach one agent; the first one's disconnect leaves the second one served."""
    a = rig.add("A")
    rig.ex.connect("A2", a.registration)
    rig.peers["A2"] = a
    rig.ex.disconnect("A")
    report["after_other_left"] = _warm(rig, "A2")  # the agent's first call: it connects
    report["exact"] = rig.exact("A2")
    report["loaded_while_used"] = _loaded(rig, a.registration.nixl.agent_name)
    rig.ex.disconnect("A2")
    report["unloaded_when_unused"] = not _loaded(rig, a.registration.nixl.agent_name)
    del rig.peers["A2"]


def bounds(rig: Rig, report: dict[str, Any]) -> None:
    """A row past the peer's NIXL region refuses that job only."""
    a = rig.add("A")
    unbounded = registration_pb2.KvRegistration()
    unbounded.CopyFrom(a.registration)
    unbounded.kv_buffers[0].length = 0  # "unknown": only the engine can tell
    rig.ex.connect("A", unbounded)
    dst = a.registration.kv_buffers[0].ptr
    past = TransferJob.of_runs([LayerSpan(rig.src.addr, dst, ROW)],
                               np.array([[0, 1, ROWS - 2, 1, 4]], dtype=np.int64), pack=False)
    report["past"] = _refused(lambda: rig.ex.execute("A", past))
    report["connected_after"] = "A" in rig.ex._peers
    report["inside"] = _warm(rig, "A")  # the first call that moves bytes
    report["exact"] = rig.exact("A")


def stuck_close(rig: Rig, report: dict[str, Any]) -> None:
    """close() after the frozen peer was disconnected: nothing is torn down under its stuck call."""
    # Its stderr must not hold our own open: the parent reads ours until it closes.
    a = rig.add("A", log_dir=tempfile.mkdtemp())
    report["warm"] = _warm(rig, "A")
    _freeze(a)
    report["stuck"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
    rig.ex.disconnect("A")  # what the server's core does to every peer before executor.close()
    report["quiet_before_close"] = rig.ex.quiesce("A", 0.1)
    rig.ex.close()
    report["engine_kept"] = rig.ex._engine is not None  # type: ignore[attr-defined]
    report["buffers_kept"] = len(rig.ex._buffers)
    report["frozen_pid"] = a.proc.pid
    del rig.peers["A"]  # stays frozen: this process must exit with A's call still inside the engine


class _CancelUnderWay:
    """A NIXL agent whose ``release_xfer_handle`` fails, as it does while a cancel is under way, until ``done``."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.done = threading.Event()
        self.refused = 0

    def release_xfer_handle(self, handle: Any) -> Any:
        if not self.done.is_set():
            self.refused += 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        return self._agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def unreleased(rig: Rig, report: dict[str, Any]) -> None:
    """A transfer NIXL will not release yet keeps its staging extent, and its peer is not quiet."""
    a = rig.add("A")
    report["warm"] = _warm(rig, "A")
    agent = _CancelUnderWay(rig.ex._agent)  # type: ignore[attr-defined]
    rig.ex._agent = agent  # type: ignore[attr-defined]
    _freeze(a)
    report["stuck"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
    worker = rig.ex._peers["A"].worker
    # The worker's own call has returned (it retried the release for a while, then left it).
    report["worker_returned"] = worker is not None and bool(futures.wait([worker.idle()], timeout=60).done)
    report["refused_releases"] = agent.refused
    report["held_while_cancelling"] = list(rig.ex.held())
    report["quiet_while_cancelling"] = rig.ex.quiesce("A", 0.5)
    marker = rig.ex.drained("A")
    report["drained_while_cancelling"] = marker is None or bool(futures.wait([marker], timeout=0.5).done)
    report["next_while_cancelling"] = _outcome(lambda: rig.ex.execute("A", rig.job("A")))
    agent.done.set()  # NIXL lets go of the handle
    report["quiet_later"] = rig.ex.quiesce("A", 60)
    report["drained_later"] = marker is None or marker.result(timeout=60) is None
    _until_released(rig, 60, 0.1)
    report["held_after"] = list(rig.ex.held())
    _thaw_and_resume(rig, report)


def probes(rig: Rig, report: dict[str, Any]) -> None:
    """A probe that cannot say (none free) neither refuses a peer as gone nor writes a healthy one off."""
    from pdproto.transfer.engines import mooncake

    mooncake.MAX_PENDING_PROBES = 1
    b = rig.add("B")
    report["warm"] = _warm(rig, "B")
    with _black_hole() as silent:
        hole = registration_pb2.KvRegistration()
        hole.mooncake.session_id = silent
        hole.kv_buffers.add(ptr=1 << 40, length=ROWS * ROW)
        # Its probe waits on the silent session for up to a minute after connect gives up.
        report["hole"] = _outcome(lambda: rig.ex.connect("hole", hole))
        report["another"] = _refused(lambda: rig.ex.connect("B2", b.registration))
        # A batch of B's fails (its session is named wrongly for it) while no probe is free.
        peer = rig.ex._peers["B"]
        session, peer.remote = peer.remote, "127.0.0.1:1"
        report["failed_batch"] = _outcome(lambda: rig.ex.execute("B", rig.job("B")))
        peer.remote = session
        report["b_connected"] = "B" in rig.ex._peers
        report["b_after"] = _outcome(lambda: rig.ex.execute("B", rig.job("B")))


SCENARIOS: dict[str, Callable[[Rig, dict[str, Any]], None]] = {
    "frozen": frozen, "blackhole": blackhole, "identity": identity, "shared": shared, "bounds": bounds,
    "stuck_close": stuck_close, "unreleased": unreleased, "probes": probes, "slow": slow}


def run_scenario(scenario: str, backend: str, timeout: float = 240.0) -> dict[str, Any]:
    """Parent side: run one scenario in a fresh process and return its report."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests._engine_rig", scenario, backend], cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"{scenario} ({backend}) exited {proc.returncode}: {proc.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return report


def main(argv: list[str]) -> int:
    """Run one scenario and print its report as one JSON line on the real stdout."""
    scenario, backend = argv
    os.environ.update(ENV)  # before the first NIXL agent of this process starts
    os.environ.update(SCENARIO_ENV.get(scenario, {}))
    out = redirect_stdout_to_stderr()
    rig = Rig(backend)
    report: dict[str, Any] = {}
    try:
        SCENARIOS[scenario](rig, report)
    finally:
        rig.close()
    out.write(json.dumps(report) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
