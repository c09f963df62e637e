"""Properties of the DCP relayout planner against direct per-token references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.dcp import DcpLayout, plan_relayout, runs, token_rows

from ._per_token import reference

I64 = np.int64


def sglang_plan(src_pages, dst_pages, P, D, r, s=0, L0=0, N=None):
    """A literal numpy transcription of SGLang 0.5.23 build_dcp_token_transfer_plan (inventory 4.4)."""
    src_pages = np.asarray(src_pages, dtype=np.int64)
    dst_pages = np.asarray(dst_pages, dtype=np.int64)
    V = P * D
    assert L0 % V == 0
    N = N if N is not None else len(src_pages) * P
    if N == 0:
        e = np.zeros(0, dtype=np.int64)
        return (e, e), (e, e)
    C = L0 + s * P
    o_t = np.arange((r - C) % D, N, D)
    loc = (s * P + o_t) // D
    t_src = src_pages[o_t // P] * P + o_t % P
    t_dst = dst_pages[loc // P] * P + loc % P
    o_d = np.arange(N)
    loc_d = s * P + o_d
    d_src = src_pages[o_d // P] * P + o_d % P
    d_dst = dst_pages[loc_d // V] * V + loc_d % V
    return (t_src, t_dst), (d_src, d_dst)


def count_descriptors(src, dst, packed):
    """Descriptors counted from expanded rows, the group_concurrent_contiguous way."""
    if src.size == 0:
        return 0
    breaks = np.diff(dst) != 1
    if not packed:
        breaks |= np.diff(src) != 1
    return 1 + int(breaks.sum())


def scatter(draw, n, spread):
    """n distinct page indexes drawn from a small range so that some are adjacent."""
    return draw(st.lists(st.integers(0, n * spread + 3), min_size=n, max_size=n, unique=True))


@st.composite
def layouts(draw):
    """Random source/destination layouts, chunk offset, prefix, tokens and page lists with enough pages."""
    Ps, Pd = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    Ns, Nd = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    Vs, Vd = Ps * Ns, Pd * Nd
    off = draw(st.integers(0, 4))
    prefix = draw(st.integers(0, 2)) * math.lcm(Vs, Vd)
    n_src = draw(st.integers(0, 10))
    N = draw(st.integers(0, n_src * Vs))
    src_pages = scatter(draw, n_src, draw(st.integers(1, 3)))
    n_dst = -(-(off * Vs + N) // Vd) + draw(st.integers(0, 2))
    dst_pages = scatter(draw, n_dst, draw(st.integers(1, 3)))
    return dict(Ps=Ps, Ns=Ns, Pd=Pd, Nd=Nd, off=off, prefix=prefix, N=N,
                src_pages=src_pages, dst_pages=dst_pages)


def plan_for(lay, s, d, **kw):
    """plan_relayout for one drawn layout and one (source rank, destination rank) pair, draft included."""
    return plan_relayout(
        lay["src_pages"], lay["dst_pages"], page_size=lay["Pd"], dcp_size=lay["Nd"], dcp_rank=d,
        src_page_offset=lay["off"], decode_prefix_len=lay["prefix"], num_kv_tokens=lay["N"],
        src_page_size=lay["Ps"], src_dcp_size=lay["Ns"], src_dcp_rank=s, include_draft=True, **kw,
    )


@given(layouts(), st.data())
def test_expand_equals_per_token_reference(lay, data):
    s = data.draw(st.integers(0, lay["Ns"] - 1))
    d = data.draw(st.integers(0, lay["Nd"] - 1))
    plan = plan_for(lay, s, d)
    t_src, t_dst, d_src, d_dst = reference(
        lay["src_pages"], lay["dst_pages"], Ps=lay["Ps"], Ns=lay["Ns"], s=s,
        Pd=lay["Pd"], Nd=lay["Nd"], d=d, off=lay["off"], N=lay["N"])
    src, dst = plan.expand()
    assert src.dtype == dst.dtype == np.int64
    np.testing.assert_array_equal(src, t_src)
    np.testing.assert_array_equal(dst, t_dst)
    dsrc, ddst = plan.expand_draft()
    np.testing.assert_array_equal(dsrc, d_src)
    np.testing.assert_array_equal(ddst, d_dst)
    assert plan.num_rows == t_src.size and plan.num_draft_rows == d_src.size
    # Runs break only at page boundaries: never more runs than pages touched on both sides.
    assert plan.target_runs.shape[0] <= len(lay["src_pages"]) + len(lay["dst_pages"])


@given(layouts(), st.data())
def test_descriptors_and_segments_match_expanded_rows(lay, data):
    plan = plan_for(lay, data.draw(st.integers(0, lay["Ns"] - 1)), data.draw(st.integers(0, lay["Nd"] - 1)))
    for draft in (False, True):
        src, dst = plan.expand_draft() if draft else plan.expand()
        for packed in (False, True):
            expected = count_descriptors(src, dst, packed)
            assert plan.num_descriptors(packed, draft=draft) == expected
            rr = plan.draft_runs if draft else plan.target_runs
            seg = runs.segments(runs.pack_source(rr) if packed else rr)
            assert seg.shape == (expected, 3)
            rows = np.arange(seg[:, 2].sum()) - np.repeat(np.cumsum(seg[:, 2]) - seg[:, 2], seg[:, 2])
            seg_src = np.repeat(seg[:, 0], seg[:, 2]) + rows
            seg_dst = np.repeat(seg[:, 1], seg[:, 2]) + rows
            np.testing.assert_array_equal(seg_src, np.arange(src.size) if packed else src)
            np.testing.assert_array_equal(seg_dst, dst)


@given(layouts())
def test_every_source_token_sent_once_and_no_destination_row_twice(lay):
    Ns, Nd, start, N = lay["Ns"], lay["Nd"], lay["off"] * lay["Ps"] * lay["Ns"], lay["N"]
    plans = {(s, d): plan_for(lay, s, d) for s in range(Ns) for d in range(Nd)}
    for s in range(Ns):
        sent = np.concatenate([plans[s, d].expand()[0] for d in range(Nd)])
        owned = sum(1 for q in range(start, start + N) if q % Ns == s)
        assert sent.size == owned and np.unique(sent).size == owned
    for d in range(Nd):
        written = np.concatenate([plans[s, d].expand()[1] for s in range(Ns)])
        owned = sum(1 for q in range(start, start + N) if q % Nd == d)
        assert written.size == owned and np.unique(written).size == owned
        drafted = np.concatenate([plans[s, d].expand_draft()[1] for s in range(Ns)])
        assert drafted.size == N and np.unique(drafted).size == N
    for (s, d), plan in plans.items():
        # Ranks share tokens iff they agree modulo gcd(Ns, Nd).
        if (s - d) % math.gcd(Ns, Nd):
            assert plan.num_rows == 0


@given(layouts(), st.data())
def test_plan_carries_its_layouts_and_cannot_be_edited(lay, data):
    plan = plan_for(lay, data.draw(st.integers(0, lay["Ns"] - 1)), data.draw(st.integers(0, lay["Nd"] - 1)))
    assert plan.src == DcpLayout(lay["Ps"], lay["Ns"], plan.src.dcp_rank)
    assert not plan.target_runs.flags.writeable and not plan.draft_runs.flags.writeable


@given(
    P=st.integers(1, 8), D=st.integers(1, 6), data=st.data(),
)
def test_dense_to_dcp_matches_sglang_formula(P, D, data):
    r = data.draw(st.integers(0, D - 1))
    s = data.draw(st.integers(0, 5))
    L0 = data.draw(st.integers(0, 3)) * P * D
    n_src = data.draw(st.integers(0, 8))
    N = data.draw(st.one_of(st.none(), st.integers(0, n_src * P)))
    src_pages = data.draw(st.permutations(range(n_src + 4)))[:n_src]
    n_dst = -(-((s + n_src) * P) // (P * D)) + 1
    dst_pages = data.draw(st.permutations(range(2 * n_dst)))[:n_dst]
    kw = dict(page_size=P, dcp_size=D, dcp_rank=r, src_page_offset=s, decode_prefix_len=L0, num_kv_tokens=N)
    (t_src, t_dst), (d_src, d_dst) = sglang_plan(src_pages, dst_pages, P, D, r, s, L0, N)
    src, dst = token_rows(src_pages, dst_pages, **kw)
    np.testing.assert_array_equal(src, t_src)
    np.testing.assert_array_equal(dst, t_dst)
    dsrc, ddst = plan_relayout(src_pages, dst_pages, **kw, include_draft=True).expand_draft()
    np.testing.assert_array_equal(dsrc, d_src)
    np.testing.assert_array_equal(ddst, d_dst)
    np.testing.assert_array_equal(plan_relayout(src_pages, dst_pages, **kw).expand()[0], t_src)


@pytest.mark.parametrize("tokens", [63, 64, 65, 255, 256, 257, 8191, 8192, 8193])
@pytest.mark.parametrize("rank", range(4))
def test_sglang_prompts_page64_dcp4(tokens, rank):
    P, D = 64, 4
    rng = np.random.default_rng(tokens * 10 + rank)
    n_src = -(-tokens // P)
    src_pages = rng.permutation(4 * n_src)[:n_src]
    n_dst = -(-tokens // (P * D))
    dst_pages = rng.permutation(4 * n_dst)[:n_dst]
    for kw in (dict(num_kv_tokens=tokens), dict(num_kv_tokens=tokens, decode_prefix_len=2 * P * D)):
        (t_src, t_dst), _ = sglang_plan(src_pages, dst_pages, P, D, rank, 0, kw.get("decode_prefix_len", 0), tokens)
        src, dst = token_rows(src_pages, dst_pages, page_size=P, dcp_size=D, dcp_rank=rank, **kw)
        np.testing.assert_array_equal(src, t_src)
        np.testing.assert_array_equal(dst, t_dst)
    # The same prompt sent in chunks of 3 prefill pages gives the same rows in total.
    chunks_src, chunks_dst = [], []
    for first in range(0, n_src, 3):
        pages = src_pages[first:first + 3]
        n = min(tokens - first * P, len(pages) * P)
        (c_src, c_dst), _ = sglang_plan(pages, dst_pages, P, D, rank, first, 0, n)
        src, dst = token_rows(pages, dst_pages, page_size=P, dcp_size=D, dcp_rank=rank,
                              src_page_offset=first, num_kv_tokens=n)
        np.testing.assert_array_equal(src, c_src)
        np.testing.assert_array_equal(dst, c_dst)
        chunks_src.append(src)
        chunks_dst.append(dst)
    (t_src, t_dst), _ = sglang_plan(src_pages, dst_pages, P, D, rank, 0, 0, tokens)
    np.testing.assert_array_equal(np.concatenate(chunks_src), t_src)
    np.testing.assert_array_equal(np.concatenate(chunks_dst), t_dst)


def test_inventory_worked_example_and_descriptor_counts():
    # Inventory 4.4: P=4, D=2, chunk 0 of 16 tokens, rank 0.
    plan = plan_relayout([10, 11, 12, 13], [5, 6], page_size=4, dcp_size=2, dcp_rank=0)
    src, dst = plan.expand()
    assert src.tolist() == list(range(40, 56, 2)) and dst.tolist() == list(range(20, 28))
    # Inventory 4.10: 64 tokens, P=4, D=4: 16 runs unpacked; packed 4 on scattered pages, 1 on consecutive.
    scattered = plan_relayout(np.arange(16) * 3, [0, 2, 4, 6], page_size=4, dcp_size=4, dcp_rank=1)
    assert scattered.num_descriptors(packed=False) == 16 and scattered.num_descriptors(packed=True) == 4
    consecutive = plan_relayout(np.arange(16), [7, 8, 9, 10], page_size=4, dcp_size=4, dcp_rank=1)
    assert consecutive.num_descriptors(packed=True) == 1


def test_empty_chunk_gives_empty_plan():
    plan = plan_relayout([], [], page_size=64, dcp_size=4, dcp_rank=3, include_draft=True)
    assert plan.num_rows == plan.num_draft_rows == 0 and plan.num_descriptors(True) == 0
    assert plan.target_runs.shape == (0, 5) and runs.segments(plan.target_runs).shape == (0, 3)
    assert "0 runs/0 rows" in repr(plan)
    src, dst = token_rows([1, 2], [], page_size=64, dcp_size=4, dcp_rank=3, num_kv_tokens=0)
    assert src.size == dst.size == 0 and src.dtype == np.int64


def test_zero_row_rank_still_gets_draft():
    # Fewer tokens than ranks: rank 3 owns no target row but every draft row (inventory 4.8).
    plan = plan_relayout([5], [9], page_size=64, dcp_size=4, dcp_rank=3, num_kv_tokens=2, include_draft=True)
    assert plan.num_rows == 0 and plan.num_draft_rows == 2


def test_n_to_m_and_same_layout():
    # DCP 2 -> DCP 4 (not supported by SGLang): source rank 1 feeds only odd destination ranks.
    for d in range(4):
        plan = plan_relayout(np.arange(4), np.arange(4), page_size=4, dcp_size=4, dcp_rank=d, src_dcp_size=2,
                             src_dcp_rank=1)
        assert plan.num_rows == (8 if d % 2 else 0)
    # Same layout: the identity on a consecutive page list is one descriptor per layer.
    same = plan_relayout(np.arange(8), np.arange(8), page_size=16, dcp_size=4, dcp_rank=2, src_dcp_size=4,
                         src_dcp_rank=2)
    assert same.num_descriptors(packed=False) == 1 and same.num_rows == 8 * 16
