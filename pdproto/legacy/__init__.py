"""SGLang 0.5.23 positional ZMQ frames <-> pdproto.v1 messages (the legacy bridge).

Reading order: ``_codec.py`` (encodings, slot-aware reader/writer), ``_entries.py``
(per-entry KV/state buffers, staging, DCP), ``_common.py`` (slot tables, the tagged
messages both backends share), then the slot layouts in ``mooncake.py`` and ``nixl.py``.
``classify`` tells which legacy message a frame list is; ``parse_any`` parses it.
docs/migration.md maps every slot to its proto field.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message

from pdproto.errors import LegacyFormatError, Reason
from pdproto.legacy import _common, mooncake, nixl
from pdproto.legacy._codec import NIXL_GUARD, ParseResult, show
from pdproto.legacy._common import KVPOLL_TO_STATE, STATE_TO_KVPOLL


class LegacyKind(enum.Enum):
    """The SGLang 0.5.23 ZMQ message kinds (inventory section 1.1, M1-M11)."""

    REGISTRATION = "registration"
    TRANSFER_INFO = "transfer_info"
    STATUS = "status"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    BOOTSTRAP = "bootstrap"
    STAGING_REQ = "staging_req"
    STAGING_RSP = "staging_rsp"
    WATERMARK = "watermark"
    CHUNK_READY = "chunk_ready"
    AUX_DATA = "aux_data"


class LegacyBackend(enum.Enum):
    """Which SGLang connector layout a frame list uses."""

    MOONCAKE = "mooncake"
    NIXL = "nixl"


@dataclass(frozen=True)
class Classification:
    """What a legacy frame list is: its kind and, when the frames show it, the backend."""

    kind: LegacyKind
    """Message kind."""
    backend: LegacyBackend | None
    """Backend when the layout is backend-specific; None for the shared tagged messages."""


_TAGS = {layout.tag: LegacyKind(layout.name.lower()) for layout in (
    _common.ABORT, _common.ABORT_ACK, _common.BOOTSTRAP, _common.STAGING_REQ, _common.STAGING_RSP,
    _common.WATERMARK, _common.CHUNK_READY, _common.AUX_DATA)}
_MOONCAKE_ONLY = {LegacyKind.BOOTSTRAP, LegacyKind.AUX_DATA}


def classify(frames: list[bytes]) -> Classification:
    """Tell which legacy message ``frames`` is, the way SGLang's listeners dispatch on frame 0.

    Only the frame count and frame 0 (and frame 1 after a NIXL guard) are read; the
    fields are checked by the parser. Raises LegacyFormatError(LEGACY_UNKNOWN_KIND).
    """
    if not isinstance(frames, (list, tuple)) or not frames or not all(
            isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        raise LegacyFormatError("legacy frames: expected a non-empty list of bytes frames",
                                reason=Reason.LEGACY_UNKNOWN_KIND)
    head = bytes(frames[0])
    if head == NIXL_GUARD:
        if len(frames) > 1 and bytes(frames[1]) == b"None":
            return Classification(LegacyKind.REGISTRATION, LegacyBackend.NIXL)
        return Classification(LegacyKind.TRANSFER_INFO, LegacyBackend.NIXL)
    if head == _common.KV_STATUS:
        return Classification(LegacyKind.STATUS, LegacyBackend.NIXL)
    if head in _TAGS:
        kind = _TAGS[head]
        if kind in _MOONCAKE_ONLY or (kind is LegacyKind.ABORT_ACK and len(frames) == 2):
            return Classification(kind, LegacyBackend.MOONCAKE)
        return Classification(kind, None)
    if head == b"None":
        return Classification(LegacyKind.REGISTRATION, LegacyBackend.MOONCAKE)
    # Untagged Mooncake traffic: a 3-frame status (P->D) or a TransferInfo (D->P).
    if len(frames) == 3:
        return Classification(LegacyKind.STATUS, LegacyBackend.MOONCAKE)
    if 8 <= len(frames) <= mooncake.TRANSFER_INFO_FRAMES:
        return Classification(LegacyKind.TRANSFER_INFO, LegacyBackend.MOONCAKE)
    raise LegacyFormatError(
        f"legacy frames: {len(frames)} frames starting with {show(head)} match no SGLang "
        "0.5.23 message", reason=Reason.LEGACY_UNKNOWN_KIND,
        metadata={"frames": len(frames), "frame0": show(head)})


def parse_any(frames: list[bytes], backend: LegacyBackend | None = None
              ) -> tuple[Classification, ParseResult[Message]]:
    """Classify and parse; ``backend`` picks the codec for the shared tagged messages.

    A frame list that shows its backend (guard, KV_STATUS, untagged Mooncake) must
    agree with ``backend`` when one is given.
    """
    found = classify(frames)
    chosen = found.backend or backend or LegacyBackend.MOONCAKE
    if backend is not None and found.backend is not None and found.backend is not backend:
        raise LegacyFormatError(
            f"legacy frames: a {found.backend.value} {found.kind.value} arrived where "
            f"{backend.value} frames were expected", reason=Reason.LEGACY_UNKNOWN_KIND,
            metadata={"kind": found.kind.value, "backend": found.backend.value})
    parser: Callable[[list[bytes]], ParseResult[Message]] | None = getattr(
        mooncake if chosen is LegacyBackend.MOONCAKE else nixl, f"parse_{found.kind.value}", None)
    if parser is None:
        raise LegacyFormatError(f"{found.kind.value} is not a {chosen.value} message",
                                reason=Reason.LEGACY_UNKNOWN_KIND,
                                metadata={"kind": found.kind.value, "backend": chosen.value})
    return found, parser(frames)


__all__ = [
    "KVPOLL_TO_STATE",
    "NIXL_GUARD",
    "STATE_TO_KVPOLL",
    "Classification",
    "LegacyBackend",
    "LegacyKind",
    "ParseResult",
    "classify",
    "mooncake",
    "nixl",
    "parse_any",
]
