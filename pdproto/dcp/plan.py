"""DCP relayout planning: which source rows go to which destination rows, as runs.

Coordinates. Every position below is a *relative global position* ``q``: the token's
global position minus the decode prefix length ``L0``. A layout (page size P, DCP size
N, rank r) holds token q on rank ``q % N`` at rank-local position ``q // N``; local
position x lives at row ``pages[x // P] * P + x % P``. Dense is N = 1. A virtual page
is ``V = P * N`` global tokens: page j of every rank of a layout covers the same V
tokens.

Source. ``src_pages`` are the source rank's pages for *this chunk*; the chunk starts at
``q = src_page_offset * Vs`` (``src_page_offset`` counts source pages, SGLang's
``index_slice.start``) and holds ``num_kv_tokens`` global tokens (default
``len(src_pages) * Vs``), of which the source rank owns those with ``q % Ns == s``.
Source page j of the list holds local positions ``(src_page_offset + j) * Ps ...``.
For a dense source this is exactly SGLang's prefill chunk.

Destination. ``dst_pages`` are the destination rank's full page list after the prefix
(SGLang does not slice it per chunk): page j holds local positions ``j*Pd .. j*Pd+Pd-1``.
``L0`` must be a multiple of both virtual pages (SGLang checks only the decode's).

Draft. The speculative-decoding draft pool is not DCP-sharded: each rank of a layout
keeps every token, in pages of V rows that reuse the target page indexes. Each
destination rank receives every chunk token; a source rank sends the draft rows of the
tokens it owns, so across source ranks each draft row is sent once per destination rank.

SGLang 0.5.23 (``build_dcp_token_transfer_plan``, dense -> DCP only, page sizes equal)
is the special case ``Ps = Pd = P, Ns = 1``; ``token_rows`` (and ``expand_draft`` of a plan
with ``include_draft``) return its index arrays exactly (plus typed errors where it raises IndexError or
silently wraps ranks).
"""

from __future__ import annotations

import dataclasses
import math

from pdproto.dcp import _checks
from pdproto.dcp import runs as _runs
from pdproto.dcp._checks import I64, PageList
from pdproto.dcp.layout import DcpLayout
from pdproto.errors import PlanError, Reason


def _readonly(runs: I64) -> I64:
    """The array, made read-only so a frozen plan cannot be edited through it."""
    runs.setflags(write=False)
    return runs


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # run arrays: no value equality
class RelayoutPlan:
    """An exact row plan for one chunk, one source rank and one destination rank, as runs."""

    target_runs: I64
    """(R, 5) int64: src_start, src_stride, dst_start, dst_stride, count (DCP-sharded target rows)."""
    draft_runs: I64
    """(R, 5) int64 runs for the unsharded draft pool; empty unless ``include_draft``."""
    num_tokens: int
    """Global tokens in the chunk (all source ranks together)."""
    src: DcpLayout
    """Source layout (dense prefill: dcp_size 1)."""
    dst: DcpLayout
    """Destination layout."""
    src_page_offset: int = 0
    """Chunk start, in source pages after the prefix."""
    decode_prefix_len: int = 0
    """Decode prefix length in global tokens."""
    include_draft: bool = False
    """Whether draft runs were planned."""

    def __repr__(self) -> str:
        """A one-line summary (run arrays can hold thousands of rows, too many for a log line)."""
        return (f"RelayoutPlan(src={self.src}, dst={self.dst}, num_tokens={self.num_tokens}, "
                f"src_page_offset={self.src_page_offset}, decode_prefix_len={self.decode_prefix_len}, "
                f"target={self.target_runs.shape[0]} runs/{self.num_rows} rows, "
                f"draft={self.draft_runs.shape[0]} runs/{self.num_draft_rows} rows)")

    @property
    def num_rows(self) -> int:
        """Target rows this plan moves (per target entry/layer)."""
        return int(self.target_runs[:, _runs.COUNT].sum())

    @property
    def num_draft_rows(self) -> int:
        """Draft rows this plan moves (per draft entry/layer)."""
        return int(self.draft_runs[:, _runs.COUNT].sum())

    def expand(self) -> tuple[I64, I64]:
        """Target (src_rows, dst_rows) per token, in token order; equals ``token_rows`` for dense -> DCP."""
        return _runs.expand(self.target_runs)

    def expand_draft(self) -> tuple[I64, I64]:
        """Draft (src_rows, dst_rows) per token, in token order (dst pages hold P*D rows), as SGLang computes them."""
        return _runs.expand(self.draft_runs)

    def num_descriptors(self, packed: bool, *, draft: bool = False) -> int:
        """Transfer descriptors per layer: maximal runs contiguous on both sides (packed: on the destination)."""
        runs = self.draft_runs if draft else self.target_runs
        # Packing gathers the source rows, in token order, into positions 0..n-1.
        return _runs.count_segments(_runs.pack_source(runs) if packed else runs)


