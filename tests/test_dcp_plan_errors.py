"""Every invalid planner input raises a typed PlanError with the offending values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.dcp import plan_relayout, token_rows
from pdproto.errors import PlanError, Reason

OK = dict(page_size=4, dcp_size=2, dcp_rank=0)


def raises(reason: Reason, fn=plan_relayout, *args, **kwargs) -> PlanError:
    """Call fn and return the PlanError it must raise with exactly this reason."""
    with pytest.raises(PlanError) as info:
        fn(*args, **kwargs)
    assert info.value.reason is reason, info.value
    assert isinstance(info.value, ValueError)
    return info.value


def test_prefix_not_aligned_to_destination_virtual_page():
    err = raises(Reason.PLAN_PREFIX_NOT_ALIGNED, token_rows, [0], [0], **OK, decode_prefix_len=4)
    assert err.metadata["decode_prefix_len"] == "4" and err.metadata["virtual_page"] == "8"
    assert "4" in str(err) and "8" in str(err)


def test_prefix_not_aligned_to_source_virtual_page():
    err = raises(Reason.PLAN_PREFIX_NOT_ALIGNED, plan_relayout, [0], [0, 1], **OK, decode_prefix_len=8,
                 src_dcp_size=3, src_page_size=4)
    assert err.metadata["side"] == "source" and err.metadata["virtual_page"] == "12"


@pytest.mark.parametrize("kw", [dict(dcp_rank=2), dict(dcp_rank=-1), dict(src_dcp_rank=1),
                                dict(src_dcp_size=2, src_dcp_rank=5), dict(dcp_rank=1.0)])
def test_rank_out_of_range(kw):
    args = {**OK, **kw}
    err = raises(Reason.PLAN_RANK_OUT_OF_RANGE, plan_relayout, [0], [0], **args)
    assert "argument" in err.metadata


def test_rank_is_checked_where_sglang_wraps_it():
    # SGLang treats r=5, D=4 like r=1; we refuse it.
    raises(Reason.PLAN_RANK_OUT_OF_RANGE, token_rows, [0], [0], page_size=4, dcp_size=4, dcp_rank=5)


def test_not_enough_dst_pages():
    # 16 tokens at P=4, D=2: each rank needs 2 destination pages.
    err = raises(Reason.PLAN_NOT_ENOUGH_DST_PAGES, token_rows, [0, 1, 2, 3], [7], **OK)
    assert err.metadata["needed_pages"] == "2" and err.metadata["dst_pages"] == "1"
    # A chunk offset moves the destination further out.
    raises(Reason.PLAN_NOT_ENOUGH_DST_PAGES, token_rows, [0], [7], **OK, src_page_offset=2)
    # Draft pages hold P*D rows: the draft may need pages the target does not.
    raises(Reason.PLAN_NOT_ENOUGH_DST_PAGES, plan_relayout, [0, 1, 2], [7], page_size=4, dcp_size=2,
           dcp_rank=1, num_kv_tokens=9, include_draft=True)


def test_tokens_beyond_source():
    err = raises(Reason.PLAN_TOKENS_BEYOND_SOURCE, token_rows, [0, 1], [0, 1], **OK, num_kv_tokens=9)
    assert err.metadata["num_kv_tokens"] == "9" and err.metadata["capacity"] == "8"


@pytest.mark.parametrize("kw", [dict(src_page_offset=-1), dict(decode_prefix_len=-8), dict(num_kv_tokens=-1),
                                dict(src_page_offset=2**61), dict(num_kv_tokens="3")])
def test_bad_offset(kw):
    err = raises(Reason.PLAN_BAD_OFFSET, token_rows, [0], [0, 1], **{**OK, **kw})
    assert err.metadata


def test_empty_input():
    err = raises(Reason.PLAN_EMPTY_INPUT, token_rows, [], [0], **OK, num_kv_tokens=3)
    assert err.metadata["num_kv_tokens"] == "3"
    raises(Reason.PLAN_EMPTY_INPUT, token_rows, [0], [], **OK)


@pytest.mark.parametrize("kw", [dict(page_size=0), dict(dcp_size=0), dict(page_size=-4), dict(src_dcp_size=0),
                                dict(src_page_size=0), dict(dst_page_size=2**31), dict(page_size=True),
                                dict(page_size=4.0)])
def test_bad_size(kw):
    err = raises(Reason.PLAN_BAD_SIZE, plan_relayout, [0], [0], **{**OK, **kw})
    assert err.metadata["argument"]


@pytest.mark.parametrize("src,dst", [([0, -1], [0]), ([0], [-3]), ([0.5], [0]), ([[0]], [0]),
                                     ([2**62], [0]), (np.array([2**63], dtype=np.uint64), [0])])
def test_bad_page_index(src, dst):
    err = raises(Reason.PLAN_BAD_PAGE_INDEX, token_rows, src, dst, **OK)
    assert err.metadata["argument"] in ("src_pages", "dst_pages")


def test_negative_page_names_index_and_value():
    err = raises(Reason.PLAN_BAD_PAGE_INDEX, token_rows, [3, 4, -7], [0, 1], **OK)
    assert err.metadata["index"] == "2" and err.metadata["value"] == "-7"


small = st.integers(-3, 12)


@given(
    src=st.lists(st.integers(-2, 40), max_size=6), dst=st.lists(st.integers(-2, 40), max_size=6),
    P=small, D=small, r=small, Ps=st.one_of(st.none(), small), Ns=small, s=small,
    off=small, L0=st.integers(-8, 64), N=st.one_of(st.none(), st.integers(-3, 100)),
)
def test_arbitrary_inputs_raise_only_plan_errors(src, dst, P, D, r, Ps, Ns, s, off, L0, N):
    try:
        plan = plan_relayout(src, dst, page_size=P, dcp_size=D, dcp_rank=r, src_page_size=Ps, src_dcp_size=Ns,
                             src_dcp_rank=s, src_page_offset=off, decode_prefix_len=L0, num_kv_tokens=N,
                             include_draft=True)
    except PlanError as err:
        assert err.reason.name.startswith("PLAN_")
        return
    src_rows, dst_rows = plan.expand()
    assert src_rows.size == dst_rows.size == plan.num_rows
