"""One rank of a two-rank SGLang prefill or DeepSeek-V4 decode (``tests/sglang/test_manager.py``), in its own process.

``--cp``: a Kimi-Linear-shaped prefill with ``--tp-size 2 --attn-cp-size 2``, where SGLang makes
every CP rank send its share (``enable_all_cp_ranks_for_transfer``); each rank sends one room of
``CP_PAGES`` in the chunks ``CP_CHUNKS`` through SGLang's ``send`` and prints, as one JSON line,
what it publishes and the chunks its engine received (page position, pages, tokens, last, aux).
``--kv-shard``: the MLA model with ``--tp-size 2`` and SGLang's KV cache sharding stated, so each TP
rank holds every other page (``SHARD_CHUNKS``); the same output, a chunk's position replaced by
its pages' positions where they are scattered.
``--cp-tp-sharing``: the same sizes on the MLA model with SGLang's CP-TP group sharing stated;
each rank prints whether it is a dummy CP rank and the attention TP and CP of its
``PrefillServerInfo``, rank 0 (which runs the bootstrap server) also what ``/route`` answers for
the server and for each TP rank. ``--dsv4-decode``: a DeepSeek-V4 decode of ``--pp-size 2``, each rank
with SGLang's ``DeepSeekV4TokenToKVPool`` of its stage's layers (``get_pp_indices``); each prints the
layer ids its ``DecodeLayout`` gives its KV and state entries. Without any of these, PP 2:

Each rank boots SGLang with ``--pp-size 2`` (ServerArgs, ``publish``, ``init_parallel_runtime``:
real gloo groups, PP included), builds the MLA pool of ``_models.py`` and the pdproto manager
from ``get_kv_class`` (so its status table is SGLang's ``PPConsensusStore``), and creates one
``PdprotoKVSender`` per room, as ``prefill.py:409-414`` does. It then polls the bootstrap queue
the way ``pop_bootstrapped`` does with PP > 1 (``prefill.py:507-515``):
``poll_and_all_reduce_prefill_pp``, which polls only on PP rank 0 (``poll_pp_consensus``) and
hands rank 0's answer down the pipeline.

No decode runs: each rank's engine is told what a decode's ``SubmitTransfer`` would tell it.

* room ``BOTH``: a decode request for it reaches both ranks' services (``engine.claim``, as the
  service's runner does at admission, with the request waiting for input). SGLang must see
  WaitingForInput only once both ranks' states reached rank 0's consensus.
* room ``STAGE1_FAILS``: only rank 1's engine fails it (``PrefillSide.abort``: the request
  failed on that rank); rank 0's engine still waits for its decode. The consensus must be
  Failed, which only rank 1 knows.

Both ranks call the PP poll the same number of times (its answer is the same on both), until
every room is WaitingForInput or Failed; SGLang's bootstrap timeout bounds the wait (a room it
fails has the timeout as its reason on rank 0). Each rank prints one JSON line with the polls
and its failure reasons.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from tests.sglang._models import LAYERS, build_pools, page_of

BOTH, STAGE1_FAILS = 501, 502
CP_ROOM, CP_PAGES, CP_CHUNKS = 503, [1, 2, 3, 4, 5], [(0, 128), (128, 256), (256, 296)]
SHARD_CHUNKS = [(0, 192), (192, 256), (256, 296)]
STAGE1_REASON = "stage 1 lost its decode"
FAILED, BOOTSTRAPPING, WAITING = 0, 1, 2  # KVPoll (disaggregation/base/conn.py:123-128)


def _boot(args: argparse.Namespace, model_flags: list[str], role: str = "prefill", page: int = 64) -> Any:
    from tests.sglang import _stubs

    _stubs.install()
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args([
        "--model-path", args.model_dir, "--device", "cpu", "--host", "127.0.0.1", "--skip-tokenizer-init",
        "--page-size", str(page), "--disaggregation-mode", role, "--disaggregation-transfer-backend", "pdproto",
        "--disaggregation-bootstrap-port", str(args.bootstrap_port), *model_flags,
    ])  # fmt: skip
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=args.rank, gpu_id=args.rank))
    init_parallel_runtime(server_args=server_args, device="cpu", dist_port=args.dist_port)
    return server_args


def _tell_engine(manager: Any, rank: int) -> None:
    """What a decode's SubmitTransfer would do to this rank's engine (module docstring)."""
    side = manager.prefill_side
    waiting = SimpleNamespace(state=WAITING, failure_code="", failure_reason="", bytes=0, aux_bytes=0, state_bytes=0)

    async def claim(room: int) -> None:
        side.engine.claim(room, peer_id="decode-0", request=waiting, expected=1)

    side.service.call(claim(BOTH))
    if rank == 1:
        side.abort(STAGE1_FAILS, STAGE1_REASON)


def _split(args: argparse.Namespace) -> None:
    """A prefill rank whose CP ranks (``--cp``) or KV-shard TP ranks (``--kv-shard``) each send their share:
    what it publishes and what its engine receives."""
    # The Mamba radix cache needs GPU state snapshots (tests/sglang/_models.py server_flags).
    server_args = _boot(args, ["--tp-size", "2", "--attn-cp-size", "2", "--disable-radix-cache"] if args.cp
                        else ["--tp-size", "2"])
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    from tests.sglang._ranks import _manager, _metadata

    model = "kimi" if args.cp else "mla"
    if not args.cp:
        # SGLang resolves the flag for a CUDA trtllm_mla prefill (kv_shard_hook.py); the manager reads
        # the resolved flag (common/conn.py:369), stated here on the MLA model's CPU pool.
        get_parallel().override_permanently(enable_kv_cache_sharding=True)
    bootstrap = None
    if args.rank == 0:
        from sglang.srt.managers.disagg_service import start_disagg_service

        bootstrap = start_disagg_service()
    pools = build_pools(model, 8, args.model_dir)
    metadata, _ = _metadata()
    manager = _manager(server_args, "prefill", pools.pool, metadata, LAYERS[model])
    info = manager.prefill_side.info
    sender = get_kv_class(TransferBackend.PDPROTO, KVClassType.SENDER)(
        mgr=manager, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=CP_ROOM)
    sender.init(len(CP_PAGES), 3)  # prefill.py:446-450
    cuts = CP_CHUNKS if args.cp else SHARD_CHUNKS
    for start, end in cuts:  # _send_kv_chunk, prefill.py:1763-1781 (page 64)
        pages = CP_PAGES[start // 64:-(-end // 64)]
        last = end == cuts[-1][1]
        if sender.should_send_kv_chunk(len(pages), last):
            sender.send(np.asarray(pages, dtype=np.int32), None, num_kv_tokens=end - start)

    async def chunks() -> list[list[Any]]:
        log = manager.prefill_side.engine.rooms[CP_ROOM]
        return [[c.page_offset if c.positions is None else c.positions.tolist(), [int(p) for p in c.src_pages],
                 c.num_tokens, c.last, c.aux_slot] for c in log.chunks]

    print(json.dumps({
        "rank": args.rank, "dummy": bool(manager.is_dummy_cp_rank), "split": info.cp_ranks_split_pages,
        "sharded": info.enable_kv_cache_sharding,
        "info": {name: [getattr(info, name).size, getattr(info, name).rank] for name in ("attn_tp", "attn_cp")},
        "chunks": manager.prefill_side.service.call(chunks())}), flush=True)
    get_parallel().tp_group.barrier()  # rank 0's bootstrap server outlives rank 1's row
    manager.close()
    del bootstrap


def _cp_tp_sharing(args: argparse.Namespace) -> None:
    """Build the manager of a CP-TP group sharing prefill rank; print what it published (module docstring)."""
    server_args = _boot(args, ["--tp-size", "2", "--attn-cp-size", "2", "--disable-radix-cache"])
    import requests
    from sglang.srt.runtime_context import get_parallel

    from tests.sglang._ranks import _manager, _metadata

    # SGLang resolves the flag only for Qwen4-Exp and GLM-5-Next (cp_tp_group_sharing_hook.py), whose
    # pools need a GPU; the manager reads the resolved flag, stated here on the MLA model's CPU pool.
    get_parallel().override_permanently(enable_cp_tp_group_sharing=True)
    bootstrap = None
    if args.rank == 0:
        from sglang.srt.managers.disagg_service import start_disagg_service

        bootstrap = start_disagg_service()
    pools = build_pools("mla", 8, args.model_dir)
    metadata, _ = _metadata()
    manager = _manager(server_args, "prefill", pools.pool, metadata, LAYERS["mla"])
    info = manager.prefill_side.info
    out: dict[str, Any] = {
        "rank": args.rank, "dummy": bool(manager.is_dummy_cp_rank),
        "info": {name: [getattr(info, name).size, getattr(info, name).rank] for name in ("attn_tp", "attn_cp")},
        "port": manager.prefill_side.port}
    if args.rank == 0:
        url = f"http://127.0.0.1:{args.bootstrap_port}/route"
        query = "prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"
        deadline = time.monotonic() + 30
        while (server := requests.get(f"{url}?{query.format(-1, -1, -1, -1)}", timeout=5)).status_code == 503:
            assert time.monotonic() < deadline, server.text
            time.sleep(0.05)
        out["server"] = server.json()
        out["rows"] = [requests.get(f"{url}?{query.format(0, 0, r, 0)}", timeout=5).json() for r in range(2)]
    print(json.dumps(out), flush=True)
    get_parallel().tp_group.barrier()  # rank 0's bootstrap server outlives rank 1's row
    manager.close()
    del bootstrap


def _dsv4_decode(args: argparse.Namespace) -> None:
    """A DeepSeek-V4 decode rank of ``--pp-size 2``: the layer ids its layout gives its own stage's entries."""
    server_args = _boot(args, ["--pp-size", "2"], role="decode", page=page_of("dsv4"))
    from sglang.srt.distributed import get_pp_indices
    from sglang.srt.runtime_context import get_parallel

    from tests.sglang._ranks import _manager, _metadata

    stage = get_pp_indices(LAYERS["dsv4"], args.rank, 2)  # the layers SGLang's model builds on this stage
    pools = build_pools("dsv4", 8, args.model_dir, stage=stage)
    metadata, _ = _metadata()
    manager = _manager(server_args, "decode", pools.pool, metadata, LAYERS["dsv4"])
    layout = manager.decode_side.layout
    print(json.dumps({"rank": args.rank, "kv": [[e.layer_id, e.token_bytes] for e in layout.kv],
                      "state": {e.type_name: [t.layer_id for t in e.tensors] for e in layout.state}}), flush=True)
    get_parallel().pp_group.barrier()
    manager.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--bootstrap-port", "--dist-port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--cp", action="store_true")
    parser.add_argument("--cp-tp-sharing", action="store_true")
    parser.add_argument("--kv-shard", action="store_true")
    parser.add_argument("--dsv4-decode", action="store_true")
    args = parser.parse_args()
    if args.dsv4_decode:
        _dsv4_decode(args)
        return
    if args.cp or args.cp_tp_sharing or args.kv_shard:
        (_cp_tp_sharing if args.cp_tp_sharing else _split)(args)
        return
    server_args = _boot(args, ["--pp-size", "2"])
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        get_kv_class,
        poll_and_all_reduce_prefill_pp,
    )
    from sglang.srt.runtime_context import get_parallel

    from tests.sglang._ranks import _manager, _metadata

    bootstrap = None
    if args.rank == 0:
        from sglang.srt.managers.disagg_service import start_disagg_service

        bootstrap = start_disagg_service()  # tokenizer_manager.py:806, in the leader's process
    pools = build_pools("mla", 8, args.model_dir)
    metadata, _ = _metadata()
    manager = _manager(server_args, "prefill", pools.pool, metadata, LAYERS["mla"])
    sender_class = get_kv_class(TransferBackend.PDPROTO, KVClassType.SENDER)
    rooms = [BOTH, STAGE1_FAILS]
    senders = [sender_class(mgr=manager, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=room)
               for room in rooms]
    parallel = get_parallel()
    # scheduler.py:1248-1250; the scheduler's pp_group (prefill.py:510)
    tp_group, cp_group, pp_group = parallel.attn_tp_group.cpu_group, parallel.attn_cp_group.cpu_group, \
        parallel.pp_group
    work: list[Any] = []  # the bootstrap queue's pp_poll_sync_work_list (prefill.py:217)

    def poll() -> list[int]:
        polls = poll_and_all_reduce_prefill_pp(senders, cp_group, tp_group, pp_group, manager.pp_rank, 2, work)
        return [int(p) for p in polls]

    first = poll()  # before any decode: every room bootstrapping
    _tell_engine(manager, args.rank)
    polls = poll()
    # The same answer on both ranks ends the loop on both, in the same round.
    while any(p not in (WAITING, FAILED) for p in polls):
        time.sleep(0.01)
        polls = poll()
    with manager.failure_lock:
        reasons = {room: manager.failure_records.get(room) for room in rooms}
    print(json.dumps({"rank": args.rank, "first": first, "polls": polls, "reasons": reasons}), flush=True)
    # Leave together: rank 0's store must outlive rank 1's last message, the groups every send.
    parallel.pp_group.barrier()
    manager.close()
    del bootstrap


if __name__ == "__main__":
    main()
