"""One rank pair of a model end to end against a dense transfer of the same bytes (bench_kimi, bench_dsa).

Prefill TP rank RANK of TP runs the real handshake service in this process
(``pdproto_demo.prefill.PrefillRank``), and decode TP rank RANK of TP with DCP runs as its
own process (``pdproto_demo.decode``) and registers through the client. A TOKENS-token
request then goes through the whole path: SubmitTransfer, CHUNKS chunks from the engine
API (the last naming the state and aux slots or pages), the DCP relayout of the MLA rows
with packing, the model's state and aux, then SUCCESS on the decode's status stream. The
time is from the decode's submit to that SUCCESS; every byte is checked on the last round
(outside the clock).

The baseline moves the same number of bytes from the same executor to the same decode
process as one contiguous descriptor per KV layer (``dense``). The line reports the
request's GB/s over the dense GB/s. Medians of ROUNDS; the machine may be shared.
Environment: PDPROTO_BENCH_BACKENDS=mooncake,nixl picks the engines.
"""

from __future__ import annotations

import math
import os
import statistics

import numpy as np

from pdproto.transfer import LayerSpan, TransferJob
from pdproto_demo import data
from pdproto_demo.decode import DecodeConfig, DecodeProcess
from pdproto_demo.prefill import PrefillConfig, PrefillRank

TOKENS = 32768
PAGE = 64
TP = DCP = 4
RANK = 1
CHUNKS = 4
ROUNDS = 3


def measure(backend: str, model: str, layers: int, **shape: int) -> dict[str, float]:
    """Median seconds and bytes of the request and of the dense transfer on one engine; ``shape``: the
    model's other fields, as ``DecodeConfig`` names them (``kda_heads=32``)."""
    common = dict(backend=backend, layers=layers, page_size=PAGE, model=model, tp_size=TP, tp_rank=RANK, slots=4,
                  **shape)
    rank = PrefillRank(PrefillConfig(name=f"bench-{model}-prefill-{os.getpid()}", pages=TOKENS // PAGE + 8,
                                     staging_mb=256, **common))  # type: ignore[arg-type]
    port = rank.service.start(60)
    # Enough decode pages for the request and for the dense copy of its bytes.
    pages = 2 * math.ceil(TOKENS / (PAGE * DCP)) + 16
    peer = DecodeProcess.launch(DecodeConfig(pages=pages, dcp_size=DCP, dcp_rank=RANK, **common),  # type: ignore[arg-type]
                                timeout=120)
    try:
        peer.call("connect", 60, targets=[f"127.0.0.1:{port}"])
        dst_pages = data.page_list(0, math.ceil(TOKENS / (PAGE * DCP)), scramble=True)
        src_pages = data.page_list(1, TOKENS // PAGE, scramble=True)
        step = TOKENS // CHUNKS
        secs: list[float] = []
        moved = 0
        for rnd in range(ROUNDS + 1):  # round 0 warms connections and lazy imports up
            room = 7000 + rnd
            rank.prepare(room, 0, TOKENS, src_pages, slot=1)
            peer.call("request", 60, room=room, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=dst_pages)
            for k in range(CHUNKS):
                chunk = src_pages[k * step // PAGE:(k + 1) * step // PAGE]
                rank.chunk(room, chunk, step, k == CHUNKS - 1, slot=1)
            reply = peer.call("wait", 300, room=room, check=rnd == ROUNDS)
            if not reply["ok"]:
                raise AssertionError(f"request failed: {reply['failures'] or reply['mismatch']}")
            if rnd == ROUNDS and not int(reply["checked"]):
                raise AssertionError("the last round checked no byte")
            moved = int(reply["bytes"]) + int(reply["aux_bytes"]) + int(reply["state_bytes"])
            if rnd:
                secs.append(float(reply["seconds"]))
            rank.release(room)
        dense_s = _dense(rank, peer, moved)
        return {"request_s": statistics.median(secs), "dense_s": dense_s, "bytes": moved,
                "kv": int(reply["bytes"]), "state": int(reply["state_bytes"]), "aux": int(reply["aux_bytes"]),
                "desc": int(reply["descriptors"]) + int(reply["aux_descriptors"]) + int(reply["state_descriptors"])}
    finally:
        peer.close()
        rank.close()


def _dense(rank: PrefillRank, peer: DecodeProcess, nbytes: int) -> float:
    """Median seconds of ``nbytes`` as one contiguous descriptor per KV layer, same executor and peer."""
    ex = rank.executor
    ex.connect("dense", peer.registration)
    row = rank.pool[0].shape[1]
    per_layer = -(-nbytes // (len(rank.bufs) * row))  # rows per layer so that every byte is counted
    spans = tuple(LayerSpan(b.addr, d.ptr, row) for b, d in zip(rank.bufs, peer.registration.kv_buffers, strict=True))
    job = TransferJob.of_runs(spans, np.array([[0, 1, 0, 1, per_layer]], dtype=np.int64), pack=False)
    ex.execute("dense", job)
    times = [ex.execute("dense", job).seconds for _ in range(ROUNDS)]
    ex.disconnect("dense")
    return statistics.median(times)


def line(backend: str, label: str, r: dict[str, float], seconds: float) -> str:
    """The result line: the request's bytes by kind, its time and GB/s, the dense time and GB/s, the ratio."""
    req, dense = r["bytes"] / r["request_s"] / 1e9, r["bytes"] / r["dense_s"] / 1e9
    return (f"{backend:<9} {label} 32K request end to end {r['bytes'] / 1e6:.1f} MB (KV {r['kv'] / 1e6:.1f},"
            f" state {r['state'] / 1e6:.2f}, aux {r['aux']:.0f} B; {int(r['desc'])} descriptors)"
            f" {r['request_s'] * 1e3:.1f} ms = {req:.2f} GB/s; dense same bytes {r['dense_s'] * 1e3:.1f} ms ="
            f" {dense:.2f} GB/s; ratio {req / dense:.2f}  [{seconds:.0f} s]")
