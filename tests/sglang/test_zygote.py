"""The SGLang tests' zygote (tests/sglang/_zygote.py): a forked child behaves as ``python -c``/``-m`` would.

The other SGLang tests rely on this: their processes read the caller's stdin,
environment and working directory, answer on its stdout, end with their own exit code,
die with their launcher and get its signals, and find SGLang imported but no plugin
loaded and no pdproto module imported.
"""

from __future__ import annotations

import array
import json
import os
import shlex
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.sglang._zygote import command

pytestmark = pytest.mark.process

REPORT = textwrap.dedent("""
    import json, os, sys
    line = sys.stdin.readline().strip()
    from sglang.srt import plugins
    print(json.dumps({
        "line": line, "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_TEST"),
        "main": __name__, "path0": sys.path[0],
        "preloaded": "sglang.srt.disaggregation.mooncake.conn" in sys.modules,
        "pdproto": sorted(m for m in sys.modules if m.split(".")[0].startswith("pdproto")),
        "plugins_loaded": getattr(plugins, "_plugins_loaded", None),
    }), flush=True)
    sys.exit(3)
""")


def _spawn(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(command(*args), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


def test_a_child_reads_the_callers_stdin_env_and_cwd_and_exits_with_its_own_code(tmp_path: Path) -> None:
    """Everything a ``python -c`` child would get from its parent arrives, and its exit code comes back."""
    proc = _spawn("-c", REPORT, "a", "b", cwd=tmp_path, env={**os.environ, "ZYGOTE_TEST": "seen"})
    out, err = proc.communicate("hello\n", timeout=120)
    assert proc.returncode == 3, err
    report = json.loads(out)
    assert report["line"] == "hello"
    assert report["argv"] == ["-c", "a", "b"]
    assert (report["cwd"], report["env"], report["main"], report["path0"]) == (str(tmp_path), "seen", "__main__", "")
    assert report["preloaded"] is True
    assert report["pdproto"] == []  # the plugin tests import it themselves, through load_plugins()
    assert report["plugins_loaded"] is False


def test_a_module_runs_as_main_with_its_arguments() -> None:
    """``-m MODULE ARGS``: the module's own argument parsing sees ARGS."""
    proc = _spawn("-m", "json.tool", "--compact")
    out, err = proc.communicate('{"a": [1, 2]}', timeout=120)
    assert (proc.returncode, out.strip()) == (0, '{"a":[1,2]}'), err


def test_an_uncaught_exception_exits_1_with_its_traceback() -> None:
    """As an interpreter would: the traceback on the caller's stderr, status 1."""
    proc = _spawn("-c", "raise RuntimeError('from the child')")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: from the child" in err


def _pid_line(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie still waiting for the zygote to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between it and the read
        return True


SLEEPER = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(300)\n"


def test_killing_the_launcher_kills_its_child() -> None:
    """A test that SIGKILLs what it started (a decode dying mid-transfer) kills the real process."""
    proc = _spawn("-c", SLEEPER)
    child = _pid_line(proc)
    assert child != proc.pid and not _gone(child)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    for _ in range(1200):  # bounded: 60 s (10 s was once too short on a loaded 2-core host)
        if _gone(child):
            break
        time.sleep(0.05)
    assert _gone(child)


def test_a_launcher_killed_before_it_read_the_pid_line_still_takes_its_child_and_spares_the_zygote() -> None:
    """Closing with the zygote's "P" line unread makes Linux reset the connection instead of an EOF: the child
    dies all the same and the zygote goes on serving (it once died there, leaving the child running)."""
    path = command("-c", "pass")[4]
    out_r, out_w = os.pipe()
    body = json.dumps({"argv": ["-c", SLEEPER], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_err:
        conn.sendmsg([len(body).to_bytes(4, "big") + body],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", (null_in.fileno(), out_w,
                                                                                null_err.fileno())).tobytes())])
    os.close(out_w)
    with os.fdopen(out_r) as out:
        child = int(out.readline())
    for _ in range(600):  # bounded: 30 s for the "P" line to arrive, so the close below resets
        try:
            if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                break
        except BlockingIOError:
            pass
        time.sleep(0.05)
    conn.close()
    for _ in range(1200):  # bounded: 60 s
        if _gone(child):
            break
        time.sleep(0.05)
    assert _gone(child)
    proc = _spawn("-c", "print('still serving')")
    assert proc.communicate(timeout=120)[0].strip() == "still serving"


def test_signals_reach_the_child_and_its_ending_comes_back() -> None:
    """SIGTERM with a handler: the child's own exit code; without one: killed by SIGTERM, as the caller sees it."""
    handled = _spawn("-c", "import os, signal, sys, time\n"
                           "signal.signal(signal.SIGTERM, lambda *_: (print('term', flush=True), sys.exit(5)))\n"
                           + SLEEPER)
    _pid_line(handled)
    handled.terminate()
    out, _ = handled.communicate(timeout=30)
    assert (handled.returncode, out.strip()) == (5, "term")
    default = _spawn("-c", SLEEPER)
    _pid_line(default)
    default.terminate()
    assert default.wait(30) == -signal.SIGTERM


def test_a_caller_without_stdin_gives_the_child_an_empty_one() -> None:
    """CI runs with no standard input: a closed stdin reaches the child as /dev/null, an empty input, not an error."""
    launched = shlex.join(command("-c", "import sys; print(repr(sys.stdin.read()))"))
    out = subprocess.run(["bash", "-c", f"exec 0<&-; {launched}"], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "''"), out.stderr
