"""A prefill whose attention-CP ranks each send their share of the pages, end to end: real processes,
real gRPC, a real Mooncake engine (TCP).

Two prefill CP ranks (each its own process, SGLang's ``enable_all_cp_ranks_for_transfer``) feed one
Kimi-shaped decode (KV, state and aux). As SGLang cuts a request (``filter_kv_indices_for_cp_rank``,
``_get_cp_rank_page_bounds``), CP rank 0 sends pages 0-2 and CP rank 1 pages 3-4, each chunk at its
page position, empty shares included; the last chunk of rank 0 is empty and still carries the
state and aux, which only CP rank 0 writes. The decode waits for both ranks, then compares every
KV, state and aux byte with the model. A decode that asks CP rank 0 alone is refused the request.
Under SGLang's DSA cache layer split each CP rank instead holds its own layers (KV and DSA index)
and sends every page of them, paired by layer id.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdproto_demo.decode import DecodeConfig, DecodeProcess
from pdproto_demo.model import ModelShape
from pdproto_demo.proc import Child, ChildError, close_all

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

LAYERS, PAGE_SIZE, PAGES, TOKENS, ROOM = 4, 16, 8, 72, 7
"""Five pages of a request, the last holding 8 tokens."""
SHARES = {0: [(0, [0, 1], 32, False), (2, [2], 16, False), (4, [], 0, True)],
          1: [(0, [], 0, False), (3, [3], 16, False), (4, [4], 8, True)]}
"""Per CP rank, what SGLang hands it of the chunks [0, 32), [32, 64), [64, 72): (page position,
positions of its pages, tokens, last)."""


def _spawn(tmp_path: Path, rank_args: list[list[str]], model: str = "hybrid") -> tuple[list[Child], DecodeProcess]:
    """Two demo prefill ranks (hybrid MLA, Mooncake) with ``rank_args`` each, and one TP 1 decode."""
    run = os.urandom(3).hex()
    prefills = [Child.spawn(f"prefill{r}", "pdproto_demo.prefill",
                            ["--backend", "mooncake", "--model", model, "--layers", str(LAYERS),
                             "--page-size", str(PAGE_SIZE), "--pages", str(PAGES), *a,
                             "--name", f"prefill{r}-{run}"], log_dir=str(tmp_path))
                for r, a in enumerate(rank_args)]
    decode = DecodeProcess.spawn_rank(DecodeConfig(backend="mooncake", model=model, layers=LAYERS, pages=PAGES,
                                                   page_size=PAGE_SIZE, name=f"decode-{run}"),
                                      label="decode", log_dir=str(tmp_path))
    return prefills, decode


def _connect_every_rank(prefills: list[Child], decode: DecodeProcess, partial_refusal: str) -> None:
    """A request that reaches only the first prefill rank is refused (``partial_refusal``): it would get
    part of the KV and read as SUCCESS; then the decode connects to both ranks, each feeding it."""
    addresses = [f"127.0.0.1:{int(c.recv(120)['port'])}" for c in prefills]
    decode.await_ready(120)
    decode.call("connect", 60, targets=addresses[:1])
    with pytest.raises(ChildError, match=partial_refusal):
        decode.call("request", 60, room=ROOM + 1, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=[0, 3, 6, 0, 3],
                    slot=1)
    connected = decode.call("connect", 60, targets=addresses)
    assert connected["required"] == [2, 2] and connected["dummies"] == [False, False], connected


def test_every_cp_rank_sends_its_pages_and_rank_0_alone_the_state_and_aux(tmp_path: Path) -> None:
    prefills, decode = _spawn(tmp_path, [["--cp-size", "2", "--cp-rank", str(r)] for r in (0, 1)])
    try:
        # A decode that asks CP rank 0 alone: an SGLang decode without the CP setting.
        _connect_every_rank(prefills, decode, "TOPOLOGY_PREFILL_CP_UNSUPPORTED")
        src = [3, 1, 6, 0, 5]  # the request's source pages, the same on both ranks
        for c in prefills:
            c.call("prepare", 60, room=ROOM, prefix=0, total=TOKENS, pages=src, slot=1)
        # Destination pages out of order, so a page copied to its own index or position is caught.
        decode.call("request", 60, room=ROOM, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=[4, 7, 2, 5, 1],
                    slot=1)
        for k in range(3):
            for r, c in enumerate(prefills):
                at, positions, tokens, last = SHARES[r][k]
                c.call("chunk", 60, room=ROOM, pages=[src[p] for p in positions], num_tokens=tokens, last=last,
                       slot=1, page_offset=at)
        decode.send("wait", room=ROOM, timeout=60, check=True)
        r = decode.recv(90)
        assert r["ok"], str(r)
        # Every KV row of the request once, its share from each rank; state and aux once, from rank 0.
        model = ModelShape(kind="hybrid", layers=LAYERS, page_size=PAGE_SIZE)
        assert r["bytes"] == len(model.kv_layers()) * TOKENS * model.kv_row_bytes(1), r
        assert r["aux_bytes"] == sum(model.aux_lens) and r["state_bytes"] > 0, r
        moved = [c.call("stats", 30)["moved"] for c in prefills]
        assert [m["kv_bytes"] for m in moved] == [
            len(model.kv_layers()) * n * model.kv_row_bytes(1) for n in (3 * PAGE_SIZE, TOKENS - 3 * PAGE_SIZE)], moved
        assert (moved[0]["state_bytes"], moved[0]["aux_bytes"]) == (r["state_bytes"], r["aux_bytes"]), moved
        assert (moved[1]["state_bytes"], moved[1]["aux_bytes"]) == (0, 0), moved
    finally:
        close_all([decode])
        close_all(prefills)


def test_every_layer_split_cp_rank_sends_every_page_of_its_own_layers_and_their_index(tmp_path: Path) -> None:
    # DeepSeek-V3.2-shaped: CP rank 0 holds layers 0-1, CP rank 1 layers 2-3, each with their index tensors.
    prefills, decode = _spawn(tmp_path, [["--cp-size", "2", "--cp-rank", str(r), "--layer-split"] for r in (0, 1)],
                              model="dsa")
    try:
        _connect_every_rank(prefills, decode, "TOPOLOGY_PREFILL_CP_UNSUPPORTED")
        src = [3, 1, 6, 0, 5]
        for c in prefills:
            c.call("prepare", 60, room=ROOM, prefix=0, total=TOKENS, pages=src, slot=1)
        decode.call("request", 60, room=ROOM, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=[4, 7, 2, 5, 1],
                    slot=1)
        for start, end in ((0, 32), (32, 64), (64, TOKENS)):  # SGLang skips the page filter: whole chunks
            for c in prefills:
                c.call("chunk", 60, room=ROOM, pages=src[start // PAGE_SIZE:-(-end // PAGE_SIZE)],
                       num_tokens=end - start, last=end == TOKENS, slot=1)
        decode.send("wait", room=ROOM, timeout=60, check=True)
        r = decode.recv(90)
        assert r["ok"], str(r)
        model = ModelShape(kind="dsa", layers=LAYERS, page_size=PAGE_SIZE)
        assert r["bytes"] == LAYERS * TOKENS * model.kv_row_bytes(1), r
        moved = [c.call("stats", 30)["moved"] for c in prefills]
        # Each rank every row and index page of its own two layers, nothing of the other's.
        assert [m["kv_bytes"] for m in moved] == [2 * TOKENS * model.kv_row_bytes(1)] * 2, moved
        assert moved[0]["state_bytes"] == moved[1]["state_bytes"] > 0, moved
        assert moved[0]["state_bytes"] + moved[1]["state_bytes"] == r["state_bytes"], (moved, r)
    finally:
        close_all([decode])
        close_all(prefills)


SHARDED = {0: [([0, 2], 32, False), ([4], 8, True)], 1: [([1], 16, False), ([3], 16, False), ([], 0, True)]}
"""Per TP rank of an MLA prefill with KV cache sharding (page ``l`` on rank ``l % 2``), what SGLang's
``filter_kv_indices_for_shard_rank`` hands it of the chunks [0, 48), [48, 64), [64, 72): (page
positions, tokens, last); rank 0 owns nothing of the second chunk, which SGLang skips."""


def test_every_kv_shard_tp_rank_sends_its_every_other_page_at_its_positions(tmp_path: Path) -> None:
    prefills, decode = _spawn(tmp_path, [["--tp-size", "2", "--tp-rank", str(r), "--kv-sharding"] for r in (0, 1)])
    try:
        # A decode that asks TP rank 0 alone would get half the pages.
        _connect_every_rank(prefills, decode, "INVALID_FIELD")
        # Each rank's pool holds the request at its own local pages: a page sent from the other
        # rank's ids, or to the wrong position, fails the byte check.
        local = {0: [3, 7, 1, 6, 5], 1: [6, 2, 0, 4, 7]}
        for r, c in enumerate(prefills):
            c.call("prepare", 60, room=ROOM, prefix=0, total=TOKENS, pages=local[r], slot=1)
        decode.call("request", 60, room=ROOM, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=[4, 7, 2, 5, 1],
                    slot=1)
        for r, c in enumerate(prefills):
            for positions, tokens, last in SHARDED[r]:
                c.call("chunk", 60, room=ROOM, pages=[local[r][p] for p in positions], num_tokens=tokens,
                       last=last, slot=1, page_offset=positions)
        decode.send("wait", room=ROOM, timeout=60, check=True)
        r = decode.recv(90)
        assert r["ok"], str(r)
        model = ModelShape(kind="hybrid", layers=LAYERS, page_size=PAGE_SIZE)
        assert r["bytes"] == len(model.kv_layers()) * TOKENS * model.kv_row_bytes(1), r
        moved = [c.call("stats", 30)["moved"] for c in prefills]
        # Each rank its own pages' rows only; aux from rank 0, each rank its state heads (TP 2 into TP 1).
        assert [m["kv_bytes"] for m in moved] == [
            len(model.kv_layers()) * n * model.kv_row_bytes(1) for n in (2 * PAGE_SIZE + 8, 2 * PAGE_SIZE)], moved
        assert (moved[0]["aux_bytes"], moved[1]["aux_bytes"]) == (sum(model.aux_lens), 0), moved
        assert moved[0]["state_bytes"] + moved[1]["state_bytes"] == r["state_bytes"] > 0, moved
    finally:
        close_all([decode])
        close_all(prefills)
