"""A prefill rank as its own process: KV pool with known contents, the real handshake service.

Run as ``python -m pdproto_demo.prefill --backend mooncake --dcp-size 2 --dcp-rank 0 ...``
(``--model hybrid --tp-size 4 --tp-rank 1`` for rank 1 of a Kimi-Linear-shaped TP 4 group,
``--model dsa`` for MLA rows with a DeepSeek-V3.2 index, ``--pp-size 2 --pp-rank 1`` for the
second pipeline stage, which holds and numbers only its own layers, ``--cp-size 2 --cp-rank 1`` for
attention-CP rank 1 of a prefill whose CP ranks each send their share of the pages (with ``--layer-split``:
every page of their own layers, as a stage holds them, SGLang's DSA cache layer split), ``--kv-sharding``
for an MLA TP rank that holds and sends every TP-size-th page, SGLang's ``--enable-kv-cache-sharding``).
The service runs on its own asyncio loop in a thread; the main thread answers JSON-line
commands: ``prepare`` writes a request's rows (and its state and aux slot), ``chunk`` calls
the engine's ``submit_chunk`` (the last one with the slots), ``poll``, ``prefix`` and
``abort_room`` call the engine's room API, ``stats`` reads what the service and its executor
wrote (what the service holds is its ``Describe`` RPC: ``pdproto status``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pdproto import backends
from pdproto.transfer import create_executor
from pdproto_server.app import ServerConfig, ServiceThread
from pdproto_server.core import HandshakeCore
from pdproto_server.engine import KvSource, PrefillEngine
from pdproto_server.registry import Limits

from . import data
from .model import KINDS, ModelShape
from .proc import Reply, redirect_stdout_to_stderr, serve_commands


class PrefillRank:
    """State of one prefill rank process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shard = data.Shard(args.dcp_size, args.dcp_rank)
        self.model = ModelShape(kind=args.model, layers=args.layers, replicated_bytes=args.replicated_bytes,
                                kda_heads=args.kda_heads, kda_head_dim=args.kda_head_dim,
                                window_pages=args.window_pages, page_size=args.page_size,
                                pp_size=args.cp_size if args.layer_split else args.pp_size,
                                pp_rank=args.cp_rank if args.layer_split else args.pp_rank)
        m, tp = self.model, args.tp_size
        rows, row_bytes = args.pages * args.page_size, m.kv_row_bytes(tp)
        self.executor = create_executor(args.backend, name=None if args.backend == "local" else args.name,
                                        staging_bytes=args.staging_mb << 20)
        self.bufs = [self.executor.allocate(rows * row_bytes) for _ in m.kv_layers()]
        self.pool = [np.asarray(b.array).reshape(rows, row_bytes) for b in self.bufs]
        self.info = m.server_info(tp=tp, rank=args.tp_rank, page_size=args.page_size, dcp_size=args.dcp_size,
                                  dcp_rank=args.dcp_rank, backend=backends.by_name(args.backend).enum,
                                  port=args.port)
        # Aux and state pools hold ``slots`` requests each, like SGLang's per-request slots (a sliding
        # window's slot is its pages); a paged entry holds a page per KV page's token page.
        self.aux = [self.executor.allocate(a.item_len * args.slots) for a in self.info.aux_entries]
        self.state = [[self.executor.allocate(t.item_len * m.entry_items(i, args.slots, args.pages * args.dcp_size))
                       for t in e.tensors] for i, e in enumerate(self.info.state_entries)]
        self.index: dict[int, list[int]] = {}
        """Per room, its DSA index pages (named on its last chunk)."""
        self.executor.register_memory([*self.bufs, *self.aux, *(b for e in self.state for b in e)])
        if args.cp_size > 1:  # every CP rank sends its share of the pages (SGLang enable_all_cp_ranks_for_transfer)
            self.info.attn_cp.size, self.info.attn_cp.rank = args.cp_size, args.cp_rank
            self.info.cp_ranks_split_pages = not args.layer_split
            if args.layer_split:  # or every page of its own layers, in one stage
                self.info.pp.size, self.info.pp.rank, self.info.enable_dsa_cache_layer_split = 1, 0, True
        self.info.enable_kv_cache_sharding = args.kv_sharding
        if args.info_minor:
            # A "newer" server: higher minor, a capability and a field older peers do not know.
            self.info.version.minor = args.info_minor
            self.info.capabilities.append(f"future-feature-{args.info_minor}")
            self.info.MergeFromString(data.FUTURE_FIELD)
        source = KvSource(tuple(self.bufs), self.info, aux=tuple(self.aux),
                          state=tuple(tuple(e) for e in self.state))
        rank = (args.tp_rank * args.dcp_size + args.dcp_rank) * args.cp_size + args.cp_rank
        self.engine = PrefillEngine(source, self.executor, prefill_rank=rank)
        a = self.args
        self.core = HandshakeCore(self.engine, limits=Limits(**json.loads(a.limits)) if a.limits else Limits())
        config = ServerConfig(listen=f"{a.host}:{a.port}", token=a.token, operator_token=a.operator_token, grace=2.0,
                              tls_cert=Path(a.tls_cert).read_bytes() if a.tls_cert else None,
                              tls_key=Path(a.tls_key).read_bytes() if a.tls_key else None)
        self.service = ServiceThread(self.core, config, name="service")

    def launch_service(self) -> int:
        """Start the service thread and return the bound port."""
        return self.service.start(60)

    def prepare(self, room: int, prefix: int, total: int, pages: list[int], corrupt: bool = False,
                slot: int = 0) -> Reply:
        """Write this rank's rows of tokens [prefix, total) of a request into ``pages``, and its
        state and aux into ``slot`` (hybrid models)."""
        a, m = self.args, self.model
        rows = data.fill(self.pool, self.shard, data.Placement(room, prefix, total, pages),
                         page_size=a.page_size, reference=m.kv_reference(a.tp_size, a.tp_rank))
        for i, buf in enumerate(self.aux):
            n = m.aux_lens[i]
            buf.array[slot * n:(slot + 1) * n] = m.aux_item(room, i)
        self.index[room] = m.index_pages(pages, total - prefix, a.dcp_size)
        for k, (entry, buf) in enumerate(zip(m.state_tensors(), (b for e in self.state for b in e), strict=True)):
            for item, block in m.state_writes(room, k, a.tp_size, a.tp_rank,
                                              m.state_pages(entry, slot, "prefill", self.index[room])):
                buf.array[item * block.size:(item + 1) * block.size] = block
        if corrupt and rows:
            # Flip one byte in the middle of the request: the decode's check must catch it.
            row = int(data.local_rows(pages, rows, self.args.page_size)[rows // 2])
            self.pool[len(self.pool) // 2][row, 77] ^= 0xFF
        return {"rows": rows}

    def chunk(self, room: int, pages: list[int], num_tokens: int, last: bool, slot: int = 0,
              page_offset: int | list[int] | None = None) -> Reply:
        """Report one computed chunk to the engine (non-blocking); the last one names the room's slots;
        ``page_offset``: the chunk's page in the request (a CP rank's share) or each page's (a KV-shard
        rank's), else after the chunks before."""
        extras: dict[str, Any] = {}
        if last and self.info.aux_entries:
            extras["aux_slot"] = slot
        if last and self.info.state_entries:
            extras["state_slots"] = [self.model.state_pages(i, slot, "prefill", self.index.get(room, ()))
                                     for i in range(len(self.info.state_entries))]
        self.engine.submit_chunk(room, pages, num_tokens, last, page_offset=page_offset, **extras)
        return {}

    def poll(self, room: int) -> Reply:
        """The engine's view of a room (KVPoll life cycle) and the decode's prefix length."""
        return {"state": self.engine.poll(room), "prefix": self.engine.decode_prefix_len(room)}

    def abort_room(self, room: int, reason: str) -> Reply:
        """Abort a room from the prefill side; its decodes see ABORTED with ``reason``."""
        self.engine.abort(room, reason)
        return {}

    def release(self, room: int) -> Reply:
        """Forget a room's chunks."""
        self.engine.release_room(room)
        self.index.pop(room, None)
        return {}

    def stats(self) -> Reply:
        """What the service wrote per kind and what the executor did (the service's state: ``Describe``)."""
        out: Reply = self.service.call(self._moved(), 10)
        st = self.executor.stats
        out["executor"] = {"jobs": st.jobs, "bytes": st.bytes, "descriptors": st.descriptors,
                           "packed_jobs": st.packed_jobs, "pack_fallbacks": st.pack_fallbacks,
                           "failures": st.failures}
        return out

    async def _moved(self) -> Reply:
        """What this process's service wrote, per kind, from its metrics (read on the service's loop;
        its peers and requests: ``Describe``)."""
        m = self.core.metrics
        moved: Reply = {"kv_bytes": m.bytes_moved._value.get(), "aux_bytes": m.aux_bytes._value.get(),
                        "state_bytes": m.state_bytes._value.get()}
        for metric, label in ((m.state_items, "split"), (m.extra_descriptors, "kind")):
            for family in metric.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        moved[f"{family.name}_{sample.labels[label]}"] = sample.value
        return {"moved": moved}

    def close(self) -> None:
        """Stop the service and release the engine."""
        self.service.stop(15)
        self.executor.close()


def parser() -> argparse.ArgumentParser:
    """The prefill rank's flags (a caller in process builds its arguments here, defaults included)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--name", default=f"prefill-{os.getpid()}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls-cert", default=None)
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--token", default=None)
    ap.add_argument("--operator-token", default=None, help="the token Describe shows every peer's rooms to")
    ap.add_argument("--dcp-size", type=int, default=1)
    ap.add_argument("--dcp-rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", choices=KINDS, default="mla", help="KV only (mla), Kimi-shaped (hybrid), mha,"
                    " DeepSeek-V3.2-shaped (dsa)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--pp-size", type=int, default=1, help="pipeline stages (mla, mha)")
    ap.add_argument("--pp-rank", type=int, default=0)
    ap.add_argument("--cp-size", type=int, default=1, help="attention CP ranks, each sending its share of pages")
    ap.add_argument("--cp-rank", type=int, default=0)
    ap.add_argument("--layer-split", action="store_true", help="each CP rank holds its own layers (mla, mha, dsa)")
    ap.add_argument("--kv-sharding", action="store_true", help="MLA pages striped across the TP ranks")
    ap.add_argument("--slots", type=int, default=8, help="aux and state slots (hybrid)")
    ap.add_argument("--replicated-bytes", type=int, default=0, help="a state tensor whole on every rank")
    ap.add_argument("--window-pages", type=int, default=0, help="pages of a sliding-window state entry (hybrid)")
    ap.add_argument("--kda-heads", type=int, default=ModelShape.kda_heads, help="KDA heads before TP (hybrid)")
    ap.add_argument("--kda-head-dim", type=int, default=ModelShape.kda_head_dim, help="KDA head dimension")
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--staging-mb", type=int, default=64)
    ap.add_argument("--info-minor", type=int, default=0, help="publish this protocol minor (skew tests)")
    ap.add_argument("--limits", default="", help="JSON keywords of pdproto_server.registry.Limits")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the prefill rank process."""
    args = parser().parse_args(argv)
    out = redirect_stdout_to_stderr()
    rank = PrefillRank(args)
    try:
        port = rank.launch_service()
        out.write('{"ready": true, "port": %d, "pid": %d}\n' % (port, os.getpid()))
        out.flush()
        serve_commands({"prepare": rank.prepare, "chunk": rank.chunk, "release": rank.release,
                        "poll": rank.poll, "abort_room": rank.abort_room, "stats": rank.stats}, out)
    finally:
        rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
