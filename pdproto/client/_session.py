"""The client's end of a Session stream (asyncio): one per registered peer, resumed after a break.

One task per session (the pump) opens the stream, resumes it after a break (with backoff,
for as long as a caller is waiting on it), reads events and resolves the callers. A caller
writes its own command (no task per request); while a write is in progress, later commands
join the writer's next message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import grpc.aio
from grpc_status import rpc_status

from pdproto.errors import PdprotoError, Reason, UnavailableError
from pdproto.session import DEFAULT_COMMAND_WINDOW, CommandOutbox, EventInbox, StatusBook
from pdproto.v1 import handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc, session_pb2, transfer_pb2

from pdproto.rpc.status import error_from_command, error_from_rpc

from ._auth import Metadata
from ._rpc import Settings, deadline_error, next_try, retry_hint

Deliver = Callable[[transfer_pb2.TransferStatus | None], None]
"""A watcher's sink: each status it asked for, then None when no more will come."""


class SessionUnsupportedError(Exception):
    """The server has no Session RPC (an older server): use the unary calls."""


class CommandRefusedError(Exception):
    """The ``__cause__`` of an error a session command was answered with (the unary calls have the RpcError)."""

    def __init__(self, refusal: session_pb2.CommandError, seq: int) -> None:
        super().__init__(f"command {seq} refused: code {refusal.code} {refusal.reason}: {refusal.message}")
        self.refusal = refusal


