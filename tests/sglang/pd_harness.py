"""SGLang 0.5.23's PD transfer, end to end on CPU: prefill and decode ranks in separate processes.

Each rank runs SGLang's real objects: ServerArgs parsed and resolved by SGLang, published
(``runtime_context.publish``), its process groups and shared Mooncake engine built by
``init_parallel_runtime``, the model's pools (``tests/sglang/_models.py``: an MLA pool, or a
Kimi-Linear-shaped hybrid pool with its Mamba state), ``MetadataBuffers``, the bootstrap
server (``start_disagg_service``) and the backend's manager, sender and receiver from
``get_kv_class``. What the scheduler does around them (allocating pages, the forward pass,
its queues) is replaced by the calls ``disaggregation/prefill.py`` and
``disaggregation/decode.py`` make, in their order; each cites the line it mirrors (paths
under ``sglang/srt/`` of the 0.5.23 wheel).

Topologies: one dense prefill rank to one decode rank, or to a decode DCP group of N
ranks (``--dcp N``: decode TP = DCP = N, so one prefill rank feeds N decode ranks, each
its own token shard and, for the hybrid, its TP share of the state), or (``run(kv_shard=True)``)
two prefill TP ranks with SGLang's KV cache sharding, each holding every other page, to a
decode of TP 2 without DCP whose every rank asks both prefill ranks for every token, or
(``run(cp_split=True)``, the Kimi-Linear hybrid) two prefill CP ranks (``--attn-cp-size 2``,
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on both sides) to a decode of TP 1: SGLang's
sender cuts each chunk to the rank's contiguous share of the pages, CP rank 0 alone sends the
state and aux, and each rank holds other bytes where it must not send. The Kimi-Linear hybrid also runs
with a plain TP prefill (``run(prefill_tp=2)``: both ranks hold the MLA KV, each its half of the KDA state
heads) into a decode of TP 1, which SGLang's pairing makes ask both, or from one prefill rank into a decode of
TP 2 without DCP (``run(dcp=2, decode_tp_only=True)``: every decode rank holds every token's KV and its half
of the state heads). Every decode rank compares its whole KV pool, every aux buffer and every
state tensor with what it must hold (the prefill's bytes where they belong, zeros elsewhere); both sides regenerate the
prefill's bytes from one seed.

``--kill`` adds a last request during which the driver kills every decode rank: the
prefill's sender must turn Failed and ``failure_exception()`` must name the reason.
``--kill-prefill`` kills the prefill instead, after the request's first chunk was sent: every
decode rank's receiver must turn Failed with a reason, within the timeout.
``--prefill-backend`` and ``--decode-backend`` run the two sides on different backends (each
defaults to ``--backend``): a pdproto decode pulling from SGLang's own Mooncake prefill.
``--again`` then runs SGLang's heartbeat-loss handler on every decode rank (the prefill
alive) and one more request, which must register anew and land byte-exact.
``--bench TOKENS`` runs one request of that many tokens and reports the prefill's
first-send-to-Success time (GB/s over the rows that had to move).

    python -m tests.sglang.pd_harness                         # mooncake_tcp, MLA, 1 -> 1
    python -m tests.sglang.pd_harness --dcp 4                  # dense -> DCP 4 (5 processes)
    python -m tests.sglang.pd_harness --backend pdproto --dcp 4
    python -m tests.sglang.pd_harness --backend pdproto --model kimi --dcp 2 --kill
    python -m tests.sglang.pd_harness --backend pdproto --dcp 4 --bench 32768
    python -m tests.sglang.pd_harness --prefill-backend mooncake_tcp --decode-backend pdproto --dcp 4
    python -m tests.sglang.pd_harness --prefill-backend pdproto --decode-backend mooncake_tcp --dcp 4
    python -m tests.sglang.pd_harness --backend pdproto --model kimi --prefill-tp 2       # fan-in
    python -m tests.sglang.pd_harness --backend pdproto --model kimi --dcp 2 --tp-only    # head slicing

``tests/sglang/test_harness.py`` runs SGLang's Mooncake 1 -> 1 and the pdproto cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdproto_demo.cluster import free_port
from tests.sglang._models import DSV4, LAYERS, PAGE, ROW_BYTES, SEED, page_of, write_config
from tests.sglang._zygote import command

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.005
FAILED, WAITING, TRANSFERRING, SUCCESS = 0, 2, 3, 4  # KVPoll (disaggregation/base/conn.py:123-128)


@dataclass(frozen=True)
class Request:
    """One request: room, prompt length, decode prefix (tokens) and prefill chunk size."""

    room: int
    tokens: int
    decode_prefix: int = 0  # a multiple of the decode's (virtual) page
    chunk: int = 0  # 0: one send; else chunked prefill of this many tokens
    abort: str = ""  # "decode" or "prefill": that side aborts the request once it is bootstrapped
    decode: int = 0  # the decode server that asks for it (Spec.instances)


REQUESTS = (
    Request(room=101, tokens=300, chunk=128),  # chunked, last page partial
    Request(room=102, tokens=64),  # exactly one page
    Request(room=103, tokens=1000, decode_prefix=256, chunk=256),  # decode holds a prefix
    Request(room=104, tokens=5),  # shorter than a page
)
DSV4_REQUESTS = (
    Request(room=101, tokens=600, chunk=256),  # chunked, last page partial; C128 block pending
    Request(room=102, tokens=7),  # shorter than a page
    Request(room=103, tokens=1000, decode_prefix=256, chunk=256),  # the decode holds a page
    Request(room=104, tokens=512),  # whole pages, on a C128 block boundary: both sides pass no c128_state index
)
"""DeepSeek-V4's requests (256-token pages, a 128-token window); ``python -m tests.sglang.pd_harness --model dsv4``
runs them, as REQUESTS chunk below a page."""
ABORTS = (
    Request(room=105, tokens=200, abort="decode"),  # the decode aborts it after sending its metadata
    Request(room=106, tokens=150, abort="prefill"),  # the prefill aborts it before computing it
)
KILL = Request(room=999, tokens=1536, chunk=1024)
"""The request a ``--kill`` run kills its decode ranks in: after the first chunk moved."""
AGAIN = Request(room=998, tokens=320, chunk=128)
"""The request an ``--again`` run sends after SGLang's heartbeat lost the prefill: it reaches it again."""
DROPPED = Request(room=997, tokens=192)
"""The request an ``--again`` run has in flight when SGLang's heartbeat loses the prefill: it fails on
both sides, and the decode releases its pages only once the prefill has stopped it."""


