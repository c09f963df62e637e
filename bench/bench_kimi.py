"""A Kimi-Linear-shaped request end to end (KV + state + aux) against a dense transfer of the same bytes.

One rank pair of the demo's kimi-tp4-dcp4 case, per engine (``bench._pair``): the 32,768-token
request's MLA rows are relaid out for DCP 4 with packing, the KDA state is sliced (heads of
every temporal state, q/k/v channels of every conv window row), and the aux slot moves.
"""

from __future__ import annotations

from bench import per_backend
from bench._pair import CHUNKS, DCP, RANK, TOKENS, TP, line, measure

LAYERS = 8  # Kimi's ratio: layers 3 and 7 are MLA, the six others KDA


def bench_backend(backend: str) -> dict[str, float]:
    """Median seconds and bytes of the request and of the dense transfer on one engine."""
    return measure(backend, "hybrid", LAYERS, kda_heads=32, kda_head_dim=128)


def main() -> int:
    """Run the bench for each engine and print the ratio line; non-zero if a run failed."""
    print(f"Kimi-shaped request: {TOKENS} tokens, {LAYERS} layers (MLA 1:3 KDA, 32 heads x 128), prefill TP {TP}"
          f" rank {RANK} -> decode TP {TP} DCP {DCP} rank {RANK}, {CHUNKS} chunks", flush=True)
    return per_backend(bench_backend, lambda backend, r, s: print(line(backend, "kimi", r, s), flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
