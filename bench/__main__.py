"""Run every benchmark module (bench/bench_*.py) in name order, or those named on the command line."""

from __future__ import annotations

import importlib
import os
import pathlib
import sys


def main(argv: list[str]) -> int:
    """Run the selected benchmarks; return non-zero if any failed."""
    # Prefill and decode processes share this host: engines advertise loopback, so traffic
    # stays on 127.0.0.1 (by default they advertise this host's routable address).
    os.environ.setdefault("PDPROTO_ADVERTISE_HOST", "127.0.0.1")
    here = pathlib.Path(__file__).parent
    names = argv or sorted(p.stem for p in here.glob("bench_*.py"))
    rc = 0
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        print(f"\n### {name}", flush=True)
        rc |= int(module.main() or 0)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
