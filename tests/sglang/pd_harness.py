"""SGLang 0.5.23's own PD transfer, end to end on CPU: prefill and decode ranks in separate processes.

Each rank runs SGLang's real objects: ServerArgs parsed and resolved by SGLang, published
(``runtime_context.publish``), its process groups and shared Mooncake engine built by
``init_parallel_runtime``, an ``MLATokenToKVPool``, ``MetadataBuffers``, the bootstrap server
(``start_disagg_service``) and the backend's manager, sender and receiver from
``get_kv_class``. What the scheduler does around them (allocating pages, the forward pass,
its queues) is replaced by the calls ``disaggregation/prefill.py`` and
``disaggregation/decode.py`` make, in their order; each cites the line it mirrors (paths
under ``sglang/srt/`` of the 0.5.23 wheel).

Topologies: one dense prefill rank to one decode rank, or to a decode DCP group of N
ranks (``--dcp N``: decode TP = DCP = N, so one prefill rank feeds N decode ranks, each
its own token shard). Every decode rank compares its whole KV pool and every aux buffer
with what it must hold (the prefill's bytes where they belong, zeros elsewhere); both
sides regenerate the prefill's bytes from one seed.

    python -m tests.sglang.pd_harness                         # mooncake_tcp, 1 -> 1
    python -m tests.sglang.pd_harness --dcp 4                  # dense -> DCP 4 (5 processes)
    python -m tests.sglang.pd_harness --backend pdproto        # the plugin's backend

``tests/sglang/test_harness.py`` runs the first (and the pdproto one); the DCP run takes
five processes and is left to this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
PAGE = 64  # physical page (tokens); a DCP decode's virtual page is PAGE * dcp
LAYERS = 4
KV_LORA_RANK, ROPE_DIM = 512, 64  # MLA row: 576 bf16 values, 1152 bytes
POOL_PAGES = 96  # usable pages per pool; page 0 is the pool's padding page
AUX_SLOTS = 8
SEED = 1234
POLL_S = 0.005
SUCCESS, FAILED, WAITING = 4, 0, 2  # KVPoll (disaggregation/base/conn.py:123-128)


@dataclass(frozen=True)
class Request:
    """One request: room, prompt length, decode prefix (tokens) and prefill chunk size."""

    room: int
    tokens: int
    decode_prefix: int = 0  # a multiple of the decode's (virtual) page
    chunk: int = 0  # 0: one send; else chunked prefill of this many tokens


REQUESTS = (
    Request(room=101, tokens=300, chunk=128),  # chunked, last page partial
    Request(room=102, tokens=64),  # exactly one page
    Request(room=103, tokens=1000, decode_prefix=256, chunk=256),  # decode holds a prefix
    Request(room=104, tokens=5),  # shorter than a page
)


def write_model_config(directory: Path) -> Path:
    """A tiny DeepSeek-V3 (MLA) config.json: what SGLang's argument checks read; no weights."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": LAYERS,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": ROPE_DIM,
        "v_head_dim": 128,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------- layout (pure)


