"""Admission: registrations (checked, negotiated, judged off the loop when large), identities, removal.

A registration is checked and negotiated, replaces the stale state of a restarted decode (never a live one: ``IDENTITY_IN_USE``),
connects the executor on the peer's worker and admits the peer. Deregister, the operator's
Evict, a restart and a dead peer (PEER_GONE from the executor) all remove a peer here: its
open requests fail, its streams end, and its engine connection is dropped on its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from pdproto import backends
from pdproto.errors import (IdentityInUseError, InvalidFieldError, NotFoundError, PdprotoError, Reason,
                            ResourceLimitError)
from pdproto.negotiation.topology import Decision, Rejection, negotiate
from pdproto.transfer import Buffer, LayerSpan, TransferExecutor, TransferJob
from pdproto.v1 import handshake_service_pb2 as hs, registration_pb2

from .registry import ENGINE_BYTES, RESPONSE_BYTES, Allowance, Peer, identity_of, retry_after_ms
from .validate import Bounds, check_registration, page_limit, registration_entries

if TYPE_CHECKING:
    from .core import HandshakeCore

log = logging.getLogger("pdproto_server.admission")
HEAVY_ENTRIES = 1024
"""A registration listing more buffers and tensors than this is checked and negotiated off the loop;
real ones list a few hundred at most (two per layer for MHA, plus state tensors)."""

JUDGE_BURST, JUDGE_RATE = 4 * Bounds.REGIONS, Bounds.REGIONS // 4
"""Buffers and tensors of large registrations the judge takes at once, and per second after that (about
9 µs of its time each): a fleet's decodes registering together fit, and a token holder registering large
ones in a loop keeps the judge busy about 15 % of the time, not all of it."""
MAX_JUDGED = 4
"""Registrations on or waiting for the judge thread at once; more are refused TOO_MANY_REGISTRATIONS. Each
holds its parsed message while it waits, and costs the judge up to a few hundred ms for a few hundred KB
sent: unbounded, a token holder sending them concurrently grew the queue (and memory) without limit."""

IDENTITY_GRACE_S = 1.0
"""How long a registration naming a live peer waits for that peer's streams to end (a client closing them)."""
IDENTITY_POLLS = 20
PROVE_S = 10.0
"""How long a bound peer that has made no call with its whole credential keeps unbound registrations of its
identity out: its decode's first call follows its Register at once; a squatter that named another decode's
engine never makes one."""


