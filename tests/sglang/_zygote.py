"""Start every SGLang test process as a fork of one interpreter that has imported SGLang already.

Importing SGLang 0.5.23 (with torch and transformers, behind the CPU stubs) costs about
14 s of CPU on these two-core machines, and the SGLang tests start 17 such processes:
that import was most of their time. ``command(...)`` returns the command line for such a
process. It starts ``tests/sglang/_launch.py``, which hands its stdin, stdout, stderr,
environment and working directory to this worker's zygote (started on first use): the
zygote forks, and the child runs the code with everything below already imported. The
launcher forwards signals and ends as the child ends, so callers keep using ``Popen`` as
for any process.

What the children share with a fresh ``python -c``/``-m`` and what they do not:

* They get the caller's environment, but module-level code that read the environment
  ran in the zygote. SGLang reads its ``SGLANG_*`` settings when they are used
  (``envs.X.get()``), torch and Mooncake at run time; ``PRELOAD`` holds nothing that
  reads a test's settings at import.
* Nothing in ``PRELOAD`` loads plugins: each child still finds ``load_plugins()``
  not yet run, which the plugin tests need.
* The zygote holds no thread of its own, socket or engine when it forks (torch's idle
  pool thread is not carried into a fork).

What the launcher cannot pass on: ``Popen.pid`` is the launcher's, so ``/proc/<pid>`` shows it
and not the child, and SIGSTOP (which no process can catch) stops only the launcher. A test
that freezes a process or reads its CPU or memory starts it with ``sys.executable`` instead.

``PDPROTO_SGLANG_ZYGOTE=0`` starts plain interpreters instead.

The vLLM tests use the same machinery with another preload (``command(..., preload=
"tests.vllm._rig")``: that module's ``PRELOAD``, in .venv-vllm): one zygote per preload
and test process, each started on first use.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = Path(__file__).with_name("_launch.py")
PRELOAD = (
    "sglang.srt.server_args",
    "sglang.srt.plugins",
    "sglang.srt.runtime_context",
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.managers.disagg_service",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.configs.kimi_linear",
    "sglang.srt.configs.mamba_utils",
)
"""Imported once by the zygote: what the SGLang test processes import, short of pdproto itself."""

_lock = threading.Lock()
_started: dict[str, tuple[subprocess.Popen[bytes], str]] = {}


def command(*args: str, preload: str = "") -> list[str]:
    """The command line that runs ``python *args`` (``-c CODE ...`` or ``-m MODULE ...``) as a fork of the zygote
    (``preload``: a module whose ``PRELOAD`` the zygote imports; default: SGLang's, above)."""
    if args[:1] not in (("-c",), ("-m",)) or len(args) < 2:
        raise ValueError(f"the zygote runs `-c CODE` or `-m MODULE` only, not {args[:2]}")
    if os.environ.get("PDPROTO_SGLANG_ZYGOTE") == "0":
        return [sys.executable, *args]
    return [sys.executable, "-S", "-I", str(LAUNCH), _socket(preload), *args]


def _socket(preload: str) -> str:
    """The socket of this process's zygote for ``preload``, starting the zygote the first time."""
    with _lock:
        started = _started.get(preload)
        if started is not None and started[0].poll() is None:
            return started[1]
        where = tempfile.mkdtemp(prefix="pdproto-zygote-")
        path = os.path.join(where, "socket")
        with open(os.path.join(where, "zygote.log"), "wb") as log:
            # Its stdin is how it learns this process ended: at EOF it stops.
            proc = subprocess.Popen([sys.executable, "-m", "tests.sglang._zygote", path, preload], cwd=REPO,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"listening":  # before its imports: callers queue meanwhile
            proc.kill()
            raise RuntimeError(f"the test zygote did not start; see {where}/zygote.log")
        atexit.register(_stop, proc, where)
        _started[preload] = (proc, path)
        return path


def _stop(proc: subprocess.Popen[bytes], where: str) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(where, ignore_errors=True)


# -- the zygote -----------------------------------------------------------------------------


def _preload(preload: str) -> None:
    """Install the CPU stubs and import ``PRELOAD`` (or import ``preload`` and its ``PRELOAD``); a failure is
    left for each child to meet itself."""
    try:
        if preload:
            names = tuple(importlib.import_module(preload).PRELOAD)
        else:
            from tests.sglang import _stubs

            _stubs.install()
            names = PRELOAD
        for name in names:
            importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - the child's own import raises it again, where a test sees it
        traceback.print_exc()
    # Everything imported so far lives as long as any child: the children's collections
    # (and their copy-on-write pages) leave it alone.
    gc.collect()
    gc.freeze()


def _serve(listener: socket.socket) -> tuple[list[str], str]:
    """Fork a child for each launcher that connects; return only in a child, with its argv and cwd."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "parent")
    child_of: dict[socket.socket, int] = {}
    conn_of: dict[int, socket.socket] = {}

    def drop(conn: socket.socket) -> None:
        sel.unregister(conn)
        conn.close()

    while True:
        for key, _ in sel.select(0.05):
            if key.data == "parent":
                if not os.read(0, 4096):  # the test worker is gone
                    for pid in conn_of:
                        os.kill(pid, signal.SIGKILL)
                    sys.exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "launcher")
            else:
                conn = key.fileobj  # type: ignore[assignment]
                pid = child_of.get(conn)
                if pid is None:
                    try:
                        request, fds = _receive(conn)
                    except (OSError, ValueError) as exc:  # a launcher killed while it sent, or not one
                        print(f"dropped a launcher: {exc}", file=sys.stderr, flush=True)
                        drop(conn)
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        sel.close()
                        listener.close()
                        for other in (*child_of, conn):
                            other.close()
                        for target, fd in enumerate(fds):
                            os.dup2(fd, target)
                            os.close(fd)
                        os.chdir(request["cwd"])
                        os.environ.clear()
                        os.environ.update(request["env"])
                        return request["argv"], request["cwd"]
                    for fd in fds:
                        os.close(fd)
                    child_of[conn], conn_of[pid] = pid, conn
                    conn.sendall(f"P {pid}\n".encode())
                    continue
                try:
                    data = conn.recv(4096)
                except ConnectionResetError:  # killed before it read our "P" line: Linux resets, not EOF
                    data = b""
                if not data:  # the launcher was killed: so is its child
                    os.kill(pid, signal.SIGKILL)
                    drop(conn)
                    del child_of[conn]
                    continue
                for line in data.decode().splitlines():
                    kind, _, value = line.partition(" ")
                    if kind == "S":
                        os.kill(pid, int(value))
        while conn_of:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conn_of.pop(pid, None)  # None: a process the preload started, not a child of ours
            if conn is not None and child_of.pop(conn, None) is not None:
                try:
                    conn.sendall(f"X {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                drop(conn)


def _receive(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """One launcher's request (argv, env, cwd) and its stdin, stdout and stderr."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("a launcher closed before its request was complete")
        data += more
    if len(fds) != 3:
        raise ConnectionError(f"a launcher sent {len(fds)} file descriptors, not 3")
    return json.loads(data[4:4 + int.from_bytes(data[:4], "big")]), fds


def _run(argv: list[str], cwd: str) -> None:
    """Run ``argv`` as ``python`` would: ``-m MODULE ARGS`` or ``-c CODE ARGS``, as ``__main__``."""
    flag, target, *rest = argv
    if flag == "-m":
        sys.path[0] = cwd
        sys.argv = [target, *rest]  # run_module puts the module's file first
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = ""
        sys.argv = ["-c", *rest]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def main() -> None:
    """``python -m tests.sglang._zygote SOCKET [PRELOAD]``: listen, preload, fork on request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)
    print("listening", flush=True)
    _preload(sys.argv[2] if len(sys.argv) > 2 else "")
    argv, cwd = _serve(listener)
    _run(argv, cwd)


if __name__ == "__main__":
    main()
