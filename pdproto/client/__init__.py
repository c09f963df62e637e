"""Decode-side gRPC client of ``pdproto.v1.HandshakeService`` (sync and asyncio).

Register returns a peer credential with the peer id; the client keeps it and sends it with
every later call for that peer (``credential(peer_id)`` hands it to another process,
``adopt`` takes one in). Every call carries a deadline; every non-OK status is raised as the
``pdproto.errors`` class of its ``google.rpc.ErrorInfo`` reason (``error_class``), with
the metadata attached and the original ``grpc.RpcError`` as ``__cause__``. Only errors
whose class is declared retryable (the UNAVAILABLE ones: ``UnavailableError``,
``ShuttingDownError``) are retried, with exponential backoff inside the call's deadline.

By default submits, aborts and status waits of a peer travel on one Session stream
(``_session.py``): a broken stream is resumed within the caller's deadline,
and what the server has not acknowledged is sent again, so no result or terminal status
is lost or repeated. A deadline that passes while the stream is still broken (a dead or
unreachable prefill) raises ``UnavailableError`` naming the cause. ``session=False`` (or a
server without the Session RPC) uses the unary calls; ``watch_status`` then re-opens a
broken WatchStatus stream within its deadline, dropping what it already delivered.

``AsyncHandshakeClient`` is the implementation; ``HandshakeClient`` runs it on one event loop
thread the process's blocking clients share, so it may be called from several threads at once.

``DecodePeer`` (``peer.py``) is the decode peer built on the async client: registered with
every prefill rank it is pointed at, it submits requests, folds the ranks' statuses into one
outcome per room and aborts; engine adapters and the demo's decode rank use it.

The public names are here; the modules behind them are private (README.md here).
"""

from __future__ import annotations

from pdproto.errors import UnavailableError, error_class
from pdproto.rpc import ChannelConfig, error_from_rpc
from pdproto.v1 import SERVICE_NAME

from ._async import AsyncHandshakeClient
from ._rpc import TERMINAL_STATES, RetryConfig
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
