"""``pdproto evict``: drop one decode peer from a running prefill, as the operator.

For a peer that holds an identity it should not (docs/security.md, "Squat a decode's
identity") or that misbehaves otherwise: its open requests end FAILED with ``PEER_GONE``,
and its decode may register again. It needs the operator token (``pdproto serve
--operator-token-file``); ``pdproto status`` lists the peer ids. Exit status: 0, or 1 when
the server cannot be reached or refuses the call (one line on stderr says why).
"""

from __future__ import annotations

import argparse
import sys

from pdproto.errors import PdprotoError

from .cmd_status import connect, connection_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the evict subcommand's options."""
    connection_arguments(parser, "file holding the operator token (pdproto serve --operator-token-file)")
    parser.add_argument("--peer", required=True, metavar="PEER_ID", help="the peer to drop (pdproto status lists them)")


def run(args: argparse.Namespace) -> int:
    """Evict the peer; print how many of its open requests were failed."""
    with connect(args) as client:
        try:
            failed = client.evict(args.peer)
        except PdprotoError as exc:
            print(f"pdproto evict: {args.target}: {exc}", file=sys.stderr)
            return 1
    print(f"evicted {args.peer}: {failed} open request(s) failed with PEER_GONE", flush=True)
    return 0
