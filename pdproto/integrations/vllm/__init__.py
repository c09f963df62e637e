"""vLLM 0.33.0 KV connector ``PdprotoConnector``, loaded through vLLM's ``kv_connector_module_path``.

``--kv-transfer-config '{"kv_connector": "PdprotoConnector", "kv_connector_module_path":
"pdproto.integrations.vllm", "kv_role": "kv_producer" | "kv_consumer", ...}'`` makes vLLM's
``KVConnectorFactory`` take ``PdprotoConnector`` from this package: prefill workers serve
pdproto's handshake service over their KV cache, decode workers register with them and
have each request's blocks written (``connector.py``). Importing this package imports
nothing from vLLM; reading ``PdprotoConnector`` does. See README.md here and docs/vllm.md.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``PdprotoConnector`` on first use (it imports vLLM)."""
    if name == "PdprotoConnector":
        from .connector import PdprotoConnector

        return PdprotoConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PdprotoConnector"]
