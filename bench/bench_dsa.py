"""A DeepSeek-V3.2-shaped request end to end (MLA KV + DSA index pages) against a dense transfer of the same bytes.

One rank pair per engine (``bench._pair``), dense prefill TP 4 rank 1 -> decode TP 4 DCP 4
rank 1: the 32,768-token request's MLA rows (576 bf16 = 1,152 bytes per token, 64-token
pages) are relaid out for DCP 4 with packing, and the DSA index (SGLang's ``dsa`` pool: per
layer one 8,448-byte item per 64-token page, 64 x (128 fp8 + 4 scale bytes)) moves whole,
replicated: the DCP decode rank holds every token's index page (512 per layer), not its
quarter, on pages of its own index space (``pdproto_demo.model.ModelShape.index_pages``).
"""

from __future__ import annotations

from bench import per_backend
from bench._pair import CHUNKS, DCP, PAGE, RANK, TOKENS, TP, line, measure

LAYERS = 8  # DeepSeek-V3.2 has 61, every one MLA with an index; the bytes scale with them


def bench_backend(backend: str) -> dict[str, float]:
    """Median seconds and bytes of the request and of the dense transfer on one engine."""
    return measure(backend, "dsa", LAYERS)


def main() -> int:
    """Run the bench for each engine and print the ratio line; non-zero if a run failed."""
    print(f"DeepSeek-V3.2-shaped request: {TOKENS} tokens, {LAYERS} layers (MLA 1,152 B rows + DSA index"
          f" {PAGE * 132:,} B per {PAGE}-token page), prefill TP {TP} rank {RANK} -> decode TP {TP} DCP {DCP}"
          f" rank {RANK}, {CHUNKS} chunks", flush=True)
    return per_backend(bench_backend, lambda backend, r, s: print(line(backend, "dsa", r, s), flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
