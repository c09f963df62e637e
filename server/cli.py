"""The ``pdproto`` command line (placeholder until subcommands land)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the pdproto CLI."""
    del argv
    print("pdproto: no subcommands yet", file=sys.stderr)
    return 2
