"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-host runs.

``NetnsPair`` (root, ``ip netns``) creates namespaces A and B, a veth pair between them
with 10.231.N.1/24 in A and 10.231.N.2/24 in B, loopback up in each, and removes all of
it on exit (the veth pair goes with its namespaces). Nothing routes anywhere else: traffic
stays on the pair and on each namespace's loopback. ``available()`` says whether this
machine can do it, and why not.

``multihost(backend)`` runs ``pdproto serve`` in A and decode ranks in B (this module's
``main``, one process each): a decode that advertises its default address moves requests
byte-exact; one that advertises 127.0.0.1 (Mooncake's old default) is refused at Register
with a reason that names ``PDPROTO_ADVERTISE_HOST``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be created here; otherwise (False, why not)."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (ip netns add)"
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2) is not installed"
    probe = f"pdp-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return True, ""


@dataclass
class NetnsPair:
    """Namespaces ``a`` and ``b``, and the addresses of each end of the veth pair."""

    a: str
    b: str
    addr_a: str
    addr_b: str

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]


@contextmanager
def netns_pair() -> Iterator[NetnsPair]:
    """Create the pair; always removed on exit, also when setting it up failed halfway."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    subnet = f"10.231.{os.getpid() % 250 + 1}"
    pair = NetnsPair(f"pdp{tag}a", f"pdp{tag}b", f"{subnet}.1", f"{subnet}.2")
    veth_a, veth_b = f"pv{tag}a", f"pv{tag}b"
    try:
        _ip("netns", "add", pair.a)
        _ip("netns", "add", pair.b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", pair.a)
        _ip("link", "set", veth_b, "netns", pair.b)
        for ns, dev, addr in ((pair.a, veth_a, pair.addr_a), (pair.b, veth_b, pair.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        _until_up((pair.a, veth_a), (pair.b, veth_b))
        yield pair
    finally:
        for ns in (pair.a, pair.b):
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", veth_a, check=False)  # only if it never made it into a namespace


def _until_up(*links: tuple[str, str], tries: int = 100) -> None:
    """Wait (at most ``tries`` x 50 ms) until each veth end's operational state is UP.

    The kernel reports a veth's carrier asynchronously (linkwatch, up to a second later); an engine
    that lists its interfaces before then leaves the veth out, and its peer across the pair then
    finds no transport the two share (NIXL: its agent metadata cannot be loaded).
    """
    for _ in range(tries):
        states = [_ip("-n", ns, "-o", "link", "show", "dev", dev).stdout for ns, dev in links]
        if all("state UP" in out for out in states):
            return
        time.sleep(0.05)
    raise RuntimeError(f"veth pair not up after {tries * 0.05:.0f} s: {states}")


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line of ``proc`` ("" on timeout or exit)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""),
                              daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def multihost(backend: str, requests: int = 3) -> dict[str, Any]:
    """``pdproto serve`` in namespace A, decodes in B; what each decode saw (see the module doc)."""
    from tests._server_harness import SERVE_ARGS

    tmp = tempfile.mkdtemp(prefix="pdproto-netns-")
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(secrets.token_hex(16))
    os.chmod(token_file, 0o600)
    report: dict[str, Any] = {"backend": backend}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PDPROTO_ADVERTISE_HOST", None)
    env.pop("UCX_NET_DEVICES", None)  # names this host's interfaces, which the namespaces do not have
    with netns_pair() as pair, open(os.path.join(tmp, "serve.log"), "w") as log:
        serve = subprocess.Popen(
            pair.command(pair.a, [sys.executable, "-m", "pdproto_server.cli", "serve", "--listen",
                                  f"{pair.addr_a}:0", "--token-file", token_file, "--backend", backend,
                                  *SERVE_ARGS]),
            cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            first = _first_line(serve, 60)
            report["serve_first_line"] = first.strip()
            port = json.loads(first)["port"]
            target = f"{pair.addr_a}:{port}"
            for variant, extra in (("default", {}), ("loopback", {"PDPROTO_ADVERTISE_HOST": "127.0.0.1"})):
                decode = subprocess.run(
                    pair.command(pair.b, [sys.executable, "-m", "tests._netns", target, token_file, backend,
                                          str(requests)]),
                    cwd=REPO, capture_output=True, text=True, timeout=180, env={**env, **extra})
                lines = decode.stdout.strip().splitlines()
                report[variant] = (json.loads(lines[-1]) if decode.returncode == 0 and lines
                                   else {"crashed": decode.returncode, "stderr": decode.stderr[-2000:]})
            report["serve_alive"] = serve.poll() is None
        finally:
            serve.terminate()
            try:
                serve.wait(timeout=20)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait(timeout=10)
    return report


def _decode(target: str, token_file: str, backend: str, requests: int) -> dict[str, Any]:
    """Inside namespace B: register, move ``requests`` rooms, check every byte."""
    from pdproto.client import HandshakeClient
    from pdproto.errors import PdprotoError
    from pdproto.v1 import common_pb2
    from pdproto_demo.decode import DecodeRank
    from tests._server_harness import SPEC

    with open(token_file) as f:
        token = f.read().strip()
    rank = DecodeRank.for_spec(SPEC, pages=16 * requests, backend=backend)
    out: dict[str, Any] = {"endpoint": str(rank.registration().WhichOneof("transport"))}
    reg = rank.registration()
    if reg.HasField("mooncake"):
        out["session_id"] = reg.mooncake.session_id
    try:
        with HandshakeClient(target, token=token, timeout=30) as client:
            try:
                peer_id = client.register(reg).peer_id
            except PdprotoError as exc:
                out["refused"] = {"reason": exc.reason.name, "message": exc.message,
                                  "field": getattr(exc, "field", None)}
                return out
            rooms = {room: rank.pages_for(SPEC.prompt_tokens, first_page=16 * i)
                     for i, room in enumerate(range(100, 100 + requests))}
            for room, pages in rooms.items():
                client.submit_transfer(peer_id, rank.transfer_info(room, pages))
            done = client.wait_for(peer_id, list(rooms), timeout=120)
            out["states"] = {str(r): (int(s.state), s.failure_code) for r, s in done.items()}
            ok = [r for r, s in done.items() if s.state == common_pb2.TRANSFER_STATE_SUCCESS]
            out["ok"] = len(ok)
            out["checked"] = rank.verify({r: rooms[r] for r in ok}, SPEC.prompt_tokens) if ok else 0
            client.deregister(peer_id)
    finally:
        rank.close()
    return out


def main(argv: list[str]) -> int:
    """Decode side (run inside namespace B): one JSON report on the real stdout."""
    from pdproto_demo.proc import redirect_stdout_to_stderr

    out = redirect_stdout_to_stderr()
    target, token_file, backend, requests = argv
    out.write(json.dumps(_decode(target, token_file, backend, int(requests))) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
