"""What the vLLM tests share: a tiny local MLA model, vLLM configs with PdprotoConnector, the KV cache
config vLLM would build for it, and the byte pattern every prefill row carries.

Imports vLLM: used only in .venv-vllm (tests/vllm is skipped elsewhere, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the wheel cannot infer a device on a CPU-only host

import numpy as np
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

PRELOAD = (
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer.kv_transfer_state",
    "vllm.v1.core.sched.output",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.worker.kv_connector_model_runner_mixin",
    "vllm.v1.worker.utils",
    "pdproto.integrations.vllm.connector",
)
"""What the zygote of the worker processes imports once (``tests/sglang/_zygote.py``, ``command(preload=...)``):
vLLM's import is about 10 s of CPU per process here."""

LAYERS = 4
ROW = 576
"""MLA row elements per token and layer: latent 512, then RoPE 64."""
MAX_LEN = 4096

# A DeepSeek-V2-shaped MLA model, small: vLLM reads only its config (no weights, no tokenizer).
MODEL = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 2, "num_experts_per_tok": 1,
    "first_k_dense_replace": LAYERS, "vocab_size": 1024, "max_position_embeddings": MAX_LEN,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
}


MHA_HEADS = 4
HEAD = 64
MHA_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": LAYERS, "num_attention_heads": MHA_HEADS, "num_key_value_heads": MHA_HEADS,
    "head_dim": HEAD, "vocab_size": 1024, "max_position_embeddings": MAX_LEN, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
}
"""A Llama-shaped MHA model: 4 KV heads of 64."""


def model_dir(root: Path, config: dict[str, Any] = MODEL) -> str:
    """A model directory holding only ``config``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def model_config(model: str) -> ModelConfig:
    """vLLM's config of the model directory ``model`` (inspects its architecture once per machine)."""
    return ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_LEN)


def vllm_config(model: str, role: str, *, tp: int = 1, dcp: int = 1, block_size: int = 16, port: int = 0,
                engine: str = "mooncake", policy: str = "fail", extra: dict[str, Any] | None = None,
                engine_id: str | None = None) -> VllmConfig:
    """A vLLM config with PdprotoConnector in ``role`` (validated by vLLM as it is built)."""
    settings: dict[str, Any] = {"engine": engine, **({"port": port} if port else {}), **(extra or {})}
    return VllmConfig(
        model_config=model_config(model),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_LEN, max_num_seqs=16, max_model_len=MAX_LEN,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="PdprotoConnector",
                                            kv_connector_module_path="pdproto.integrations.vllm", kv_role=role,
                                            engine_id=engine_id, kv_connector_extra_config=settings,
                                            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))


def layer_names() -> list[str]:
    """vLLM's names of the model's attention layers."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def mla_cache_config(block_size: int, num_blocks: int, mha_heads: int = 0) -> KVCacheConfig:
    """The KV cache config vLLM builds for the model: one MLA group (or MHA with ``mha_heads`` on this rank),
    every layer in one allocation, layer-compact."""
    spec: FullAttentionSpec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=ROW,
                                               dtype=torch.bfloat16)
    if mha_heads:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=mha_heads, head_size=HEAD, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = layer_names()
    tensor = KVCacheTensor(size=page * num_blocks * len(names), layers=names, layer_stride=page * num_blocks,
                           block_stride=page)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout="LBNHC")


def hybrid_layer_names() -> tuple[list[str], list[str]]:
    """A Mamba2/MLA hybrid's attention layers (0, 2) and Mamba2 mixers (1, 3)."""
    return ([f"model.layers.{i}.self_attn.attn" for i in range(0, LAYERS, 2)],
            [f"model.layers.{i}.mixer" for i in range(1, LAYERS, 2)])


def hybrid_cache_config(config: VllmConfig, num_blocks: int, ssm_dtype: str = "float32") -> KVCacheConfig:
    """The KV cache config vLLM builds (``get_kv_cache_config_from_groups``) for a small Mamba2/MLA hybrid in
    ``--mamba-cache-mode none``: an MLA group and a Mamba2 group (per-rank state shapes from vLLM's calculator,
    the conv layout per ``VLLM_SSM_CONV_STATE_LAYOUT``), the Mamba page padded to the MLA page of 16 tokens."""
    block = config.cache_config.block_size
    mla = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=ROW, dtype=torch.bfloat16)
    shapes = MambaStateShapeCalculator.mamba2_state_shape(tp_world_size=config.parallel_config.tensor_parallel_size,
                                                          intermediate_size=256, n_groups=1, num_heads=8,
                                                          head_dim=32, state_size=16, conv_kernel=4)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", ssm_dtype)
    mamba = MambaSpec(block_size=MAX_LEN, shapes=shapes, dtypes=dtypes, page_size_padded=mla.page_size_bytes,
                      mamba_cache_mode=config.cache_config.mamba_cache_mode)
    attention, mixers = hybrid_layer_names()
    config.cache_config.kv_cache_layout = "LBNHC"
    config.cache_config.num_gpu_blocks_override = num_blocks
    return get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(attention, mla), KVCacheGroupSpec(mixers, mamba)],
                                           mla.page_size_bytes * len(attention) * num_blocks)


def rows(layer: int, tokens: np.ndarray, seed: int, width: int = ROW) -> np.ndarray:
    """The prefill's rows of ``tokens`` in ``layer``: ``width`` int16 words, distinct per layer, token and request."""
    base = (layer * 1_000_003 + seed * 7_919 + tokens.astype(np.int64)[:, None] * 577 + np.arange(width)) % 32_749
    return (base + 1).astype(np.int16)  # never 0: a row left unwritten stays 0


def scheduler(config: VllmConfig, block_size: int, num_blocks: int, *, hybrid: bool = False) -> Scheduler:
    """vLLM's own scheduler over the model's KV cache config (or the hybrid's), with the config's connector."""
    config.cache_config.num_gpu_blocks = num_blocks
    cache = hybrid_cache_config(config, num_blocks) if hybrid else mla_cache_config(block_size, num_blocks)
    block, hashed = resolve_kv_cache_block_sizes(cache, config)  # the hybrid's: lcm(16, Mamba's MAX_LEN), 16
    return Scheduler(vllm_config=config, kv_cache_config=cache,
                     structured_output_manager=StructuredOutputManager(config), block_size=block,
                     hash_block_size=hashed)


def request(request_id: str, tokens: int, params: dict[str, Any], block_size: int) -> Request:
    """A greedy one-token request of ``tokens`` prompt tokens with these ``kv_transfer_params``."""
    init_none_hash(sha256)
    return Request(request_id, list(range(1, tokens + 1)),
                   SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def runner_output(reqs: list[Request], **kv: set[str]) -> ModelRunnerOutput:
    """What the model runner returns for a step: one sampled token per request, and the connector's sets."""
    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids],
                             kv_connector_output=KVConnectorOutput(**kv) if kv else None)