class Admission:
    """Register, Deregister, Evict, and the removal of restarted and dead peers."""

    def __init__(self, core: HandshakeCore) -> None:
        self.core = core
        self.engine, self.limits, self.metrics, self.registry = core.engine, core.limits, core.metrics, core.registry
        core.runner.on_peer_gone = self._peer_gone
        self.credentials = EngineCredentials(core.engine.executor)
        self._registering = 0
        self._judge = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdproto-judge")
        """Checks and negotiates registrations of more than ``HEAVY_ENTRIES`` buffers and tensors, one at
        a time: on the loop, one would stall every other peer's calls for its whole length."""
        self.judged = 0
        """Registrations on or waiting for the judge thread (``DescribeResponse.registrations_judged``)."""
        self._judge_s = 0.1
        """Seconds the judge took per registration lately (a refused one is told to wait for the queue)."""
        self._judging = Allowance()
        """What the judge may still take (``JUDGE_BURST``, ``JUDGE_RATE``): all registrants share it, since
        Register names no peer yet."""

    async def register(self, request: hs.RegisterRequest, origin: str = "") -> hs.RegisterResponse:
        """Negotiate, replace a restarted peer's stale state, connect the executor, admit.

        The response carries the new peer's credential, which every later call for it must present.
        ``origin`` is the gRPC peer string of the call (validation reads where it came from).
        """
        try:
            result = await self._register(request, origin)
        except PdprotoError as exc:
            self.metrics.registered(exc.reason.code)
            raise
        self.metrics.registered("ACCEPTED")
        return result

    async def _register(self, request: hs.RegisterRequest, origin: str) -> hs.RegisterResponse:
        self.core.accepting()
        verdict = None
        entries = registration_entries(request.registration)
        if entries > HEAVY_ENTRIES:
            self._judge_room(entries)
            self.judged += 1
            try:
                reg, verdict = await asyncio.wrap_future(self._judge.submit(self._check_and_negotiate, request, origin))
            finally:
                self.judged -= 1
            self.core.accepting()
        else:
            reg = check_registration(request, origin)
        return await self._admit(reg, verdict or self._negotiate(reg))

    def _judge_room(self, entries: int) -> None:
        """Raise TOO_MANY_REGISTRATIONS, with the seconds to wait, unless the judge takes ``entries`` more."""
        wait = self.judged * self._judge_s if self.judged >= MAX_JUDGED else \
            self._judging.take(entries, JUDGE_BURST, JUDGE_RATE, time.monotonic())
        if wait:
            why = (f"{self.judged} are being checked or wait for it (limit {MAX_JUDGED})" if self.judged >= MAX_JUDGED
                   else f"their checks may take {JUDGE_RATE} buffers and tensors per second, and this one lists "
                        f"{entries}")
            raise ResourceLimitError(
                f"registrations of more than {HEAVY_ENTRIES} buffers and tensors arrive faster than the server "
                f"checks them: {why}; retry in {wait:.2f} s",
                reason=Reason.TOO_MANY_REGISTRATIONS,
                metadata={"entries": entries, "judged": self.judged, "retryAfterMs": retry_after_ms(wait)})

    def _negotiate(self, reg: registration_pb2.KvRegistration) -> Decision:
        """The verdict on ``reg``; a rejection raises its typed error."""
        started = time.perf_counter()
        verdict = negotiate(self.engine.source.info, reg)
        self.metrics.negotiation_seconds.observe(time.perf_counter() - started)
        if isinstance(verdict, Rejection):
            raise verdict.to_error()
        return verdict

    def _check_and_negotiate(self, request: hs.RegisterRequest,
                             origin: str) -> tuple[registration_pb2.KvRegistration, Decision]:
        """``check_registration`` and ``_negotiate`` together (on the judge's thread)."""
        started = time.perf_counter()
        try:
            reg = check_registration(request, origin)
            return reg, self._negotiate(reg)
        finally:
            self._judge_s = 0.5 * self._judge_s + 0.5 * (time.perf_counter() - started)

    async def _admit(self, reg: registration_pb2.KvRegistration, verdict: Decision) -> hs.RegisterResponse:
        """Connect the executor (on the peer's worker) and add the peer, as ``verdict`` says."""
        identity = identity_of(reg)
        bound = reg.HasField("credential_buffer")
        engine = backends.identity_key(reg)
        # Registrations of one decode rank run one at a time, so concurrent ones leave one peer.
        async with self.registry.serialized(identity):
            self.core.accepting()
            stale = await self._replaced(self.registry.stale_for(identity), identity, engine if bound else None)
            self.core.accepting()  # a drain may have begun while it waited for a closing client's streams
            self.registry.check_capacity(self._registering - len(stale))
            for old in stale:
                # Same notify endpoint or engine identity: the decode restarted (or one that binds its
                # credential to the engine replaces a holder that did not). The old peer's requests can
                # never complete; fail them and drop its engine connection.
                log.info("peer %s re-registered as a new peer; dropping stale state", old.peer_id)
                await self.drop(old, Reason.PEER_GONE, "the decode re-registered (restart)" if old.bound or not bound
                                else "a registration whose credential went through this engine took its identity")
            self.registry.check_capacity(self._registering)
            self._registering += 1
            try:
                peer_id = self.registry.new_id()
                result = verdict.to_proto()
                result.peer_id = peer_id
                peer = Peer(peer_id=peer_id, registration=reg, decision=verdict, result=result,
                            identity=identity, worker=self.engine.executor.worker(peer_id),
                            credential=self.registry.new_credential(), bound=bound)
                peer.page_limit = page_limit(peer)
                try:
                    await asyncio.wrap_future(peer.worker.submit(self.engine.executor.connect, peer_id, reg,
                                                                 what=f"connect {peer_id}"))
                    if bound:
                        tail = await asyncio.wrap_future(peer.worker.submit(
                            self.credentials.write, peer_id, reg, what=f"credential of {peer_id}"))
                        peer.credential = peer.credential[:RESPONSE_BYTES] + tail
                except BaseException:
                    # Never admitted; its connect (maybe still running) is undone in the background.
                    self.registry.remove(peer)
                    self._disconnect_later(peer)
                    raise
                self.registry.add(peer)
            finally:
                self._registering -= 1
        if bound:
            return hs.RegisterResponse(result=peer.result, peer_credential=peer.credential[:RESPONSE_BYTES],
                                       credential_bytes_in_engine=ENGINE_BYTES)
        return hs.RegisterResponse(result=peer.result, peer_credential=peer.credential)

    @staticmethod
    async def _replaced(stale: list[Peer], identity: tuple[str, ...], bound: str | None) -> list[Peer]:
        """The peers sharing ``identity`` that this registration replaces; IDENTITY_IN_USE if one is live.

        A decode's exit closes its streams, so a restarted one finds them closed; one that
        is still reading them is alive, and whoever names its endpoint or engine is not it
        (docs/security.md). Streams a client has just closed may take a moment to end
        here, so the check waits up to ``IDENTITY_GRACE_S`` for them. Binding the credential to
        the engine (``bound``: the engine's identity key, for a bound registration) proves the engine, not the notify endpoint (an address anyone can
        name): a bound registration is refused only by a live bound peer of its engine, replaces
        an unbound one of its engine even while it reads a stream, and leaves a live peer that
        shares only its notify endpoint alone. An unbound registration is refused by any peer
        that was bound, until it is gone (one that never made a call with its whole credential,
        for ``PROVE_S`` only).
        """
        for poll in range(IDENTITY_POLLS + 1):
            here = [p for p in stale if not p.closed and p.gone_at is None]
            now = time.monotonic()
            owner = [p for p in here if p.bound and not bound and (p.proven or now - p.registered_at < PROVE_S)]
            if bound:
                live = [p for p in here if p.attached() and p.bound and bound in p.identity]
                kept = [p for p in here if p.attached() and bound not in p.identity]
            else:
                live, kept = owner or [p for p in here if p.attached()], []
            if not live and (not kept or poll == IDENTITY_POLLS):
                return [p for p in stale if all(p is not k for k in kept)]
            if owner or (live and poll == IDENTITY_POLLS):
                break
            await asyncio.sleep(IDENTITY_GRACE_S / IDENTITY_POLLS)
        old = live[0]
        keys = sorted(set(identity) & set(old.identity))
        log.warning("refused a registration naming %s of live peer %s", ", ".join(keys), old.peer_id)
        if owner:
            raise IdentityInUseError(
                f"a registered decode with {', '.join(keys)} proved it owns that engine (its credential went "
                "through it): only a registration that proves it too (credential_buffer) replaces it",
                reason=Reason.IDENTITY_IN_USE, metadata={"identity": ",".join(keys)})
        raise IdentityInUseError(
            f"a registered decode with {', '.join(keys)} still reads its status stream: it is alive, so this "
            "is not its restart. A restarted decode can register once its old process is gone (its streams "
            "close with it); otherwise give this decode its own notify endpoint and engine",
            reason=Reason.IDENTITY_IN_USE, metadata={"identity": ",".join(keys)})

    async def deregister(self, request: hs.DeregisterRequest) -> int:
        """Fail the peer's open requests with PEER_GONE, cancel them, disconnect, forget it."""
        peer = self.registry.peer(request.peer_id, request.peer_credential)
        return await self.drop(peer, Reason.PEER_GONE, "the decode deregistered")

    async def evict(self, request: hs.EvictRequest) -> int:
        """Drop a peer for the operator (the caller checked the operator token); like ``deregister``."""
        peer = self.registry.peers.get(request.peer_id)
        if peer is None or peer.closed:
            raise NotFoundError(f"peer {request.peer_id!r} is not registered", reason=Reason.PEER_NOT_FOUND,
                                metadata={"peerId": request.peer_id})
        log.warning("the operator evicted peer %s", peer.peer_id)
        return await self.drop(peer, Reason.PEER_GONE, "the operator evicted the peer")

    async def drop(self, peer: Peer, reason: Reason, message: str) -> int:
        """Remove a peer and free everything it held; returns how many requests were failed.

        Its open requests end FAILED with ``reason`` (after their in-flight chunk drained,
        unless the peer's engine is stuck), its streams end after sending that, and its
        engine connection is dropped through its worker. The peer counts toward ``max_peers``
        until that disconnect has returned.
        """
        if peer.closed:
            return 0
        peer.closed = True
        self.registry.remove(peer)
        failed, done = await self._release(peer, reason, message)
        if not peer.worker.stuck:
            await asyncio.wait([done], timeout=self.limits.drain_timeout)
        return failed

    def _disconnect_later(self, peer: Peer) -> asyncio.Task[object]:
        """Drop the peer's engine connection on its worker, behind what runs there; once that returned (and
        so every earlier call), the peer stops counting toward ``max_peers``."""

        async def disconnect() -> None:
            loop = asyncio.get_running_loop()

            def release(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed while the engine held the call
                    loop.call_soon_threadsafe(self.registry.release, peer)

            try:
                call = peer.worker.submit(self.engine.executor.disconnect, peer.peer_id, cleanup=True,
                                          what=f"disconnect {peer.peer_id}")
                call.returned.add_done_callback(release)
                # Shielded: a cancelled wait must not cancel the disconnect queued behind a stuck call.
                await asyncio.shield(asyncio.wrap_future(call))
            except PdprotoError as exc:  # not queued (retired already, the process exits), or it failed
                log.warning("disconnect of %s failed: %s", peer.peer_id, exc)
                if not peer.worker.busy:
                    self.registry.release(peer)

        return self.core.spawn(disconnect(), f"disconnect-{peer.peer_id}")

    def _peer_gone(self, peer: Peer) -> None:
        """The executor found the peer dead: free it in the background (once)."""
        if peer.closed or peer.gone_at is not None:
            return
        peer.gone_at = time.monotonic()
        self.core.deadlines.add(peer.gone_at + self.limits.keep_finished, peer)
        log.warning("peer %s is gone (engine reported PEER_GONE); freeing its state", peer.peer_id)
        self.core.spawn(self._release(peer, Reason.PEER_GONE, "the decode process is gone"), f"gone-{peer.peer_id}")

    async def _release(self, peer: Peer, reason: Reason, message: str) -> tuple[int, asyncio.Task[object]]:
        """Fail the peer's open requests, end its streams, drop its engine connection in the background;
        (requests failed, the disconnect's task).

        A dead peer (PEER_GONE) keeps its record: its final statuses stay visible, and it counts toward
        ``max_peers``, until the decode re-registers (which replaces it) or ``keep_finished`` passes.
        """
        open_requests = list(peer.open.values())
        await asyncio.gather(*(self.core.runner.stop(peer, r, reason, message) for r in open_requests))
        peer.end_streams()
        return len(open_requests), self._disconnect_later(peer)

    def close(self) -> None:
        """Stop the judge (a peer's worker stuck in an engine is left behind: a daemon thread)."""
        stuck = [p.peer_id for p in self.registry.retired.values() if p.worker.busy]
        if stuck:
            log.warning("closing with engine calls still out for %d peers: %s", len(stuck), stuck[:8])
        self._judge.shutdown(wait=False, cancel_futures=True)


CREDENTIAL_SLOTS = 256
"""Credential writes that may be in flight at once; each needs its own source bytes until its engine call ends."""


class EngineCredentials:
    """Writes the engine-bound part of peer credentials from a small registered source region.

    A registration that names a ``credential_buffer`` gets the first ``RESPONSE_BYTES`` of its
    credential in the ``RegisterResponse`` and the last ``ENGINE_BYTES`` written through the
    transfer engine into that buffer, on the engine the registration names. Only the process that
    owns that engine reads them, so a token holder that names another decode's engine (a Mooncake
    session id is an address, so it can be guessed) gets a credential it cannot complete: it can
    open no stream and submit nothing, so it never holds the identity against the decode that does
    own the engine (docs/security.md).
    """

    def __init__(self, executor: TransferExecutor) -> None:
        self._executor = executor
        self._source: Buffer | None = None
        self._free = list(range(CREDENTIAL_SLOTS))
        self._lock = threading.Lock()

    def _take(self) -> tuple[Buffer, int]:
        with self._lock:
            if self._source is None:
                source = self._executor.allocate(ENGINE_BYTES * CREDENTIAL_SLOTS)
                self._executor.register_memory([source])
                self._source = source
            if not self._free:
                raise ResourceLimitError(
                    f"{CREDENTIAL_SLOTS} registrations are writing their credentials at once; retry shortly",
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


__all__ = ["Admission", "EngineCredentials", "HEAVY_ENTRIES", "JUDGE_BURST", "JUDGE_RATE", "MAX_JUDGED"]
