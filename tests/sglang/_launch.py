"""Stand in for one SGLang test process that ``tests/sglang/_zygote.py`` forks (stdlib only, run with ``-S -I``).

``python -S -I _launch.py SOCKET -m MODULE ARGS...`` (or ``-c CODE ARGS...``) hands this
process's stdin, stdout and stderr, environment and working directory to the zygote,
which forks a child that runs them with SGLang already imported. This process then
behaves as that child would to whoever started it: the signals it gets are passed on,
and it ends as the child ends, with its exit code, or by the same signal. If it is
killed itself, the zygote sees the connection close and kills the child.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    """Connect, hand over, relay signals until the child's exit, then end the same way."""
    path, argv = sys.argv[1], sys.argv[2:]
    for fd in (0, 1, 2):  # a closed one (a caller without stdin) is handed on as /dev/null
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest free descriptor: this one
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    header = len(body).to_bytes(4, "big")
    conn.sendmsg([header + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", (0, 1, 2)).tobytes())])
    for signum in FORWARDED:
        signal.signal(signum, lambda n, _frame: conn.sendall(f"S {n}\n".encode()))
    lines = conn.makefile("r")
    status = None
    for line in lines:
        kind, _, value = line.strip().partition(" ")
        if kind == "X":
            status = int(value)
            break
    if status is None:
        sys.stderr.write(f"tests/sglang/_launch.py: the zygote at {path} closed without the child's exit"
                         " status (it failed or was stopped; see its log beside the socket)\n")
        sys.exit(70)
    if status < 0:  # killed by a signal: end by the same one, so Popen.returncode reads the same
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
