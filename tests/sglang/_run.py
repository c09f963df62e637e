"""Run code against SGLang 0.5.23 in a process of its own.

SGLang is never imported into the pytest process: its import installs the CPU stubs
(tests/sglang/_stubs.py), which other tests' torch must not see, and every plugin test
needs an interpreter where ``load_plugins()`` has not run yet. The process is a fork of
the worker's zygote (tests/sglang/_zygote.py), which has imported SGLang but loaded no plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from tests.sglang._zygote import command

REPO = Path(__file__).resolve().parents[2]
_PRELUDE = "from tests.sglang import _stubs\n_stubs.install()\nimport json\n"


def run_sglang(code: str, *, env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    """Run ``code`` (after the stubs are installed); it must print one JSON value last."""
    proc = subprocess.run(
        command("-c", _PRELUDE + textwrap.dedent(code)),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"subprocess failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])
