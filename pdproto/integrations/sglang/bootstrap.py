"""Bootstrap server of the pdproto SGLang backend: SGLang's own registry, unchanged.

Discovery stays SGLang's: each prefill rank registers itself with ``PUT /route`` (its
``rank_ip``/``rank_port``; for pdproto, the rank's gRPC endpoint) and a decode resolves
ranks with ``GET /route`` by prefill DP, CP, TP and PP rank, plus ``/query_dp_ranks`` and
``/health``. Deriving from ``CommonKVBootstrapServer`` also keeps SGLang's Rust-server mode,
which stands in for exactly this class (``managers/disagg_service.py:54-66``).
"""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


class PdprotoKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """The HTTP registry prefill ranks register with and decodes query (SGLang's, as is)."""
