"""``pdproto serve``: the prefill-side handshake service over a synthetic KV pool.

The pool and its chunks come from ``pdproto_demo.synthetic``, imported when the command runs.

Prints one JSON line ``{"event": "listening", "port": ..., "metrics_port": ...}`` on
stdout once it accepts calls (tests and scripts read the bound port from it), and
exits 0 after a graceful SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import stat
import sys
from pathlib import Path

from pdproto import backends
from pdproto.errors import ConfigError, PdprotoError
from pdproto.rpc import ChannelConfig
from pdproto.transfer import INLINE_BYTES, create_executor

from .app import RunningServer, ServerConfig, serve
from .core import HandshakeCore
from .engine import PrefillEngine
from .metrics import ServiceMetrics, serve_metrics
from .registry import Limits


def _rate(text: str) -> float:
    """A non-negative number of an argparse flag."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``serve`` flags."""
    net = parser.add_argument_group("network")
    net.add_argument("--listen", default="127.0.0.1:50051", help="host:port (port 0 picks one)")
    net.add_argument("--token-file", type=Path,
                     help="file holding the deployment's token (callers prove it, never send it)")
    net.add_argument("--operator-token-file", type=Path,
                     help="file holding a second token, for Describe (pdproto status) and GetServerInfo only: "
                          "it shows every peer's room ids and engine identity, which the --token-file token "
                          "shows a peer only for itself")
    net.add_argument("--allow-unauthenticated", action="store_true",
                     help="serve a non-loopback address without a token (trusted networks only)")
    net.add_argument("--tls-cert", type=Path, help="PEM server certificate chain")
    net.add_argument("--tls-key", type=Path, help="PEM server private key")
    net.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 picks one)")
    net.add_argument("--grace", type=float, default=10.0, help="drain seconds after SIGTERM")
    net.add_argument("--max-message-bytes", type=int, default=4 << 20)
    net.add_argument("--keepalive-ms", type=int, default=30_000)
    net.add_argument("--legacy-port", type=int, default=None, metavar="PORT",
                     help="also serve unmodified SGLang 0.5.23 decodes (--backend's frames) on this ZMQ port of "
                          "the --listen host (0 picks one; unauthenticated: docs/security.md); default: off")
    lim = parser.add_argument_group("limits")
    lim.add_argument("--max-peers", type=int, default=256,
                     help="decode peers held at once (gone ones count until released); one engine thread each")
    lim.add_argument("--max-inflight", type=int, default=1024, help="open requests per peer")
    lim.add_argument("--max-finished", type=int, default=4096,
                     help="final statuses kept per peer for late queries (oldest dropped first)")
    lim.add_argument("--max-streams", type=int, default=8,
                     help="open status streams per peer (WatchStatus and Session)")
    lim.add_argument("--snapshot-rate", type=_rate, default=1.0,
                     help="full status snapshots per second a peer's new streams may be sent (four at once); "
                          "0: no limit")
    lim.add_argument("--call-rate", type=_rate, default=1000.0,
                     help="calls per second one peer's credential may make (two seconds' worth at once); "
                          "0: no limit")
    lim.add_argument("--match-timeout", type=float, default=30.0,
                     help="seconds a request waits for the next chunk")
    lim.add_argument("--engine-timeout", type=float, default=30.0,
                     help="seconds one engine call may take before its peer is written off")
    lim.add_argument("--keep-finished", type=float, default=60.0,
                     help="seconds final statuses and gone peers stay queryable")
    kv = parser.add_argument_group("synthetic KV source")
    kv.add_argument("--backend", choices=backends.NAMES, default="local")
    kv.add_argument("--advertise-host", default=None,
                    help="address the transfer engine advertises, and a name the handshake service proves its "
                         "token for (default: PDPROTO_ADVERTISE_HOST, else a routable address of this host)")
    kv.add_argument("--staging-bytes", type=int, default=64 << 20,
                    help="packing region of mooncake/nixl executors (0 disables packing)")
    kv.add_argument("--inline-bytes", default=str(INLINE_BYTES), metavar="N",
                    help=f"mooncake/nixl: chunks of at most N bytes are packed inline and sent as one engine "
                         f"call, larger ones pipelined (default {INLINE_BYTES}; 0 always pipelines)")
    kv.add_argument("--layers", type=int, default=4)
    kv.add_argument("--row-bytes", type=int, default=1152, help="bytes per token per layer")
    kv.add_argument("--pages", type=int, default=256)
    kv.add_argument("--page-size", type=int, default=16)
    kv.add_argument("--attention", choices=("mla", "mha", "hybrid-mla"), default="mla")
    kv.add_argument("--kv-dtype", default="bfloat16")
    kv.add_argument("--model-id", default="synthetic")
    kv.add_argument("--prompt-tokens", type=int, default=200, help="tokens every room produces")
    kv.add_argument("--chunk-tokens", type=int, default=64)
    kv.add_argument("--chunk-delay-ms", type=float, default=0.0, help="delay between chunks")
    parser.add_argument("--log-level", default="WARNING")


def _read_file(path: Path, flag: str) -> bytes:
    """A regular file's bytes, or CONFIG_INVALID saying why it cannot be used."""
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{flag} {path} is a directory, not a file", metadata={"setting": flag})
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{flag} {path} is not a regular file", metadata={"setting": flag})
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: no such file", metadata={"setting": flag}) from None
    except PermissionError:
        raise ConfigError(f"{flag} {path}: permission denied; the service's user must be able to read it",
                          metadata={"setting": flag}) from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})", metadata={"setting": flag}) from None