def _pages(requests: list[Request], tokens_per_page: int, seed: int) -> dict[int, list[int]]:
    """Disjoint, shuffled page ids per request, never page 0 (the padding page)."""
    import random

    free = list(range(1, POOL_PAGES + 1))
    random.Random(seed).shuffle(free)
    out = {}
    for req in requests:
        n = -(-req.tokens // tokens_per_page)
        out[req.room], free = free[:n], free[n:]
    return out


def prefill_pages(requests: list[Request]) -> dict[int, list[int]]:
    """The prefill's req_to_token, page by page: PAGE tokens per page."""
    return _pages(requests, PAGE, SEED)


def decode_pages(requests: list[Request], dcp: int) -> dict[int, list[int]]:
    """The decode's pages: virtual pages of PAGE * dcp tokens, the same ids on every DCP rank
    (mem_cache/kv_cache_builder.py:393-400; each rank's physical page k holds its shard)."""
    return _pages(requests, PAGE * dcp, SEED + 1)


def expected_rows(req: Request, src: list[int], dst: list[int], dcp: int, rank: int) -> list[tuple[int, int]]:
    """(prefill row, decode row) pairs one decode rank must receive for ``req``.

    Without DCP whole pages move, a partial last page included (mooncake/conn.py
    send_kvcache). With DCP, token p goes to rank p % dcp at local position p // dcp
    (common/utils.py:139-198); only those rows move.
    """
    if dcp == 1:
        return [
            (s * PAGE + i, d * PAGE + i)
            for s, d in zip(src[req.decode_prefix // PAGE :], dst[req.decode_prefix // PAGE :])
            for i in range(PAGE)
        ]
    return [
        (src[p // PAGE] * PAGE + p % PAGE, dst[p // (PAGE * dcp)] * PAGE + (p // dcp) % PAGE)
        for p in range(req.decode_prefix, req.tokens)
        if p % dcp == rank
    ]


# --------------------------------------------------------------------- SGLang set-up


def _boot(args: argparse.Namespace, role: str, tp: int, rank: int) -> Any:
    """Parse, resolve and publish ServerArgs for one rank, then build its process groups."""
    from tests.sglang import _stubs

    _stubs.install()
    from sglang.srt.distributed.bootstrap import init_parallel_runtime
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()  # launch_server.py:79; again in each scheduler (scheduler.py:6323)
    argv = [
        "--model-path", args.model_dir, "--device", "cpu", "--host", "127.0.0.1",
        "--skip-tokenizer-init", "--page-size", str(PAGE),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", args.backend,
        "--disaggregation-bootstrap-port", str(args.bootstrap_port),
    ]  # fmt: skip
    if tp > 1:
        argv += ["--tp-size", str(tp), "--dcp-size", str(tp)]
    server_args = prepare_server_args(argv)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    # What the scheduler's model runner does first: gloo groups on CPU and the shared
    # Mooncake engine (distributed/bootstrap.py:92-143). SGLang builds a DCP group only on
    # GPU platforms (distributed/parallel_state.py:2651-2659); the transfer path reads the
    # DCP size and rank from the published config and never uses that group, so on CPU
    # the groups are built without the DCP split (the override its docstring asks for).
    parallel = get_parallel()
    with parallel.override(attn_dcp_size=1) if tp > 1 else contextlib.nullcontext():
        init_parallel_runtime(server_args=server_args, device="cpu", dist_port=args.dist_port)
    return server_args


def _pool() -> Any:
    import torch

    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
        kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def _metadata() -> tuple[Any, Any]:
    import torch

    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    buffers = MetadataBuffers(
        AUX_SLOTS, hidden_size=256, hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=16,
    )  # fmt: skip
    return buffers, ReqToMetadataIdxAllocator(AUX_SLOTS)


def _manager(server_args: Any, role: str, pool: Any, metadata: Any) -> Any:
    """KVArgs filled as prefill.py:257-353 / decode.py:608-700 fill them, then the manager."""
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        is_mla_backend,
        setup_state_kv_args,
    )
    from sglang.srt.runtime_context import get_disagg, get_parallel

    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()  # prefill.py:258, decode.py:609
    kv_args.engine_rank = get_parallel().tp_rank % get_parallel().attn_tp_size  # decode.py:613
    kv_args.pp_rank = get_parallel().pp_rank
    kv_args.system_dp_rank = get_parallel().dp_rank
    kv_args.rust_http_port = None  # prefill.py:263 (no Rust server)
    kv_args.kv_cache_dtype_str = "bfloat16"  # model_runner.kv_cache_dtype_str
    kv_args.kv_layout = get_pd_kv_layout(pool)
    kv_args.prefill_start_layer = pool.start_layer  # prefill.py:275-286
    ptrs, lens, item_lens = get_kv_transfer_buf_infos(pool)  # prefill.py:287
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, item_lens
    kv_args.num_draft_entries = 0  # no speculative draft pool
    kv_args.kv_layer_ids = build_kv_layer_ids(  # prefill.py:326
        token_to_kv_pool=pool, draft_token_to_kv_pool=None,
        num_draft_entries=0, num_hidden_layers=LAYERS,
    )  # fmt: skip
    kv_args.page_size = pool.page_size  # prefill.py:337, decode.py:670
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        metadata.get_buf_infos()  # prefill.py:339, decode.py:672
    )
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, LAYERS, req_to_token_pool=None)  # prefill.py:350
    manager_class = get_kv_class(backend, KVClassType.MANAGER)  # prefill.py:358
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return manager_class(kv_args, mode, server_args, is_mla_backend(pool))  # prefill.py:364


def _fill_random(tensor: Any, seed: int) -> None:
    import torch

    raw = tensor.view(torch.uint8).reshape(-1)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def _token_slots(pages: list[int], tokens: int, tokens_per_page: int) -> Any:
    """A req_to_token row, int32 like ReqToTokenPool's (memory_pool.py:406): page indices
    derived from it are int32, which the frames require (decode.py:2234)."""
    import torch

    t = torch.arange(tokens, dtype=torch.int32)
    return torch.tensor(pages, dtype=torch.int32)[t // tokens_per_page] * tokens_per_page + (
        t % tokens_per_page
    )


def _aux_tensors(metadata: Any) -> list[Any]:
    """The aux buffers, in get_buf_infos order (utils.py:524-544)."""
    by_ptr = {t.data_ptr(): t for t in vars(metadata).values() if hasattr(t, "data_ptr")}
    return [by_ptr[p] for p in metadata.get_buf_infos()[0]]


def _write_aux_row(metadata: Any, index: int, room: int) -> None:
    """Stand-in for MetadataBuffers.set_buf (utils.py:584): seeded bytes in every buffer,
    and the room in bootstrap_room, which the decode's gate waits for (utils.py:245-260)."""
    for k, buf in enumerate(_aux_tensors(metadata)):
        if buf is metadata.bootstrap_room:
            buf[index].zero_()
            buf[index, 0] = room
        else:
            _fill_random(buf[index], SEED * 1000 + room * 16 + k)


def _poll_until(poll: Callable[[], list[Any]], done: set[int], timeout_s: float) -> list[int]:
    """Repeat one of SGLang's reduced polls until every state is in ``done``.

    Every rank of a group stops on the same iteration: the states are all-reduced.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        polls = [int(p) for p in poll()]
        if all(p in done for p in polls) or time.monotonic() > deadline:
            return polls
        time.sleep(POLL_S)


# --------------------------------------------------------------------- prefill


def run_prefill(args: argparse.Namespace) -> None:
    """One dense prefill rank: bootstrap server, manager, a sender per request, chunked sends."""
    server_args = _boot(args, "prefill", tp=1, rank=0)
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        get_kv_class,
        poll_and_all_reduce_attn_cp_tp_group,
    )
    from sglang.srt.managers.disagg_service import start_disagg_service
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.runtime_context import get_disagg, get_parallel

    # tokenizer_manager.py:806 starts it in the prefill's main process; the ranks'
    # managers register with it (retrying until it answers, common/conn.py:1635-1662).
    bootstrap = start_disagg_service()
    pool = _pool()
    for layer, buf in enumerate(pool.kv_buffer):
        _fill_random(buf, SEED + layer)  # stands in for the forward pass
    metadata, allocator = _metadata()
    manager = _manager(server_args, "prefill", pool, metadata)
    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    sender_class = get_kv_class(backend, KVClassType.SENDER)  # prefill.py:407
    tp_group = get_parallel().attn_tp_group.cpu_group  # scheduler.py:1248-1250
    cp_group = get_parallel().attn_cp_group.cpu_group
    print(json.dumps({"ready": True}), flush=True)

    requests = [Request(**r) for r in json.loads(args.requests)]
    src_pages = prefill_pages(requests)
    senders = [
        sender_class(  # create_sender, prefill.py:409-414
            mgr=manager,
            bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}",
            bootstrap_room=req.room,
            req_has_disagg_prefill_dp_rank=False,
        )
        for req in requests
    ]

    def poll() -> list[Any]:  # prefill.py:517 and 1163
        return poll_and_all_reduce_attn_cp_tp_group(senders, cp_group, tp_group)

    # pop_bootstrapped (prefill.py:497-551) waits for WaitingForInput ...
    polls = _poll_until(poll, {WAITING, FAILED}, args.timeout)
    if polls != [WAITING] * len(requests):
        raise SystemExit(f"prefill: bootstrap polls {polls}")
    results: dict[int, dict[str, Any]] = {}
    for req, sender in zip(requests, senders):
        # ... then finalize_bootstrap (prefill.py:429-444).
        prefix = sender.pop_decode_prefix_len()  # prefill.py:437
        index = allocator.alloc()  # ensure_metadata_buffer, prefill.py:424
        sender.init(-(-(req.tokens - prefix) // PAGE), index)  # prefill.py:442, 446-450
        slots = _token_slots(src_pages[req.room], req.tokens, PAGE)
        start = prefix  # req.start_send_idx, prefill.py:438
        ends = list(range(start + (req.chunk or req.tokens), req.tokens, req.chunk or req.tokens))
        for end in ends + [req.tokens]:
            last = end == req.tokens
            if not last:
                end -= end % PAGE  # a partial page waits for the next send, prefill.py:1546
            else:
                _write_aux_row(metadata, index, req.room)  # set_buf, prefill.py:1568
            state = [] if last else None  # one entry per kv_args.state_types, prefill.py:1709
            _send_kv_chunk(sender, slots, start, end, last, state, kv_to_page_indices)
            start = end
        results[req.room] = {"prefix": prefix, "aux_index": index}
    # process_disagg_prefill_inflight_queue (prefill.py:1151-1269)
    polls = _poll_until(poll, {SUCCESS, FAILED}, args.timeout)
    for req, sender, state in zip(requests, senders, polls):
        results[req.room]["poll"] = state
        if state == FAILED:
            try:
                sender.failure_exception()  # prefill.py:1292
            except Exception as exc:  # its message is the failure reason
                results[req.room]["reason"] = str(exc)
        elif state == SUCCESS:
            sender.clear()  # prefill.py:1233
            metric = sender.get_transfer_metric()  # prefill.py:1256
            results[req.room]["metric_bytes"] = metric.transfer_total_bytes
    print(json.dumps({"results": results}), flush=True)
    sys.stdin.readline()  # keep the engine and bootstrap server up until the driver is done
    del bootstrap


def _send_kv_chunk(
    sender: Any, slots: Any, start: int, end: int, last: bool, state: Any, to_pages: Any
) -> None:
    """_send_kv_chunk (prefill.py:1528-1786): split at the sender's limit, send each segment."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_grid_segments

    if end < start:
        return  # prefill.py:1557
    limit = sender.get_max_transfer_tokens()  # prefill.py:1713
    if limit is None:
        segments = [(start, end)]
    else:
        segments = compute_grid_segments(start, end, 0, limit)  # prefill.py:1723
    for seg_start, seg_end in segments:
        pages = to_pages(slots[seg_start:seg_end], PAGE)  # prefill.py:1763
        segment_is_last = last and seg_end == end
        if not sender.should_send_kv_chunk(len(pages), segment_is_last):  # prefill.py:1765
            continue
        sender.send(  # prefill.py:1776-1781
            pages, state if segment_is_last else None, num_kv_tokens=seg_end - seg_start
        )


# --------------------------------------------------------------------- decode


@dataclass
class _GatedRequest:
    """What _apply_metadata_gate reads of a DecodeRequest and its Req (utils.py:238-260)."""

    metadata_buffer_index: int
    bootstrap_host: str = "127.0.0.1"

    @property
    def req(self) -> _GatedRequest:
        return self


def run_decode(args: argparse.Namespace) -> None:
    """One decode rank: manager, a receiver per request, metadata, then every byte checked."""
    server_args = _boot(args, "decode", tp=args.dcp, rank=args.rank)
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        get_kv_class,
        poll_and_all_reduce,
    )
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.runtime_context import get_disagg, get_parallel

    pool = _pool()
    metadata, allocator = _metadata()
    manager = _manager(server_args, "decode", pool, metadata)
    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    receiver_class = get_kv_class(backend, KVClassType.RECEIVER)  # decode.py:905
    group = get_parallel().attn_tp_group.cpu_group  # gloo_group, decode.py:421 and 2545
    addr = f"127.0.0.1:{args.bootstrap_port}"
    requests = [Request(**r) for r in json.loads(args.requests)]
    dst_pages = decode_pages(requests, args.dcp)
    receivers = [  # _create_receiver_and_enqueue, decode.py:907-911
        receiver_class(mgr=manager, bootstrap_addr=addr, bootstrap_room=req.room)
        for req in requests
    ]
    # _resolve_pending_reqs -> _ensure_prefill_info (decode.py:1200): retried each
    # scheduling cycle until every prefill rank has registered.
    deadline = time.monotonic() + args.timeout
    while not manager.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise SystemExit("decode: the prefill never registered with the bootstrap server")
        time.sleep(0.2)
    for receiver in receivers:
        receiver.init(0)  # _init_receiver, decode.py:1105 (one prefill DP rank)
    # _update_handshake_waiters (decode.py:1124-1170)
    polls = _poll_until(
        lambda: poll_and_all_reduce(receivers, group), {WAITING, FAILED}, args.timeout
    )
    if polls != [WAITING] * len(requests):
        raise SystemExit(f"decode: handshake polls {polls}")
    gated = []
    for req, receiver in zip(requests, receivers):  # pop_preallocated (decode.py:1333-1842)
        slots = _token_slots(dst_pages[req.room], req.tokens, PAGE * args.dcp)
        index = allocator.alloc()  # _send_kv_metadata, decode.py:1847-1848
        # only the pages after the prefix go to the prefill (decode.py:1640-1660, 2231-2235)
        pages = kv_to_page_indices(slots[req.decode_prefix :], PAGE * args.dcp)
        receiver.send_metadata(pages, index, [], decode_prefix_len=req.decode_prefix)  # :1863
        gated.append(_GatedRequest(index))
    # pop_transferred (decode.py:2833-2900): Success waits for the aux row to land.
    polls = _poll_until(
        lambda: poll_and_all_reduce(receivers, group, decode_reqs=gated, metadata_buffers=metadata),
        {SUCCESS, FAILED},
        args.timeout,
    )
    report: dict[str, Any] = {"rank": args.rank, "polls": polls, "reasons": {}}
    for req, receiver, state in zip(requests, receivers, polls):
        if state == FAILED:
            try:
                receiver.failure_exception()  # decode.py:2870
            except Exception as exc:  # its message is the failure reason
                report["reasons"][req.room] = str(exc)
        elif state == SUCCESS:
            receiver.clear()  # _commit_transfer_to_req, decode.py:2774
    indices = {req.room: g.metadata_buffer_index for req, g in zip(requests, gated)}
    report["mismatches"] = _check(pool, metadata, requests, indices, args.dcp, args.rank)
    print(json.dumps(report), flush=True)


def _check(
    pool: Any, metadata: Any, requests: list[Request], indices: dict[int, int], dcp: int, rank: int
) -> list[str]:
    """Every byte of this rank's KV pool and aux buffers against what it must hold."""
    import torch

    src_pool = _pool()
    for layer, buf in enumerate(src_pool.kv_buffer):
        _fill_random(buf, SEED + layer)
    src_pages, dst_pages = prefill_pages(requests), decode_pages(requests, dcp)
    pairs = [
        pair
        for req in requests
        for pair in expected_rows(req, src_pages[req.room], dst_pages[req.room], dcp, rank)
    ]
    src_rows = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    dst_rows = torch.tensor([d for _, d in pairs], dtype=torch.int64)
    mismatches = []
    for layer in range(LAYERS):
        expected = torch.zeros_like(pool.kv_buffer[layer])
        expected[dst_rows] = src_pool.kv_buffer[layer][src_rows]
        got = pool.kv_buffer[layer].view(torch.uint8).reshape(expected.shape[0], -1)
        want = expected.view(torch.uint8).reshape(expected.shape[0], -1)
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        if bad:
            mismatches.append(f"layer {layer}: {len(bad)} rows differ, first {bad[:5]}")
    src_meta, _ = _metadata()
    for req in requests:
        _write_aux_row(src_meta, indices[req.room], req.room)
    for k, (got, want) in enumerate(zip(_aux_tensors(metadata), _aux_tensors(src_meta))):
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            mismatches.append(f"aux buffer {k} differs")
    return mismatches


# --------------------------------------------------------------------- driver


def run(
    backend: str,
    requests: tuple[Request, ...] = REQUESTS,
    *,
    dcp: int = 1,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Run one prefill rank and ``dcp`` decode ranks for ``backend``; return their reports.

    Keys: ``prefill`` (its report or None), ``decode`` (one report per rank, None where a
    rank printed none), ``prefill_rc``, ``decode_rc`` (list) and the tail of every stderr.
    """
    env = dict(
        os.environ,
        MOONCAKE_PROTOCOL="tcp",  # no RDMA device here (mooncake_transfer_engine.py:209)
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(int(timeout)),
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(int(timeout)),
        # CPU ranks beyond the NUMA node count must be told where their threads go
        # (utils/numa_utils.py:459-496); this only matters on AMX or arm64 hosts.
        SGLANG_CPU_OMP_THREADS_BIND="|".join([f"0-{(os.cpu_count() or 1) - 1}"] * dcp),
    )
    cmd = [sys.executable, "-m", "tests.sglang.pd_harness"]
    out: dict[str, Any] = {"prefill": None, "decode": [None] * dcp}
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            "--backend", backend, "--dcp", str(dcp), "--timeout", str(timeout),
            "--model-dir", str(write_model_config(Path(tmp) / "mla")),
            "--bootstrap-port", str(free_port()),
            "--requests", json.dumps([asdict(r) for r in requests]),
        ]  # fmt: skip
        prefill_err = Path(tmp) / "prefill.err"
        with prefill_err.open("w") as err:
            prefill = subprocess.Popen(
                cmd + ["--role", "prefill", "--dist-port", str(free_port())] + common,
                env=env, text=True, cwd=REPO,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
            assert prefill.stdout is not None and prefill.stdin is not None
            try:
                if prefill.stdout.readline():  # {"ready": true}
                    _run_decodes(cmd, common, env, dcp, timeout, out)
                    line = prefill.stdout.readline()
                    out["prefill"] = json.loads(line) if line else None
                prefill.stdin.close()
                out["prefill_rc"] = prefill.wait(timeout=30)
            finally:
                if prefill.poll() is None:
                    prefill.kill()
                    prefill.wait()
        out["prefill_stderr"] = prefill_err.read_text()[-3000:]
    return out


def _run_decodes(
    cmd: list[str], common: list[str], env: dict[str, str], dcp: int, timeout: float,
    out: dict[str, Any],
) -> None:  # fmt: skip
    dist_port = str(free_port())
    ranks = [
        subprocess.Popen(
            cmd + ["--role", "decode", "--rank", str(rank), "--dist-port", dist_port] + common,
            env=env, text=True, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        for rank in range(dcp)
    ]
    out["decode_rc"], out["decode_stderr"] = [], []
    for rank, proc in enumerate(ranks):
        try:
            stdout, stderr = proc.communicate(timeout=timeout * 3)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        lines = stdout.strip().splitlines()
        out["decode"][rank] = json.loads(lines[-1]) if lines else None
        out["decode_rc"].append(proc.returncode)
        out["decode_stderr"].append(stderr[-3000:])


def main() -> None:
    """``--role`` runs one rank; without it, the driver runs all of them and prints a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"])
    parser.add_argument("--backend", default="mooncake_tcp")
    parser.add_argument("--dcp", type=int, default=1, help="decode TP = DCP size")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--model-dir")
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument("--dist-port", type=int)
    parser.add_argument("--requests")
    args = parser.parse_args()
    if args.role == "prefill":
        run_prefill(args)
    elif args.role == "decode":
        run_decode(args)
    else:
        started = time.monotonic()
        report = run(args.backend, dcp=args.dcp, timeout=args.timeout)
        report["seconds"] = round(time.monotonic() - started, 1)
        for key in ("prefill_stderr", "decode_stderr"):
            report.pop(key, None)
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
