"""pdproto: a typed, versioned prefill/decode KV handshake for disaggregated LLM serving."""

from pdproto import _moved

PROTOCOL_MAJOR = 1
"""Protocol major version this package speaks; peers with another major are rejected."""

PROTOCOL_MINOR = 1
"""Protocol minor version this package speaks; newer minors only add fields."""

_moved.install()  # the import paths issue 32 moved keep working, deprecated (_moved.py)

__all__ = ["PROTOCOL_MAJOR", "PROTOCOL_MINOR"]
