"""``pdproto check`` through the real console entry point, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from pdproto.negotiation.topology import example_registration, example_server_info

pytestmark = pytest.mark.process


def check(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pdproto_server.cli check ARGV``."""
    return subprocess.run([sys.executable, "-m", "pdproto_server.cli", "check", *argv],
                          capture_output=True, text=True, timeout=120, check=False)


def test_accepted_pair_prints_mode_and_pairings() -> None:
    r = check("--decode-dcp", "4", "--decode-dcp-rank", "3", "--draft", "1", "--layers", "2")
    assert r.returncode == 0, r.stderr
    assert "ACCEPTED" in r.stdout and "mode=DENSE_TO_DCP" in r.stdout
    assert "decode DCP size 4 rank 3" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]
    assert rows == [["0", "0", "target", "1152", "1152"], ["1", "1", "target", "1152", "1152"],
                    ["2", "2", "draft", "1152", "1152"]]
    assert "deployment: 0 finding(s)" in r.stdout


def test_json_files_rejected_pair_json_output(tmp_path: Path) -> None:
    info = example_server_info(dtype="fp8_e4m3", num_layers=3)
    reg = example_registration(dcp_size=2, num_layers=3)
    (tmp_path / "p.json").write_text(json_format.MessageToJson(info))
    (tmp_path / "d.json").write_text(json_format.MessageToJson(reg))
    r = check("--prefill-json", str(tmp_path / "p.json"), "--decode-json", str(tmp_path / "d.json"),
              "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["ok"] is False
    rejection = out["topology"]["rejection"]
    assert rejection["reason"] == "TOPOLOGY_KV_DTYPE_MISMATCH"
    assert rejection["metadata"] == {"prefillKvCacheDtype": "fp8_e4m3", "decodeKvCacheDtype": "bfloat16"}
    assert "TOPOLOGY_KV_DTYPE_MISMATCH" in r.stderr
    assert out["findings"] == []  # a DCP decode defaults to the chunk cache


def test_error_finding_fails_an_accepted_topology() -> None:
    r = check("--decode-dcp", "2", "--decode-cache", "radix", "--json")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["topology"]["mode"] == "NEGOTIATION_MODE_DENSE_TO_DCP"
    assert [(f["role"], f["severity"], f["code"]) for f in out["findings"]] == [
        ("decode", "error", "DECODE_DCP_RADIX_CACHE")]
    assert "DECODE_DCP_RADIX_CACHE" in r.stderr


def test_malformed_input_exits_2() -> None:
    r = check("--prefill-page-size", "0")
    assert r.returncode == 2
    assert "page_size" in r.stderr and not r.stdout