class PeerSession:
    """A peer's session: commands out, events in, resumed on a new stream after a break."""

    def __init__(self, stub: hs_grpc.HandshakeServiceAsyncStub, settings: Settings, peer_id: str,
                 credential: bytes) -> None:
        self.peer_id = peer_id
        self.credential = credential
        self._stub = stub
        self._s = settings
        self.outbox = CommandOutbox()
        self.inbox = EventInbox()
        self.book = StatusBook()
        self.session_id = ""
        self.command_window = DEFAULT_COMMAND_WINDOW
        self.error: BaseException | None = None
        """Set when the session is over for good (peer removed, protocol error, no Session RPC)."""
        self.failure: BaseException | None = None
        """What the session's waits and watches were last ended with (``error``, or a failure a later call retries)."""
        self.broken: PdprotoError | None = None
        """Why the last stream broke, until a new one opens: a deadline passing meanwhile reports it."""
        self._resent: set[int] = set()
        """Seqs of submits sent again in a new session: DUPLICATE_REQUEST then means it was applied."""
        self._call: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        """Set whenever the pump's state or the credit changes; waiters re-check their condition."""
        self._futures: dict[int, asyncio.Future[session_pb2.CommandResult]] = {}
        self._watchers: set[tuple[frozenset[int], Deliver]] = set()
        """Each watch's rooms (all when empty) and where its statuses go (a sink per watch)."""
        self._waiting = 0
        """Callers in ``_until`` (opening the session, or waiting for the command window)."""
        self._writing = False
        self._closed = False
        self._used: Metadata = ()
        """The metadata the last stream was opened with."""
        self._renewed = False
        """The proof was renewed since a stream last opened."""

    # -- the pump -----------------------------------------------------------

    def _interested(self) -> bool:
        return bool(self._futures or self._watchers or self._waiting)

    def _start(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run(), name=f"session-{self.peer_id}")

    async def _run(self) -> None:
        backoffs = self._s.retry.backoffs()
        while not self._closed:
            try:
                await self._stream()
                error: PdprotoError = UnavailableError("the session stream ended")
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                error.__cause__ = exc
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    self._end(SessionUnsupportedError("the server has no Session RPC"))
                    return
                if exc.code() is grpc.StatusCode.CANCELLED:  # the server stopped the call
                    error = UnavailableError(f"the session stream was cancelled: {exc.details()}")
                if exc.code() is grpc.StatusCode.INTERNAL and rpc_status.from_call(exc) is None:
                    # gRPC's own, not the server's (which sends every INTERNAL with an ErrorInfo): a
                    # write racing the server's end of the call reads back "Internal error from Core"
                    # instead of the server's status. A new stream learns the real one.
                    error = UnavailableError(f"the session stream failed inside gRPC: {exc.details()}")
                    error.__cause__ = exc
            except PdprotoError as exc:  # a server that broke the numbering rules
                error = exc
            finally:
                opened = self._ready.is_set()
                self._ready.clear()
                call, self._call = self._call, None
                if call is not None:
                    call.cancel()
                self._changed.set()
            self.broken = error
            if opened:  # the stream worked: the next break starts again from the first backoff
                backoffs = self._s.retry.backoffs()
            if error.reason is Reason.SESSION_NOT_FOUND:
                self._restart()
                continue
            if opened:
                self._renewed = False
            if error.reason is Reason.UNAUTHENTICATED and self._s.proof is not None and not self._renewed:
                self._renewed = True  # the server restarted or the proof expired: authenticate once more
                self._s.proof.renew(self._used)
                continue
            if error.reason is Reason.SHUTTING_DOWN:
                # The server drained and ended the session after its last event: what waits
                # now fails (retryable: re-register where the prefill comes back); a later call tries again.
                self._fail(error)
                return
            if not error.retryable and retry_hint(error) is None:  # a hint: a resume refused for now
                self._end(error)
                return
            if not self._interested() or self._closed:
                return  # the next caller starts it again (and resumes the session)
            delay = next_try(error, backoffs)
            if delay is None:
                self._fail(error)  # out of retries; a later call starts over
                return
            await asyncio.sleep(delay)

    async def _stream(self) -> None:
        """One stream: open or resume, replay, then read until it breaks."""
        self._used = await self._s.metadata(self._stub, self._s.timeout)
        call = self._stub.Session(metadata=self._used)
        self._call = call
        opening = session_pb2.SessionOpen(peer_id=self.peer_id, peer_credential=self.credential,
                                          resume_session_id=self.session_id, event_window=self.inbox.window)
        await call.write(hs.SessionRequest(open=opening, event_ack=self.inbox.ack()))
        first = await call.read()
        if not isinstance(first, hs.SessionResponse) or not first.HasField("opened"):
            raise UnavailableError("the session stream ended before it opened")
        opened = first.opened
        self.session_id = opened.session_id
        self.command_window = opened.command_window or DEFAULT_COMMAND_WINDOW
        self.inbox.window = opened.event_window or self.inbox.window
        self.outbox.resume(opened.applied_command_seq if opened.resumed else 0)
        self._dispatch(first)
        self.broken = None
        self._ready.set()
        self._changed.set()
        await self.flush()
        while True:
            response = await call.read()
            if not isinstance(response, hs.SessionResponse):
                return  # EOF without a status: treated as a break
            self._dispatch(response)
            if self.inbox.ack_due(self.command_window):
                await self.flush()

    def _restart(self) -> None:
        """The server lost the session: start a new one and send every unanswered command again."""
        renumbered = self.outbox.restart()
        self._futures = {renumbered[old]: fut for old, fut in self._futures.items() if old in renumbered}
        self._resent = {new for old, new in renumbered.items()
                        if self.outbox.unanswered[new].HasField("submit")}
        self.session_id = ""
        self.inbox = EventInbox(self.inbox.window)

    def _end(self, error: BaseException) -> None:
        """The session is over for good: fail what waits on it, end its watchers, refuse later calls."""
        self.error = error
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Fail what waits on the session now and end its watchers."""
        futures, self._futures = self._futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(error)
        self.failure = error
        for _, deliver in list(self._watchers):
            deliver(None)
        self._watchers.clear()
        self._changed.set()

    def _dispatch(self, response: hs.SessionResponse) -> None:
        for event in response.events:
            if not self.inbox.accept(event):
                continue
            if event.HasField("result"):
                seq = event.result.command_seq
                if self.outbox.answered(seq) is None:
                    continue
                if event.result.HasField("submitted"):
                    # Known from now on to a new watcher's snapshot (as WatchStatus's snapshot would be);
                    # not a change, so current watchers do not get it.
                    self.book.update(event.result.submitted)
                command_done = self._futures.pop(seq, None)
                if command_done is not None and not command_done.done():
                    command_done.set_result(event.result)
                self._changed.set()
                continue
            status = event.status
            if not self.book.update(status):
                continue
            for rooms, deliver in self._watchers:
                if not rooms or status.room in rooms:
                    deliver(status)

    async def flush(self, *, ack: bool = False) -> None:
        """Write queued commands and a due acknowledgement (``ack``: acknowledge every result now, which
        frees the command window); a caller that finds a write in progress leaves it to that writer."""
        if self._writing or self._call is None:
            return
        self._writing = True
        call = self._call
        try:
            while True:
                commands = self.outbox.take()
                due = self.inbox.ack_due(self.command_window) or (ack and self.inbox.results_unacked > 0)
                if not commands and not due:
                    return
                ack = False
                await call.write(hs.SessionRequest(commands=commands, event_ack=self.inbox.ack()))
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream broke; the pump resumes it and the outbox sends these again
        finally:
            self._writing = False

    # -- what callers do --------------------------------------------------------

    async def _until(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Wait (starting the pump when needed) until ``ready()``, the session ends, or the deadline."""
        # A caller waiting here counts as interest: without it the pump stopped at every failed open
        # and this loop started it again at once, with no backoff (4,796 opens in 2 s of a down prefill).
        self._waiting += 1
        try:
            while True:
                self._changed.clear()
                if ready():
                    return
                if self.error is not None:
                    raise self.error
                self._start()
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._changed.wait()
                except TimeoutError:
                    raise self.late_error(f"{what}: the session did not get there before the deadline") from None
        finally:
            self._waiting -= 1

    def late_error(self, what: str, **metadata: object) -> PdprotoError:
        """The error of a deadline that passed: UNAVAILABLE with the cause when the stream was broken all along.

        A caller that waited on a dead or unreachable prefill learns that, not just that time ran out.
        """
        broken = self.broken
        if broken is not None and not self._ready.is_set():
            error = UnavailableError(f"{what}: the prefill is unreachable ({broken.message})",
                                     metadata={"peerId": self.peer_id, "cause": broken.reason.name,
                                               **{k: str(v) for k, v in metadata.items()}})
            error.__cause__ = broken
            return error
        return deadline_error(what, peerId=self.peer_id, **metadata)

    async def open(self, timeout: float) -> None:
        """Wait until a stream is open (raises ``SessionUnsupportedError`` for a server without sessions)."""
        if not self._ready.is_set() or self.error is not None:
            await self._until(self._ready.is_set, asyncio.get_running_loop().time() + timeout, "opening the session")

    async def command(self, command: session_pb2.SessionCommand, timeout: float) -> session_pb2.CommandResult:
        """Send one command and wait for its result, within ``timeout`` seconds (resuming a broken stream)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # The caller opened the session just before (``open``); a break since is resumed by the pump.
        if len(self.outbox.unanswered) + self.inbox.results_unacked >= self.command_window:
            await self.flush(ack=True)
            await self._until(lambda: len(self.outbox.unanswered) + self.inbox.results_unacked < self.command_window,
                              deadline, "waiting for the command window")
        seq = self.outbox.add(command)
        result: asyncio.Future[session_pb2.CommandResult] = loop.create_future()
        self._futures[seq] = result
        # A bare timer on the result (not asyncio.timeout_at): half the cost, on every command.
        timer = loop.call_at(deadline, _expire, result)
        try:
            await self.flush()
            return await result
        except TimeoutError:
            self._futures.pop(seq, None)
            raise self.late_error(f"no result for command {seq} before the deadline (it may still be applied)",
                             seq=seq) from None
        finally:
            timer.cancel()

    def outcome(self, seq_result: session_pb2.CommandResult) -> transfer_pb2.TransferStatus | transfer_pb2.AbortAck:
        """A command's result as the unary call returns it, or its error raised."""
        kind = seq_result.WhichOneof("outcome")
        if kind == "submitted":
            return seq_result.submitted
        if kind == "aborted":
            return seq_result.aborted
        error = error_from_command(seq_result.error)
        error.__cause__ = CommandRefusedError(seq_result.error, seq_result.command_seq)
        if error.reason is Reason.DUPLICATE_REQUEST and seq_result.command_seq in self._resent:
            # Sent again into a new session after the old one was lost: the first copy was applied.
            known = self.book.latest.get(int(error.metadata.get("room", "-1")))
            if known is not None:
                return known
        raise error

    async def wait(self, rooms: Iterable[int], timeout: float) -> dict[int, transfer_pb2.TransferStatus]:
        """The terminal status of each room, within ``timeout`` seconds: a watch of the rooms until then."""
        deadline = asyncio.get_running_loop().time() + timeout
        pending = set(rooms)
        done: dict[int, transfer_pb2.TransferStatus] = {}
        over = asyncio.Event()

        def deliver(status: transfer_pb2.TransferStatus | None) -> None:
            if status is None:  # the session failed
                over.set()
            elif status.room in pending and self.book.terminal(status.room) is status:  # not an older generation's
                done[status.room] = status
                pending.discard(status.room)
                if not pending:
                    over.set()

        stop = self.watch(frozenset(pending), deliver)
        try:
            if pending:
                async with asyncio.timeout_at(deadline):
                    await over.wait()
        except TimeoutError:
            raise self.late_error("no terminal status before the deadline", rooms=sorted(pending)) from None
        finally:
            stop()
        if pending:
            assert self.failure is not None
            raise self.failure
        return done

    def watch(self, rooms: frozenset[int], deliver: Deliver) -> Callable[[], None]:
        """Deliver what is known of ``rooms`` now, then each change, then None when the session ends.

        Returns the function that stops the watch.
        """
        for status in self.book.current(rooms):
            deliver(status)
        if self.error is not None:
            deliver(None)
            return lambda: None
        watcher = (rooms, deliver)
        self._watchers.add(watcher)
        self._start()
        return lambda: self._watchers.discard(watcher)

    async def close(self) -> None:
        """Stop the pump and the stream (what waits on them gets UNAVAILABLE)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        if self.error is None:
            self._end(UnavailableError("the client closed the session"))


def _expire(result: asyncio.Future[Any]) -> None:
    """A command's deadline passed: its waiter gets TimeoutError (a later result is dropped)."""
    if not result.done():
        result.set_exception(TimeoutError())


__all__ = ["CommandRefusedError", "Deliver", "PeerSession", "SessionUnsupportedError"]
