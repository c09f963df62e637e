"""The ``pdproto plan`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdproto_server import cli


def pdproto(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``pdproto plan ARGS`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "pdproto_server.cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.process
def test_json_reports_descriptors_and_bytes_per_destination_rank():
    out = pdproto("--tokens", "8192", "--page-size", "64", "--dcp", "4", "--layers", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    pairs = report["pairs"]
    assert [p["dst_rank"] for p in pairs] == [0, 1, 2, 3]
    for p in pairs:
        # 2048 rows per rank, strided source: one descriptor per row unpacked; packed, one per
        # destination page (scattered pages: none adjacent).
        assert p["rows"] == 2048 and p["runs"] == 128
        assert p["descriptors_per_layer_unpacked"] == 2048 and p["descriptors_per_layer_packed"] == 32
        assert p["bytes"] == 2048 * 1152 * 2 and p["descriptors_packed"] == 64


@pytest.mark.process
def test_table_and_n_to_m_layout():
    out = pdproto("--tokens", "1000", "--src-dcp", "2", "--dcp", "4", "--page-size", "16",
                  "--pages", "contiguous", "--draft-layers", "1", "--show-runs", "1")
    assert out.returncode == 0, out.stderr
    assert "desc/layer packed" in out.stdout and "draft rows" in out.stdout
    assert "run src_start=" in out.stdout
    assert "total: 1000 rows" in out.stdout


@pytest.mark.process
def test_bad_input_exits_2_with_reason():
    out = pdproto("--tokens", "100", "--prefix", "10")
    assert out.returncode == 2 and "PLAN_PREFIX_NOT_ALIGNED" in out.stderr
    out = pdproto("--tokens", "100", "--prefix", "10", "--json")
    assert out.returncode == 2 and json.loads(out.stdout)["error"]["reason"] == "PLAN_PREFIX_NOT_ALIGNED"


@pytest.mark.parametrize("args,reason", [
    (["--tokens", "100", "--dst-rank", "4"], "PLAN_RANK_OUT_OF_RANGE"),
    (["--tokens", "100", "--page-size", "0"], "PLAN_BAD_SIZE"),
    (["--tokens", "-5"], "PLAN_BAD_OFFSET"),
])
def test_bad_input_reasons_in_process(args, reason, capsys):
    # Same dispatcher as the subprocess runs, without paying interpreter start-up per case.
    assert cli.main(["plan", *args, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["reason"] == reason
