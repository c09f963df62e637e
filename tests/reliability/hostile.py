"""The hostile-peer row: an authenticated decode that attacks, against a real ``pdproto serve`` (local backend).

A bystander decode has two requests in flight (chunks 200 ms apart) while a second,
token-holding decode tries everything the issue named:

* another peer's id with its own credential, with none and with a guess: submit into the
  bystander's pages, abort, watch, deregister (unary calls), and open a Session as it;
* its own peer: a destination page past its memory, sizes and names past every bound
  (``tests/test_bad_input.py``), a message over the size limit, bytes that are no message;
* registrations naming the bystander: its notify endpoint, and its arena (engine identity),
  each refused ``IDENTITY_IN_USE`` while the bystander reads its status stream;
* registrations naming hostile arenas: every kind ``tests/_arena_peer.py`` serves (unsealed,
  FIFO, /dev/shm and disk files, ...), and old-style arena names that are a symlink to a
  file it does not own and a FIFO;
* sessions opened back to back with its 100 kept statuses, each asking for the largest window
  and leaving after the first frame: past its snapshot allowance, refused ``TOO_MANY_STREAMS``;
* twelve registrations of 16,000 KV buffers at once: past what the judge queues, refused
  ``TOO_MANY_REGISTRATIONS``.

Each attempt must be refused with a typed reason (the error's ``reason``; a raw gRPC status
where the call never reaches a handler), the file behind the symlink must be untouched, and
the bystander's requests must land byte-exact, as must the attacker's own request afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable

import grpc

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.rpc import error_from_rpc
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, registration_pb2, session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.proc import Child
from pdproto_server.registry import CREDENTIAL_BYTES, Limits
from tests._arena_peer import KINDS
from tests._server_harness import SERVE_ARGS, SPEC, proof_metadata, running_server
from tests.test_bad_input import REGISTRATIONS, TRANSFERS

from .harness import Outcome
from .limits import _expect_error

TOKEN = "hostile-row-token"
SLOW = ("--chunk-delay-ms", "200", "--match-timeout", "20")
INFLIGHT, KEPT = 28, 100
"""The server's --max-inflight and --max-finished: the attacker keeps KEPT statuses, and a full snapshot
(the allowance's unit) is INFLIGHT + KEPT."""
LIMITS = ("--max-inflight", str(INFLIGHT), "--max-finished", str(KEPT))
FLOOD = 40
SUCCESS = common_pb2.TRANSFER_STATE_SUCCESS
NOT_FOUND = {Reason.PEER_NOT_FOUND}
METHOD = "/pdproto.v1.HandshakeService/"


def _grpc_code(out: Outcome, what: str, codes: set[grpc.StatusCode], call: Callable[[], object]) -> None:
    """A raw call that must end with one of ``codes`` (it is refused before any handler runs)."""
    out.runs += 1
    out.faults += 1
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() in codes:
            out.failed_expected += 1
            out.notes.append(f"{what}: {exc.code().name}")
        else:
            out.problems.append(f"{what}: wrong status {exc.code().name}: {exc.details()}")
        return
    out.problems.append(f"{what}: accepted")


def _other_peers_id(out: Outcome, target: str, victim: DecodeRank, vid: str, placed: dict[int, list[int]],
                    own: bytes) -> None:
    """Every call on the bystander's id, with the attacker's credential, none and a guess."""
    guesses = {"own credential": own, "no credential": b"", "a guess": secrets.token_bytes(CREDENTIAL_BYTES)}
    into_victim = victim.transfer_info(13, placed[11])
    with HandshakeClient(target, token=TOKEN, timeout=10, session=False) as unary:
        for name, cred in guesses.items():
            _expect_error(out, f"submit into another peer ({name})", NOT_FOUND,
                          lambda c=cred: unary.submit_transfer(vid, into_victim, credential=c))
            _expect_error(out, f"abort another peer's request ({name})", NOT_FOUND,
                          lambda c=cred: unary.abort(vid, 11, credential=c))
            _expect_error(out, f"watch another peer ({name})", NOT_FOUND,
                          lambda c=cred: list(unary.watch_status(vid, [11], timeout=2, credential=c)))
            _expect_error(out, f"deregister another peer ({name})", NOT_FOUND,
                          lambda c=cred: unary.deregister(vid, credential=c))
    for name, cred in guesses.items():
        with HandshakeClient(target, token=TOKEN, timeout=10) as session:
            session.adopt(vid, cred)
            _expect_error(out, f"a Session as another peer ({name})", NOT_FOUND,
                          lambda s=session: s.wait_for(vid, [11], timeout=5))


def _impersonations(out: Outcome, client: HandshakeClient, victim: DecodeRank) -> None:
    """Register as the bystander (its notify endpoint, then its arena) while it reads its stream."""
    other = _stranger()
    by_notify, by_engine = victim.registration(), victim.registration()
    by_notify.local.CopyFrom(other.local)
    by_engine.notify_endpoint.CopyFrom(other.notify_endpoint)
    for name, reg in (("notify endpoint", by_notify), ("arena", by_engine)):
        _expect_error(out, f"register as the bystander (its {name})", {Reason.IDENTITY_IN_USE},
                      lambda r=reg: client.register(r))


def _stranger() -> registration_pb2.KvRegistration:
    """A valid registration of a decode identity nobody registered (a refused one then replaces no one)."""
    template = DecodeRank.for_spec(SPEC, pages=16)
    try:
        return template.registration()
    finally:
        template.close()


def _bad_inputs(out: Outcome, target: str, attacker: DecodeRank, client: HandshakeClient, hid: str) -> None:
    """Out-of-bounds pages, every over-bound field, an oversized message, garbage bytes."""
    far = attacker.transfer_info(30, [1 << 30] * len(attacker.pages_for(SPEC.prompt_tokens)))
    _expect_error(out, "destination page past its memory",
                  {Reason.DESTINATION_OUT_OF_BOUNDS, Reason.INVALID_FIELD},
                  lambda: client.submit_transfer(hid, far))
    for room, (case, (mutate, _)) in enumerate(TRANSFERS.items(), start=31):
        info = attacker.transfer_info(room, attacker.pages_for(SPEC.prompt_tokens))
        mutate(info)
        _expect_error(out, f"transfer: {case}", {Reason.INVALID_FIELD},
                      lambda i=info: client.submit_transfer(hid, i))
    for case, (mutate, _) in REGISTRATIONS.items():
        reg = _stranger()
        mutate(reg)
        _expect_error(out, f"registration: {case}", {Reason.INVALID_FIELD}, lambda r=reg: client.register(r))
    metadata = proof_metadata(target, TOKEN)
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as chan:
        big = chan.unary_unary(METHOD + "Register", request_serializer=hs.RegisterRequest.SerializeToString)
        huge = _stranger()
        huge.model_id = "m" * (6 << 20)
        _grpc_code(out, "a 6 MiB registration", {grpc.StatusCode.RESOURCE_EXHAUSTED},
                   lambda: big(hs.RegisterRequest(registration=huge), timeout=10, metadata=metadata))
        for method in ("Register", "SubmitTransfer", "Abort"):
            raw = chan.unary_unary(METHOD + method)
            _grpc_code(out, f"garbage bytes to {method}", {grpc.StatusCode.INVALID_ARGUMENT},
                       lambda r=raw: r(b"\xff\xff\xff\xff\x0f" + os.urandom(64), timeout=10, metadata=metadata))


def _hostile_arenas(out: Outcome, client: HandshakeClient) -> None:
    """Every hostile arena kind, a /dev/shm symlink to a file it does not own and a FIFO: refused."""
    base = _stranger()
    served = Child.spawn("arena-peer", "tests._arena_peer", [])
    try:
        served.recv(60)
        for kind in KINDS:
            if kind == "good":
                continue
            reply = served.call("serve", kind=kind)
            reg = registration_pb2.KvRegistration()
            reg.CopyFrom(base)
            reg.local.CopyFrom(registration_pb2.KvRegistration.FromString(
                bytes.fromhex(reply["registration"])).local)
            _expect_error(out, f"arena {kind}", {Reason.INVALID_FIELD}, lambda r=reg: client.register(r))
    finally:
        served.close()
    with tempfile.TemporaryDirectory() as tmp:
        victim = os.path.join(tmp, "not-yours")
        with open(victim, "wb") as f:
            f.write(b"v" * 4096)
        link = f"/dev/shm/pdproto-rel-link-{os.getpid()}"
        fifo = f"/dev/shm/pdproto-rel-fifo-{os.getpid()}"
        os.symlink(victim, link)
        os.mkfifo(fifo)
        try:
            for what, path in (("symlink", link), ("FIFO", fifo)):
                reg = registration_pb2.KvRegistration()
                reg.CopyFrom(base)
                reg.local.Clear()
                reg.local.shm_name = os.path.basename(path)
                reg.local.size = 1 << 20
                reg.local.pid = os.getpid()
                _expect_error(out, f"an arena named as a /dev/shm {what}", {Reason.INVALID_FIELD},
                              lambda r=reg: client.register(r))
            with open(victim, "rb") as f:
                out.expect(f.read() == b"v" * 4096, "the file behind the symlink was written")
            out.expect(os.path.lexists(link) and os.path.exists(fifo), "the prefill deleted a file it does not own")
        finally:
            os.unlink(link)
            os.unlink(fifo)


def _snapshot_flood(out: Outcome, target: str, client: HandshakeClient, hid: str) -> None:
    """Sessions opened back to back, each asking for the largest window and leaving after its first
    frame: past the peer's snapshot allowance each is refused TOO_MANY_STREAMS."""
    for first in range(1000, 1000 + KEPT, INFLIGHT):
        rooms = range(first, first + INFLIGHT)
        for room in rooms:
            client.submit_transfer(hid, transfer_pb2.TransferInfo(room=room, dst_kv_pages=[0], is_dummy=True))
        client.wait_for(hid, rooms, timeout=60)
    opening = hs.SessionRequest(open=session_pb2.SessionOpen(
        peer_id=hid, peer_credential=client.credential(hid), event_window=8192))
    session = grpc.insecure_channel(target)
    metadata = proof_metadata(target, TOKEN)
    call_session = session.stream_stream(METHOD + "Session", request_serializer=hs.SessionRequest.SerializeToString,
                                         response_deserializer=hs.SessionResponse.FromString)
    served = refused = 0
    started = time.monotonic()
    try:
        for _ in range(FLOOD):
            call = call_session(iter([opening]), timeout=10, metadata=metadata)
            out.runs += 1
            try:
                next(call)
                served += 1
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if error.reason is not Reason.TOO_MANY_STREAMS:
                    out.problems.append(f"snapshot flood: wrong error {str(error)[:160]}")
                    continue
                refused += 1
                out.faults += 1
                out.failed_expected += 1
            finally:
                call.cancel()
    finally:
        session.close()
    capacity, rate = Limits(max_inflight_per_peer=INFLIGHT, max_finished_per_peer=KEPT).snapshot_allowance
    bound = int((capacity + (time.monotonic() - started) * rate) / KEPT) + 1
    out.expect(refused > 0 and served <= bound,
               f"snapshot flood: {served} of {FLOOD} sessions were sent {KEPT} statuses each (at most {bound})")
    shown = next(p for p in client.describe().peers if p.peer_id == hid).snapshots_refused
    out.expect(shown == refused, f"snapshot flood: Describe counts {shown} refusals of the peer, not {refused}")
    out.notes.append(f"snapshot flood: {FLOOD} sessions opened back to back, {refused} refused TOO_MANY_STREAMS")


def _registration_flood(out: Outcome, target: str) -> None:
    """Twelve registrations of 16,000 KV buffers each sent at once: past what the judge queues, each is
    refused TOO_MANY_REGISTRATIONS; the rest end typed (they name a decode that is gone)."""
    big = _stranger()
    for _ in range(16_000):
        big.kv_buffers.add().CopyFrom(big.kv_buffers[0])
    with grpc.insecure_channel(target) as chan:
        register = chan.unary_unary(METHOD + "Register", request_serializer=hs.RegisterRequest.SerializeToString,
                                    response_deserializer=hs.RegisterResponse.FromString)
        calls = [register.future(hs.RegisterRequest(registration=big), timeout=60,
                                 metadata=proof_metadata(target, TOKEN)) for _ in range(12)]
        refused = 0
        for call in calls:
            exc = call.exception()
            out.runs += 1
            if exc is None:
                continue
            error = error_from_rpc(exc)  # type: ignore[arg-type]  # a failed future holds an RpcError
            if error.reason is Reason.TOO_MANY_REGISTRATIONS:
                refused += 1
                out.faults += 1
                out.failed_expected += 1
            elif error.reason is Reason.INTERNAL:
                out.problems.append(f"registration flood: untyped error {str(error)[:160]}")
    out.expect(refused > 0, "registration flood: twelve registrations of 16,000 buffers at once were all queued")
    out.notes.append(f"registration flood: 12 registrations of 16,000 buffers at once, {refused} refused "
                     "TOO_MANY_REGISTRATIONS")


def _count_served(out: Outcome, rank: DecodeRank, client: HandshakeClient, pid: str,
                  placed: dict[int, list[int]]) -> None:
    """Wait for ``placed`` rooms; each must be SUCCESS, and the whole pool byte-exact."""
    out.succeeded(client.wait_for(pid, placed, timeout=60))
    try:
        out.bytes_verified += rank.verify(placed, SPEC.prompt_tokens)
    except AssertionError as exc:
        out.corrupted += len(placed)
        out.ok -= len(placed)
        out.problems.append(f"bytes differ: {str(exc)[:200]}")


def hostile_peer(backend: str = "local") -> Outcome:
    """The hostile-peer row (see the module doc)."""
    out = Outcome("hostile peer", backend)
    bystander = DecodeRank.for_spec(SPEC, pages=64, backend=backend)
    attacker = DecodeRank.for_spec(SPEC, pages=64, backend=backend)
    try:
        with running_server(*SERVE_ARGS, "--backend", backend, *SLOW, *LIMITS, token=TOKEN) as srv, \
                HandshakeClient(srv.target, token=TOKEN, timeout=20) as vc, \
                HandshakeClient(srv.target, token=TOKEN, timeout=20) as hc:
            vid = vc.register(bystander.registration()).peer_id
            hid = hc.register(attacker.registration()).peer_id
            placed = {room: bystander.pages_for(SPEC.prompt_tokens, first_page=i * 16)
                      for i, room in enumerate((11, 12))}
            for room, pages in placed.items():
                vc.submit_transfer(vid, bystander.transfer_info(room, pages))
            finals: list[int] = []
            watcher = threading.Thread(target=lambda: finals.extend(
                s.room for s in vc.watch_status(vid, placed, timeout=60) if s.state == SUCCESS), daemon=True)
            watcher.start()
            _other_peers_id(out, srv.target, bystander, vid, placed, hc.credential(hid))
            _impersonations(out, hc, bystander)
            _bad_inputs(out, srv.target, attacker, hc, hid)
            if backend == "local":
                _hostile_arenas(out, hc)
            _snapshot_flood(out, srv.target, hc, hid)
            _registration_flood(out, srv.target)
            _count_served(out, bystander, vc, vid, placed)
            mine = {21: attacker.pages_for(SPEC.prompt_tokens)}
            hc.submit_transfer(hid, attacker.transfer_info(21, mine[21]))
            _count_served(out, attacker, hc, hid, mine)
            vc.deregister(vid)
            watcher.join(30)
            out.expect(sorted(finals) == sorted(placed), f"the bystander's watch saw {finals}")
            out.expect(srv.proc.poll() is None, f"the server died: {srv.proc.returncode}")
            out.notes.insert(0, f"{out.faults} attacks refused with a typed reason while the bystander's "
                                f"{len(placed)} requests moved byte-exact")
    except E.PdprotoError as exc:
        out.problems.append(f"row crashed: {exc}")
    finally:
        bystander.close()
        attacker.close()
    return out


def identity_squat(backend: str, rounds: int = 3) -> Outcome:
    """Token holders squat decodes' engine identities; the decodes that bind their credentials win.

    Each round, against two fresh victims: a squatter registers the first victim's registration
    with its ``credential_buffer`` (the engine's half lands in the victim's memory: its stream and
    submit are refused ``PEER_NOT_FOUND``), and the victim registers over it; then claims on the
    victim, bound and unbound, are refused ``IDENTITY_IN_USE``. Another squatter registers the second
    victim's registration unbound and reads a status stream; that victim registers over it too (the
    squatter's stream ends, its credential dies). A third squatter binds its own engine under a third
    victim's notify endpoint and reads a stream: the victim still registers (a notify endpoint is an
    address, proof of nothing). Every victim's request lands byte-exact.
    """
    out = Outcome("identity squat", backend)
    with running_server(*SERVE_ARGS, "--backend", backend, token=TOKEN) as srv:
        for r in range(rounds):
            victims = [DecodeRank.for_spec(SPEC, pages=32, backend=backend, name=f"victim-{r}-{i}-{os.getpid()}")
                       for i in range(3)]
            try:
                with HandshakeClient(srv.target, token=TOKEN, timeout=10) as squatter:
                    _notify_squat(out, srv.target, victims[2], squatter, backend)
                    _bound_squat(out, srv.target, victims[0], squatter)
                    _unbound_squat(out, srv.target, victims[1], squatter)
                for i, victim in enumerate(victims):
                    _served(out, victim, room=500 + 3 * r + i)
            except Exception as exc:  # noqa: BLE001 - a crashed round is a problem, never a skip
                out.problems.append(f"round {r} crashed: {type(exc).__name__}: {exc}")
            finally:
                for victim in victims:
                    victim.close()
    return out


def _streaming(client: HandshakeClient, peer_id: str, credential: bytes | None = None) -> bool:
    """Whether the server counts a status stream (``WatchStatus`` or ``Session``) of the peer, within 5 s."""
    for _ in range(100):
        if any(p.watch_streams + p.sessions_connected
               for p in client.describe(peer_id=peer_id, credential=credential).peers if p.peer_id == peer_id):
            return True
        time.sleep(0.05)
    return False


def _notify_squat(out: Outcome, target: str, victim: DecodeRank, squatter: HandshakeClient, backend: str) -> None:
    """A squatter binds its own engine under the victim's notify endpoint and reads a stream: both are served."""
    own = DecodeRank.for_spec(SPEC, pages=8, backend=backend, name=f"notify-squatter-{os.getpid()}")
    try:
        reg = own.registration(bound=True)
        reg.notify_endpoint.CopyFrom(victim.registration().notify_endpoint)
        sid = squatter.register(reg, read_credential=own.credential.read).peer_id

        def watch() -> None:
            with contextlib.suppress(E.PdprotoError):
                for _ in squatter.watch_status(sid, timeout=30):
                    pass

        threading.Thread(target=watch, daemon=True).start()
        if not _streaming(squatter, sid):
            out.problems.append("the notify-endpoint squatter's status stream never opened")
        out.runs += 1
        out.faults += 1
        try:
            victim.connect([target], token=TOKEN)  # a notify endpoint is an address: it keeps no one out
        except E.PdprotoError as exc:
            out.problems.append(f"a live peer under the victim's notify endpoint kept it out: {exc}")
            return
        out.failed_expected += 1
        out.notes.append("notify-endpoint squatter: the victim registered beside it")
        squatter.deregister(sid)
    finally:
        own.close()


def _bound_squat(out: Outcome, target: str, victim: DecodeRank, squatter: HandshakeClient) -> None:
    """A squatter names the victim's engine with its credential_buffer; then claims the live victim."""
    before = victim.credential.read(16)
    sid = squatter.register(victim.registration(bound=True), read_credential=lambda n: bytes(n)).peer_id
    if victim.credential.read(16) == before:
        out.problems.append("the engine's half of the squatter's credential did not land in the victim's memory")
    _expect_error(out, "bound squatter watches", NOT_FOUND, lambda: list(squatter.watch_status(sid, timeout=5)))
    _expect_error(out, "bound squatter submits", NOT_FOUND,
                  lambda: squatter.submit_transfer(sid, victim.transfer_info(1, victim.pages_for(64))))
    victim.connect([target], token=TOKEN)
    assert victim.peer is not None
    rank = victim.peer.ranks[0]
    if not _streaming(squatter, rank.peer_id, rank.client.credential(rank.peer_id)):
        out.problems.append("the victim's status stream never opened")
    for what, claim, reader in (("unbound", victim.registration(), None),
                                ("bound", victim.registration(bound=True), lambda n: bytes(n))):
        _expect_error(out, f"{what} claim on the live victim", {Reason.IDENTITY_IN_USE},
                      lambda claim=claim, reader=reader: squatter.register(claim, read_credential=reader))


def _unbound_squat(out: Outcome, target: str, victim: DecodeRank, squatter: HandshakeClient) -> None:
    """A squatter registers the victim's identity unbound and reads a stream; the victim takes it over."""
    uid = squatter.register(victim.registration()).peer_id
    ended = threading.Event()

    def watch() -> None:
        try:
            for _ in squatter.watch_status(uid, timeout=60):
                pass
        except E.PdprotoError:
            pass
        ended.set()

    threading.Thread(target=watch, daemon=True).start()
    if not _streaming(squatter, uid):
        out.problems.append("the unbound squatter's status stream never opened")
    victim.connect([target], token=TOKEN)
    out.runs += 1
    out.faults += 1
    if ended.wait(30):
        out.failed_expected += 1
        out.notes.append("live unbound squatter: displaced by the decode that proved its engine")
    else:
        out.problems.append("the unbound squatter's stream did not end when the victim took the identity over")
    _expect_error(out, "displaced squatter submits", NOT_FOUND,
                  lambda: squatter.submit_transfer(uid, victim.transfer_info(2, victim.pages_for(64))))


def _served(out: Outcome, victim: DecodeRank, room: int) -> None:
    """One request of the victim through its own decode peer: SUCCESS and byte-exact."""
    pages = victim.pages_for(SPEC.prompt_tokens)
    victim.request(room, 0, SPEC.prompt_tokens, [], pages)
    assert victim.peer is not None
    outcome = victim.peer.wait(room, timeout=60)
    out.runs += 1
    if outcome.state != SUCCESS:
        out.lost += 1
        out.problems.append(f"victim's room {room}: {outcome}")
        return
    out.ok += 1
    try:
        out.bytes_verified += victim.verify({room: pages}, SPEC.prompt_tokens)
    except AssertionError as exc:
        out.ok -= 1
        out.corrupted += 1
        out.problems.append(f"bytes differ: {str(exc)[:200]}")
