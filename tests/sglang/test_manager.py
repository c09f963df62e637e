"""The pdproto manager and sender with SGLang 0.5.23's own objects, short of a full PD run.

* PP 2 prefill: two ranks in two processes (``tests/sglang/_prefill_group.py``) on SGLang's real
  gloo groups and ``PPConsensusStore``, polled through SGLang's ``poll_and_all_reduce_prefill_pp``
  (only PP rank 0 polls): each rank's own engine state reaches the consensus.
* IPv6: a prefill rank on ``::1`` serves its handshake service at ``[::1]:port``, and the
  address the decode builds from ``/route`` reaches it.
* A CP prefill whose every CP rank sends its share of the pages: each rank counts the tokens of
  its share as SGLang cuts it (a DSA cache layer split's CP ranks send whole chunks of their own
  layers: tests/test_sglang_layout.py, tests/test_cp_e2e.py).
* A CP-TP group sharing prefill: each CP rank publishes itself as a TP rank of a CP-1 prefill,
  to the bootstrap server and in its handshake service's ``PrefillServerInfo``.
* DeepSeek-V4 with PP 2: each decode stage's entries carry the layers SGLang's model gives the stage,
  and each prefill stage's pair with the decode entries SGLang's own PP slicing picks.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pdproto.errors import ConfigError, Reason
from pdproto.integrations.sglang import layout
from pdproto_demo.cluster import free_port
from tests.sglang._models import write_config
from tests.sglang._prefill_group import BOTH, FAILED, STAGE1_FAILS, STAGE1_REASON, WAITING
from tests.sglang._run import REPO, run_sglang
from tests.sglang._zygote import command

TIMEOUT_S = 60
"""SGLang's bootstrap timeout in the PP run: only a room nobody's state reached would see it."""


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _run_group(tmp_path: Path, model: str, *extra: str) -> tuple[list[dict[str, Any] | None], list[int], list[str]]:
    """Both ranks of ``tests/sglang/_prefill_group.py``: their JSON lines, exit codes and stderr tails."""
    env = dict(os.environ, MOONCAKE_PROTOCOL="tcp", SGLANG_HOST_IP="127.0.0.1",
               SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(TIMEOUT_S),
               SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(TIMEOUT_S),
               SGLANG_CPU_OMP_THREADS_BIND="|".join([f"0-{(os.cpu_count() or 1) - 1}"] * 2))
    common = ["--model-dir", str(write_config(model, tmp_path / model)), "--bootstrap-port", str(free_port()),
              "--dist-port", str(free_port()), *extra]
    procs = [subprocess.Popen(command("-m", "tests.sglang._prefill_group", "--rank", str(r), *common),
                              cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=(tmp_path / f"rank{r}.err").open("w"))
             for r in range(2)]
    outs: list[dict[str, Any] | None] = []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=TIMEOUT_S * 4)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else None)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    errs = [(tmp_path / f"rank{r}.err").read_text()[-3000:] for r in range(2)]
    return outs, [p.returncode for p in procs], errs


@pytest.mark.process
def test_pp2_prefill_each_ranks_engine_state_reaches_the_consensus(tmp_path: Path) -> None:
    """With PP 2 SGLang polls only PP rank 0 during bootstrap; rank 1's engine state must reach it."""
    outs, codes, errs = _run_group(tmp_path, "mla")
    assert outs[0] is not None and outs[1] is not None, errs
    for out in outs:
        assert out["first"] == [1, 1]  # Bootstrapping: no decode yet
        # BOTH: waiting for input on both ranks; STAGE1_FAILS: failed on rank 1 only.
        assert out["polls"] == [WAITING, FAILED], (out, errs)
    # Rank 1 recorded its engine's reason; rank 0 none (no bootstrap timeout fired there).
    assert STAGE1_REASON in (outs[1]["reasons"][str(STAGE1_FAILS)] or "")
    assert outs[0]["reasons"] == {str(BOTH): None, str(STAGE1_FAILS): None}
    assert codes == [0, 0], errs


