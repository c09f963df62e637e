"""``pdproto demo``: real prefill and decode processes, real engines, every byte checked (``pdproto_demo/README.md``).

Per backend and model one cluster of ranks on 127.0.0.1 serves every topology of that model; each prompt
goes in several chunks (with a decode prefix on long ones), and each decode rank compares its whole KV pool,
aux and state slots with what a monolithic run would hold. One table row per (backend, topology, prompt):
the median of `--repeat` requests of it, each one checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdproto import backends
from pdproto.negotiation.reach import ADVERTISE_ENV

from .cluster import Cluster, Geometry, RequestResult, Topology
from .proc import ChildError

PROMPTS = (63, 64, 65, 255, 256, 257, 8191, 8192, 8193, 32768)


@dataclass(frozen=True)
class Case:
    """One demo topology and the model its ranks serve."""

    topology: Topology
    model: str = "mla"


TOPOLOGIES = {"dense-dcp4": Case(Topology(1, 4)), "dcp2-dcp4": Case(Topology(2, 4)),
              "kimi-tp4-dcp4": Case(Topology(1, 4, src_tp=4, dst_tp=4), "hybrid")}


def prefix_for(tokens: int) -> int:
    """Decode prefix (cache hit) of a prompt: none on short prompts, virtual-page aligned on long ones."""
    if tokens >= 16384:
        return 1024
    if tokens >= 1024:
        return 256
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options."""
    parser.add_argument("--backend", default="all", choices=["all", *backends.NAMES],
                        help=f"transfer backend; all = {' then '.join(backends.MULTI_HOST)} (default)")
    parser.add_argument("--prompts", default=",".join(map(str, PROMPTS)),
                        help="comma-separated prompt lengths in tokens")
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES),
                        help=f"comma-separated subset of {', '.join(TOPOLOGIES)}")
    parser.add_argument("--layers", type=int, default=8,
                        help="model layers (MLA rows of 1152 bytes; the Kimi case has one MLA layer in four)")
    parser.add_argument("--page-size", type=int, default=64, help="page size in tokens")
    parser.add_argument("--kda-heads", type=int, default=32, help="Kimi case: KDA heads before TP")
    parser.add_argument("--kda-head-dim", type=int, default=128,
                        help="Kimi case: KDA head dimension (a temporal state is heads x dim x dim fp32)")
    parser.add_argument("--repeat", type=_positive, default=3,
                        help="requests per row, each one checked; the row shows their median time and the slowest")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline per request in seconds")
    parser.add_argument("--corrupt-one-byte", action="store_true", help=argparse.SUPPRESS)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _progress(label: str) -> Callable[[int, int], None]:
    tty = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        # On a terminal the line is rewritten in place; in logs only long requests get one.
        if tty and total > 1:
            end = "\r" if done < total else "\n"
            print(f"  {label}: chunk {done}/{total}", end=end, file=sys.stderr, flush=True)
        elif total >= 8 and done in (1, total // 2, total):
            print(f"  {label}: chunk {done}/{total}", file=sys.stderr, flush=True)
    return show


def _median_row(runs: list[RequestResult]) -> tuple[RequestResult, float]:
    """One table row from a prompt's requests: the median one (failed if any failed) and the slowest time.

    A single request of a tenth of a second moves by a factor of two on a loaded host, so one
    sample per row would not say how time grows with tokens.
    """
    ordered = sorted(runs, key=lambda r: r.seconds)
    row = dataclasses.replace(ordered[(len(ordered) - 1) // 2], ok=all(r.ok for r in runs),
                              failures=[f for r in runs for f in r.failures],
                              mismatches=[m for r in runs for m in r.mismatches])
    return row, ordered[-1].seconds


def _row(backend: str, topo: str, r: RequestResult, slowest: float) -> str:
    total = r.bytes + r.aux_bytes + r.state_bytes
    gbs = total / r.seconds / 1e9 if r.seconds > 0 else 0.0
    verdict = "ok" if r.ok else "FAIL"
    return (f"{backend:<9}{topo:<14}{r.tokens:>7}{r.prefix:>7}{r.chunks:>7}{r.bytes:>13,}{r.aux_bytes:>7,}"
            f"{r.state_bytes:>12,}{r.descriptors:>7}{r.aux_descriptors:>6}{r.state_descriptors:>6}"
            f"{r.seconds:>9.3f}{slowest:>8.3f}{gbs:>8.2f}{r.checked:>14,}  {verdict}")


HEADER = (f"{'backend':<9}{'topology':<14}{'tokens':>7}{'prefix':>7}{'chunks':>7}{'KV bytes':>13}{'aux':>7}"
          f"{'state':>12}{'d.KV':>7}{'d.aux':>6}{'d.st':>6}{'seconds':>9}{'max s':>8}{'GB/s':>8}{'verified':>14}"
          "  result")


def _run_cluster(backend: str, args: argparse.Namespace, prompts: list[int], topos: list[str],
                 model: str) -> list[str]:
    """Start the processes the topologies of one model need, then run every prompt over each."""
    longest = max(prompts)
    geo = Geometry(layers=args.layers, page_size=args.page_size, max_tokens=longest, max_prefix=prefix_for(longest))
    cases = [TOPOLOGIES[t].topology for t in topos]
    groups = sorted({c.src_dcp for c in cases})
    src_tp, dst_tp = max(c.src_tp for c in cases), max(c.dst_tp for c in cases)
    cluster = Cluster(backend, geo, dst_dcp=4, src_groups=groups, log_dir=args.log_dir, model=model,
                      src_tp=src_tp, dst_tp=dst_tp, kda_heads=args.kda_heads, kda_head_dim=args.kda_head_dim)
    failures: list[str] = []
    corrupt = args.corrupt_one_byte
    try:
        print(f"starting {backend} ({model}): {sum(groups) * src_tp} prefill and {max(4, dst_tp)} decode"
              " processes", file=sys.stderr, flush=True)
        cluster.launch()
        for tname in topos:
            cluster.connect(TOPOLOGIES[tname].topology)
            # One untimed request of the longest prompt first: one-time costs (engine connections, torch
            # on a prefill's first gather of 1 MiB: seconds of CPU) land there, not on a table row.
            warm = cluster.run_request(longest, prefix_for(longest), timeout=args.timeout)
            print(f"  {backend} {tname}: warm-up request {'ok' if warm.ok else 'FAILED'} in "
                  f"{warm.seconds:.2f} s", file=sys.stderr, flush=True)
            if not warm.ok:
                failures.append(f"{backend} {tname} warm-up: {warm.failures or warm.mismatches}")
            for i, tokens in enumerate(prompts):
                label = f"{backend} {tname} {tokens} tokens ({i + 1}/{len(prompts)})"
                print(f"  {label}", file=sys.stderr, flush=True)
                runs = []
                for _ in range(args.repeat):
                    runs.append(cluster.run_request(tokens, prefix_for(tokens), corrupt=corrupt,
                                                    timeout=args.timeout, progress=_progress(label)))
                    corrupt = False
                res, slowest = _median_row(runs)
                print(_row(backend, tname, res, slowest), flush=True)
                if not res.ok:
                    failures.append(f"{backend} {tname} {tokens}: {res.failures or res.mismatches}")
    except ChildError as exc:
        failures.append(f"{backend}: {exc}")
    finally:
        cluster.close()
    return failures


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every byte of every case matched."""
    names = list(backends.MULTI_HOST) if args.backend == "all" else [args.backend]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    topos = [t for t in args.topologies.split(",") if t]
    unknown = [t for t in topos if t not in TOPOLOGIES]
    if unknown:
        print(f"unknown topology {unknown}; choose from {list(TOPOLOGIES)}", file=sys.stderr)
        return 2
    # Every rank runs on this host: engines advertise loopback, so no byte leaves it (a decode
    # started here would otherwise advertise this host's routable address).
    os.environ.setdefault(ADVERTISE_ENV, "127.0.0.1")
    t0 = time.monotonic()
    args.log_dir = tempfile.mkdtemp(prefix="pdproto-demo-")
    print(f"process logs: {args.log_dir}", file=sys.stderr)
    print(HEADER, flush=True)
    failures: list[str] = []
    for backend in names:
        # One cluster per model (its ranks serve every topology of that model).
        for model in dict.fromkeys(TOPOLOGIES[t].model for t in topos):
            failures += _run_cluster(backend, args, prompts, [t for t in topos if TOPOLOGIES[t].model == model],
                                     model)
    elapsed = time.monotonic() - t0
    if failures:
        for f in failures:
            print(f"MISMATCH {f}", file=sys.stderr)
        print(f"FAIL ({len(failures)} failing cases, {elapsed:.1f} s)", flush=True)
        return 1
    print(f"PASS ({len(names)} backends x {len(topos)} topologies x {len(prompts)} prompts, "
          f"{elapsed:.1f} s)", flush=True)
    return 0
