"""Session streams: one decode peer's submits and aborts in, results and status changes out.

A ``ServerSession`` outlives its streams (``pdproto_server/README.md``, reading order 8): it
keeps its ``EventLog`` for ``Limits.keep_finished`` seconds with no stream attached, so a
client that lost its stream resumes without losing or repeating an event. The handler writes
everything the window allows in one message; a command beyond the client's command window is
held unread, so a flooding client stalls on HTTP/2 flow control while other peers' streams
carry on. The credential is checked once per stream, in ``SessionOpen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from pdproto.errors import InvalidFieldError, NotFoundError, PdprotoError, Reason
from pdproto.rpc.status import command_error
from pdproto.session import DEFAULT_COMMAND_WINDOW, EventLog
from pdproto.v1 import handshake_service_pb2 as hs, session_pb2, transfer_pb2

from .core import HandshakeCore
from .engine import Deadlines
from .registry import Peer

log = logging.getLogger("pdproto_server.session")
APPLY_TURN = 32
"""Commands a stream applies before it lets the event loop run other peers' calls."""


class Ctx(Protocol):
    """What a stream offers the hub: the gRPC call's context (``read``, ``write``)."""

    async def read(self) -> object:
        """The next request, the typed error ``_status.tolerant`` refused it with, or ``grpc.aio.EOF``."""

    async def write(self, message: hs.SessionResponse) -> None:
        """Send one response."""


