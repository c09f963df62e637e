"""Decode-side gRPC client of ``pdproto.v1.HandshakeService`` (blocking and asyncio), and the decode peer.

The public names are here; what each does, and the private modules behind them: README.md here.
Sessions, their resume, and the unary calls of ``session=False``: the top README, docs/protocol.md 2b.
"""

from __future__ import annotations

from pdproto.errors import UnavailableError, error_class
from pdproto.rpc import ChannelConfig, error_from_rpc
from pdproto.session import TERMINAL_STATES
from pdproto.v1 import SERVICE_NAME

from ._async import AsyncHandshakeClient
from ._rpc import RetryConfig
from ._sync import HandshakeClient
from .peer import DecodePeer, PrefillRank

__all__ = [
    "AsyncHandshakeClient",
    "ChannelConfig",
    "DecodePeer",
    "HandshakeClient",
    "PrefillRank",
    "RetryConfig",
    "SERVICE_NAME",
    "TERMINAL_STATES",
    "UnavailableError",
    "error_class",
    "error_from_rpc",
]