LEGACY = {"PDPROTO_LEGACY": "1"}
"""The environment that makes a pdproto prefill serve SGLang's own decodes on its rank port."""


def hostile_frames() -> tuple[list[bytes], ...]:
    """Raw frames any process reaching a rank port can push; a pdproto prefill refuses each, harming nothing."""
    from pdproto.legacy import mooncake
    from pdproto.negotiation.topology import example_registration
    from pdproto.v1 import BACKEND_MOONCAKE

    return (
        [b"garbage"],  # no message
        [b"None", b"127.0.0.1"],  # a registration cut short
        [b"ABORT", b"not-a-room"],
        [b"\xff" * 8] * 9,  # TransferInfo-shaped, no integer in it
        [b"WATERMARK", b"1", b"2", b"s"],  # staging traffic the prefill does not serve
        # Well-formed, but not this prefill's model (one KV entry): refused by negotiation.
        mooncake.build_registration(example_registration(backend=BACKEND_MOONCAKE, num_layers=1)),
    )


HOSTILE_REFUSALS = {"unknown LEGACY_UNKNOWN_KIND": 1, "registration LEGACY_FRAME_COUNT": 1,
                    "abort LEGACY_BAD_INTEGER": 1, "transfer_info LEGACY_BAD_INTEGER": 1,
                    "watermark LEGACY_UNKNOWN_KIND": 1, "registration TOPOLOGY_LAYER_METADATA_ONE_SIDED": 1}
"""What the prefill's legacy listener counts for ``hostile_frames()`` ("kind outcome" -> messages)."""


