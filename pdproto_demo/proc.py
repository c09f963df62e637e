"""Child processes driven by JSON lines: the demo and reliability runs use one per rank.

The parent writes one JSON command per line on the child's stdin and reads one JSON reply
per line from its stdout; stderr is passed through (or captured to a file). Every read has a
deadline, every child runs in its own process group, and ``close`` always reaps it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any, Self

Reply = dict[str, Any]


class ChildError(RuntimeError):
    """A child process died, timed out, or answered with an error."""


class Child:
    """One worker process speaking JSON lines; create with ``Child.spawn``."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self._replies: queue.Queue[Reply | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(
        cls, name: str, module: str, args: list[str], *, env: dict[str, str] | None = None,
        log_dir: str | None = None,
    ) -> Self:
        """Start ``python -m module args`` in its own process group; stderr goes to ``log_dir/name.log``."""
        log = open(os.path.join(log_dir, f"{name}.log"), "ab") if log_dir else None
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
            env={"PYTHONUNBUFFERED": "1", **os.environ, **(env or {})},
            start_new_session=True,
        )
        if log is not None:
            log.close()  # the child holds its own descriptor
        return cls(name, proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue  # engines sometimes print banners on stdout; replies are JSON objects
            try:
                self._replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._replies.put(None)

    def send(self, op: str, **fields: Any) -> None:
        """Send one command without waiting for the reply."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise ChildError(f"{self.name}: cannot send {op}: {exc}") from exc

    def recv(self, timeout: float) -> Reply:
        """Next reply; raises ChildError on death, timeout or an error reply."""
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(f"{self.name}: no reply within {timeout:.0f} s") from None
        if reply is None:
            raise ChildError(f"{self.name}: exited with {self.proc.wait(timeout=5)}")
        if reply.get("error"):
            raise ChildError(f"{self.name}: {reply['error']}")
        return reply

    def call(self, op: str, timeout: float = 60.0, **fields: Any) -> Reply:
        """Send a command and wait for its reply."""
        self.send(op, **fields)
        return self.recv(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's whole process group (fault injection and cleanup)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill_and_reap(self, timeout: float = 10.0) -> int:
        """SIGKILL the child and wait until it is gone (its memory is unmapped once reaped)."""
        self.kill()
        return self.proc.wait(timeout=timeout)

    def close(self, timeout: float = 10.0) -> int:
        """Ask the child to quit, then kill its group if it lingers; returns its exit status."""
        self.ask_to_quit()
        return self.reap(timeout)

    def ask_to_quit(self) -> None:
        """Send ``quit`` if the child still runs, without waiting for it to exit (``close_all``)."""
        if self.proc.poll() is None:
            try:
                self.send("quit")
            except ChildError:
                pass

    def reap(self, timeout: float = 10.0) -> int:
        """Wait up to ``timeout`` for the child to exit, then kill its group; returns its exit status."""
        if self.proc.poll() is None:
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass


def close_all(children: Iterable[Child], timeout: float = 10.0) -> None:
    """``close`` several children, asking all of them to quit first: a rank's exit takes about a
    second (its engine and libraries unload), and one at a time that added up for every group."""
    children = list(children)
    for child in children:
        child.ask_to_quit()
    for child in children:
        try:
            child.reap(timeout)
        except (ChildError, OSError):
            pass


def serve_commands(handlers: dict[str, Callable[..., Reply]], out: IO[str], ready: Reply) -> None:
    """Child side: write the ready line (``ready``, with the pid), then read commands from stdin and answer
    each with one JSON line on ``out`` until ``quit`` or EOF."""
    out.write(json.dumps({"ready": True, "pid": os.getpid(), **ready}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            reply = handlers[op](**cmd)
        except Exception as exc:  # every failure goes back to the parent, typed where possible
            reason = getattr(getattr(exc, "reason", None), "name", type(exc).__name__)
            reply = {"error": f"{op}: {reason}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def redirect_stdout_to_stderr() -> IO[str]:
    """Keep a private handle on stdout for replies and send everything else (engine logs) to stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return replies
