"""Which address a transfer engine advertises to its peers.

A Mooncake engine advertises ``host:port`` in its session id, and a peer on another host
connects there. 127.0.0.1 (the engine's own default) works only when prefill and decode
share a host, and fails every transfer otherwise. So, in order:

1. ``PDPROTO_ADVERTISE_HOST`` (or an executor's ``host`` option, which the decode's
   ``--advertise-host`` flag sets) when given;
2. the source address of the route toward ``toward`` (the prefill, when known), or toward
   the default route;
3. the first non-loopback IPv4 address of an interface that is up;
4. 127.0.0.1 (a host with loopback only).

Finding the route source sends no packet: it is a UDP ``connect``, which only asks the
kernel's routing table.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from pdproto.negotiation.reach import ADVERTISE_ENV, is_loopback

_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_SOMEWHERE = "198.51.100.1"
"""A documentation address (TEST-NET-2): the route toward it is the default route."""


def route_source(toward: str) -> str | None:
    """The local address the kernel would send from toward ``toward``; None without a route."""
    try:
        family = socket.AF_INET6 if ":" in toward else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface that is up and has one, in interface order."""
    out: list[tuple[str, str]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req), 16)[0]
                if not flags & _IFF_UP:
                    continue
                out.append((name, socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])))
            except OSError:
                continue  # no IPv4 address
    return out


def advertise_host(toward: str | None = None) -> str:
    """The address to advertise: ``PDPROTO_ADVERTISE_HOST``, else a routable one (see the module doc)."""
    configured = os.environ.get(ADVERTISE_ENV, "").strip()
    if configured:
        return configured
    for target in ([toward] if toward else []) + [_SOMEWHERE]:
        source = route_source(target)
        if source and (not is_loopback(source) or target == toward):
            return source
    for _, address in interface_addresses():
        if not is_loopback(address):
            return address
    return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The interface that holds ``address``, if one does."""
    return next((name for name, addr in interface_addresses() if addr == address), None)


__all__ = ["advertise_host", "interface_addresses", "interface_of", "route_source"]
