"""A prefill rank's half of the backend: its pools registered, its ``PrefillEngine``, its handshake service.

Built once per prefill scheduler rank from the ``KVArgs`` SGLang gave the manager. The
service (``pdproto_server``: negotiation, planning, transfers, statuses) runs on its own
event loop in a thread (``ServiceThread``); SGLang's scheduler thread talks to it only
through the thread-safe engine API (``pdproto_server/README.md``): ``submit_chunk`` per send,
``status`` per poll, ``decode_prefix_len``, ``abort`` and ``release_room``. Nothing here
decides anything about layouts or bytes: that is the service's job.

This is the one place pdproto's core package reaches ``pdproto_server``: an engine adapter
runs inside the engine's process and embeds the prefill service (DESIGN.md, layers).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdproto import backends
from pdproto.errors import ConfigError, PdprotoError, Reason
from pdproto_server.app import ServerConfig, ServiceThread
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import KvSource, PrefillEngine, RoomStatus
from pdproto_server.registry import Limits

from . import layout
from .engines import open_rank
from .settings import BackendSettings

log = logging.getLogger(__name__)


class PrefillSide:
    """One prefill rank's registered pools, engine and running handshake service."""

    def __init__(self, kv_args: Any, ranks: layout.Ranks, *, is_mla_backend: bool, settings: BackendSettings,
                 host: str, device: str, prefill_rank: int, match_timeout_s: float) -> None:
        memory = open_rank(kv_args, settings, host=host, device=device)
        self.executor = memory.executor
        try:
            self.rings = layout.ring_sizes(kv_args)
            self.page_rows = layout.page_rows(kv_args)
            if self.page_rows > 1 and settings.legacy:
                # SGLang's own decodes name token counts and prefixes per token, not per compressed page.
                raise ConfigError("PDPROTO_LEGACY=1 (serving SGLang's own decodes) is not supported for DeepSeek-V4's"
                                  " compressed KV; run its decodes with --disaggregation-transfer-backend pdproto too",
                                  reason=Reason.CONFIG_INVALID, metadata={"setting": "PDPROTO_LEGACY"})
            self.info = layout.server_info(kv_args, ranks, is_mla_backend=is_mla_backend, host=host, port=0,
                                           backend=backends.by_name(settings.engine).enum)
            source = KvSource(memory.kv, self.info, aux=memory.aux, state=memory.state)
            self.engine = PrefillEngine(source, self.executor, prefill_rank=prefill_rank)
            # A decode submits when SGLang's prefill may still be queueing the request: wait for its
            # chunks as long as SGLang's own decode waits for the transfer.
            limits = Limits(match_timeout=match_timeout_s)
            # One port per process on a host: the rank's GPU index picks it.
            gpu_id = int(getattr(kv_args, "gpu_id", 0) or 0)

            listen = layout.host_port(host, settings.port + gpu_id if settings.port else 0)
            config = ServerConfig(listen=listen,
                                  token=settings.token, operator_token=settings.operator_token,
                                  allow_unauthenticated=settings.allow_unauthenticated,
                                  tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                  # SGLang's own decodes dial the bootstrap record's rank_port: this one.
                                  legacy_listen=layout.host_port(host, 0), legacy_serve=settings.legacy)
            self.service = ServiceThread(HandshakeCore(self.engine, limits=limits), config,
                                         name=f"pdproto-prefill-{prefill_rank}")
            self.port = self.service.start()
            self.legacy_port = self.service.legacy_port
        except BaseException:
            self.executor.close()
            raise
        self.info.rank_endpoint.port = self.port
        log.info("pdproto: prefill rank %d serves %s (%s); SGLang's own decodes on port %d (%s)", prefill_rank,
                 layout.host_port(host, self.port), settings.engine, self.legacy_port,
                 "served" if settings.legacy else "refused: PDPROTO_LEGACY is off")

    def submit(self, room: int, pages: Sequence[int], num_tokens: int, last: bool,
               state_indices: Sequence[Any] | None, aux_index: int | None, *,
               page_offset: int | Sequence[int] | None = None) -> None:
        """Report one chunk SGLang sent; the last names the room's state slots (one list per
        state component, as SGLang passes them) and aux slot; ``page_offset``: the chunk's page
        of the request (a CP rank's share) or each page's (a KV-shard rank's), else after the chunks
        before it. Raises ``PdprotoError``."""
        slots = layout.state_items(self.rings, state_indices) if last and state_indices is not None else None
        if self.page_rows > 1:  # DeepSeek-V4: a row per page, and SGLang's chunks start on a page
            num_tokens = len(pages)
        self.engine.submit_chunk(room, np.asarray(pages, dtype=np.int64), int(num_tokens), last,
                                 state_slots=slots, aux_slot=aux_index if last else None, page_offset=page_offset)

    def status(self, room: int) -> RoomStatus:
        """The room over every decode request for it (thread-safe)."""
        return self.engine.status(room)

    def decode_prefix_len(self, room: int) -> int:
        """Tokens the decode holds already; 0 until a decode said."""
        return (self.engine.decode_prefix_len(room) or 0) * self.page_rows

    def abort(self, room: int, reason: str) -> None:
        """Fail the room's decode requests with ``reason``; never raises (SGLang's abort must not)."""
        try:
            self.engine.abort(room, reason)
        except PdprotoError as exc:
            log.warning("pdproto: abort of room %d not delivered: %s", room, exc)

    def release(self, room: int) -> None:
        """Forget the room (its pages are SGLang's again), including an abort of an earlier lifecycle."""
        self.engine.release_room(room)

    def close(self) -> None:
        """Drain and stop the service, then release the engine."""
        self.service.stop()
        self.executor.close()


__all__ = ["PrefillSide"]
