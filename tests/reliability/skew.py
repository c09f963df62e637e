"""Version skew: newer/older minor versions against the real server, and both frame dialects on one socket."""

from __future__ import annotations

import glob
import os
import random
import threading

from pdproto import legacy, wire
from pdproto.bridge import ENVELOPE, LEGACY, Routed, ZmqBridge
from pdproto.errors import PdprotoError
from pdproto.negotiation.topology import example_registration
from pdproto.v1 import transfer_pb2
from pdproto_demo.cluster import Cluster, Topology
from pdproto_demo.proc import ChildError

from .harness import FAULT_GEOMETRY, LOG_DIR, Outcome, prefill_stats
from tests.golden.generate import unpack_container

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden")


def _golden(backend: str) -> list[tuple[str, list[bytes]]]:
    """SGLang 0.5.23 frame lists of one backend, exactly as its builders send them."""
    out = []
    for path in sorted(glob.glob(os.path.join(GOLDEN, backend, "*.bin"))):
        with open(path, "rb") as fh:
            out.append((os.path.basename(path), unpack_container(fh.read())))
    return out


def mixed_bridge(backend: str, rounds: int = 200) -> Outcome:
    """Two senders on one PULL socket: SGLang positional frames and Envelope frames, plus garbage."""
    import zmq

    out = Outcome("legacy + envelope on one ZMQ socket", backend)
    which = legacy.LegacyBackend.MOONCAKE if backend == "mooncake" else legacy.LegacyBackend.NIXL
    bridge = ZmqBridge(legacy_backend=which)
    golden = _golden(backend)
    envelopes = [
        example_registration(page_size=64, dcp_size=4, dcp_rank=r, num_layers=8, layer_ids=True)
        for r in range(4)
    ] + [transfer_pb2.TransferInfo(room=7 + i, dst_kv_pages=list(range(i, i + 9)), decode_prefix_len=256)
         for i in range(4)]
    garbage = [[b"\xb7\x50\x00\x01"], [b"\xb7\x50" + os.urandom(30)], [b"NOT_A_TAG", b"x"], [b""]]
    expected: list[tuple[str, object]] = []
    ctx = zmq.Context()
    legacy_sock, env_sock = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    for s in (legacy_sock, env_sock):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(bridge.endpoint)
    try:
        rng = random.Random(5)
        sends: list[tuple[str, list[bytes], object]] = []
        for _ in range(rounds):
            name, frames = rng.choice(golden)
            sends.append(("legacy", frames, legacy.parse_any(frames, which)[1].message))
            msg = rng.choice(envelopes)
            sends.append(("envelope", [wire.encode(msg)], msg))
            sends.append(("garbage", rng.choice(garbage), None))
        # Both senders write at once, so the dialects interleave on the socket.
        lock = threading.Lock()

        def push(sock: zmq.Socket[bytes], kind: str) -> None:
            for k, frames, _ in sends:
                if (k == "envelope") == (kind == "envelope"):
                    with lock:
                        sock.send_multipart(frames)

        threads = [threading.Thread(target=push, args=(legacy_sock, "legacy")),
                   threading.Thread(target=push, args=(env_sock, "envelope"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        expected = [(k, m) for k, _, m in sends]
        out.faults = sum(1 for k, _ in expected if k == "garbage")
        got: list[Routed | PdprotoError] = []
        while len(got) < len(expected):
            item = bridge.receive(10.0)
            if item is None:
                break
            got.append(item)
        out.runs = len(expected)
        pending = {ENVELOPE: [m for k, m in expected if k == "envelope"],
                   LEGACY: [m for k, m in expected if k == "legacy"]}
        for item in got:
            if isinstance(item, PdprotoError):
                out.failed_expected += 1
                continue
            want = pending[item.dialect].pop(0) if pending[item.dialect] else None
            if want is None or item.message != want:
                out.corrupted += 1
                out.problems.append(f"{item.dialect} {item.kind} routed wrong")
            else:
                out.ok += 1
                out.bytes_verified += item.message.ByteSize()
        out.lost = len(expected) - len(got)
        out.expect(out.failed_expected == out.faults, f"{out.failed_expected} rejected, {out.faults} garbage sent")
        out.notes.append(f"bridge counts: envelope {bridge.stats.envelope}, legacy {bridge.stats.legacy}, "
                         f"rejected {bridge.stats.rejected}")
    finally:
        legacy_sock.close(0)
        env_sock.close(0)
        ctx.term()
        bridge.close()
    return out


def minor_skew(backend: str) -> Outcome:
    """Older-minor decode vs newer-minor server, and a newer-minor decode with unknown fields."""
    out = Outcome("minor version skew + unknown fields", backend)
    c = Cluster(backend, FAULT_GEOMETRY, dst_dcp=2, src_groups=(1,), log_dir=LOG_DIR,
                prefill_args=["--info-minor", "1"])
    try:
        c.launch()
        topo = Topology(1, 2)
        # Rank 0 speaks minor 0 (older than the server's 1); rank 1 speaks minor 2 and adds
        # a field this schema does not know, as a newer build would.
        c.connect(topo, ranks=[0], minor=0)
        c.connect(topo, ranks=[1], minor=2, unknown_field=True)
        out.faults = 2
        for tokens in (2048, 8192):
            out.count(c.run_request(tokens, 256))
        st = prefill_stats(c)
        out.expect(st["peers"] == 2, f"server holds {st['peers']} peers")
        out.notes.append(f"agreed versions: {st.get('versions')}")
    except ChildError as exc:
        out.problems.append(f"skewed peer rejected: {exc}")
    finally:
        c.close()
    return out

