"""The stuck-peer row (mooncake, nixl): a frozen and a black-holed decode hold nothing another peer needs.

Against a real ``pdproto serve`` (16 MiB per request in 4 chunks 300 ms apart, each engine
call bounded by ``--engine-timeout``; UCX over TCP, where a stopped peer really stalls a
transfer), with real decode processes:

* **frozen**: a decode with five requests open is SIGSTOPped mid-transfer. A bystander
  decode registers and moves a request byte-exact meanwhile; the frozen peer's requests all
  end FAILED with a reason (``DEADLINE_EXCEEDED``: its worker is fenced, what queues behind
  the stuck call fails at once), delivered to a Session opened for it afterwards.
* **black-holed**: an endpoint that accepts connections and never answers. A decode process
  SIGSTOPped before it registers (the kernel accepts its TCP connections; nothing answers)
  and, on Mooncake, a bare socket that accepts and stays silent, registered as the session.
  Mooncake probes a session at Register: that Register fails ``DEADLINE_EXCEEDED`` while
  the bystander is served. NIXL loads the agent without contacting it: its requests fail
  with a reason at the engine deadline, and the bystander is served.

Afterwards no engine call is left in flight and the server still serves byte-exact.
``python -m tests.reliability.stuck TARGET BACKEND MODE ROOM`` is a decode of this row
(``serve``: one request checked byte-exact; ``frozen``: open requests, then wait to be stopped).
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from typing import Any

from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError
from pdproto.v1 import common_pb2, transfer_pb2
from pdproto_demo.decode import DecodeConfig, DecodeProcess, DecodeRank
from pdproto_demo.proc import Child
from pdproto_demo.synthetic import SyntheticSpec

from tests._server_harness import running_server

from .crash import _decode, served
from .harness import LOG_DIR, Outcome, wait_until

SPEC = SyntheticSpec(layers=4, row_bytes=2048, pages=256, page_size=16, prompt_tokens=2048,
                     chunk_tokens=512, chunk_delay=0.3)
ENGINE_TIMEOUT = 4.0
ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
"""NIXL over TCP on loopback in the server and every decode: over shared memory UCX writes into a stopped process."""
STUCK_ROOMS = list(range(5000, 5005))
FAILED, SUCCESS = common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_SUCCESS
REASONS = {"DEADLINE_EXCEEDED", "PEER_GONE", "TRANSFER_FAILED"}


def _serve_args(backend: str) -> tuple[str, ...]:
    s = SPEC
    return ("--backend", backend, "--layers", str(s.layers), "--row-bytes", str(s.row_bytes), "--pages", str(s.pages),
            "--page-size", str(s.page_size), "--prompt-tokens", str(s.prompt_tokens), "--chunk-tokens",
            str(s.chunk_tokens), "--chunk-delay-ms", str(int(s.chunk_delay * 1000)), "--match-timeout", "60",
            "--engine-timeout", str(ENGINE_TIMEOUT), "--keep-finished", "60")


def _finals(out: Outcome, target: str, peer_id: str, credential: bytes, rooms: list[int], what: str,
            reasons: frozenset[str] | set[str] = REASONS) -> None:
    """A Session opened for the stuck peer gets each room's final status: FAILED with one of ``reasons``."""
    try:
        with HandshakeClient(target, timeout=30) as client:
            client.adopt(peer_id, credential)
            finals = client.wait_for(peer_id, rooms, timeout=ENGINE_TIMEOUT * 6)
    except PdprotoError as exc:
        out.runs += len(rooms)
        out.lost += len(rooms)
        out.problems.append(f"{what}: no final statuses: {exc}")
        return
    for room in rooms:
        st = finals[room]
        out.runs += 1
        if st.state == FAILED and st.failure_code in reasons:
            out.failed_expected += 1
        else:
            out.lost += 1
            out.problems.append(f"{what}: room {room} ended {st.state} {st.failure_code!r}")
    out.notes.append(f"{what}: {len(rooms)} requests FAILED "
                     f"{sorted({finals[r].failure_code for r in rooms})}, read from a Session opened afterwards")


def _frozen(out: Outcome, target: str, backend: str) -> None:
    """A decode with open requests SIGSTOPped mid-transfer; a bystander is served meanwhile."""
    child = Child.spawn(f"frozen-{backend}", "tests.reliability.stuck", [target, backend, "frozen", "0"], env=ENV,
                        log_dir=LOG_DIR)
    try:
        ready = child.recv(90)
        child.kill(signal.SIGSTOP)
        out.faults += 1
        served(out, target, backend, 41, module="tests.reliability.stuck", env=ENV)
        stuck = _describe(target)
        # Alive but paused past its deadline: the deadline's reason, never written off as gone.
        _finals(out, target, ready["peer"], bytes.fromhex(ready["credential"]), STUCK_ROOMS, "frozen decode",
                {"DEADLINE_EXCEEDED"})
        out.notes.append(f"while frozen: engine calls stuck {stuck.engine_calls_stuck}, "
                         f"{stuck.open_requests} requests open")
    finally:
        child.kill(signal.SIGCONT)
        child.close()


def _describe(target: str) -> Any:
    with HandshakeClient(target, timeout=10, session=False) as client:
        return client.describe()


