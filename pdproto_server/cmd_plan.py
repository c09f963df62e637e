"""``pdproto plan``: show a DCP relayout plan (runs, descriptors per layer, bytes) per rank pair.

The page lists are synthetic: ``--pages contiguous`` numbers pages 0, 1, 2, ... and
``--pages scattered`` (default, a paged allocator's worst case) uses every other page,
so no two pages are adjacent and each destination page is its own packed descriptor.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from pdproto.dcp import RelayoutPlan, plan_relayout
from pdproto.errors import PlanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the plan subcommand's options."""
    parser.add_argument("--tokens", type=int, required=True, help="tokens in the chunk (num_kv_tokens)")
    parser.add_argument("--page-size", type=int, default=64, help="page size of both sides (default 64)")
    parser.add_argument("--src-page-size", type=int, default=None, help="source page size (default --page-size)")
    parser.add_argument("--dst-page-size", type=int, default=None,
                        help="destination page size (default --page-size)")
    parser.add_argument("--dcp", type=int, default=4, help="destination (decode) DCP size (default 4)")
    parser.add_argument("--src-dcp", type=int, default=1, help="source (prefill) DCP size (default 1: dense)")
    parser.add_argument("--dst-rank", type=int, default=None, help="only this destination rank (default all)")
    parser.add_argument("--prefix", type=int, default=0, help="decode prefix length in tokens (default 0)")
    parser.add_argument("--chunk-offset", type=int, default=0, help="chunk start in source pages (default 0)")
    parser.add_argument("--bytes-per-token", type=int, default=1152,
                        help="bytes of one token row per layer (default 1152: MLA 576 x bf16)")
    parser.add_argument("--layers", type=int, default=1, help="target layers/entries (default 1)")
    parser.add_argument("--draft-layers", type=int, default=0, help="draft entries to plan too (default 0)")
    parser.add_argument("--pages", choices=("scattered", "contiguous"), default="scattered",
                        help="synthetic page lists (default scattered: no two pages adjacent)")
    parser.add_argument("--show-runs", type=int, default=0, metavar="N", help="also print the first N runs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _pages(count: int, kind: str) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Synthetic page indexes: 0..count-1, or every other page so none are adjacent."""
    step = 1 if kind == "contiguous" else 2
    return np.arange(count, dtype=np.int64) * step


def _plans(args: argparse.Namespace) -> list[RelayoutPlan]:
    """One plan per (source rank, destination rank) pair that was asked for."""
    src_page = args.src_page_size or args.page_size
    dst_page = args.dst_page_size or args.page_size
    # Page counts are sized from the arguments; bad sizes are left for the planner to reject.
    v_src = max(src_page * args.src_dcp, 1)
    v_dst = max(dst_page * args.dcp, 1)
    n_src = max(-(-args.tokens // v_src), 0)
    n_dst = max(-(-(args.chunk_offset * v_src + args.tokens) // v_dst), 0)
    dst_ranks = range(args.dcp) if args.dst_rank is None else [args.dst_rank]
    plans = []
    for s in range(max(args.src_dcp, 1)):
        for d in dst_ranks:
            plans.append(plan_relayout(
                _pages(n_src, args.pages), _pages(n_dst, args.pages),
                page_size=args.page_size, dcp_size=args.dcp, dcp_rank=d,
                src_page_size=args.src_page_size, dst_page_size=args.dst_page_size,
                src_dcp_size=args.src_dcp, src_dcp_rank=s,
                src_page_offset=args.chunk_offset, decode_prefix_len=args.prefix,
                num_kv_tokens=args.tokens, include_draft=args.draft_layers > 0,
            ))
    return plans


def _row(plan: RelayoutPlan, args: argparse.Namespace) -> dict[str, Any]:
    """The figures for one rank pair."""
    unpacked, packed = plan.num_descriptors(packed=False), plan.num_descriptors(packed=True)
    row: dict[str, Any] = {
        "src_rank": plan.src.dcp_rank,
        "dst_rank": plan.dst.dcp_rank,
        "rows": plan.num_rows,
        "runs": int(plan.target_runs.shape[0]),
        "descriptors_per_layer_unpacked": unpacked,
        "descriptors_per_layer_packed": packed,
        "bytes": plan.num_rows * args.bytes_per_token * args.layers,
        "descriptors_unpacked": unpacked * args.layers,
        "descriptors_packed": packed * args.layers,
    }
    if args.draft_layers > 0:
        row["draft_rows"] = plan.num_draft_rows
        row["draft_descriptors_per_layer"] = plan.num_descriptors(packed=False, draft=True)
        row["draft_bytes"] = plan.num_draft_rows * args.bytes_per_token * args.draft_layers
    if args.show_runs > 0:
        row["first_runs"] = plan.target_runs[: args.show_runs].tolist()
    return row


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """A human-readable table with one line per rank pair and a total."""
    head = ["src", "dst", "rows", "runs", "desc/layer unpacked", "desc/layer packed", "MB"]
    widths = [4, 4, 9, 7, 20, 18, 10]
    if args.draft_layers > 0:
        head += ["draft rows", "draft desc/layer"]
        widths += [11, 17]
    lines = ["".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    for r in rows:
        cells = [r["src_rank"], r["dst_rank"], r["rows"], r["runs"], r["descriptors_per_layer_unpacked"],
                 r["descriptors_per_layer_packed"], f"{r['bytes'] / 1e6:.2f}"]
        if args.draft_layers > 0:
            cells += [r["draft_rows"], r["draft_descriptors_per_layer"]]
        lines.append("".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)))
        for run in r.get("first_runs", []):
            lines.append("          run src_start=%d src_stride=%d dst_start=%d dst_stride=%d count=%d" % tuple(run))
    total_rows = sum(r["rows"] for r in rows)
    lines.append(
        f"total: {total_rows} rows, {sum(r['bytes'] for r in rows) / 1e6:.2f} MB over {args.layers} layer(s); "
        f"descriptors {sum(r['descriptors_unpacked'] for r in rows)} unpacked, "
        f"{sum(r['descriptors_packed'] for r in rows)} packed"
    )
    if args.draft_layers > 0:
        lines.append(f"draft: {sum(r['draft_rows'] for r in rows)} rows, "
                     f"{sum(r['draft_bytes'] for r in rows) / 1e6:.2f} MB over {args.draft_layers} draft layer(s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan every requested rank pair and print the result; exit 2 with the reason on bad input."""
    try:
        plans = _plans(args)
    except PlanError as err:
        if args.json:
            print(json.dumps({"error": {"reason": err.reason.code, "message": err.message,
                                        "metadata": err.metadata}}))
        print(f"pdproto plan: {err}", file=sys.stderr)
        return 2
    rows = [_row(p, args) for p in plans if p.num_rows or p.num_draft_rows]
    layout = {
        "tokens": args.tokens, "src_page_size": plans[0].src.page_size if plans else args.page_size,
        "dst_page_size": plans[0].dst.page_size if plans else args.page_size,
        "src_dcp": args.src_dcp, "dst_dcp": args.dcp, "prefix": args.prefix,
        "chunk_offset": args.chunk_offset, "bytes_per_token": args.bytes_per_token,
        "layers": args.layers, "pages": args.pages,
    }
    if args.json:
        print(json.dumps({"layout": layout, "pairs": rows}, indent=1))
    else:
        print(" ".join(f"{k}={v}" for k, v in layout.items()))
        print(_table(rows, args))
    return 0
