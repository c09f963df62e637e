"""`make reliability`: fault injection, version skew, limits and load; prints one table.

Usage: python -m tests.reliability.run [--backends mooncake,nixl] [--requests 200] [--soak-s 60]
[--only NAME ...] [--write-doc]. Exit status 0 only when every row passes (0 lost, 0 corrupted, every fault
reported with a reason, the server healthy afterwards).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from collections.abc import Callable

from . import busy, crash, exactly_once, faults, flood, hostile, limits, load, memory, mixed, skew, soak, stuck
from .harness import HEADER, LOG_DIR, Outcome, row

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "reliability.md")


def plan(backends: list[str], requests: int, soak_s: float = 60.0) -> list[tuple[str, str, Callable[[], Outcome]]]:
    """(name, backend, thunk) for every row, in table order."""
    rows: list[tuple[str, str, Callable[[], Outcome]]] = []
    for b in backends:
        for name in faults.SCENARIOS:
            rows.append((name, b, lambda name=name, b=b: faults.run(name, b)))  # type: ignore[misc]
    rows.append(("skew", backends[0], lambda: skew.minor_skew(backends[0])))
    rows.append(("mixed_fleet", "mooncake", mixed.mixed_fleet))
    rows.append(("limits", "local", lambda: limits.resource_limits("local")))
    rows.append(("auth", "local", lambda: limits.auth("local")))
    rows.append(("tls", "local", lambda: limits.tls("local")))
    rows.append(("hostile_peer", "local", lambda: hostile.hostile_peer("local")))
    rows.append(("call_flood", "local", lambda: flood.call_flood("local")))
    for b in [b for b in backends if b in ("mooncake", "nixl")]:
        rows.append(("identity_squat", b, lambda b=b: hostile.identity_squat(b)))  # type: ignore[misc]
    rows.append(("memory", "local", lambda: memory.memory_limits("local")))
    rows.append(("exactly_once", "local", lambda: exactly_once.exactly_once("local")))
    for b in dict.fromkeys(["local", *backends]):
        rows.append(("crashing_peer", b, lambda b=b: crash.crashing_peer(b)))  # type: ignore[misc]
    for b in [b for b in backends if b in ("mooncake", "nixl")]:
        rows.append(("stuck_peer", b, lambda b=b: stuck.stuck_peer(b)))  # type: ignore[misc]
    for b in [b for b in backends if b in ("mooncake", "nixl")]:
        rows.append(("multihost", b, lambda b=b: crash.multihost(b)))  # type: ignore[misc]
    for b in [b for b in backends if b in ("mooncake", "nixl")]:
        for n in (8, 16):
            rows.append(("busy", b, lambda b=b, n=n: busy.busy_sessions(b, n)))  # type: ignore[misc]
    for b in backends:
        rows.append(("load", b, lambda b=b: load.load(b, requests)))  # type: ignore[misc]
    for b in [b for b in backends if b in ("mooncake", "nixl")]:
        rows.append(("soak", b, lambda b=b: soak.soak(b, soak_s)))  # type: ignore[misc]
    return rows


def _guard(name: str, backend: str, fn: Callable[[], Outcome]) -> Outcome:
    try:
        return fn()
    except Exception as exc:  # a crashed scenario is a FAIL row, never a silent skip
        o = Outcome(name, backend)
        o.problems.append(f"crashed: {type(exc).__name__}: {exc}")
        return o


def write_doc(outcomes: list[Outcome], elapsed: float) -> None:
    """Replace the results block of docs/reliability.md with this run's table and notes."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Run {stamp}, {elapsed:.0f} s, `make reliability` on a shared 2-core host.", "",
             "| scenario | backend | runs | faults | ok | failed as expected | lost | corrupted "
             "| bytes verified | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.scenario} | {o.backend} | {o.runs} | {o.faults} | {o.ok} | {o.failed_expected} | "
                     f"{o.lost} | {o.corrupted} | {o.bytes_verified:,} | {o.result} |")
    lines += ["", "Reasons and measurements reported by the run:", ""]
    for o in outcomes:
        for n in dict.fromkeys(o.notes[:4]):
            lines.append(f"- {o.scenario} ({o.backend}): {n}")
        for p in o.problems[:3]:
            lines.append(f"- **{o.scenario} ({o.backend}) problem**: {p}")
    block = "\n".join(lines)
    with open(DOC) as fh:
        text = fh.read()
    text = re.sub(r"<!-- results:begin -->.*<!-- results:end -->",
                  f"<!-- results:begin -->\n{block}\n<!-- results:end -->", text, flags=re.S)
    with open(DOC, "w") as fh:
        fh.write(text)


def main(argv: list[str] | None = None) -> int:
    """Run every scenario and print the table; non-zero on any FAIL row."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backends", default="mooncake,nixl")
    ap.add_argument("--requests", type=int, default=200, help="load: requests per decode peer")
    ap.add_argument("--soak-s", type=float, default=60.0,
                    help="soak: seconds of traffic per engine, warm-up included (600 for the 10-minute soak)")
    ap.add_argument("--only", nargs="*", default=None, help="row names to run (e.g. decode_killed load)")
    ap.add_argument("--write-doc", action="store_true", help="record the table in docs/reliability.md")
    args = ap.parse_args(argv)
    # Every process shares this host: engines advertise loopback, so traffic stays on 127.0.0.1
    # (the multi-host row drops it for the processes it starts in its namespaces).
    os.environ.setdefault("PDPROTO_ADVERTISE_HOST", "127.0.0.1")
    backends = [b for b in args.backends.split(",") if b]
    rows = [r for r in plan(backends, args.requests, args.soak_s) if args.only is None or r[0] in args.only]
    print(f"process logs: {LOG_DIR}", file=sys.stderr)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    for i, (name, backend, fn) in enumerate(rows):
        print(f"[{i + 1}/{len(rows)}] {name} ({backend}) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        o = _guard(name, backend, fn)
        outcomes.append(o)
        print(f"    {o.result} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        for p in o.problems:
            print(f"    problem: {p}", file=sys.stderr)
    elapsed = time.monotonic() - t0
    print(HEADER)
    for o in outcomes:
        print(row(o))
    print()
    for o in outcomes:
        for n in dict.fromkeys(o.notes[:4]):
            print(f"  {o.scenario} ({o.backend}): {n}")
    failed = [o for o in outcomes if not o.passed]
    lost = sum(o.lost for o in outcomes)
    corrupted = sum(o.corrupted for o in outcomes)
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(outcomes)} rows, {len(failed)} failing, "
          f"{lost} lost, {corrupted} corrupted, {sum(o.faults for o in outcomes)} faults injected, "
          f"{elapsed:.0f} s")
    if args.write_doc:
        write_doc(outcomes, elapsed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
