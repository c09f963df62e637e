"""What a flooding session peer must not do (``tests/test_session.py``).

A flooder writes submits without reading or acknowledging anything; meanwhile a good
peer's requests must complete, byte-exact, the server must have applied no more of the
flooder's commands than its command window, and the flooder's writes must have stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import grpc

from pdproto.client import HandshakeClient
from pdproto.errors import PdprotoError
from pdproto.rpc import error_from_rpc
from pdproto.session import DEFAULT_COMMAND_WINDOW
from pdproto.v1 import common_pb2, describe_pb2, handshake_service_pb2 as hs, session_pb2, transfer_pb2
from pdproto_demo.decode import DecodeRank

from ._server_harness import SPEC


async def flood(send: Callable[[hs.SessionRequest], Awaitable[None]], written: list[int],
                stop: asyncio.Event) -> None:
    """Send submits 100 at a time (4,000 pages each) until ``send`` blocks past ``stop``; ``written[0]``
    is the last seq sent."""
    pages = [1] * 4000  # a large message, so a window of buffers fills after a few
    seq = 0
    while not stop.is_set():
        commands = []
        for _ in range(100):
            seq += 1
            commands.append(session_pb2.SessionCommand(seq=seq, submit=transfer_pb2.TransferInfo(
                room=seq, dst_kv_pages=pages, is_dummy=True)))
        sent = asyncio.ensure_future(send(hs.SessionRequest(commands=commands)))
        done, _ = await asyncio.wait([sent, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if sent not in done:
            sent.cancel()
            return
        written[0] = seq


@contextlib.contextmanager
def flooding(start: Callable[[list[int], asyncio.Event], Coroutine[Any, Any, None]]) -> Iterator[list[int]]:
    """Run ``start(written, stop)`` on its own event loop thread while the block runs; yields ``written``."""
    written = [0]
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(start(written, stop),))
    thread.start()
    try:
        yield written
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def check_held_back(client: HandshakeClient, good: DecodeRank, good_id: str, bad_id: str,
                    written: list[int]) -> dict[str, describe_pb2.PeerView]:
    """Run four of the good peer's requests while the flood goes on; returns both peers' views after."""
    time.sleep(1.0)
    placed = {room: good.pages_for(SPEC.prompt_tokens, first_page=i * 16) for i, room in enumerate(range(4))}
    for room, pages in placed.items():
        client.submit_transfer(good_id, good.transfer_info(room, pages))
    done = client.wait_for(good_id, placed, timeout=20)
    assert all(s.state == common_pb2.TRANSFER_STATE_SUCCESS for s in done.values()), done
    good.verify(placed, SPEC.prompt_tokens)
    # The flood stalls: its count stops moving for half a second. On a loaded machine it may
    # still be filling the buffers when the good peer is done, so wait (bounded) for the stall;
    # a flood that is never held back passes 20,000 long before the wait ends.
    stalled_at, waited = -1, time.monotonic()
    while (written[0] != stalled_at or not written[0]) and written[0] < 20_000 and time.monotonic() - waited < 30:
        stalled_at = written[0]
        time.sleep(0.5)
    assert 0 < written[0] == stalled_at < 20_000, (written[0], stalled_at)
    views = {p.peer_id: p for p in client.describe().peers}
    applied = views[bad_id].open_requests + views[bad_id].finished_kept
    assert applied <= DEFAULT_COMMAND_WINDOW, applied
    return views


def calling(call: Callable[[], Any], at_once: int, outcomes: list[PdprotoError | None], go: threading.Event,
            stop: threading.Event) -> None:
    """Flood with ``call`` (a unary callable's ``future``): ``at_once`` calls at a time while ``go`` is set,
    until ``stop``; appends None for each call served and the typed refusal for each refused."""
    while go.wait() and not stop.is_set():
        for future in [call() for _ in range(at_once)]:
            try:
                future.result()
                outcomes.append(None)
            except grpc.RpcError as exc:
                outcomes.append(error_from_rpc(exc))


__all__ = ["calling", "check_held_back", "flood", "flooding"]
