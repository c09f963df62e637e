"""Pure parts of pdproto.transfer: descriptors and gathers from runs, bounds from run extents, notifications."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.dcp import plan_relayout
from pdproto.dcp.runs import (expand, extents, from_rows, num_rows, packed_fan_in, progression_runs, segments,
                               source_rows)
from pdproto.errors import DestinationOutOfBoundsError, EngineUnavailableError, InvalidFieldError, Reason
from pdproto.transfer import LayerSpan, Segment, TransferJob
from pdproto.transfer.base import check_bounds, decode_notification, encode_notification, remote_regions, validate_job
from pdproto.transfer.packing import (TORCH_IMPORT_BYTES, Gatherer, copy_runs, packed_layers,
                                      packing_saves, row_descriptors, row_layers, torch_or_none,
                                      unpack_fan_in)
from pdproto.v1 import registration_pb2

# Runs as the planner may emit them (strides >= 1, counts >= 1), in any order.
run_rows = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 5), st.integers(0, 60), st.integers(1, 5),
                              st.integers(1, 6)), max_size=12)


@st.composite
def spans(draw: st.DrawFn) -> LayerSpan:
    """A layer whose moved bytes are the whole row or a drawn sub-range, with either pitch."""
    src_pitch, dst_pitch = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    width = draw(st.integers(1, min(src_pitch, dst_pitch)))
    return LayerSpan(1000, 100_000, src_pitch, dst_row_bytes=dst_pitch,
                     src_offset=draw(st.integers(0, src_pitch - width)),
                     dst_offset=draw(st.integers(0, dst_pitch - width)), width=width)


def _runs(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _bytes_moved(descs: np.ndarray) -> dict[int, int]:
    """Map every destination byte address to its source byte address."""
    out: dict[int, int] = {}
    for s, d, n in descs.tolist():
        for i in range(n):
            out[d + i] = s + i
    return out


def _per_row_bytes(layer: LayerSpan, src_base: int, src_pitch: int, src_rows: list[int],
                   dst_rows: list[int]) -> dict[int, int]:
    """The byte map the per-row formula gives: row pair (s, d) moves ``width`` bytes at the offsets."""
    return {layer.dst_ptr + d * layer.dst_pitch + layer.dst_offset + i: src_base + s * src_pitch + i
            for s, d in zip(src_rows, dst_rows) for i in range(layer.nbytes)}


@given(run_rows, spans())
def test_row_descriptors_move_exactly_the_row_pairs(rows: list[tuple[int, int, int, int, int]],
                                                     layer: LayerSpan) -> None:
    runs = _runs(rows)
    src, dst = expand(runs)
    descs = row_descriptors(layer, runs)
    want = _per_row_bytes(layer, layer.src_ptr + layer.src_offset, layer.row_bytes, src.tolist(), dst.tolist())
    # Later row pairs overwrite earlier ones on a shared destination row, as the engine would.
    assert _bytes_moved(descs) == want
    assert len(descs) <= src.size


@given(run_rows, st.lists(st.one_of(spans(), st.integers(1, 9).map(lambda pitch: LayerSpan(1000, 100_000, pitch))),
                          min_size=2, max_size=4))
def test_layers_sharing_a_cut_get_what_each_would_alone(rows: list[tuple[int, int, int, int, int]],
                                                         layers: list[LayerSpan]) -> None:
    """A segment's layers share the runs' cut (``row_layers``): whole rows and byte ranges alike."""
    runs = _runs(rows)
    together = row_layers(layers, runs)
    assert len(together) == len(layers)
    for layer, descs in zip(layers, together, strict=True):
        assert descs.tolist() == row_descriptors(layer, runs).tolist()


@given(run_rows.filter(lambda rows: len(rows) == 1), spans())
def test_one_run_takes_the_same_descriptors_and_extents_as_many(rows: list[tuple[int, int, int, int, int]],
                                                               layer: LayerSpan) -> None:
    """A single run (a state item, an aux row) skips numpy; it must give what the general path gives."""
    runs = _runs(rows)
    doubled = np.concatenate([runs, runs])  # two runs: the general path, for the same rows twice
    general = row_descriptors(layer, doubled)
    assert row_descriptors(layer, runs).tolist() == general[:len(general) // 2].tolist()
    src, dst = expand(runs)
    assert extents(runs) == (int(src.min()), int(src.max()), int(dst.min()), int(dst.max()))


def packed_descriptors(staging_addr: int, layer: LayerSpan, runs: np.ndarray) -> np.ndarray:
    """One layer's descriptors after packing at ``staging_addr``."""
    return packed_layers([staging_addr], [layer], runs)[0]

