"""Deployment rules (pdproto.negotiation.config): one test per finding code, plus clean configs."""

from __future__ import annotations

from typing import Any

import pytest

from pdproto.negotiation.config import (
    CacheMode,
    DeploymentConfig,
    Role,
    Severity,
    check_deployment,
    effective_cache,
)
from pdproto.errors import Reason

P, D = Role.PREFILL, Role.DECODE


def codes(cfg: DeploymentConfig) -> dict[str, Severity]:
    """Finding code -> severity."""
    return {f.code: f.severity for f in check_deployment(cfg)}


@pytest.mark.parametrize("cfg", [
    DeploymentConfig(role=P),
    DeploymentConfig(role=D),
    DeploymentConfig(role=D, dcp_size=4, attention="mla", backend="nixl"),
    DeploymentConfig(role=D, dcp_size=4, cache=CacheMode.CHUNK, page_size=16),
    DeploymentConfig(role=D, allocation_policy="prefill_complete"),
    DeploymentConfig(role=P, cache=CacheMode.HIERARCHICAL, retraction_backup="host_pool"),
])
def test_clean_configs_have_no_findings(cfg: DeploymentConfig) -> None:
    assert check_deployment(cfg) == []


CASES: list[tuple[dict[str, Any], str, Severity]] = [
    ({"role": D, "dcp_size": 0}, "SIZE_INVALID", Severity.ERROR),
    ({"role": D, "page_size": 0}, "SIZE_INVALID", Severity.ERROR),
    ({"role": D, "backend": "rdma"}, "BACKEND_UNKNOWN", Severity.ERROR),
    ({"role": D, "allocation_policy": "late"}, "ALLOCATION_POLICY_UNKNOWN", Severity.ERROR),
    ({"role": D, "attention": "gqa"}, "ATTENTION_UNKNOWN", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "attention": "mha"}, "DCP_REQUIRES_MLA", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "backend": "mori"}, "DECODE_DCP_BACKEND", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "backend": "ascend"}, "DECODE_DCP_BACKEND", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "backend": "fake"}, "DECODE_DCP_BACKEND", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "backend": "local"}, "DECODE_DCP_LOCAL_BACKEND", Severity.WARNING),
    ({"role": D, "dcp_size": 2, "cache": CacheMode.RADIX}, "DECODE_DCP_RADIX_CACHE", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "cache": CacheMode.HIERARCHICAL},
     "DECODE_DCP_HIERARCHICAL_CACHE", Severity.ERROR),
    ({"role": P, "dcp_size": 2}, "PREFILL_DCP_OVERHEAD", Severity.WARNING),
    ({"role": D, "dcp_size": 2, "role_switch": True}, "ROLE_SWITCH_DCP", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "retraction_backup": "host_pool"},
     "RETRACTION_HOST_POOL_DCP", Severity.ERROR),
    ({"role": D, "dcp_size": 2, "unified_memory": True}, "UNIFIED_MEMORY_DCP", Severity.ERROR),
    ({"role": P, "dcp_size": 2, "kv_cache_sharding": True}, "KV_SHARDING_DCP", Severity.ERROR),
    ({"role": P, "dcp_size": 2, "attn_cp_size": 2}, "PREFILL_CP_DCP", Severity.ERROR),
    ({"role": P, "dcp_size": 4, "page_size": 16, "radix_page_size": 16},
     "RADIX_PAGE_SIZE", Severity.ERROR),
    ({"role": P, "dcp_size": 2, "cache": CacheMode.HIERARCHICAL, "speculative_algorithm": "eagle"},
     "HICACHE_DCP_SPECULATIVE", Severity.ERROR),
    ({"role": D, "allocation_policy": "prefill_complete", "dcp_size": 2},
     "PREFILL_COMPLETE_POLICY", Severity.ERROR),
    ({"role": D, "allocation_policy": "prefill_complete", "backend": "nixl"},
     "PREFILL_COMPLETE_POLICY", Severity.ERROR),
    ({"role": D, "allocation_policy": "prefill_complete", "pp_size": 2},
     "PREFILL_COMPLETE_POLICY", Severity.ERROR),
    ({"role": P, "allocation_policy": "prefill_complete", "attn_cp_size": 2},
     "PREFILL_COMPLETE_POLICY", Severity.ERROR),
]


@pytest.mark.parametrize(("kwargs", "code", "severity"), CASES,
                         ids=[f"{c}-{i}" for i, (_, c, _s) in enumerate(CASES)])
def test_rule(kwargs: dict[str, Any], code: str, severity: Severity) -> None:
    cfg = DeploymentConfig(**kwargs)
    found = codes(cfg)
    assert found.get(code) is severity, found
    assert all(f.reason is Reason.CONFIG_INVALID for f in check_deployment(cfg))


def test_radix_page_size_matching_the_virtual_page_is_fine() -> None:
    cfg = DeploymentConfig(role=P, dcp_size=4, page_size=16, radix_page_size=64)
    assert "RADIX_PAGE_SIZE" not in codes(cfg)


def test_decode_dcp_forces_chunk_cache() -> None:
    assert effective_cache(DeploymentConfig(role=D, dcp_size=4)) is CacheMode.CHUNK
    assert effective_cache(DeploymentConfig(role=D)) is CacheMode.RADIX
    assert effective_cache(DeploymentConfig(role=P, dcp_size=4)) is CacheMode.RADIX


def test_all_findings_are_reported_together() -> None:
    cfg = DeploymentConfig(role=D, dcp_size=2, backend="mori", cache=CacheMode.RADIX,
                           role_switch=True, unified_memory=True)
    assert {"DECODE_DCP_BACKEND", "DECODE_DCP_RADIX_CACHE", "ROLE_SWITCH_DCP",
            "UNIFIED_MEMORY_DCP"} <= set(codes(cfg))
    assert check_deployment(cfg) == check_deployment(cfg)  # fixed order


def test_prefill_complete_message_names_every_violation() -> None:
    cfg = DeploymentConfig(role=D, allocation_policy="prefill_complete", dcp_size=2,
                           backend="nixl", pp_size=2, attention="mla")
    (f,) = [f for f in check_deployment(cfg) if f.code == "PREFILL_COMPLETE_POLICY"]
    for part in ("dcp_size 2", "backend nixl", "pp_size 2"):
        assert part in f.message
