"""Pipeline stages end to end: real prefill and decode processes, real gRPC, a real Mooncake engine (TCP).

Two prefill stages (PP 2, each its own process holding and numbering only its layers) feed
two decode stages (PP 2, each its own process, sending no layer ids, as SGLang's plain pools
do) and a decode that holds every layer (PP 1: fan-in from both stages). One small request per
topology; each decode rank compares every byte of every KV buffer with the model: its own
layers' rows on the request's pages, the background everywhere else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdproto.errors import ConfigError
from pdproto_demo.data import ROW_BYTES
from pdproto_demo.decode import DecodeConfig, DecodeProcess
from pdproto_demo.model import ModelShape
from pdproto_demo.proc import Child, ChildError, close_all

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

LAYERS, PAGE_SIZE, PAGES, TOKENS = 4, 16, 8, 40
"""Four layers (two per stage); 40 tokens: two full pages and a partial one."""
CHUNKS = [(0, 32), (32, 40)]
"""Token ranges of the request's two chunks (whole pages but the last)."""


def _prefill(stage: int, run: str, log_dir: Path) -> Child:
    return Child.spawn(f"prefill-pp{stage}", "pdproto_demo.prefill",
                       ["--backend", "mooncake", "--layers", str(LAYERS), "--page-size", str(PAGE_SIZE),
                        "--pages", str(PAGES), "--pp-size", "2", "--pp-rank", str(stage),
                        "--name", f"prefill-pp{stage}-{run}"], log_dir=str(log_dir))


def _decode(pp_size: int, stage: int, run: str, log_dir: Path) -> DecodeProcess:
    config = DecodeConfig(backend="mooncake", layers=LAYERS, pages=PAGES, page_size=PAGE_SIZE,
                          pp_size=pp_size, pp_rank=stage, layer_ids=pp_size == 1,
                          name=f"decode-pp{pp_size}-{stage}-{run}")
    return DecodeProcess.spawn_rank(config, label=f"decode-pp{pp_size}-{stage}", log_dir=str(log_dir))


def test_pp2_stages_feed_their_own_decode_stages_and_fan_in_to_a_pp1_decode(tmp_path: Path) -> None:
    run = os.urandom(3).hex()
    prefills = [_prefill(s, run, tmp_path) for s in (0, 1)]
    stages = [_decode(2, s, run, tmp_path) for s in (0, 1)]
    whole = _decode(1, 0, run, tmp_path)
    try:
        address = [f"127.0.0.1:{int(c.recv(120)['port'])}" for c in prefills]
        for d in (*stages, whole):
            d.await_ready(120)
        # A decode stage hears from its own prefill stage only, as in SGLang's rank mapping.
        with pytest.raises(ChildError, match="TOPOLOGY_NOT_A_SENDER"):
            stages[1].call("connect", 60, targets=[address[0]])
        for s, d in enumerate(stages):
            d.send("connect", targets=[address[s]])
        whole.send("connect", targets=address)
        connected = [d.recv(60) for d in (*stages, whole)]
        assert [c["required"] for c in connected] == [[1], [1], [2, 2]]

        # Room 1: stage s -> decode stage s. Room 2: both stages -> the PP 1 decode.
        rooms = {1: ([1, 0, 2], stages), 2: ([5, 4, 6], [whole])}
        for room, (src_pages, _) in rooms.items():
            for c in prefills:
                c.send("prepare", room=room, prefix=0, total=TOKENS, pages=src_pages)
            for c in prefills:
                c.recv(60)
        for room, (_, decodes) in rooms.items():
            for d in decodes:
                # Reversed destination pages, so a page copied to its own index is caught.
                d.call("request", 60, room=room, prefix=0, total=TOKENS, prefix_pages=[], dst_pages=[3, 2, 1])
        for room, (src_pages, _) in rooms.items():
            for k, (a, b) in enumerate(CHUNKS):
                for c in prefills:
                    c.send("chunk", room=room, pages=src_pages[a // PAGE_SIZE:-(-b // PAGE_SIZE)],
                           num_tokens=b - a, last=k == len(CHUNKS) - 1)
                for c in prefills:
                    c.recv(60)
        for room, (_, decodes) in rooms.items():
            for d in decodes:
                d.send("wait", room=room, timeout=60, check=True)
            for d in decodes:
                r = d.recv(90)
                layers = LAYERS // (2 if d in stages else 1)
                assert r["ok"], (d.name, r["failures"], r["mismatch"])
                # Every byte of every KV buffer of the rank was compared; exactly its layers' rows moved.
                assert r["checked"] == layers * PAGES * PAGE_SIZE * ROW_BYTES, (d.name, r)
                assert r["bytes"] == layers * TOKENS * ROW_BYTES, (d.name, r)
    finally:
        close_all([*stages, whole])
        close_all(prefills)


def test_stages_of_a_model_with_state_are_refused_as_not_modelled() -> None:
    # Which stage writes aux and state is not modelled: a hybrid stage would check the wrong bytes.
    with pytest.raises(ConfigError, match="mla, mha and dsa only"):
        ModelShape(kind="hybrid", pp_size=2)
