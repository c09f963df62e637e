"""Benchmarks run by ``make bench``; each bench_*.py module has a ``main() -> int``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from pdproto.errors import EngineUnavailableError

_R = TypeVar("_R")


def per_backend(run: Callable[[str], _R], report: Callable[[str, _R, float], None]) -> int:
    """Run ``run`` for each engine of PDPROTO_BENCH_BACKENDS (default mooncake,nixl), then ``report``
    (engine, result, seconds); a missing engine is skipped, a failure printed; non-zero if one failed."""
    rc = 0
    for backend in os.environ.get("PDPROTO_BENCH_BACKENDS", "mooncake,nixl").split(","):
        t0 = time.perf_counter()
        try:
            result = run(backend)
        except EngineUnavailableError as exc:
            print(f"{backend:<9} skipped: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - report and carry on with the next engine
            print(f"{backend:<9} FAILED: {exc!r}")
            rc = 1
            continue
        report(backend, result, time.perf_counter() - t0)
    return rc
