"""Deployment rules for PD disaggregation with DCP, reported as findings.

``check_deployment(cfg)`` looks at one server's settings (a ``DeploymentConfig``) and
returns every rule it breaks, errors and warnings alike, so an operator sees all of
them at once instead of fixing one crash at a time. The rules are SGLang 0.5.23's
(inventory section 4.11, file references in each rule's message) where they apply to
pdproto, plus the cache rule SGLang lacked: a DCP decode keeps a chunk cache, because
its radix tree would index rank-local rows as if they were whole virtual pages.

Each finding has a stable ``code`` (UPPER_SNAKE_CASE, treated as API) and a reason
(CONFIG_INVALID), which ``pdproto check --json`` reports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdproto import backends
from pdproto.errors import Reason


class Role(enum.StrEnum):
    """Which side of PD disaggregation the server runs."""

    PREFILL = "prefill"
    DECODE = "decode"


class CacheMode(enum.StrEnum):
    """Prefix cache kind (SGLang: radix tree, chunk cache with radix off, HiCache)."""

    RADIX = "radix"
    CHUNK = "chunk"
    HIERARCHICAL = "hierarchical"


class Severity(enum.StrEnum):
    """How bad a finding is: an error stops the deployment, a warning does not."""

    ERROR = "error"
    WARNING = "warning"


SGLANG_ONLY_DCP_BACKENDS = frozenset({"mori", "ascend", "fake"})
"""Backends SGLang 0.5.23 also allowed for a DCP decode (pd_hook.py:82-96); not pdproto's."""

KNOWN_BACKENDS = frozenset(backends.NAMES) | SGLANG_ONLY_DCP_BACKENDS
"""Every backend name the checker recognises."""

ALLOCATION_POLICIES = frozenset({"early", "prefill_complete"})
"""Decode allocation policies."""

MLA_KINDS = frozenset({"mla", "hybrid_mla"})
"""Attention kinds whose KV pool DCP can shard."""


@dataclass(frozen=True)
class DeploymentConfig:
    """The settings of one PD server that the rules look at."""

    role: Role
    """Prefill or decode."""
    backend: str = "mooncake"
    """Transfer backend name: mooncake, nixl, local (or SGLang's mori, ascend, fake)."""
    dcp_size: int = 1
    """Decode context parallel size of this server."""
    page_size: int = 1
    """Physical page size in tokens."""
    cache: CacheMode | None = None
    """Prefix cache; None means the default, which a DCP decode forces to CHUNK."""
    radix_page_size: int | None = None
    """Page size of the radix tree/allocator when set explicitly; must be page_size*dcp_size."""
    attention: str | None = None
    """KV pool family: mla, hybrid_mla or mha; None when unknown."""
    pp_size: int = 1
    """Pipeline parallel size."""
    attn_cp_size: int = 1
    """Attention context parallel size (SGLang --enable-prefill-cp)."""
    allocation_policy: str = "early"
    """Decode allocation policy: early or prefill_complete."""
    role_switch: bool = False
    """SGLang --enable-pd-role-switch."""
    retraction_backup: str | None = None
    """Decode retraction backup (SGLang --disaggregation-decode-retraction-backup)."""
    unified_memory: bool = False
    """SGLang --enable-unified-memory."""
    kv_cache_sharding: bool = False
    """SGLang --enable-kv-cache-sharding."""
    speculative_algorithm: str | None = None
    """Speculative decoding algorithm (lower case), or None."""


@dataclass(frozen=True)
class Finding:
    """One broken rule: its severity, stable code, reason and explanation."""

    severity: Severity
    """Error or warning."""
    code: str
    """Stable rule identifier, UPPER_SNAKE_CASE."""
    message: str
    """What is wrong, with the values, and what to change."""
    reason: Reason = Reason.CONFIG_INVALID
    """Machine-readable reason an error carries."""


def effective_cache(cfg: DeploymentConfig) -> CacheMode:
    """The cache the server runs with: a DCP decode is forced to CHUNK, else RADIX by default."""
    if cfg.cache is not None:
        return cfg.cache
    return CacheMode.CHUNK if cfg.role is Role.DECODE and cfg.dcp_size > 1 else CacheMode.RADIX


def _err(code: str, message: str) -> Finding:
    return Finding(Severity.ERROR, code, message)


def _warn(code: str, message: str) -> Finding:
    return Finding(Severity.WARNING, code, message)


def _shape(cfg: DeploymentConfig) -> list[Finding]:
    """Sizes and names that no other rule can be judged without."""
    out = []
    for name in ("dcp_size", "page_size", "pp_size", "attn_cp_size"):
        if getattr(cfg, name) < 1:
            out.append(_err("SIZE_INVALID", f"{name} must be >= 1, got {getattr(cfg, name)}"))
    if cfg.backend not in KNOWN_BACKENDS:
        out.append(_err("BACKEND_UNKNOWN", f"unknown backend {cfg.backend!r};"
                        f" known: {', '.join(sorted(KNOWN_BACKENDS))}"))
    if cfg.allocation_policy not in ALLOCATION_POLICIES:
        out.append(_err("ALLOCATION_POLICY_UNKNOWN",
                        f"unknown allocation policy {cfg.allocation_policy!r};"
                        f" known: {', '.join(sorted(ALLOCATION_POLICIES))}"))
    if cfg.attention is not None and cfg.attention not in MLA_KINDS | {"mha"}:
        out.append(_err("ATTENTION_UNKNOWN", f"unknown attention kind {cfg.attention!r}"))
    return out


