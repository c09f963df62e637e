"""One prefill or decode rank of the SGLang harness (``tests/sglang/pd_harness.py``), in its own process.

Each rank boots SGLang (ServerArgs, ``publish``, ``init_parallel_runtime``), builds the
model's pools (``_models.py``) and its backend's manager from ``get_kv_class``, then makes
the calls ``disaggregation/prefill.py`` or ``disaggregation/decode.py`` make, in their
order; each call cites the line it mirrors (paths under ``sglang/srt/`` of the 0.5.23
wheel). It talks to the driver in JSON lines on stdout and waits on stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.sglang._models import (
    AUX_SLOTS,
    LAYERS,
    SEED,
    build_pools,
    check_index,
    check_paged,
    check_state,
    check_tail,
    fill_prefill,
    fill_random,
    fill_state_share,
    page_rows,
    server_flags,
    state_indices,
)
from tests.sglang.pd_harness import (
    AGAIN,
    DROPPED,
    FAILED,
    KILL,
    POLL_S,
    SUCCESS,
    WAITING,
    Request,
    Spec,
    decode_pages,
    expected_rows,
    prefill_pages,
    state_slots,
)


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
        "--skip-tokenizer-init", "--page-size", str(args.spec.page),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", args.prefill_backend if role == "prefill" else args.decode_backend,
        "--disaggregation-bootstrap-port", str(args.bootstrap_port),
        *server_flags(args.spec.model, role),
    ]  # fmt: skip
    if role == "prefill" and args.spec.cp_split:  # as tests/sglang/_prefill_group.py boots Kimi Linear's CP ranks
        argv += ["--tp-size", str(tp), "--attn-cp-size", str(tp)]
    elif tp > 1:  # a prefill's TP ranks are plain TP; a decode's its DCP group, unless Spec.decode_dcp says not
        argv += ["--tp-size", str(tp), *(["--dcp-size", str(tp)] if role == "decode" and args.spec.decode_dcp else [])]
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
    if args.spec.shared_engine:
        # maybe_init_shared_mooncake_transfer_engine (mooncake_transfer_engine.py:315-365) starts
        # it for HiCache's Mooncake store, elastic EP or encoder disaggregation too.
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )
        from sglang.srt.utils.network import get_local_ip_auto

        init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=rank)
    return server_args


def _engine_report(manager: Any) -> dict[str, Any]:
    """Which transfer engine the rank's backend uses: SGLang's shared one, or its own."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine,
    )

    shared = get_mooncake_transfer_engine()
    side = getattr(manager, "prefill_side", None) or getattr(manager, "decode_side", None)
    executor = getattr(side, "executor", None)
    return {
        "shared": None if shared is None else shared.get_session_id(),
        "adopted": getattr(executor, "adopted", None),
        # Mooncake names an engine by session id, NIXL by agent name.
        "session": getattr(executor.endpoint(), "session_id", None) if executor is not None else None,
    }


def _sessions(manager: Any) -> dict[str, int]:
    """The decode peers' sessions as the prefill rank's service sees them: how many are connected."""
    import os

    from pdproto.client import HandshakeClient

    side = getattr(manager, "prefill_side", None)
    if side is None:
        return {}
    endpoint = side.info.rank_endpoint
    with HandshakeClient(f"{endpoint.host}:{endpoint.port}", token=os.environ.get("PDPROTO_TOKEN")) as client:
        peers = client.describe().peers
    return {"connected": sum(p.sessions_connected for p in peers)}


def _legacy(manager: Any) -> dict[str, int]:
    """What the prefill rank's legacy listener made of each SGLang Mooncake message: "kind outcome" -> count."""
    side = getattr(manager, "prefill_side", None)
    if side is None:
        return {}
    metric = side.service.core.metrics.legacy_frames
    return {f"{s.labels['kind']} {s.labels['outcome']}": int(s.value)
            for m in metric.collect() for s in m.samples if s.name.endswith("_total")}


