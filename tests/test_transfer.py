"""Real executors (local, Mooncake TCP, NIXL UCX) writing into decode peers in separate processes.

The prefill side runs in the test process, one executor per backend for the
whole session; each decode is ``python -m pdproto_demo.decode``. Jobs carry the
planner's runs; every destination byte is read back from the peer and checked
against the per-token formula (``tests/_per_token.py``), never against the runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdproto import backends
from pdproto.dcp import DcpLayout, plan_chunk, plan_relayout
from pdproto.errors import (
    DestinationOutOfBoundsError,
    NotFoundError,
    PdprotoError,
    Reason,
    TopologyError,
    error_class,
)
from pdproto.transfer import (
    DRAM,
    VRAM,
    Buffer,
    LayerSpan,
    Segment,
    TransferExecutor,
    TransferJob,
    TransferResult,
    create_executor,
    encode_notification,
)
from pdproto.transfer.engines import mooncake
from pdproto.transfer.engines._engine import EngineExecutor
from pdproto.transfer.engines._paths import INLINE_BYTES
from pdproto.v1 import registration_pb2
from pdproto_demo.decode import DecodeConfig, DecodeProcess

from ._per_token import reference

# PDPROTO_TEST_DEVICE=cuda runs both sides in VRAM (scripts/gpu_check.sh); local is host-only.
DEVICE = os.environ.get("PDPROTO_TEST_DEVICE", "cpu")
BACKENDS = ["mooncake", "nixl"] if DEVICE.startswith("cuda") else ["local", "mooncake", "nixl"]
LAYERS = 2
ROW = 576  # half an MLA row: odd enough that an off-by-one in byte offsets shows
PAGE = 16
DCP = 4
SRC_PAGES = 256
SRC_ROWS = SRC_PAGES * PAGE
DST_ROWS = SRC_ROWS // DCP

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

ENGINES = [b for b in BACKENDS if b != "local"]
MODES = ["inline", "pipelined", "per_row"]
"""How an engine executor may run a packed job (the local backend has one path: numpy copies)."""
EXTENT = DST_ROWS * ROW
"""The most staging one job of ``Pair`` takes: half its region, while another job may come."""


class Prefill:
    """A prefill-side executor with filled, registered source buffers."""

    def __init__(self, backend: str, staging_bytes: int) -> None:
        self.ex: TransferExecutor = create_executor(backend, staging_bytes=staging_bytes,
                                                    transfer_timeout_s=10, device=DEVICE)
        rng = np.random.default_rng(7)
        kind = VRAM if DEVICE.startswith("cuda") else DRAM
        self.src: list[Buffer] = [self.ex.allocate(SRC_ROWS * ROW, kind=kind) for _ in range(LAYERS)]
        self.host: list[np.ndarray] = []
        for b in self.src:
            data = rng.integers(0, 256, b.length, dtype=np.uint8)
            if kind == VRAM:
                import torch

                b.array.copy_(torch.from_numpy(data))
            else:
                b.array[:] = data
            self.host.append(data.reshape(SRC_ROWS, ROW))
        self.ex.register_memory(self.src)

    def spans(self, peer: DecodeProcess, **byte_range: int) -> list[LayerSpan]:
        """One span per layer, source layer i into the peer's layer i."""
        return [LayerSpan(s.addr, d.ptr, ROW, **byte_range)
                for s, d in zip(self.src, peer.registration.kv_buffers)]

    def job(self, peer: DecodeProcess, runs: np.ndarray, *, pack: bool = True,
            room: int | None = None) -> TransferJob:
        return TransferJob.of_runs(self.spans(peer), runs, pack=pack,
                                   notification=None if room is None else encode_notification(room, b""))


class Pair:
    """A prefill executor and a long-lived decode peer of one backend, shared by the tests."""

    def __init__(self, backend: str) -> None:
        self.pre = Prefill(backend, staging_bytes=2 * DST_ROWS * ROW)
        self.peer = _peer(backend)
        self.pre.ex.connect("d0", self.peer.registration)


_pairs: dict[str, Pair] = {}


