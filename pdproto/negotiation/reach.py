"""Can the prefill reach the engine a decode advertises? The pure rule the service applies at Register.

A decode's transfer engine advertises an address in its registration (Mooncake: the host of
``session_id``). A decode on another host that advertises a loopback address registers
fine and then fails every transfer (``PEER_GONE``): the prefill's loopback is not the
decode's. The rule refuses that registration up front, with a reason that says what to set.

Executors advertise a routable address by default (``pdproto.transfer.address``); an
operator sets one with the ``PDPROTO_ADVERTISE_HOST`` environment variable or the decode's
``--advertise-host`` flag. This module is core: no sockets, only ``ipaddress``.
"""

from __future__ import annotations

import functools
import ipaddress
from urllib.parse import unquote

from pdproto import backends
from pdproto.v1 import registration_pb2

ADVERTISE_ENV = "PDPROTO_ADVERTISE_HOST"
"""Environment variable naming the address a process's transfer engine advertises."""


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); False for names it cannot tell."""
    # Remembered, as grpc_peer_host is: every Register asks about its caller's address and its
    # engine's, a few of them per fleet, and parsing them was a tenth of a Register's own time.
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=1024)
def grpc_peer_host(peer: str) -> str | None:
    """The host of a gRPC peer string (``ipv4:10.0.0.2:5000``, ``ipv6:[::1]:5000``); None for ``unix:``
    and the unknown."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]") or None
    return None


def engine_host(registration: registration_pb2.KvRegistration) -> tuple[str, str] | None:
    """(field path, host) the registration's engine advertises; None when its endpoint names no host."""
    spec = backends.of_registration(registration)
    if spec is None or not spec.host_in:
        return None
    value = str(getattr(getattr(registration, spec.transport), spec.host_in))
    host = value.rpartition(":")[0].strip("[]") if ":" in value else value
    return (f"registration.{spec.transport}.{spec.host_in}", host) if host else None


def unreachable(registration: registration_pb2.KvRegistration, peer: str) -> list[tuple[str, str]]:
    """(field, reason) pairs for an engine endpoint on loopback registered from a non-loopback peer.

    ``peer`` is the gRPC peer string of the Register call. Empty when the peer is on
    loopback itself, unknown, or the endpoint names no host.
    """
    peer_host = grpc_peer_host(peer)
    if peer_host is None or is_loopback(peer_host):
        return []
    found = engine_host(registration)
    if found is None or not is_loopback(found[1]):
        return []
    field, host = found
    return [(field, f"the decode's engine advertises {host}, a loopback address, but it registered from "
                    f"{peer_host}: this prefill cannot reach it there. On the decode, set {ADVERTISE_ENV} "
                    f"(or --advertise-host) to an address this prefill can reach, e.g. {peer_host}")]


__all__ = ["ADVERTISE_ENV", "engine_host", "grpc_peer_host", "is_loopback", "unreachable"]
