"""The ``process`` marker is enforced: an unmarked test that starts a process fails.

``make test-fast`` runs ``-m "not process"``; this keeps that set free of processes and
servers as tests are added. Runs pytest on a scratch suite that uses tests/conftest.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SUITE = '''
import subprocess, sys
import grpc.aio
import pytest

def test_unmarked_spawn():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_grpc_server():
    grpc.aio.server()

def test_unmarked_pure():
    assert sum(range(4)) == 6

@pytest.mark.process
def test_marked_spawn():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_unmarked_tests_that_spawn_or_serve_fail(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                          "-o", "markers=process: starts processes", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    out = run.stdout + run.stderr
    assert "2 failed, 2 passed" in out, out
    assert "test_unmarked_spawn started a process (subprocess.Popen) but is not marked" in out
    assert "test_unmarked_grpc_server started a gRPC server but is not marked" in out
