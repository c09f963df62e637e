"""Local-backend guards: one deadline for an arena handover, typed errors once a lease is closed,
and runs whose last row does not fit in int64.

Real executors in this process: a decode ``LocalExecutor`` serves its sealed arena on its
abstract socket, and a prefill ``LocalExecutor`` fetches and writes into it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pdproto.errors import InvalidFieldError, PdprotoError, Reason
from pdproto.transfer import LayerSpan, TransferJob, arena, create_executor
from pdproto.transfer.local import LocalExecutor
from pdproto.v1 import registration_pb2

pytestmark = [pytest.mark.timeout(120)]

REGION = 16 << 10


class Pair:
    """A decode with one 16 KiB KV buffer, and a prefill with a 16 KiB source of 7s."""

    def __init__(self) -> None:
        decode = create_executor("local", arena_bytes=1 << 20)
        prefill = create_executor("local", arena_bytes=1 << 20, connect_timeout_s=5)
        assert isinstance(decode, LocalExecutor) and isinstance(prefill, LocalExecutor)
        self.decode, self.prefill = decode, prefill
        self.dst = decode.allocate(REGION)
        self.src = prefill.allocate(REGION)
        self.src.array[:] = 7
        self.registration = registration_pb2.KvRegistration()
        self.registration.local.CopyFrom(decode.endpoint())
        self.registration.kv_buffers.add(ptr=self.dst.ptr, length=REGION)

    def job(self, runs: list[list[int]], row: int = 4096) -> TransferJob:
        return TransferJob.of_runs([LayerSpan(self.src.addr, self.dst.ptr, row)], np.array(runs, dtype=np.int64))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_run_whose_last_row_wraps_int64_is_refused_typed(pair: Pair) -> None:
    """Row 2 of a dst stride of 2**62+5 is past 2**63: computed in int64 it wrapped below the region."""
    pair.prefill.connect("d", pair.registration)
    with pytest.raises(InvalidFieldError) as caught:
        pair.prefill.execute("d", pair.job([[0, 1, 0, 2**62 + 5, 3]]))
    assert caught.value.field == "job.segments[0].runs" and "int64" in caught.value.message
    assert not np.asarray(pair.dst.array).any()  # nothing was written
    # The same peer still takes a job that fits.
    pair.prefill.execute("d", pair.job([[0, 1, 0, 1, 4]]))
    assert (np.asarray(pair.dst.array) == 7).all()


def test_a_closed_lease_reads_as_gone_not_as_a_bare_value_error(pair: Pair) -> None:
    lease = arena.fetch(pair.registration.local, REGION, timeout=5)
    assert lease.alive()
    lease.close()
    assert lease.alive() is False


def test_a_transfer_racing_a_disconnect_fails_typed(pair: Pair) -> None:
    """Every execute either lands or fails PEER_NOT_FOUND / PEER_GONE, never with a bare exception."""
    job = pair.job([[0, 1, 0, 1, 4]], row=64)
    stop = threading.Event()
    outcomes: list[str] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                pair.prefill.execute("d", job)
                outcomes.append("ok")
            except PdprotoError as exc:
                outcomes.append(exc.reason.name)
            except BaseException as exc:  # noqa: BLE001 - the bug this test is about
                outcomes.append(repr(exc))

    pair.prefill.connect("d", pair.registration)
    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for _ in range(20):  # a guard: the race window is too small to hit on demand
            pair.prefill.disconnect("d")
            pair.prefill.connect("d", pair.registration)
    finally:
        stop.set()
        thread.join(30)
    assert set(outcomes) <= {"ok", Reason.PEER_NOT_FOUND.name, Reason.PEER_GONE.name}, set(outcomes)


def test_an_arena_client_that_dribbles_its_secret_is_cut_off_at_one_total_deadline(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode answers one client at a time: a byte now and then, each inside a per-recv timeout,
    must not hold it past the handover deadline (docs/security.md)."""
    monkeypatch.setattr(arena, "_HANDOVER_S", 0.5)
    endpoint = pair.registration.local
    hello = arena.HELLO + endpoint.secret
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect("\0" + endpoint.socket)
    cut_at = None
    try:
        for i, byte in enumerate(hello):
            try:
                slow.send(bytes([byte]))
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    cut_at = i
                    break
            except BlockingIOError:
                pass  # still open, nothing to read
            except (BrokenPipeError, ConnectionResetError):
                cut_at = i
                break
            time.sleep(0.2)  # 40 bytes: 8 s in all, against 0.5 s per recv or in total
    finally:
        slow.close()
    assert cut_at is not None and cut_at < len(hello) - 1, "the dribbling client got the whole handover"
    # The server is free again: a prompt prefill connects.
    pair.prefill.connect("d", pair.registration)
    pair.prefill.execute("d", pair.job([[0, 1, 0, 1, 4]]))
