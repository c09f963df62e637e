"""The one spelling of a KV cache dtype every engine adapter publishes (``kv_cache_dtype``).

Negotiation compares ``PrefillServerInfo.kv_cache_dtype`` with ``KvRegistration.kv_cache_dtype``
as strings (docs/protocol.md, rule 6), and the engines spell one dtype differently: SGLang's
``--kv-cache-dtype`` says ``bf16`` or ``bfloat16`` and its resolver ``bf16`` for the same cache,
vLLM's cache dtype names ``fp8`` for e4m3 and its ``auto`` resolves to torch's ``bfloat16``.
Each adapter passes what its engine says through ``kv_dtype``; what comes out is the canonical
name (the table in docs/protocol.md, section 1).
"""

from __future__ import annotations

CANONICAL = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e4m3fnuz": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2",
}
"""Engine spellings (torch names without ``torch.``) -> the canonical name. Other names (``mxfp8``,
``fp8_ds_mla``, ``nvfp4``, ...) are layouts of their own: published as the engine spells them, so two
engines that name them differently are refused, never mixed."""


def kv_dtype(name: object) -> str:
    """The canonical KV dtype of an engine's spelling; ``""`` (unset: not compared) for ``auto`` or none,
    which say "the model's dtype" without naming it (the row size is still compared, rule 14)."""
    text = str(name or "").strip().lower().removeprefix("torch.")
    if text in ("", "auto", "none"):
        return ""
    return CANONICAL.get(text, text)


__all__ = ["CANONICAL", "kv_dtype"]