class _Stream:
    """One attached stream: how to wake its writer, and whether a newer stream took over."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.replaced = False
        """A newer stream resumed the session: this one stops at once."""
        self.writing = False
        """A write is in progress (one at a time); whoever writes sends everything sendable."""
        self.applying = False
        """The reader is applying commands and writes what they produced itself: no wake-up needed."""
        self.in_command = False
        """The reader waits inside a command (a submit superseding a chunk in the engine): it is not
        cancelled there, since the command counts as applied and its result must reach the session."""
        self.closing = False
        """The stream is over: its reader stops after the command it is in."""
        self.task: asyncio.Task[object] | None = None
        """The task serving the stream (cut when an ended session's client does not take its tail)."""


class ServerSession:
    """One peer's session: its event log, the stream attached to it (if any), its status subscription."""

    def __init__(self, hub: SessionHub, session_id: str, peer: Peer, event_window: int,
                 command_window: int) -> None:
        self.hub = hub
        self.session_id = session_id
        self.peer = peer
        self.log = EventLog(event_window, command_window)
        self.stream: _Stream | None = None
        self.detached_at: float | None = None
        self.ended: PdprotoError | None = None
        """Why the session is over; its stream ends with it once everything is written."""
        self.held: deque[session_pb2.SessionCommand] = deque()
        """Commands received beyond the credit, in order, waiting for acknowledgements."""
        self.progress = asyncio.Event()
        """Set when a command result frees credit without an acknowledgement (an abort finished)."""
        self.applier = asyncio.Lock()
        """One stream applies commands at a time: a replaced stream's reader may finish a command while
        the new stream's reader has the next ones."""
        self._cut: asyncio.TimerHandle | None = None

    def push(self, status: transfer_pb2.TransferStatus) -> None:
        """A status change of one of the peer's requests."""
        self.log.status(status)
        if self.ended is None and self.log.queued > self.hub.core.limits.max_unread:
            self._fell_behind()
        self.wake()

    def _fell_behind(self) -> None:
        """End a session whose client acknowledged nothing while its events piled up (its peer's own
        unary submits finish meanwhile); kept, each finished request would add one for good."""
        limit = self.hub.core.limits.max_unread
        log.warning("session %s of peer %s: more than %d events unacknowledged; ending it",
                    self.session_id, self.peer.peer_id, limit)
        self.ended = NotFoundError(
            f"session {self.session_id} of peer {self.peer.peer_id} was ended: its client acknowledged no "
            f"event while more than {limit} queued (twice what the peer can have open and kept). Open a "
            "new session: its first events are the peer's current statuses",
            reason=Reason.SESSION_NOT_FOUND, metadata={"sessionId": self.session_id, "limit": limit})
        self.log.discard()
        self.hub.drop(self)
        self.progress.set()
        self._cut_now()

    def close(self) -> None:
        """The peer is over (deregistered, replaced, gone) or the server drains: flush, then end."""
        if self.ended is None:
            self.ended = self.hub.core.ended_reason(self.peer)
        if self.stream is None:
            self.hub.drop(self)
        else:
            self.cut_later()
        self.wake()
        self.progress.set()

    def cut_later(self) -> None:
        """Give the attached stream ``drain_timeout`` seconds to deliver what is left, then end it.

        An ended session counts toward no limit (its peer is released), so a client that keeps
        the stream open and never reads or acknowledges must not keep it, and its tasks, forever.
        """
        if self._cut is None:
            self._cut = asyncio.get_running_loop().call_later(self.hub.core.limits.drain_timeout, self._late)

    def _late(self) -> None:
        log.info("session %s of peer %s: the client took nothing for %.0f s after it ended",
                 self.session_id, self.peer.peer_id, self.hub.core.limits.drain_timeout)
        self._cut_now()

    def _cut_now(self) -> None:
        """End the attached stream with the session's reason (``serve`` raises it)."""
        stream = self.stream
        if stream is not None and stream.task is not None and not stream.task.done():
            log.info("session %s of peer %s: cutting its stream (%s)", self.session_id, self.peer.peer_id,
                     self.ended.message if self.ended is not None else "")
            stream.closing = True
            stream.task.cancel()

    @property
    def attached(self) -> bool:
        """A stream serves the session now; a detached one waits for a resume."""
        return self.stream is not None

    def wake(self) -> None:
        """Tell the attached stream's writer to look at the log."""
        if self.stream is not None and not self.stream.applying:
            self.stream.wake.set()


class SessionHub:
    """Every session of every peer, and the Session RPC's stream handling."""

    def __init__(self, core: HandshakeCore, *, command_window: int = DEFAULT_COMMAND_WINDOW) -> None:
        self.core = core
        self.command_window = command_window
        self.sessions: dict[str, ServerSession] = {}
        self.started_at = time.monotonic()
        self.detached: Deadlines[ServerSession] = Deadlines()
        """Sessions without a stream, due to be forgotten ``keep_finished`` after they lost it."""
        core.on_tick.append(self.expire)

    # -- opening -------------------------------------------------------------

    def open(self, request: hs.SessionRequest) -> tuple[ServerSession, session_pb2.SessionOpened]:
        """Start or resume the session a stream's first message names; raises a typed error otherwise."""
        if not request.HasField("open"):
            raise InvalidFieldError("open", "the first message of a Session stream must carry SessionOpen")
        opening = request.open
        peer = self.core.peer(opening.peer_id, opening.peer_credential)
        if opening.resume_session_id:
            session = self.sessions.get(opening.resume_session_id)
            if session is None or session.peer is not peer or session.ended is not None:
                raise NotFoundError(
                    f"session {opening.resume_session_id!r} of peer {peer.peer_id} is not kept any more "
                    "(it ended or was detached too long); open a new session",
                    reason=Reason.SESSION_NOT_FOUND, metadata={"sessionId": opening.resume_session_id})
            session.log.ack(request.event_ack)  # before anything changes: a bad one leaves the session as it was
            # Each resume writes every unacknowledged event again: a resume loop is a snapshot loop.
            self.core.draw_snapshot(peer, session.log.unacknowledged, "a resume's unacknowledged events")
            session.log.rewind()
            # The client sends every command after applied_command_seq again, so what the old
            # stream left unapplied goes: kept, each resume would add a frame's worth to it.
            session.held.clear()
            resumed = True
        else:
            if request.event_ack:
                # Checked before the session exists: raised after, it would stay subscribed, unserved.
                raise InvalidFieldError("event_ack", f"acknowledges event {request.event_ack} of a new session, "
                                        "which has sent none", metadata={"eventAck": request.event_ack})
            session = self._new(peer, opening.event_window)
            resumed = False
        if session.stream is not None:
            session.stream.replaced = True
            session.stream.wake.set()
        session.stream = _Stream()
        session.detached_at = None
        return session, session_pb2.SessionOpened(
            session_id=session.session_id, resumed=resumed, applied_command_seq=session.log.applied_command_seq,
            event_window=session.log.event_window, command_window=session.log.command_window)

    def _new(self, peer: Peer, event_window: int) -> ServerSession:
        mine = self.of(peer)
        if len(peer.feeds) >= self.core.limits.max_streams_per_peer:
            # Make room with the session detached longest (its client would resume it, not start anew).
            detached = sorted((s for s in mine if s.stream is None),
                              key=lambda s: s.detached_at or 0.0)
            if detached:
                self.drop(detached[0])
        session = ServerSession(self, secrets.token_hex(16), peer, event_window, self.command_window)
        snapshot, ended = self.core.subscribe(peer, session)
        session.log.finals(snapshot.finished)
        for status in snapshot.open:
            session.log.status(status)
        if ended:
            # A peer that is gone (or removed) but still known: its kept final statuses are
            # delivered, then the stream ends with why, as WatchStatus does.
            session.ended = self.core.ended_reason(peer)
        self.sessions[session.session_id] = session
        return session

    def of(self, peer: Peer) -> list[ServerSession]:
        """The peer's sessions, attached or kept for a resume."""
        return [s for s in peer.feeds if isinstance(s, ServerSession)]

    def drop(self, session: ServerSession) -> None:
        """Forget a session: it takes no resume and no more statuses."""
        self.sessions.pop(session.session_id, None)
        session.peer.feeds.discard(session)

    def expire(self, now: float) -> None:
        """Forget sessions detached for ``keep_finished`` (only those due are looked at)."""
        keep = self.core.limits.keep_finished
        for session in self.detached.take_due(now):
            if session.detached_at is not None and now - session.detached_at >= keep:
                self.drop(session)

    # -- one stream ------------------------------------------------------------

    async def serve(self, context: Ctx) -> None:
        """Run one Session stream until the client leaves, the session ends or a newer stream resumes it."""
        first: object = await context.read()
        if isinstance(first, PdprotoError):
            raise first
        if not isinstance(first, hs.SessionRequest):
            return  # EOF: the client left before opening
        await self.core.pace(first.open.peer_id, first.open.peer_credential)
        session, opened = self.open(first)
        stream = session.stream
        assert stream is not None
        stream.task = asyncio.current_task()
        if session.ended is not None:
            session.cut_later()
        reader = asyncio.get_running_loop().create_task(self._read(context, session, stream, first))
        streams = self.core.metrics.session_streams
        streams.inc()
        try:
            await self._write(context, session, stream, opened, reader)
        except asyncio.CancelledError:
            if not stream.closing or session.ended is None:
                raise
            # Cut by cut_later: end with the session's reason (the call's status).
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise session.ended from None
        finally:
            streams.dec()
            stream.closing = True
            if not stream.in_command:
                reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if session.stream is stream:
                session.stream = None
                session.detached_at = time.monotonic()
                if session.ended is not None:
                    self.drop(session)
                else:
                    self.detached.add(session.detached_at + self.core.limits.keep_finished, session)

    async def _write(self, context: Ctx, session: ServerSession, stream: _Stream,
                     opened: session_pb2.SessionOpened, reader: asyncio.Task[None]) -> None:
        """Write what the log has whenever woken (statuses that change later); end the stream when told."""
        stream.writing = True
        try:
            await context.write(hs.SessionResponse(opened=opened, events=session.log.take()))
        finally:
            stream.writing = False
        while True:
            await self._flush(context, session, stream)
            if stream.replaced:
                return
            if not session.log.sendable and not stream.writing:
                if session.ended is not None and not session.log.queued:
                    raise session.ended  # everything it may send is written: end with the reason
                if reader.done():
                    reader.result()  # the client's error (a protocol violation) ends the stream
                    return  # the client closed its side
            stream.wake.clear()
            await stream.wake.wait()

    @staticmethod
    async def _flush(context: Ctx, session: ServerSession, stream: _Stream) -> None:
        """Write every sendable event, in as few messages as the window allows; one writer at a time."""
        if stream.writing:
            return
        stream.writing = True
        try:
            while session.log.sendable and not stream.replaced:
                await context.write(hs.SessionResponse(events=session.log.take()))
        finally:
            stream.writing = False
            if session.ended is not None or session.log.sendable:
                stream.wake.set()  # the writer task ends the stream, or sends what came meanwhile

    async def _read(self, context: Ctx, session: ServerSession, stream: _Stream, first: hs.SessionRequest) -> None:
        try:
            message = first  # its acknowledgement was applied when it opened the session
            while True:
                if len(message.commands) > session.log.command_window:
                    # No more than the window may be outstanding, so no compliant message carries more;
                    # checked before any is touched (a 4 MB frame holds two million empty commands).
                    raise InvalidFieldError(
                        "commands", f"{len(message.commands)} commands in one message, more than the command "
                        f"window ({session.log.command_window}) a client may have outstanding",
                        metadata={"commands": len(message.commands), "commandWindow": session.log.command_window})
                if session.ended is None:  # an ended session applies nothing more
                    session.held.extend(message.commands)
                stream.applying = True
                try:
                    await self._apply(session, stream)
                finally:
                    stream.applying = False
                if stream.closing:
                    return
                await self._flush(context, session, stream)
                while session.held and session.ended is None:
                    # Commands beyond the credit (a client ignoring its window; a compliant one
                    # never has any): read nothing more, so HTTP/2 flow control stops
                    # its writes and what is held stays within one message, until credit frees.
                    session.progress.clear()
                    await session.progress.wait()
                    await self._apply(session, stream)
                    if stream.closing:
                        return
                received: object = await context.read()
                if isinstance(received, PdprotoError):
                    raise received  # the reader's error ends the stream, typed
                if not isinstance(received, hs.SessionRequest):
                    return  # EOF: the client closed its side
                message = received
                session.log.ack(message.event_ack)
        finally:
            stream.wake.set()

    async def _apply(self, session: ServerSession, stream: _Stream) -> None:
        """Apply held commands while the credit allows, in order, one stream at a time."""
        log_ = session.log
        taken = 0
        async with session.applier:
            while session.held and log_.credit > 0 and session.ended is None and not stream.closing:
                taken += 1
                if taken % APPLY_TURN == 0:
                    await asyncio.sleep(0)  # a full window of submits must not hold other peers' calls
                    continue  # the conditions may have changed meanwhile
                command = session.held.popleft()
                if not log_.admit(command):
                    continue
                if command.HasField("submit"):
                    stream.in_command = True
                    try:
                        result = await self._apply_one(session.peer, command)
                    except asyncio.CancelledError:
                        # The server stops: the command was applied, so it gets a result all the same.
                        log_.result(_refused(command.seq, PdprotoError("the submit was cancelled (the server "
                                                                       "is stopping)")))
                        raise
                    finally:
                        stream.in_command = False
                    log_.result(result)
                elif command.HasField("abort"):
                    # An abort waits for an in-flight chunk to drain: the stream does not wait with it.
                    task = asyncio.get_running_loop().create_task(self._apply_one(session.peer, command))
                    task.add_done_callback(_deliver(session, command.seq, task))
                else:
                    log_.result(_refused(command.seq, InvalidFieldError("commands[].kind",
                                                                        "submit or abort is required")))

    async def _apply_one(self, peer: Peer, command: session_pb2.SessionCommand) -> session_pb2.CommandResult:
        """A submit's status or an abort's acknowledgement, or the typed error the unary call would raise."""
        try:
            if command.HasField("submit"):
                status = await self.core.submit_to(peer, command.submit)
                return session_pb2.CommandResult(command_seq=command.seq, submitted=status)
            ack = await self.core.abort_for(peer, command.abort)
            return session_pb2.CommandResult(command_seq=command.seq, aborted=ack)
        except PdprotoError as exc:
            return _refused(command.seq, exc)


def _refused(seq: int, error: PdprotoError) -> session_pb2.CommandResult:
    return session_pb2.CommandResult(command_seq=seq, error=command_error(error))


def _deliver(session: ServerSession, seq: int,
             task: asyncio.Task[session_pb2.CommandResult]) -> Callable[[object], None]:
    """Queue an abort's result when its task ends, whatever the ending."""

    def done(_: object) -> None:
        if task.cancelled():
            result = _refused(seq, PdprotoError("the abort was cancelled (the server is stopping)"))
        elif task.exception() is not None:
            log.error("abort failed unexpectedly", exc_info=task.exception())
            result = _refused(seq, PdprotoError("internal error in abort"))
        else:
            result = task.result()
        session.log.result(result)
        session.wake()
        session.progress.set()

    return done


__all__ = ["ServerSession", "SessionHub"]
