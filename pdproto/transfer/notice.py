"""The chunk notice: how a prefill's engine tells a decode that one chunk of a request has landed.

Engines with a notification channel (NIXL) deliver it after the last byte of the chunk's
last job, also when the decode rank owns no rows of that chunk. Mooncake and ``local``
have no channel; there completion travels on the control plane only.

Wire format (``docs/protocol.md``, "Chunk notices"): ``encode_notification(room, payload)``,
that is the room as 8 bytes little-endian, then the ASCII payload
``gen=<generation> chunk=<index> last=<0|1>`` with decimal numbers and single spaces.
The prefill service builds it (``pdproto_server.transfers``); a decode parses what its
executor's ``notifications()`` returns. Anything else (another sender's notice, a
malformed one) parses to None, because an engine delivers whatever a peer sends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .base import Notification, encode_notification

_PAYLOAD = re.compile(rb"gen=(\d{1,20}) chunk=(\d{1,20}) last=([01])")


@dataclass(frozen=True)
class ChunkNotice:
    """One chunk of one request generation has fully landed on the decode."""

    room: int
    """Request id (``TransferInfo.room``)."""
    generation: int
    """Request generation the chunk belongs to (a reused room has a higher one)."""
    chunk: int
    """Chunk index within the request, from 0."""
    last: bool
    """True for the request's last chunk."""


def encode_chunk_notice(notice: ChunkNotice) -> bytes:
    """The notification bytes a prefill sends for ``notice``."""
    payload = f"gen={notice.generation} chunk={notice.chunk} last={int(notice.last)}".encode()
    return encode_notification(notice.room, payload)


def decode_chunk_notice(notification: Notification) -> ChunkNotice | None:
    """The chunk notice in a received notification; None when its payload is not one."""
    m = _PAYLOAD.fullmatch(notification.payload)
    if m is None:
        return None
    return ChunkNotice(room=notification.room, generation=int(m[1]), chunk=int(m[2]), last=m[3] == b"1")


__all__ = ["ChunkNotice", "decode_chunk_notice", "encode_chunk_notice"]
