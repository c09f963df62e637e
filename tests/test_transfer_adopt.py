"""A Mooncake executor that adopts an engine the process already runs (an inference engine's shared one).

SGLang keeps one ``mooncake.engine.TransferEngine`` per process; pdproto's executor must
move bytes through it instead of starting a second engine, and must leave it running when
it closes. The memory is registered as an engine knows its KV pool: by address
(``pdproto.transfer.at_address``). The decode is a real peer process; every byte is read back.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdproto.dcp import plan_relayout
from pdproto.errors import InvalidFieldError
from pdproto.transfer import LayerSpan, TransferJob, at_address
from pdproto.transfer.engines.mooncake import MooncakeExecutor
from pdproto_demo.decode import DecodeConfig, DecodeProcess

from ._per_token import reference

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

ROW, PAGE, DCP, PAGES, LAYERS = 576, 16, 4, 64, 2


def _shared_engine() -> tuple[object, str]:
    """A Mooncake engine started the way SGLang starts its shared one (P2P handshake, TCP)."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def test_an_adopted_engine_moves_a_relayout_and_outlives_the_executor(tmp_path: object) -> None:
    engine, session = _shared_engine()
    rows = PAGES * PAGE
    owned = [np.random.default_rng(layer).integers(0, 256, rows * ROW, dtype=np.uint8) for layer in range(LAYERS)]
    peer = DecodeProcess.launch(DecodeConfig(backend="mooncake", layers=LAYERS, pages=rows // DCP, page_size=1,
                                             row_bytes=ROW, background=0), timeout=60)
    try:
        for round_ in range(2):  # a second executor adopts the same engine after the first closed
            ex = MooncakeExecutor(engine=engine, session_id=session, staging_bytes=4 << 20)
            assert ex.endpoint().session_id == session
            src = [at_address(a.ctypes.data, a.nbytes) for a in owned]  # the pool, known by address
            ex.register_memory(src)
            ex.connect("d0", peer.registration)
            plan = plan_relayout(np.arange(PAGES), np.arange(PAGES // DCP)[::-1].copy(), page_size=PAGE,
                                 dcp_size=DCP, dcp_rank=1)
            job = TransferJob.of_runs([LayerSpan(s.addr, d.ptr, ROW) for s, d in
                                       zip(src, peer.registration.kv_buffers)], plan.target_runs, pack=True)
            result = ex.execute("d0", job)
            assert result.packed and not result.fallback
            path = os.path.join(str(tmp_path), f"dump{round_}.bin")
            peer.call("dump", path=path)
            got = np.fromfile(path, dtype=np.uint8).reshape(LAYERS, rows // DCP, ROW)
            src_rows, dst_rows, _, _ = reference(list(range(PAGES)), list(range(PAGES // DCP))[::-1], Ps=PAGE,
                                                 Ns=1, s=0, Pd=PAGE, Nd=DCP, d=1, off=0, N=rows)
            for layer in range(LAYERS):
                assert np.array_equal(got[layer][dst_rows], owned[layer].reshape(rows, ROW)[src_rows])
            assert result.bytes == src_rows.size * ROW * LAYERS
            ex.close()
            peer.call("fill", value=0)
        # Closing the executors left the engine running for its owner.
        assert f"127.0.0.1:{engine.get_rpc_port()}" == session  # type: ignore[attr-defined]
    finally:
        peer.close()


def test_adopting_an_engine_needs_its_session_id() -> None:
    with pytest.raises(InvalidFieldError) as info:
        MooncakeExecutor(engine=object())
    assert info.value.field == "session_id"
