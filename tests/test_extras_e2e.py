"""Aux, state, fan-in and MHA heads end to end: real prefill and decode processes, real engines.

Each case starts prefill ranks (the real handshake service over a real Mooncake or NIXL
engine) and decode ranks as processes (``pdproto_demo``), runs requests through them, and
has every decode rank compare every KV, aux and state byte with a monolithic reference.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from pdproto_demo.cluster import Cluster, Geometry, Topology
from pdproto_demo.model import ModelShape
from pdproto_demo.proc import ChildError

pytestmark = [pytest.mark.process, pytest.mark.long, pytest.mark.timeout(600)]

GEO = Geometry(layers=8, page_size=16, max_tokens=512, max_prefix=64)


@contextlib.contextmanager
def cluster(backend: str, src_tp: int, dst_tp: int, *, model: str = "hybrid", replicated_bytes: int = 0,
            window_pages: int = 0, dst_dcp: int = 1, decode: dict[str, Any] | None = None,
            ) -> Iterator[tuple[Cluster, Topology]]:
    """Prefill TP ``src_tp`` (dense) feeding decode TP ``dst_tp`` (DCP ``dst_dcp``), connected."""
    c = Cluster(backend, GEO, dst_dcp=dst_dcp, src_groups=(1,), model=model, src_tp=src_tp, dst_tp=dst_tp,
                replicated_bytes=replicated_bytes, window_pages=window_pages, decode=decode,
                log_dir=tempfile.mkdtemp(prefix="pdproto-extras-"))
    try:
        c.launch()
        topo = Topology(1, dst_dcp, src_tp, dst_tp)
        c.connect(topo)
        yield c, topo
    finally:
        c.close()


def moved(c: Cluster) -> list[dict[str, Any]]:
    """Per prefill rank, what its service wrote per kind."""
    stats = []
    for child in c.prefills[1]:
        child.send("stats")
        stats.append(child.recv(30)["moved"])
    return stats


def ok(result: Any) -> None:
    assert result.ok, (result.failures, result.mismatches)
    assert result.checked > 0


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 2), (2, 4)])
def test_recurrent_state_is_sliced_by_head_and_channel_group(backend: str, src_tp: int, dst_tp: int) -> None:
    with cluster(backend, src_tp, dst_tp) as (c, _):
        for tokens in (65, 257):
            r = c.run_request(tokens, 0)
            ok(r)
            # Each decode rank got its whole state (every byte compared) and one aux slot.
            assert r.state_bytes > 0 and r.aux_bytes == dst_tp * sum(ModelShape(kind="hybrid").aux_lens)
        sent = moved(c)
        assert all(s["state_bytes"] > 0 for s in sent)


@pytest.mark.parametrize(("backend", "src_tp", "dst_tp"), [("mooncake", 4, 2), ("nixl", 2, 4)])
def test_sliding_window_pages_land_in_window_order_sliced_by_head(backend: str, src_tp: int, dst_tp: int) -> None:
    """A sliding-window entry (SGLang's swa pool) beside the recurrent one: the i-th page of the
    prefill's window lands on the i-th page the decode lists, which is another item (the decode
    lists its pages in reverse), each prefill rank writing its heads of it."""
    window = 3
    shape = ModelShape(kind="hybrid", window_pages=window)
    per_rank = sum(t.item_len * shape.entry_items(i, 1, 0) for i, e in enumerate(shape.decode_state(dst_tp))
                   for t in e.tensors)
    with cluster(backend, src_tp, dst_tp, window_pages=window) as (c, _):
        for tokens in (65, 257):
            r = c.run_request(tokens, 0)
            ok(r)
            assert r.state_bytes == dst_tp * per_rank


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_mha_kv_rows_are_sliced_by_head(backend: str, src_tp: int, dst_tp: int) -> None:
    with cluster(backend, src_tp, dst_tp, model="mha") as (c, _):
        for tokens in (63, 256):
            ok(c.run_request(tokens, 0))
        # With fan-in every prefill rank writes its heads of every row.
        assert all(s["kv_bytes"] > 0 for s in moved(c))


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_mha_fan_in_goes_packed_per_page_when_the_decode_reorders_it(backend: str) -> None:
    """Prefill TP 4 -> decode TP 2: each prefill rank writes its heads of a destination page as one block, the
    last page row by row; the decode puts the pages back in row order. The same requests with a decode that does
    not ask for it (an older one) go row by row; every byte checked both ways, decode prefixes and chunks included."""
    descriptors = {}
    for packed in (True, False):
        with cluster(backend, 4, 2, model="mha", decode={"packed_fan_in": packed}) as (c, _):
            results = [c.run_request(tokens, prefix) for tokens, prefix in ((63, 0), (256, 0), (300, 32))]
            for r in results:
                ok(r)
            descriptors[packed] = sum(r.descriptors for r in results)
    # 16-row pages: a page's block is one descriptor instead of 16, and the last page of each request stays per row.
    assert descriptors[True] * 4 < descriptors[False], descriptors


def test_state_only_peer_writes_state_and_nothing_else() -> None:
    # Hybrid MLA, prefill TP 2 -> decode TP 1, for a decode that does not let the ranks share the KV out
    # (SPLIT_KV): rank 0 sends KV, state and aux; rank 1 only state.
    with cluster("mooncake", 2, 1, decode={"split_kv": False}) as (c, _):
        replies = c.connect(Topology(1, 1, 2, 1))
        assert replies[0]["dummies"] == [False, False] and replies[0]["required"] == [2, 2]
        ok(c.run_request(257, 0))
        first, second = moved(c)
        assert first["kv_bytes"] > 0 and first["aux_bytes"] > 0 and first["state_bytes"] > 0
        assert second["kv_bytes"] == 0 and second["aux_bytes"] == 0 and second["state_bytes"] > 0


@pytest.mark.parametrize(("backend", "model"), [("mooncake", "mla"), ("nixl", "mla"), ("mooncake", "hybrid")])
def test_mla_fan_in_ranks_write_the_kv_entries_in_turn(backend: str, model: str) -> None:
    """Prefill TP 2 -> decode TP 1 for a decode that asks for SPLIT_KV: each prefill rank writes half the MLA
    entries (the hybrid's two MLA layers: one each) and no rank is a dummy; every byte checked, decode
    prefixes and chunks included. The same requests to a decode that does not ask: rank 0 writes every entry."""
    kv: dict[bool, list[int]] = {}
    for split in (True, False):
        with cluster(backend, 2, 1, model=model, decode={"split_kv": split}) as (c, _):
            replies = c.connect(Topology(1, 1, 2, 1))
            assert replies[0]["dummies"] == [False, not split and model == "mla"]
            for tokens, prefix in ((63, 0), (257, 0), (300, 32)):
                ok(c.run_request(tokens, prefix))
            kv[split] = [int(s["kv_bytes"]) for s in moved(c)]
    assert kv[True][0] == kv[True][1] > 0 and kv[False][1] == 0
    assert sum(kv[True]) == sum(kv[False])


def test_a_failing_prefill_rank_fails_the_request_with_its_reason() -> None:
    with cluster("mooncake", 2, 1) as (c, _):
        f = c.begin(257, 0)
        c.send_chunks(f, upto=1)
        failing = c.prefills[1][1]
        failing.send("abort_room", room=f.room, reason="rank 1 ran out of KV pages")
        failing.recv(30)
        failing.send("poll", room=f.room)
        assert failing.recv(30)["state"] == 5  # TRANSFER_STATE_FAILED
        c.send_chunks(f)
        r = c.finish(f)
        assert not r.ok and r.failure_codes == ["ABORTED"]
        (failure,) = r.failures
        assert "rank 1 ran out of KV pages" in failure and str(c.ports[1][1]) in failure
        # The next request on the same ranks is unaffected.
        ok(c.run_request(65, 0))


@pytest.mark.parametrize("which", ["aux", "state"])
def test_out_of_bounds_aux_index_or_state_slot_is_refused_and_nothing_is_written(which: str) -> None:
    with cluster("mooncake", 1, 1) as (c, _):
        decode = c.decodes[0]
        slots = c.slots
        bad = {"slot": 1, "aux_slot": slots + 3} if which == "aux" else {"slot": slots + 3, "aux_slot": 1}
        f = c.begin(65, 0, decodes=[])  # the prefill side of a request, no decode submitted yet
        with pytest.raises(ChildError, match="DESTINATION_OUT_OF_BOUNDS"):
            decode.call("request", 30, room=f.room, prefix=0, total=65, prefix_pages=[],
                        dst_pages=[1, 2, 3, 4, 5], **bad)
        c.send_chunks(f)
        untouched = decode.call("untouched", 60)
        assert untouched["ok"], untouched["problem"]
        ok(c.run_request(257, 0))


@pytest.mark.parametrize(("src_tp", "dst_tp", "writes"), [(2, 1, 1), (1, 2, 2), (4, 2, 2)])
def test_replicated_state_is_sent_once_per_destination(src_tp: int, dst_tp: int, writes: int) -> None:
    with cluster("mooncake", src_tp, dst_tp, replicated_bytes=96) as (c, _):
        ok(c.run_request(65, 0))
        sent = moved(c)
        assert sum(s.get("pdproto_state_items_replicated", 0) for s in sent) == writes


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 4), (4, 4)])
def test_dsa_index_pages_reach_every_dcp_rank_whole(src_tp: int, dst_tp: int) -> None:
    """DeepSeek-V3.2-shaped (MLA rows and SGLang's dsa index, paged and replicated): every rank of a DCP 4
    decode gets every index page of the request, from its one prefill rank, on the pages of its own
    index space (a DCP rank's KV page stands for 4 of them); the pages no request names keep the
    background, and go back to it when the request is released."""
    shape = ModelShape(kind="dsa", page_size=GEO.page_size)
    page = GEO.page_size * shape.index_row_bytes
    with cluster("mooncake", src_tp, dst_tp, model="dsa", dst_dcp=4) as (c, _):
        for tokens in (65, 257):
            r = c.run_request(tokens, 0)
            ok(r)
            assert r.state_bytes == 4 * -(-tokens // GEO.page_size) * GEO.layers * page
        assert sum(s["state_bytes"] for s in moved(c)) == 4 * (5 + 17) * GEO.layers * page
        for decode in c.decodes:
            untouched = decode.call("untouched", 60)
            assert untouched["ok"], untouched["problem"]