@pytest.mark.process
def test_a_cp_split_hybrid_mla_prefill_rank_sends_its_share_at_its_page_positions(tmp_path: Path) -> None:
    """Kimi Linear with --attn-cp-size 2: SGLang makes every CP rank send (5 pages: rank 0 pages 0-2,
    rank 1 pages 3-4); each rank's engine gets its pages at their positions with their tokens, and
    every chunk SGLang sends, empty ones included (the last carries the aux slot)."""
    outs, codes, errs = _run_group(tmp_path, "kimi", "--cp")
    assert outs[0] is not None and outs[1] is not None, errs
    for r, out in enumerate(outs):
        assert (out["rank"], out["dummy"], out["split"]) == (r, False, True), out
        assert out["info"] == {"attn_tp": [1, 0], "attn_cp": [2, r]}, out
    assert outs[0]["chunks"] == [[0, [1, 2], 128, False, None], [2, [3], 64, False, None], [4, [], 0, True, 3]]
    assert outs[1]["chunks"] == [[0, [], 0, False, None], [3, [4], 64, False, None], [4, [5], 40, True, 3]]
    assert codes == [0, 0], errs


@pytest.mark.process
def test_a_cp_tp_sharing_prefill_rank_publishes_itself_as_tp_rank_r_of_a_cp_1_prefill(tmp_path: Path) -> None:
    """--tp-size 2 --attn-cp-size 2 with SGLang's CP-TP group sharing: both ranks send, as TP ranks 0 and 1."""
    outs, codes, errs = _run_group(tmp_path, "mla", "--cp-tp-sharing")
    assert outs[0] is not None and outs[1] is not None, errs
    for r, out in enumerate(outs):
        assert (out["rank"], out["dummy"], out["info"]) == (r, False, {"attn_tp": [2, r], "attn_cp": [1, 0]}), out
    server, rows = outs[0]["server"], outs[0]["rows"]
    assert (server["attn_tp_size"], server["attn_cp_size"]) == (2, 1), server
    assert [row["pdproto_port"] for row in rows] == [out["port"] for out in outs], rows
    assert codes == [0, 0], errs


def test_a_cp_ranks_share_of_a_chunk_counts_its_own_tokens() -> None:
    """SGLang passes the whole chunk's tokens; 13 pages of 16 over CP 2: rank 0 pages 0-6, rank 1 pages 7-12."""
    share = functools.partial(layout.cp_share_tokens, total_pages=13, page_size=16)
    # A chunk of pages 4-9 (96 tokens): 3 pages on rank 0, 3 on rank 1.
    assert [share(4, 6, 96, cp=(2, r)) for r in (0, 1)] == [48, 48]
    # The last chunk, pages 10-12 with 8 tokens on its last page: rank 0 holds none of it.
    assert [share(10, 3, 40, cp=(2, r)) for r in (0, 1)] == [0, 40]
    # Fewer pages than CP ranks: the last rank's share is empty.
    assert [layout.cp_share_tokens(0, 1, 5, total_pages=1, cp=(2, r), page_size=16) for r in (0, 1)] == [5, 0]
    # _get_cp_rank_page_bounds(10, r, 4): ranks 0 and 1 hold 3 pages, ranks 2 and 3 hold 2.
    assert [layout.cp_share_tokens(0, 10, 160, total_pages=10, cp=(4, r), page_size=16) for r in range(4)] \
        == [48, 48, 32, 32]
    for rank in (0, 1):  # the shares add up to the request
        assert sum(share(a, b - a, min(b * 16, 200) - a * 16, cp=(2, rank)) for a, b in ((0, 4), (4, 10), (10, 13))) \
            == (112 if rank == 0 else 88)