@dataclass(frozen=True)
class Spec:
    """What every rank of one run agrees on: model, requests, pool size."""

    model: str = "mla"
    requests: tuple[Request, ...] = REQUESTS
    kill: bool = False
    shared_engine: bool = False
    """Start SGLang's shared Mooncake engine in every rank first, as HiCache's Mooncake store does."""
    again: bool = False
    """After the requests, the decode's heartbeat loses the prefill (SGLang forgets its ranks) while
    ``DROPPED`` is in flight, then one more request (``AGAIN``) reaches it again."""
    kill_prefill: bool = False
    """A last request (``KILL``) during which the driver kills the prefill."""
    extra_pages: int = 8
    instances: int = 1
    """Decode servers, each its own DCP group and maybe its own backend (``Request.decode`` picks one)."""
    kv_shard: bool = False
    """Two prefill TP ranks with SGLang's KV cache sharding (logical page l on rank l % 2 as local page
    l // 2), into a decode of TP 2 without DCP: every decode rank asks both prefill ranks for every token."""
    cp_split: bool = False
    """Two prefill CP ranks (``--tp-size 2 --attn-cp-size 2``) whose every rank sends its contiguous share of
    each request's pages, CP rank 0 alone the state and aux (Kimi Linear), into a decode of TP 1."""
    prefill_tp: int = 1
    """Plain TP prefill ranks (``--tp-size``): each holds the replicated MLA KV and the aux row, and a hybrid's
    state heads are split over them (each rank holds its share of the TP-1 prefill's state)."""
    decode_tp_only: bool = False
    """The decode's ranks are TP without DCP (``--tp-size N``): each holds every token's KV and its TP share of
    a hybrid's state, as the decode of ``kv_shard`` does."""
    dump: str = ""
    """A decode rank fed by a vLLM prefill (tests/vllm/test_cross_engine.py) writes its KV pool and metadata
    buffers here for that driver to check, and builds the metadata buffers SGLang builds without speculative
    decoding (the ones a vLLM prefill writes)."""

    def mine(self, instance: int) -> list[Request]:
        """The requests of decode server ``instance``."""
        return [r for r in self.requests if r.decode == instance]

    def all_requests(self) -> list[Request]:
        killed = [KILL] if self.kill or self.kill_prefill else []
        return [*self.requests, *([DROPPED, AGAIN] if self.again else []), *killed]

    @property
    def prefill_ranks(self) -> int:
        """Prefill processes: two TP ranks with KV cache sharding, two CP ranks, else ``prefill_tp``."""
        return 2 if self.kv_shard or self.cp_split else self.prefill_tp

    @property
    def decode_dcp(self) -> bool:
        """Whether the decode's TP ranks are its DCP group (else TP without DCP: ``kv_shard``, ``decode_tp_only``)."""
        return not (self.kv_shard or self.decode_tp_only)

    @property
    def page(self) -> int:
        """Tokens per (physical) page of the model's pools."""
        return page_of(self.model)

    @property
    def pool_pages(self) -> int:
        """Usable pages per pool (page 0 is the pool's padding page): every request fits."""
        return sum(-(-r.tokens // self.page) for r in self.all_requests()) + self.extra_pages

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "requests": [asdict(r) for r in self.requests]})

    @classmethod
    def from_json(cls, text: str) -> Spec:
        raw = json.loads(text)
        return cls(**{**raw, "requests": tuple(Request(**r) for r in raw["requests"])})


# --------------------------------------------------------------------- layout (pure)


