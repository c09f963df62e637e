"""A small P/D cluster of real processes on 127.0.0.1, driven request by request.

Used by ``pdproto demo`` and by the reliability runs: prefill ranks (``pdproto_demo.prefill``)
serve the handshake service, decode ranks (``pdproto_demo.decode``) register through the client. A request
is laid out here (pages, chunks) and its bytes are checked by each decode rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdproto.negotiation.senders import target_tp_ranks

from . import data
from .decode import DecodeConfig, DecodeProcess
from .model import RankConfig
from .prefill import PrefillConfig
from .proc import Child, Reply, close_all


@dataclass(frozen=True)
class Topology:
    """A prefill group (TP x DCP) feeding a decode group (TP, with DCP inside it as in SGLang)."""

    src_dcp: int
    dst_dcp: int
    src_tp: int = 1
    dst_tp: int = 1

    @property
    def dst_ranks(self) -> int:
        """Decode processes of one group: TP ranks (DCP ranks are TP rank mod DCP size)."""
        return max(self.dst_tp, self.dst_dcp)

    def sources_of(self, dst_rank: int) -> list[int]:
        """Prefill members feeding a decode rank: DCP ranks that share tokens with it (s = d mod
        gcd(Ns, Nd)) within the TP ranks SGLang's rank mapping pairs it with."""
        g = math.gcd(self.src_dcp, self.dst_dcp)
        tps = target_tp_ranks(self.src_tp, self.dst_tp, dst_rank % self.dst_tp)
        return [t * self.src_dcp + s for t in tps for s in range(self.src_dcp) if s % g == dst_rank % g]


@dataclass(frozen=True)
class Geometry:
    """Sizes shared by every rank of a run."""

    layers: int = 8
    page_size: int = 64
    max_tokens: int = 32768
    max_prefix: int = 1024
    slots: int = 1
    """Requests the prefill pool holds at once (each in its own page range)."""

    def slot_pages(self, src_dcp: int) -> int:
        """Prefill pages one request slot spans."""
        return math.ceil(self.max_tokens / (self.page_size * src_dcp)) + 2

    def src_pages(self, src_dcp: int) -> int:
        """Prefill pool pages: every slot plus slack."""
        return self.slot_pages(src_dcp) * self.slots + 8

    def dst_pages(self, dst_dcp: int) -> int:
        """Decode pool pages: prefix, longest request, slack."""
        v = self.page_size * dst_dcp
        return math.ceil(self.max_tokens / v) + math.ceil(self.max_prefix / v) + 8


@dataclass
class RequestResult:
    """What one request did across every rank."""

    room: int
    tokens: int
    prefix: int
    chunks: int
    ok: bool
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    checked: int = 0
    aux_bytes: int = 0
    state_bytes: int = 0
    aux_descriptors: int = 0
    state_descriptors: int = 0
    failures: list[str] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    failure_codes: list[str] = field(default_factory=list)


@dataclass
class Flight:
    """A request in progress: its layout and how many chunks were reported so far."""

    room: int
    tokens: int
    prefix: int
    vs: int
    bounds: list[tuple[int, int]]
    src_pages: list[int]
    decodes: list[int]
    sources: list[Child]
    sent: int = 0
    t0: float = 0.0
    waiting: list[int] = field(default_factory=list)
    slot: int = 0
    """The prefill's aux and state slot for the request (hybrid models)."""


