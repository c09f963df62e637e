"""`pdproto demo`, reduced: real prefill/decode processes, every decode byte checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

DEMO = [sys.executable, "-m", "pdproto_server.cli", "demo", "--backend", "local",
        "--prompts", "65,257", "--layers", "8"]


def _run(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DEMO, *extra], capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_demo_passes_and_checks_every_byte() -> None:
    """Every topology passes; every row of the table is ok and bytes were verified."""
    proc = _run("--repeat", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("local ")]
    assert len(rows) == 6  # 3 topologies x 2 prompts, one row for a prompt's two requests
    assert all(line.endswith("ok") for line in rows)
    assert {"dense-dcp4", "dcp2-dcp4", "kimi-tp4-dcp4"} == {line.split()[1] for line in rows}
    # Bytes and descriptors per kind: KV only for MLA, KV + aux + state for the Kimi-shaped case.
    for line in rows:
        kv, aux, state, d_kv, d_aux, d_state = (int(x.replace(",", "")) for x in line.split()[5:11])
        assert kv > 0 and d_kv > 0
        kimi = line.split()[1] == "kimi-tp4-dcp4"
        assert (aux > 0 and state > 0 and d_aux > 0 and d_state > 0) == kimi
        median, slowest = (float(x) for x in line.split()[11:13])
        assert 0 < median <= slowest


def test_a_row_is_the_median_request_and_fails_with_any_of_its_requests() -> None:
    """A row's time is its requests' median, the slowest beside it; one failed request fails the row."""
    from pdproto_demo.cluster import RequestResult
    from pdproto_demo.run import _median_row

    runs = [RequestResult(room=r, tokens=65, prefix=0, chunks=2, ok=True, seconds=s, bytes=599_040)
            for r, s in ((1, 0.30), (2, 0.10), (3, 0.20))]
    row, slowest = _median_row(runs)
    assert (row.room, row.seconds, slowest, row.ok, row.bytes) == (3, 0.20, 0.30, True, 599_040)
    runs[1].ok, runs[1].failures = False, ["d-0: TRANSFER_FAILED: gone"]
    row, _ = _median_row(runs)
    assert not row.ok and row.failures == ["d-0: TRANSFER_FAILED: gone"]
    assert _median_row(runs[:2])[0].seconds == 0.10  # of two, the faster: a row never shows the slowest twice


@pytest.mark.timeout(300)
def test_demo_fails_on_one_corrupted_byte() -> None:
    """One flipped source byte makes the demo report the mismatch and exit non-zero."""
    proc = _run("--corrupt-one-byte", "--topologies", "dense-dcp4")  # the first of a row's three requests
    assert proc.returncode != 0
    assert "FAIL" in proc.stdout
    assert "MISMATCH" in proc.stderr


def test_decode_config_round_trips_through_its_command_line() -> None:
    """What a parent asks for is what the decode process runs with, flags and booleans included."""
    from pdproto_demo.decode import DecodeConfig

    config = DecodeConfig(backend="nixl", layers=3, pages=17, page_size=1, row_bytes=576, dcp_size=4,
                          dcp_rank=3, name="d-3", notify_port=4242, kv_dtype="fp8_e4m3", model_id="m",
                          layer_ids=False, background=0)
    assert DecodeConfig.parse(config.argv()) == config
    assert DecodeConfig.parse([]) == DecodeConfig()
    from pdproto_demo.prefill import PrefillConfig

    prefill = PrefillConfig(model="dsa", cp_size=2, cp_rank=1, layer_split=True, token="t", limits='{"a": 1}')
    assert PrefillConfig.parse(prefill.argv()) == prefill and prefill.shape().pp_size == 2


def test_the_decode_checks_every_dsa_index_page_including_those_no_request_names() -> None:
    """A DCP 2 decode's index holds every token's page (two per KV page): the check wants a request's
    pages to hold the model's bytes and every other page the background."""
    from pdproto_demo.decode import DecodeConfig, DecodeRank

    rank = DecodeRank(DecodeConfig(model="dsa", layers=2, pages=4, page_size=16, dcp_size=2))
    try:
        index = rank.model.index_pages([3, 1], 40, 2)  # 40 tokens: 3 index pages, from KV pages 3 and 1
        assert index == [6, 7, 2]
        (first, second) = (b for e in rank.state for b in e)
        for k, buf in enumerate((first, second)):
            for item, block in rank.model.state_writes(5, k, 1, 0, index):
                buf.array[item * block.size:(item + 1) * block.size] = block
        checked, problem = rank.verify_extras({5: (1, index)})
        assert problem is None and checked == 2 * 8 * 16 * 132
        second.array[0] ^= 0xFF  # index page 0, which the request does not name
        assert rank.verify_extras({5: (1, index)})[1] == "state buffer 1: byte 0 is 90, expected 165"
        second.array[0] ^= 0xFF
        first.array[6 * 16 * 132] ^= 1  # the request's first page
        assert "state buffer 0: byte 12672" in str(rank.verify_extras({5: (1, index)})[1])
    finally:
        rank.close()
