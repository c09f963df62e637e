"""pdproto's SGLang backend against SGLang 0.5.23's own Mooncake backend, same driver (issue 34).

Both backends run through ``tests/sglang/pd_harness.py``: SGLang's real ServerArgs, pools,
bootstrap server, manager, sender and receiver in separate prefill and decode processes,
driven in the call order of ``disaggregation/prefill.py``/``decode.py``, every byte checked
on every decode rank. The time is the prefill's, from just before its first ``send()`` (the
harness's finalize-bootstrap and chunk bookkeeping, the same for both) to the poll that
reports Success (start-up and the byte check are outside it; with two prefill ranks, the
later of the two). Each row runs the two backends interleaved, ROUNDS times each, so that the
machine's load shifts hit both alike, and prints the ratio pdproto / SGLang (each round's pair)
min, median and max, then each side's median seconds and GB/s over the KV token rows that land
(``tokens x KV layers x row``, times the decode ranks when a decode TP without DCP gives each
rank every token; the same bytes for both; a hybrid's state and the aux row ride along
uncounted). A row whose ratio goes above 1.0 (pdproto slower) is marked. Where SGLang's own backend fails the transfer
(at DCP on a CPU host it sends a descriptor per token, which overflows Mooncake's TCP lane
queue for the dense MLA model at these sizes) the row says so with its reason and shows pdproto's runs alone; any other failure
prints FAILED with the reason and makes ``main`` return 1. The harness bounds every wait
(TIMEOUT_S per step) and kills ranks that do not exit, so a stuck run ends.

The shapes: one prefill rank into a decode rank or a decode DCP group, the Kimi-shaped hybrid
from two plain prefill TP ranks into a decode TP 1 (fan-in: the decode asks both, each sends its
half of the state heads), from one prefill rank into a decode TP 2 without DCP (head slicing),
and from four prefill TP ranks into a decode DCP 4 group (8 processes on two cores).
``PDPROTO_BENCH_SGLANG_SHAPES`` runs only some shapes: comma-separated pieces of their names,
each naming at least one (``PDPROTO_BENCH_SGLANG_SHAPES="fan-in,head slicing"``).
Every harness run starts its own processes (~10-20 s on two cores), so by default only the
columns the issue turns on run: 32,768 tokens as 4 chunks and 8,192 whole;
``PDPROTO_BENCH_SGLANG=full`` adds 32,768 whole and 8,192 as 4 chunks.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

ROUNDS = 3
TIMEOUT_S = 30.0
"""The harness's per-step wait (and SGLang's bootstrap/waiting timeouts): a stuck run ends, never hangs."""
KV_LAYERS = {"mla": 4, "kimi": 2, "dsa": 4}
"""The harness models' KV (MLA) layers (``tests/sglang/_models.py``): Kimi's other six layers are KDA state."""
BASELINE = "mooncake_tcp"
BACKENDS = (BASELINE, "pdproto")
"""Run in this order in every round."""


@dataclass(frozen=True)
class Shape:
    """One topology the harness runs: model, decode TP and prefill TP (plain TP ranks)."""

    name: str
    model: str
    decode_tp: int
    prefill_tp: int = 1
    dcp: bool = True
    """The decode's TP ranks are its DCP group (each a token shard); else TP without DCP (each every token)."""

    @property
    def landings(self) -> int:
        """Decode ranks each KV token row lands on."""
        return 1 if self.dcp else self.decode_tp


SHAPES = (
    Shape("MLA TP1 -> TP1", "mla", 1),
    Shape("dense -> DCP 4", "mla", 4),
    Shape("hybrid TP1 -> TP1", "kimi", 1),
    Shape("hybrid TP1 -> DCP 4", "kimi", 4),
    Shape("hybrid TP2 -> TP1 (fan-in)", "kimi", 1, prefill_tp=2),
    Shape("hybrid TP1 -> TP2 (head slicing)", "kimi", 2, dcp=False),
    Shape("hybrid TP4 -> TP4 / DCP 4", "kimi", 4, prefill_tp=4),
)
WIDTH = max(len(shape.name) for shape in SHAPES)
COLUMNS = ((32768, 8192), (8192, 8192))
"""(tokens, chunk) pairs run by default: chunk == tokens is one whole send."""
FULL_COLUMNS = ((8192, 2048), (32768, 32768))


def _one(backend: str, shape: Shape, tokens: int, chunk: int) -> float:
    """Seconds of one harness run; raises with the reason if any rank did not land every byte."""
    from tests.sglang.pd_harness import SUCCESS, Request, run

    out: dict[str, Any] = run(backend, (Request(room=1, tokens=tokens, chunk=chunk),), model=shape.model,
                              dcp=shape.decode_tp, prefill_tp=shape.prefill_tp, decode_tp_only=not shape.dcp,
                              timeout=TIMEOUT_S)
    prefills = out.get("prefills") or [None]
    for rank, prefill in enumerate(prefills):
        if prefill is None:
            raise RuntimeError(f"no report from prefill rank {rank} (rc {out['prefill_rcs']}):"
                               f" {_tail(out['prefill_stderr'])}")
        (result,) = prefill["results"].values()
        if result["poll"] != SUCCESS:
            raise _TransferFailed(f"prefill rank {rank} poll {result['poll']}: {result.get('reason')}")
    for rank, (decode, err) in enumerate(zip(out["decode"], out["decode_stderr"], strict=True)):
        if decode is None:
            raise RuntimeError(f"decode rank {rank} sent no report: {_tail(err)}")
        if decode["polls"] != [SUCCESS] or decode["mismatches"]:
            raise RuntimeError(f"decode rank {rank}: polls {decode['polls']} {decode['reasons']},"
                               f" mismatches {decode['mismatches'][:3]}")
    return max(float(prefill["seconds"]) for prefill in prefills)