def _dcp_rules(cfg: DeploymentConfig) -> list[Finding]:
    """Rules that apply only when this server shards its KV cache with DCP."""
    n = cfg.dcp_size
    out = []
    if cfg.attention is not None and cfg.attention not in MLA_KINDS:
        out.append(_err("DCP_REQUIRES_MLA",
                        f"DCP {n} needs an MLA or hybrid-MLA KV pool, not {cfg.attention}"))
    if cfg.role is Role.DECODE:
        if cfg.backend in SGLANG_ONLY_DCP_BACKENDS:
            out.append(_err("DECODE_DCP_BACKEND",
                            f"decode DCP {n} with backend {cfg.backend}: SGLang 0.5.23 allowed it,"
                            f" but pdproto relayouts run on {' or '.join(backends.MULTI_HOST)} only"))
        elif cfg.backend in backends.NAMES and backends.by_name(cfg.backend).single_host:
            out.append(_warn("DECODE_DCP_LOCAL_BACKEND",
                             f"the {cfg.backend} backend copies within one host: fine for tests and demos,"
                             " not a multi-node deployment"))
        if cfg.cache is CacheMode.RADIX:
            out.append(_err("DECODE_DCP_RADIX_CACHE",
                            f"decode DCP {n} runs with the chunk cache: turn the radix cache off"
                            " (SGLang --disable-radix-cache)"))
        elif cfg.cache is CacheMode.HIERARCHICAL:
            out.append(_err("DECODE_DCP_HIERARCHICAL_CACHE",
                            f"decode DCP {n} runs with the chunk cache: hierarchical cache is not"
                            " supported on a DCP decode"))
    else:
        out.append(_warn("PREFILL_DCP_OVERHEAD",
                         f"prefill DCP {n} works only against a decode with the same DCP layout and"
                         " adds communication without benefit; a dense prefill feeds any decode"
                         " (pd_hook.py:57-62)"))
    if cfg.role_switch:
        out.append(_err("ROLE_SWITCH_DCP", f"--enable-pd-role-switch rejects DCP {n} (pd_hook.py:164-196)"))
    if cfg.retraction_backup == "host_pool":
        out.append(_err("RETRACTION_HOST_POOL_DCP",
                        f"retraction backup host_pool rejects DCP {n} (kv_cache_hook.py:361-365)"))
    if cfg.unified_memory:
        out.append(_err("UNIFIED_MEMORY_DCP",
                        f"unified memory with DCP {n} is not available under PD (kv_cache_hook.py:740-747)"))
    if cfg.kv_cache_sharding:
        out.append(_err("KV_SHARDING_DCP",
                        f"KV cache sharding and DCP {n} are mutually exclusive (kv_shard_hook.py:170-175)"))
    if cfg.attn_cp_size > 1:
        out.append(_err("PREFILL_CP_DCP",
                        f"attention CP {cfg.attn_cp_size} is incompatible with DCP {n}"
                        " (parallel_hook.py:249-250)"))
    cache = effective_cache(cfg)
    expected = cfg.page_size * n
    if cache is not CacheMode.CHUNK and cfg.radix_page_size not in (None, expected):
        out.append(_err("RADIX_PAGE_SIZE",
                        f"under DCP the radix/allocator page is page_size*dcp_size = {expected}"
                        f" tokens, not {cfg.radix_page_size} (kv_cache_builder.py:393-400)"))
    if cache is CacheMode.HIERARCHICAL and cfg.speculative_algorithm not in (None, "none", "dspark"):
        out.append(_err("HICACHE_DCP_SPECULATIVE",
                        f"hierarchical cache with DCP allows speculative decoding none or dspark,"
                        f" not {cfg.speculative_algorithm} (hicache_hook.py:129-168)"))
    return out


def check_deployment(cfg: DeploymentConfig) -> list[Finding]:
    """Every rule ``cfg`` breaks, errors and warnings, in a fixed order."""
    out = _shape(cfg)
    if any(f.code == "SIZE_INVALID" for f in out):
        return out
    if cfg.dcp_size > 1:
        out += _dcp_rules(cfg)
    if cfg.allocation_policy == "prefill_complete":
        broken = [f"{name} {value}" for name, value, ok in (
            ("dcp_size", cfg.dcp_size, cfg.dcp_size == 1),
            ("backend", cfg.backend, cfg.backend == "mooncake"),
            ("pp_size", cfg.pp_size, cfg.pp_size == 1),
            ("attn_cp_size", cfg.attn_cp_size, cfg.attn_cp_size == 1),
        ) if not ok]
        if broken:
            out.append(_err("PREFILL_COMPLETE_POLICY",
                            "allocation policy prefill_complete needs dcp_size 1, backend mooncake,"
                            f" pp_size 1 and attn_cp_size 1; got {', '.join(broken)}"
                            " (pd_hook.py:199-207)"))
    return out


__all__ = [
    "ALLOCATION_POLICIES",
    "KNOWN_BACKENDS",
    "MLA_KINDS",
    "SGLANG_ONLY_DCP_BACKENDS",
    "CacheMode",
    "DeploymentConfig",
    "Finding",
    "Role",
    "Severity",
    "check_deployment",
    "effective_cache",
]
