"""Pure parts of pdproto.transfer: run grouping, descriptors, bounds, gathers, notifications."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.errors import DestinationOutOfBoundsError, EngineUnavailableError, InvalidFieldError, Reason
from pdproto.transfer import LayerSpan, TransferJob
from pdproto.transfer.base import (
    check_bounds,
    contiguous_runs,
    decode_notification,
    encode_notification,
    validate_job,
)
from pdproto.transfer.packing import (
    Gatherer,
    pack_fits,
    packed_descriptors,
    row_descriptors,
    strided_runs,
)

pairs = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), max_size=200)


def _bytes_moved(descs: np.ndarray) -> dict[int, int]:
    """Map every destination byte address to its source byte address."""
    out: dict[int, int] = {}
    for s, d, n in descs.tolist():
        for i in range(n):
            out[d + i] = s + i
    return out


@given(pairs, st.integers(1, 9))
def test_row_descriptors_move_exactly_the_row_pairs(rows: list[tuple[int, int]], rb: int) -> None:
    src = np.array([r[0] for r in rows], dtype=np.int64)
    dst = np.array([r[1] for r in rows], dtype=np.int64)
    descs = row_descriptors(1000, 100_000, rb, src, dst)
    want = {100_000 + d * rb + i: 1000 + s * rb + i for s, d in zip(src.tolist(), dst.tolist())
            for i in range(rb)}
    assert _bytes_moved(descs) == want
    assert len(descs) == contiguous_runs(src, dst)[0].size <= len(rows)


@given(st.lists(st.integers(0, 500), unique=True, max_size=200), st.integers(1, 9))
def test_packed_descriptors_break_only_where_destination_does(dst_list: list[int], rb: int) -> None:
    dst = np.array(dst_list, dtype=np.int64)
    descs = packed_descriptors(0, 1 << 20, rb, dst)
    want = {(1 << 20) + d * rb + i: k * rb + i for k, d in enumerate(dst_list) for i in range(rb)}
    assert _bytes_moved(descs) == want
    assert len(descs) == 1 + int(np.count_nonzero(np.diff(dst) != 1)) if dst.size else len(descs) == 0


def test_strided_dcp_rows_pack_to_one_descriptor_per_page_run() -> None:
    src = np.arange(1, 4 * 1024, 4, dtype=np.int64)  # DCP 4, rank 1: every 4th row
    dst = np.arange(1024, dtype=np.int64)
    assert len(row_descriptors(0, 0, 8, src, dst)) == 1024
    assert len(packed_descriptors(0, 0, 8, dst)) == 1


@pytest.mark.parametrize("use_torch", [True, False])
def test_gather_matches_fancy_indexing(use_torch: bool) -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (300, 24), dtype=np.uint8)
    rows = rng.integers(0, 300, 97).astype(np.int64)
    out = np.zeros((97, 24), dtype=np.uint8)
    g = Gatherer()
    g.gather(src[:1], np.zeros(1, dtype=np.int64), np.zeros((1, 24), dtype=np.uint8))
    if not use_torch:
        g._torch = None  # the numpy path, taken where torch is not installed
    g.gather(src, rows, out)
    assert np.array_equal(out, src[rows])


def test_pack_fits_checks_every_layer() -> None:
    assert pack_fits(10, (8, 16), 160)
    assert not pack_fits(10, (8, 17), 160)


def test_bounds_name_the_side_that_overflows() -> None:
    job = TransferJob(layers=(LayerSpan(1000, 5000, 10),), src_rows=np.array([0, 9]),
                      dst_rows=np.array([0, 10]))
    src, dst = validate_job(job)
    check_bounds(job, src, dst, local=[(1000, 100)], remote=[(5000, 110)])
    with pytest.raises(DestinationOutOfBoundsError) as info:
        check_bounds(job, src, dst, local=[(1000, 100)], remote=[(5000, 109)])
    assert info.value.reason == Reason.DESTINATION_OUT_OF_BOUNDS
    with pytest.raises(InvalidFieldError) as info:
        check_bounds(job, src, dst, local=[(1000, 99)], remote=[(5000, 110)])
    assert info.value.reason == Reason.INVALID_FIELD and info.value.field == "job.layers.src_ptr"
    # A length of 0 means "unknown" and leaves that buffer unbounded.
    check_bounds(job, src, dst, local=[(1000, 100)], remote=[(5000, 0)])


def test_malformed_jobs_are_invalid_field() -> None:
    for src, dst in (([1, 2], [1]), ([-1], [0])):
        with pytest.raises(InvalidFieldError) as info:
            validate_job(TransferJob(layers=(), src_rows=np.array(src), dst_rows=np.array(dst)))
        assert info.value.reason == Reason.INVALID_FIELD


@given(st.integers(0, 2**64 - 1), st.binary(max_size=40))
def test_notification_round_trip(room: int, payload: bytes) -> None:
    n = decode_notification("agent", encode_notification(room, payload))
    assert n is not None and (n.room, n.payload, n.peer) == (room, payload, "agent")


@pytest.mark.process
@pytest.mark.parametrize(("backend", "package"), [("mooncake", "mooncake"), ("nixl", "nixl_cu12")])
def test_missing_engine_names_the_package(backend: str, package: str) -> None:
    # A child interpreter where the engine cannot be imported, as on a machine without it.
    code = (f"import sys; sys.modules[{package!r}] = None; sys.modules['nixl'] = None\n"
            "from pdproto.errors import EngineUnavailableError\n"
            "from pdproto.transfer import create_executor\n"
            f"try:\n    create_executor({backend!r})\n"
            "except EngineUnavailableError as e:\n    print(e.reason.name, e.message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("ENGINE_UNAVAILABLE"), out.stderr
    assert "pip install" in out.stdout
    assert issubclass(EngineUnavailableError, ImportError)


@given(st.lists(st.integers(0, 400), max_size=120))
def test_strided_gather_equals_fancy_indexing(rows_list: list[int]) -> None:
    rows = np.array(rows_list, dtype=np.int64)
    src = np.arange(401 * 3, dtype=np.uint8).reshape(401, 3)
    out = np.zeros((rows.size, 3), dtype=np.uint8)
    Gatherer().gather(src, rows, out, strided_runs(rows))
    assert np.array_equal(out, src[rows])


def test_dcp_rows_gather_as_one_strided_copy_per_page() -> None:
    pages = np.random.default_rng(0).permutation(64)
    rows = (pages[:, None] * 64 + 1 + 4 * np.arange(16)[None, :]).ravel().astype(np.int64)
    runs = strided_runs(rows)
    assert runs is not None and len(runs[0]) == 64
    assert set(runs[1].tolist()) == {16} and set(runs[3].tolist()) == {4}


@pytest.mark.process
def test_stale_local_arenas_are_swept_but_named_ones_kept() -> None:
    from pdproto.transfer.local import SHM_DIR, sweep_stale_arenas

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    stale = os.path.join(SHM_DIR, f"pdproto-{dead.pid}-0123456789ab")
    named = os.path.join(SHM_DIR, f"pdproto-{dead.pid}-custom-name")
    for path in (stale, named):
        with open(path, "wb"):
            pass
    try:
        assert sweep_stale_arenas() >= 1
        assert not os.path.exists(stale) and os.path.exists(named)
    finally:
        for path in (stale, named):
            if os.path.exists(path):
                os.unlink(path)


def test_staging_extents_are_disjoint_and_a_held_extent_does_not_block_others() -> None:
    from pdproto.transfer.packing import StagingExtents

    ext = StagingExtents(1000)
    a = ext.acquire(100, 10_000, timeout=0)
    assert a == (0, 500)  # a job never takes more than half while another may come
    b = ext.acquire(100, 10_000, timeout=0)
    assert b == (500, 500)
    assert ext.acquire(1, 1, timeout=0.01) is None  # full: the caller falls back instead of hanging
    ext.release(*a)
    c = ext.acquire(300, 300, timeout=0)
    assert c is not None and c[0] + c[1] <= 500 and c[1] == 300
    ext.release(*b)
    ext.release(*c)
    assert ext.acquire(1000, 1000, timeout=0) == (0, 1000)  # freed ranges merge back
    assert ext.acquire(1001, 1001, timeout=0) is None
