"""The decode peer: one decode rank's registrations with its prefill ranks, its requests and their outcomes.

What it does, and who uses it: README.md here (``peer.py``). Two orderings matter. ``abort``
waits for the room's submit to each rank first: calls on one channel may be served out of
order, and a rank that saw the abort first would acknowledge it and then write pages the
caller freed. A new registration with a rank the caller ``drop``ped waits for its release
(``Deregister``), or the prefill, alive after all, would read this live decode as an
impostor (IDENTITY_IN_USE).

The network calls run on the shared event loop (``pdproto.rpc.loop.LoopThread``); the public
methods may be called from any thread. ``connect`` blocks (one Register per new rank); ``submit``
and ``abort`` return at once, their results arriving as outcomes and futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdproto.errors import DeadlineExceededError, PdprotoError, Reason, error_for
from pdproto.negotiation.fanin import FanInTracker, Outcome
from pdproto.negotiation.senders import SenderSet
from pdproto.negotiation.tpmap import PACKED_FAN_IN
from pdproto.rpc.loop import LoopThread
from pdproto.session import TERMINAL_STATES
from pdproto.v1 import registration_pb2, server_info_pb2, transfer_pb2

from ._async import AsyncHandshakeClient
from ._rpc import CredentialReader

log = logging.getLogger(__name__)

WATCH_S = 300.0
"""Deadline of one status stream; it is opened again at once when it passes. A rank whose stream
is broken then (its process died while its host engine still believes in it) ends UNAVAILABLE and
is lost: within SGLang's own waiting timeout (300 s), not an hour later."""
RELEASE_S = 2.0
"""Longest wait for a dropped prefill rank to answer our ``Deregister`` (it may be dead)."""
RETRY_AFTER_S = 5.0
"""A prefill rank whose registration failed is not tried again for this long: its requests fail at
once with that failure, where each would block the caller for the whole Register deadline (a dead
or unreachable prefill would stall a host engine's scheduler, request after request)."""
PROBE_S = 0.5
"""At a ``wait``'s deadline, how long each rank still silent is asked once more for the room."""


@dataclass(eq=False)
class PrefillRank:
    """One prefill rank this decode peer registered with."""

    address: str
    """host:port of the rank's handshake service."""
    index: int
    """This peer's number for the rank (the fan-in's sender key)."""
    client: AsyncHandshakeClient
    result: server_info_pb2.NegotiationResult
    """What the rank's ``Register`` answered (peer id, mode, sender set)."""
    senders: SenderSet
    """The prefill ranks this decode rank hears from, as that rank computed them."""
    dummy: bool
    """That rank writes nothing here: submitted to (``is_dummy``), not waited for."""
    rooms: set[int] = field(default_factory=set)
    """Rooms waiting for this rank's terminal status."""
    watch: asyncio.Task[None] | None = None

    @property
    def peer_id(self) -> str:
        """The peer id the rank gave this decode."""
        return self.result.peer_id


def _check_kv_shares(room: int, ranks: Sequence[PrefillRank]) -> None:
    """Refuse a request that misses a prefill rank writing part of this decode rank's KV: a CP rank of a
    prefill whose CP ranks each send a share of the pages or their own layers (``PrefillServerInfo``
    ``cp_ranks_split_pages``, ``enable_dsa_cache_layer_split``), or a TP rank (KV cache sharding, heads):
    the KV would arrive in part and still read as SUCCESS."""
    asked = {(m.tp_rank, m.pp_rank, m.cp_rank) for r in ranks if r.senders.senders
             for m in (r.senders.senders[r.result.senders.self_index],)}
    missing = sorted({(s.tp_rank, s.pp_rank, s.cp_rank) for r in ranks for s in r.senders.senders
                      if s.sends_kv and (s.tp_rank, s.pp_rank, s.cp_rank) not in asked})
    if any(cp for _, _, cp in missing):
        cps = sorted({cp for _, _, cp in missing if cp})
        raise error_for(Reason.TOPOLOGY_PREFILL_CP_UNSUPPORTED,
                        f"room {room}: the prefill's attention-CP ranks each send part of the KV, and this "
                        f"request does not reach CP ranks {cps}: ask every CP rank (an SGLang decode: set "
                        "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 as on the prefill)",
                        metadata={"room": room, "missingCpRanks": ",".join(map(str, cps))})
    if missing:
        raise error_for(Reason.INVALID_FIELD,
                        f"room {room}: prefill ranks (tp, pp, cp) {missing} write part of this decode rank's KV"
                        " (KV cache sharding, or their heads) and the request does not reach them: ask every"
                        " sender of the negotiation", metadata={"room": room, "field": "addresses"})


