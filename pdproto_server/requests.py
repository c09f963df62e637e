"""Requests: SubmitTransfer admits a request generation, Abort stops one and answers once it drained."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from pdproto.errors import (DeadlineExceededError, DuplicateRequestError, InvalidFieldError, NotFoundError,
                            PdprotoError, Reason, RequestFailedError, ResourceLimitError)
from pdproto.v1 import handshake_service_pb2 as hs, transfer_pb2

from .registry import Peer, Request
from .runner import drained
from .validate import check_transfer

if TYPE_CHECKING:
    from .core import HandshakeCore

LARGE_PAGE_LIST = 4096
"""Destination pages from which a request keeps its list as an int64 array (1M pages over 64 chunks:
about 230 ms of server CPU converting the protobuf list again at each chunk)."""


class Requests:
    """SubmitTransfer and Abort: generations, supersession, the per-peer in-flight limit, drained aborts."""

    def __init__(self, core: HandshakeCore) -> None:
        self.core = core
        self.engine, self.limits, self.registry, self.runner = core.engine, core.limits, core.registry, core.runner

    async def submit(self, request: hs.SubmitTransferRequest) -> transfer_pb2.TransferStatus:
        """Admit one request generation and start moving its chunks as they arrive."""
        self.core.accepting()
        peer = self.registry.peer(request.peer_id, request.peer_credential)
        if not request.HasField("transfer"):
            raise InvalidFieldError.of([("transfer", "required")])
        return await self.submit_to(peer, request.transfer)

    async def submit_to(self, peer: Peer, info: transfer_pb2.TransferInfo) -> transfer_pb2.TransferStatus:
        """``submit`` for a peer whose credential was already checked (a session stream checks it once)."""
        self.core.accepting()
        _check_alive(peer)
        pages = check_transfer(info, peer)
        current = peer.generation_of(info.room)
        if current is not None:
            if info.generation == current:
                raise DuplicateRequestError(
                    f"room {info.room} generation {info.generation} was already submitted",
                    reason=Reason.DUPLICATE_REQUEST, metadata={"room": info.room, "generation": info.generation})
            if info.generation < current:
                raise _stale(info.room, info.generation, current)
        old = peer.open.get(info.room)
        if old is not None:
            # A newer generation supersedes the old one (retraction, retry).
            await self.runner.stop(peer, old, Reason.ABORTED, f"superseded by generation {info.generation}")
        open_count = len(peer.open)
        if open_count >= self.limits.max_inflight_per_peer:
            raise ResourceLimitError(
                f"peer {peer.peer_id} has {open_count} requests in flight (limit {self.limits.max_inflight_per_peer})",
                reason=Reason.TOO_MANY_REQUESTS,
                metadata={"limit": self.limits.max_inflight_per_peer, "inflight": open_count})
        if peer.closed or self.registry.peers.get(peer.peer_id) is not peer:
            raise NotFoundError(f"peer {peer.peer_id!r} went away", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peerId": peer.peer_id})
        _check_alive(peer)
        # The planner reads the whole list at every chunk: a long one is converted for it once, here.
        dst_pages = pages if len(pages) < LARGE_PAGE_LIST else np.asarray(pages, dtype=np.int64)
        req = Request(peer_id=peer.peer_id, room=info.room, generation=info.generation, transfer=info,
                      dst_pages=dst_pages, prefix_len=info.decode_prefix_len,
                      prefill_rank=self.engine.prefill_rank)
        self.runner.start(peer, req)
        # The status right after admission travels in this response (a request whose chunks were
        # all there may be over already); streams report changes from here on.
        return req.final or req.status()

    async def abort(self, request: hs.AbortRequest) -> transfer_pb2.AbortAck:
        """Abort a request generation; answers once its in-flight chunk has drained.

        If the chunk is still inside the engine after ``drain_timeout`` (a stuck peer), the
        request is FAILED all the same but the call answers DEADLINE_EXCEEDED: its pages are
        not safe to reuse until the engine returns (Abort again later to learn when).
        """
        return await self.abort_for(self.registry.peer(request.peer_id, request.peer_credential), request.abort)

    async def abort_for(self, peer: Peer, note: transfer_pb2.AbortNotification) -> transfer_pb2.AbortAck:
        """``abort`` for a peer whose credential was already checked."""
        current = peer.generation_of(note.room)
        if current is None:
            raise NotFoundError(f"room {note.room} is unknown for peer {peer.peer_id}",
                                reason=Reason.REQUEST_NOT_FOUND, metadata={"room": note.room})
        if note.HasField("generation") and note.generation != current:
            if note.generation < current:
                raise _stale(note.room, note.generation, current)
            raise NotFoundError(f"room {note.room} generation {note.generation} was never submitted",
                                reason=Reason.REQUEST_NOT_FOUND,
                                metadata={"room": note.room, "generation": note.generation})
        req = peer.open.get(note.room)
        if req is not None:
            safe = await self.runner.stop(peer, req, Reason.ABORTED, "aborted by the decode")
        else:  # finished, maybe while its chunk was still inside the engine (DEADLINE_EXCEEDED)
            safe = await drained(peer, note.room, current, self.limits.drain_timeout)
        # A stuck worker's call may still return within the drain timeout: the executor's marker says when.
        safe = (safe or peer.worker.stuck) and await self._quiet(peer)
        if not safe:
            raise DeadlineExceededError(
                f"room {note.room} is aborted, but a chunk is still inside the transfer engine after "
                f"{self.limits.drain_timeout:g} s; its pages may still be written until the engine returns",
                reason=Reason.DEADLINE_EXCEEDED, metadata={"room": note.room, "generation": current})
        return transfer_pb2.AbortAck(room=note.room, prefill_rank=self.engine.prefill_rank, generation=current)

    async def _quiet(self, peer: Peer) -> bool:
        """True once no engine call for the peer is inside the engine; False after the drain timeout.

        The executor may have given a call up at its own deadline while the engine still runs
        it. The wait holds no thread: a frozen peer's aborts, however many, cannot take the
        threads another peer's abort needs (as ``asyncio.to_thread`` on the loop's shared
        executor did). A process that is exiting cannot say (``ShuttingDownError``, never an
        acknowledgement).
        """
        marker = self.engine.executor.drained(peer.peer_id)
        if marker is None:
            return True
        try:
            # Shielded: the marker may be the peer's queued disconnect, which must still run.
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(marker)), self.limits.drain_timeout)
        except TimeoutError:
            return False
        except PdprotoError:
            pass  # the call failed, and it has left the engine
        return True


def _check_alive(peer: Peer) -> None:
    """A peer whose process is gone admits no new work (it must re-register)."""
    if peer.gone_at is not None:
        raise RequestFailedError(f"peer {peer.peer_id} is gone; re-register", reason=Reason.PEER_GONE,
                                 metadata={"peerId": peer.peer_id})


def _stale(room: int, got: int, current: int) -> RequestFailedError:
    return RequestFailedError(f"room {room}: generation {got} is older than the current {current}",
                              reason=Reason.STALE_GENERATION,
                              metadata={"room": room, "generation": got, "currentGeneration": current})


__all__ = ["LARGE_PAGE_LIST", "Requests"]