@pytest.fixture(scope="session")
def pairs() -> Iterator[dict[str, Pair]]:
    """One executor and one decode per backend for the session (NIXL allows one agent per process)."""
    yield _pairs
    for pair in _pairs.values():
        pair.peer.close()
        pair.pre.ex.close()
    _pairs.clear()


@pytest.fixture(params=BACKENDS)
def pair(request: pytest.FixtureRequest, pairs: dict[str, Pair]) -> Iterator[Pair]:
    backend = str(request.param)
    if backend not in pairs:
        pairs[backend] = Pair(backend)
    yield pairs[backend]
    pairs[backend].peer.call("fill", value=0)
    _use(pairs[backend].pre.ex, "default")


def _use(ex: TransferExecutor, mode: str) -> bool:
    """Make an engine executor run packed jobs ``mode``'s way; the job's ``pack`` flag for it.

    "inline" lifts the threshold (a job still needs one staging extent that holds all of it),
    "pipelined" sets it to 0, "default" restores the executor's own.
    """
    if isinstance(ex, EngineExecutor):
        ex.inline_bytes = {"inline": 1 << 40, "default": INLINE_BYTES}.get(mode, 0)
    return mode != "per_row"


def _path(res: TransferResult) -> str:
    """Which path a job took, as ``MODES`` names it."""
    return "inline" if res.inline else "pipelined" if res.packed else "per_row"


def _peer(backend: str) -> DecodeProcess:
    return DecodeProcess.launch(DecodeConfig(backend=backend, layers=LAYERS, pages=DST_ROWS, page_size=1,
                                             row_bytes=ROW, device=DEVICE, background=0), timeout=60)


