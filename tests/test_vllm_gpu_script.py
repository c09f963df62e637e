"""scripts/vllm_gpu_check.py on a CPU machine: the servers it would start (it needs GPUs to run them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_sglang_gpu_script import _flag

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_gpu_check.py"


def _commands(*args: str) -> dict[str, list[str]]:
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "/models/m", "--dry-run", *args],
                         capture_output=True, text=True, check=True, timeout=60)
    out: dict[str, list[str]] = json.loads(run.stdout)
    return out


def test_the_gpu_check_starts_a_reference_and_a_pdproto_pair_of_one_model() -> None:
    cmds = _commands()
    assert set(cmds) == {"reference", "prefill", "decode"}
    assert {_flag(c, "serve") for c in cmds.values()} == {"/models/m"}
    assert "--kv-transfer-config" not in cmds["reference"]
    roles = {}
    for side in ("prefill", "decode"):
        config = json.loads(_flag(cmds[side], "--kv-transfer-config"))
        assert (config["kv_connector"], config["kv_connector_module_path"]) == ("PdprotoConnector",
                                                                                 "pdproto.integrations.vllm")
        roles[side] = config["kv_role"]
        if side == "prefill":
            assert config["kv_connector_extra_config"]["port"] > 0  # the decodes are told this port
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    assert "--decode-context-parallel-size" not in cmds["decode"]


def test_a_dcp_decode_runs_tp_equal_dcp() -> None:
    decode = _commands("--decode-tp", "4")["decode"]
    assert _flag(decode, "--tensor-parallel-size") == _flag(decode, "--decode-context-parallel-size") == "4"
