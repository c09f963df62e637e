"""The first cross-engine PD transfer: an SGLang 0.5.23 prefill (pdproto's SGLang backend) feeds vLLM 0.33.0
decodes (``PdprotoConnector``), MLA, dense -> TP 1 and dense -> DCP 4, every row checked.

Two processes, two virtualenvs: the SGLang prefill rank of ``tests/sglang/pd_harness.py``
(SGLang's own ``ServerArgs``, pools, bootstrap server, manager and senders, chunked sends) in
SGLang's interpreter, and vLLM decode workers (``_worker.py``: vLLM's own code from the
process group to the step) in this one: one of TP 1, four of TP 4 / DCP 4. Where the engines disagree, negotiation decides
(docs/protocol.md): SGLang's aux buffers (first token, logprobs) reach no vLLM decode, which
registers none (rule 16b); the pages are 64 tokens on the prefill, 16 on the decode (the decode
announces ``page-relayout``, rule 12); both publish the canonical dtype "bfloat16" (rule 6); the
room is SGLang's ``bootstrap_room``, which the decode's ``kv_transfer_params`` carry.

And back: a vLLM prefill worker (``sglang_bootstrap_port``) feeds an SGLang decode rank of the same
harness, which finds it through the bootstrap server the prefill's scheduler-side connector runs and
gates each request on the metadata row the prefill writes (the first token, the room).
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from dataclasses import asdict
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
    pd_harness.Request(room=(1 << 58) + 104, tokens=700, chunk=256, decode=1),  # to the DCP 4 decode, chunked
    pd_harness.Request(room=(1 << 58) + 105, tokens=131, decode_prefix=64, decode=1),  # to DCP 4, with a prefix
)
"""Rooms past 32 bits, passed through as they are (under 2**59: the harness seeds aux bytes with room * 16);
``decode`` 0 is the TP 1 decode, 1 the TP 4 / DCP 4 one."""
BLOCK = 16
"""The vLLM decodes' block (SGLang's page is ``PAGE``, 64); a DCP 4 decode's scheduler block is 64 tokens."""
BLOCKS = 128


def sglang_python() -> str:
    """SGLang's interpreter: ``$PDPROTO_SGLANG_PYTHON`` or the repository's ``.venv``."""
    path = os.environ.get(SGLANG_PYTHON) or str(REPO / ".venv" / "bin" / "python")
    if not Path(path).exists():
        pytest.fail(f"SGLang's interpreter {path} does not exist: build .venv (scripts/setup.sh) or set "
                    f"{SGLANG_PYTHON}")
    return path


def sglang_env(timeout: int, **more: str) -> dict[str, str]:
    """The environment of an SGLang rank on loopback: Mooncake over TCP, the harness's timeouts."""
    return {**os.environ, "MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1", "PDPROTO_ENGINE": "mooncake",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(timeout),
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(timeout),
            "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000", **more}


def prefill_rows(spec: pd_harness.Spec) -> list[np.ndarray]:
    """The prefill's KV pool, layer by layer, as int16 words per token slot: ``fill_prefill``'s seeded bytes
    over SGLang's ``MLATokenToKVPool`` buffers (``pool_pages * PAGE`` slots and the padding page)."""
    out = []
    for layer in range(LAYERS["mla"]):
        buf = torch.empty(((spec.pool_pages + 1) * PAGE, 576), dtype=torch.bfloat16)
        fill_random(buf, SEED + layer)
        out.append(buf.view(torch.int16).numpy())
    return out


