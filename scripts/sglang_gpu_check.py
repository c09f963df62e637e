#!/usr/bin/env python3
"""GPU check of the SGLang backend: a real ``sglang.launch_server`` prefill/decode pair with pdproto.

A plain server answers each prompt greedily (the reference); then a prefill and a decode server with
``--disaggregation-transfer-backend pdproto``, this script as their router (one ``bootstrap_room`` per
prompt, as SGLang's router posts it), must generate the same first ``--tokens`` token ids. Needs a GPU,
``sglang==0.5.23``, ``mooncake-transfer-engine`` and this repository installed, and the model on disk
(nothing is downloaded); every server log is kept under ``--log-dir``. How to run it: ``docs/sglang.md``.

    python scripts/sglang_gpu_check.py --model-path /models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In one sentence, a transformer language model is",
    "List three prime numbers:",
]
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on this host right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    """``python -m sglang.launch_server`` for one server on this host's GPU(s)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--host", HOST,
           "--port", str(port), "--mem-fraction-static", str(args.mem_fraction), "--random-seed", "0", *extra]
    return cmd + (["--disable-cuda-graph"] if not args.cuda_graph else [])


def commands(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, list[str]]:
    """The reference server, the prefill and the decode, as they are started."""
    pd = ["--disaggregation-transfer-backend", "pdproto", "--disaggregation-bootstrap-port", str(ports["bootstrap"])]
    decode = ["--disaggregation-mode", "decode", *pd, "--base-gpu-id", str(args.decode_gpu)]
    if args.decode_tp > 1:
        decode += ["--tp-size", str(args.decode_tp), "--dcp-size", str(args.decode_tp)]
    return {
        "reference": server_command(args, ports["reference"]),
        "prefill": server_command(args, ports["prefill"], "--disaggregation-mode", "prefill", *pd),
        "decode": server_command(args, ports["decode"], *decode),
    }


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until the server answers ``/health``; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise RuntimeError(f"server on port {port} not healthy within {timeout:.0f} s")


def generate(port: int, prompt: str, tokens: int, **bootstrap: Any) -> list[int]:
    """Greedy ``tokens`` output token ids for ``prompt`` from the server on ``port``."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}, **bootstrap}
    out = _post(f"http://{HOST}:{port}/generate", body, timeout=600)
    ids = out.get("output_ids") or out.get("meta_info", {}).get("output_ids")
    if ids is None:
        raise RuntimeError(f"no output_ids in the answer of port {port}: {json.dumps(out)[:300]}")
    return [int(i) for i in ids]


class Servers:
    """Started servers, each in its own process group, stopped together."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("wb")
        print(f"starting {name}: {shlex.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def add_common_arguments(ap: argparse.ArgumentParser, *, tokens: int, memory_flag: str) -> None:
    """The options both GPU checks share (the model flag and engine-specific ones are the caller's)."""
    ap.add_argument("--tokens", type=int, default=tokens, help="generated tokens compared per prompt")
    ap.add_argument("--mem-fraction", type=float, default=0.3, help=f"{memory_flag} of each server")
    ap.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs (slower start)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--dry-run", action="store_true", help="print the server commands and exit")


def run_check(args: argparse.Namespace, cmds: dict[str, list[str]], ports: dict[str, int], env: dict[str, str],
              answer: Callable[[int, str], Any], pair: Callable[[str], tuple[Callable[[], Any], Callable[[], Any]]],
              log_prefix: str) -> int:
    """Answer every prompt on the reference, then on the prefill/decode pair (``pair``: the two posts of
    one prompt); PASS when the decode's answers equal the reference's. 0 on PASS."""
    if args.dry_run:
        print(json.dumps(cmds, indent=1))
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=log_prefix))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = Servers(log_dir, env)
    ok = True
    try:
        ref = servers.start("reference", cmds["reference"])
        wait_healthy(ports["reference"], ref, args.start_timeout)
        expected = [answer(ports["reference"], p) for p in PROMPTS]
        servers.stop()
        prefill = servers.start("prefill", cmds["prefill"])
        decode = servers.start("decode", cmds["decode"])
        wait_healthy(ports["prefill"], prefill, args.start_timeout)
        wait_healthy(ports["decode"], decode, args.start_timeout)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for prompt, want in zip(PROMPTS, expected, strict=True):
                p, d = (pool.submit(post) for post in pair(prompt))
                p.result()
                got = d.result()
                ok &= got == want
                print(f"{'same' if got == want else 'DIFFERENT'}  {prompt!r}: pd={got!r} reference={want!r}",
                      flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as the check's verdict
        print(f"FAIL: {type(exc).__name__}: {exc} (logs: {log_dir})")
        return 1
    finally:
        servers.stop()
    print(("PASS" if ok else "FAIL") + f" (logs: {log_dir})")
    return 0 if ok else 1


def main() -> int:
    """Run the check; 0 on PASS."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="a model directory on this machine (nothing is downloaded)")
    ap.add_argument("--decode-gpu", type=int, default=0, help="--base-gpu-id of the decode (0: share the GPU)")
    ap.add_argument("--decode-tp", type=int, default=1, help="decode TP = DCP size (MLA models, that many GPUs)")
    add_common_arguments(ap, tokens=8, memory_flag="--mem-fraction-static")
    args = ap.parse_args()
    ports = {name: free_port() for name in ("reference", "prefill", "decode", "bootstrap")}
    env = dict(os.environ, SGLANG_HOST_IP=HOST, PDPROTO_TOKEN=os.environ.get("PDPROTO_TOKEN", os.urandom(16).hex()))

    def answer(port: int, prompt: str, **bootstrap: Any) -> list[int]:
        return generate(port, prompt, args.tokens, **bootstrap)[:args.tokens]

    def pair(prompt: str) -> tuple[Callable[[], list[int]], Callable[[], list[int]]]:
        boot = {"bootstrap_host": HOST, "bootstrap_port": ports["bootstrap"], "bootstrap_room": random.getrandbits(63)}
        return lambda: answer(ports["prefill"], prompt, **boot), lambda: answer(ports["decode"], prompt, **boot)

    return run_check(args, commands(args, ports), ports, env, answer, pair, "pdproto-gpu-check-")


if __name__ == "__main__":
    raise SystemExit(main())