def _metadata(spec: Spec | None = None) -> tuple[Any, Any]:
    import torch

    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    # Draft hidden states as a speculative decoding server sends them, or SGLang's padding without
    # (scheduler.py:1555), which a vLLM prefill writes (``Spec.dump``).
    hidden = (16, torch.float32) if spec is not None and spec.dump else (256, torch.bfloat16)
    buffers = MetadataBuffers(
        AUX_SLOTS, hidden_size=hidden[0], hidden_states_dtype=hidden[1],
        max_sampling_mask_tokens=16,
    )  # fmt: skip
    return buffers, ReqToMetadataIdxAllocator(AUX_SLOTS)


def _manager(server_args: Any, role: str, pool: Any, metadata: Any, layers: int, draft: Any = None) -> Any:
    """KVArgs filled as prefill.py:257-353 / decode.py:608-700 fill them (``draft``: the speculative draft's
    pool), then the manager."""
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
    kv_args.prefill_end_layer = getattr(pool, "end_layer", None)
    draft_ptrs, draft_lens, draft_items = draft.get_contiguous_buf_infos() if draft is not None else ([], [], [])
    kv_args.kv_data_ptrs, kv_args.kv_data_lens = ptrs + draft_ptrs, lens + draft_lens  # prefill.py:300-317
    kv_args.kv_item_lens = item_lens + draft_items
    kv_args.num_draft_entries = len(draft_ptrs)
    kv_args.kv_layer_ids = build_kv_layer_ids(  # prefill.py:326
        token_to_kv_pool=pool, draft_token_to_kv_pool=draft,
        num_draft_entries=len(draft_ptrs), num_hidden_layers=layers,
    )  # fmt: skip
    kv_args.page_size = pool.page_size  # prefill.py:337, decode.py:670
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        metadata.get_buf_infos()  # prefill.py:339, decode.py:672
    )
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, draft, layers, req_to_token_pool=None)  # prefill.py:350
    manager_class = get_kv_class(backend, KVClassType.MANAGER)  # prefill.py:358
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    # A hybrid pool is not "MLA" here even with MLA layers (prefill.py:195, utils.py:865).
    return manager_class(kv_args, mode, server_args, is_mla_backend(pool))  # prefill.py:364


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


def _write_aux_row(metadata: Any, index: int, room: int, salt: int = 0) -> None:
    """Stand-in for MetadataBuffers.set_buf (utils.py:584): seeded bytes in every buffer,
    and the room in bootstrap_room, which the decode's gate waits for (utils.py:245-260).
    A ``salt`` other than 0 seeds other bytes: a row no decode may receive."""
    for k, buf in enumerate(_aux_tensors(metadata)):
        if buf is metadata.bootstrap_room:
            buf[index].zero_()
            buf[index, 0] = room
        else:
            fill_random(buf[index], SEED * 1000 + room * 16 + k + salt * 1_000_003)


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


