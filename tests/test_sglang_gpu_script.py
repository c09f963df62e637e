"""scripts/sglang_gpu_check.py on a CPU machine: the servers it would start (it needs a GPU to run them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sglang_gpu_check.py"


def _commands(*args: str) -> dict[str, list[str]]:
    run = subprocess.run([sys.executable, str(SCRIPT), "--model-path", "/models/m", "--dry-run", *args],
                         capture_output=True, text=True, check=True, timeout=60)
    out: dict[str, list[str]] = json.loads(run.stdout)
    return out


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_gpu_check_starts_a_reference_and_a_pdproto_pair_of_one_model() -> None:
    cmds = _commands()
    assert set(cmds) == {"reference", "prefill", "decode"}
    for cmd in cmds.values():
        assert cmd[1:3] == ["-m", "sglang.launch_server"] and _flag(cmd, "--model-path") == "/models/m"
    assert "--disaggregation-mode" not in cmds["reference"]
    for role in ("prefill", "decode"):
        assert _flag(cmds[role], "--disaggregation-mode") == role
        assert _flag(cmds[role], "--disaggregation-transfer-backend") == "pdproto"
    # Both sides meet at one bootstrap port; every server has a port of its own.
    assert _flag(cmds["prefill"], "--disaggregation-bootstrap-port") == _flag(
        cmds["decode"], "--disaggregation-bootstrap-port")
    assert len({_flag(c, "--port") for c in cmds.values()}) == 3


def test_a_dcp_decode_on_its_own_gpus() -> None:
    decode = _commands("--decode-gpu", "1", "--decode-tp", "2")["decode"]
    assert (_flag(decode, "--base-gpu-id"), _flag(decode, "--tp-size"), _flag(decode, "--dcp-size")) == ("1", "2", "2")
