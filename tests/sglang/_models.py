"""The model shapes the SGLang harness runs, built from SGLang's own pool classes.

* ``mla``: a DeepSeek-V3-shaped MLA pool (``MLATokenToKVPool``, 4 layers, 576 bf16 values =
  1152 bytes per token), aux buffers, no state.
* ``dsa``: a DeepSeek-V3.2-shaped pool (``DeepseekV32ForCausalLM``; see ``write_config``):
  SGLang's ``DSATokenToKVPool``, the same MLA rows plus per layer an index-K buffer of one
  8,448-byte page (64 tokens of 128 fp8 + 4 scale bytes) per KV page, which SGLang moves as
  its one ``dsa`` state component; on a DCP decode the buffer covers every (virtual) token.
  Layer 2 shares layer 1's top-k, so its buffer has 0 rows and nothing moves for it.
* ``gptoss``: a GPT-OSS-shaped MHA model (``GptOssForCausalLM``: sliding-window layers 0 and 2,
  full layers 1 and 3, 2 KV heads of 64) with ``--kv-cache-dtype mxfp8``: SGLang's ``SWAKVPool``
  over two ``MHATokenToKVPoolMXFP8`` sub-pools, as ``_build_hybrid_swa_kv_pool`` builds it. KV is
  the full layers' fp8 K and V; state is ``swa`` (the window layers' K and V pages),
  ``block_scale`` (the full layers' UE8M0 scales, one item per KV page) and ``block_scale_swa``
  (the window layers' scales, one item per window page).
* ``qwen4``: a Qwen4-Exp-shaped hybrid (SGLang's ``Qwen4ExpConfig``: GDN at layers 0 and 2, QSA full
  attention at 1 and 3): its ``QSATokenToKVPool`` over a ``MambaPool`` from the config's
  ``mamba2_cache_params``, as the QSA branch of ``_build_linear_kv_pool`` builds it. KV is the
  full layers' K and V; state is ``mamba`` (GDN conv and temporal state, one slot per request),
  ``qsa_pending`` (per request row: each QSA layer's ring of 4 raw index keys, then the shared
  RoPE position ring) and ``qsa_compressed`` (per KV page: 16 compressed index keys per layer).
* ``minimax``: a MiniMax-M3-sparse-shaped MHA model (``MiniMaxM3SparseForCausalLM``: dense layers 0
  and 2, sparse layers 1 and 3 with K-only index keys): SGLang's ``MiniMaxSparseKVPool``, as
  ``_build_minimax_sparse_kv_pool`` builds it. KV is the sparse layers' K and V; state is
  ``minimax_index_k`` (the sparse layers' index keys, per KV page of the suffix) and
  ``minimax_dense_kv`` (the dense layers' K then V, per KV page of the whole sequence).
* ``kimi``: a Kimi-Linear-shaped hybrid: SGLang's ``KimiLinearConfig`` (8 layers; KDA at
  layers 0-2 and 4-6, MLA at 3 and 7), its ``HybridLinearKVPool(use_mla=True)`` over a
  ``MambaPool`` built from the config's own ``mamba2_cache_params`` (conv state
  ``[K-1, q|k|v]`` bf16, temporal state ``[H, hd, hd]`` fp32 per KDA layer), aux buffers.
* ``glm5next``: a GLM-5-Next-shaped hybrid (KDA + DSA): the ``kimi`` config and Mamba pool, and its
  ``HybridLinearKVPool(use_mla=True, use_dsa=True)`` with a compressed index kpool of 4 as
  ``_build_hybrid_linear_kv_pool`` builds it (``kv_cache_configurator.py:2623-2655``): 256-token
  pages (DSA keeps 64-token index pages, ``memory_pool.py:5366-5374``), state ``mamba``, ``dsa``
  and ``dsa_tail`` (per request row and MLA layer a K-tail and a score-tail ring of
  ``4 + tail_extra_slots`` slots of 128 bf16). The decode's ring has one speculative slot more than
  the prefill's (``TAIL_EXTRA``), so SGLang's 6-tuples differ on the two sides; the harness stands
  in for boot flags SGLang resolves only on a GPU (a DSA config, ``--speculative-*``).
* ``dsv4``: a DeepSeek-V4-shaped pool: SGLang's ``DeepSeekV4TokenToKVPool`` (4 layers of compression
  ratios 0, 4, 128, 4; fp8 V4 layout; 256-token pages, a 128-token window) as the DSV4 branch of
  ``_build_token_to_kv_pool`` builds it (``kv_cache_configurator.py:1821``). KV is five entries of
  whole compressed pages (C4 KV of layers 1 and 3, their C4 indexer keys, C128 KV of layer 2; checked
  page by page: ``page_rows``); state is ``swa`` (the 4 layers' SWA pages of the window, then the C4
  compressor and indexer-compressor rings of the same SWA pages) and ``c128_state`` (the request's
  C128 ring page, none when the prompt ends on a 128-token block), then a DSpark draft's (an SWA-only NextN
  layer, ``is_draft_worker``, built while SGLang's spec config says DSPARK) ``swa`` pages and ``request_row``
  (its ``swa_valid_from``, one int64 per request row), as ``setup_state_kv_args`` appends them
  (``utils.py:1775-1858``). Booted with the DeepSeek-V3 config, as ``dsa`` is (a V4 config's arguments
  resolve on a GPU only).
* ``dsv4unified``: the same pool on ROCm's unified KV (``unified_kv_gate.py:13-15``, which asks for HIP: the
  harness answers the gate for the pool's construction only) in its fp8 two-pool layout (``unified_fp8``,
  as the configurator passes ``SGLANG_DSV4_UNIFIED_KV_FP8`` on gfx95): KV is the compressed pages after
  each layer's SWA ring, nope then rope; state is ``swa`` (the C4 compressor rings only), ``swa_ring``
  (each layer's ring rows of the window, nope then rope) and ``c128_state``.
* ``dsv41``: a DeepSeek-V4.1-shaped pool with a DSpark draft: the ``dsv4`` pool with V4.1's ratios
  (6 layers of ratios 0, 4, 1, 2, 1, 2; kv_source layers 2 and 3, which layers 4 and 5 read:
  ``collect_sources_by_ratio``) and ``full_size``, target and draft built while SGLang's spec config
  says DSPARK with 3 draft tokens, as ``_build_dsv4_kv_pool`` passes them (``kv_cache_configurator.py:2054-2141``).
  V4 layout: the V4.1 layouts need an SM100 GPU (``select_dsv4_kv_layout``). KV is six entries in
  SGLang's wire order (``_init_compressed_pools``): C4 KV, C4 indexer, then per low ratio the kv_source
  layer's KV and its packed fp4 indexer keys (a run of 64-slot index pages per full page); state is
  ``swa`` (the 6 layers' SWA pages, the C4 compressor rings), ``c128_state`` (the ratio-2 kv_source's
  pending-pair ring of the request row, none for an even length), the draft's ``swa`` and ``request_row``.
  V4.1 has no ratio 128 here: SGLang moves one request-state index list for every request-scoped pool and
  asserts they share one ring layout (``request_state_transfer_indices``), which C128's ring and the
  pair ring do not.

Both sides derive every byte from one seed. A decode rank checks its whole KV pool, every aux
buffer and every state tensor against what it must hold: the prefill's bytes where they belong,
projected onto the rank's share under TP (computed here by plain slicing of SGLang's layouts, not
by pdproto), zeros elsewhere. ``dsa_tail`` rings are checked by SGLang's own remap (``check_tail``);
state components other than ``mamba``, ``dsa`` and ``dsa_tail`` are read and checked generically
(``GENERIC``): every registered buffer by the address and item size
``setup_state_kv_args`` gives, the i-th prefill item of a component landing in the i-th decode
item, with the indices ``state_indices`` computes as ``prefill.py``/``decode.py`` do.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAGE = 64  # physical page (tokens); a DCP decode's virtual page is PAGE * dcp
KV_LORA_RANK, ROPE_DIM = 512, 64  # MLA row: 576 bf16 values, 1152 bytes
ROW_BYTES = (KV_LORA_RANK + ROPE_DIM) * 2
AUX_SLOTS = 16
STATE_SLOTS = 16  # mamba slots per pool (SGLang adds padding slot 0)
SEED = 1234
LAYERS = {"mla": 4, "dsa": 4, "kimi": 8, "gptoss": 4, "qwen4": 4, "minimax": 4, "glm5next": 8, "dsv4": 4,
          "dsv4unified": 4, "dsv41": 6}
DSV4_RATIOS = [0, 4, 128, 4]  # dsv4: per layer its KV compression ratio (0: the window only)
DSV41_RATIOS, DSV41_SOURCES = [0, 4, 1, 2, 1, 2], [2, 3]  # dsv41: ratios, and the layers owning ratio 1/2 storage
DSV4 = ("dsv4", "dsv4unified", "dsv41")
INDEX_KPOOL = 4  # glm5next: index keys compressed 4:1, so 64-token index pages need 256-token KV pages
TAIL_EXTRA = {"prefill": 0, "decode": 1}  # glm5next: max_speculative_num_draft_tokens on each side
SWA_WINDOW = 128  # GPT-OSS's sliding_window, shortened to two pages so a window is shorter than most prompts
GENERIC = frozenset({"swa", "block_scale", "block_scale_swa", "qsa_pending", "qsa_compressed", "minimax_index_k",
                     "minimax_dense_kv", "c128_state", "swa_ring", "request_row"})
"""State types whose every item moves whole, i-th to i-th (checked by ``check_paged``)."""
KDA = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}


def write_config(model: str, directory: Path) -> Path:
    """A tiny config.json of the model: what SGLang's argument checks and pools read; no weights."""
    mla = {
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": LAYERS[model], "num_attention_heads": 4, "num_key_value_heads": 4,
        "first_k_dense_replace": LAYERS[model], "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": ROPE_DIM, "v_head_dim": 128,
        "max_position_embeddings": 4096, "rope_theta": 10000, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    }  # fmt: skip
    if model == "gptoss":
        # Booted without --kv-cache-dtype mxfp8: SGLang refuses it without an SM100 GPU at argument
        # resolution (arg_groups/kv_cache_hook.py:100-110); build_pools builds the MXFP8 pools.
        config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 1024,
                  "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": LAYERS[model],
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": SWA_WINDOW,
                  "layer_types": ["sliding_attention", "full_attention"] * 2, "num_local_experts": 4,
                  "experts_per_token": 2, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
                  "rope_theta": 10000, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "attention_bias": True}
    elif model == "minimax":
        # MiniMax-M3 sparse: dense attention at layers 0 and 2, sparse at 1 and 3 with K-only index keys
        # (SGLang refuses index values in PD, utils.py:1519-1524), one 64-wide index head.
        config = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m2", "vocab_size": 1024,
                  "hidden_size": 256, "intermediate_size": 256, "dense_intermediate_size": 512,
                  "num_hidden_layers": LAYERS[model], "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 0,
                  "rms_norm_eps": 1e-6, "hidden_act": "silu", "scoring_func": "sigmoid", "num_mtp_modules": 0,
                  "max_position_embeddings": 4096, "rope_theta": 10000, "torch_dtype": "bfloat16",
                  "sparse_attention_config": {
                      "sparse_attention_freq": [0, 1, 0, 1], "sparse_disable_index_value": [0, 1, 0, 1],
                      "sparse_index_dim": 64, "sparse_num_index_heads": 4, "sparse_block_size": 64,
                      "sparse_topk_blocks": 16, "sparse_init_block": 1, "sparse_local_block": 1,
                      "sparse_init_tokens": 64, "sparse_local_tokens": 64}}
    elif model == "qwen4":
        # Qwen4-Exp's text model: GDN at layers 0 and 2, QSA full attention at 1 and 3, its indexer one
        # 64-wide key head compressed 4:1 (budget / ratio must be 512 or 2048, qsa/config.py:66-70).
        config = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
                  "torch_dtype": "bfloat16", "text_config": {
                      "model_type": "qwen4_exp_text", "vocab_size": 1024, "hidden_size": 256,
                      "intermediate_size": 512, "num_hidden_layers": LAYERS[model], "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                      "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                      "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                      "layer_types": ["linear_attention", "qwen_sparse_attention"] * 2, "indexer_n_heads": 4,
                      "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 2048,
                      "indexer_compress_ratio": 4, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
                      "max_position_embeddings": 4096, "rope_theta": 10000, "partial_rotary_factor": 0.25,
                      "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}}
    elif model in ("mla", "dsa", *DSV4):
        config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "n_routed_experts": 8,
                  "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, **mla}
        # "dsa" boots as DeepSeek-V3 too: SGLang resolves a DeepseekV32ForCausalLM config's arguments by
        # asking CUDA for the device capability (arg_groups/model_hook.py:341), which a CPU cannot
        # answer; the transfer path reads only the pool, which build_pools makes a DSATokenToKVPool.
    else:
        config = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "num_experts": 8,
                  "num_shared_experts": 1, "num_experts_per_token": 2, "mla_use_nope": True, **mla,
                  # 1-based, as Kimi Linear's checkpoints list them: MLA at layers 3 and 7.
                  "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], **KDA}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def page_of(model: str) -> int:
    """Tokens per physical page of ``model``'s pools."""
    return PAGE * INDEX_KPOOL if model in ("glm5next", *DSV4) else PAGE


def page_rows(model: str) -> int:
    """Tokens per KV row the harness checks: a whole page for DeepSeek-V4's compressed KV, else one token."""
    return page_of(model) if model in DSV4 else 1


def server_flags(model: str, role: str) -> list[str]:
    """Flags a rank of ``model`` needs on this CPU machine beyond the common ones."""
    if model in ("kimi", "qwen4", "glm5next") and role == "prefill":
        # The prefill's Mamba radix cache needs state snapshots SGLang supports only on GPUs
        # (arg_groups/mamba_hook.py:120); the transfer path does not use it.
        return ["--disable-radix-cache"]
    return []


@dataclass
class Pools:
    """One rank's SGLang pools: the KV pool object, its per-layer KV tensors, the Mamba pool."""

    pool: Any
    kv: list[Any]
    mamba: Any = None
    config: Any = None
    index: list[Any] | None = None
    """The DSA index-K buffers, one ``[pages, 8448]`` uint8 tensor per layer."""
    pages: int = 0
    """Usable pages of the pool (page 0 is its padding page)."""
    types: list[str] = field(default_factory=list)
    """The ``StateType`` value of every state component, in ``setup_state_kv_args``'s order."""
    state: list[list[Any]] = field(default_factory=list)
    """Per state component, per tensor a ``[items, item bytes]`` uint8 view of its buffer."""
    draft: Any = None
    """The speculative draft's KV pool, which ``setup_state_kv_args`` reads too (DeepSeek-V4's DSpark)."""


def _byte_views(ptrs: list[int], lens: list[int], items: list[int]) -> list[Any]:
    """Per buffer SGLang hands the transfer backend (address, bytes, bytes per item), an ``[items, item bytes]``
    uint8 view of it (None for a 0-byte item)."""
    import torch

    return [torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)[: n // it * it].view(-1, it)
            if it else None for p, n, it in zip(ptrs, lens, items)]


def _with_state(pools: Pools, layers: int) -> Pools:
    """``pools`` with the state components ``setup_state_kv_args`` (utils.py:1462) registers for its pool,
    each tensor viewed as bytes from the address and length SGLang gives the transfer backend."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import setup_state_kv_args

    args = SimpleNamespace()
    setup_state_kv_args(args, pools.pool, pools.draft, layers)
    pools.types = [str(t.value) for t in args.state_types]
    pools.state = [_byte_views(*infos) for infos in zip(args.state_data_ptrs, args.state_data_lens,
                                                         args.state_item_lens)]
    return pools


def build_pools(model: str, pool_pages: int, config_dir: str, *, tp: int | None = None,
                role: str = "prefill", stage: tuple[int, int] | None = None) -> Pools:
    """The rank's pools as SGLang builds them; ``tp`` overrides the state TP size (references); ``stage``:
    a PP stage's ``[start, end)`` layers (``dsv4`` only)."""
    pools = _build(model, pool_pages, config_dir, tp, role, stage or (0, LAYERS[model]))
    pools.pages = pool_pages
    return _with_state(pools, LAYERS[model])


def _build(model: str, pool_pages: int, config_dir: str, tp: int | None, role: str,
           stage: tuple[int, int]) -> Pools:
    import torch

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, HybridLinearKVPool, MambaPool, MLATokenToKVPool

    size = pool_pages * page_of(model)
    if model == "gptoss":  # kv_cache_configurator.py:2500-2546 (_build_hybrid_swa_kv_pool) with mxfp8
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        pool = SWAKVPool(
            size=size, size_swa=size, page_size=PAGE, dtype=torch.float8_e4m3fn, post_capture_active=False,
            head_num=2, head_dim=64, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3],
            device="cpu", enable_kv_cache_copy=False, token_to_kv_pool_class=MHATokenToKVPoolMXFP8,
            enable_memory_saver=False,
        )  # fmt: skip
        full = pool.full_kv_pool
        return Pools(pool, [b.view(torch.uint8) for b in full.k_buffer + full.v_buffer])
    if model == "minimax":  # kv_cache_configurator.py:2552-2603 (_build_minimax_sparse_kv_pool)
        from sglang.srt.configs.model_config import (
            get_minimax_sparse_disable_value_layer_ids,
            get_minimax_sparse_layer_ids,
        )
        from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

        sparse = json.loads((Path(config_dir) / "config.json").read_text())["sparse_attention_config"]
        dense_ids, sparse_ids = get_minimax_sparse_layer_ids(sparse)
        pool = MiniMaxSparseKVPool(
            size=size, page_size=PAGE, dtype=torch.bfloat16, index_dtype=torch.bfloat16, head_num=2, head_dim=64,
            idx_head_dim=sparse["sparse_index_dim"], dense_layer_ids=dense_ids, sparse_layer_ids=sparse_ids,
            disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(sparse), device="cpu",
            enable_memory_saver=False, start_layer=0, end_layer=LAYERS[model],
        )  # fmt: skip
        # The main KV SGLang moves is the sparse layers' K, then V (get_sparse_kv_buf_infos).
        return Pools(pool, [pool.get_key_buffer(i) for i in sparse_ids]
                     + [pool.get_value_buffer(i) for i in sparse_ids])
    if model == "qwen4":  # kv_cache_configurator.py:2656-2716 (the QSA branch of the linear pool)
        from sglang.srt.configs.qwen4_exp import Qwen4ExpConfig
        from sglang.srt.layers.attention.qsa.config import parse_qsa_profile
        from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

        config = Qwen4ExpConfig(**json.loads((Path(config_dir) / "config.json").read_text())).text_config
        qsa = parse_qsa_profile(config)
        mamba = MambaPool(size=STATE_SLOTS, spec_state_size=0, cache_params=config.mamba2_cache_params,
                          mamba_layer_ids=config.linear_layer_ids, device="cpu")
        pool = QSATokenToKVPool(
            size=size, dtype=torch.bfloat16, page_size=PAGE, head_num=config.num_key_value_heads,
            head_dim=config.head_dim, full_attention_layer_ids=config.full_attention_layer_ids, device="cpu",
            mamba_pool=mamba, qsa_index_kv_heads=qsa.kv_heads, qsa_index_head_dim=qsa.head_dim,
            qsa_compress_ratio=qsa.compress_ratio, qsa_token_topk=qsa.budget, num_request_slots=STATE_SLOTS + 1,
        )  # fmt: skip
        full = pool.full_kv_pool
        return Pools(pool, full.k_buffer + full.v_buffer, mamba, config)
    if model in DSV4:  # kv_cache_configurator.py:1821-1865 (the DSV4 branch), fp8 KV on a non-SM100 host
        from sglang.srt.layers.attention.dsv4 import unified_kv_gate
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.runtime_context import get_spec

        pool_args = dict(
            max_num_reqs=STATE_SLOTS, swa_size=size, c4_size=size // 4, c128_size=size // 128,
            # A C4 ring per SWA page: 8 rows, 16 under speculation (get_compress_state_ring_size)
            c4_state_pool_size=size // page_of(model) * (16 if model == "dsv41" else 8), c128_state_pool_size=0, page_size=page_of(model),
            swa_page_size=page_of(model), dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=ROPE_DIM, indexer_head_dim=128,
            device="cpu", enable_memory_saver=False, sliding_window=SWA_WINDOW,
        )  # fmt: skip
        unified, gate = model == "dsv4unified", unified_kv_gate.is_unified_kv_triton
        v41 = model == "dsv41"
        if unified:  # ROCm's gate (is_hip() and SGLANG_HACK_FLASHMLA_BACKEND), answered for this pool only
            unified_kv_gate.is_unified_kv_triton = lambda: True
        # V4.1 serves PD speculation with DSpark only, whose draft tokens size the target's compressor rings.
        dspark = dict(speculative_algorithm="DSPARK", **({"speculative_num_draft_tokens": 3} if v41 else {}))
        try:
            with get_spec().override(**dspark) if v41 else contextlib.nullcontext():
                # A stage's layers, as the configurator passes them (SGLang's default end_layer is layer_num - 1).
                pool = DeepSeekV4TokenToKVPool(
                    **pool_args, layer_num=stage[1] - stage[0], start_layer=stage[0], end_layer=stage[1],
                    unified_fp8=unified, **(dict(compression_ratios=DSV41_RATIOS, kv_source_layers=DSV41_SOURCES,
                                                 full_size=size) if v41 else dict(compression_ratios=DSV4_RATIOS)))
        finally:
            unified_kv_gate.is_unified_kv_triton = gate
        for state in (*pool.compress_state_pools, *pool.indexer_compress_state_pools):
            if state is not None:  # torch.empty, then a sentinel row: the check reads unmoved bytes as zeros
                state.kv_score_buffer.kv_score.zero_()
        draft = None
        if not unified:  # a DSpark draft registers request_row only off ROCm (deepseek_v4_memory_pool.py:1245-1260)
            with get_spec().override(**dspark):
                draft = DeepSeekV4TokenToKVPool(**pool_args, layer_num=1, compression_ratios=[0], is_draft_worker=True)
        return Pools(pool, _byte_views(*pool.get_contiguous_buf_infos()), draft=draft)
    if model == "dsa":  # kv_cache_configurator.py:1866 (the DSA branch), arguments as it passes them
        pool = DSATokenToKVPool(
            size=size, page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=torch.bfloat16, qk_rope_head_dim=ROPE_DIM,
            layer_num=LAYERS[model], device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=KV_LORA_RANK + ROPE_DIM,
            # Layer 2 reuses layer 1's top-k, as index_topk_freq 2 makes it (model_config.py:510-522),
            # so its index buffer has 0 rows and SGLang's PD skips it (kv_cache_configurator.py:2368-2373).
            skip_topk_layers=[False, False, True, False],
        )  # fmt: skip
        return Pools(pool, list(pool.kv_buffer), index=list(pool.index_key_cache.buffer))
    if model == "mla":
        pool = MLATokenToKVPool(
            size=size, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=KV_LORA_RANK,
            qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS[model], device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        return Pools(pool, list(pool.kv_buffer))
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.configs.mamba_utils import KimiLinearCacheParams, KimiLinearStateShape

    config = KimiLinearConfig(**json.loads((Path(config_dir) / "config.json").read_text()))
    cache = config.mamba2_cache_params  # what the model runner sizes the pool with (this rank's TP)
    if tp is not None:
        shape = KimiLinearStateShape.create(tp_world_size=tp, num_heads=KDA["num_heads"],
                                            head_dim=KDA["head_dim"], conv_kernel_size=KDA["short_conv_kernel_size"])
        cache = KimiLinearCacheParams(shape=shape, layers=config.linear_layer_ids)
    mamba = MambaPool(size=STATE_SLOTS, spec_state_size=0, cache_params=cache,
                      mamba_layer_ids=config.linear_layer_ids, device="cpu")
    dsa = {} if model != "glm5next" else dict(
        use_dsa=True, index_head_dim=128, kv_cache_dim=KV_LORA_RANK + ROPE_DIM, index_kpool=INDEX_KPOOL,
        index_kpool_compress=True, tail_extra_slots=TAIL_EXTRA[role], max_running_requests=STATE_SLOTS,
    )  # fmt: skip
    pool = HybridLinearKVPool(
        size=size, dtype=torch.bfloat16, page_size=page_of(model), head_num=1, head_dim=KV_LORA_RANK + ROPE_DIM,
        full_attention_layer_ids=config.full_attention_layer_ids, device="cpu", mamba_pool=mamba, use_mla=True,
        kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, **dsa,
    )  # fmt: skip
    index = list(pool.full_kv_pool.index_key_cache.buffer) if dsa else None
    return Pools(pool, list(pool.full_kv_pool.kv_buffer), mamba, config, index=index)


def fill_random(tensor: Any, seed: int) -> None:
    """Seeded bytes into every byte of ``tensor``."""
    import torch

    raw = tensor.view(torch.uint8).reshape(-1)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def _state_tensors(pools: Pools) -> list[tuple[str, Any]]:
    """(field, per-layer tensor [slots, ...]) of every state entry, in SGLang's registration order
    (``MambaPool.get_contiguous_buf_infos``: all conv layers, then all temporal layers)."""
    cache = pools.mamba.mamba_cache
    out = [("conv", layer) for conv in cache.conv for layer in conv]
    return out + [("temporal", layer) for layer in cache.temporal]


def _index_source(pages: int, item: int, layer: int) -> Any:
    """The prefill's index-K buffer of ``layer``: ``pages`` seeded pages of ``item`` bytes."""
    import torch

    out = torch.empty((pages, item), dtype=torch.uint8)
    fill_random(out, SEED * 11 + layer)
    return out


def fill_prefill(pools: Pools) -> None:
    """The prefill's KV and state: seeded bytes (stands in for the forward pass)."""
    for layer, buf in enumerate(pools.kv):
        fill_random(buf, SEED + layer)
    for layer, buf in enumerate(pools.index or ()):
        buf.copy_(_index_source(buf.shape[0], buf.shape[1], layer))
    if pools.mamba is not None:
        for k, (_, tensor) in enumerate(_state_tensors(pools)):
            fill_random(tensor, SEED * 7 + k)
    for k, (name, tensors) in enumerate(zip(pools.types, pools.state)):
        for i, tensor in enumerate(tensors if name in GENERIC or name == "dsa_tail" else ()):
            fill_random(tensor, SEED * 13 + k * 100 + i)


def state_indices(pools: Pools, slot: int, row: Any, prefix: int, tokens: int) -> list[Any]:
    """What prefill.py:1577-1709 / decode.py:1662-1786 pass: one entry per ``kv_args.state_types``.

    ``slot`` is the request's Mamba slot; ``row`` its req_to_token row, ``prefix`` the decode's
    cached prefix and ``tokens`` the sequence length. DSA takes the pages of ``[prefix, tokens)``
    (``_dsa_pages_payload``: ``suffix_page_indices`` at the pool's page size), ``block_scale`` every
    KV page of ``[0, tokens)`` (``_full_kv_pages_payload``), and so do ``qsa_compressed`` and
    ``minimax_dense_kv``; ``minimax_index_k`` the pages of ``[prefix, tokens)``; ``qsa_pending``
    the request's row, ``dsa_tail`` its 6-tuple, ``swa`` and ``block_scale_swa`` the
    SWA-pool pages of the window ``[max(prefix, tokens - window), tokens)`` floored to a page
    (``_swa_payload``), ``swa_ring`` the ring rows of the window's positions, ``request_row`` the row.
    """
    import numpy as np

    import torch

    from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages
    from sglang.srt.disaggregation.utils import get_dsa_tail_state_indices
    from sglang.srt.mem_cache.common import kv_to_page_indices, suffix_page_indices

    page = pools.pool.page_size
    window = max(prefix, tokens - SWA_WINDOW) // page * page

    def swa() -> Any:
        # translate_swa_indices_for_transfer maps full token slots to SWA-pool slots through the
        # allocator's full_to_swa_index_mapping; here full page f is held at SWA page pages + 1 - f,
        # so the two sub-pools' page ids differ, as they do in SGLang.
        full = row[window:tokens].to(torch.int64)
        return kv_to_page_indices((pools.pages + 1 - full // page) * page + full % page, page)

    def swa_ring() -> Any:
        # _swa_ring_payload (prefill.py:1652-1663, decode.py:1728-1737): the window's positions, whatever the
        # decode's prefix, as rows of the request row's ring in the side's own pool.
        ring, window = pools.pool.unified_swa_ring_size, pools.pool.unified_swa_window
        positions = np.arange(max(0, tokens - window), tokens)
        return ((STATE_SLOTS + 1 - slot) * ring + positions % ring).astype(np.int32)

    payloads = {
        "mamba": lambda: np.array([slot], dtype=np.int64),
        # get_qsa_pending_state_indices (utils.py:142-147): the request's req_to_token row, here
        # STATE_SLOTS + 1 - its Mamba slot, so the two components name different items.
        "qsa_pending": lambda: np.array([STATE_SLOTS + 1 - slot], dtype=np.int32),
        "qsa_compressed": lambda: kv_to_page_indices(row[:tokens], page),
        "minimax_index_k": lambda: minimax_index_transfer_pages(row[:tokens], page_size=page, prefix_len=prefix),
        "minimax_dense_kv": lambda: kv_to_page_indices(row[:tokens], page),
        "dsa": lambda: suffix_page_indices(row.unsqueeze(0), 0, prefix, tokens, page),
        "block_scale": lambda: kv_to_page_indices(row[:tokens], page),
        "swa": swa,
        "block_scale_swa": swa,
        # _dsa_tail_payload (prefill.py:1640-1645, decode.py:1716-1721): the live tail of the request's row,
        # here the qsa_pending row, in the side's own ring.
        "dsa_tail": lambda: get_dsa_tail_state_indices(pools.pool, STATE_SLOTS + 1 - slot, tokens),
        # _request_state_payload (prefill.py:1665-1669, decode.py:1739-1742): the request row's C128 ring page
        # holding the pending partial block, none at a block boundary.
        "c128_state": lambda: pools.pool.request_state_transfer_indices(STATE_SLOTS + 1 - slot, tokens),
        "swa_ring": swa_ring,
        # _request_row_payload (prefill.py:1671-1672, decode.py:1744-1745): the request's row.
        "request_row": lambda: np.array([STATE_SLOTS + 1 - slot], dtype=np.int32),
    }
    return [payloads[name]() for name in pools.types]


def _items_differ(got: Any, source: Any, pairs: list[tuple[int, int]]) -> list[int]:
    """Rows of ``got`` (``[items, bytes]``) that are not ``source``'s row s at d for each (s, d), zero elsewhere."""
    import torch

    want = torch.zeros_like(got)
    for s, d in pairs:
        want[d] = source[s]
    return list((got != want).any(dim=1).nonzero().flatten().tolist())


def check_paged(pools: Pools, reference: Pools, rows: dict[int, tuple[Any, Any, int, int]],
                slots: dict[int, tuple[int, int]]) -> list[str]:
    """Every byte of a decode rank's ``GENERIC`` state components: for each room, item i of the
    decode's index list holds item i of the prefill's (``reference``: the prefill's pools, refilled
    from the seed), every other item zero.

    ``rows`` maps room -> (prefill req_to_token row, decode req_to_token row, decode prefix, tokens),
    ``slots`` room -> (prefill Mamba slot, decode Mamba slot).
    """
    mismatches = []
    for k, (name, tensors, sources) in enumerate(zip(pools.types, pools.state, reference.state)):
        if name not in GENERIC:
            continue
        pairs: list[tuple[int, int]] = []
        for room, (src_row, dst_row, prefix, tokens) in rows.items():
            src = state_indices(reference, slots[room][0], src_row, prefix, tokens)[k]
            dst = state_indices(pools, slots[room][1], dst_row, prefix, tokens)[k]
            assert len(src) == len(dst) and (len(src) or name == "c128_state"), (name, src, dst)
            pairs += zip((int(i) for i in src), (int(i) for i in dst))
        for i, (got, source) in enumerate(zip(tensors, sources)):
            if bad := _items_differ(got, source, pairs):
                mismatches.append(f"{name} tensor {i}: items {bad[:8]} differ ({len(bad)})")
    return mismatches


def check_index(pools: Pools, prefill_pages: int, rows: dict[int, tuple[Any, Any, int, int]]) -> list[str]:
    """Every byte of a decode rank's DSA index-K buffers: the prefill's index page of each suffix
    page where the decode's page of those tokens is, zeros everywhere else (the prefix included).

    ``rows`` maps room -> (prefill req_to_token row, decode req_to_token row, decode prefix, tokens);
    the prefill's buffers hold ``prefill_pages`` pages. Pages follow token slots // page (an index page
    per KV page of the side's own slot space), with no SGLang helper in the way.
    """
    if pools.index is None:
        return []
    page = pools.pool.page_size
    pairs = [(int(src[p]) // page, int(dst[p]) // page)
             for src, dst, prefix, tokens in rows.values() for p in range(prefix, tokens, page)]
    mismatches = []
    for layer, got in enumerate(pools.index):
        if not got.shape[0]:
            continue  # a layer sharing the previous layer's top-k holds no index
        if bad := _items_differ(got, _index_source(prefill_pages, got.shape[1], layer), pairs):
            mismatches.append(f"DSA index layer {layer}: pages {bad[:8]} differ ({len(bad)})")
    if not pairs:
        mismatches.append("no DSA index page was expected to move")
    return mismatches


def check_tail(pools: Pools, reference: Pools, rows: dict[int, tuple[Any, Any, int, int]],
               slots: dict[int, tuple[int, int]]) -> list[str]:
    """Every byte of a decode rank's ``dsa_tail`` rings: each room's live slots where SGLang's own remap
    between the two rings puts them (``build_dsa_tail_transfer_blocks``, utils.py:1331-1451, on byte
    offsets), every other byte zero. Arguments as ``check_paged``'s."""
    import torch

    from sglang.srt.disaggregation.utils import build_dsa_tail_transfer_blocks

    mismatches, live = [], 0
    for k, (name, tensors, sources) in enumerate(zip(pools.types, pools.state, reference.state)):
        if name != "dsa_tail":
            continue
        for i, (got, source) in enumerate(zip(tensors, sources)):
            want = torch.zeros_like(got).reshape(-1)
            for room, (src_row, dst_row, prefix, tokens) in rows.items():
                src = state_indices(reference, slots[room][0], src_row, prefix, tokens)[k]
                dst = state_indices(pools, slots[room][1], dst_row, prefix, tokens)[k]
                for s, d, n in build_dsa_tail_transfer_blocks([0], [source.shape[1]], [0], src, dst, [got.shape[1]]):
                    want[d:d + n] = source.reshape(-1)[s:s + n]
                    live += n
            if not torch.equal(got.reshape(-1), want):
                bad = (got.reshape(-1) != want).nonzero().flatten().tolist()
                mismatches.append(f"dsa_tail tensor {i}: {len(bad)} bytes differ, first {bad[:8]}")
    if "dsa_tail" in pools.types and not live:
        mismatches.append("no dsa_tail slot was expected to move")
    return mismatches


def _project(field: str, item: Any, tp: int, rank: int) -> Any:
    """A TP-1 state slot as TP rank ``rank`` of ``tp`` holds it (SGLang's Kimi layouts)."""
    import torch

    if tp == 1:
        return item
    if field == "temporal":  # [H, hd, hd], split by head
        h = item.shape[0] // tp
        return item[rank * h:(rank + 1) * h]
    # conv [K-1, q|k|v]: each of the three channel groups is split on its own
    width = item.shape[1] // 3
    share = width // tp
    return torch.cat([item[:, g * width + rank * share: g * width + (rank + 1) * share] for g in range(3)], dim=1)


def _reference_state(pools: Pools, model: str, config_dir: str) -> list[tuple[str, Any, Any]]:
    """(field, ``pools``' tensor, the TP-1 prefill's tensor as ``fill_prefill`` fills it) of every state entry."""
    reference = build_pools(model, 1, config_dir, tp=1)
    fill_prefill(reference)
    return [(field, mine, src) for (field, mine), (_, src) in zip(_state_tensors(pools), _state_tensors(reference))]


def fill_state_share(pools: Pools, model: str, config_dir: str, tp: int, rank: int) -> None:
    """A plain TP prefill rank's state: in every slot, its share of the TP-1 prefill's (``check_state``'s projection)."""
    if pools.mamba is None or tp == 1:
        return
    for field, mine, src in _reference_state(pools, model, config_dir):
        for slot in range(src.shape[0]):
            mine[slot] = _project(field, src[slot], tp, rank)


def check_state(pools: Pools, model: str, config_dir: str, slots: dict[int, tuple[int, int]], tp: int,
                rank: int) -> list[str]:
    """Every state byte of a decode rank: each room's slot holds its share of the prefill's, zeros elsewhere.

    ``slots`` maps room -> (prefill slot, decode slot).
    """
    import torch

    if pools.mamba is None:
        return []
    mismatches = []
    for k, (field, got, src) in enumerate(_reference_state(pools, model, config_dir)):
        want = torch.zeros_like(got)
        for src_slot, dst_slot in slots.values():
            want[dst_slot] = _project(field, src[src_slot], tp, rank)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad = [s for s in range(got.shape[0]) if not torch.equal(got[s], want[s])]
            mismatches.append(f"state tensor {k} ({field}): slots {bad} differ")
    return mismatches


__all__ = ["AUX_SLOTS", "DSV4", "DSV41_RATIOS", "DSV41_SOURCES", "GENERIC", "LAYERS", "PAGE", "Pools", "ROW_BYTES", "SEED", "SWA_WINDOW", "build_pools",
           "check_index", "check_paged", "check_state", "check_tail", "fill_prefill", "fill_random", "fill_state_share",
           "page_of", "page_rows", "server_flags", "state_indices", "write_config"]