def _crt_first(src: DcpLayout, dst: DcpLayout, start: int) -> tuple[int, int] | None:
    """(first q >= start owned by both ranks, step lcm(Ns, Nd)), or None when the ranks share no token."""
    ns, nd = src.dcp_size, dst.dcp_size
    g = math.gcd(ns, nd)
    if (dst.dcp_rank - src.dcp_rank) % g:
        return None
    step = ns // g * nd
    # q = s + ns*t with ns*t = d - s (mod nd): divide by g, then invert ns/g modulo nd/g.
    t = ((dst.dcp_rank - src.dcp_rank) // g * pow(ns // g, -1, nd // g)) % (nd // g)
    residue = (src.dcp_rank + ns * t) % step
    return start + (residue - start) % step, step


def _count(first: int, step: int, end: int) -> int:
    """Members of first, first+step, ... below end."""
    return max(0, -((first - end) // step))


def _check_dst_capacity(what: str, last_local: int, page_size: int, dst_pages: I64, rank: int) -> None:
    """Raise unless local position last_local has a destination page."""
    need = last_local // page_size + 1
    if need <= dst_pages.size:
        return
    reason = Reason.PLAN_EMPTY_INPUT if dst_pages.size == 0 else Reason.PLAN_NOT_ENOUGH_DST_PAGES
    raise PlanError(
        f"{what} rows of destination rank {rank} need {need} destination pages, got {dst_pages.size}",
        reason=reason,
        metadata={"entries": what, "needed_pages": need, "dst_pages": dst_pages.size, "dst_rank": rank},
    )


def _checked(side: str, layout: DcpLayout) -> DcpLayout:
    """The layout with every field checked (PLAN_BAD_SIZE, PLAN_RANK_OUT_OF_RANGE naming ``side``)."""
    page = _checks.size(f"{side}_page_size", layout.page_size)
    size = _checks.size(f"{side}_dcp_size", layout.dcp_size)
    return DcpLayout(page, size, _checks.rank(f"{side}_dcp_rank", layout.dcp_rank, size))


def plan_chunk(
    src: DcpLayout,
    dst: DcpLayout,
    src_pages: PageList,
    dst_pages: PageList,
    *,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: int | None = None,
    include_draft: bool = False,
) -> RelayoutPlan:
    """Plan one chunk from a source layout's rank to a destination layout's rank as runs (module docstring).

    Args:
        src: the source rank's layout (a dense prefill: ``DcpLayout(page_size)``).
        dst: the destination rank's layout.
        src_pages: the source rank's pages of this chunk.
        dst_pages: the destination rank's full page list after the prefix.
        src_page_offset: chunk start in source pages after the prefix.
        decode_prefix_len: prefix length in global tokens; a multiple of both virtual pages.
        num_kv_tokens: global tokens in the chunk; default ``len(src_pages) * Ps * Ns``.
        include_draft: also plan the unsharded draft pool.

    Raises:
        PlanError: with a PLAN_* reason and the offending values in ``metadata``.
    """
    src, dst = _checked("src", src), _checked("dst", dst)
    offset = _checks.offset("src_page_offset", src_page_offset)
    prefix = _checks.offset("decode_prefix_len", decode_prefix_len)
    # Draft pages hold a whole virtual page, so that bounds the row indexes.
    src_arr = _checks.pages("src_pages", src_pages, src.virtual_page)
    dst_arr = _checks.pages("dst_pages", dst_pages, dst.virtual_page)

    for side, layout in (("destination", dst), ("source", src)):
        if prefix % layout.virtual_page:
            raise PlanError(
                f"decode_prefix_len={prefix} is not a multiple of the {side} virtual page "
                f"{layout.page_size}*{layout.dcp_size}={layout.virtual_page}",
                reason=Reason.PLAN_PREFIX_NOT_ALIGNED,
                metadata={"decode_prefix_len": prefix, "side": side, "virtual_page": layout.virtual_page},
            )

    capacity = src_arr.size * src.virtual_page
    if num_kv_tokens is None:
        tokens = capacity
    else:
        tokens = _checks.offset("num_kv_tokens", num_kv_tokens)
        if tokens > 0 and src_arr.size == 0:
            raise PlanError(f"num_kv_tokens={tokens} but src_pages is empty", reason=Reason.PLAN_EMPTY_INPUT,
                            metadata={"num_kv_tokens": tokens, "src_pages": 0})
        if tokens > capacity:
            raise PlanError(
                f"num_kv_tokens={tokens} exceeds the {src_arr.size} source pages "
                f"({capacity} tokens at {src.page_size}*{src.dcp_size} per page)",
                reason=Reason.PLAN_TOKENS_BEYOND_SOURCE,
                metadata={"num_kv_tokens": tokens, "src_pages": src_arr.size, "capacity": capacity},
            )
    start = offset * src.virtual_page
    end = start + tokens
    if end > _checks.MAX_ROW:
        raise PlanError(f"chunk end {end} (src_page_offset={offset}) is too large", reason=Reason.PLAN_BAD_OFFSET,
                        metadata={"src_page_offset": offset, "num_kv_tokens": tokens})

    target = _runs.empty_runs()
    shared = _crt_first(src, dst, start)
    if shared is not None:
        first, step = shared
        count = _count(first, step, end)
        if count:
            _check_dst_capacity("target", (first + (count - 1) * step) // dst.dcp_size,
                                dst.page_size, dst_arr, dst.dcp_rank)
            target = _runs.progression_runs(
                count,
                first // src.dcp_size - offset * src.page_size, step // src.dcp_size, src_arr, src.page_size,
                first // dst.dcp_size, step // dst.dcp_size, dst_arr, dst.page_size,
            )

    draft = _runs.empty_runs()
    if include_draft:
        # start is a multiple of Ns, so the source rank's first token is start + s.
        first = start + src.dcp_rank
        count = _count(first, src.dcp_size, end)
        if count:
            _check_dst_capacity("draft", first + (count - 1) * src.dcp_size, dst.virtual_page,
                                dst_arr, dst.dcp_rank)
            draft = _runs.progression_runs(
                count,
                first - start, src.dcp_size, src_arr, src.virtual_page,
                first, src.dcp_size, dst_arr, dst.virtual_page,
            )

    return RelayoutPlan(
        target_runs=_readonly(target),
        draft_runs=_readonly(draft),
        num_tokens=tokens,
        src=src,
        dst=dst,
        src_page_offset=offset,
        decode_prefix_len=prefix,
        include_draft=include_draft,
    )


def plan_relayout(
    src_pages: PageList,
    dst_pages: PageList,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: int | None = None,
    src_page_size: int | None = None,
    src_dcp_size: int = 1,
    src_dcp_rank: int = 0,
    dst_page_size: int | None = None,
    include_draft: bool = False,
) -> RelayoutPlan:
    """``plan_chunk`` with the layouts spelled as keywords (the documented API; defaults: dense -> DCP).

    The other arguments, and the PlanError raised, are ``plan_chunk``'s.

    Args:
        page_size: page size in tokens of both sides unless overridden below.
        dcp_size: destination DCP group size.
        dcp_rank: destination DCP rank.
        src_page_size: source page size (default ``page_size``).
        src_dcp_size: source DCP group size (default 1: dense).
        src_dcp_rank: source DCP rank.
        dst_page_size: destination page size (default ``page_size``).
    """
    base = _checks.size("page_size", page_size)
    return plan_chunk(
        DcpLayout(base if src_page_size is None else src_page_size, src_dcp_size, src_dcp_rank),
        DcpLayout(base if dst_page_size is None else dst_page_size, dcp_size, dcp_rank),
        src_pages, dst_pages, src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len,
        num_kv_tokens=num_kv_tokens, include_draft=include_draft,
    )


def token_rows(
    src_pages: PageList,
    dst_pages: PageList,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: int | None = None,
) -> tuple[I64, I64]:
    """Dense -> DCP target (src_rows, dst_rows), int64, exactly as SGLang 0.5.23 computes them."""
    return plan_relayout(
        src_pages, dst_pages, page_size=page_size, dcp_size=dcp_size, dcp_rank=dcp_rank,
        src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len, num_kv_tokens=num_kv_tokens,
    ).expand()