def free_port(span: int = 1) -> int:
    """A TCP port free on 127.0.0.1 now, with the ``span - 1`` after it.

    Drawn below the kernel's ephemeral range: every engine, UCX listener and client socket takes
    its port from that range, and one did take a port found free there before the server meant
    for it started (a vLLM prefill failed to bind). A random draw keeps parallel tests apart.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    low = max(1024, high - 12000)
    for _ in range(1000):
        port = secrets.randbelow(high - low - span) + low
        try:
            with contextlib.ExitStack() as held:
                for p in range(port, port + span):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {span} free ports in a row between {low} and {high} on 127.0.0.1")


class Cluster:
    """Prefill and decode rank processes of one backend; reused across requests and topologies."""

    def __init__(self, backend: str, geometry: Geometry, *, dst_dcp: int = 4, dst_groups: int = 1,
                 src_groups: Sequence[int] = (1, 2), token: str | None = None,
                 env: dict[str, str] | None = None, log_dir: str | None = None,
                 prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, src_tp: int = 1,
                 dst_tp: int = 1, **shape: Any) -> None:
        """``shape``: the other ``model.RankConfig`` fields every rank shares (``model``, ``slots``, ...);
        ``prefill`` and ``decode``: further ``PrefillConfig`` and ``DecodeConfig`` fields of those ranks."""
        self.backend = backend
        self.src_tp, self.dst_tp = src_tp, dst_tp
        self.shape = {"backend": backend, "layers": geometry.layers, "page_size": geometry.page_size, **shape}
        self.slots = int(shape.get("slots", RankConfig.slots))
        self.dst_groups = dst_groups
        self.prefill = prefill or {}
        self.decode = decode or {}
        self.notify_ports: list[int] = []
        self.peer_ids: dict[int, list[str]] = {}
        self.run_id = os.urandom(3).hex()
        self.log_dir = log_dir
        self.geo = geometry
        self.dst_dcp = dst_dcp
        self.token = token
        self.operator_token = os.urandom(16).hex()
        """Each prefill's operator token: ``Describe`` shows every room to it (the reliability suite reads them)."""
        self.env = env or {}
        self.prefills: dict[int, list[Child]] = {}
        self.ports: dict[int, list[int]] = {}
        self.decodes: list[DecodeProcess] = []
        self.topology: Topology | None = None
        self._room = 1000
        self._src_groups = tuple(src_groups)

    def spawn_prefill(self, ns: int, r: int, port: int = 0) -> Child:
        """Start prefill rank ``r`` of the DCP ``ns`` group without waiting for it (its ready line has its port)."""
        config = PrefillConfig(**self.shape, **self.prefill, dcp_size=ns, dcp_rank=r % ns, tp_size=self.src_tp,
                               tp_rank=r // ns, pages=self.geo.src_pages(ns), name=f"prefill-{ns}-{r}-{self.run_id}",
                               port=port, operator_token=self.operator_token, token=self.token or "")
        return Child.spawn(f"prefill-dcp{ns}-r{r}", "pdproto_demo.prefill", config.argv(), env=self.env,
                           log_dir=self.log_dir)

    def spawn_decode(self, d: int) -> DecodeProcess:
        """Start decode rank ``d`` without waiting for it (``await_ready`` next)."""
        config = DecodeConfig(**self.shape, **self.decode, pages=self.geo.dst_pages(self.dst_dcp), dcp_size=self.dst_dcp,
                              dcp_rank=d % self.dst_dcp, name=f"decode-{d}-{self.run_id}",
                              notify_port=self.notify_ports[d], tp_size=self.dst_tp, tp_rank=d % self.dst_tp)
        return DecodeProcess.spawn_rank(config, label=f"decode-r{d}", env=self.env, log_dir=self.log_dir)

    def launch(self, timeout: float = 120.0) -> None:
        """Start every process and wait until each is ready."""
        per_group = max(self.dst_dcp, self.dst_tp)
        self.notify_ports = [free_port() for _ in range(per_group * self.dst_groups)]
        for ns in self._src_groups:
            self.prefills[ns] = [self.spawn_prefill(ns, r) for r in range(ns * self.src_tp)]
        self.decodes = [self.spawn_decode(d) for d in range(per_group * self.dst_groups)]
        for ns, group in self.prefills.items():
            self.ports[ns] = [int(c.recv(timeout)["port"]) for c in group]
        for c in self.decodes:
            c.await_ready(timeout)

    def connect(self, topo: Topology, timeout: float = 60.0, ranks: Sequence[int] | None = None,
                **options: Any) -> list[Reply]:
        """Register decode ranks (all by default) with their prefill ranks for ``topo``."""
        ranks = list(range(len(self.decodes))) if ranks is None else list(ranks)
        for d in ranks:
            targets = [f"127.0.0.1:{self.ports[topo.src_dcp][s]}" for s in topo.sources_of(d % topo.dst_ranks)]
            self.decodes[d].send("connect", targets=targets, token=self.token, **options)
        replies = [self.decodes[d].recv(timeout) for d in ranks]
        for d, r in zip(ranks, replies, strict=True):
            self.peer_ids[d] = list(r["peers"])
        self.topology = topo
        return replies

    def begin(self, tokens: int, prefix: int, *, corrupt: bool = False, timeout: float = 60.0,
              decodes: Sequence[int] | None = None, room: int | None = None, generation: int = 0,
              dst_offset: int = 0, slot: int = 0) -> Flight:
        """Lay out a request, write its source rows and submit the destination on each decode rank."""
        topo = self.topology
        assert topo is not None, "connect() first"
        g = self.geo
        if room is None:
            self._room += 1
            room = self._room
        n = tokens - prefix
        vs = g.page_size * topo.src_dcp
        vd = g.page_size * self.dst_dcp
        # Chunks of whole virtual pages, a quarter of the request each (at most 4096 tokens); the last takes the rest.
        size = min(max(vs, math.ceil(math.ceil(n / 4) / vs) * vs), max(4096, vs))
        f = Flight(room=room, tokens=tokens, prefix=prefix, vs=vs,
                   bounds=[(a, min(a + size, n)) for a in range(0, n, size)] or [(0, 0)],
                   src_pages=data.page_list(1 + slot * g.slot_pages(topo.src_dcp), max(1, math.ceil(n / vs)),
                                            scramble=True),
                   decodes=list(range(topo.dst_ranks) if decodes is None else decodes),
                   sources=self.prefills[topo.src_dcp], slot=1 + room % (self.slots - 1))
        pre_pages = list(range(0, math.ceil(prefix / vd)))
        dst_pages = data.page_list(len(pre_pages) + 1 + dst_offset, max(1, math.ceil(n / vd)), scramble=True)
        for i, c in enumerate(f.sources):
            c.send("prepare", room=room, prefix=prefix, total=tokens, pages=f.src_pages,
                   corrupt=corrupt and i == 0, slot=f.slot)
        for c in f.sources:
            c.recv(timeout)
        for d in f.decodes:
            self.decodes[d].send("request", room=room, prefix=prefix, total=tokens,
                                 prefix_pages=pre_pages, dst_pages=dst_pages, generation=generation)
        for d in f.decodes:
            self.decodes[d].recv(timeout)
        f.t0 = time.monotonic()
        return f

    def send_chunks(self, f: Flight, upto: int | None = None, *, timeout: float = 60.0,
                    progress: Any = None) -> None:
        """Report the flight's next chunks to every prefill rank (all remaining by default)."""
        end = len(f.bounds) if upto is None else min(upto, len(f.bounds))
        while f.sent < end:
            k = f.sent
            a, b = f.bounds[k]
            pages = f.src_pages[a // f.vs: math.ceil(b / f.vs)] if b > a else []
            for c in f.sources:
                c.send("chunk", room=f.room, pages=pages, num_tokens=b - a, last=k == len(f.bounds) - 1,
                       slot=f.slot)
            for c in f.sources:
                c.recv(timeout)
            f.sent += 1
            if progress is not None:
                progress(f.sent, len(f.bounds))

    def finish(self, f: Flight, *, timeout: float = 120.0, check: bool = True,
               skip: Sequence[int] = ()) -> RequestResult:
        """Wait for the flight on its decode ranks (except ``skip``), check bytes, release the room."""
        self.finish_start(f, timeout=timeout, check=check, skip=skip)
        return self.finish_collect(f, timeout=timeout)

    def finish_start(self, f: Flight, *, timeout: float = 120.0, check: bool = True,
                     skip: Sequence[int] = ()) -> None:
        """Ask the flight's decode ranks to wait and check, without blocking here."""
        f.waiting = [d for d in f.decodes if d not in skip]
        for d in f.waiting:
            self.decodes[d].send("wait", room=f.room, timeout=timeout, check=check)

    def finish_collect(self, f: Flight, *, timeout: float = 120.0) -> RequestResult:
        """Collect what ``finish_start`` asked for and release the room on the prefill."""
        replies = [self.decodes[d].recv(timeout + 30) for d in f.waiting]
        for c in f.sources:
            c.send("release", room=f.room)
        for c in f.sources:
            c.recv(timeout)
        res = RequestResult(f.room, f.tokens, f.prefix, len(f.bounds), all(r["ok"] for r in replies))
        for key in ("bytes", "descriptors", "aux_bytes", "state_bytes", "aux_descriptors", "state_descriptors",
                    "checked"):
            setattr(res, key, sum(int(r[key]) for r in replies))
        for r in replies:
            res.failures += r["failures"]
            if r.get("failure_code"):
                res.failure_codes.append(r["failure_code"])
            if r["mismatch"]:
                res.mismatches.append(r["mismatch"])
        res.seconds = max((float(r["done_at"]) for r in replies), default=f.t0) - f.t0
        return res

    def run_request(self, tokens: int, prefix: int, *, corrupt: bool = False, timeout: float = 120.0,
                    progress: Any = None) -> RequestResult:
        """Run one request end to end over the connected topology and check every decode byte."""
        f = self.begin(tokens, prefix, corrupt=corrupt, timeout=timeout)
        self.send_chunks(f, timeout=timeout, progress=progress)
        return self.finish(f, timeout=timeout)

    def close(self) -> None:
        """Stop every process (quit, then kill the process group): the decodes, then the prefills,
        each side's processes exiting at once."""
        close_all(self.decodes)
        close_all(c for g in self.prefills.values() for c in g)
