"""The ``pdproto`` dispatcher imports only the module of the command that runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdproto_server.cli import SUBCOMMANDS

pytestmark = pytest.mark.process

PROBE = """
import contextlib, io, json, sys
from pdproto_server import cli
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    cli.main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.startswith("pdproto_server.cmd_") or m == "grpc")
print(json.dumps({"loaded": loaded, "out": out.getvalue()}))
"""


def run_cli(*argv: str) -> dict[str, object]:
    """Run the CLI in a fresh interpreter; what it printed and which command modules it loaded."""
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    result: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return result


def test_top_level_help_lists_every_command_and_imports_none() -> None:
    result = run_cli("--help")
    assert result["loaded"] == []
    assert all(name in str(result["out"]) for name in SUBCOMMANDS)


@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_command_imports_its_module_only(command: str) -> None:
    result = run_cli(command, "--help")
    assert result["loaded"] == [SUBCOMMANDS[command][0]]  # neither grpc nor serve/demo
    assert "usage: pdproto " + command in str(result["out"])


def test_serve_help_imports_serve_only() -> None:
    result = run_cli("serve", "--help")
    assert [m for m in result["loaded"] if m != "grpc"] == ["pdproto_server.cmd_serve"]  # type: ignore[union-attr]