def _token(path: Path, flag: str = "--token-file") -> str:
    """The token in ``path``: one word of printable ASCII; warns when others may read the file."""
    raw = _read_file(path, flag)
    token = raw.decode("ascii", errors="replace").strip()
    if not token:
        raise ConfigError(f"{flag} {path} is empty: an empty token would turn authentication off; "
                          "write the token into it", metadata={"setting": flag})
    if not all(c.isascii() and c.isprintable() and not c.isspace() for c in token):
        raise ConfigError(f"{flag} {path} must hold one token of printable ASCII without spaces",
                          metadata={"setting": flag})
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        who = "everyone" if mode & stat.S_IROTH else "its group"
        print(f"pdproto serve: warning: {flag} {path} is readable by {who} (mode {stat.S_IMODE(mode):o}); "
              f"run chmod 600 {path}", file=sys.stderr, flush=True)
    return token


def _config(args: argparse.Namespace) -> ServerConfig:
    """Server settings from the flags; CONFIG_INVALID for any setting that would weaken security."""
    if (args.tls_cert is None) != (args.tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if args.tls_key is None else ("--tls-key", "--tls-cert")
        raise ConfigError(f"{given} without {missing}: TLS needs both, and with one the server would serve "
                          "plaintext; pass both", metadata={"setting": missing})
    token = _token(args.token_file) if args.token_file else None
    operator = _token(args.operator_token_file, "--operator-token-file") if args.operator_token_file else None
    if operator is not None and operator == token:
        raise ConfigError("--operator-token-file holds the --token-file token: every decode could then read "
                          "every peer's room ids; give the operator a token of its own",
                          metadata={"setting": "--operator-token-file"})
    return ServerConfig(
        listen=args.listen, token=token, operator_token=operator, allow_unauthenticated=args.allow_unauthenticated,
        tls_cert=_read_file(args.tls_cert, "--tls-cert") if args.tls_cert else None,
        tls_key=_read_file(args.tls_key, "--tls-key") if args.tls_key else None,
        channel=ChannelConfig(max_message_bytes=args.max_message_bytes, keepalive_time_ms=args.keepalive_ms,
                              min_ping_interval_ms=min(10_000, args.keepalive_ms)),
        advertise_host=args.advertise_host, grace=args.grace, legacy_listen=None if args.legacy_port is None else
        f"{args.listen.rpartition(':')[0]}:{args.legacy_port}", legacy_serve=args.legacy_port is not None)


def _inline_bytes(value: str) -> int:
    """``--inline-bytes`` as a byte count; CONFIG_INVALID unless it is a non-negative integer."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"--inline-bytes {value!r} must be a non-negative integer (bytes; 0 always pipelines)",
                          metadata={"setting": "--inline-bytes"})
    return n


async def _main(args: argparse.Namespace, config: ServerConfig) -> int:
    from pdproto_demo.synthetic import SyntheticProducer, SyntheticSpec, build_source

    spec = SyntheticSpec(layers=args.layers, row_bytes=args.row_bytes, pages=args.pages,
                         page_size=args.page_size, prompt_tokens=args.prompt_tokens,
                         chunk_tokens=args.chunk_tokens, chunk_delay=args.chunk_delay_ms / 1000.0,
                         backend=args.backend, attention=args.attention, kv_cache_dtype=args.kv_dtype,
                         model_id=args.model_id)
    inline_bytes = _inline_bytes(args.inline_bytes)
    # The local backend's arena holds only what this process advertises as a destination (nothing).
    # The executor's workers bound each engine call (a chunk's transfer, a connect) by --engine-timeout,
    # and a new Mooncake session's probe by half of it, so its own error (naming the handshake) comes first.
    executor = create_executor(args.backend, arena_bytes=1 << 20, staging_bytes=args.staging_bytes,
                               inline_bytes=inline_bytes,
                               transfer_timeout_s=args.engine_timeout, host=args.advertise_host,
                               connect_timeout_s=max(1.0, args.engine_timeout / 2))
    try:
        engine = PrefillEngine(build_source(spec, executor), executor)
        metrics = ServiceMetrics()
        metrics_port = serve_metrics(metrics, args.metrics_port) if args.metrics_port is not None else None
        core = HandshakeCore(engine, metrics=metrics, limits=Limits(
            max_peers=args.max_peers, max_inflight_per_peer=args.max_inflight,
            max_finished_per_peer=args.max_finished, max_streams_per_peer=args.max_streams,
            match_timeout=args.match_timeout,
            keep_finished=args.keep_finished, drain_timeout=args.grace, snapshot_rate=args.snapshot_rate,
            call_rate=args.call_rate))
        producer = SyntheticProducer(engine, spec)

        def ready(running: RunningServer) -> None:
            _collect_less()
            legacy = running.legacy.port if running.legacy is not None else None
            print(json.dumps({"event": "listening", "port": running.port, "metrics_port": metrics_port,
                              "legacy_port": legacy}), flush=True)

        try:
            return await serve(core, config, ready)
        finally:
            await producer.close()
    finally:
        executor.close()


GC_YOUNG = 20_000
"""Allocations between young-generation collections in ``pdproto serve`` (CPython's default: 700)."""


def _collect_less() -> None:
    """Leave start-up's objects out of every later collection, and collect the young generation less often.

    Every request allocates a few container objects that outlive it (statuses kept for
    ``--keep-finished``), so CPython's defaults collect every few hundred requests, walking a
    heap that grows with what is kept (what it saved: docs/perf-log.md, "Garbage collection").
    Embedders own their process's collector; this is ours.
    """
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 20, 20)


def run(args: argparse.Namespace) -> int:
    """Run the service until SIGTERM; 0 on a clean shutdown, 2 on a configuration error."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_main(args, _config(args)))
    except PdprotoError as exc:
        print(f"pdproto serve: {exc}", file=sys.stderr)
        return 2


__all__ = ["add_arguments", "run"]
