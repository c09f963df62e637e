"""pdproto: a typed, versioned prefill/decode KV handshake for disaggregated LLM serving."""

PROTOCOL_MAJOR = 1
"""Protocol major version this package speaks; peers with another major are rejected."""

PROTOCOL_MINOR = 1
"""Protocol minor version this package speaks; newer minors only add fields."""

__all__ = ["PROTOCOL_MAJOR", "PROTOCOL_MINOR"]
