"""Crashing peers and multi-host, against a real ``pdproto serve`` and real engines.

* **crashing peer** (each backend): a decode process that dies (SIGKILL) while its request
  is mid-transfer: that request ends FAILED with a reason, a bystander decode is served
  byte-exact before and after, and the server keeps serving. Per backend, also:
  - local: a decode that tries to shrink its arena (the kernel refuses: sealed) and then
    drops it: its next request fails PEER_GONE; hostile arenas of every kind
    (``tests/_arena_peer.py``) are refused at Register with a reason;
  - nixl: registrations whose metadata loads another agent, or an agent whose name is not
    UTF-8, are refused; a row past the peer's NIXL region refuses that job only, and a
    peer's disconnect leaves another peer on the same agent served (``tests/_engine_rig.py``).
* **multi-host** (mooncake, nixl): ``pdproto serve`` and decodes in two network namespaces
  joined by a veth pair (``tests/_netns.py``): default decodes are served byte-exact, one
  that advertises 127.0.0.1 is refused at Register. Skipped, with the reason, where
  namespaces cannot be created.

``python -m tests.reliability.crash TARGET BACKEND MODE`` is the decode side of the
crashing-peer row (one process per decode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError, Reason
from pdproto.v1 import common_pb2, registration_pb2
from pdproto_demo.decode import DecodeRank
from pdproto_demo.proc import Child
from pdproto_demo.synthetic import SyntheticSpec

from tests import _netns
from tests._arena_peer import KINDS
from tests._engine_rig import run_scenario
from tests._server_harness import REPO, SERVE_ARGS, SPEC, running_server

from .harness import Outcome
from .limits import _expect_error

SLOW = ("--chunk-delay-ms", "300", "--match-timeout", "30")
"""Chunks 300 ms apart: a decode killed after the first one dies mid-transfer."""
DEADLINE = 30.0
FAILED, SUCCESS = common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_SUCCESS


def served(out: Outcome, target: str, backend: str, room: int, *, module: str = "tests.reliability.crash",
           env: dict[str, str] | None = None) -> None:
    """A bystander decode (its own process, ``module``'s ``serve``) moves one request; count it ok or lost."""
    proc = subprocess.run([sys.executable, "-m", module, target, backend, "serve", str(room)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    out.runs += 1
    try:
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out.lost += 1
        out.problems.append(f"bystander room {room} crashed: {proc.stderr[-300:]}")
        return
    if r.get("mismatch"):
        out.corrupted += 1
        out.problems.append(f"bystander room {room}: {r['mismatch']}")
    elif r.get("state") == SUCCESS:
        out.ok += 1
        out.bytes_verified += int(r["checked"])
    else:
        out.lost += 1
        out.problems.append(f"bystander room {room}: {r}")


def _dies_mid_transfer(out: Outcome, target: str, backend: str) -> None:
    """A decode process SIGKILLed after its request's first chunk moved: FAILED with a reason."""
    child = Child.spawn(f"crash-{backend}", "tests.reliability.crash", [target, backend, "die", "1"])
    try:
        ready = child.recv(60)
        child.kill()
        child.proc.wait(timeout=10)
        out.faults += 1
        out.runs += 1
        with HandshakeClient(target, timeout=10) as client:
            client.adopt(ready["peer"], bytes.fromhex(ready["credential"]))
            final = None
            try:
                for status in client.watch_status(ready["peer"], [1], timeout=DEADLINE):
                    if status.state in (FAILED, SUCCESS):
                        final = status
                        break
            except PdprotoError as exc:  # the stream may end with the peer
                final = None
                out.notes.append(f"dead decode's stream ended: {exc.reason.name}")
        if final is not None and final.state == FAILED and final.failure_code:
            out.failed_expected += 1
            out.notes.append(f"decode killed mid-transfer: {final.failure_code}")
        elif final is not None and final.state == SUCCESS:
            out.problems.append("the killed decode's request reported SUCCESS")
        else:
            out.lost += 1
            out.problems.append(f"the killed decode's request has no terminal status: {final}")
    finally:
        child.close()


def _local_arenas(out: Outcome, target: str) -> None:
    """Hostile arenas refused at Register; a decode that shrinks then drops its arena fails alone."""
    hostile = Child.spawn("arena-peer", "tests._arena_peer", [])
    try:
        hostile.recv(60)
        template = DecodeRank.for_spec(SPEC, pages=16)
        base = template.registration()
        template.close()
        with HandshakeClient(target, timeout=20) as client:
            for kind in KINDS:
                if kind == "good":
                    continue
                reply = hostile.call("serve", kind=kind)
                reg = registration_pb2.KvRegistration()
                reg.CopyFrom(base)  # a valid layout; only the arena it names is hostile
                reg.local.CopyFrom(registration_pb2.KvRegistration.FromString(
                    bytes.fromhex(reply["registration"])).local)
                _expect_error(out, f"arena {kind}", {Reason.INVALID_FIELD}, lambda r=reg: client.register(r))
    finally:
        hostile.close()
    shrinker = DecodeRank.for_spec(SPEC, pages=32)
    try:
        with HandshakeClient(target, timeout=20) as client:
            peer = client.register(shrinker.registration()).peer_id
            fd = getattr(shrinker.executor, "_arena_fd", -1)
            try:
                os.ftruncate(fd, 0)
                out.problems.append("a decode truncated its sealed arena")
            except OSError as exc:
                out.notes.append(f"arena truncation refused by the kernel: {exc.strerror}")
            pages = shrinker.pages_for(SPEC.prompt_tokens)
            client.submit_transfer(peer, shrinker.transfer_info(1, pages))
            st = client.wait_for(peer, [1], timeout=DEADLINE)[1]
            out.runs += 1
            if st.state == SUCCESS:
                out.ok += 1
                out.bytes_verified += shrinker.verify({1: pages}, SPEC.prompt_tokens)
            else:
                out.lost += 1
                out.problems.append(f"after a refused truncation: {st.failure_code}")
            shrinker.executor.close()  # drops its arena
            out.faults += 1
            client.submit_transfer(peer, shrinker.transfer_info(2, pages))
            st = client.wait_for(peer, [2], timeout=DEADLINE)[2]
            out.runs += 1
            if st.state == FAILED and st.failure_code == "PEER_GONE":
                out.failed_expected += 1
                out.notes.append("a decode that dropped its arena: PEER_GONE")
            else:
                out.lost += 1
                out.problems.append(f"a decode that dropped its arena: {st.state} {st.failure_code}")
    finally:
        shrinker.close()


def _count_rig(out: Outcome, scenario: str) -> None:
    """Engine-level NIXL checks (``tests/_engine_rig.py``): refusals count as faults with a reason."""
    r = run_scenario(scenario, "nixl")
    for key, value in r.items():
        if not isinstance(value, dict) or "ok" not in value:
            continue
        out.runs += 1
        if value["ok"]:
            out.ok += 1
        elif value.get("reason") in ("INVALID_FIELD", "DESTINATION_OUT_OF_BOUNDS"):
            out.faults += 1
            out.failed_expected += 1
            out.notes.append(f"{scenario}/{key}: {value['reason']}")
        else:
            out.lost += 1
            out.problems.append(f"{scenario}/{key}: {value}")
    for flag in ("a_exact", "exact"):
        if flag in r:
            out.expect(bool(r[flag]), f"{scenario}: the surviving peer's bytes differ")
    for flag in ("mismatch_left_loaded", "not_utf8_left_loaded"):
        if flag in r:
            out.expect(not r[flag], f"{scenario}: a refused agent was left loaded ({flag})")


def crashing_peer(backend: str) -> Outcome:
    """The crashing-peer row of one backend (see the module doc)."""
    out = Outcome("crashing peer", backend)
    with running_server(*SERVE_ARGS, "--backend", backend, *SLOW) as srv:
        served(out, srv.target, backend, 10)
        _dies_mid_transfer(out, srv.target, backend)
        if backend == "local":
            _local_arenas(out, srv.target)
        served(out, srv.target, backend, 11)
        out.expect(srv.proc.poll() is None, f"the server died: {srv.proc.returncode}")
    if backend == "nixl":
        for scenario in ("identity", "bounds", "shared"):
            _count_rig(out, scenario)
    return out


def multihost(backend: str) -> Outcome:
    """Prefill and decodes on two hosts (network namespaces); skipped with the reason when impossible."""
    out = Outcome("multi-host (netns + veth)", backend)
    can, why = _netns.available()
    if not can:
        out.skipped = why
        return out
    r = _netns.multihost(backend, requests=3)
    default = r.get("default", {})
    out.runs += 3
    out.ok += int(default.get("ok", 0))
    out.lost += 3 - int(default.get("ok", 0))
    out.bytes_verified += int(default.get("checked", 0))
    if default.get("ok") != 3:
        out.problems.append(f"default decode: {default}")
    if "session_id" in default:
        out.notes.append(f"a default decode advertised {default['session_id']}")
    out.runs += 1
    out.faults += 1
    refused = r.get("loopback", {}).get("refused")
    if refused and "PDPROTO_ADVERTISE_HOST" in refused.get("message", ""):
        out.failed_expected += 1
        out.notes.append(f"a decode advertising 127.0.0.1: {refused['reason']} ({refused['field']})")
    else:
        out.problems.append(f"a decode advertising 127.0.0.1 was not refused with what to set: {r.get('loopback')}")
    out.expect(r.get("serve_first_line", "").startswith('{"event": "listening"'),
               f"serve's first stdout line: {r.get('serve_first_line')!r}")
    out.expect(bool(r.get("serve_alive")), "the server died")
    return out


def _decode(target: str, backend: str, mode: str, room: int, spec: SyntheticSpec = SPEC) -> dict[str, Any]:
    """Decode side: ``serve`` moves one request and checks every byte; ``die`` reports its ids
    and waits to be killed."""
    rank = DecodeRank.for_spec(spec, pages=max(32, -(-spec.prompt_tokens // spec.page_size)), backend=backend)
    try:
        with HandshakeClient(target, timeout=30) as client:
            peer = client.register(rank.registration()).peer_id
            pages = rank.pages_for(spec.prompt_tokens)
            client.submit_transfer(peer, rank.transfer_info(room, pages))
            if mode == "die":
                for status in client.watch_status(peer, [room], timeout=DEADLINE):
                    if status.state == common_pb2.TRANSFER_STATE_TRANSFERRING:
                        break
                return {"peer": peer, "credential": client.credential(peer).hex()}
            st = client.wait_for(peer, [room], timeout=60)[room]
            out: dict[str, Any] = {"state": int(st.state), "code": st.failure_code, "checked": 0}
            if st.state == SUCCESS:
                try:
                    out["checked"] = rank.verify({room: pages}, spec.prompt_tokens)
                except AssertionError as exc:
                    out["mismatch"] = str(exc)[:300]
            client.deregister(peer)
            return out
    finally:
        if mode != "die":
            rank.close()


def main(argv: list[str]) -> int:
    """Decode process of the crashing-peer row: one JSON line; ``die`` then sleeps until killed."""
    from pdproto_demo.proc import redirect_stdout_to_stderr

    out = redirect_stdout_to_stderr()
    target, backend, mode, room = argv
    out.write(json.dumps(_decode(target, backend, mode, int(room))) + "\n")
    out.flush()
    if mode == "die":
        time.sleep(600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
