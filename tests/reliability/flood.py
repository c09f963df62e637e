"""The call-flood row: one peer calls as fast as it can while another moves its KV (local backend).

A victim decode runs requests one after another (submit, wait for SUCCESS, check the bytes),
first alone, then while a second registered peer floods the server from eight threads with
peer-scoped calls (``Describe`` with its own credential, which lists nothing: the cheapest call
a credential makes), each thread waiting for one call's answer before the next, or sending 50 at
once. Against a server with no call rate (``--call-rate 0``) and with one: the flooder's calls are
held to the rate, those past what the server holds refused ``TOO_MANY_CALLS`` with
``retryAfterMs``; the victim's are never held or refused. Reported, not asserted: the victim's
median transfer time with the flood over without it, for each case (what the rate buys).
"""

from __future__ import annotations

import statistics
import threading
import time

import grpc

from pdproto import errors as E
from pdproto.client import HandshakeClient
from pdproto.errors import Reason
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc
from pdproto_demo.decode import DecodeRank
from pdproto_demo.synthetic import SyntheticSpec
from pdproto_server.registry import CALL_BURST_S, CALL_HOLD_S
from tests._flood import calling
from tests._server_harness import running_server

from .harness import Outcome

SPEC = SyntheticSpec(layers=8, row_bytes=1152, pages=512, page_size=16, prompt_tokens=2048, chunk_tokens=512)
ARGS = ("--layers", str(SPEC.layers), "--row-bytes", str(SPEC.row_bytes), "--pages", str(SPEC.pages),
        "--page-size", str(SPEC.page_size), "--prompt-tokens", str(SPEC.prompt_tokens),
        "--chunk-tokens", str(SPEC.chunk_tokens), "--chunk-delay-ms", "0")
RATE = 100
"""The limited server's ``--call-rate``."""
REQUESTS = 20
"""Victim requests alone and as many flooded."""
BLOCKS = 4
THREADS = 8
AT_ONCE = 50


def _victim_times(out: Outcome, victim: DecodeRank, client: HandshakeClient, peer_id: str,
                  first_room: int) -> list[float]:
    """Run a block of requests one at a time; the seconds each took from submit to SUCCESS."""
    pages = victim.pages_for(SPEC.prompt_tokens)
    times = []
    for room in range(first_room, first_room + REQUESTS // BLOCKS):
        started = time.perf_counter()
        client.submit_transfer(peer_id, victim.transfer_info(room, pages))
        done = client.wait_for(peer_id, [room], timeout=60)
        times.append(time.perf_counter() - started)
        out.succeeded(done)
        checked = victim.verify({room: pages}, SPEC.prompt_tokens)
        out.bytes_verified += checked
        if done[room].state == common_pb2.TRANSFER_STATE_SUCCESS and not checked:
            out.corrupted += 1
            out.problems.append(f"room {room}: no bytes verified")
    return times


def _one_server(out: Outcome, rate: int, at_once: int) -> float:
    """Victim alone, then under a flood of ``at_once`` calls per thread at a time, against a server with
    ``--call-rate rate``; returns the ratio."""
    victim, flooder = DecodeRank.for_spec(SPEC, pages=SPEC.pages), DecodeRank.for_spec(SPEC, pages=16)
    try:
        with running_server(*ARGS, "--call-rate", str(rate)) as srv, \
                HandshakeClient(srv.target, timeout=60) as client, grpc.insecure_channel(srv.target) as channel:
            good = client.register(victim.registration()).peer_id
            bad = client.register(flooder.registration()).peer_id
            describe = hs_grpc.HandshakeServiceStub(channel).Describe
            own = hs.DescribeRequest(peer_id=bad, peer_credential=client.credential(bad))
            outcomes: list[E.PdprotoError | None] = []
            flooding, stop = threading.Event(), threading.Event()
            threads = [threading.Thread(target=calling, args=(lambda: describe.future(own, timeout=30), at_once,
                                                              outcomes, flooding, stop), daemon=True)
                       for _ in range(THREADS)]
            for t in threads:
                t.start()
            alone: list[float] = []
            flooded: list[float] = []
            try:
                # Blocks of requests alone and flooded, in turn: the host's other load falls on both alike.
                for block in range(2 * BLOCKS):
                    (flooding.set if block % 2 else flooding.clear)()
                    time.sleep(0.3)
                    (flooded if block % 2 else alone).extend(
                        _victim_times(out, victim, client, good, 1 + block * REQUESTS // BLOCKS))
            finally:
                stop.set()
                flooding.set()
                for t in threads:
                    t.join(30)
            refused = [o for o in outcomes if o is not None]
            out.runs += 1
            out.faults += 1
            wrong = [o for o in refused if not (isinstance(o, E.ResourceLimitError) and o.reason is Reason.TOO_MANY_CALLS
                                                and int(o.metadata.get("retryAfterMs", "0")) > 0)]
            out.expect(not wrong, f"--call-rate {rate}: flood refused otherwise: {wrong[:2]}")
            # Threads that wait for each answer are only held; fifty at once each are more than the rate holds.
            expect_refusals = rate > 0 and THREADS * at_once > rate * (CALL_BURST_S + CALL_HOLD_S)
            out.expect(bool(refused) == expect_refusals, f"--call-rate {rate}, {at_once} at once: "
                                                         f"{len(refused)} of {len(outcomes)} refused")
            if not wrong:
                out.failed_expected += 1
            views = {p.peer_id: p for p in client.describe().peers}
            out.expect(views[good].calls_refused == 0, f"the victim was refused {views[good].calls_refused} calls")
            out.expect(srv.proc.poll() is None, "the server died")
            ratio = statistics.median(flooded) / statistics.median(alone)
            out.notes.append(
                f"--call-rate {rate or 'off'}: flooder {len(outcomes)} calls from {THREADS} threads ({at_once} at once), "
                f"{len(refused)} refused TOO_MANY_CALLS; victim's {REQUESTS} transfers of "
                f"{SPEC.prompt_tokens} tokens, median {statistics.median(alone) * 1e3:.0f} ms alone, "
                f"{statistics.median(flooded) * 1e3:.0f} ms flooded: ratio {ratio:.2f}")
            out.extra[f"ratio_rate_{rate}_{at_once}"] = ratio
            return ratio
    finally:
        victim.close()
        flooder.close()


def call_flood(backend: str = "local") -> Outcome:
    """The call-flood row (see the module doc)."""
    out = Outcome("call flood -> TOO_MANY_CALLS", backend)
    try:
        for rate, at_once in ((0, 1), (RATE, 1), (0, AT_ONCE), (RATE, AT_ONCE)):
            _one_server(out, rate, at_once)
    except E.PdprotoError as exc:
        out.problems.append(f"row crashed: {exc}")
    return out
