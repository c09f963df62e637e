"""A stand-alone decode-side peer for tests, benchmarks and demos: ``python -m pdproto.transfer.peer``.

It allocates and registers ``--layers`` KV buffers of ``--rows`` × ``--row-bytes``.
It then prints ``READY <hex KvRegistration>`` and answers commands on stdin,
one per line. Every reply line starts with ``PDPEER `` (engines log to stdout too):
  ``dump PATH``  write every buffer, back to back, to PATH; reply ``OK``
  ``zero``       zero every buffer; reply ``OK``
  ``notifs [S]`` reply ``NOTIFS room,room,...``: notifications new since the last ``notifs``,
                 waiting up to S seconds for the first
  ``quit``       close the executor and exit
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import threading
import time

from pdproto.transfer import VRAM, create_executor, set_endpoint
from pdproto.v1 import common_pb2, registration_pb2


PREFIX = "PDPEER "


def _reply(text: str, flush: bool = True) -> None:
    print(PREFIX + text, flush=flush)


def main(argv: list[str] | None = None) -> int:
    """Run the peer until ``quit`` or end of stdin."""
    ap = argparse.ArgumentParser(prog="python -m pdproto.transfer.peer")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--row-bytes", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)

    size = args.rows * args.row_bytes
    ex = create_executor(args.backend, name=args.name, arena_bytes=max(size * args.layers * 2, 1 << 20))
    try:
        if args.device.startswith("cuda"):
            dev = int(args.device.split(":")[1]) if ":" in args.device else 0
            bufs = [ex.allocate(size, kind=VRAM, device=dev) for _ in range(args.layers)]
        else:
            bufs = [ex.allocate(size) for _ in range(args.layers)]
        ex.register_memory([b for b in bufs if args.backend != "local"])
        reg = registration_pb2.KvRegistration(page_size=1, kv_item_len=args.row_bytes,
                                              attention_kind=common_pb2.ATTENTION_KIND_MLA)
        if args.device.startswith("cuda"):
            reg.gpu_id = bufs[0].device
        set_endpoint(reg, ex.endpoint())
        reg.kv_buffers.extend(b.kv_buffer(item_len=args.row_bytes) for b in bufs)
        _reply("READY " + reg.SerializeToString().hex(), flush=True)
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "dump":
                with open(arg, "wb") as f:
                    for b in bufs:
                        data = b.array.cpu().numpy() if b.kind == VRAM else b.array
                        f.write(memoryview(data).cast("B"))
                _reply("OK")
            elif cmd == "zero":
                for b in bufs:
                    b.array[:] = 0
                _reply("OK")
            elif cmd == "notifs":
                # Notifications may trail the data by a moment; poll briefly before answering.
                deadline = time.monotonic() + float(arg or 0)
                received: list[int] = []
                while True:
                    received.extend(n.room for n in ex.notifications())
                    if received or time.monotonic() >= deadline:
                        break
                    time.sleep(0.01)
                _reply("NOTIFS " + ",".join(str(r) for r in received), flush=True)
            elif cmd == "quit":
                break
    finally:
        if args.backend == "local":
            ex.close()  # unlinks the /dev/shm arena, which would outlive the process
    # Engines are left to the OS: Mooncake's orderly teardown alone takes about a second,
    # and exiting without it is what a killed decode does anyway.
    sys.stdout.flush()
    os._exit(0)


class PeerProcess:
    """Runs ``python -m pdproto.transfer.peer`` in a child process and talks to it (tests, bench)."""

    def __init__(self, backend: str, *, layers: int, rows: int, row_bytes: int,
                 device: str = "cpu", timeout_s: float = 60.0) -> None:
        """Start the peer and wait (at most ``timeout_s``) for its registration."""
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdproto.transfer.peer", "--backend", backend,
             "--layers", str(layers), "--rows", str(rows), "--row-bytes", str(row_bytes),
             "--device", device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            ready = self._expect("READY")
            self.registration = registration_pb2.KvRegistration.FromString(bytes.fromhex(ready))
        except BaseException:
            self.kill()
            raise

    def _pump(self) -> None:
        # A reader thread, so every wait on the child can carry a timeout.
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):].rstrip("\n"))
        self._lines.put(None)

    def _expect(self, word: str) -> str:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer sent no {word} within {self.timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"peer exited before {word} (rc={self.proc.poll()})")
        head, _, rest = line.partition(" ")
        if head != word:
            raise RuntimeError(f"peer answered {line!r}, expected {word}")
        return rest

    def command(self, text: str, expect: str = "OK") -> str:
        """Send one command line and return the rest of the reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._expect(expect)

    def dump(self, path: str) -> None:
        """Ask the peer to write all its buffers to ``path``."""
        self.command(f"dump {path}")

    def notified_rooms(self, wait_s: float = 5.0) -> list[int]:
        """Rooms of the notifications the peer received (waits up to ``wait_s`` for the first)."""
        rest = self.command(f"notifs {wait_s}", expect="NOTIFS")
        return [int(x) for x in rest.split(",") if x]

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the peer and reap it."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        """Ask the peer to quit; kill it if it does not within 10 s."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()


if __name__ == "__main__":
    sys.exit(main())