def _dcp(seed: int, rank: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dense -> DCP plan's target runs, and its (src_rows, dst_rows) by the per-token formula."""
    rng = np.random.default_rng(seed)
    src_pages, dst_pages = rng.permutation(SRC_PAGES), rng.permutation(DST_ROWS // PAGE)
    plan = plan_relayout(src_pages, dst_pages, page_size=PAGE, dcp_size=DCP, dcp_rank=rank)
    src_rows, dst_rows, _, _ = reference(src_pages.tolist(), dst_pages.tolist(), Ps=PAGE, Ns=1, s=0,
                                         Pd=PAGE, Nd=DCP, d=rank, off=0, N=SRC_ROWS)
    return plan.target_runs, src_rows, dst_rows


def _dump(peer: DecodeProcess, tmp: str) -> np.ndarray:
    """The peer's buffers, (layers, DST_ROWS, ROW)."""
    path = os.path.join(tmp, "dump.bin")
    peer.call("dump", path=path)
    return np.fromfile(path, dtype=np.uint8).reshape(LAYERS, DST_ROWS, ROW)


def _check_layers(pre: Prefill, got: np.ndarray, rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    """Layer i's rows ``rows[i][1]`` hold source rows ``rows[i][0]``; every other byte is zero."""
    for layer, host in enumerate(pre.host):
        src_rows, dst_rows = rows.get(layer, (np.zeros(0, dtype=np.int64),) * 2)
        untouched = np.ones(DST_ROWS, dtype=bool)
        untouched[dst_rows] = False
        assert np.array_equal(got[layer][dst_rows], host[src_rows]), f"layer {layer} differs"
        assert not got[layer][untouched].any(), f"layer {layer}: bytes outside the job"


def _check(pre: Prefill, peer: DecodeProcess, tmp: str, src_rows: np.ndarray,
           dst_rows: np.ndarray) -> None:
    """Every layer's written rows equal their source rows, and every other row is still zero."""
    _check_layers(pre, _dump(peer, tmp), {layer: (src_rows, dst_rows) for layer in range(LAYERS)})


@pytest.mark.parametrize("mode", MODES)
def test_dcp_relayout_lands_every_byte(pair: Pair, mode: str, tmp_path: object) -> None:
    pre, peer = pair.pre, pair.peer
    runs, src_rows, dst_rows = _dcp(seed=1)
    pack = _use(pre.ex, mode)
    res = pre.ex.execute("d0", pre.job(peer, runs, pack=pack))
    assert res.bytes == src_rows.size * ROW * LAYERS
    if pre.ex.backend != "local":
        # The whole relayout is more than one staging extent holds, so even with inline
        # allowed it runs the pipeline, its second layer reusing the first one's bytes.
        assert res.bytes > EXTENT
        assert _path(res) == ("pipelined" if mode == "inline" else mode) and not res.fallback
        # Packed: one descriptor per destination page run, far fewer than rows.
        assert (res.descriptors < src_rows.size // 4) is pack
    _check(pre, peer, str(tmp_path), src_rows, dst_rows)


def test_staging_too_small_falls_back_per_row_and_counts(pairs: dict[str, Pair],
                                                         tmp_path: object) -> None:
    # Mooncake only: a second NIXL agent in this process is what NIXL warns against.
    if "mooncake" not in pairs:
        pairs["mooncake"] = Pair("mooncake")
    peer = pairs["mooncake"].peer
    # A second executor with a one-page staging region: every packed job must fall back.
    pre = Prefill("mooncake", staging_bytes=4096)
    try:
        runs, src_rows, dst_rows = _dcp(seed=2, rank=3)
        pre.ex.connect("d0", peer.registration)
        res = pre.ex.execute("d0", pre.job(peer, runs, pack=True))
        assert res.fallback and not res.packed
        assert pre.ex.stats.pack_fallbacks == 1
        _check(pre, peer, str(tmp_path), src_rows, dst_rows)
    finally:
        pre.ex.close()
        peer.call("fill", value=0)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_row"])
def test_run_ending_one_row_past_the_region_is_refused(pair: Pair, pack: bool, tmp_path: object) -> None:
    pre, peer = pair.pre, pair.peer
    inside = np.array([[0, 1, 0, 1, 8]], dtype=np.int64)
    # Bounds come from run extents: a contiguous run, and a strided one whose first rows
    # are inside but whose last row is one past the registered region.
    for past in ([0, 1, DST_ROWS - 8, 1, 9], [0, 4, DST_ROWS - 12, 4, 4]):
        job = TransferJob(segments=(Segment(inside, tuple(pre.spans(peer))),
                                    Segment(np.array([past], dtype=np.int64), tuple(pre.spans(peer)[:1]))),
                          pack=pack)
        with pytest.raises(DestinationOutOfBoundsError) as info:
            pre.ex.execute("d0", job)
        assert info.value.reason == Reason.DESTINATION_OUT_OF_BOUNDS
        empty = np.zeros(0, dtype=np.int64)
        _check(pre, peer, str(tmp_path), empty, empty)  # nothing was written, not even the good segment
    # The same run one row shorter is accepted.
    res = pre.ex.execute("d0", pre.job(peer, np.array([[0, 4, DST_ROWS - 13, 4, 4]], dtype=np.int64), pack=pack))
    assert res.bytes == 4 * ROW * LAYERS


def test_zero_row_rank_still_gets_its_notifications_in_order(pair: Pair) -> None:
    pre, peer = pair.pre, pair.peer
    res = pre.ex.execute("d0", TransferJob(segments=(), notification=(encode_notification(42, b""),
                                                                      encode_notification(44, b""))))
    assert res.bytes == 0 and res.descriptors == 0
    if backends.by_name(pre.ex.backend).notifications:  # the registry's column, checked on the engine
        assert res.notified
        rooms: list[int] = []
        for _ in range(5):  # each call waits up to 10 s for the first notice it has not returned yet
            rooms += peer.call("notices", 40, wait=10)["rooms"]
            if len(rooms) >= 2:
                break
        assert rooms == [42, 44]
        assert pre.ex.notify("d0", 43, b"done")
        assert peer.call("notices", 40, wait=10)["rooms"] == [43]
    else:
        assert not res.notified and not pre.ex.notify("d0", 43, b"")


def test_peer_killed_mid_transfer_fails_with_reason_then_other_peer_served(
        pair: Pair, tmp_path: object) -> None:
    pre, other = pair.pre, pair.peer
    ex = pre.ex
    runs, src_rows, dst_rows = _dcp(seed=3, rank=0)
    victim = _peer(ex.backend)
    outcome: list[BaseException] = []
    first_done = threading.Event()

    def hammer() -> None:
        # Transfer to the victim until it fails; the kill lands while one is in flight.
        try:
            for i in range(100_000):
                ex.execute("victim", pre.job(victim, runs, pack=_use(ex, MODES[i % 3])))
                first_done.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)
        finally:
            first_done.set()

    try:
        ex.connect("victim", victim.registration)
        worker = threading.Thread(target=hammer, daemon=True)
        worker.start()
        assert first_done.wait(timeout=60)
        time.sleep(0.01)
        victim.kill()
        worker.join(timeout=45)
        assert not worker.is_alive(), "a transfer to a dead peer did not end"
        assert len(outcome) == 1 and isinstance(outcome[0], PdprotoError), outcome
        assert outcome[0].reason in (Reason.PEER_GONE, Reason.TRANSFER_FAILED,
                                     Reason.DEADLINE_EXCEEDED)
        assert type(outcome[0]) is error_class(outcome[0].reason)
        _holds_nothing(ex, "victim")
        ex.disconnect("victim")
        res = ex.execute("d0", pre.job(other, runs, pack=True))
        assert res.bytes == src_rows.size * ROW * LAYERS
        _check(pre, other, str(tmp_path), src_rows, dst_rows)
    finally:
        ex.disconnect("victim")
        victim.close()


def _holds_nothing(ex: TransferExecutor, peer_id: str) -> None:
    """Once no call for the peer is inside the engine, no engine batch and no staging byte is held."""
    assert ex.quiesce(peer_id, 30)
    if isinstance(ex, EngineExecutor):
        assert ex.held() == (0, 0)


def _chunk(seed: int, rows: int, rank: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``rows`` rows of a dense -> DCP relayout (one chunk), and its rows by the per-token formula."""
    rng = np.random.default_rng(seed)
    tokens = rows * DCP
    src_pages = rng.permutation(SRC_PAGES)[:-(-tokens // PAGE)]
    dst_pages = rng.permutation(DST_ROWS // PAGE)[:-(-tokens // (PAGE * DCP))]
    plan = plan_chunk(DcpLayout(PAGE), DcpLayout(PAGE, DCP, rank), src_pages, dst_pages, num_kv_tokens=tokens)
    src_rows, dst_rows, _, _ = reference(src_pages.tolist(), dst_pages.tolist(), Ps=PAGE, Ns=1, s=0,
                                         Pd=PAGE, Nd=DCP, d=rank, off=0, N=tokens)
    assert src_rows.size == rows
    return plan.target_runs, src_rows, dst_rows


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), rows=st.sampled_from([1, 7, 16, 64, DST_ROWS // 2]),
       rank=st.integers(0, DCP - 1))
def test_inline_pipelined_and_per_row_write_the_same_bytes(pair: Pair, tmp_path: object, seed: int, rows: int,
                                                          rank: int) -> None:
    # From one row to the largest job one staging extent holds (half the peer's buffers).
    pre, peer = pair.pre, pair.peer
    runs, src_rows, dst_rows = _chunk(seed, rows, rank)
    notifies = backends.by_name(pre.ex.backend).notifications
    dumps = []
    for room, mode in enumerate(MODES, start=100):
        peer.call("fill", value=0)
        res = pre.ex.execute("d0", pre.job(peer, runs, pack=_use(pre.ex, mode), room=room))
        assert res.bytes == rows * ROW * LAYERS <= EXTENT
        if pre.ex.backend != "local":
            assert _path(res) == mode and not res.fallback
        # Every path sends the job's notification once its bytes are written (NIXL).
        assert res.notified is notifies
        if notifies:
            assert peer.call("notices", 40, wait=10)["rooms"] == [room]
        dumps.append(_dump(peer, str(tmp_path)))
    assert all(np.array_equal(dumps[0], d) for d in dumps[1:])
    _check_layers(pre, dumps[0], {layer: (src_rows, dst_rows) for layer in range(LAYERS)})


@pytest.mark.parametrize("pair", ENGINES, indirect=True)
def test_a_job_right_at_the_inline_threshold_takes_each_path(pair: Pair, tmp_path: object) -> None:
    pre, peer = pair.pre, pair.peer
    ex = pre.ex
    assert isinstance(ex, EngineExecutor)
    runs, src_rows, dst_rows = _chunk(seed=8, rows=16)
    job = pre.job(peer, runs, pack=True)
    expected = {  # threshold -> (packed, inline) counted for the job, and the path it took
        job.nbytes: (1, 1, "inline"),
        job.nbytes - 1: (1, 0, "pipelined"),
    }
    for threshold, (packed, inline, path) in expected.items():
        ex.inline_bytes = threshold
        before = dataclasses.replace(ex.stats)
        res = ex.execute("d0", job)
        assert _path(res) == path
        assert (ex.stats.packed_jobs - before.packed_jobs, ex.stats.inline_jobs - before.inline_jobs) == (packed,
                                                                                                          inline)
        assert ex.stats.pack_fallbacks == before.pack_fallbacks and ex.stats.jobs == before.jobs + 1
        _check(pre, peer, str(tmp_path), src_rows, dst_rows)
        peer.call("fill", value=0)
    # Per-row is neither packed nor inline, and is no fallback: packing was not asked for.
    ex.inline_bytes = job.nbytes
    before = dataclasses.replace(ex.stats)
    res = ex.execute("d0", pre.job(peer, runs, pack=False))
    assert _path(res) == "per_row"
    assert (ex.stats.packed_jobs, ex.stats.inline_jobs, ex.stats.pack_fallbacks) == (
        before.packed_jobs, before.inline_jobs, before.pack_fallbacks)
    _check(pre, peer, str(tmp_path), src_rows, dst_rows)


@pytest.mark.parametrize("pair", ENGINES, indirect=True)
def test_an_inline_job_to_a_killed_peer_fails_typed_and_holds_nothing(pair: Pair, tmp_path: object) -> None:
    pre, other = pair.pre, pair.peer
    ex = pre.ex
    runs, src_rows, dst_rows = _chunk(seed=9, rows=16, rank=2)
    victim = _peer(ex.backend)
    try:
        ex.connect("victim", victim.registration)
        _use(ex, "inline")
        assert ex.execute("victim", pre.job(victim, runs)).inline  # the peer was reachable inline
        victim.kill_and_reap()  # gone, its memory unmapped
        before = dataclasses.replace(ex.stats)
        with pytest.raises(PdprotoError) as info:
            for _ in range(50):  # an engine may take a write or two before it notices the peer is gone
                ex.execute("victim", pre.job(victim, runs))
        assert info.value.reason in (Reason.PEER_GONE, Reason.TRANSFER_FAILED, Reason.DEADLINE_EXCEEDED)
        assert type(info.value) is error_class(info.value.reason)
        assert ex.stats.failures == before.failures + 1
        _holds_nothing(ex, "victim")
        # The staging extent came back: the next inline job (another peer) gets one at once.
        res = ex.execute("d0", pre.job(other, runs))
        assert res.inline
        _check(pre, other, str(tmp_path), src_rows, dst_rows)
    finally:
        ex.disconnect("victim")
        victim.close()


def test_unknown_peer_and_wrong_backend_are_typed_errors(pair: Pair) -> None:
    ex = pair.pre.ex
    with pytest.raises(NotFoundError) as info:
        ex.execute("nobody", TransferJob(segments=()))
    assert info.value.reason == Reason.PEER_NOT_FOUND
    reg = registration_pb2.KvRegistration()
    if ex.backend == "mooncake":
        reg.local.arena_name = "nothing-here"
    else:
        reg.mooncake.session_id = "127.0.0.1:1"
    with pytest.raises(TopologyError) as info:
        ex.connect("x", reg)
    assert info.value.reason == Reason.TOPOLOGY_BACKEND_UNSUPPORTED


def test_two_peers_served_from_parallel_threads(pair: Pair, tmp_path: object) -> None:
    # The server runs jobs for different peers on a thread pool: both must land intact.
    pre, first = pair.pre, pair.peer
    second = _peer(pre.ex.backend)
    plans = {"d0": _dcp(seed=4, rank=2), "d1": _dcp(seed=5, rank=1)}
    peers = {"d0": first, "d1": second}
    errors: list[BaseException] = []

    def run(peer_id: str) -> None:
        try:
            for pack in (True, False, True):
                pre.ex.execute(peer_id, pre.job(peers[peer_id], plans[peer_id][0], pack=pack))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    try:
        pre.ex.connect("d1", second.registration)
        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        for peer_id, peer in peers.items():
            _check(pre, peer, str(tmp_path), *plans[peer_id][1:])
    finally:
        pre.ex.disconnect("d1")
        second.close()


@st.composite
def chunks(draw: st.DrawFn) -> dict[str, object]:
    """A chunk between two drawn layouts (ranks that share tokens), sized to the test buffers."""
    Ps, Pd = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    Ns, Nd = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    d = draw(st.integers(0, Nd - 1))
    g = math.gcd(Ns, Nd)
    s = draw(st.sampled_from([r for r in range(Ns) if r % g == d % g]))
    Vs, Vd = Ps * Ns, Pd * Nd
    off = draw(st.integers(0, 2))
    room = DST_ROWS - Vd - off * Vs  # the draft writes global positions up to the chunk end
    n_src = draw(st.integers(0, max(0, min(32, room // Vs))))
    N = draw(st.integers(0, n_src * Vs))
    n_dst = -(-(off * Vs + N) // Vd)
    # Scattered pages, some adjacent, inside each side's buffer (draft pages are virtual pages).
    src_pages = draw(st.lists(st.integers(0, SRC_ROWS // Vs - 1), min_size=n_src, max_size=n_src, unique=True))
    dst_pages = draw(st.lists(st.integers(0, DST_ROWS // Vd - 1), min_size=n_dst, max_size=n_dst, unique=True))
    return dict(Ps=Ps, Ns=Ns, s=s, Pd=Pd, Nd=Nd, d=d, off=off, N=N, src_pages=src_pages, dst_pages=dst_pages)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=chunks())
def test_executing_runs_writes_what_the_per_token_formula_says(pair: Pair, mode: str, tmp_path: object,
                                                               chunk: dict[str, object]) -> None:
    # One job, two segments: target runs into layer 0 and draft runs into layer 1.
    pre, peer = pair.pre, pair.peer
    peer.call("fill", value=0)
    c: dict[str, object] = dict(chunk)
    src, dst = c.pop("src_pages"), c.pop("dst_pages")
    plan = plan_chunk(DcpLayout(c["Ps"], c["Ns"], c["s"]), DcpLayout(c["Pd"], c["Nd"], c["d"]), src, dst,
                      src_page_offset=c["off"], num_kv_tokens=c["N"], include_draft=True)
    t_src, t_dst, d_src, d_dst = reference(src, dst, **c)
    spans = pre.spans(peer)
    pack = _use(pre.ex, mode)
    job = TransferJob(segments=(Segment(plan.target_runs, (spans[0],)), Segment(plan.draft_runs, (spans[1],))),
                      pack=pack)
    res = pre.ex.execute("d0", job)
    assert res.bytes == (t_src.size + d_src.size) * ROW
    if pre.ex.backend != "local" and res.bytes:
        fits = res.bytes <= EXTENT
        assert _path(res) == ("pipelined" if mode == "inline" and not fits else mode) and not res.fallback
    _check_layers(pre, _dump(peer, str(tmp_path)), {0: (t_src, t_dst), 1: (d_src, d_dst)})


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_row"])
@pytest.mark.parametrize("split", ["src", "dst"])
def test_a_byte_range_of_each_row_moves_alone(pair: Pair, pack: bool, split: str, tmp_path: object) -> None:
    # KV head slicing: half of each 576-byte source row into 288-byte destination rows
    # ("src"), or 288-byte source rows into the second half of 576-byte rows ("dst").
    pre, peer = pair.pre, pair.peer
    half = ROW // 2
    runs, src_rows, dst_rows = _dcp(seed=6, rank=2)
    if split == "src":
        byte_range = dict(dst_row_bytes=half, src_offset=half, width=half)
        src_pitch, dst_pitch, src_off, dst_off = ROW, half, half, 0
    else:
        byte_range = dict(row_bytes=half, dst_row_bytes=ROW, dst_offset=half, width=half)
        src_pitch, dst_pitch, src_off, dst_off = half, ROW, 0, half
    spans = [LayerSpan(s.addr, d.ptr, **{"row_bytes": ROW, **byte_range})
             for s, d in zip(pre.src, peer.registration.kv_buffers)]
    res = pre.ex.execute("d0", TransferJob.of_runs(spans, runs, pack=pack))
    assert res.bytes == src_rows.size * half * LAYERS
    if pre.ex.backend != "local":
        assert res.packed is pack and not res.fallback
    got = _dump(peer, str(tmp_path)).reshape(LAYERS, -1)
    cols = np.arange(half)
    for layer, host in enumerate(pre.host):
        want = np.zeros(DST_ROWS * ROW, dtype=np.uint8)
        want[(dst_rows * dst_pitch + dst_off)[:, None] + cols] = \
            host.reshape(-1)[(src_rows * src_pitch + src_off)[:, None] + cols]
        assert np.array_equal(got[layer], want), f"layer {layer} differs"


class _RecordingEngine:
    """A Mooncake engine that records the batches it is given and the waits asked of it."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.batches: dict[int, list[tuple[int, int, int]]] = {}
        self.checked: list[int] = []
        self.waited: list[list[int]] = []

    def batch_transfer_async_write(self, session: str, src: list[int], dst: list[int], sizes: list[int]) -> int:
        bid = int(self.engine.batch_transfer_async_write(session, src, dst, sizes))  # type: ignore[attr-defined]
        self.batches[bid] = list(zip(src, dst, sizes, strict=True))
        return bid

    def transfer_check_status(self, bid: int) -> int:
        self.checked.append(bid)
        return int(self.engine.transfer_check_status(bid))  # type: ignore[attr-defined]

    def get_batch_transfer_status(self, bids: list[int]) -> int:
        self.waited.append(list(bids))
        return int(self.engine.get_batch_transfer_status(bids))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


@pytest.mark.parametrize("pair", ["mooncake"], indirect=True)
@pytest.mark.parametrize("mode", ["inline", "per_row"])
def test_mooncake_says_a_batch_is_done_only_after_the_whole_batch_wait(pair: Pair, mode: str, tmp_path: object,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait sleeps on a one-descriptor sentinel, a hint only: every batch must still pass
    # Mooncake's own whole-batch wait before the job returns, and the sentinel rewrites bytes
    # of its own batch's last descriptor, nothing else.
    pre, peer = pair.pre, pair.peer
    ex = pre.ex
    assert isinstance(ex, EngineExecutor)
    runs, src_rows, dst_rows = _chunk(seed=3, rows=DST_ROWS // 2)
    monkeypatch.setattr(mooncake, "SENTINEL_FROM", 64 << 10)  # this job's batches are smaller than the default
    recorder = _RecordingEngine(ex._engine)  # type: ignore[attr-defined]
    ex._engine = recorder  # type: ignore[attr-defined]
    try:
        peer.call("fill", value=0)
        res = ex.execute("d0", pre.job(peer, runs, pack=_use(ex, mode)))
    finally:
        ex._engine = recorder.engine  # type: ignore[attr-defined]
    assert _path(res) == mode
    sentinels = {bid for bid in recorder.batches if bid in recorder.checked}
    assert sentinels, "a batch of SENTINEL_FROM bytes or more is waited for through a sentinel"
    waited = {bid for bids in recorder.waited for bid in bids}
    order = list(recorder.batches)
    for bid in order:
        if bid in sentinels:
            (sent,) = recorder.batches[bid]
            src, dst, size = recorder.batches[order[order.index(bid) - 1]][-1]
            assert sent == (src, dst, min(size, mooncake.SENTINEL_BYTES))
        else:
            assert bid in waited, "every batch passes Mooncake's whole-batch wait"
    _check(pre, peer, str(tmp_path), src_rows, dst_rows)
