"""Assemble and run the gRPC server: servicer, health, reflection, auth, TLS, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as _health_aio
from grpc_reflection.v1alpha import reflection

from pdproto.rpc import ChannelConfig
from pdproto.errors import ConfigError, ShuttingDownError
from pdproto.rpc.loop import LoopThread
from pdproto.v1 import SERVICE_NAME

from .auth import ServedNames, TokenProof, TokenProofInterceptor, require_token_policy
from .core import HandshakeCore
from .legacy import LegacyListener
from .service import HandshakeServicer, add_to_server

log = logging.getLogger("pdproto_server.app")


@dataclass(frozen=True)
class ServerConfig:
    """How the gRPC server listens and stops."""

    listen: str = "127.0.0.1:0"
    """host:port; port 0 picks a free one."""
    token: str | None = None
    """The deployment's token, which callers prove (``Authenticate``) and never send; required when
    ``listen`` is not loopback (unless allow_unauthenticated)."""
    operator_token: str | None = None
    """A second token, for ``GetServerInfo``, ``Describe`` and ``Evict`` only: ``Describe`` shows room ids
    and engine identities to it (to the deployment's token, only a peer's own with its credential)."""
    allow_unauthenticated: bool = False
    """Serve without a token on a non-loopback address (trusted networks only)."""
    tls_cert: bytes | None = None
    """PEM server certificate chain; with tls_key enables TLS."""
    tls_key: bytes | None = None
    """PEM private key."""
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    """Keepalive and message-size options (the client uses the same)."""
    advertise_host: str | None = None
    """A further name the server answers at and proves its token for (a name or address decodes dial),
    beside its listen host or, for a wildcard, every interface address; default
    ``PDPROTO_ADVERTISE_HOST``."""
    grace: float = 10.0
    """Seconds in-flight work may take to finish after SIGTERM."""
    legacy_listen: str | None = None
    """host:port of the legacy listener for SGLang 0.5.23's Mooncake decodes (port 0 picks one); None: none."""
    legacy_serve: bool = False
    """The legacy listener serves those decodes; off, it answers each of their requests Failed, naming the
    setting (``pdproto_server/legacy.py``)."""


@dataclass
class RunningServer:
    """A started server and the pieces shutdown needs."""

    server: grpc.aio.Server
    health: _health_aio.HealthServicer
    core: HandshakeCore
    port: int
    config: ServerConfig
    legacy: LegacyListener | None = None

    async def shutdown(self) -> None:
        """NOT_SERVING, drain in-flight requests, stop the server, release everything."""
        await self.health.enter_graceful_shutdown()
        await self.core.drain(self.config.grace)
        await self.server.stop(self.config.grace)
        await self.core.close()
        if self.legacy is not None:  # last: the drained requests' ends are sent to legacy decodes first
            await asyncio.to_thread(self.legacy.stop)


async def start_server(core: HandshakeCore, config: ServerConfig) -> RunningServer:
    """Build and start the server; returns once it accepts calls."""
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("TLS needs both tls_cert and tls_key; with one the server would serve plaintext",
                          metadata={"setting": "tls_key" if config.tls_key is None else "tls_cert"})
    if config.operator_token is not None and config.operator_token == config.token:
        # `pdproto serve` and the SGLang settings say so first, naming their flag or variable.
        raise ConfigError("operator_token equals token: every decode could then read every peer's room ids "
                          "and engine identity; give the operator a token of its own",
                          metadata={"setting": "operator_token"})
    require_token_policy(config.listen, config.token, allow_insecure=config.allow_unauthenticated)
    # An empty token is refused here, never read as "no authentication".
    proofs = None
    if config.token is not None or config.operator_token is not None:
        proofs = TokenProof(config.token, config.operator_token)
    interceptors = [TokenProofInterceptor(proofs)] if config.token is not None and proofs is not None else []
    server = grpc.aio.server(interceptors=interceptors, options=config.channel.server_options())
    servicer = HandshakeServicer(core, proofs=proofs)
    add_to_server(servicer, server)
    health = _health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    if config.tls_cert is not None and config.tls_key is not None:
        creds = grpc.ssl_server_credentials([(config.tls_key, config.tls_cert)])
        port = server.add_secure_port(config.listen, creds)
    else:
        port = server.add_insecure_port(config.listen)
    if proofs is not None:
        proofs.names = ServedNames.of(config.listen, port, config.advertise_host)
    await core.start()
    legacy = None
    if config.legacy_listen is not None:
        host, _, legacy_port = config.legacy_listen.rpartition(":")
        legacy = LegacyListener(core, asyncio.get_running_loop(), host.strip("[]"), int(legacy_port),
                                serve=config.legacy_serve)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, health=health, core=core, port=port, config=config, legacy=legacy)


async def serve(core: HandshakeCore, config: ServerConfig, ready: Callable[[RunningServer], None]) -> int:
    """Run until SIGTERM/SIGINT, then shut down gracefully; returns the exit status.

    ``ready`` is called once the server accepts calls.
    """
    running = await start_server(core, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ready(running)
        await stop.wait()
        log.info("shutting down: draining for up to %.1fs", config.grace)
    finally:
        # Handlers stay installed while draining: a repeated SIGTERM must not kill the drain.
        try:
            await running.shutdown()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    return 0


_T = TypeVar("_T")


class ServiceThread:
    """The service on an event loop of its own (``pdproto.rpc.loop.LoopThread``), for a host that is not asyncio.

    A prefill scheduler (SGLang's, a demo rank) builds the ``HandshakeCore`` over its
    ``PrefillEngine``, calls ``start`` for the bound port and keeps reporting chunks from
    its own thread (the engine API is thread-safe); ``stop`` drains and shuts down.
    """

    def __init__(self, core: HandshakeCore, config: ServerConfig, *, name: str = "pdproto-service") -> None:
        self.core = core
        self.config = config
        self.port = 0
        """The bound port, once ``start`` returned."""
        self.legacy_port = 0
        """The legacy listener's port, once ``start`` returned (0: none, ``ServerConfig.legacy_listen``)."""
        self._name = name
        self._thread: LoopThread | None = None
        self._running: RunningServer | None = None

    def start(self, timeout: float = 60.0) -> int:
        """Start serving; returns the bound port, or raises what stopped the server from starting."""
        thread = self._thread = LoopThread(self._name)
        try:
            self._running = thread.run(start_server(self.core, self.config), timeout,
                                       what=f"starting the handshake service on {self.config.listen}")
        except BaseException:
            thread.stop()
            raise
        self.port = self._running.port
        self.legacy_port = self._running.legacy.port if self._running.legacy is not None else 0
        return self.port

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float = 10.0) -> _T:
        """Run ``coro`` on the service's loop (where its state may be read without locks)."""
        if self._thread is None:
            raise ShuttingDownError("the handshake service was not started")
        return self._thread.run(coro, timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """Drain and shut the service down (``ServerConfig.grace``); safe to call twice or before start."""
        thread, running, self._running = self._thread, self._running, None
        if thread is None or running is None:
            return
        try:
            thread.run(running.shutdown(), timeout, what="draining the handshake service")
        except Exception:  # noqa: BLE001 - a host stopping the service has no use for the error
            log.exception("the handshake service did not shut down cleanly")
        finally:
            thread.stop()
            if not thread.alive:
                thread.loop.close()  # its selector and self-pipe, as a loop run to completion closes them


__all__ = ["RunningServer", "ServerConfig", "ServiceThread", "serve", "start_server"]
