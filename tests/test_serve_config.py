"""``pdproto serve`` refuses configuration that would silently weaken security (real processes).

Half a TLS configuration (the token would travel in clear), an empty token file (no
authentication), a missing, unreadable or directory token file: exit status 2 and one
line on stderr, no traceback. A token file others can read starts the server with one
warning line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ._server_harness import REPO

pytestmark = pytest.mark.process

SERVE = [sys.executable, "-m", "pdproto_server.cli", "serve", "--listen", "127.0.0.1:0", "--pages", "8"]


def _serve(*args: str, wait_ready: bool = False) -> tuple[int | None, str]:
    """Run ``pdproto serve``; (exit status or None if it started, stderr)."""
    proc = subprocess.Popen([*SERVE, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        if wait_ready:
            ready = json.loads(proc.stdout.readline())
            assert ready["event"] == "listening", ready
            proc.terminate()
            proc.wait(timeout=30)
            return None, proc.stderr.read()
        rc = proc.wait(timeout=60)
        return rc, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _refused(stderr: str, *phrases: str) -> None:
    """Exactly one line, naming the problem, and no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("pdproto serve: CONFIG_INVALID:"), lines[0]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def _pem(tmp: Path) -> Path:
    path = tmp / "half.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\nnot checked: refused before it is read\n-----END CERTIFICATE-----\n")
    return path


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key"])
def test_half_a_tls_configuration_is_refused(tmp_path: Path, flag: str) -> None:
    rc, err = _serve(flag, str(_pem(tmp_path)))
    assert rc == 2
    _refused(err, flag, "plaintext")


def _empty(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text("  \n")
    path.chmod(0o600)
    return path


def _missing(tmp: Path) -> Path:
    return tmp / "no-such-token"


def _directory(tmp: Path) -> Path:
    path = tmp / "token.d"
    path.mkdir()
    return path


def _symlink_loop(tmp: Path) -> Path:
    path = tmp / "token"
    path.symlink_to(path)
    return path


def _no_permission(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text("s3cret")
    path.chmod(0)
    return path


TOKEN_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "empty": (_empty, "is empty"),
    "missing": (_missing, "no such file"),
    "directory": (_directory, "is a directory"),
    "unreadable (symlink loop)": (_symlink_loop, "cannot read it"),
    "unreadable (mode 000)": (_no_permission, "permission denied"),
}


@pytest.mark.parametrize("case", list(TOKEN_FILES))
def test_a_token_file_that_cannot_serve_is_refused(tmp_path: Path, case: str) -> None:
    if case == "unreadable (mode 000)" and os.geteuid() == 0:
        pytest.skip("running as root, which reads a mode-000 file anyway; the symlink-loop case covers "
                    "an unreadable token file here")
    make, phrase = TOKEN_FILES[case]
    rc, err = _serve("--token-file", str(make(tmp_path)))
    assert rc == 2
    _refused(err, "--token-file", phrase)


def test_an_operator_token_must_be_its_own(tmp_path: Path) -> None:
    token, operator = tmp_path / "token", tmp_path / "operator"
    for path in (token, operator):
        path.write_text("s3cret-token\n")
        path.chmod(0o600)
    rc, err = _serve("--token-file", str(token), "--operator-token-file", str(operator))
    assert rc == 2
    _refused(err, "--operator-token-file", "its own")
    rc, err = _serve("--operator-token-file", str(_empty(tmp_path)))
    assert rc == 2
    _refused(err, "--operator-token-file", "is empty")


def test_a_token_file_others_can_read_starts_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    path.chmod(0o644)
    rc, err = _serve("--token-file", str(path), wait_ready=True)
    assert rc is None
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "chmod 600" in warnings[0] and "everyone" in warnings[0], err
    path.chmod(0o600)
    rc, err = _serve("--token-file", str(path), wait_ready=True)
    assert rc is None and "warning" not in err, err


@pytest.mark.parametrize("value", ["-1", "4MiB", "1.5", ""])
def test_a_bad_inline_threshold_is_refused(value: str) -> None:
    rc, err = _serve("--inline-bytes", value)
    assert rc == 2
    _refused(err, "--inline-bytes", repr(value), "non-negative integer")
