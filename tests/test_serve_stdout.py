"""`pdproto serve` keeps stdout for its JSON lines: no engine log line comes first.

Scripts and tests read the bound port from the first stdout line. NIXL's Python wrapper
logs INFO lines to stdout and UCX logs there by default; both now go to stderr.
"""

from __future__ import annotations

import pytest

from ._server_harness import SERVE_ARGS, running_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.mark.parametrize("backend", ["nixl", "mooncake", "local"])
def test_the_first_stdout_line_of_serve_is_the_listening_json(backend: str) -> None:
    # running_server parses the first stdout line as JSON and fails on anything else.
    with running_server(*SERVE_ARGS, "--backend", backend) as srv:
        assert srv.port > 0
        assert "NIXL" in srv.stderr() or backend != "nixl"  # the engine did log, just not on stdout
