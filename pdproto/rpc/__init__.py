"""What both gRPC ends share (see README.md here): channel options, and errors to statuses and back."""

from __future__ import annotations

from .channel import ChannelConfig
from .status import build_status, error_from_rpc, grpc_code

__all__ = [
    "ChannelConfig",
    "build_status",
    "error_from_rpc",
    "grpc_code",
]