class _TransferFailed(RuntimeError):
    """The harness ran, and the backend's sender reported Failed with this reason."""


def _tail(stderr: str) -> str:
    """The last line of a rank's stderr that says something."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else "(no stderr)"


def _row(shape: Shape, tokens: int, chunk: int) -> tuple[str, bool]:
    """One table row from ROUNDS interleaved pairs of runs, and whether it failed.

    SGLang's own backend failing a transfer (its sender reports Failed: it cannot move this
    shape here) is a measurement: the row says so, shows pdproto's runs alone and does not
    fail the bench. Anything else failing (pdproto, a rank without a report) fails it.
    """
    from tests.sglang._models import ROW_BYTES

    secs: dict[str, list[float]] = {b: [] for b in BACKENDS}
    mode = "whole" if chunk >= tokens else f"{-(-tokens // chunk)} x {chunk}"
    head = f"{shape.name:<{WIDTH}} {tokens:>6} {mode:<9}"
    baseline_failed = ""
    for _ in range(ROUNDS):
        for backend in BACKENDS:
            if backend == BASELINE and baseline_failed:
                continue  # it failed once; each failed run waits out the decode's timeout
            try:
                secs[backend].append(_one(backend, shape, tokens, chunk))
            except _TransferFailed as exc:
                if backend != BASELINE:
                    return f"{head} FAILED ({backend}): {exc}", True
                baseline_failed = str(exc)
            except Exception as exc:  # noqa: BLE001 - the row reports it, the bench goes on
                return f"{head} FAILED ({backend}): {exc}", True
    nbytes = tokens * KV_LAYERS[shape.model] * ROW_BYTES * shape.landings
    pd = statistics.median(secs["pdproto"])
    pd_cols = f"{pd:>9.3f} {nbytes / pd / 1e9:>6.2f}"
    if baseline_failed:
        return f"{head} {'SGLang FAILED':>17} {'-':>8} {'-':>6} {pd_cols}  SGLang: {baseline_failed}", False
    ratios = sorted(p / s for s, p in zip(secs[BASELINE], secs["pdproto"], strict=True))
    sg = statistics.median(secs[BASELINE])
    mark = "  < above 1.0" if max(ratios) > 1.0 else ""
    return (f"{head} {ratios[0]:>5.2f} {statistics.median(ratios):>5.2f} {ratios[-1]:>5.2f}"
            f" {sg:>8.3f} {nbytes / sg / 1e9:>6.2f} {pd_cols}{mark}"), False


def _selected(pieces: str) -> tuple[Shape, ...]:
    """The shapes whose names hold one of the comma-separated ``pieces`` (all without any); raises ValueError
    naming a piece that matches none."""
    wanted = [piece.strip() for piece in pieces.split(",") if piece.strip()]
    if unknown := [piece for piece in wanted if not any(piece in shape.name for shape in SHAPES)]:
        raise ValueError(f"no shape's name holds {unknown}; the shapes: {[shape.name for shape in SHAPES]}")
    return tuple(shape for shape in SHAPES if not wanted or any(piece in shape.name for piece in wanted))


def main() -> int:
    """Print the comparison table; non-zero if any run failed."""
    if importlib.util.find_spec("sglang") is None:  # the harness's ranks import it behind CPU stubs
        print("skipped: SGLang is not installed")
        return 0
    try:
        shapes = _selected(os.environ.get("PDPROTO_BENCH_SGLANG_SHAPES", ""))
    except ValueError as exc:
        print(f"PDPROTO_BENCH_SGLANG_SHAPES: {exc}")
        return 2
    full = os.environ.get("PDPROTO_BENCH_SGLANG") == "full"
    columns = COLUMNS + FULL_COLUMNS if full else COLUMNS
    print(f"SGLang harness (tests/sglang/pd_harness.py), first send() to Success, {ROUNDS} interleaved runs per"
          f" backend; ratio = pdproto / SGLang mooncake_tcp per round (a row with a round above 1.0 is marked);"
          f" GB/s over KV token rows."
          f" Columns: {', '.join(f'{t} / chunk {c}' for t, c in columns)}"
          f"{'' if full else ' (PDPROTO_BENCH_SGLANG=full adds 32768 whole and 8192 in 4 chunks)'}", flush=True)
    print(f"{'shape':<{WIDTH}} {'tokens':>6} {'send':<9} {'min':>5} {'med':>5} {'max':>5}"
          f" {'SGLang s':>8} {'GB/s':>6} {'pdproto s':>9} {'GB/s':>6}", flush=True)
    rc = 0
    began = time.perf_counter()
    for shape in shapes:
        for tokens, chunk in columns:
            line, failed = _row(shape, tokens, chunk)
            rc |= failed
            print(line, flush=True)
    print(f"[{time.perf_counter() - began:.0f} s]")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