@dataclass(frozen=True)
class PackedFanIn:
    """What a room's prefill ranks wrote packed (docs/protocol.md section 3, packed fan-in)."""

    pages: tuple[int, ...]
    """The room's destination pages but its last: those to put back in row order."""
    page_size: int
    """Rows in one of those pages (the decode's registered page size)."""
    slices: dict[int, list[tuple[int, int]]]
    """Per decode KV entry written packed, every sender's (offset, length) in its rows."""
    row_bytes: dict[int, int]
    """Per such entry, the bytes of one of its rows."""


def _fan_in_slices(ranks: Sequence[PrefillRank], registration: registration_pb2.KvRegistration,
                   ) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int]]:
    """Per decode KV entry that ``ranks`` write packed (docs/protocol.md section 3, packed fan-in), every sender's
    (offset, length) in its rows; and the bytes of each such entry's row.

    Raises ``UnsupportedVersionError`` when some of them write an entry packed and others do not
    (prefill ranks of two releases): no order of the page's bytes would then be right; and
    ``InvalidFieldError`` when they say packed where this decode did not ask for it, or their slices
    are not equal parts that fill the entry's row: nothing the decode reorders may come from a guess.
    """
    packed: dict[int, set[bool]] = {}
    slices: dict[int, set[tuple[int, int]]] = {}
    for r in ranks:
        for e in r.result.entries:
            if e.HasField("row_slice") and e.row_slice.length:
                packed.setdefault(e.dst_entry, set()).add(e.packed_fan_in)
                slices.setdefault(e.dst_entry, set()).add((e.row_slice.dst_offset, e.row_slice.length))
    mixed = sorted(e for e, kinds in packed.items() if len(kinds) > 1)
    if mixed:
        raise error_for(Reason.UNSUPPORTED_VERSION,
                        f"prefill ranks {sorted(r.address for r in ranks)} disagree on packed fan-in for decode KV "
                        f"entries {mixed}: some write their heads packed, others row by row (two releases?)",
                        metadata={"entries": ",".join(map(str, mixed))})
    out = {e: sorted(slices[e]) for e, kinds in packed.items() if kinds == {True}}
    rows: dict[int, int] = {}
    buffers, page = registration.kv_buffers, registration.page_size or 1
    for entry, cuts in out.items():
        row = rows[entry] = (buffers[entry].item_len or registration.kv_item_len) // page if entry < len(buffers) else 0
        width = cuts[0][1]
        if PACKED_FAN_IN not in registration.capabilities or not row or row % width or \
                cuts != [(k * width, width) for k in range(row // width)]:
            raise error_for(Reason.INVALID_FIELD,
                            f"prefill ranks {sorted(r.address for r in ranks)} write decode KV entry {entry} packed as "
                            f"slices {cuts} of its {row}-byte rows, which "
                            + ("this decode did not ask for" if PACKED_FAN_IN not in registration.capabilities
                               else "are not equal parts that fill the row"),
                            metadata={"field": "result.entries.packed_fan_in", "entry": entry})
    return out, rows


OutcomeHandler = Callable[[int, Outcome], None]
Infos = Sequence[transfer_pb2.TransferInfo] | Callable[[PrefillRank], transfer_pb2.TransferInfo]
Submitted = concurrent.futures.Future[transfer_pb2.TransferStatus | PdprotoError]
"""A submit's future: the rank's status right after it, or the refusal (the room fails with it)."""


class DecodePeer:
    """One decode rank's prefill ranks, requests and outcomes (module docstring)."""

    def __init__(self, registration: registration_pb2.KvRegistration, *, token: str | None = None,
                 root_cert: bytes | str | Path | None = None, server_name: str | None = None,
                 timeout: float = 5.0, on_outcome: OutcomeHandler | None = None,
                 read_credential: CredentialReader | None = None) -> None:
        self.registration = registration
        self.read_credential = read_credential
        """Reads back the credential part a prefill rank wrote into ``registration.credential_buffer``."""
        self.timeout = timeout
        """Default deadline of each call to a prefill rank."""
        self.on_outcome = on_outcome
        """Called once per submitted room with its terminal outcome (on the loop's thread: keep it short)."""
        self._client = functools.partial(AsyncHandshakeClient, token=token, root_cert=root_cert,
                                         server_name=server_name, timeout=timeout)
        self.loop = LoopThread.shared()
        self._ranks: dict[str, PrefillRank] = {}
        self._ranks_lock = threading.Lock()
        """Guards ``_ranks``; never held while waiting for the loop (the loop takes it too)."""
        self._connecting = threading.Lock()
        """Serializes registrations (callers' threads only), so a rank is registered once."""
        self._failed: dict[str, tuple[float, PdprotoError]] = {}
        """Prefill ranks whose registration failed: until when they are not tried again, and why."""
        self._numbers = itertools.count()
        self._generations = itertools.count(1)
        self._tracker = FanInTracker()
        self._lock = threading.Lock()
        """Guards the tracker, the outcome futures and the ranks' room sets (callers and the loop)."""
        self._outcomes: dict[int, concurrent.futures.Future[Outcome]] = {}
        self._closing: dict[str, asyncio.Task[None]] = {}
        """Dropped ranks being released (deregistered, their clients closed), by address (loop only)."""
        self._submits: dict[int, dict[str, Submitted]] = {}
        """Submits by room and rank address, for the aborts that must wait for them."""
        self._fan_ins: dict[int, PackedFanIn] = {}
        """Rooms whose prefill ranks write heads packed (until forgotten)."""

    # -- ranks --------------------------------------------------------------------------

    @property
    def ranks(self) -> list[PrefillRank]:
        """The prefill ranks registered with now, in registration order."""
        with self._ranks_lock:
            return list(self._ranks.values())

    def connect(self, address: str, timeout: float | None = None) -> PrefillRank:
        """The rank at ``address``, registering with it first if needed (``timeout``: the Register deadline)."""
        with self._connecting:
            with self._ranks_lock:
                rank = self._ranks.get(address)
            if rank is not None:
                return rank
            failed = self._failed.get(address)
            now = time.monotonic()
            if failed is not None and now < failed[0]:
                until, exc = failed
                raise error_for(exc.reason, f"registration with prefill rank {address} failed "
                                f"{RETRY_AFTER_S - (until - now):.1f} s ago and is retried after "
                                f"{RETRY_AFTER_S:g} s: {exc.message}", metadata={"address": address})
            budget = self.timeout if timeout is None else timeout
            try:
                rank = self.loop.run(self._register(address, budget), timeout=budget + self.timeout * 2,
                                     what=f"registration with prefill rank {address}")
            except PdprotoError as exc:
                self._failed[address] = (time.monotonic() + RETRY_AFTER_S, exc)
                raise
            self._failed.pop(address, None)
            with self._ranks_lock:
                self._ranks[address] = rank
            return rank

    async def _register(self, address: str, timeout: float) -> PrefillRank:
        await self._released(address, timeout=self.timeout)
        client = self._client(address)
        try:
            result = await client.register(self.registration, timeout=timeout, read_credential=self.read_credential)
        except BaseException:
            await client.close()
            raise
        senders = SenderSet.from_proto(result.senders)
        me = senders.senders[result.senders.self_index] if senders.senders else None
        rank = PrefillRank(address, next(self._numbers), client, result, senders, dummy=me is not None and me.dummy)
        rank.watch = asyncio.get_running_loop().create_task(self._watch(rank), name=f"watch-{address}")
        log.info("pdproto: registered with prefill rank %s as %s (mode %d%s)", address, rank.peer_id,
                 result.mode, ", dummy" if rank.dummy else "")
        return rank

    async def _watch(self, rank: PrefillRank) -> None:
        """The rank's status stream for as long as the rank is ours: every status into the fan-in."""
        while True:
            try:
                async for status in rank.client.watch_status(rank.peer_id, timeout=WATCH_S):
                    self._apply(rank, status)
            except asyncio.CancelledError:
                return
            except PdprotoError as exc:
                if exc.reason is Reason.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: open it again (it starts with a snapshot)
                self._lost(rank, exc.reason.name, exc.message)
                return
            except Exception as exc:  # noqa: BLE001 - the rooms waiting on this rank must still end
                log.exception("pdproto: status stream of %s broke", rank.address)
                self._lost(rank, Reason.INTERNAL.name, repr(exc))
                return
            # The server ends a stream only when it dropped the peer or shuts down.
            self._lost(rank, Reason.UNAVAILABLE.name, "the prefill rank ended its status stream")
            return

    def _apply(self, rank: PrefillRank, status: transfer_pb2.TransferStatus) -> None:
        with self._lock:
            outcome = self._tracker.update(status, sender=rank.index)
            if status.state in TERMINAL_STATES:
                rank.rooms.discard(status.room)
            first = self._settle(status.room, outcome)
        if first is not None and self.on_outcome is not None:
            self.on_outcome(status.room, first)

    def _fail(self, room: int, code: str, reason: str) -> None:
        with self._lock:
            first = self._settle(room, self._tracker.fail(room, code, reason))
        if first is not None and self.on_outcome is not None:
            self.on_outcome(room, first)

    def _settle(self, room: int, outcome: Outcome | None) -> Outcome | None:
        """The room's outcome if it just became terminal (first time for this submit), else None (lock held)."""
        future = self._outcomes.get(room)
        if outcome is None or not outcome.terminal or future is None or future.done():
            return None
        future.set_result(outcome)
        return outcome

    def _lost(self, rank: PrefillRank, code: str, message: str) -> None:
        """The rank's stream broke: fail what waits on it, and register again on next use."""
        log.warning("pdproto: status stream of prefill rank %s ended: %s: %s", rank.address, code, message)
        with self._ranks_lock:
            if self._ranks.get(rank.address) is rank:
                del self._ranks[rank.address]
        with self._lock:
            rooms, rank.rooms = set(rank.rooms), set()
        for room in rooms:
            self._fail(room, code, f"lost prefill rank {rank.address}: {message}")
        self._retire(rank)

    def drop(self, addresses: Sequence[str]) -> None:
        """Forget these prefill ranks (found dead by the host engine); each is released in the background."""
        with self._ranks_lock:
            gone = [self._ranks.pop(a) for a in addresses if a in self._ranks]
        for rank in gone:
            self.loop.loop.call_soon_threadsafe(self._retire, rank)

    def _retire(self, rank: PrefillRank) -> None:
        """Release a rank no longer ours in the background (loop only)."""
        self._closing[rank.address] = self.loop.loop.create_task(
            self._release(rank, min(RELEASE_S, self.timeout)), name=f"release-{rank.address}")

    async def _release(self, rank: PrefillRank, deregister_s: float | None) -> None:
        """Stop the rank's status stream (unless it is the caller), deregister (within ``deregister_s``;
        None: not at all), close its client.

        A host engine drops a rank on missed heartbeats, and may be wrong: a prefill that is alive
        would go on writing the rooms just failed and maybe reused. ``Deregister`` returns once
        that rank's in-flight chunks drained, so afterwards it writes nothing here, and it frees
        this rank's identity at once for the next registration. A rank that is really gone
        answers with an error (or not in time): nothing is left to stop there.
        """
        if rank.watch is not None and rank.watch is not asyncio.current_task():
            rank.watch.cancel()
        try:
            if deregister_s is not None:
                await rank.client.deregister(rank.peer_id, timeout=deregister_s)
        except PdprotoError as exc:
            log.info("pdproto: deregistering from prefill rank %s: %s", rank.address, exc.reason.name)
        except Exception:  # noqa: BLE001 - the client must still close
            log.exception("pdproto: deregistering from prefill rank %s failed", rank.address)
        finally:
            await rank.client.close()

    async def _released(self, address: str, timeout: float | None = None) -> None:
        """Wait for the release of the rank dropped at ``address``, if there is one (loop only)."""
        closing = self._closing.get(address)
        if closing is not None:
            await asyncio.wait([closing], timeout=timeout)

    # -- requests -------------------------------------------------------------------------

    def submit(self, room: int, addresses: Sequence[str], infos: Infos, *, generation: int | None = None,
               timeout: float | None = None) -> int:
        """Hand each prefill rank at ``addresses`` its ``TransferInfo`` of ``room``; returns the generation.

        ``infos`` is one message per address, or a function that builds one for a rank. The peer
        sets its room, generation (default: the next of this peer's numbering), ``is_dummy``
        and ``required_dst_info_num`` from the rank's negotiation. Registers with a rank first
        where needed (one dropped or lost since). Raises ``TopologyError`` when ``addresses`` miss
        a CP rank that sends a share of the pages, ``InvalidFieldError`` when they miss another rank
        that writes KV here. The submits run in the background: a refusal fails the room (its
        outcome); ``submitted`` waits for them.
        """
        if not addresses:
            raise error_for(Reason.INVALID_FIELD, f"room {room}: a request needs at least one prefill rank",
                            metadata={"field": "addresses"})
        ranks = [self.connect(a) for a in addresses]
        _check_kv_shares(room, ranks)
        slices, rows = _fan_in_slices(ranks, self.registration)
        built = [infos(r) if callable(infos) else infos[i] for i, r in enumerate(ranks)]
        generation = next(self._generations) if generation is None else generation
        live = [r.index for r in ranks if not r.dummy]
        with self._lock:
            self._tracker.expect(room, generation, live or [ranks[0].index])
            self._outcomes[room] = concurrent.futures.Future()
            for r in ranks:
                if not r.dummy:
                    r.rooms.add(room)
            # Before any submit goes out: the room's outcome may follow it at once.
            self._fan_ins.pop(room, None)
            if slices:
                pages = next(b for r, b in zip(ranks, built, strict=True) if not r.dummy).dst_kv_pages
                self._fan_ins[room] = PackedFanIn(tuple(pages[:-1]), self.registration.page_size, slices, rows)
        futures = self._submits[room] = {}
        for r, info in zip(ranks, built, strict=True):
            info.room, info.generation, info.is_dummy = room, generation, r.dummy
            info.required_dst_info_num = r.senders.decode_ranks_per_prefill_rank or 1
            futures[r.address] = self.loop.submit(self._submit(r, info, timeout))
        return generation

    async def _submit(self, rank: PrefillRank, info: transfer_pb2.TransferInfo,
                      timeout: float | None) -> transfer_pb2.TransferStatus | PdprotoError:
        try:
            status = await rank.client.submit_transfer(rank.peer_id, info, timeout=timeout)
        except PdprotoError as exc:
            self._fail(info.room, exc.reason.name, f"prefill rank {rank.address} refused room {info.room}: "
                                                   f"{exc.message}")
            return exc
        except Exception as exc:  # noqa: BLE001 - a bug must fail the request, not vanish in a future
            log.exception("pdproto: submit of room %d to %s failed", info.room, rank.address)
            message = f"submit to prefill rank {rank.address} failed: {exc!r}"
            self._fail(info.room, Reason.INTERNAL.name, message)
            return error_for(Reason.INTERNAL, message)
        self._apply(rank, status)
        return status

    def submitted(self, room: int, timeout: float) -> list[transfer_pb2.TransferStatus]:
        """Wait for ``room``'s submits: each rank's status right after it, in ``submit``'s order (a refusal raised)."""
        futures = list(self._submits.get(room, {}).values())
        if concurrent.futures.wait(futures, timeout).not_done:
            raise DeadlineExceededError(f"the submits of room {room} did not end within {timeout:g} s",
                                        reason=Reason.DEADLINE_EXCEEDED, metadata={"room": room})
        results = [f.result() for f in futures]
        for r in results:
            if isinstance(r, PdprotoError):
                raise r
        return [r for r in results if not isinstance(r, PdprotoError)]

    def wait(self, room: int, timeout: float) -> Outcome:
        """``room``'s terminal outcome, waiting up to ``timeout`` s.

        At the deadline each rank still silent is asked once more (``PROBE_S``): a terminal
        status still counts; an error fails the room with that rank's reason (UNAVAILABLE when
        the prefill was unreachable all along); otherwise it fails DEADLINE_EXCEEDED.
        """
        with self._lock:
            future = self._outcomes.get(room)
        if future is None:
            raise error_for(Reason.REQUEST_NOT_FOUND, f"room {room} was not submitted here, or was forgotten",
                            metadata={"room": room})
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            self.loop.run(self._overdue(room, timeout), timeout=PROBE_S + self.timeout, what=f"probing room {room}")
        return future.result(0)

    async def _overdue(self, room: int, waited: float) -> None:
        with self._lock:
            silent = [r for r in self.ranks if room in r.rooms]
        got = await asyncio.gather(*(r.client.wait_for(r.peer_id, [room], timeout=PROBE_S) for r in silent),
                                   return_exceptions=True)
        for rank, final in zip(silent, got, strict=True):
            if isinstance(final, PdprotoError):
                self._fail(room, final.reason.name, f"{rank.address}: {final.message}")
            elif isinstance(final, BaseException):
                raise final
            else:
                self._apply(rank, final[room])
        self._fail(room, Reason.DEADLINE_EXCEEDED.name, f"no terminal status of room {room} within {waited:g} s")

    def fan_in(self, room: int) -> PackedFanIn | None:
        """What ``room``'s prefill ranks write packed, to put back in row order once it succeeded (before the
        engine reads its pages; ``pdproto.transfer.packing.unpack_fan_in``); None when nothing is packed."""
        with self._lock:
            return self._fan_ins.get(room)

    def statuses(self, room: int) -> list[transfer_pb2.TransferStatus]:
        """The latest status of each rank ``room`` waits for (for its byte and chunk counts)."""
        with self._lock:
            return self._tracker.statuses(room)

    def abort(self, room: int, generation: int, addresses: Sequence[str] | None = None, *,
              timeout: float | None = None) -> list[concurrent.futures.Future[transfer_pb2.AbortAck | None]]:
        """Abort a request generation on each rank at ``addresses`` (default: every registered one).

        Each future ends once its rank drained the request: with the rank's ``AbortAck``, or
        None where nothing was left to abort (the rank no longer knows the request; or it was
        dropped, once its release is done). Any other refusal ends it with that error.
        """
        addresses = [r.address for r in self.ranks] if addresses is None else addresses
        out = []
        for address in addresses:
            with self._ranks_lock:
                rank = self._ranks.get(address)
            submitted = self._submits.get(room, {}).get(address)
            out.append(self.loop.submit(self._abort(address, rank, room, generation, submitted, timeout)))
        return out

    async def _abort(self, address: str, rank: PrefillRank | None, room: int, generation: int,
                     submitted: Submitted | None, timeout: float | None) -> transfer_pb2.AbortAck | None:
        if rank is None:
            await self._released(address)
            return None
        if submitted is not None:
            await asyncio.wait([asyncio.wrap_future(submitted)])
        try:
            return await rank.client.abort(rank.peer_id, room, generation, timeout=timeout)
        except PdprotoError as exc:
            if exc.reason in (Reason.REQUEST_NOT_FOUND, Reason.STALE_GENERATION, Reason.PEER_NOT_FOUND):
                return None
            log.warning("pdproto: abort of room %d on %s failed: %s", room, address, exc)
            raise
        except Exception:
            log.exception("pdproto: abort of room %d on %s failed", room, address)
            raise

    def forget(self, room: int) -> None:
        """Stop tracking ``room``; a submit still on its way is kept for an abort that follows."""
        submits = self._submits.pop(room, None)
        pending = {a: f for a, f in (submits or {}).items() if not f.done()}
        if pending:
            # A host may clear a failed room before it aborts it (SGLang's decode.py pop_transferred:
            # failure_exception, then ensure_abort_notified): the abort must still wait for these,
            # or a rank could see it first, acknowledge it, and then write pages the host freed.
            self._submits[room] = pending
            for future in pending.values():
                future.add_done_callback(functools.partial(self._submitted, room, pending))
        with self._lock:
            self._tracker.forget(room)
            self._outcomes.pop(room, None)
            self._fan_ins.pop(room, None)
            for rank in self.ranks:
                rank.rooms.discard(room)

    def _submitted(self, room: int, pending: dict[str, Submitted], _: object) -> None:
        """A kept submit of a forgotten room ended: forget the room's submits once all have."""
        if self._submits.get(room) is pending and all(f.done() for f in pending.values()):
            self._submits.pop(room, None)

    # -- life cycle -----------------------------------------------------------------------

    def close(self, *, deregister: bool = True) -> None:
        """Release every prefill rank: deregistered first, or (``deregister=False``) left to find out, as
        after a crash, once this decode's streams closed."""
        deregister_s = RELEASE_S if deregister else None
        with self._ranks_lock:
            ranks, self._ranks = list(self._ranks.values()), {}

        async def release() -> None:
            await asyncio.gather(*(self._release(r, deregister_s) for r in ranks))
            if self._closing:
                await asyncio.wait(self._closing.values(), timeout=RELEASE_S)

        self.loop.run(release(), timeout=(deregister_s or 0) + RELEASE_S + self.timeout,
                      what="releasing the prefill ranks")


__all__ = ["PROBE_S", "RELEASE_S", "RETRY_AFTER_S", "WATCH_S", "DecodePeer", "OutcomeHandler", "PackedFanIn",
           "PrefillRank"]