@pytest.mark.process
def test_a_kv_sharding_mla_prefill_tp_rank_sends_its_every_other_page_at_its_positions(tmp_path: Path) -> None:
    """MLA with --tp-size 2 and KV cache sharding: logical page l on TP rank l % 2 as local page l // 2.
    Pages 1-5 in chunks of pages 1-3, 4, 5: each engine gets its local pages at their positions with
    their tokens; rank 1 owns nothing of the second chunk (SGLang skips it), rank 0 nothing of the
    last (sent empty, with the aux slot); each rank publishes the sharding."""
    outs, codes, errs = _run_group(tmp_path, "mla", "--kv-shard")
    assert outs[0] is not None and outs[1] is not None, errs
    for r, out in enumerate(outs):
        assert (out["rank"], out["dummy"], out["split"], out["sharded"]) == (r, False, False, True), out
        assert out["info"] == {"attn_tp": [2, r], "attn_cp": [1, 0]}, out
    assert outs[0]["chunks"] == [[1, [1], 64, False, None], [3, [2], 64, False, None], [2, [], 0, True, 3]]
    assert outs[1]["chunks"] == [[[0, 2], [0, 1], 128, False, None], [4, [2], 40, True, 3]]
    assert codes == [0, 0], errs


@pytest.mark.process
def test_a_deepseek_v4_decode_stage_numbers_its_entries_from_the_layers_sglang_gives_it(tmp_path: Path) -> None:
    """A DeepSeek-V4 decode of --pp-size 2 (layers of ratios 0, 4, 128, 4): its KVArgs carry no layer range, so
    the manager takes the one SGLang's model builds (get_pp_indices: layers 0-1, then 2-3), and each stage's
    C4 KV and indexer, C128 KV, window and compressor rings carry their layers, as a prefill stage's do."""
    outs, codes, errs = _run_group(tmp_path, "dsv4", "--dsv4-decode")
    assert outs == [
        {"rank": 0, "kv": [[1, 37440], [1, 8448]], "state": {"swa": [0, 1, 1, 1]}},
        {"rank": 1, "kv": [[3, 37440], [3, 8448], [2, 1728]], "state": {"swa": [2, 3, 3, 3], "c128_state": [2]}},
    ], errs
    assert codes == [0, 0], errs


V4_SLICES = """
from types import SimpleNamespace
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.disaggregation.common.conn import CommonKVManager
from pdproto.integrations.sglang import layout
from tests.test_sglang_layout import DSV4_PP, _pair, _v4_pp, dsv4

decode = dsv4(ratios=DSV4_PP, base=0x20_0000)
out = []
for stage in ((0, 3), (3, 6)):
    args, ranks = _v4_pp(stage)
    decision = _pair(args, ranks, decode, layout.Ranks(attn_tp=(1, 0)))
    ours = [[decode.kv_data_ptrs[p.dst_entry] for p in decision.pairings]]
    ours += [[decode.state_data_ptrs[e.dst_entry][t.dst_tensor] for t in e.tensors] for e in decision.tp.state]
    manager = SimpleNamespace(kv_args=SimpleNamespace(prefill_start_layer=stage[0], prefill_end_layer=stage[1]))
    sglangs = [CommonKVManager._mla_slice_ptrs_for_pp(manager, src, dst, list(DSV4_PP), kind)[1] for src, dst, kind in (
        (args.kv_data_ptrs, decode.kv_data_ptrs, None),
        (args.state_data_ptrs[0], decode.state_data_ptrs[0], StateType.SWA),
        (args.state_data_ptrs[1], decode.state_data_ptrs[1], StateType.DSV4_REQUEST_STATE))]
    out.append([ours, sglangs])
print(json.dumps(out))
"""


@pytest.mark.process
def test_deepseek_v4_pp_stages_pair_as_sglangs_own_slicing_cuts_a_whole_model_decode() -> None:
    """The decode entries pdproto pairs each prefill stage's KV, swa and c128_state with (by layer id) are the
    ones SGLang's own backends cut from a PP 1 decode's lists (``_mla_slice_ptrs_for_pp``), for both stages
    of a model of ratios 0, 4, 128, 4, 128, 0."""
    for ours, sglangs in run_sglang(V4_SLICES):
        assert [len(group) for group in ours] == [3, 5, 1]
        assert ours == sglangs


