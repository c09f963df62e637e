"""The ``pdproto`` command line: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module defines
#   add_arguments(parser: argparse.ArgumentParser) -> None
#   run(args: argparse.Namespace) -> int
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdproto_server.cmd_serve", "run the prefill-side handshake service"),
    "demo": ("pdproto_demo.run", "end-to-end transfer demo with real engines and processes"),
    "plan": ("pdproto_server.cmd_plan", "show a DCP relayout plan: runs, descriptors, bytes per rank"),
    "check": ("pdproto_server.cmd_check", "topology verdict and deployment findings for a P/D pair"),
    "status": ("pdproto_server.cmd_status", "what a running prefill is doing: peers, open requests, limits"),
    "evict": ("pdproto_server.cmd_evict", "drop one decode peer from a running prefill (the operator token)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``command``'s module is imported, to add its flags.

    Every subcommand is listed (for ``pdproto --help``), but importing a command's
    module can be costly (``serve`` loads gRPC, ``demo`` the engines), so only the one
    that will run is imported.
    """
    parser = argparse.ArgumentParser(prog="pdproto", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the pdproto CLI and return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # The top level takes no options but --help, so the first other word names the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    rc: int = args._run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