@given(run_rows, spans())
def test_packed_descriptors_read_staging_in_run_order(rows: list[tuple[int, int, int, int, int]],
                                                      layer: LayerSpan) -> None:
    runs = _runs(rows)
    _, dst = expand(runs)
    descs = packed_descriptors(0, layer, runs)
    assert _bytes_moved(descs) == _per_row_bytes(layer, 0, layer.nbytes, list(range(dst.size)), dst.tolist())


@given(run_rows, st.lists(spans(), min_size=1, max_size=4))
def test_packed_layers_cut_each_layer_as_packed_descriptors_would(rows: list[tuple[int, int, int, int, int]],
                                                                  layers: list[LayerSpan]) -> None:
    # Layers of mixed shapes, each packed at its own staging address into its own buffer:
    # cutting once per shape must still give every layer exactly its own bytes.
    runs = _runs(rows)
    _, dst = expand(runs)
    layers = [dataclasses.replace(layer, dst_ptr=(k + 1) << 20) for k, layer in enumerate(layers)]
    staging = [(k + 1) << 30 for k in range(len(layers))]
    out = packed_layers(staging, layers, runs)
    assert len(out) == len(layers)
    for base, layer, descs in zip(staging, layers, out):
        assert _bytes_moved(descs) == _per_row_bytes(layer, base, layer.nbytes, list(range(dst.size)), dst.tolist())


def test_strided_dcp_rows_pack_to_one_descriptor_per_page_run() -> None:
    runs = np.array([[1, 4, 0, 1, 1024]], dtype=np.int64)  # DCP 4, rank 1: every 4th row
    assert len(row_descriptors(LayerSpan(0, 0, 8), runs)) == 1024
    assert len(packed_descriptors(0, LayerSpan(0, 0, 8), runs)) == 1
    # A byte sub-range of each row cannot span rows on the destination: one per row.
    assert len(packed_descriptors(0, LayerSpan(0, 0, 8, width=4), runs)) == 1024


def test_jobs_are_packed_only_where_packing_at_least_halves_the_descriptors() -> None:
    pages = np.random.default_rng(3).permutation(64)[:16]
    page_to_page = np.array([[64 * s, 1, 64 * d, 1, 64] for s, d in zip(pages, pages[::-1])], dtype=np.int64)
    whole, src_cut, dst_cut = LayerSpan(0, 0, 8), LayerSpan(0, 0, 8, dst_row_bytes=4, width=4), \
        LayerSpan(0, 0, 4, dst_row_bytes=8, width=4)
    assert not packing_saves([Segment(page_to_page, (whole,))])  # one descriptor per page either way
    assert not packing_saves([Segment(page_to_page, (dst_cut,))])  # one per row either way (MHA fan-in)
    assert packing_saves([Segment(page_to_page, (src_cut,))])  # per row unpacked, per page packed
    dcp = np.array([[1, 4, 0, 1, 1024]], dtype=np.int64)  # DCP 4, rank 1: every 4th row
    assert packing_saves([Segment(page_to_page, (whole,)), Segment(dcp, (whole,))])  # any segment decides
    assert not packing_saves([Segment(np.zeros((0, 5), dtype=np.int64), (whole,))])


