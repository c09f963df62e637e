"""What both gRPC ends share (see README.md here): channel options, and errors to statuses and back.

The server (``pdproto_server``) and the client (``pdproto.client``) import this package;
neither imports the other.
"""

from __future__ import annotations

from .channel import ChannelConfig
from .status import (
    DOMAIN,
    build_status,
    command_error,
    error_from_command,
    error_from_parts,
    error_from_rpc,
    grpc_code,
    status_for,
)

__all__ = [
    "DOMAIN",
    "ChannelConfig",
    "build_status",
    "command_error",
    "error_from_command",
    "error_from_parts",
    "error_from_rpc",
    "grpc_code",
    "status_for",
]
