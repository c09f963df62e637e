"""Start a real ``pdproto serve`` in a subprocess on 127.0.0.1 port 0, and stop it for sure.

Usage::

    with running_server("--prompt-tokens", "200", token="s3cret") as srv:
        HandshakeClient(srv.target, token=srv.token) ...
        rc = srv.terminate()          # SIGTERM, wait, exit status

The server prints ``{"event": "listening", "port": N, "metrics_port": M}`` on stdout once
it accepts calls; stderr goes to a file whose tail is shown when startup fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pdproto_demo.synthetic import SyntheticSpec

REPO = Path(__file__).resolve().parents[1]

SPEC = SyntheticSpec(layers=2, row_bytes=256, pages=128, page_size=16, prompt_tokens=200,
                     chunk_tokens=64, chunk_delay=0.05)
"""The synthetic KV source most server tests share; ``SERVE_ARGS`` starts a server with it."""
SERVE_ARGS = ("--layers", str(SPEC.layers), "--row-bytes", str(SPEC.row_bytes), "--pages", str(SPEC.pages),
              "--page-size", str(SPEC.page_size), "--prompt-tokens", str(SPEC.prompt_tokens),
              "--chunk-tokens", str(SPEC.chunk_tokens), "--chunk-delay-ms", "50", "--match-timeout", "10")


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus exposition text as {sample name with its labels: value}."""
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@dataclass
class ServerProcess:
    """A running server subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int | None
    token: str | None
    stderr_path: Path
    lines: list[str] = field(default_factory=list)
    ready: dict[str, object] = field(default_factory=dict)
    """The server's "listening" line (``legacy_port`` among the rest)."""

    @property
    def target(self) -> str:
        """gRPC target string."""
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The server's /metrics samples by name, labels included (started with ``--metrics-port``)."""
        assert self.metrics_port is not None, "the server was started without --metrics-port"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return metric_samples(resp.read().decode())

    def stderr(self) -> str:
        """What the server logged so far."""
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait up to ``timeout`` (then SIGKILL), return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
            raise

    def kill(self) -> None:
        """SIGKILL if still running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _read_ready(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, object] | None:
    """The first JSON line on stdout, or None on timeout/exit."""
    result: dict[str, object] | None = None

    def reader() -> None:
        nonlocal result
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line:
            try:
                result = json.loads(line)
            except ValueError:
                result = None

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    return result


@contextlib.contextmanager
def running_server(*args: str, token: str | None = None, operator_token: str | None = None,
                   timeout: float = 30.0, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Run ``pdproto serve --listen 127.0.0.1:0 <args>``; always stopped on exit.

    The tokens are written to ``token`` and ``operator-token`` beside ``srv.stderr_path``.
    """
    tmp = Path(tempfile.mkdtemp(prefix="pdproto-srv-"))
    cmd = [sys.executable, "-m", "pdproto_server.cli", "serve", "--listen", "127.0.0.1:0", *args]
    for value, name, flag in ((token, "token", "--token-file"),
                              (operator_token, "operator-token", "--operator-token-file")):
        if value is not None:
            token_file = tmp / name
            token_file.write_text(value)
            token_file.chmod(0o600)
            cmd += [flag, str(token_file)]
    stderr_path = tmp / "stderr.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, env=full_env)
    try:
        ready = _read_ready(proc, timeout)
        if ready is None or ready.get("event") != "listening":
            proc.kill()
            proc.wait(timeout=5)
            raise RuntimeError(f"server did not start: rc={proc.returncode}\n"
                               f"{stderr_path.read_text(errors='replace')[-3000:]}")
        metrics = ready.get("metrics_port")
        srv = ServerProcess(proc=proc, port=int(str(ready["port"])),
                            metrics_port=int(str(metrics)) if metrics is not None else None,
                            token=token, stderr_path=stderr_path, ready=ready)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def proof_metadata(target: str, token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata proving ``token`` to the server at ``target``, for raw gRPC stubs (as the client
    makes it: ``Authenticate``, the server's proof checked, then the client's)."""
    import secrets

    import grpc

    from pdproto.rpc import proof
    from pdproto.v1 import handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc

    nonce = secrets.token_bytes(proof.NONCE_BYTES)
    with grpc.insecure_channel(target) as channel:
        answer = hs_grpc.HandshakeServiceStub(channel).Authenticate(
            hs.AuthenticateRequest(client_nonce=nonce, address=target), timeout=10)
    assert answer.server_proof == proof.server_proof(token, nonce, answer.server_nonce, target)
    return (("authorization", proof.header(token, answer.server_nonce, nonce)),)


def self_signed(where: Path) -> tuple[Path, Path]:
    """A throwaway key and certificate for localhost and 127.0.0.1 (the openssl CLI), as (key, cert)."""
    key, cert = where / "key.pem", where / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    return key, cert


__all__ = ["REPO", "SERVE_ARGS", "SPEC", "ServerProcess", "proof_metadata", "running_server", "self_signed"]
