"""SGLang 0.5.23's state kinds through the pdproto backend, each on SGLang's real pool (issue 33).

The same harness as ``test_harness.py`` (``tests/sglang/pd_harness.py``: real processes, SGLang's
objects driven in the order of ``prefill.py``/``decode.py``, every byte of every decode buffer
checked), one prefill rank into one decode rank per model, with chunked prefill, a decode prefix,
partial and sub-page prompts:

* a GPT-OSS-shaped MHA model with ``--kv-cache-dtype mxfp8`` (``SWAKVPool`` over
  ``MHATokenToKVPoolMXFP8``: ``swa``, ``block_scale``, ``block_scale_swa``), on both engines;
* a Qwen4-Exp-shaped hybrid (``QSATokenToKVPool``: ``mamba``, ``qsa_pending``, ``qsa_compressed``),
  on both engines;
* a MiniMax-M3-sparse-shaped model (``MiniMaxSparseKVPool``: ``minimax_index_k``,
  ``minimax_dense_kv``), on both engines;
* a GLM-5-Next-shaped hybrid (``HybridLinearKVPool(use_dsa=True)`` with a compressed index kpool:
  ``mamba``, ``dsa``, ``dsa_tail``), rings of different sizes on the two sides, on both engines;
* a DeepSeek-V4-shaped pool (``DeepSeekV4TokenToKVPool``: compressed KV pages, ``swa`` with the C4
  compressor state, ``c128_state``), on ROCm's unified KV too, and with DeepSeek-V4.1's ratios 1 and 2 and
  a DSpark draft, on both engines.

Their TP-mismatch policies (refused, replicated) are pure tests in ``tests/test_sglang_layout.py``.
A file of its own so that ``make test``'s two workers run it beside ``test_harness.py``.
"""

from __future__ import annotations

from typing import Callable

import pytest

from tests.sglang.pd_harness import DSV4_REQUESTS, REQUESTS, Request, run
from tests.sglang.test_harness import TOKEN, _assert_ranks_ok

pytestmark = [pytest.mark.process, pytest.mark.long]


def _one_to_one_moves_every_byte(model: str, engine: str, state_bytes: Callable[[Request], int],
                                 row_bytes: int, requests: tuple[Request, ...] = REQUESTS) -> None:
    """``model`` 1 -> 1 on ``engine``: every rank's every byte as expected, and each room's metric is its
    suffix's KV rows (``row_bytes`` per token), its ``state_bytes`` and the same aux row."""
    out = run("pdproto", requests, model=model, env={**TOKEN, "PDPROTO_ENGINE": engine})
    _assert_ranks_ok(out, 1, len(requests))  # mismatches: every byte of KV, aux and every state component
    assert out["decode_rc"] == [0], out["decode_stderr"]
    results = {int(room): r for room, r in out["prefill"]["results"].items()}
    aux = {results[req.room]["metric_bytes"] - (req.tokens - req.decode_prefix) * row_bytes - state_bytes(req)
           for req in requests}
    assert len(aux) == 1 and aux.pop() > 0


