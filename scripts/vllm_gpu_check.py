#!/usr/bin/env python3
"""GPU check of the vLLM connector: a real ``vllm serve`` prefill/decode pair with PdprotoConnector.

Runs on a machine with NVIDIA GPUs and, installed with pip, ``vllm==0.33.0`` (with its own GPU
requirements), ``mooncake-transfer-engine`` (the CUDA build) and this repository
(``pip install -e .``); nothing is downloaded: the model must already be on disk (``--model``;
an MLA model vLLM serves, e.g. DeepSeek-V2-Lite: the connector moves MLA caches only).

1. A plain (not disaggregated) server answers each prompt greedily: the reference.
2. A prefill (``kv_producer``) and a decode (``kv_consumer``) start with
   ``--kv-transfer-config`` naming ``PdprotoConnector`` from ``pdproto.integrations.vllm``;
   this script is their router: it posts each prompt to both at once with one
   ``transfer_id`` in ``kv_transfer_params`` (the prefill with ``max_tokens`` 1), and tells
   the decode where the prefill's ranks listen.
3. The decode's greedy completion must equal the reference's.

``--decode-tp 4`` runs the decode with TP 4 = DCP 4 (4 GPUs). Prints one line per prompt and
``PASS`` or ``FAIL``; exits 0 on PASS. Every server log is kept under ``--log-dir``.
``--dry-run`` prints the three server command lines and exits.

    python scripts/vllm_gpu_check.py --model /models/DeepSeek-V2-Lite-Chat
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_gpu_check import HOST, Servers, _post, free_port, wait_healthy  # noqa: E402 - the same harness

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In one sentence, a transformer language model is",
    "List three prime numbers:",
]


def server_command(args: argparse.Namespace, port: int, *extra: str) -> list[str]:
    """``vllm serve`` for one server."""
    cmd = ["vllm", "serve", args.model, "--host", HOST, "--port", str(port), "--gpu-memory-utilization",
           str(args.mem_fraction), "--seed", "0", "--max-model-len", "4096", *extra]
    return cmd + ([] if args.cuda_graph else ["--enforce-eager"])


def transfer_config(role: str, **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON of one side."""
    return json.dumps({"kv_connector": "PdprotoConnector", "kv_connector_module_path": "pdproto.integrations.vllm",
                       "kv_role": role, "kv_connector_extra_config": {"engine": "mooncake", **extra}})


def commands(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, list[str]]:
    """The reference server, the prefill and the decode, as they are started."""
    decode = ["--kv-transfer-config", transfer_config("kv_consumer")]
    if args.decode_tp > 1:
        decode += ["--tensor-parallel-size", str(args.decode_tp), "--decode-context-parallel-size",
                   str(args.decode_tp)]
    return {
        "reference": server_command(args, ports["reference"]),
        "prefill": server_command(args, ports["prefill"], "--kv-transfer-config",
                                  transfer_config("kv_producer", port=ports["pdproto"])),
        "decode": server_command(args, ports["decode"], *decode),
    }


def complete(port: int, args: argparse.Namespace, prompt: str, tokens: int, **params: Any) -> str:
    """Greedy completion of ``prompt`` by the server on ``port``."""
    body: dict[str, Any] = {"model": args.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if params:
        body["kv_transfer_params"] = params
    out = _post(f"http://{HOST}:{port}/v1/completions", body, timeout=600)
    return str(out["choices"][0]["text"])


def main() -> int:
    """Run the check; 0 on PASS."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an MLA model directory on this machine (nothing is downloaded)")
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens compared per prompt")
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="--gpu-memory-utilization of each server")
    ap.add_argument("--decode-tp", type=int, default=1, help="decode TP = DCP size (that many GPUs)")
    ap.add_argument("--cuda-graph", action="store_true", help="keep CUDA graphs (slower start)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--dry-run", action="store_true", help="print the server commands and exit")
    args = ap.parse_args()
    ports = {name: free_port() for name in ("reference", "prefill", "decode", "pdproto")}
    cmds = commands(args, ports)
    if args.dry_run:
        print(json.dumps(cmds, indent=1))
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdproto-vllm-gpu-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PDPROTO_ADVERTISE_HOST=HOST,
               PDPROTO_TOKEN=os.environ.get("PDPROTO_TOKEN", os.urandom(16).hex()))
    servers = Servers(log_dir, env)
    ok = True
    try:
        ref = servers.start("reference", cmds["reference"])
        wait_healthy(ports["reference"], ref, args.start_timeout)
        expected = [complete(ports["reference"], args, p, args.tokens) for p in PROMPTS]
        servers.stop()
        prefill = servers.start("prefill", cmds["prefill"])
        decode = servers.start("decode", cmds["decode"])
        wait_healthy(ports["prefill"], prefill, args.start_timeout)
        wait_healthy(ports["decode"], decode, args.start_timeout)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for prompt, want in zip(PROMPTS, expected, strict=True):
                tid = uuid.uuid4().hex
                p = pool.submit(complete, ports["prefill"], args, prompt, 1, do_remote_decode=True, transfer_id=tid)
                d = pool.submit(complete, ports["decode"], args, prompt, args.tokens, do_remote_prefill=True,
                                remote_host=HOST, remote_port=ports["pdproto"], remote_tp_size=1, transfer_id=tid)
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


if __name__ == "__main__":
    raise SystemExit(main())
