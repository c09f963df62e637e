"""vLLM worker processes with PdprotoConnector move real MLA bytes: prefill and decode in separate
processes, real engines (Mooncake over TCP, NIXL over UCX), every row of every layer checked.

Each worker runs vLLM's own code from the process group to the step (``_worker.py``); the
connector metadata of each step is what the scheduler-side connector builds
(``test_vllm_scheduler.py`` drives that half with a real ``Scheduler``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from pdproto.integrations.vllm.layout import room_of
from pdproto_demo.cluster import free_port
from pdproto_demo.proc import Child, close_all
from tests.sglang._zygote import command

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]

READY_S = 240.0
"""vLLM's import and process-group set-up take 10-20 s per process here, more under load."""




@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from . import _rig

    return _rig.model_dir(tmp_path_factory.mktemp("model"))


def spawn(name: str, args: list[str], logs: Path) -> Child:
    """One worker process, forked from the zygote that imported vLLM once (``_rig.PRELOAD``)."""
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(command("-m", "tests.vllm._worker", *args, preload="tests.vllm._rig"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    return Child(name, proc)


@contextmanager
def started(groups: list[tuple[str, int, dict[str, Any]]], model: str, logs: Path) -> Iterator[list[list[Child]]]:
    """Start every group of worker processes (role, size, options) at once; yield them by group once ready."""
    out: list[list[Child]] = []
    try:
        for g, (role, n, opts) in enumerate(groups):
            dist = free_port()
            args = ["--model", model, "--role", role, "--tp", str(n), "--dist-port", str(dist)]
            for k, v in opts.items():
                args += [f"--{k.replace('_', '-')}", json.dumps(v) if isinstance(v, dict) else str(v)]
            out.append([spawn(f"{role}{g}-{r}", [*args, "--rank", str(r)], logs) for r in range(n)])
        for child in (c for group in out for c in group):
            assert child.recv(READY_S).get("ready"), child.name
        yield out
    finally:
        close_all([c for group in out for c in group])


def step(children: list[Child], **meta: Any) -> list[dict[str, Any]]:
    """One step on every worker (the same metadata, as vLLM broadcasts it)."""
    for c in children:
        c.send("step", **meta)
    replies = [c.recv(60.0) for c in children]
    for c, r in zip(children, replies, strict=True):
        assert "error" not in r, (c.name, r)
    return replies


def until(children: list[Child], want: dict[str, tuple[str, str]], timeout: float = 60.0, *,
          earlier: Iterable[tuple[Child, dict[str, Any]]] = ()) -> dict[str, list[str]]:
    """Step every worker (as vLLM steps both engines all along) until each named in ``want`` reported its
    request id under its key (a rank reports an id once); returns every id each reported, by key.

    ``earlier``: the replies of the steps that handed the workers their requests. A rank may report in
    that very step (a dummy prefill rank whose decode submitted already ends as soon as it is held).
    """
    seen: dict[str, dict[str, list[str]]] = {c.name: {"sent": [], "received": [], "failed": []} for c in children}
    for c, r in earlier:
        for key in ("sent", "received", "failed"):
            seen[c.name][key] += r[key]
    end = time.monotonic() + timeout
    while True:
        missing = sorted(n for n, (key, rid) in want.items() if rid not in seen[n][key])
        if not missing:
            return {n: [f"{k}:{i}" for k, ids in got.items() for i in ids] for n, got in seen.items()}
        assert time.monotonic() < end, f"no {want[missing[0]]} from {missing}: {seen}"
        for c, r in zip(children, step(children), strict=True):
            for key in ("sent", "received", "failed"):
                seen[c.name][key] += r[key]
        time.sleep(0.02)


def transfer(prefill: Child | list[Child], decodes: list[Child], *, tokens: int, src: list[int], dst: list[int],
             port: int, prefix: int = 0, dst_block: int, seed: int, state: tuple[int, int] | None = None) -> None:
    """One request: the decode ranks submit (to every prefill rank), the prefill's request finishes, the bytes
    land; every row checked on every decode rank, and nothing written outside the request. ``state``: a hybrid's
    Mamba state block on the prefill and on the decode, every byte of every Mamba layer's page checked too."""
    prefills = prefill if isinstance(prefill, list) else [prefill]
    room = room_of(f"req-{seed}")
    src_state, dst_state = state or (0, 0)
    blocks = {"state": [dst_state]} if state else {}
    for p in prefills:  # each prefill TP rank fills what it holds: MLA the whole row, MHA its heads
        p.call("fill", blocks=src, tokens=tokens, seed=seed, state_block=src_state)
    submitted = step(decodes, recvs=[{"request_id": f"d{seed}", "room": room,
                                      "addresses": [f"127.0.0.1:{port + r}" for r in range(len(prefills))],
                                      "blocks": dst[prefix // dst_block:], "prefix": prefix, **blocks}])
    held = step(prefills, sends=[{"request_id": f"p{seed}", "room": room, "blocks": src, "num_tokens": tokens,
                                  "lease_s": 30.0, **({"state": [src_state]} if state else {})}],
                finished=[f"p{seed}"])
    want = {**{d.name: ("received", f"d{seed}") for d in decodes}, **{p.name: ("sent", f"p{seed}") for p in prefills}}
    seen = until([*prefills, *decodes], want, earlier=[*zip(decodes, submitted), *zip(prefills, held)])
    assert not any(i.startswith("failed:") for ids in seen.values() for i in ids), seen
    for d in decodes:
        got = d.call("check", blocks=dst, tokens=tokens, seed=seed, prefix=prefix, state_block=dst_state)
        assert got["checked"] > 0 and got["bad"] == 0 and got["state_bad"] == 0, (d.name, got)
        assert got["state_words"] > 0 or not state, (d.name, got)  # the state pages were compared
        state_rows = got["state_rows"] if state else 0
        assert got["written"] == got["checked"] + state_rows, f"{d.name} has rows written outside the request: {got}"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_mla_tp1_to_tp1(engine: str, model: str, tmp_path: Path) -> None:
    """MLA, one prefill worker to one decode worker, the same block size: 200 tokens, 4 layers."""
    port = free_port()
    with started([("kv_producer", 1, {"port": port, "engine": engine}), ("kv_consumer", 1, {"engine": engine})],
                 model, tmp_path) as (prefill, decode):
        transfer(prefill[0], decode, tokens=200, src=[5, 9, 2, 7, 11, 3, 4, 6, 8, 10, 12, 13, 14],
                 dst=[40, 3, 17, 8, 21, 30, 31, 32, 33, 34, 35, 36, 37], port=port, dst_block=16, seed=1)
        # vLLM aborts a decode request whose bytes are on the way (its prefill never finishes here): the
        # room is aborted on the prefill, and the receive ends failed long before its 300 s deadline (the bound
        # is 90 s: a clean-clone make test under load from other work once took over 20 s).
        step(decode, recvs=[{"request_id": "d-x", "room": room_of("req-x"), "addresses": [f"127.0.0.1:{port}"],
                             "blocks": [50, 51], "prefix": 0}])
        step([*prefill, *decode])
        cancelled = step(decode, cancels=["d-x"])
        seen = until([*prefill, *decode], {decode[0].name: ("failed", "d-x")}, timeout=90.0,
                     earlier=zip(decode, cancelled))
        assert "received:d-x" in seen[decode[0].name]


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_mamba_hybrid_request(engine: str, model: str, tmp_path: Path) -> None:
    """A Mamba2/MLA hybrid in vLLM's own KV cache config (an MLA group and a Mamba2 group overlaying it, mode
    none): the MLA rows of the 99 tokens its prefill computed (of a 100-token prompt: vLLM's N-1) and the state
    page of each Mamba layer (conv, then temporal, padded to the MLA page) land byte for byte in the decode's
    blocks and its state block, and nothing else is written."""
    port = free_port()
    hybrid = {"engine": engine, "hybrid": "float32"}
    with started([("kv_producer", 1, {"port": port, **hybrid}), ("kv_consumer", 1, hybrid)],
                 model, tmp_path) as ([prefill], decode):
        transfer(prefill, decode, tokens=99, src=[5, 9, 2, 7, 11, 3, 4], dst=[40, 3, 17, 8, 21, 30, 31], port=port,
                 dst_block=16, seed=6, state=(12, 22))


def test_a_mamba_state_laid_out_differently_is_refused_at_registration(model: str, tmp_path: Path) -> None:
    """Decodes whose Mamba conv state is DS where the prefill's is SD, or whose temporal state is bf16 where the
    prefill's is fp32 (the same padded page size), are refused at Register, naming the state entry and both
    descriptions; a decode laid out as the prefill registers."""
    port = free_port()
    with started([("kv_producer", 1, {"port": port, "hybrid": "float32"}),
                  ("kv_consumer", 1, {"hybrid": "float32", "conv_layout": "DS"}),
                  ("kv_consumer", 1, {"hybrid": "bfloat16"}), ("kv_consumer", 1, {"hybrid": "float32"})],
                 model, tmp_path) as (_, [ds], [bf16], [same]):
        address = f"127.0.0.1:{port}"
        for decode, differs in ((ds, "conv DS"), (bf16, "bfloat16(8, 32, 16)")):
            got = decode.call("connect", address=address)
            assert got["reason"] == "TOPOLOGY_STATE_KIND_MISMATCH", got
            assert differs in got["message"] and "conv SD: bfloat16(3, 288), float32(8, 32, 16)" in got["message"]
        assert same.call("connect", address=address)["reason"] == ""


def test_block_size_mismatch_with_decode_prefix(model: str, tmp_path: Path) -> None:
    """Prefill blocks of 16 tokens to decode blocks of 64, the decode holding the first 64 tokens already."""
    port = free_port()
    with started([("kv_producer", 1, {"port": port, "engine": "nixl"}),
                  ("kv_consumer", 1, {"engine": "nixl", "block_size": 64})], model, tmp_path) as (prefill, decode):
        transfer(prefill[0], decode, tokens=230, src=list(range(20, 35)), dst=[9, 4, 12, 6], port=port,
                 prefix=64, dst_block=64, seed=2)


def test_mla_tp2_prefill_to_tp1_decode(model: str, tmp_path: Path) -> None:
    """An MLA prefill of TP 2 (each rank holds the whole latent cache): the decode registers with both and, as
    it asks for SPLIT_KV, each writes its share of the layers; both hand their blocks back."""
    port = free_port(span=2)
    with started([("kv_producer", 2, {"port": port}), ("kv_consumer", 1, {})], model, tmp_path) as (prefills, decode):
        transfer(prefills, decode, tokens=120, src=[9, 10, 11, 12, 13, 14, 15, 16], dst=[2, 4, 6, 8, 10, 12, 14, 16],
                 port=port, dst_block=16, seed=5)


def test_mha_tp1_to_tp2_slices_heads(tmp_path: Path) -> None:
    """MHA (4 KV heads of 64, each head's K then V): one prefill worker to a TP 2 decode, each rank
    getting its two heads of every token's row."""
    from . import _rig

    model = _rig.model_dir(tmp_path / "mha", _rig.MHA_MODEL)
    port = free_port()
    with started([("kv_producer", 1, {"port": port, "mha_heads": 4}), ("kv_consumer", 2, {"mha_heads": 2})],
                 model, tmp_path) as ([prefill], decodes):
        transfer(prefill, decodes, tokens=90, src=[3, 8, 1, 9, 12, 14], dst=[5, 2, 11, 7, 6, 4], port=port,
                 dst_block=16, seed=4)


def test_mha_tp2_to_tp4_slices_heads(tmp_path: Path) -> None:
    """MHA from a TP 2 prefill (two of the 4 KV heads each) to a TP 4 decode (one each): every decode rank
    registers with both prefill ranks, and the one that holds its head writes it."""
    from . import _rig

    model = _rig.model_dir(tmp_path / "mha", _rig.MHA_MODEL)
    port = free_port(span=2)
    with started([("kv_producer", 2, {"port": port, "mha_heads": 2}), ("kv_consumer", 4, {"mha_heads": 1})],
                 model, tmp_path) as (prefills, decodes):
        transfer(prefills, decodes, tokens=70, src=[6, 1, 9, 4, 13], dst=[8, 3, 12, 2, 10], port=port,
                 dst_block=16, seed=6)


def test_mha_tp2_to_tp1_heads_go_packed_and_land_in_row_order(tmp_path: Path) -> None:
    """MHA fan-in: each of two prefill ranks (two of the 4 KV heads each) writes its heads of every decode block
    but the last as one block, and the decode puts the blocks back in row order before it reports the request
    received: every row whole, nothing written outside the request."""
    from . import _rig

    model = _rig.model_dir(tmp_path / "mha", _rig.MHA_MODEL)
    port = free_port(span=2)
    with started([("kv_producer", 2, {"port": port, "mha_heads": 2}), ("kv_consumer", 1, {"mha_heads": 4})],
                 model, tmp_path) as (prefills, decodes):
        assert [decodes[0].call("connect", address=f"127.0.0.1:{port + r}")["packed"] for r in range(2)] == [True] * 2
        transfer(prefills, decodes, tokens=90, src=[4, 11, 2, 8, 13, 6], dst=[9, 3, 14, 1, 7, 12], port=port,
                 dst_block=16, seed=8)


def test_dense_to_dcp4(model: str, tmp_path: Path) -> None:
    """A dense prefill to a decode of TP 4 / DCP 4: token t lands on rank t % 4 at local row t // 4."""
    port = free_port()
    with started([("kv_producer", 1, {"port": port}), ("kv_consumer", 4, {"dcp": 4})],
                 model, tmp_path) as (prefill, decodes):
        # The decode's scheduler block is 16 x 4 = 64 tokens: 300 tokens take 5 of them.
        transfer(prefill[0], decodes, tokens=300, src=list(range(30, 49)), dst=[7, 2, 9, 5, 11], port=port,
                 dst_block=64, seed=3)


def test_a_dead_peer_ends_the_transfer_on_the_other_side(model: str, tmp_path: Path) -> None:
    """A decode killed mid-transfer: the prefill hands its blocks back to vLLM (finished_sending). A prefill
    killed mid-transfer: the decode reports the request received and failed (failed_recving), for vLLM's
    kv_load_failure_policy (test_vllm_scheduler.py: fail and recompute)."""
    port = free_port()
    waits = {"extra": {"recv_timeout_s": 10}}
    with started([("kv_producer", 1, {"port": port}), ("kv_consumer", 1, {}), ("kv_consumer", 1, waits)],
                 model, tmp_path) as ([prefill], [doomed], [decode]):
        address = [f"127.0.0.1:{port}"]
        for d, rid in ((doomed, "a"), (decode, "b")):
            prefill.call("fill", blocks=[4, 5], tokens=20, seed=len(rid))
            step([d], recvs=[{"request_id": f"d-{rid}", "room": room_of(f"req-{rid}"), "addresses": address,
                              "blocks": [6, 7], "prefix": 0}])
        step([prefill, doomed, decode])  # one step each: both submits are on their way
        doomed.kill_and_reap()
        held = step([prefill], sends=[{"request_id": "p-a", "room": room_of("req-a"), "blocks": [4, 5],
                                       "num_tokens": 20, "lease_s": 30.0}])
        seen = until([prefill, decode], {prefill.name: ("sent", "p-a")}, timeout=120.0, earlier=zip([prefill], held))
        assert not any(i.endswith("d-b") for i in seen[decode.name]), seen  # b waits on: its prefill lives
        prefill.kill_and_reap()
        seen = until([decode], {decode.name: ("failed", "d-b")}, timeout=60.0)  # its 10 s deadline, then a probe
        assert "received:d-b" in seen[decode.name]
        assert decode.call("check", blocks=[6, 7], tokens=20, seed=1)["written"] == 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["mla", "mamba-hybrid"])
def test_two_real_schedulers_drive_the_workers(hybrid: bool, model: str, tmp_path: Path) -> None:
    """Both engines' own ``Scheduler`` pick the blocks and build each step's metadata; the workers' results go
    back into them: the decode request runs once its bytes landed, the prefill's blocks are freed. A Mamba
    hybrid's prefill computes the prompt but its last token, and its decode that last token from the state the
    prefill held after the others (vLLM's N-1)."""
    from . import _rig

    port = free_port()
    tokens = 100
    opts = {"hybrid": "float32"} if hybrid else {}
    with started([("kv_producer", 1, {"port": port, **opts}), ("kv_consumer", 1, opts)],
                 model, tmp_path) as ([prefill], [decode]):
        engines = {"p": (_rig.scheduler(_rig.vllm_config(model, "kv_producer", port=port), 16, 64, hybrid=hybrid),
                         prefill),
                   "d": (_rig.scheduler(_rig.vllm_config(model, "kv_consumer"), 16, 64, hybrid=hybrid), decode)}
        params = {"p": {"do_remote_decode": True, "transfer_id": "chat-7"},
                  "d": {"do_remote_prefill": True, "transfer_id": "chat-7", "remote_host": "127.0.0.1",
                        "remote_port": port}}
        reqs = {k: _rig.request(k, tokens, params[k], 16) for k in engines}
        for k, (sched, _) in engines.items():
            sched.add_request(reqs[k])
        free = engines["p"][0].kv_cache_manager.block_pool.get_num_free_blocks()

        def engine_step(k: str, *, forward: bool = False) -> Any:
            """One step of engine ``k``: schedule, the worker's connector calls, the results back in."""
            sched, worker = engines[k]
            out = sched.schedule()
            if k == "d" and out.num_scheduled_tokens:
                return out  # the decode runs: its blocks are read before a forward would finish it
            meta = out.kv_connector_metadata
            if forward:  # the prefill's forward wrote the request's KV (and state) before the step ends
                ids = sched.kv_cache_manager.get_block_ids(k)
                worker.call("fill", blocks=ids[0], tokens=out.num_scheduled_tokens[k], seed=7,
                            state_block=ids[1][0] if hybrid else 0)
            (got,) = step([worker], sends=[asdict(s) for s in meta.sends], recvs=[asdict(r) for r in meta.recvs],
                          finished=sorted(out.finished_req_ids))
            sched.update_from_output(out, _rig.runner_output([reqs[k]] if forward else [],
                                                             finished_sending=set(got["sent"]),
                                                             finished_recving=set(got["received"]),
                                                             failed_recving=set(got["failed"])))
            return out

        engine_step("d")
        assert reqs["d"].status.name == "WAITING_FOR_REMOTE_KVS"
        engine_step("p", forward=True)
        assert reqs["p"].status.name == "FINISHED_LENGTH_CAPPED"
        end = time.monotonic() + 60
        runs = None
        while runs is None or engines["p"][0].connector.has_pending_push_work():
            assert time.monotonic() < end, (reqs["d"].status, engines["p"][0].connector.has_pending_push_work())
            engine_step("p")
            if runs is None:
                out = engine_step("d")
                runs = out if out.num_scheduled_tokens else None
            time.sleep(0.02)
        assert reqs["d"].status.name == "RUNNING"
        assert runs.num_scheduled_tokens == {"d": 1}  # vLLM recomputes the last prompt token itself
        assert engines["p"][0].kv_cache_manager.block_pool.get_num_free_blocks() == free
        ids = engines["d"][0].kv_cache_manager.get_block_ids("d")
        loaded = tokens - 1 if hybrid else tokens
        assert reqs["p"].num_computed_tokens == loaded
        got = decode.call("check", blocks=ids[0], tokens=loaded, seed=7, state_block=ids[1][0] if hybrid else 0)
        layers = len(_rig.hybrid_layer_names()[0]) if hybrid else _rig.LAYERS
        assert got["checked"] == loaded * layers and got["bad"] == 0 and got["state_bad"] == 0, got
        assert got["written"] == got["checked"] + (got["state_rows"] if hybrid else 0), got
