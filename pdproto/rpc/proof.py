"""Proof of a token without sending it: the MACs both ends compute (``Authenticate``, docs/protocol.md 2c).

Every MAC field is length-prefixed, and each side's MAC starts with its own label, so no
message of one kind reads as another.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

SCHEME = "Pdproto-HMAC"
"""The ``authorization`` scheme of a call authenticated by a proof."""
NONCE_BYTES = 16
"""Length of the client's nonce."""
MAX_NONCE_BYTES = 64
"""The longest nonce either side accepts."""


def _mac(token: str, *parts: bytes) -> bytes:
    message = b"".join(len(p).to_bytes(4, "big") + p for p in (b"pdproto.v1 token proof", *parts))
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes, address: str) -> bytes:
    """The server's answer to a challenge: it holds ``token`` and answers at ``address`` (canonical)."""
    return _mac(token, b"server", client_nonce, server_nonce, address.encode())


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The client's proof of ``token`` for the session the two nonces name."""
    return _mac(token, b"client", server_nonce, client_nonce)


def header(token: str, server_nonce: bytes, client_nonce: bytes) -> str:
    """The ``authorization`` value of every call after ``Authenticate``."""
    return f"{SCHEME} {server_nonce.hex()} {client_nonce.hex()} {client_proof(token, server_nonce, client_nonce).hex()}"


def parse_header(value: str) -> tuple[bytes, bytes, bytes] | None:
    """(server nonce, client nonce, client proof) of an ``authorization`` value; None when it is not one."""
    parts = value.split(" ")
    if len(parts) != 4 or parts[0] != SCHEME or any(len(p) > 2 * MAX_NONCE_BYTES for p in parts[1:]):
        return None
    try:
        server_nonce, client_nonce, proof = (bytes.fromhex(p) for p in parts[1:])
    except ValueError:
        return None
    return server_nonce, client_nonce, proof


def canonical_host(host: str) -> str:
    """A host as both ends compare it: an IP literal in its compressed form, a name in lower case."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower()


def canonical_address(target: str) -> str:
    """``host:port`` as both ends compare it (``canonical_host``, IPv6 in brackets); ``target`` may
    carry gRPC's ``dns:``/``ipv4:``/``ipv6:`` scheme."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, _, port = target.rpartition(":")
    host = canonical_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["MAX_NONCE_BYTES", "NONCE_BYTES", "SCHEME", "canonical_address", "canonical_host", "client_proof", "header",
           "parse_header", "server_proof"]