def _pages(tokens: int) -> int:
    return -(-tokens // 64)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pdproto_gpt_oss_mxfp8_window_pages_and_block_scales_move_every_byte(engine: str) -> None:
    """A GPT-OSS-shaped MHA model with MXFP8 KV (SGLang's SWAKVPool over MHATokenToKVPoolMXFP8 sub-pools):
    the full layers' fp8 KV rows, the window layers' SWA pages (``swa``), the full layers' UE8M0 scale
    pages of the whole sequence (``block_scale``) and the window layers' scale pages (``block_scale_swa``)
    land byte-exact at the decode's own page ids, every other byte of every buffer zero; chunked
    prefill, a decode prefix, partial and sub-page prompts. On the backend's Mooncake and NIXL engines.
    The metric: token rows of 2 full layers, K and V (4 x 2 heads x 64 fp8); the window's SWA pages
    (4 x 8,192) and scale pages (4 x 256); every KV page's scales (4 x 256)."""
    def state(req: Request) -> int:
        window = _pages(req.tokens) - max(req.decode_prefix, req.tokens - 128) // 64
        return window * 4 * (8192 + 256) + _pages(req.tokens) * 4 * 256

    _one_to_one_moves_every_byte("gptoss", engine, state, row_bytes=4 * 128)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pdproto_qwen4_exp_gdn_and_qsa_state_move_every_byte(engine: str) -> None:
    """A Qwen4-Exp-shaped hybrid (SGLang's Qwen4ExpConfig and QSATokenToKVPool over a GDN MambaPool): the
    QSA layers' KV rows, the GDN conv and temporal state (``mamba``, the request's Mamba slot), each QSA
    layer's ring of pending index keys and the shared RoPE ring (``qsa_pending``, the request's row) and
    the compressed index keys of every KV page (``qsa_compressed``) land byte-exact, every other byte of
    every buffer zero; chunked prefill, a decode prefix, partial and sub-page prompts. On the backend's
    Mooncake and NIXL engines. The metric: token rows of 2 layers, K and V (4 x 2 heads x 64 bf16); one
    GDN slot (2 conv of 1,536 and 2 temporal of 16,384 bytes); one pending row (2 x 512 + 96); 2 x 2,048
    per KV page of [0, seq) (the prefix's too, as SGLang sends them)."""
    _one_to_one_moves_every_byte("qwen4", engine, lambda req: 2 * (1536 + 16384) + 2 * 512 + 96
                                 + _pages(req.tokens) * 2 * 2048, row_bytes=4 * 256)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pdproto_minimax_m3_sparse_index_keys_and_dense_layers_move_every_byte(engine: str) -> None:
    """A MiniMax-M3-sparse-shaped model (SGLang's MiniMaxSparseKVPool): the sparse layers' KV rows as the
    main KV, their K-only index keys of the suffix's pages (``minimax_index_k``) and the dense layers'
    whole K and V of every page (``minimax_dense_kv``) land byte-exact, every other byte of every buffer
    zero; chunked prefill, a decode prefix, partial and sub-page prompts. The metric: token rows of 2
    sparse layers, K and V (4 x 2 heads x 64 bf16); 2 x 8,192 per suffix page; 4 x 16,384 per page.
    On the backend's Mooncake and NIXL engines."""
    _one_to_one_moves_every_byte("minimax", engine, lambda req: (
        _pages(req.tokens) - req.decode_prefix // 64) * 2 * 8192 + _pages(req.tokens) * 4 * 16384, row_bytes=4 * 256)


GLM5_NEXT_REQUESTS = (
    Request(room=101, tokens=491, chunk=256),  # 3 live: prefill ring of 4 at 0-2, decode ring of 5 at 3-4, 0
    Request(room=102, tokens=7),  # 3 live: prefill at 0-2, decode at 4, 0-1 (wrapped)
    Request(room=103, tokens=770, decode_prefix=256, chunk=256),  # 2 live: prefill at 0-1, decode at 3-4
    Request(room=104, tokens=256),  # seq % index_kpool == 0: both sides pass [], nothing moves
)
"""GLM-5-Next's requests: 256-token pages (index_kpool 4); the live tail is ``tokens % 4`` slots at
``(tokens - live) % tail_size`` of each side's ring (``get_dsa_tail_state_indices``, utils.py:1269-1297)."""


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pdproto_glm5_next_kda_state_dsa_index_and_tail_rings_move_every_byte(engine: str) -> None:
    """A GLM-5-Next-shaped hybrid (KDA + DSA: SGLang's HybridLinearKVPool(use_mla, use_dsa) with index_kpool 4
    and kpool compress): the MLA layers' KV rows, the KDA conv and temporal state (``mamba``), the index-K
    pages of the suffix (``dsa``) and the live slots of each MLA layer's K-tail and score-tail rings
    (``dsa_tail``) land byte-exact, the tail at the decode's own ring positions in a ring one slot longer
    than the prefill's (wrapping where SGLang's remap wraps), every other byte of every buffer zero;
    chunked prefill, a decode prefix, a request with no live tail. On the backend's Mooncake and NIXL engines. The
    metric: token rows of 2 MLA layers (1,152 bytes each); one KDA slot (6 conv of 1,152 and 6 temporal of
    4,096 bytes); 2 x 8,448 per suffix page; 2 layers x (K, score) x 256 bytes per live tail slot."""
    _one_to_one_moves_every_byte("glm5next", engine, lambda req: 6 * (1152 + 4096)
                                 + (-(-req.tokens // 256) - req.decode_prefix // 256) * 2 * 8448
                                 + req.tokens % 4 * 2 * 2 * 256, row_bytes=2 * 1152, requests=GLM5_NEXT_REQUESTS)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
@pytest.mark.parametrize("model", ["dsv4", "dsv4unified", "dsv41"])
def test_pdproto_deepseek_v4_kv_pages_window_rings_c128_state_and_dspark_request_row_move_every_byte(
        model: str, engine: str) -> None:
    """A DeepSeek-V4-shaped pool (SGLang's DeepSeekV4TokenToKVPool, layers of compression ratios 0, 4, 128, 4):
    the compressed KV pages of the suffix (C4 KV, C4 indexer keys, C128 KV) whole at the decode's page ids,
    the window's C4 compressor and indexer-compressor rings by SWA page (``swa``) and the request's C128 ring
    page (``c128_state``, none on a block boundary) land byte-exact, every other byte of every buffer zero;
    chunked prefill, a decode prefix, a sub-page prompt. On the backend's Mooncake and NIXL engines.

    ``dsv4`` (paged SWA, fp8; with a DSpark draft): ``swa`` holds the window's SWA pages too, the draft's
    ``swa`` its own SWA pages, ``request_row`` the draft's int64 row. The metric: 2 x 37,440 + 2 x 8,448 +
    1,728 bytes per suffix page; 4 x 149,760 + 2 x 65,536 + 2 x 16,384 + 149,760 per window page; 524,288
    per C128 ring page; 8 per request.
    ``dsv4unified`` (ROCm's unified KV, fp8 two-pool): the KV pages sit after each layer's ring, nope then
    rope; the window is ``swa_ring``, each layer's ring rows of the last 128 positions (``req * ring +
    pos % ring``), nope then rope. The metric: 2 x (32,768 + 8,192 + 8,448) + 1,024 + 256 per suffix page;
    2 x 65,536 + 2 x 16,384 per window page; 4 x (512 + 128) per window token; 524,288 per C128 ring page.
    ``dsv41`` (DeepSeek-V4.1's ratios 0, 4, 1, 2, 1, 2 with a DSpark draft of 3 tokens): KV is C4 KV and indexer
    keys, then each low ratio's kv_source KV and fp4 indexer keys; ``c128_state`` the ratio-2 kv_source's
    pending-pair ring, moved for an odd length. The metric: 37,440 + 8,448 + 149,760 + 17,408 + 74,880 + 8,704
    per suffix page; 6 x 149,760 + 131,072 + 32,768 + 149,760 per window page; 32,768 per pending pair; 8 per
    request."""
    unified = model == "dsv4unified"
    # Per model: KV bytes per suffix page, swa bytes per window page, request-state bytes (C128 ring page, V4.1's
    # pair ring) and the length that leaves it pending, request-row bytes.
    kv, swa, request, pending, row = {"dsv4": (93504, 762880 + 149760, 524288, 128, 8),
                                      "dsv4unified": (100096, 163840, 524288, 128, 0),
                                      "dsv41": (296640, 1062400 + 149760, 32768, 2, 8)}[model]

    def moved(req: Request) -> int:
        pages = -(-req.tokens // 256)
        window = pages - max(req.decode_prefix, req.tokens - 128) // 256
        ring = 4 * 640 * min(req.tokens, 128) if unified else row
        return (pages - req.decode_prefix // 256) * kv + window * swa + ring + (req.tokens % pending > 0) * request

    _one_to_one_moves_every_byte(model, engine, moved, row_bytes=0, requests=DSV4_REQUESTS)
