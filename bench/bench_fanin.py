"""MHA fan-in (prefill TP 2 -> decode TP 1): heads packed per decode page against heads row by row.

Each prefill rank holds half of every token row's KV heads and writes its half of each decode
row. Row by row (what a decode without the ``packed-fan-in`` capability gets, and what SGLang's
own backends do: ``send_kvcache_slice``) that is one descriptor per token and layer; packed it
is one per decode page and layer, and the decode puts each page back in row order once the
request succeeded (that reorder is inside the time). Real prefill and decode processes
(``pdproto_demo.cluster``), every byte checked on each round; the time is the decode's, from
its submit to the request's end. Medians of ROUNDS after one warm-up request.
Environment: PDPROTO_BENCH_BACKENDS=mooncake,nixl picks the engines.
"""

from __future__ import annotations

import statistics
import tempfile

from bench import per_backend
from pdproto_demo.cluster import Cluster, Geometry, Topology

TOKENS = 8192
GEO = Geometry(layers=8, page_size=64, max_tokens=TOKENS, max_prefix=0)
ROUNDS = 3


def _run(backend: str, packed: bool) -> dict[str, float]:
    """Median seconds, bytes and descriptors of TOKENS-token requests with the decode asking for packing or not."""
    c = Cluster(backend, GEO, dst_dcp=1, src_groups=(1,), model="mha", src_tp=2, dst_tp=1,
                decode={"packed_fan_in": packed}, log_dir=tempfile.mkdtemp(prefix="pdproto-bench-fanin-"))
    try:
        c.launch()
        c.connect(Topology(1, 1, 2, 1))
        results = [c.run_request(TOKENS, 0) for _ in range(ROUNDS + 1)]
    finally:
        c.close()
    for r in results:
        if not r.ok or not r.checked:
            raise AssertionError(f"request failed: {r.failures or r.mismatches}")
    timed = results[1:]
    return {"s": statistics.median(r.seconds for r in timed), "bytes": timed[0].bytes,
            "desc": timed[0].descriptors}


def bench_backend(backend: str) -> dict[str, dict[str, float]]:
    """Both ways on one engine."""
    return {"packed": _run(backend, True), "rows": _run(backend, False)}


def _line(backend: str, r: dict[str, dict[str, float]], seconds: float) -> str:
    p, rows = r["packed"], r["rows"]
    return (f"{backend:<9} {TOKENS} tokens, {p['bytes'] / 1e6:.1f} MB: packed {p['s'] * 1e3:.1f} ms"
            f" ({int(p['desc'])} descriptors, {p['bytes'] / p['s'] / 1e9:.2f} GB/s), row by row"
            f" {rows['s'] * 1e3:.1f} ms ({int(rows['desc'])} descriptors); time packed / row by row"
            f" {p['s'] / rows['s']:.2f}  [{seconds:.0f} s]")


def main() -> int:
    """Run the bench for each engine and print its line; non-zero if a run failed."""
    print(f"MHA fan-in: prefill TP 2 -> decode TP 1, {GEO.layers} layers, pages of {GEO.page_size}, one request of"
          f" {TOKENS} tokens", flush=True)
    return per_backend(bench_backend, lambda backend, r, s: print(_line(backend, r, s), flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
