"""Limits and security against the real server: RESOURCE_EXHAUSTED, tokens (proven, never sent), TLS."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import grpc

from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError, Reason
from pdproto.negotiation.topology import example_registration
from pdproto.v1 import common_pb2, handshake_service_pb2 as hs, handshake_service_pb2_grpc as hs_grpc
from pdproto_demo.cluster import Cluster, Topology, free_port
from pdproto_demo.proc import Child, ChildError

from .harness import FAULT_GEOMETRY, LOG_DIR, Outcome

TOPO = Topology(1, 2)


def _expect_error(out: Outcome, what: str, reasons: set[Reason], fn: object) -> None:
    """Run ``fn``; it must raise a PdprotoError with one of ``reasons``."""
    out.runs += 1
    out.faults += 1
    try:
        fn()  # type: ignore[operator]
    except (PdprotoError, ChildError) as exc:
        reason = getattr(exc, "reason", None)
        text = str(exc)
        if reason in reasons or any(r.name in text for r in reasons):
            out.failed_expected += 1
            out.notes.append(f"{what}: {reason.name if reason else text[:80]}")
            return
        out.problems.append(f"{what}: wrong error {text[:160]}")
        return
    out.problems.append(f"{what}: accepted")


def _extra_registration(port: int, backend: int = common_pb2.BACKEND_LOCAL) -> object:
    return example_registration(page_size=64, dcp_size=2, dcp_rank=0, num_layers=8, layer_ids=True,
                                backend=backend, port=port, memory_kind=common_pb2.MEMORY_KIND_DRAM)


def resource_limits(backend: str) -> Outcome:
    """max peers, in-flight requests per peer, message size: each answered RESOURCE_EXHAUSTED."""
    out = Outcome("limits -> RESOURCE_EXHAUSTED", backend)
    limits = {"max_peers": 2, "max_inflight_per_peer": 2}
    c = Cluster(backend, FAULT_GEOMETRY, dst_dcp=2, src_groups=(1,), log_dir=LOG_DIR,
                prefill={"limits": json.dumps(limits)})
    try:
        c.launch()
        c.connect(TOPO)
        target = f"127.0.0.1:{c.ports[1][0]}"
        with HandshakeClient(target) as client:
            _expect_error(out, "third peer", {Reason.TOO_MANY_PEERS},
                          lambda: client.register(_extra_registration(free_port())))  # type: ignore[arg-type]
        flights = [c.begin(2048, 0, decodes=[0]) for _ in range(2)]
        _expect_error(out, "third in-flight request", {Reason.TOO_MANY_REQUESTS},
                      lambda: c.begin(2048, 0, decodes=[0]))
        for f in flights:
            c.send_chunks(f)
            out.count(c.finish(f))
        # A registration larger than the 4 MiB limit, sent by a client that allows bigger sends.
        big = _extra_registration(free_port(), common_pb2.BACKEND_NIXL)
        big.nixl.agent_metadata = os.urandom(6 << 20)  # type: ignore[attr-defined]
        chan = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
        stub = hs_grpc.HandshakeServiceStub(chan)
        out.runs += 1
        out.faults += 1
        try:
            stub.Register(hs.RegisterRequest(registration=big), timeout=10)  # type: ignore[arg-type]
            out.problems.append("6 MiB registration accepted")
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                out.failed_expected += 1
                out.notes.append("6 MiB message: RESOURCE_EXHAUSTED")
            else:
                out.problems.append(f"6 MiB message: {exc.code()}")
        finally:
            chan.close()
        out.count(c.run_request(4096, 256))  # still healthy
    finally:
        c.close()
    return out


def auth(backend: str) -> Outcome:
    """A token-protected server refuses a call without a proof of its token; a client with another token
    refuses the server, which cannot prove it; off loopback a token is required."""
    out = Outcome("auth: token proof, off-loopback", backend)
    c = Cluster(backend, FAULT_GEOMETRY, dst_dcp=2, src_groups=(1,), log_dir=LOG_DIR, token="s3cret-token")
    try:
        c.launch()
        c.connect(TOPO)
        target = f"127.0.0.1:{c.ports[1][0]}"
        for what, token, reason in (("no token", None, Reason.UNAUTHENTICATED),
                                    ("wrong token", "guess", Reason.RANK_UNPROVEN)):
            def call(token: str | None = token) -> None:
                with HandshakeClient(target, token=token) as client:
                    client.get_server_info()
            _expect_error(out, what, {reason}, call)
        out.count(c.run_request(4096, 256))
        # Without a token, a non-loopback listen address must refuse to start.
        out.runs += 1
        out.faults += 1
        p = Child.spawn("prefill-open", "pdproto_demo.prefill",
                        ["--backend", backend, "--pages", "8", "--host", "0.0.0.0"], log_dir=LOG_DIR)
        try:
            p.recv(60)
            out.problems.append("served 0.0.0.0 without a token")
        except ChildError as exc:
            out.failed_expected += 1
            out.notes.append(f"0.0.0.0 without token: refused ({str(exc)[:60]})")
        finally:
            p.close()
    finally:
        c.close()
    return out


def _make_cert(directory: str) -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1, made with the openssl CLI."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def tls(backend: str) -> Outcome:
    """TLS with a certificate made in the test: trusted clients work, plaintext clients cannot."""
    out = Outcome("TLS (cert generated in test)", backend)
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _make_cert(tmp)
        c = Cluster(backend, FAULT_GEOMETRY, dst_dcp=2, src_groups=(1,), log_dir=LOG_DIR, token="tls-token",
                    prefill={"tls_cert": cert, "tls_key": key})
        try:
            c.launch()
            c.connect(TOPO, root_cert=cert)
            out.count(c.run_request(4096, 256))
            target = f"127.0.0.1:{c.ports[1][0]}"

            def plaintext() -> None:
                with HandshakeClient(target, token="tls-token", timeout=3.0) as client:
                    client.get_server_info()
            _expect_error(out, "plaintext client", {Reason.UNAVAILABLE, Reason.DEADLINE_EXCEEDED}, plaintext)
        finally:
            c.close()
    return out