def _pages(requests: list[Request], tokens_per_page: int, seed: int, pool_pages: int) -> dict[int, list[int]]:
    """Disjoint, shuffled page ids per request, never page 0 (the padding page)."""
    import random

    free = list(range(1, pool_pages + 1))
    random.Random(seed).shuffle(free)
    out = {}
    for req in requests:
        n = -(-req.tokens // tokens_per_page)
        out[req.room], free = free[:n], free[n:]
    return out


def prefill_pages(spec: Spec) -> dict[int, list[int]]:
    """The prefill's req_to_token, page by page: ``spec.page`` tokens per page."""
    return _pages(spec.all_requests(), spec.page, SEED, spec.pool_pages)


def decode_pages(spec: Spec, dcp: int) -> dict[int, list[int]]:
    """The decode's pages: virtual pages of ``spec.page * dcp`` tokens, the same ids on every DCP rank
    (mem_cache/kv_cache_builder.py:393-400; each rank's physical page k holds its shard)."""
    return _pages(spec.all_requests(), spec.page * dcp, SEED + 1, spec.pool_pages)


def state_slots(spec: Spec) -> dict[int, tuple[int, int]]:
    """room -> (prefill Mamba slot, decode Mamba slot); different on the two sides, never slot 0."""
    rooms = [r.room for r in spec.all_requests()]
    return {room: (1 + i, len(rooms) - i) for i, room in enumerate(rooms)}


def expected_rows(req: Request, src: list[int], dst: list[int], dcp: int, rank: int,
                  whole_pages: bool = False, page: int = PAGE) -> list[tuple[int, int]]:
    """(prefill row, decode row) pairs one decode rank must receive for ``req``.

    SGLang's Mooncake backend without DCP moves whole pages, a partial last page included
    (mooncake/conn.py send_kvcache: ``whole_pages``). Otherwise token p goes to rank p % dcp
    at local position p // dcp (common/utils.py:139-198), and only those rows move.
    """
    if whole_pages and dcp == 1:
        return [
            (s * page + i, d * page + i)
            for s, d in zip(src[req.decode_prefix // page :], dst[req.decode_prefix // page :])
            for i in range(page)
        ]
    return [
        (src[p // page] * page + p % page, dst[p // (page * dcp)] * page + (p // dcp) % page)
        for p in range(req.decode_prefix, req.tokens)
        if p % dcp == rank
    ]


# --------------------------------------------------------------------- driver


class _Lines:
    """A rank's stdout, read on a thread: the JSON lines it prints, in order."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ended = False
        """The rank's stdout closed: every later ``next`` answers None at once, not after its timeout."""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def next(self, timeout: float) -> Any:
        """The next JSON line, or None if none comes in time (or the rank exited)."""
        if self._ended:
            return None
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            self._ended = True
            return None
        return json.loads(line)


def run(
    backend: str,
    requests: tuple[Request, ...] = REQUESTS,
    *,
    model: str = "mla",
    dcp: int = 1,
    kill: bool = False,
    shared_engine: bool = False,
    again: bool = False,
    kill_prefill: bool = False,
    prefill_backend: str | None = None,
    decode_backend: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    decodes: tuple[tuple[str, int], ...] = (),
    hostile: tuple[list[bytes], ...] = (),
    kv_shard: bool = False,
    cp_split: bool = False,
    prefill_tp: int = 1,
    decode_tp_only: bool = False,
) -> dict[str, Any]:
    """Run the prefill ranks (``Spec.prefill_ranks``) and ``dcp`` decode ranks for ``backend`` (or one backend
    per side); return their reports.

    ``prefill_tp`` > 1 runs that many plain TP prefill ranks; ``decode_tp_only`` makes the ``dcp`` decode ranks
    TP without DCP (``Spec``).

    ``decodes`` gives the decode side a backend of its own: one decode server per (backend, DCP
    size), each asking for the requests whose ``Request.decode`` is its index (the prefill stays on
    ``backend``; ``dcp`` is then unused). ``hostile`` frames are pushed to the prefill rank's
    ``rank_port`` (the bootstrap record's, which SGLang's own decodes dial) before any request; the
    prefill reports what its legacy listener made of every message (``prefill["legacy"]``).

    Keys: ``prefill`` (its results and seconds, or None; ``prefills``: every prefill rank's), ``up``
    (each decode rank's start-up line), ``decode`` (one report per rank, None where a rank printed
    none), ``kill`` (the prefill's view of the ``--kill`` request), ``again`` and ``again_decode`` (the
    prefill's and every decode rank's view of the ``--again`` request), ``killed`` (every decode rank's
    view of the ``--kill-prefill`` request), ``prefill_rc`` (``prefill_rcs``: every prefill rank's),
    ``decode_rc`` (list) and the tail of every stderr.
    """
    prefill_backend = prefill_backend or backend
    decodes = decodes or ((decode_backend or backend, dcp),)
    spec = Spec(model, tuple(requests), kill, shared_engine, again, kill_prefill, instances=len(decodes),
                kv_shard=kv_shard, cp_split=cp_split, prefill_tp=prefill_tp, decode_tp_only=decode_tp_only)
    dcp = sum(d for _, d in decodes)
    env_overrides = env
    env = dict(
        os.environ,
        MOONCAKE_PROTOCOL="tcp",  # no RDMA device here (mooncake_transfer_engine.py:209)
        SGLANG_HOST_IP="127.0.0.1",  # every rank on loopback (utils/network.py:417)
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(int(timeout)),
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(int(timeout)),
        # SGLang's decode gives up on a prefill after two /health calls that took over 3 s
        # (common/conn.py:2004-2034); a loaded two-core host can starve the prefill that long,
        # and a spurious node failure fails every room in flight. ``--again`` runs the
        # handler itself.
        SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="1000",
        # CPU ranks beyond the NUMA node count must be told where their threads go
        # (utils/numa_utils.py:459-496); this only matters on AMX or arm64 hosts.
        SGLANG_CPU_OMP_THREADS_BIND="|".join([f"0-{(os.cpu_count() or 1) - 1}"] * max(dcp, spec.prefill_ranks)),
    )
    if cp_split:
        # SGLang makes a Kimi Linear prefill's every CP rank send without it (common/conn.py:373-391);
        # set on both sides, as docs/sglang.md asks of a deployment.
        env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    env.update(env_overrides or {})  # the caller's settings win, these defaults included
    cmd = command("-m", "tests.sglang.pd_harness")
    out: dict[str, Any] = {"prefill": None, "decode": [None] * dcp, "kill": None}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        common = [
            "--prefill-backend", prefill_backend, "--timeout", str(timeout),
            "--model-dir", str(write_config(model, Path(tmp) / model)),
            "--bootstrap-port", str(free_port()), "--spec", spec.to_json(),
        ]  # fmt: skip

        def spawn(role: str, name: str, *extra: str) -> subprocess.Popen[str]:
            err = stack.enter_context((Path(tmp) / f"{name}.err").open("w"))
            proc = subprocess.Popen(
                cmd + ["--role", role, *extra] + common, env=env, text=True, cwd=REPO,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
            stack.callback(_stop, proc)
            return proc

        prefill_dist_port = str(free_port())
        prefills = [spawn("prefill", f"prefill{r or ''}", "--dist-port", prefill_dist_port,
                          "--backend", prefill_backend, "--rank", str(r)) for r in range(spec.prefill_ranks)]
        prefill = prefills[0]
        prefill_lines = [_Lines(p) for p in prefills]
        lines = prefill_lines[0]
        procs: list[subprocess.Popen[str]] = []
        names: list[str] = []
        readies = [p.next(timeout * 2) for p in prefill_lines]  # {"ready": true, ...}
        out["ready"] = readies[0] if all(readies) else None
        if out["ready"]:
            for k, (side, size) in enumerate(decodes):
                dist_port = str(free_port())
                for r in range(size):
                    names.append(f"decode{len(names)}")
                    procs.append(spawn("decode", names[-1], "--dist-port", dist_port, "--rank", str(r),
                                       "--backend", side, "--decode-backend", side, "--dcp", str(size),
                                       "--instance", str(k)))
            decode_lines = [_Lines(d) for d in procs]
            out["up"] = [d.next(timeout * 3) for d in decode_lines]  # {"up": rank}
            if hostile:
                _push_frames(out["ready"]["rank_port"], hostile)
            for p in prefills:
                _say(p, "go")
            out["decode"] = [d.next(timeout * 2) for d in decode_lines]
            out["prefills"] = [p.next(timeout) for p in prefill_lines]
            out["prefill"] = out["prefills"][0]
            if again:
                out["again_decode"] = [(d.next(timeout * 2) or {}).get("again") for d in decode_lines]
                again_line = lines.next(timeout) or {}
                out["dropped"], out["again"] = again_line.get("dropped"), again_line.get("again")
            if kill or kill_prefill:
                out["submitted"] = [d.next(timeout) for d in decode_lines]
                out["transferring"] = lines.next(timeout)
            if kill:
                for d in procs:  # the decode server dies mid-transfer
                    d.send_signal(signal.SIGKILL)
                    d.wait()
                _say(prefill, "go")
                out["kill"] = (lines.next(timeout * 2) or {}).get("kill")
            elif kill_prefill:
                prefill.send_signal(signal.SIGKILL)  # the prefill server dies mid-transfer
                prefill.wait()
                for d in procs:
                    _say(d, "go")
                out["killed"] = [(d.next(timeout * 2) or {}).get("killed") for d in decode_lines]
        _stop(*prefills, quit_first=True)
        _stop(*procs, quit_first=True)  # together: each takes seconds to exit (torch unloads)
        out["prefill_rc"] = prefill.returncode
        out["prefill_rcs"] = [p.returncode for p in prefills]
        out["decode_rc"] = [d.returncode for d in procs]
        out["prefill_stderr"] = "".join((Path(tmp) / f"prefill{r or ''}.err").read_text()[-3000:]
                                        for r in range(len(prefills)))
        out["decode_stderr"] = [(Path(tmp) / f"{name}.err").read_text()[-3000:] for name in names]
    return out


def _push_frames(port: int, messages: tuple[list[bytes], ...]) -> None:
    """Push raw multipart messages to a ZMQ PULL port on loopback, as any process that reaches it can."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frames in messages:
        sock.send_multipart(frames)
    sock.close()  # lingers until every message left
    ctx.term()


def _say(proc: subprocess.Popen[str], line: str) -> None:
    """One line to a rank's stdin (it reads one where the driver paces it); a rank that died
    is left to the report."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.write(line + "\n")
        proc.stdin.flush()


def _stop(*procs: subprocess.Popen[str], quit_first: bool = False) -> None:
    """End ranks: close their stdin (each exits), else kill them after a grace period; every rank
    is told before any is waited for."""
    running = [p for p in procs if p.poll() is None]
    if quit_first:
        for proc in running:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        end = time.monotonic() + 30
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, end - time.monotonic()))
    for proc in running:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    """``--role`` runs one rank; without it, the driver runs all of them and prints a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"])
    parser.add_argument("--backend", default="mooncake_tcp", help="both sides' backend (a rank: its own)")
    parser.add_argument("--prefill-backend", help="the prefill's backend (default: --backend)")
    parser.add_argument("--decode-backend", help="the decode's backend (default: --backend)")
    parser.add_argument("--instance", type=int, default=0, help="a decode rank's server (Spec.instances)")
    parser.add_argument("--dcp", type=int, default=1, help="decode TP = DCP size")
    parser.add_argument("--tp-only", action="store_true", help="the decode's --dcp ranks are TP without DCP")
    parser.add_argument("--prefill-tp", type=int, default=1, help="plain TP prefill ranks")
    parser.add_argument("--model", choices=sorted(LAYERS), default="mla")
    parser.add_argument("--kill", action="store_true", help="kill the decode ranks during a last request")
    parser.add_argument("--shared-engine", action="store_true", help="start SGLang's shared Mooncake engine first")
    parser.add_argument("--kill-prefill", action="store_true", help="kill the prefill during a last request")
    parser.add_argument("--again", action="store_true",
                        help="the decode's heartbeat loses the prefill, then a last request reaches it again")
    parser.add_argument("--bench", type=int, default=0, help="one request of this many tokens; report GB/s")
    parser.add_argument("--bench-chunk", type=int, default=8192, help="its prefill chunk (tokens)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--model-dir")
    parser.add_argument("--bootstrap-port", type=int)
    parser.add_argument("--dist-port", type=int)
    parser.add_argument("--spec", type=Spec.from_json)
    args = parser.parse_args()
    args.prefill_backend = args.prefill_backend or args.backend
    args.decode_backend = args.decode_backend or args.backend
    if args.role is not None:
        from tests.sglang import _ranks

        (_ranks.run_prefill if args.role == "prefill" else _ranks.run_decode)(args)
        # Nothing is checked after a rank's last line, and the interpreter's final collections
        # (SGLang, torch and transformers loaded: 600k objects) take 8-10 s of CPU per rank here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        requests = (Request(room=1, tokens=args.bench, chunk=args.bench_chunk),) if args.bench else REQUESTS
        if args.model == "kimi" and not args.bench:
            requests = tuple(r for r in REQUESTS if r.decode_prefix == 0)
        if args.model in DSV4 and not args.bench:
            requests = DSV4_REQUESTS
        started = time.monotonic()
        prefill_backend, decode_backend = args.prefill_backend or args.backend, args.decode_backend or args.backend
        report = run(prefill_backend, requests, model=args.model, kill=args.kill,
                     shared_engine=args.shared_engine, again=args.again, kill_prefill=args.kill_prefill,
                     timeout=args.timeout, decodes=((decode_backend, args.dcp),), prefill_tp=args.prefill_tp,
                     decode_tp_only=args.tp_only,
                     env=LEGACY if prefill_backend == "pdproto" != decode_backend else None)
        report["seconds"] = round(time.monotonic() - started, 1)
        if args.bench and report["prefill"]:
            moved = args.bench * LAYERS[args.model] * ROW_BYTES  # every token row lands once
            report["bench"] = {"bytes": moved, "seconds": report["prefill"]["seconds"],
                               "GBps": moved / report["prefill"]["seconds"] / 1e9}
        for key in ("prefill_stderr", "decode_stderr"):
            report.pop(key, None)
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