def test_sglang_prefill_to_vllm_decodes(tmp_path: Path) -> None:
    """One SGLang MLA prefill rank (page 64) feeds a vLLM TP 1 decode (block 16: three requests, one chunked,
    one with a decode prefix) and a vLLM TP 4 / DCP 4 decode (token t on rank t % 4 at local row t // 4: two
    requests): every decode row is the prefill's, nothing else written, every SGLang sender Success."""
    from . import _rig

    model = _rig.model_dir(tmp_path / "vllm-mla")
    spec = pd_harness.Spec("mla", REQUESTS)
    port, timeout = free_port(), 60
    env = sglang_env(timeout, PDPROTO_PORT=str(port))
    args = ["--role", "prefill", "--backend", "pdproto", "--prefill-backend", "pdproto", "--timeout", str(timeout),
            "--model-dir", str(write_config("mla", tmp_path / "sglang-mla")), "--spec", spec.to_json(),
            "--bootstrap-port", str(free_port()), "--dist-port", str(free_port())]
    log = tmp_path / "prefill.log"
    with open(log, "wb") as err:
        prefill = subprocess.Popen([sglang_python(), "-m", "tests.sglang.pd_harness", *args], cwd=REPO, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines = pd_harness._Lines(prefill)
        with started([("kv_consumer", 1, {"block_size": BLOCK, "blocks": BLOCKS}),
                      ("kv_consumer", 4, {"dcp": 4, "block_size": BLOCK, "blocks": BLOCKS})],
                     model, tmp_path) as groups:
            assert (lines.next(120.0) or {}).get("ready"), log.read_text()[-3000:]
            dst: dict[int, list[int]] = {}
            for k, group in enumerate(groups):
                free = list(range(1, BLOCKS))
                random.Random(SEED + k).shuffle(free)
                block = BLOCK * len(group)  # the decode's scheduler block: BLOCK rows on each DCP rank
                mine = [r for r in REQUESTS if r.decode == k]
                for r in mine:
                    n = -(-r.tokens // block)
                    dst[r.room], free = free[:n], free[n:]
                # Each decode submits first, as a vLLM decode does once its router sent the request to both.
                step(group, recvs=[{"request_id": f"d{r.room}", "room": r.room, "addresses": [f"127.0.0.1:{port}"],
                                    "blocks": dst[r.room][r.decode_prefix // block:], "prefix": r.decode_prefix}
                                   for r in mine])
            pd_harness._say(prefill, "go")
            decodes = [c for group in groups for c in group]
            want = {c.name: {f"d{r.room}" for r in REQUESTS if r.decode == k} for k, g in enumerate(groups) for c in g}
            got = {c.name: {"received": set(), "failed": set()} for c in decodes}
            end = time.monotonic() + timeout
            while not all(want[n] <= got[n]["received"] for n in want):
                assert time.monotonic() < end, (got, log.read_text()[-3000:])
                for c, reply in zip(decodes, step(decodes), strict=True):
                    for key in ("received", "failed"):
                        got[c.name][key] |= set(reply[key])
                time.sleep(0.02)
            assert not any(g["failed"] for g in got.values()), got
            report = lines.next(float(timeout))
            assert report is not None, log.read_text()[-3000:]
            assert {int(room): r["poll"] for room, r in report["results"].items()} == \
                {r.room: pd_harness.SUCCESS for r in REQUESTS}, report
            rows, src = prefill_rows(spec), pd_harness.prefill_pages(spec)
            for r in REQUESTS:
                t = np.arange(r.tokens)
                slots = np.asarray(src[r.room])[t // PAGE] * PAGE + t % PAGE
                np.save(tmp_path / f"{r.room}.npy", np.stack([layer[slots] for layer in rows]))
            for k, group in enumerate(groups):
                for c in group:
                    checked, written = 0, 0
                    for r in (r for r in REQUESTS if r.decode == k):
                        out = c.call("check", blocks=dst[r.room], tokens=r.tokens, prefix=r.decode_prefix,
                                     expected=str(tmp_path / f"{r.room}.npy"))
                        rank = int(c.name.rsplit("-", 1)[1])
                        owned = sum(1 for i in range(r.decode_prefix, r.tokens) if i % len(group) == rank)
                        assert out["bad"] == 0 and out["checked"] == owned * LAYERS["mla"], (c.name, r, out)
                        checked, written = checked + out["checked"], out["written"]
                    assert written == checked, f"{c.name}: rows written outside the requests: {written} of {checked}"
    finally:
        pd_harness._stop(prefill, quit_first=True)


REVERSE = (
    pd_harness.Request(room=(1 << 58) + 201, tokens=300),  # the decode's last page partial (300 = 4 * 64 + 44)
    pd_harness.Request(room=(1 << 58) + 202, tokens=5),  # shorter than a block on either side
    pd_harness.Request(room=(1 << 58) + 203, tokens=700, decode_prefix=256),  # the decode holds a prefix
)
"""Requests of the reverse direction: a vLLM prefill (block 16) to an SGLang decode (page 64)."""


@pytest.mark.parametrize("dcp", [1, 4])
def test_vllm_prefill_to_an_sglang_decode(tmp_path: Path, dcp: int) -> None:
    """A vLLM MLA prefill worker (block 16, ``sglang_bootstrap_port``) feeds an SGLang decode of TP 1 or of TP 4 /
    DCP 4 (page 64, SGLang's own receivers, poll and metadata gate): each decode rank finds the prefill through
    the bootstrap server the prefill's scheduler-side connector runs, every decode row is the prefill's (token t
    on rank t % dcp at local row t // dcp) and nothing else is written, each rank's metadata row holds the first
    token vLLM sampled and the room, and every request ends Success there."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    from pdproto.integrations.vllm.connector import PdprotoConnector
    from pdproto.integrations.vllm.sglang_peer import BOOTSTRAP_ROOM, OUTPUT_IDS

    from . import _rig

    model = _rig.model_dir(tmp_path / "vllm-mla")
    port, bootstrap_port, timeout = free_port(), free_port(), 60
    extra = {"sglang_bootstrap_port": bootstrap_port}
    scheduler = PdprotoConnector(_rig.vllm_config(model, "kv_producer", port=port, extra=extra),
                                 KVConnectorRole.SCHEDULER, _rig.mla_cache_config(BLOCK, BLOCKS))
    dump = tmp_path / "decode"
    dump.mkdir()
    spec = pd_harness.Spec("mla", REVERSE, dump=str(dump))
    # CPU ranks beyond the NUMA node count are told where their threads go (pd_harness.run says why).
    env = sglang_env(timeout, SGLANG_CPU_OMP_THREADS_BIND="|".join([f"0-{(os.cpu_count() or 1) - 1}"] * dcp))
    args = ["--role", "decode", "--backend", "pdproto", "--prefill-backend", "pdproto", "--timeout", str(timeout),
            "--model-dir", str(write_config("mla", tmp_path / "sglang-mla")), "--spec", spec.to_json(),
            "--bootstrap-port", str(bootstrap_port), "--dist-port", str(free_port()), "--dcp", str(dcp)]
    logs = [tmp_path / f"decode{r}.log" for r in range(dcp)]
    decodes: list[subprocess.Popen[str]] = []

    def tails() -> str:
        return "\n".join(log.read_text()[-2000:] for log in logs)

    try:
        with started([("kv_producer", 1, {"block_size": BLOCK, "blocks": BLOCKS, "port": port, "extra": extra})],
                     model, tmp_path) as [[prefill]]:
            # Each decode rank registers with the prefill rank its bootstrap record names, as soon as it is up.
            for rank, log in enumerate(logs):
                with open(log, "wb") as err:
                    decodes.append(subprocess.Popen(
                        [sglang_python(), "-m", "tests.sglang.pd_harness", *args, "--rank", str(rank)], cwd=REPO,
                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True))
            lines = [pd_harness._Lines(d) for d in decodes]
            free = list(range(1, BLOCKS))
            random.Random(SEED).shuffle(free)
            for k, r in enumerate(REVERSE):
                n = -(-r.tokens // BLOCK)
                src, free = free[:n], free[n:]
                prefill.call("fill", blocks=src, tokens=r.tokens, seed=k)
                # What vLLM's scheduler holds when the prefill request ends: its one sampled token.
                req = _rig.request(f"p{r.room}", r.tokens, {"do_remote_decode": True, "bootstrap_room": r.room}, BLOCK)
                req.append_output_token_ids(100 + k)
                req.num_computed_tokens, req.status = r.tokens, RequestStatus.FINISHED_LENGTH_CAPPED
                delay, params = scheduler.request_finished(req, src)
                assert delay and params is not None and params["bootstrap_room"] == r.room
            sends = [asdict(s) for s in scheduler.build_connector_meta(None).sends]
            assert [s["first_token"] for s in sends] == [100, 101, 102]
            # Held from when the decode is up (SGLang's start-up is not counted against the prefill's lease).
            assert [(line.next(240.0) or {}).get("up") for line in lines] == list(range(dcp)), tails()
            sent = set(step([prefill], sends=sends)[0]["sent"])  # a request may end in the step that holds it
            end = time.monotonic() + timeout
            while len(sent) < len(REVERSE):
                assert time.monotonic() < end and all(d.poll() is None for d in decodes), (sent, tails())
                sent |= set(step([prefill])[0]["sent"])
                time.sleep(0.05)
            reports = [line.next(float(timeout)) for line in lines]
            for report in reports:
                assert report is not None and "polls" in report, (report, tails())
                assert report["polls"] == [pd_harness.SUCCESS] * len(REVERSE), report
                assert report["protocols"] == {f"127.0.0.1:{port}": "pdproto"}, report
    finally:
        scheduler.shutdown()
        pd_harness._stop(*decodes, quit_first=True)
    dst = pd_harness.decode_pages(spec, dcp)
    for rank, report in enumerate(reports):
        kv = np.load(dump / f"{rank}-kv.npy").reshape(LAYERS["mla"], -1, _rig.ROW)
        want = np.zeros_like(kv)
        for k, r in enumerate(REVERSE):
            t = np.arange(r.decode_prefix, r.tokens)
            t = t[t % dcp == rank]
            slots = np.asarray(dst[r.room])[t // (PAGE * dcp)] * PAGE + (t // dcp) % PAGE
            for layer in range(LAYERS["mla"]):
                want[layer, slots] = _rig.rows(layer, t, k)
        bad = [(layer, int(row)) for layer in range(LAYERS["mla"])
               for row in np.flatnonzero((kv[layer] != want[layer]).any(1))]
        assert not bad, f"rank {rank}: {len(bad)} rows differ from what they must hold, first {bad[:5]}"
        aux = [np.load(dump / f"{rank}-aux{i}.npy") for i in range(len(list(dump.glob(f"{rank}-aux*.npy"))))]
        expected = [np.zeros_like(a) for a in aux]
        for k, r in enumerate(REVERSE):
            index = report["aux_index"][str(r.room)]
            expected[OUTPUT_IDS][index].view(np.int32)[0] = 100 + k
            expected[BOOTSTRAP_ROOM][index].view(np.uint64)[0] = r.room
        assert [i for i, (a, e) in enumerate(zip(aux, expected, strict=True)) if not np.array_equal(a, e)] == [], rank
