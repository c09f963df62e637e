"""The first cross-engine PD transfer: an SGLang 0.5.23 prefill (pdproto's SGLang backend) feeds a vLLM
0.33.0 decode (``PdprotoConnector``), MLA, dense -> TP 1, every row checked.

Two processes, two virtualenvs: the SGLang prefill rank of ``tests/sglang/pd_harness.py``
(SGLang's own ``ServerArgs``, pools, bootstrap server, manager and senders, chunked sends) in
SGLang's interpreter, and a vLLM decode worker (``_worker.py``: vLLM's own code from the
process group to the step) in this one. Where the engines disagree, negotiation decides
(docs/protocol.md): SGLang's aux buffers (first token, logprobs) reach no vLLM decode, which
registers none (rule 16b); the pages are 64 tokens on the prefill, 16 on the decode (the decode
announces ``page-relayout``, rule 12); both publish the canonical dtype "bfloat16" (rule 6); the
room is SGLang's ``bootstrap_room``, which the decode's ``kv_transfer_params`` carry.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.sglang import pd_harness
from tests.sglang._models import LAYERS, PAGE, SEED, fill_random, write_config

from .test_vllm_transfer import free_port, started, step

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = "PDPROTO_SGLANG_PYTHON"
"""The environment variable naming SGLang's interpreter (default: the repository's ``.venv/bin/python``)."""

REQUESTS = (
    pd_harness.Request(room=(1 << 58) + 101, tokens=300, chunk=128),  # chunked, last page partial
    pd_harness.Request(room=(1 << 58) + 102, tokens=5),  # shorter than a block
    pd_harness.Request(room=(1 << 58) + 103, tokens=1000, decode_prefix=256, chunk=256),  # with a decode prefix
)
"""Rooms past 32 bits, passed through as they are (under 2**59: the harness seeds aux bytes with room * 16)."""
BLOCK = 16
"""The vLLM decode's block (SGLang's page is ``PAGE``, 64)."""
BLOCKS = 128


def sglang_python() -> str:
    """SGLang's interpreter: ``$PDPROTO_SGLANG_PYTHON`` or the repository's ``.venv``."""
    path = os.environ.get(SGLANG_PYTHON) or str(REPO / ".venv" / "bin" / "python")
    if not Path(path).exists():
        pytest.fail(f"SGLang's interpreter {path} does not exist: build .venv (scripts/setup.sh) or set "
                    f"{SGLANG_PYTHON}")
    return path


def prefill_rows(spec: pd_harness.Spec) -> list[np.ndarray]:
    """The prefill's KV pool, layer by layer, as int16 words per token slot: ``fill_prefill``'s seeded bytes
    over SGLang's ``MLATokenToKVPool`` buffers (``pool_pages * PAGE`` slots and the padding page)."""
    out = []
    for layer in range(LAYERS["mla"]):
        buf = torch.empty(((spec.pool_pages + 1) * PAGE, 576), dtype=torch.bfloat16)
        fill_random(buf, SEED + layer)
        out.append(buf.view(torch.int16).numpy())
    return out


def test_sglang_prefill_to_vllm_decode(tmp_path: Path) -> None:
    """SGLang MLA prefill (page 64) -> vLLM MLA decode (block 16), three requests (one chunked, one with a
    decode prefix): every decode row is the prefill's, nothing else written, every SGLang sender Success."""
    from . import _rig

    model = _rig.model_dir(tmp_path / "vllm-mla")
    spec = pd_harness.Spec("mla", REQUESTS)
    port, timeout = free_port(), 60
    env = {**os.environ, "MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1", "PDPROTO_PORT": str(port),
           "PDPROTO_ENGINE": "mooncake", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(timeout),
           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(timeout),
           "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000"}
    args = ["--role", "prefill", "--backend", "pdproto", "--prefill-backend", "pdproto", "--timeout", str(timeout),
            "--model-dir", str(write_config("mla", tmp_path / "sglang-mla")), "--spec", spec.to_json(),
            "--bootstrap-port", str(free_port()), "--dist-port", str(free_port())]
    with open(tmp_path / "prefill.log", "wb") as log:
        prefill = subprocess.Popen([sglang_python(), "-m", "tests.sglang.pd_harness", *args], cwd=REPO, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        lines = pd_harness._Lines(prefill)
        with started([("kv_consumer", 1, {"block_size": BLOCK, "blocks": BLOCKS})], model, tmp_path) as [[decode]]:
            assert (lines.next(120.0) or {}).get("ready"), (tmp_path / "prefill.log").read_text()[-3000:]
            free = list(range(1, BLOCKS))
            random.Random(SEED).shuffle(free)
            dst = {}
            for r in REQUESTS:
                n = -(-r.tokens // BLOCK)
                dst[r.room], free = free[:n], free[n:]
            # The decode submits first, as a vLLM decode does once its router sent the request to both.
            step([decode], recvs=[{"request_id": f"d{r.room}", "room": r.room, "addresses": [f"127.0.0.1:{port}"],
                                   "blocks": dst[r.room][r.decode_prefix // BLOCK:], "prefix": r.decode_prefix}
                                  for r in REQUESTS])
            pd_harness._say(prefill, "go")
            want, got = {f"d{r.room}" for r in REQUESTS}, {"received": set(), "failed": set()}
            end = time.monotonic() + timeout
            while not want <= got["received"]:
                assert time.monotonic() < end, (got, (tmp_path / "prefill.log").read_text()[-3000:])
                (reply,) = step([decode])
                for key in got:
                    got[key] |= set(reply[key])
                time.sleep(0.02)
            assert not got["failed"], got
            report = lines.next(float(timeout))
            assert report is not None, (tmp_path / "prefill.log").read_text()[-3000:]
            assert {int(room): r["poll"] for room, r in report["results"].items()} == \
                {r.room: pd_harness.SUCCESS for r in REQUESTS}, report
            rows, src = prefill_rows(spec), pd_harness.prefill_pages(spec)
            checked, written = 0, 0
            for r in REQUESTS:
                t = np.arange(r.tokens)
                slots = np.asarray(src[r.room])[t // PAGE] * PAGE + t % PAGE
                np.save(tmp_path / f"{r.room}.npy", np.stack([layer[slots] for layer in rows]))
                out = decode.call("check", blocks=dst[r.room], tokens=r.tokens, prefix=r.decode_prefix,
                                  expected=str(tmp_path / f"{r.room}.npy"))
                assert out["bad"] == 0 and out["checked"] == (r.tokens - r.decode_prefix) * LAYERS["mla"], (r, out)
                checked, written = checked + out["checked"], out["written"]
            assert written == checked, f"rows written outside the requests: {written} of {checked}"
    finally:
        pd_harness._stop(prefill, quit_first=True)
