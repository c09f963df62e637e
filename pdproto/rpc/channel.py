"""Transport options both gRPC ends must agree on: keepalive, message sizes, reconnect backoff."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChannelConfig:
    """Transport options that must agree between server and client (keepalive, sizes)."""

    max_message_bytes: int = 4 << 20
    """Largest message either side sends or accepts (control messages are small)."""
    keepalive_time_ms: int = 30_000
    """Client ping interval; must be >= the server's ``min_ping_interval_ms``."""
    keepalive_timeout_ms: int = 10_000
    """How long a ping may go unanswered before the connection is considered dead."""
    min_ping_interval_ms: int = 10_000
    """Server: the most frequent ping it tolerates (else GOAWAY too_many_pings)."""
    permit_without_calls: bool = True
    """Ping idle connections too, so a dead peer is noticed before the next call."""

    def _common(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.permit_without_calls)),
        ]

    def client_options(self) -> list[tuple[str, Any]]:
        """Channel arguments for the client."""
        # gRPC's own retry layer stays off: ours retries only UNAVAILABLE, inside the deadline.
        # Short reconnect backoff: after a prefill restart the default (1 s growing to 120 s)
        # outlived whole deadlines, so a re-registering decode never reached the new server.
        return [*self._common(), ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]

    def server_options(self) -> list[tuple[str, Any]]:
        """Server arguments matching ``client_options``."""
        return [
            *self._common(),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]


__all__ = ["ChannelConfig"]