def _emit(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


# --------------------------------------------------------------------- prefill


@dataclass
class _Prefill:
    """One prefill rank's SGLang objects and what it computed."""

    args: argparse.Namespace
    manager: Any
    sender_class: Any
    pools: Any
    metadata: Any
    allocator: Any
    tp_group: Any
    cp_group: Any
    src_pages: dict[int, list[int]] = field(default_factory=dict)
    aux_salt: int = 0
    """Not 0 on a CP rank past 0 of ``Spec.cp_split``: its aux rows differ from CP rank 0's, and no decode may get them."""

    def senders(self, requests: list[Request]) -> list[Any]:
        return [
            self.sender_class(  # create_sender, prefill.py:409-414
                mgr=self.manager,
                bootstrap_addr=f"127.0.0.1:{self.args.bootstrap_port}",
                bootstrap_room=req.room,
                req_has_disagg_prefill_dp_rank=False,
            )
            for req in requests
        ]

    def poll(self, senders: list[Any]) -> list[Any]:  # prefill.py:517 and 1163
        from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

        return poll_and_all_reduce_attn_cp_tp_group(senders, self.cp_group, self.tp_group)

    def start(self, req: Request, sender: Any) -> dict[str, Any]:
        """finalize_bootstrap (prefill.py:429-444), once the poll said WaitingForInput."""
        prefix = sender.pop_decode_prefix_len()  # prefill.py:437
        index = self.allocator.alloc()  # ensure_metadata_buffer, prefill.py:424
        sender.init(-(-(req.tokens - prefix) // self.args.spec.page), index)  # prefill.py:442, 446-450
        return {"prefix": prefix, "aux_index": index}

    def send(self, req: Request, sender: Any, started: dict[str, Any], upto: int | None = None) -> None:
        """The request's chunks from where the last send stopped (``req.start_send_idx``) to ``upto``
        tokens, or to its end; the last one carries the aux row and the state."""
        from sglang.srt.mem_cache.common import kv_to_page_indices

        slots = _token_slots(self.src_pages[req.room], req.tokens, self.args.spec.page)
        start = started.setdefault("sent", started["prefix"])  # req.start_send_idx, prefill.py:438
        stop = req.tokens if upto is None else upto
        while start < stop:
            end = min(start + (req.chunk or req.tokens), req.tokens)
            last = end == req.tokens
            if not last:
                end -= end % self.args.spec.page  # a partial page waits for the next send, prefill.py:1546
            else:
                _write_aux_row(self.metadata, started["aux_index"], req.room, self.aux_salt)  # set_buf, prefill.py:1568
            # One entry per kv_args.state_types on the last chunk only (prefill.py:1577-1709).
            state = None
            if last:
                state = state_indices(self.pools, state_slots(self.args.spec)[req.room][0], slots, started["prefix"],
                                      req.tokens)
            _send_kv_chunk(sender, slots, start, end, last, state, started["prefix"], kv_to_page_indices,
                           self.args.spec.page)
            started["sent"] = start = end


def run_prefill(args: argparse.Namespace) -> None:
    """One dense prefill rank: bootstrap server, manager, a sender per request, chunked sends."""
    spec: Spec = args.spec
    server_args = _boot(args, "prefill", tp=spec.prefill_ranks, rank=args.rank)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers.disagg_service import start_disagg_service
    from sglang.srt.runtime_context import get_disagg, get_parallel

    if spec.kv_shard:
        # SGLang resolves the flag for a CUDA trtllm_mla prefill (kv_shard_hook.py); the manager reads
        # the resolved flag (common/conn.py:369), stated here on the MLA model's CPU pool.
        get_parallel().override_permanently(enable_kv_cache_sharding=True)
    # tokenizer_manager.py:806 starts it in the prefill's main process; the ranks'
    # managers register with it (retrying until it answers, common/conn.py:1635-1662).
    bootstrap = start_disagg_service() if args.rank == 0 else None
    pools = build_pools(spec.model, spec.pool_pages, args.model_dir)
    fill_prefill(pools)
    fill_state_share(pools, spec.model, args.model_dir, spec.prefill_tp, args.rank)  # a plain TP rank's state heads
    if spec.kv_shard:
        _keep_shard(pools, spec.page, shards=2, rank=args.rank)
    if spec.cp_split:
        _keep_cp_share(pools, spec, args.rank)
    metadata, allocator = _metadata()
    manager = _manager(server_args, "prefill", pools.pool, metadata, LAYERS[spec.model], pools.draft)
    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    rank = _Prefill(
        args, manager, get_kv_class(backend, KVClassType.SENDER), pools, metadata, allocator,  # prefill.py:407
        get_parallel().attn_tp_group.cpu_group, get_parallel().attn_cp_group.cpu_group,  # scheduler.py:1248-1250
        prefill_pages(spec), aux_salt=args.rank if spec.cp_split else 0,
    )  # fmt: skip
    _emit({"ready": True, "engine": _engine_report(manager), "rank_port": manager.rank_port})
    # SGLang's decodes are up before a request reaches the prefill: the driver says "go" once
    # every decode rank is, so their start-up (a minute on a loaded host) is not counted
    # against the bootstrap timeout the senders below start.
    sys.stdin.readline()

    requests = list(spec.requests)
    senders = rank.senders(requests)
    # pop_bootstrapped (prefill.py:497-551) waits for WaitingForInput (or Failed: a decode abort) ...
    polls = _poll_until(lambda: rank.poll(senders), {WAITING, FAILED}, args.timeout)
    if [p for req, p in zip(requests, polls) if req.abort != "decode" and p != WAITING]:
        raise SystemExit(f"prefill: bootstrap polls {polls}")
    results: dict[int, dict[str, Any]] = {}
    began = time.perf_counter()
    for req, sender in zip(requests, senders):
        results[req.room] = {}
        if req.abort == "prefill":
            sender.abort()  # an aborted request in the waiting queue: scheduler.py:3813, prefill.py:598-599
        elif req.abort == "":
            results[req.room] = rank.start(req, sender)  # ... then finalize_bootstrap
            rank.send(req, sender, results[req.room])
    # process_disagg_prefill_inflight_queue (prefill.py:1151-1269)
    polls = _poll_until(lambda: rank.poll(senders), {SUCCESS, FAILED}, args.timeout)
    seconds = time.perf_counter() - began
    for req, sender, state in zip(requests, senders, polls):
        results[req.room].update(_conclude(sender, state))
    _emit({"results": results, "seconds": seconds, "sessions": _sessions(manager), "legacy": _legacy(manager)})
    if spec.again:
        dropped = _dropped_by_decode(args, rank)
        _emit({"dropped": dropped, "again": _served_again(args, rank)})
    if spec.kill or spec.kill_prefill:
        _emit({"kill": _killed_mid_transfer(args, rank)})  # with kill_prefill, the driver kills this rank in it
    sys.stdin.readline()  # keep the engine and bootstrap server up until the driver is done
    del bootstrap


def _keep_shard(pools: Any, page: int, shards: int, rank: int) -> None:
    """What KV cache sharding leaves this rank: logical page l of the whole pool, for l % shards == rank,
    as its local page l // shards (``filter_kv_indices_for_shard_rank``)."""
    for buf in pools.kv:
        pages = buf.view(buf.shape[0] // page, -1)
        mine = pages[rank::shards].clone()
        pages[: mine.shape[0]] = mine


def _keep_cp_share(pools: Any, spec: Spec, rank: int) -> None:
    """Leave this CP rank right only where it sends (``Spec.cp_split``): other bytes in the KV rows of each
    request's pages outside its share (SGLang's ``_get_cp_rank_page_bounds`` over the pages after the decode
    prefix, as ``filter_kv_indices_for_cp_rank`` cuts them) and, past CP rank 0, in every state item, so a
    byte from the wrong rank shows on the decode."""
    from sglang.srt.disaggregation.utils import _get_cp_rank_page_bounds

    page, src_pages = spec.page, prefill_pages(spec)
    for req in spec.all_requests():
        suffix = src_pages[req.room][req.decode_prefix // page:]
        first, end = _get_cp_rank_page_bounds(len(suffix), rank, spec.prefill_ranks)
        for p in suffix[:first] + suffix[end:]:
            for layer, buf in enumerate(pools.kv):
                fill_random(buf[p * page:(p + 1) * page], SEED * 19 + p * 64 + layer)
    for k, tensors in enumerate(pools.state if rank else ()):
        for i, tensor in enumerate(tensors):
            if tensor is not None:
                fill_random(tensor, SEED * 23 + k * 100 + i)


def _conclude(sender: Any, state: int) -> dict[str, Any]:
    """What the inflight queue does with a finished sender (prefill.py:1160-1311)."""
    out: dict[str, Any] = {"poll": state}
    if state == FAILED:
        try:
            sender.failure_exception()  # prefill.py:1292
        except Exception as exc:  # its message is the failure reason
            out["reason"] = str(exc)
            out["failure_reason"] = getattr(exc, "failure_reason", None)
    elif state == SUCCESS:
        sender.clear()  # prefill.py:1233
        metric = sender.get_transfer_metric()  # prefill.py:1256
        out["metric_bytes"] = metric.transfer_total_bytes
    return out


def _dropped_by_decode(args: argparse.Namespace, rank: _Prefill) -> dict[str, Any]:
    """The ``DROPPED`` request: bootstrapped, never sent, until the decode deregisters (its heartbeat
    lost this prefill) and the request fails here with the reason."""
    (sender,) = senders = rank.senders([DROPPED])
    (state,) = _poll_until(lambda: rank.poll(senders), {FAILED, SUCCESS}, args.timeout)
    return _conclude(sender, state)


def _served_again(args: argparse.Namespace, rank: _Prefill) -> dict[str, Any]:
    """The ``AGAIN`` request, from a decode that forgot this prefill's ranks and registers anew."""
    (sender,) = senders = rank.senders([AGAIN])
    polls = _poll_until(lambda: rank.poll(senders), {WAITING, FAILED}, args.timeout)
    if polls != [WAITING]:
        return {"bootstrap_polls": polls, **_conclude(sender, polls[0])}
    started = rank.start(AGAIN, sender)
    rank.send(AGAIN, sender, started)
    (state,) = _poll_until(lambda: rank.poll(senders), {SUCCESS, FAILED}, args.timeout)
    return _conclude(sender, state)


def _killed_mid_transfer(args: argparse.Namespace, rank: _Prefill) -> dict[str, Any]:
    """The ``KILL`` request: its first chunk moves, the driver kills every decode rank, then
    the prefill sends the rest; the sender must turn Failed with a reason."""
    (sender,) = senders = rank.senders([KILL])
    polls = _poll_until(lambda: rank.poll(senders), {WAITING, FAILED}, args.timeout)
    if polls != [WAITING]:
        return {"bootstrap_polls": polls}
    started = rank.start(KILL, sender)
    rank.send(KILL, sender, started, upto=KILL.chunk)  # the first chunk only
    deadline = time.monotonic() + args.timeout
    while (sender.get_transfer_metric().transfer_total_bytes or 0) == 0 and time.monotonic() < deadline:
        rank.poll(senders)
        time.sleep(POLL_S)
    moved = sender.get_transfer_metric().transfer_total_bytes
    _emit({"transferring": moved, "poll": int(rank.poll(senders)[0])})
    sys.stdin.readline()  # the driver killed the decode ranks
    rank.send(KILL, sender, started)  # the rest, with the aux row and the state
    (state,) = _poll_until(lambda: rank.poll(senders), {SUCCESS, FAILED}, args.timeout)
    return {"moved_before_kill": moved, **_conclude(sender, state)}


def _send_kv_chunk(
    sender: Any, slots: Any, start: int, end: int, last: bool, state: Any, prefix: int, to_pages: Any, page: int
) -> None:
    """_send_kv_chunk (prefill.py:1528-1786): split at the sender's limit, send each segment."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_grid_segments

    if end < start:
        return  # prefill.py:1557
    limit = sender.get_max_transfer_tokens()  # prefill.py:1713
    if limit is None:
        segments = [(start, end)]
    else:
        segments = compute_grid_segments(start, end, prefix, limit)  # prefill.py:1723
    for seg_start, seg_end in segments:
        pages = to_pages(slots[seg_start:seg_end], page)  # prefill.py:1763
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
    args.tp = args.dcp  # the decode's TP: its state heads are split over it
    if not args.spec.decode_dcp:
        args.dcp = 1  # TP ranks without DCP: each rank holds every token (Spec.decode_dcp)
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        get_kv_class,
        poll_and_all_reduce,
    )
    from sglang.srt.runtime_context import get_disagg, get_parallel

    spec: Spec = args.spec
    pools = build_pools(spec.model, spec.pool_pages, args.model_dir, role="decode")
    metadata, allocator = _metadata(spec)
    manager = _manager(server_args, "decode", pools.pool, metadata, LAYERS[spec.model], pools.draft)
    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    receiver_class = get_kv_class(backend, KVClassType.RECEIVER)  # decode.py:905
    group = get_parallel().attn_tp_group.cpu_group  # gloo_group, decode.py:421 and 2545
    addr = f"127.0.0.1:{args.bootstrap_port}"
    dst_pages = decode_pages(spec, args.dcp)
    _emit({"up": args.rank})

    def prepare(requests: list[Request]) -> tuple[list[Any], list[_GatedRequest]]:
        """From receiver creation to send_metadata (decode.py:900-1877) for ``requests``."""
        receivers = [  # _create_receiver_and_enqueue, decode.py:907-911
            receiver_class(mgr=manager, bootstrap_addr=addr, bootstrap_room=req.room) for req in requests
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
        polls = _poll_until(lambda: poll_and_all_reduce(receivers, group), {WAITING, FAILED}, args.timeout)
        if polls != [WAITING] * len(requests):
            refused = {}
            for req, receiver, state in zip(requests, receivers, polls):
                if state == FAILED:
                    try:
                        receiver.failure_exception()  # _update_handshake_waiters, decode.py:1159-1164
                    except Exception as exc:  # its message is the failure reason
                        refused[req.room] = str(exc)
            _emit({"rank": args.rank, "handshake": polls, "refused": refused})
            raise SystemExit(f"decode: handshake polls {polls}")
        gated = []
        for req, receiver in zip(requests, receivers):  # pop_preallocated (decode.py:1333-1842)
            from sglang.srt.mem_cache.common import kv_to_page_indices

            slots = _token_slots(dst_pages[req.room], req.tokens, spec.page * args.dcp)
            index = allocator.alloc()  # _send_kv_metadata, decode.py:1847-1848
            # only the pages after the prefix go to the prefill (decode.py:1640-1660, 2231-2235)
            pages = kv_to_page_indices(slots[req.decode_prefix :], spec.page * args.dcp)
            # decode.py:1660-1786
            state = state_indices(pools, state_slots(spec)[req.room][1], slots, req.decode_prefix, req.tokens)
            receiver.send_metadata(pages, index, state, decode_prefix_len=req.decode_prefix)  # :1863
            gated.append(_GatedRequest(index))
        return receivers, gated

    requests = spec.mine(args.instance)
    receivers, gated = prepare(requests)
    for req, receiver in zip(requests, receivers):
        if req.abort == "decode":
            receiver.abort()  # an aborted request in the transfer queue: scheduler.py:5780
    # pop_transferred (decode.py:2833-2900): Success waits for the aux row to land.
    polls = _poll_until(
        lambda: poll_and_all_reduce(receivers, group, decode_reqs=gated, metadata_buffers=metadata),
        {SUCCESS, FAILED},
        args.timeout,
    )
    report: dict[str, Any] = {"rank": args.rank, "instance": args.instance, "polls": polls, "reasons": {}, "release_safe": {},
                              "engine": _engine_report(manager)}
    for req, receiver, state in zip(requests, receivers, polls):
        if state == FAILED:
            try:
                receiver.failure_exception()  # decode.py:2870
            except Exception as exc:  # its message is the failure reason
                report["reasons"][req.room] = str(exc)
            if manager.enable_deferred_decode_kv_release:
                report["release_safe"][req.room] = _until_release_safe(args, manager, receiver, req.room)
        elif state == SUCCESS:
            receiver.clear()  # _commit_transfer_to_req, decode.py:2774
    indices = {req.room: g.metadata_buffer_index for req, g in zip(requests, gated)}
    if spec.dump:
        _dump(f"{spec.dump}/{args.rank}-", pools, metadata)
        report["aux_index"] = indices
    else:
        report["mismatches"] = _check(args, pools, metadata, indices)
    if args.decode_backend == "pdproto":
        report["protocols"] = manager.peer_protocols()
        report["legacy_counts"] = dict(manager.legacy.counts)
        if args.prefill_backend != "pdproto":
            report["frames_as_sglang"] = _frames_as_sglang(args, manager, pools, dst_pages)
    _emit(report)
    if spec.again:
        # SGLang's heartbeat missed the prefill (common/conn.py:2060): its ranks are forgotten, and
        # a later request reaches it again (conn.py:2078), registering anew with each prefill rank.
        dropped = _dropped(args, manager, addr, prepare, lambda r, g: poll_and_all_reduce(
            r, group, decode_reqs=g, metadata_buffers=metadata), group)
        receivers, gated = prepare([AGAIN])
        (state,) = _poll_until(
            lambda: poll_and_all_reduce(receivers, group, decode_reqs=gated, metadata_buffers=metadata),
            {SUCCESS, FAILED},
            args.timeout,
        )
        again: dict[str, Any] = {"poll": state, "dropped": dropped}
        if state == FAILED:
            try:
                receivers[0].failure_exception()
            except Exception as exc:  # its message is the failure reason
                again["reason"] = str(exc)
        else:
            receivers[0].clear()
        indices[AGAIN.room] = gated[0].metadata_buffer_index
        again["mismatches"] = _check(args, pools, metadata, indices)
        _emit({"again": again})
    if spec.kill or spec.kill_prefill:
        receivers, gated = prepare([KILL])
        _emit({"submitted": KILL.room})
        sys.stdin.readline()  # the driver kills this rank here (or the prefill), mid-transfer
        _emit({"killed": _until_concluded(args, receivers[0], lambda: poll_and_all_reduce(
            receivers, group, decode_reqs=gated, metadata_buffers=metadata))})


def _dump(prefix: str, pools: Any, metadata: Any) -> None:
    """This rank's KV pool (int16 words, [layer, slot, word]) and metadata buffers (bytes per slot), as .npy
    files whose paths start with ``prefix``."""
    import numpy as np
    import torch

    np.save(f"{prefix}kv.npy", torch.stack([layer.view(torch.int16) for layer in pools.kv]).numpy())
    for k, buf in enumerate(_aux_tensors(metadata)):
        np.save(f"{prefix}aux{k}.npy", buf.view(torch.uint8).reshape(buf.shape[0], -1).numpy())


def _dropped(args: argparse.Namespace, manager: Any, addr: str, prepare: Callable[..., Any],
             poll: Callable[[Any, Any], list[Any]], group: Any) -> dict[str, Any]:
    """SGLang's heartbeat handler runs while ``DROPPED`` is in flight and the prefill is alive:
    the room fails, and once SGLang may release its pages (every prefill rank acknowledged the
    abort) the prefill must already have ended this rank's registration, so nothing more lands."""
    import torch.distributed as dist

    side = manager.decode_side
    receivers, gated = prepare([DROPPED])
    for submitted in side.peer._submits.get(DROPPED.room, {}).values():
        submitted.result(args.timeout)  # the prefill holds the request
    dist.barrier(group=group)  # ... from every decode rank
    old = [(rank.address, rank.peer_id, rank.client.credential(rank.peer_id)) for rank in side.peer.ranks]
    manager._handle_node_failure(addr)
    (state,) = _poll_until(lambda: poll(receivers, gated), {SUCCESS, FAILED}, args.timeout)
    receiver = receivers[0]
    safe = _until_release_safe(args, manager, receiver, DROPPED.room)
    out = {"poll": state, "release_safe": safe, "registrations": [_registration(*o) for o in old]}
    try:
        receiver.failure_exception()
    except Exception as exc:  # its message is the failure reason
        out["reason"] = str(exc)
    return out


def _frames_as_sglang(args: argparse.Namespace, manager: Any, pools: Any, dst_pages: dict[int, list[int]]) -> bool:
    """Whether the pdproto decode's registration and TransferInfo frames (a dummy's too) are the ones
    SGLang's own Mooncake decode builds from the same rank (mooncake/conn.py:3215-3308), byte for byte."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.mem_cache.common import kv_to_page_indices

    sglang = SimpleNamespace(
        kv_args=manager.kv_args, local_ip=manager.local_ip, rank_port=manager.rank_port,
        attn_tp_size=manager.attn_tp_size, dcp_size=manager.dcp_size, dcp_rank=manager.dcp_rank,
        enable_staging=False, get_session_id=manager.legacy_session,
    )  # fmt: skip
    same = (MooncakeKVManager.build_receiver_registration_message(sglang)
            == manager.build_receiver_registration_message())
    req = args.spec.requests[-1]
    slots = _token_slots(dst_pages[req.room], req.tokens, args.spec.page * args.dcp)
    state = state_indices(pools, state_slots(args.spec)[req.room][1], slots, req.decode_prefix, req.tokens)
    for dummy in (False, True):
        kw = dict(bootstrap_room=req.room, required_dst_info_num=args.dcp, is_dummy=dummy, aux_index=3,
                  kv_indices=kv_to_page_indices(slots[req.decode_prefix:], args.spec.page * args.dcp), state_indices=state,
                  decode_prefix_len=req.decode_prefix)
        same = same and MooncakeKVManager.build_receiver_metadata_message(sglang, **kw) == (
            manager.build_receiver_metadata_message(**kw))
    return same


def _until_concluded(args: argparse.Namespace, receiver: Any, poll: Callable[[], list[Any]]) -> dict[str, Any]:
    """The ``KILL`` request after the driver killed the prefill: how and how fast it concluded here."""
    began = time.monotonic()
    (state,) = _poll_until(poll, {SUCCESS, FAILED}, args.timeout)
    out: dict[str, Any] = {"poll": state, "seconds": round(time.monotonic() - began, 2)}
    if state == FAILED:
        try:
            receiver.failure_exception()  # decode.py:2870
        except Exception as exc:  # its message is the failure reason
            out["reason"] = str(exc)
    return out


def _until_release_safe(args: argparse.Namespace, manager: Any, receiver: Any, room: int) -> bool:
    """Whether SGLang may release a failed room's pages within the timeout: every prefill rank
    acknowledged its abort (decode.py:2894-2912 arms it for a failure the decode did not start,
    3056-3071 waits for the acknowledgements, 3027 drops the tracker)."""
    if not receiver.abort_notified:
        receiver.ensure_abort_notified(force_arm=True)
    deadline = time.monotonic() + args.timeout
    while not (safe := manager.is_abort_release_safe(room, len(receiver.bootstrap_infos))):
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    manager.clear_deferred_abort_state(room)
    return safe


def _registration(address: str, peer_id: str, credential: bytes) -> str:
    """How the prefill rank at ``address`` answers for a registration now: "registered", or the
    reason it is not (``PEER_NOT_FOUND`` once it ended)."""
    import os

    from pdproto.client import HandshakeClient
    from pdproto.errors import PdprotoError

    with HandshakeClient(address, token=os.environ.get("PDPROTO_TOKEN"), session=False) as client:
        try:
            client.describe(peer_id=peer_id, credential=credential, timeout=10)
        except PdprotoError as exc:
            return exc.reason.name
    return "registered"


def _check(args: argparse.Namespace, pools: Any, metadata: Any, indices: dict[int, int]) -> list[str]:
    """Every byte of this rank's KV pool, aux buffers and state against what it must hold."""
    import torch

    spec: Spec = args.spec
    src_pools = build_pools(spec.model, spec.pool_pages, args.model_dir, tp=1)
    fill_prefill(src_pools)
    src_pages, dst_pages = prefill_pages(spec), decode_pages(spec, args.dcp)
    # Every request the decode asked for (the ``AGAIN`` one once it has a metadata row).
    requests = [*spec.mine(args.instance), *([AGAIN] if AGAIN.room in indices else [])]
    pairs = [
        pair
        for req in requests
        if not req.abort
        for pair in expected_rows(req, src_pages[req.room], dst_pages[req.room], args.dcp, args.rank % args.dcp,
                                  whole_pages=args.prefill_backend != "pdproto", page=spec.page)
    ]
    rows_per = page_rows(spec.model)  # DeepSeek-V4: its KV tensors hold a row per page, which moves whole
    pairs = sorted({(s // rows_per, d // rows_per) for s, d in pairs})
    src_rows = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    dst_rows = torch.tensor([d for _, d in pairs], dtype=torch.int64)
    mismatches = []
    for layer, (got_layer, src_layer) in enumerate(zip(pools.kv, src_pools.kv)):
        expected = torch.zeros_like(got_layer)
        expected[dst_rows] = src_layer[src_rows]
        got = got_layer.view(torch.uint8).reshape(expected.shape[0], -1)
        want = expected.view(torch.uint8).reshape(expected.shape[0], -1)
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        if bad:
            mismatches.append(f"KV layer {layer}: {len(bad)} rows differ, first {bad[:5]}")
    src_meta, _ = _metadata()
    for req in requests:
        if not req.abort:
            _write_aux_row(src_meta, indices[req.room], req.room)
    for k, (got, want) in enumerate(zip(_aux_tensors(metadata), _aux_tensors(src_meta))):
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            mismatches.append(f"aux buffer {k} differs")
    moved = {req.room for req in requests if not req.abort}
    slots = {room: pair for room, pair in state_slots(spec).items() if room in moved}
    rows = {req.room: (_token_slots(src_pages[req.room], req.tokens, spec.page),
                       _token_slots(dst_pages[req.room], req.tokens, spec.page * args.dcp), req.decode_prefix,
                       req.tokens)
            for req in requests if not req.abort}
    return (mismatches + check_state(pools, spec.model, args.model_dir, slots, args.tp, args.rank)
            + check_index(pools, spec.pool_pages + 1, rows) + check_paged(pools, src_pools, rows, slots)
            + check_tail(pools, src_pools, rows, slots))
