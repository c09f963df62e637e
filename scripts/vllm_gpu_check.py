#!/usr/bin/env python3
"""GPU check of the vLLM connector: a real ``vllm serve`` prefill/decode pair with PdprotoConnector.

A plain server answers each prompt greedily (the reference); then a prefill (``kv_producer``) and a
decode (``kv_consumer``) with ``--kv-transfer-config`` naming ``PdprotoConnector``, this script as their
router (both posted at once, ``kv_transfer_params`` as ``docs/vllm.md`` lists them), must complete it the
same. Needs NVIDIA GPUs, ``vllm==0.33.0``, ``mooncake-transfer-engine`` and this repository installed, and
an MLA model on disk (the connector moves MLA caches only; nothing is downloaded). ``--decode-tp 4`` runs
the decode with TP 4 = DCP 4 (4 GPUs); every server log is kept under ``--log-dir``.

    python scripts/vllm_gpu_check.py --model /models/DeepSeek-V2-Lite-Chat
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_gpu_check import HOST, _post, add_common_arguments, free_port, run_check  # noqa: E402 - the same harness


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
    ap.add_argument("--decode-tp", type=int, default=1, help="decode TP = DCP size (that many GPUs)")
    add_common_arguments(ap, tokens=16, memory_flag="--gpu-memory-utilization")
    args = ap.parse_args()
    ports = {name: free_port() for name in ("reference", "prefill", "decode", "pdproto")}
    env = dict(os.environ, PDPROTO_ADVERTISE_HOST=HOST,
               PDPROTO_TOKEN=os.environ.get("PDPROTO_TOKEN", os.urandom(16).hex()))

    def pair(prompt: str) -> tuple[Callable[[], str], Callable[[], str]]:
        tid = uuid.uuid4().hex
        return (lambda: complete(ports["prefill"], args, prompt, 1, do_remote_decode=True, transfer_id=tid),
                lambda: complete(ports["decode"], args, prompt, args.tokens, do_remote_prefill=True,
                                 remote_host=HOST, remote_port=ports["pdproto"], remote_tp_size=1, transfer_id=tid))

    return run_check(args, commands(args, ports), ports, env,
                     lambda port, prompt: complete(port, args, prompt, args.tokens), pair, "pdproto-vllm-gpu-check-")


if __name__ == "__main__":
    raise SystemExit(main())
