"""``pdproto status``: what a running prefill is doing, from its ``Describe`` RPC.

Prints the peers (with their negotiated mode, backend and streams), each peer's open
requests (state, bytes, age) and the limits in use, as tables; ``--json`` prints the
``DescribeResponse`` as protobuf JSON instead; ``--watch N`` refreshes every N seconds.
Exit status: 0, or 1 when the server cannot be reached or refuses the call (one line on
stderr says why).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from google.protobuf import json_format

from pdproto import v1
from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError
from pdproto.v1 import handshake_service_pb2 as hs


def connection_arguments(parser: argparse.ArgumentParser, token_help: str) -> None:
    """The options that reach a running prefill (``connect``): address, token file, TLS, timeout."""
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the prefill's gRPC address")
    parser.add_argument("--token-file", type=Path, help=token_help)
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="CA certificate to verify the server (enables TLS)")
    parser.add_argument("--server-name", help="TLS name to expect from the server (when it differs from HOST)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")


def connect(args: argparse.Namespace) -> HandshakeClient:
    """A unary-only client for ``connection_arguments``' options."""
    token = args.token_file.read_text().strip() if args.token_file else None
    return HandshakeClient(args.target, token=token, root_cert=args.tls_ca, server_name=args.server_name,
                           timeout=args.timeout, session=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the status subcommand's options."""
    connection_arguments(parser, "file holding a token (proven, never sent): the operator token (serve "
                                 "--operator-token-file) shows every peer's room ids and engine identity, the "
                                 "deployment's token does not")
    parser.add_argument("--peer", default="", metavar="PEER_ID", help="only this peer")
    parser.add_argument("--requests", type=int, default=16, metavar="N",
                        help="open requests listed per peer, oldest first (default 16)")
    parser.add_argument("--json", action="store_true", help="print the DescribeResponse as JSON")
    parser.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                        help="refresh every SECONDS until interrupted")


HIDDEN = "(hidden)"
"""What the table shows for a room id or engine identity the server left out (``PeerView.redacted``)."""


def _name(enum: object, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)  # type: ignore[attr-defined]


def render(d: hs.DescribeResponse) -> str:
    """The tables a person reads: server line, peers, open requests, limits."""
    lines = [f"prefill rank {d.prefill_rank}  backend {_name(v1.Backend, d.backend, 'BACKEND_')}  "
             f"protocol {d.version.major}.{d.version.minor}  up {d.uptime_ms / 1000:.0f} s  "
             f"{'DRAINING  ' if d.draining else ''}open requests {d.open_requests}"
             f"{f'  judging {d.registrations_judged} registrations' if d.registrations_judged else ''}",
             "",
             f"{'peer':<20} {'state':<5} {'mode':<13} {'backend':<8} {'protocol':<15} {'engine':<28} {'age s':>7} "
             f"{'open':>5} {'kept':>5} {'sess':>5} {'watch':>5} {'unacked':>7} {'throttled':>9} {'refused':>7}"]
    for p in d.peers:
        mode = _name(v1.NegotiationMode, p.result.mode, "NEGOTIATION_MODE_")
        sessions = f"{p.sessions_connected}+{p.sessions_detached}" if p.sessions_detached else str(p.sessions_connected)
        engine = HIDDEN if p.redacted else p.engine_identity[:28]
        lines.append(f"{p.peer_id:<20} {_name(v1.PeerState, p.state, 'PEER_STATE_'):<5} {mode:<13} "
                     f"{_name(v1.Backend, p.result.backend, 'BACKEND_'):<8} {p.protocol or 'pdproto':<15} {engine:<28} "
                     f"{p.age_ms / 1000:>7.1f} {p.open_requests:>5} {p.finished_kept:>5} {sessions:>5} "
                     f"{p.watch_streams:>5} {p.events_unacknowledged:>7} "
                     f"{p.calls_refused:>9} {p.snapshots_refused:>7}")
    if not d.peers:
        lines.append("(no peers)")
    requests = [(p, r) for p in d.peers for r in p.requests]
    if requests:
        lines += ["", f"{'peer':<20} {'room':>12} {'gen':>4} {'state':<17} {'bytes':>12} {'chunks':>6} {'age s':>7}"]
        for p, r in requests:
            state = _name(v1.TransferState, r.state, "TRANSFER_STATE_") + (" (dummy)" if r.is_dummy else "")
            room = HIDDEN if p.redacted else str(r.room)
            lines.append(f"{p.peer_id:<20} {room:>12} {r.generation:>4} {state:<17} {r.bytes_transferred:>12} "
                         f"{r.chunks_done:>6} {r.age_ms / 1000:>7.1f}")
    if any(p.redacted for p in d.peers):
        lines += ["", f"{HIDDEN}: hidden from this token; the operator token (pdproto serve --operator-token-file) "
                      "shows room ids and engine identities"]
    lines += ["", f"{'limit':<24} {'used':>8} {'of':>8}"]
    lines += [f"{lim.name:<24} {lim.used:>8} {lim.limit:>8}" for lim in d.limits]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Describe the server once, or every ``--watch`` seconds."""
    with connect(args) as client:
        while True:
            try:
                d = client.describe(peer_id=args.peer, request_limit=args.requests)
            except PdprotoError as exc:
                print(f"pdproto status: {args.target}: {exc}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(json_format.MessageToDict(d, preserving_proto_field_name=True)), flush=True)
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")
                print(render(d), flush=True)
            if not args.watch:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0
