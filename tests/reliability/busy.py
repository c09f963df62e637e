"""Busy sessions: one prefill executor writes per-row descriptors to 8 or 16 decodes at once.

Every session gets a DCP-4 relayout job left unpacked (one descriptor per row: 2,048 rows a
layer, so each layer is one full engine batch; 4 layers at 8 sessions, 2 at 16, so a round
moves 65,536 descriptors either way) in every round, all sessions in flight together, and every decode's whole pool is compared with its source rows after each
round. What must hold: no batch fails (before the executor set the Mooncake TCP lanes'
admission wait, a loaded host failed 2,048-descriptor batches with rc -1 and the peer's
queue then stayed full), no job is slower than its deadline, every byte lands.

The engine runs in a child process (``python -m tests.reliability.busy BACKEND SESSIONS``,
one JSON line on stdout): NIXL wants one agent per process, and the engines read their
environment once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import numpy as np

from .harness import LOG_DIR, Outcome

ROWS, ROW, PAGE, DCP = 2048, 1152, 64, 4
DESCRIPTORS_PER_ROUND = 65536
ROUNDS = 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def busy_sessions(backend: str, sessions: int) -> Outcome:
    """The row: ``sessions`` decodes fed per-row batches at once for ``ROUNDS`` rounds."""
    out = Outcome(f"busy sessions x{sessions}", backend)
    proc = subprocess.run([sys.executable, "-m", "tests.reliability.busy", backend, str(sessions)],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    with open(os.path.join(LOG_DIR, f"busy-{backend}-{sessions}.log"), "w") as log:
        log.write(proc.stderr)
    try:
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out.problems.append(f"the rig crashed (rc {proc.returncode}): {proc.stderr[-300:]}")
        return out
    out.runs, out.ok, out.bytes_verified = r["jobs"], r["ok"], r["bytes_verified"]
    out.lost, out.corrupted = len(r["failures"]), r["corrupted"]
    out.problems += r["failures"][:3]
    out.notes.append(f"{r['jobs']} jobs of {r['descriptors_per_job']:,} descriptors ({sessions} at once): "
                     f"{r['descriptors_per_s']:,.0f} descriptors/s, slowest job {r['slowest_s']:.1f} s, "
                     f"{len(r['failures'])} failed")
    return out


def _rig(backend: str, sessions: int) -> dict[str, object]:
    from pdproto.dcp import DcpLayout, plan_chunk
    from pdproto.errors import PdprotoError
    from pdproto.transfer import LayerSpan, TransferJob, create_executor
    from pdproto_demo.decode import DecodeConfig, DecodeProcess

    src_rows = ROWS * DCP
    layers = max(1, DESCRIPTORS_PER_ROUND // (sessions * ROWS))
    ex = create_executor(backend, transfer_timeout_s=120)
    peers: list[DecodeProcess] = []
    try:
        config = DecodeConfig(backend=backend, layers=layers, pages=ROWS, page_size=1, row_bytes=ROW, background=0)
        peers = [DecodeProcess.spawn_rank(config, label=f"busy-{i}", log_dir=LOG_DIR) for i in range(sessions)]
        for p in peers:
            p.await_ready(180)
        rng = np.random.default_rng(sessions)
        fill = rng.integers(0, 256, (layers, src_rows, ROW), dtype=np.uint8)
        srcs = [ex.allocate(src_rows * ROW) for _ in range(layers)]
        for layer, b in enumerate(srcs):
            b.array[:] = fill[layer].reshape(-1)
        ex.register_memory(srcs)
        jobs, expected = [], []
        for i, p in enumerate(peers):
            ex.connect(f"busy-{i}", p.registration)
            spans = tuple(LayerSpan(s.addr, d.ptr, ROW) for s, d in zip(srcs, p.registration.kv_buffers))
            # Each session reads other (scattered) prefill pages, so a misrouted write shows.
            plan = plan_chunk(DcpLayout(PAGE), DcpLayout(PAGE, DCP, i % DCP), rng.permutation(src_rows // PAGE),
                              np.arange(ROWS // PAGE))
            jobs.append(TransferJob.of_runs(spans, plan.target_runs, pack=False))
            expected.append(plan.expand())

        def run(i: int) -> tuple[int, float, str]:
            t0 = time.monotonic()
            try:
                res = ex.execute(f"busy-{i}", jobs[i])
                return res.descriptors, time.monotonic() - t0, ""
            except PdprotoError as exc:
                return 0, time.monotonic() - t0, f"session {i}: {exc}"

        failures: list[str] = []
        ok = corrupted = checked = descriptors = 0
        slowest = busy = 0.0
        with futures.ThreadPoolExecutor(sessions) as pool, tempfile.TemporaryDirectory() as tmp:
            for _ in range(ROUNDS):
                t0 = time.monotonic()
                results = list(pool.map(run, range(sessions)))
                busy += time.monotonic() - t0
                for i, (n, secs, error) in enumerate(results):
                    descriptors += n
                    slowest = max(slowest, secs)
                    if error:
                        failures.append(error)
                        continue
                    path = os.path.join(tmp, f"{i}.bin")
                    peers[i].call("dump", path=path)
                    got = np.fromfile(path, dtype=np.uint8).reshape(layers, ROWS, ROW)
                    src, dst = expected[i]
                    checked += got.nbytes
                    if all(np.array_equal(got[layer][dst], fill[layer][src]) for layer in range(layers)):
                        ok += 1
                    else:
                        corrupted += 1
                        failures.append(f"session {i}: destination bytes differ from the source rows")
        return {"jobs": sessions * ROUNDS, "ok": ok, "corrupted": corrupted, "failures": failures,
                "bytes_verified": checked, "descriptors_per_job": layers * ROWS,
                "descriptors_per_s": descriptors / busy if busy else 0.0, "slowest_s": slowest}
    finally:
        for p in peers:
            p.close()
        ex.close()


def main(argv: list[str]) -> int:
    """Run the rig for one backend and session count; print its JSON report."""
    backend, sessions = argv[0], int(argv[1])
    report = _rig(backend, sessions)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