def test_a_kv_shard_ranks_share_of_a_chunk_counts_its_own_tokens() -> None:
    """SGLang passes the whole chunk's tokens; only the chunk's last page may be partial."""
    share = functools.partial(layout.shard_tokens, page_size=16)
    assert [share([4, 5, 6, 7], 60, shards=(2, r)) for r in (0, 1)] == [32, 28]
    assert [share([7], 5, shards=(2, r)) for r in (0, 1)] == [0, 5]
    assert [share([], 0, shards=(2, r)) for r in (0, 1)] == [0, 0]


IPV6_PREFILL = """
import numpy as np
from types import SimpleNamespace
from pdproto.client import HandshakeClient
from pdproto.errors import ConfigError
from pdproto.integrations.sglang import layout
from pdproto_demo.cluster import free_port
from pdproto.integrations.sglang.manager import rank_address
from pdproto.integrations.sglang.prefill_side import PrefillSide
from pdproto.integrations.sglang.settings import BackendSettings

kv = [np.zeros((4 * 64, 1152), dtype=np.uint8) for _ in range(2)]
aux = [np.zeros((4, 64), dtype=np.uint8)]
kv_args = SimpleNamespace(
    kv_data_ptrs=[a.ctypes.data for a in kv], kv_data_lens=[a.nbytes for a in kv], kv_item_lens=[64 * 1152] * 2,
    kv_layer_ids=[], num_draft_entries=0, prefill_start_layer=0, page_size=64, kv_cache_dtype_str="bfloat16",
    kv_layout=None, aux_data_ptrs=[a.ctypes.data for a in aux], aux_data_lens=[a.nbytes for a in aux],
    aux_item_lens=[64], gpu_id=0, is_hybrid_mla_backend=False, state_types=[])
side = PrefillSide(kv_args, layout.Ranks(attn_tp=(1, 0)), is_mla_backend=True, settings=BackendSettings.from_env(),
                   host="::1", device="cpu", prefill_rank=0, match_timeout_s=5.0)
try:
    # What /route publishes (rank_ip, and the handshake service as pdproto_port) and the decode dials.
    address = rank_address({"rank_ip": "::1", "rank_port": 1, "pdproto_port": side.port})
    with HandshakeClient(address) as client:
        client.describe()
    try:  # an unmodified SGLang prefill's record has no pdproto_port
        rank_address({"rank_ip": "::1", "rank_port": 1})
        legacy = ""
    except ConfigError as exc:
        legacy = str(exc)
    print(json.dumps({"address": address, "port": side.port, "listen": side.service.config.listen,
                      "legacy": legacy}))
finally:
    side.close()
"""


@pytest.mark.process
@pytest.mark.skipif(not _ipv6_loopback(), reason="this host cannot bind the IPv6 loopback ::1")
def test_a_prefill_rank_on_ipv6_serves_and_the_decode_reaches_it() -> None:
    """SGLANG_HOST_IP ::1: the service binds [::1]:port (unbracketed, gRPC cannot bind it)."""
    out = run_sglang(IPV6_PREFILL, env={"MOONCAKE_PROTOCOL": "tcp"})
    assert out["listen"] == "[::1]:0"
    assert out["address"] == f"[::1]:{out['port']}"
    assert "SGLang's own transfer backend" in out["legacy"]  # a record without pdproto_port


def test_host_port_brackets_ipv6_hosts_only() -> None:
    assert layout.host_port("::1", 50051) == "[::1]:50051"
    assert layout.host_port("[fe80::1]", 7) == "[fe80::1]:7"
    assert layout.host_port("10.0.0.1", 0) == "10.0.0.1:0"
    assert layout.host_port("prefill-0.local", 9) == "prefill-0.local:9"


