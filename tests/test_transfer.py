"""Real executors (local, Mooncake TCP, NIXL UCX) writing into decode peers in separate processes.

The prefill side runs in the test process, one executor per backend for the
whole session; each decode is ``python -m pdproto_demo.decode``. Every
destination byte is read back from the peer and checked.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdproto.dcp import plan_relayout
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
    TransferExecutor,
    TransferJob,
    create_executor,
    encode_notification,
)
from pdproto.v1 import registration_pb2
from pdproto_demo.decode import DecodeConfig, DecodeProcess

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

    def job(self, peer: DecodeProcess, src_rows: np.ndarray, dst_rows: np.ndarray, *,
            pack: bool = True, room: int | None = None) -> TransferJob:
        layers = tuple(LayerSpan(s.addr, d.ptr, ROW)
                       for s, d in zip(self.src, peer.registration.kv_buffers))
        return TransferJob(layers=layers, src_rows=src_rows, dst_rows=dst_rows, pack=pack,
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
    pairs[backend].peer.fill(0)


def _peer(backend: str) -> DecodeProcess:
    return DecodeProcess.launch(DecodeConfig(backend=backend, layers=LAYERS, pages=DST_ROWS, page_size=1,
                                             row_bytes=ROW, device=DEVICE, background=0), timeout=60)


def _dcp_rows(seed: int, rank: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    plan = plan_relayout(rng.permutation(SRC_PAGES), rng.permutation(DST_ROWS // PAGE),
                         page_size=PAGE, dcp_size=DCP, dcp_rank=rank)
    return plan.expand()


def _check(pre: Prefill, peer: DecodeProcess, tmp: str, src_rows: np.ndarray,
           dst_rows: np.ndarray) -> None:
    """Every written row equals its source row, and every other row is still zero."""
    path = os.path.join(tmp, "dump.bin")
    peer.dump(path)
    got = np.fromfile(path, dtype=np.uint8).reshape(LAYERS, DST_ROWS, ROW)
    untouched = np.ones(DST_ROWS, dtype=bool)
    untouched[dst_rows] = False
    for layer, host in enumerate(pre.host):
        want = host[src_rows]
        assert np.array_equal(got[layer][dst_rows], want), f"layer {layer} differs"
        assert not got[layer][untouched].any(), f"layer {layer}: bytes outside the job"


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_row"])
def test_dcp_relayout_lands_every_byte(pair: Pair, pack: bool, tmp_path: object) -> None:
    pre, peer = pair.pre, pair.peer
    src_rows, dst_rows = _dcp_rows(seed=1)
    res = pre.ex.execute("d0", pre.job(peer, src_rows, dst_rows, pack=pack))
    assert res.bytes == src_rows.size * ROW * LAYERS
    if pre.ex.backend != "local":
        assert res.packed is pack and not res.fallback
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
        src_rows, dst_rows = _dcp_rows(seed=2, rank=3)
        pre.ex.connect("d0", peer.registration)
        res = pre.ex.execute("d0", pre.job(peer, src_rows, dst_rows, pack=True))
        assert res.fallback and not res.packed
        assert pre.ex.stats.pack_fallbacks == 1
        _check(pre, peer, str(tmp_path), src_rows, dst_rows)
    finally:
        pre.ex.close()
        peer.fill(0)


def test_rows_beyond_registered_length_are_refused(pair: Pair, tmp_path: object) -> None:
    pre, peer = pair.pre, pair.peer
    src_rows = np.arange(0, 8, dtype=np.int64)
    dst_rows = np.arange(DST_ROWS - 4, DST_ROWS + 4, dtype=np.int64)
    with pytest.raises(DestinationOutOfBoundsError) as info:
        pre.ex.execute("d0", pre.job(peer, src_rows, dst_rows))
    assert info.value.reason == Reason.DESTINATION_OUT_OF_BOUNDS
    _check(pre, peer, str(tmp_path), src_rows[:0], dst_rows[:0])  # nothing was written


def test_zero_row_rank_still_gets_its_notification(pair: Pair) -> None:
    pre, peer = pair.pre, pair.peer
    empty = np.zeros(0, dtype=np.int64)
    res = pre.ex.execute("d0", pre.job(peer, empty, empty, room=42))
    assert res.bytes == 0 and res.descriptors == 0
    if pre.ex.backend == "nixl":
        assert res.notified
        assert peer.notified_rooms(wait_s=10) == [42]
        assert pre.ex.notify("d0", 43, b"done")
        assert peer.notified_rooms(wait_s=10) == [43]
    else:
        assert not res.notified and not pre.ex.notify("d0", 43, b"")


def test_peer_killed_mid_transfer_fails_with_reason_then_other_peer_served(
        pair: Pair, tmp_path: object) -> None:
    pre, other = pair.pre, pair.peer
    ex = pre.ex
    src_rows, dst_rows = _dcp_rows(seed=3, rank=0)
    victim = _peer(ex.backend)
    outcome: list[BaseException] = []
    first_done = threading.Event()

    def hammer() -> None:
        # Transfer to the victim until it fails; the kill lands while one is in flight.
        try:
            for i in range(100_000):
                ex.execute("victim", pre.job(victim, src_rows, dst_rows, pack=i % 2 == 1))
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
        ex.disconnect("victim")
        res = ex.execute("d0", pre.job(other, src_rows, dst_rows, pack=True))
        assert res.bytes == src_rows.size * ROW * LAYERS
        _check(pre, other, str(tmp_path), src_rows, dst_rows)
    finally:
        ex.disconnect("victim")
        victim.close()


def test_unknown_peer_and_wrong_backend_are_typed_errors(pair: Pair) -> None:
    ex = pair.pre.ex
    empty = np.zeros(0, dtype=np.int64)
    with pytest.raises(NotFoundError) as info:
        ex.execute("nobody", TransferJob(layers=(), src_rows=empty, dst_rows=empty))
    assert info.value.reason == Reason.PEER_NOT_FOUND
    reg = registration_pb2.KvRegistration()
    if ex.backend == "mooncake":
        reg.local.shm_name = "nothing-here"
    else:
        reg.mooncake.session_id = "127.0.0.1:1"
    with pytest.raises(TopologyError) as info:
        ex.connect("x", reg)
    assert info.value.reason == Reason.TOPOLOGY_BACKEND_UNSUPPORTED


def test_two_peers_served_from_parallel_threads(pair: Pair, tmp_path: object) -> None:
    # The server runs jobs for different peers on a thread pool: both must land intact.
    pre, first = pair.pre, pair.peer
    second = _peer(pre.ex.backend)
    rows = {"d0": _dcp_rows(seed=4, rank=2), "d1": _dcp_rows(seed=5, rank=1)}
    peers = {"d0": first, "d1": second}
    errors: list[BaseException] = []

    def run(peer_id: str) -> None:
        try:
            for pack in (True, False, True):
                src_rows, dst_rows = rows[peer_id]
                pre.ex.execute(peer_id, pre.job(peers[peer_id], src_rows, dst_rows, pack=pack))
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
            _check(pre, peer, str(tmp_path), *rows[peer_id])
    finally:
        pre.ex.disconnect("d1")
        second.close()
