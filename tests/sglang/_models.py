"""The model shapes the SGLang harness runs, built from SGLang's own pool classes.

* ``mla``: a DeepSeek-V3-shaped MLA pool (``MLATokenToKVPool``, 4 layers, 576 bf16 values =
  1152 bytes per token), aux buffers, no state.
* ``dsa``: a DeepSeek-V3.2-shaped pool (``DeepseekV32ForCausalLM``; see ``write_config``):
  SGLang's ``DSATokenToKVPool``, the same MLA rows plus per layer an index-K buffer of one
  8,448-byte page (64 tokens of 128 fp8 + 4 scale bytes) per KV page, which SGLang moves as
  its one ``dsa`` state component; on a DCP decode the buffer covers every (virtual) token.
  Layer 2 shares layer 1's top-k, so its buffer has 0 rows and nothing moves for it.
* ``kimi``: a Kimi-Linear-shaped hybrid: SGLang's ``KimiLinearConfig`` (8 layers; KDA at
  layers 0-2 and 4-6, MLA at 3 and 7), its ``HybridLinearKVPool(use_mla=True)`` over a
  ``MambaPool`` built from the config's own ``mamba2_cache_params`` (conv state
  ``[K-1, q|k|v]`` bf16, temporal state ``[H, hd, hd]`` fp32 per KDA layer), aux buffers.

Both sides derive every byte from one seed. A decode rank checks its whole KV pool, every
aux buffer and every state tensor against what it must hold: the prefill's bytes where they
belong, projected onto the rank's share under TP (computed here by plain slicing of SGLang's
layouts, not by pdproto), zeros elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 64  # physical page (tokens); a DCP decode's virtual page is PAGE * dcp
KV_LORA_RANK, ROPE_DIM = 512, 64  # MLA row: 576 bf16 values, 1152 bytes
ROW_BYTES = (KV_LORA_RANK + ROPE_DIM) * 2
AUX_SLOTS = 16
STATE_SLOTS = 16  # mamba slots per pool (SGLang adds padding slot 0)
SEED = 1234
LAYERS = {"mla": 4, "dsa": 4, "kimi": 8}
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
    if model in ("mla", "dsa"):
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


def server_flags(model: str, role: str) -> list[str]:
    """Flags a rank of ``model`` needs on this CPU machine beyond the common ones."""
    if model == "kimi" and role == "prefill":
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


def build_pools(model: str, pool_pages: int, config_dir: str, *, tp: int | None = None) -> Pools:
    """The rank's pools as SGLang builds them; ``tp`` overrides the state TP size (references)."""
    import torch

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, HybridLinearKVPool, MambaPool, MLATokenToKVPool

    size = pool_pages * PAGE
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
    pool = HybridLinearKVPool(
        size=size, dtype=torch.bfloat16, page_size=PAGE, head_num=1, head_dim=KV_LORA_RANK + ROPE_DIM,
        full_attention_layer_ids=config.full_attention_layer_ids, device="cpu", mamba_pool=mamba, use_mla=True,
        kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
    )  # fmt: skip
    return Pools(pool, list(pool.full_kv_pool.kv_buffer), mamba, config)


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


def state_indices(pools: Pools, slot: int, row: Any, prefix: int, tokens: int) -> list[Any]:
    """What prefill.py:1577-1709 / decode.py:1662-1786 pass: one entry per ``kv_args.state_types``.

    ``slot`` is the request's Mamba slot; ``row`` its req_to_token row, ``prefix`` the decode's
    cached prefix and ``tokens`` the sequence length, from which DSA takes the pages of
    ``[prefix, tokens)`` (``_dsa_pages_payload``: ``suffix_page_indices`` at the pool's page size).
    """
    import numpy as np

    from sglang.srt.mem_cache.common import suffix_page_indices

    if pools.index is not None:
        return [suffix_page_indices(row.unsqueeze(0), 0, prefix, tokens, pools.pool.page_size)]
    return [] if pools.mamba is None else [np.array([slot], dtype=np.int64)]


def check_index(pools: Pools, prefill_pages: int, rows: dict[int, tuple[Any, Any, int, int]]) -> list[str]:
    """Every byte of a decode rank's DSA index-K buffers: the prefill's index page of each suffix
    page where the decode's page of those tokens is, zeros everywhere else (the prefix included).

    ``rows`` maps room -> (prefill req_to_token row, decode req_to_token row, decode prefix, tokens);
    the prefill's buffers hold ``prefill_pages`` pages. Pages follow token slots // 64 (index pages
    are 64 tokens of the side's own slot space), with no SGLang helper in the way.
    """
    import torch

    if pools.index is None:
        return []
    pairs = [(int(src[p]) // 64, int(dst[p]) // 64)
             for src, dst, prefix, tokens in rows.values() for p in range(prefix, tokens, 64)]
    mismatches = []
    for layer, got in enumerate(pools.index):
        if not got.shape[0]:
            continue  # a layer sharing the previous layer's top-k holds no index
        source = _index_source(prefill_pages, got.shape[1], layer)
        want = torch.zeros_like(got)
        for s, d in pairs:
            want[d] = source[s]
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        if bad:
            mismatches.append(f"DSA index layer {layer}: pages {bad[:8]} differ ({len(bad)})")
    if not pairs:
        mismatches.append("no DSA index page was expected to move")
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


def check_state(pools: Pools, model: str, config_dir: str, slots: dict[int, tuple[int, int]], tp: int,
                rank: int) -> list[str]:
    """Every state byte of a decode rank: each room's slot holds its share of the prefill's, zeros elsewhere.

    ``slots`` maps room -> (prefill slot, decode slot).
    """
    import torch

    if pools.mamba is None:
        return []
    reference = build_pools(model, 1, config_dir, tp=1)
    fill_prefill(reference)
    mismatches = []
    for k, ((field, got), (_, src)) in enumerate(zip(_state_tensors(pools), _state_tensors(reference))):
        want = torch.zeros_like(got)
        for src_slot, dst_slot in slots.values():
            want[dst_slot] = _project(field, src[src_slot], tp, rank)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad = [s for s in range(got.shape[0]) if not torch.equal(got[s], want[s])]
            mismatches.append(f"state tensor {k} ({field}): slots {bad} differ")
    return mismatches


__all__ = ["AUX_SLOTS", "LAYERS", "PAGE", "Pools", "ROW_BYTES", "SEED", "build_pools", "check_index", "check_state",
           "fill_prefill", "fill_random", "server_flags", "state_indices", "write_config"]