class _Silent:
    """A socket that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        """host:port."""
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        """Stop accepting and drop what was accepted."""
        self.sock.close()
        for conn in self.held:
            conn.close()


def _black_holed(out: Outcome, target: str, backend: str, reg: Any, what: str) -> None:
    """Register ``reg`` (its endpoint accepts and never answers) while a bystander is served.

    Mooncake must refuse it at Register (DEADLINE_EXCEEDED); where Register succeeds (NIXL),
    its requests must each fail with a reason.
    """
    result: dict[str, Any] = {}

    def register() -> None:
        try:
            with HandshakeClient(target, timeout=30) as client:
                result["peer"] = client.register(reg).peer_id
                result["credential"] = client.credential(result["peer"])
        except PdprotoError as exc:
            result["error"] = exc

    t = threading.Thread(target=register, daemon=True)
    t.start()
    out.faults += 1
    served(out, target, backend, 42, module="tests.reliability.stuck", env=ENV)
    t.join(ENGINE_TIMEOUT * 4)
    error = result.get("error")
    if "peer" not in result:
        out.runs += 1
        if error is not None and error.reason.name == "DEADLINE_EXCEEDED":
            out.failed_expected += 1
            out.notes.append(f"{what}: Register {error.reason.name}")
        else:
            out.lost += 1
            out.problems.append(f"{what}: Register ended {error!r}")
        return
    with HandshakeClient(target, timeout=30) as client:
        client.adopt(result["peer"], result["credential"])
        pages = list(range(-(-SPEC.prompt_tokens // SPEC.page_size)))
        for room in STUCK_ROOMS[:3]:
            client.submit_transfer(result["peer"], transfer_pb2.TransferInfo(room=room, dst_kv_pages=pages))
    served(out, target, backend, 43, module="tests.reliability.stuck", env=ENV)
    _finals(out, target, result["peer"], result["credential"], STUCK_ROOMS[:3], what)


def _stopped_decode(backend: str) -> DecodeProcess:
    """A decode process that is SIGSTOPped before anyone connects to it; its registration is known."""
    config = DecodeConfig(backend=backend, layers=SPEC.layers, pages=128, page_size=SPEC.page_size,
                          row_bytes=SPEC.row_bytes, model_id=SPEC.model_id, kv_dtype=SPEC.kv_cache_dtype,
                          layer_ids=False)
    child = DecodeProcess.launch(config, label=f"black-hole-{backend}", env=ENV, log_dir=LOG_DIR)
    child.kill(signal.SIGSTOP)
    return child


def stuck_peer(backend: str) -> Outcome:
    """The stuck-peer row of one engine (see the module doc)."""
    out = Outcome("stuck peer (frozen, black-holed)", backend)
    with running_server(*_serve_args(backend), env=ENV) as srv:
        served(out, srv.target, backend, 40, module="tests.reliability.stuck", env=ENV)
        _frozen(out, srv.target, backend)
        stopped = _stopped_decode(backend)
        try:
            _black_holed(out, srv.target, backend, stopped.registration, "decode stopped before Register")
        finally:
            stopped.kill(signal.SIGCONT)
            stopped.close()
        if backend == "mooncake":
            silent = _Silent()
            try:
                template = DecodeRank.for_spec(SPEC, pages=128, backend=backend)
                reg = template.registration()
                template.close()
                reg.mooncake.session_id = silent.address
                _black_holed(out, srv.target, backend, reg, "a socket that never answers")
            finally:
                silent.close()
        idle = wait_until(lambda: _describe(srv.target).engine_calls == 0, 60, interval=0.5)
        out.expect(bool(idle), f"engine calls still in flight: {_describe(srv.target).engine_calls}")
        served(out, srv.target, backend, 44, module="tests.reliability.stuck", env=ENV)
        out.expect(srv.proc.poll() is None, f"the server died: {srv.proc.returncode}")
    return out


def _frozen_decode(target: str, backend: str) -> dict[str, Any]:
    """Register, move one request (the engines have met), open ``STUCK_ROOMS``; report ids."""
    rank = DecodeRank.for_spec(SPEC, pages=128 * len(STUCK_ROOMS), backend=backend)
    client = HandshakeClient(target, timeout=30)
    peer = client.register(rank.registration()).peer_id
    client.submit_transfer(peer, rank.transfer_info(4999, rank.pages_for(SPEC.prompt_tokens)))
    if client.wait_for(peer, [4999], timeout=60)[4999].state != SUCCESS:
        raise SystemExit("the warm-up request failed")
    for i, room in enumerate(STUCK_ROOMS):
        client.submit_transfer(peer, rank.transfer_info(room, rank.pages_for(SPEC.prompt_tokens, i * 128)))
    return {"peer": peer, "credential": client.credential(peer).hex()}


def main(argv: list[str]) -> int:
    """A decode of this row: one JSON line; ``frozen`` then sleeps until stopped and killed."""
    from pdproto_demo.proc import redirect_stdout_to_stderr

    out = redirect_stdout_to_stderr()
    target, backend, mode, room = argv
    report = _frozen_decode(target, backend) if mode == "frozen" else _decode(target, backend, mode, int(room), SPEC)
    out.write(json.dumps(report) + "\n")
    out.flush()
    if mode == "frozen":
        time.sleep(600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