@pytest.mark.parametrize("tensor", [False, True], ids=["numpy", "torch"])
@given(page=st.integers(1, 5), factor=st.integers(2, 4), width=st.integers(1, 3), seed=st.integers(0, 99))
def test_packed_fan_in_blocks_land_in_row_order_once_unpacked(tensor: bool, page: int, factor: int, width: int,
                                                              seed: int) -> None:
    """Every sender writes its slice of the request's rows through its packed runs and descriptors (the last page
    row by row); ``unpack_fan_in`` then leaves every row as whole-row writes would, and other pages untouched."""
    rng = np.random.default_rng(seed)
    pages, row = rng.permutation(8)[:4], factor * width
    tokens = int(rng.integers(len(pages) - 1, len(pages)) * page + rng.integers(1, page + 1))
    dst_rows = (pages[np.arange(tokens) // page] * page + np.arange(tokens) % page).astype(np.int64)
    runs = progression_runs(tokens, 0, 1, np.arange(len(pages), dtype=np.int64), page, 0, 1, pages.astype(np.int64), page)
    want = rng.integers(1, 255, (8 * page, row), dtype=np.uint8)
    got = np.zeros_like(want)
    expected = got.copy()
    expected[dst_rows] = want[dst_rows]
    for slot in range(factor):
        source = np.ascontiguousarray(want[dst_rows][:, slot * width:(slot + 1) * width])  # this sender's heads
        packed, tail = packed_fan_in(runs, page, factor, slot, int(pages[-1]))
        assert num_rows(packed) + num_rows(tail) == tokens
        for rows, layer in ((packed, LayerSpan(0, 0, width, dst_row_bytes=width)),
                            (tail, LayerSpan(0, 0, width, dst_row_bytes=row, dst_offset=slot * width, width=width))):
            for s, d, n in row_descriptors(layer, rows).tolist() if rows.shape[0] else ():
                got.reshape(-1)[d:d + n] = source.reshape(-1)[s:s + n]
    if tensor:
        import torch
        held = torch.from_numpy(got)
        unpack_fan_in(held, pages[:-1].tolist(), page, [(k * width, width) for k in range(factor)])
        got = held.numpy()
    else:
        unpack_fan_in(got, pages[:-1].tolist(), page, [(k * width, width) for k in range(factor)])
    assert np.array_equal(got, expected)


def test_unmerged_segments_are_one_per_row() -> None:
    runs = np.array([[0, 1, 10, 1, 5], [5, 1, 15, 1, 3]], dtype=np.int64)
    assert segments(runs).tolist() == [[0, 10, 8]]
    assert segments(runs, merge=False).tolist() == [[i, 10 + i, 1] for i in range(8)]


@pytest.mark.parametrize("use_torch", [True, False])
@given(rows=run_rows, data=st.data())
def test_gather_from_runs_equals_fancy_indexing(use_torch: bool, rows: list[tuple[int, int, int, int, int]],
                                                data: st.DataObject) -> None:
    runs = _runs(rows)
    src_rows, _ = expand(runs)
    pitch = data.draw(st.integers(1, 12))
    width = data.draw(st.integers(1, pitch))
    offset = data.draw(st.integers(0, pitch - width))
    rows_needed = int(src_rows.max()) + 1 if src_rows.size else 0
    table = np.random.default_rng(0).integers(0, 256, (rows_needed + 1, pitch), dtype=np.uint8)
    flat = table.reshape(-1)[offset:]
    view = flat[:max(0, rows_needed - 1) * pitch + width] if rows_needed else flat[:0]
    out = np.zeros((src_rows.size, width), dtype=np.uint8)
    g = Gatherer()
    # Either path on any size: torch as after a large gather, numpy as where torch is not installed.
    g._loaded, g._torch = True, torch_or_none() if use_torch else None
    g.gather(view, pitch, runs, out, source_rows(runs))
    assert np.array_equal(out, table[src_rows, offset:offset + width])


def test_copy_runs_writes_strided_destinations() -> None:
    src = np.arange(40, dtype=np.uint8)
    dst = np.zeros(40, dtype=np.uint8)
    # Rows of 4 bytes: source rows 0, 2, 4 -> destination rows 1, 4, 7 (DCP -> dense shape).
    copy_runs(src, 4, dst, 4, np.array([[0, 2, 1, 3, 3]], dtype=np.int64), 4)
    want = np.zeros(40, dtype=np.uint8)
    for s, d in ((0, 1), (2, 4), (4, 7)):
        want[d * 4:d * 4 + 4] = src[s * 4:s * 4 + 4]
    assert np.array_equal(dst, want)


def test_from_rows_round_trips_any_row_pairs() -> None:
    src = np.array([5, 6, 7, 20, 3, 4], dtype=np.int64)
    dst = np.array([0, 1, 2, 3, 9, 10], dtype=np.int64)
    runs = from_rows(src, dst)
    assert runs.shape == (3, 5)
    assert [a.tolist() for a in expand(runs)] == [src.tolist(), dst.tolist()]
    assert source_rows(runs).tolist() == src.tolist()


def _job(runs: list[list[int]], layer: LayerSpan) -> TransferJob:
    return TransferJob.of_runs([layer], np.array(runs, dtype=np.int64))


def test_bounds_come_from_run_extents_and_name_the_side() -> None:
    layer = LayerSpan(1000, 5000, 10)
    job = _job([[0, 9, 0, 10, 2]], layer)  # rows 0, 9 -> 0, 10
    check_bounds(job, local=[(1000, 100)], remote={5000: 110})
    with pytest.raises(DestinationOutOfBoundsError) as info:
        check_bounds(job, local=[(1000, 100)], remote={5000: 109})
    assert info.value.reason == Reason.DESTINATION_OUT_OF_BOUNDS
    with pytest.raises(InvalidFieldError) as info:
        check_bounds(job, local=[(1000, 99)], remote={5000: 110})
    assert info.value.reason == Reason.INVALID_FIELD and info.value.field == "job.segments.layers.src_ptr"
    # A length of 0 means "unknown" and leaves that buffer unbounded.
    check_bounds(job, local=[(1000, 100)], remote={5000: 0})
    # A sub-range is bounded by its own bytes: the last row's 4 bytes at offset 6 end at byte 110.
    check_bounds(_job([[0, 9, 0, 10, 2]], LayerSpan(1000, 5000, 10, src_offset=6, dst_offset=6, width=4)),
                 local=[(1000, 100)], remote={5000: 110})


@pytest.mark.parametrize("runs", [[[0, 1, -1, 1, 2]], [[0, 0, 0, 1, 2]], [[0, 1, 0, 1, 0]], [[0, 1, 0, 1]]])
def test_malformed_runs_are_invalid_field(runs: list[list[int]]) -> None:
    with pytest.raises(InvalidFieldError) as info:
        validate_job(TransferJob(segments=(Segment(np.array(runs, dtype=np.int64), (LayerSpan(0, 0, 8),)),)))
    assert info.value.reason == Reason.INVALID_FIELD


@pytest.mark.parametrize("span", [LayerSpan(0, 0, 0), LayerSpan(0, 0, 8, src_offset=4, width=5),
                                  LayerSpan(0, 0, 8, dst_row_bytes=4, width=5), LayerSpan(0, 0, 8, width=-1),
                                  LayerSpan(0, 0, 8, src_offset=1)])
def test_byte_ranges_outside_a_row_are_invalid_field(span: LayerSpan) -> None:
    with pytest.raises(InvalidFieldError) as info:
        validate_job(_job([[0, 1, 0, 1, 1]], span))
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


def test_remote_regions_bound_every_registered_base_the_loosest_way() -> None:
    reg = registration_pb2.KvRegistration()
    reg.kv_buffers.add(ptr=100, length=50)
    reg.kv_buffers.add(ptr=100, length=80)  # the same base twice: the looser bound
    reg.kv_buffers.add(ptr=300, length=0)  # unknown length: unbounded
    reg.aux_ptrs.extend([400, 500])
    reg.aux_data_lens.extend([16])  # the second aux buffer's length is not given: unbounded
    reg.state_buffers.add(data_ptrs=[600, 700, 300], data_lens=[8, 9, 10])  # 300 again, after an unknown
    reg.state_buffers.add(data_ptrs=[800])
    assert remote_regions(reg) == {100: 80, 300: 0, 400: 16, 500: 0, 600: 8, 700: 9, 800: 0}


@pytest.mark.process
def test_only_a_large_gather_imports_torch() -> None:
    """A process whose gathers stay small never pays torch's import (seconds); a large one loads it, once."""
    code = f"""
import sys, numpy as np
from pdproto.dcp.runs import source_rows
from pdproto.transfer.packing import Gatherer
g = Gatherer()
seen = []
for rows in (64, {TORCH_IMPORT_BYTES // 1024}):  # 1 KiB rows: 64 KiB, then the threshold
    runs = np.array([[0, 2, 0, 1, rows]], dtype=np.int64)  # every other source row
    src = np.random.default_rng(rows).integers(0, 256, 2 * rows * 1024, dtype=np.uint8)
    out = np.empty((rows, 1024), dtype=np.uint8)
    g.gather(src, 1024, runs, out, source_rows(runs))
    seen.append(("torch" in sys.modules, bool(np.array_equal(out, src.reshape(-1, 1024)[::2]))))
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[(False, True), (True, True)]", out.stderr
