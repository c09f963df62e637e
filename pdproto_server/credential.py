"""Credentials bound to a decode's transfer engine: part of a peer's credential travels through the engine.

A registration that names a ``credential_buffer`` gets the first ``RESPONSE_BYTES`` of its
credential in the ``RegisterResponse`` and the last ``ENGINE_BYTES`` written through the
transfer engine into that buffer, on the engine the registration names. Only the process that
owns that engine reads them, so a token holder that names another decode's engine (a Mooncake
session id is an address, so it can be guessed) gets a credential it cannot complete: it can
open no stream and submit nothing, so it never holds the identity against the decode that does
own the engine (``admission.py``, docs/security.md).
"""

from __future__ import annotations

import secrets
import threading

import numpy as np

from pdproto.errors import InvalidFieldError, PdprotoError, Reason, ResourceLimitError
from pdproto.transfer import Buffer, LayerSpan, TransferExecutor, TransferJob
from pdproto.v1 import registration_pb2

from .registry import retry_after_ms

ENGINE_BYTES = 16
"""Credential bytes written through the engine (128 bits: what the issue asks of a credential)."""
RESPONSE_BYTES = 16
"""Credential bytes returned in the response."""
SLOTS = 256
"""Writes that may be in flight at once; each needs its own source bytes until its engine call ends."""


class EngineCredentials:
    """Writes the engine-bound part of peer credentials from a small registered source region."""

    def __init__(self, executor: TransferExecutor) -> None:
        self._executor = executor
        self._source: Buffer | None = None
        self._free = list(range(SLOTS))
        self._lock = threading.Lock()

    def _take(self) -> tuple[Buffer, int]:
        with self._lock:
            if self._source is None:
                source = self._executor.allocate(ENGINE_BYTES * SLOTS)
                self._executor.register_memory([source])
                self._source = source
            if not self._free:
                raise ResourceLimitError(
                    f"{SLOTS} registrations are writing their credentials at once; retry shortly",
                    reason=Reason.TOO_MANY_REGISTRATIONS, metadata={"retryAfterMs": retry_after_ms(1.0)})
            return self._source, self._free.pop()

    def write(self, peer_id: str, registration: registration_pb2.KvRegistration) -> bytes:
        """Write fresh random bytes into the peer's ``credential_buffer`` through the engine; return them.

        Blocking (the peer's worker); the peer must be connected. A write the engine refuses
        is an ``INVALID_FIELD`` naming the buffer.
        """
        secret = secrets.token_bytes(ENGINE_BYTES)
        source, slot = self._take()
        try:
            offset = slot * ENGINE_BYTES
            source.array[offset:offset + ENGINE_BYTES] = np.frombuffer(secret, dtype=np.uint8)
            span = LayerSpan(src_ptr=source.addr + offset, dst_ptr=registration.credential_buffer.ptr,
                             row_bytes=ENGINE_BYTES)
            self._executor.execute(peer_id, TransferJob.of_runs([span], np.array([[0, 1, 0, 1, 1]], dtype=np.int64),
                                                                pack=False))
        except PdprotoError as exc:
            raise InvalidFieldError(
                "registration.credential_buffer",
                "the prefill could not write this peer's credential into credential_buffer through the transfer "
                f"engine ({exc.reason.name}: {exc.message}); it must be memory registered with the engine the "
                "registration names", metadata={"peer": peer_id}) from exc
        finally:
            with self._lock:
                self._free.append(slot)
        return secret


__all__ = ["ENGINE_BYTES", "RESPONSE_BYTES", "EngineCredentials"]
