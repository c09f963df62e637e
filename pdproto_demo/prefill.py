"""A prefill rank as its own process: KV pool with known contents, the real handshake service.

Run as ``python -m pdproto_demo.prefill --backend mooncake --dcp-size 2 --dcp-rank 0 ...`` (flags: the
fields of ``PrefillConfig``). The service runs on its own asyncio loop in a thread; the main thread answers
the JSON-line commands of ``main`` (``pdproto_demo/README.md``); what the service holds is its ``Describe``
RPC (``pdproto status``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
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
from .model import HeadReference, ModelShape, RankConfig
from .proc import Reply, redirect_stdout_to_stderr, serve_commands


@dataclass(frozen=True)
class PrefillConfig(RankConfig):
    """Shape and service of one prefill rank; each field is also a command-line flag of the process."""

    host: str = "127.0.0.1"
    """Address the service listens on."""
    port: int = 0
    """Port the service listens on (0: any free one, reported by the ready line)."""
    tls_cert: str = ""
    """PEM certificate file of the service (empty: plaintext)."""
    tls_key: str = ""
    """PEM key file of the service."""
    token: str = ""
    """The deployment's token (empty: none)."""
    operator_token: str = ""
    """The token ``Describe`` shows every peer's rooms to."""
    cp_size: int = 1
    """Attention CP ranks, each sending its share of the pages."""
    cp_rank: int = 0
    """This rank's attention CP index."""
    layer_split: bool = False
    """Each CP rank sends every page of its own layers, as a stage holds them (SGLang's DSA cache layer split)."""
    kv_sharding: bool = False
    """An MLA TP rank holds and sends every TP-size-th page (SGLang's ``--enable-kv-cache-sharding``)."""
    staging_mb: int = 64
    """Staging memory of the executor, MiB."""
    info_minor: int = 0
    """Publish this protocol minor (skew tests)."""
    limits: str = ""
    """JSON keywords of ``pdproto_server.registry.Limits``."""

    def shape(self) -> ModelShape:
        """The model shape this rank holds: a layer-split CP rank holds its layers as a stage would."""
        whole = super().shape()
        return replace(whole, pp_size=self.cp_size, pp_rank=self.cp_rank) if self.layer_split else whole


class PrefillRank:
    """State of one prefill rank process."""

    def __init__(self, args: PrefillConfig) -> None:
        self.args = args
        self.shard = data.Shard(args.dcp_size, args.dcp_rank)
        self.model = m = args.shape()
        rows, row_bytes = args.pages * args.page_size, m.kv_row_bytes(args.tp_size)
        self.executor = create_executor(args.backend, staging_bytes=args.staging_mb << 20,
                                        name=None if args.backend == "local" else args.name or f"prefill-{os.getpid()}")
        self.bufs = [self.executor.allocate(rows * row_bytes) for _ in m.kv_layers()]
        self.pool = [np.asarray(b.array).reshape(rows, row_bytes) for b in self.bufs]
        self.info = m.server_info(tp=args.tp_size, rank=args.tp_rank, page_size=args.page_size, dcp_size=args.dcp_size,
                                  dcp_rank=args.dcp_rank, backend=backends.by_name(args.backend).enum,
                                  port=args.port)
        # Aux and state pools hold ``slots`` requests each, like SGLang's per-request slots (a sliding
        # window's slot is its pages); a paged entry holds a page per KV page's token page.
        self.aux = [self.executor.allocate(a.item_len * args.slots) for a in self.info.aux_entries]
        self.state = [[self.executor.allocate(t.item_len * m.entry_items(i, args.slots, args.pages * args.dcp_size))
                       for t in e.tensors] for i, e in enumerate(self.info.state_entries)]
        self.index: dict[int, list[int]] = {}
        """Per room, its DSA index pages (named on its last chunk)."""
        self.extras = [*self.aux, *(b for e in self.state for b in e)]
        """Every aux buffer, then every state tensor's (``ModelShape.extra_items``'s order)."""
        self.executor.register_memory([*self.bufs, *self.extras])
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
        self.core = HandshakeCore(self.engine, limits=Limits(**json.loads(args.limits)) if args.limits else Limits())
        config = ServerConfig(listen=f"{args.host}:{args.port}", token=args.token or None,
                              operator_token=args.operator_token or None, grace=2.0,
                              tls_cert=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
                              tls_key=Path(args.tls_key).read_bytes() if args.tls_key else None)
        self.service = ServiceThread(self.core, config, name="service")

    def prepare(self, room: int, prefix: int, total: int, pages: list[int], corrupt: bool = False,
                slot: int = 0) -> Reply:
        """Write this rank's rows of tokens [prefix, total) of a request into ``pages``, and its
        state and aux into ``slot`` (hybrid models)."""
        a, m = self.args, self.model
        rows = data.fill(self.pool, self.shard, data.Placement(room, prefix, total, pages),
                         page_size=a.page_size, reference=HeadReference(m, a.tp_size, a.tp_rank))
        self.index[room] = m.index_pages(pages, total - prefix, a.dcp_size)
        writes = m.extra_writes(room, slot, self.index[room], "prefill", a.tp_size, a.tp_rank)
        for buf, items in zip(self.extras, writes, strict=True):
            for item, block in items:
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
        """What this process's service wrote, per kind, from its metrics (its peers and requests: ``Describe``)."""
        return self.service.call(self._moved(), 10)

    async def _moved(self) -> Reply:
        """``stats``, read on the service's loop."""
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the prefill rank process."""
    args = PrefillConfig.parse(argv)
    out = redirect_stdout_to_stderr()
    rank = PrefillRank(args)
    try:
        serve_commands({"prepare": rank.prepare, "chunk": rank.chunk, "release": rank.release, "poll": rank.poll,
                        "abort_room": rank.abort_room, "stats": rank.stats}, out, {"port": rank.service.start(60)})
    finally:
        rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
