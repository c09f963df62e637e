"""One ZMQ socket, two dialects: SGLang 0.5.23 positional frames and pdproto Envelope frames.

During a rolling upgrade a prefill's PULL socket receives both: old decodes send SGLang's
positional multipart messages, upgraded ones send a single Envelope frame. ``route`` tells
them apart by the Envelope magic (``pdproto.wire.is_envelope_frame``; SGLang's frame 0 is
always ASCII or the NIXL guard, never 0xB7) and turns either into the same ``pdproto.v1``
message. A malformed message becomes a typed error for that message only; the socket and
every other sender keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import Message

from pdproto import legacy, wire
from pdproto.errors import LegacyFormatError, PdprotoError, WireError

ENVELOPE = "envelope"
LEGACY = "legacy"


@dataclass(frozen=True)
class Routed:
    """A message received on the bridge, whichever dialect carried it."""

    dialect: str
    """``"envelope"`` or ``"legacy"``."""
    message: Message
    """The ``pdproto.v1`` message (KvRegistration, TransferInfo, AbortNotification, ...)."""
    kind: str
    """Message type name, e.g. ``"KvRegistration"``."""
    backend: str | None = None
    """Legacy layout (``"mooncake"``/``"nixl"``) when the frames show it."""
    assumed: tuple[str, ...] = ()
    """Legacy defaults the parser assumed for absent slots."""


def route(frames: Sequence[bytes], *, legacy_backend: legacy.LegacyBackend | None = None) -> Routed:
    """Decode one multipart message in either dialect; raises WireError or LegacyFormatError only."""
    frames = _frames(frames)
    if frames and wire.is_envelope_frame(frames[0]):
        if len(frames) != 1:
            raise WireError(f"an Envelope travels as one frame, got {len(frames)}",
                            metadata={"frames": len(frames)})
        msg = wire.decode(frames[0])
        return Routed(ENVELOPE, msg, type(msg).__name__)
    found, parsed = legacy.parse_any(frames, legacy_backend)
    backend = found.backend.value if found.backend is not None else None
    return Routed(LEGACY, parsed.message, type(parsed.message).__name__, backend, tuple(parsed.assumed))


def _frames(frames: object) -> list[bytes]:
    """The frames as bytes; WIRE_MALFORMED for anything that is not a sequence of bytes-like frames.

    Each frame goes through ``memoryview``, never ``bytes(frame)``: ``bytes(10**9)`` would
    allocate a gigabyte for an integer "frame", and ``bytes("x")`` raises a bare TypeError.
    """
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise WireError(f"expected a list of bytes-like frames, found {type(frames).__name__}",
                        metadata={"type": type(frames).__name__})
    out: list[bytes] = []
    for i, frame in enumerate(frames):
        try:
            out.append(bytes(memoryview(frame)))
        except TypeError:
            raise WireError(f"frame {i} is {type(frame).__name__}, not bytes-like",
                            metadata={"frame": i, "type": type(frame).__name__}) from None
    return out


@dataclass
class BridgeStats:
    """Counts per dialect, and rejected messages by reason."""

    envelope: int = 0
    legacy: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class ZmqBridge:
    """A bound ZMQ PULL socket that yields ``Routed`` messages from both dialects."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", *,
                 legacy_backend: legacy.LegacyBackend | None = None, max_message_bytes: int = 4 << 20) -> None:
        import zmq  # lazily: the pure core must import without pyzmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A peer that sends more than this is disconnected by ZMQ itself, before parsing.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.bind(endpoint)
        raw = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint: str = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.legacy_backend = legacy_backend
        self.stats = BridgeStats()

    def receive(self, timeout: float) -> Routed | PdprotoError | None:
        """Next message (or the typed error it caused); None when nothing arrived within ``timeout`` s."""
        if not self._sock.poll(int(timeout * 1000)):
            return None
        frames = self._sock.recv_multipart(copy=True)
        try:
            routed = route(frames, legacy_backend=self.legacy_backend)
        except (WireError, LegacyFormatError) as exc:
            self.stats.rejected[exc.reason.name] = self.stats.rejected.get(exc.reason.name, 0) + 1
            return exc
        if routed.dialect == ENVELOPE:
            self.stats.envelope += 1
        else:
            self.stats.legacy += 1
        return routed

    def close(self) -> None:
        """Close the socket and its context."""
        self._sock.close(0)
        self._ctx.term()


__all__ = ["ENVELOPE", "LEGACY", "BridgeStats", "Routed", "ZmqBridge", "route"]
