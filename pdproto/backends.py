"""The transfer-engine registry: one row per engine, read by every module that names one.

Core: the executor is named by a dotted path that only ``pdproto.transfer.create_executor``
imports. A name, enum value, oneof field or endpoint type with no row raises ``TopologyError``
(TOPOLOGY_BACKEND_UNSUPPORTED); nothing falls back to a default engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from pdproto.errors import Reason, TopologyError
from pdproto.v1 import common_pb2, registration_pb2

Endpoint = Message
"""What goes into ``KvRegistration.transport``: the endpoint message of one row."""


@dataclass(frozen=True)
class BackendSpec:
    """One transfer engine as the rest of pdproto sees it."""

    name: str
    """Name on the command line, in ``DeploymentConfig.backend`` and in ``create_executor``."""
    enum: common_pb2.Backend.ValueType
    """``pdproto.v1.Backend`` value a prefill lists in ``PrefillServerInfo.backends``."""
    transport: str
    """Case of the ``KvRegistration.transport`` oneof that carries this engine's endpoint."""
    endpoint: type[Message]
    """Endpoint message type (what the executor's ``endpoint()`` returns)."""
    identity: str
    """Endpoint field that names the decode's engine across restarts; must be non-empty."""
    executor: str
    """``module:Class`` of the executor; imported only when one is created."""
    single_host: bool = False
    """True when the engine copies within one host only (tests, demos, single-node setups)."""
    host_in: str = ""
    """Endpoint field that starts with the host the engine advertises (``host:port``); "" when
    the endpoint carries none a prefill can read (NIXL's metadata is opaque)."""
    notifications: bool = False
    """True when the engine delivers notifications to the decode (chunk notices arrive there)."""

    def identity_of(self, registration: registration_pb2.KvRegistration) -> str:
        """The value of this engine's identity field in ``registration`` ("" when unset)."""
        return str(getattr(getattr(registration, self.transport), self.identity))


ALL: tuple[BackendSpec, ...] = (
    BackendSpec("mooncake", common_pb2.BACKEND_MOONCAKE, "mooncake", registration_pb2.MooncakeEndpoint,
                "session_id", "pdproto.transfer.engines.mooncake:MooncakeExecutor", host_in="session_id"),
    BackendSpec("nixl", common_pb2.BACKEND_NIXL, "nixl", registration_pb2.NixlEndpoint,
                "agent_name", "pdproto.transfer.engines.nixl:NixlExecutor", notifications=True),
    BackendSpec("local", common_pb2.BACKEND_LOCAL, "local", registration_pb2.LocalEndpoint,
                "arena_name", "pdproto.transfer.local:LocalExecutor", single_host=True),
)
"""Every engine pdproto can move bytes with."""

NAMES: tuple[str, ...] = tuple(b.name for b in ALL)
"""Backend names, in registry order."""

MULTI_HOST: tuple[str, ...] = tuple(b.name for b in ALL if not b.single_host)
"""Names of the engines that move bytes between hosts."""


def _find(what: str, value: object) -> BackendSpec:
    """The row whose attribute ``what`` equals ``value``; a typed error when none does."""
    for spec in ALL:
        if getattr(spec, what) == value:
            return spec
    shown = value.__name__ if isinstance(value, type) else repr(value)
    raise TopologyError(f"unknown transfer backend {what} {shown}; known backends: {', '.join(NAMES)}",
                        reason=Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
                        metadata={what: shown, "known": ",".join(NAMES)})


def by_name(name: str) -> BackendSpec:
    """The row named ``name``."""
    return _find("name", name)


def by_enum(value: int) -> BackendSpec:
    """The row of a ``pdproto.v1.Backend`` value (UNSPECIFIED has none)."""
    return _find("enum", value)


_BY_TRANSPORT = {spec.transport: spec for spec in ALL}


def by_transport(transport: str) -> BackendSpec:
    """The row of a ``KvRegistration.transport`` oneof case."""
    spec = _BY_TRANSPORT.get(transport)  # a dict, not _find's scan: several lookups per Register
    return spec if spec is not None else _find("transport", transport)


def by_endpoint(endpoint: Message) -> BackendSpec:
    """The row whose endpoint message type ``endpoint`` is."""
    return _find("endpoint", type(endpoint))


def of_registration(registration: registration_pb2.KvRegistration) -> BackendSpec | None:
    """The row of the engine a registration names; None when its transport is unset."""
    transport = registration.WhichOneof("transport")
    return None if transport is None else by_transport(transport)


def set_endpoint(registration: registration_pb2.KvRegistration, endpoint: Message) -> None:
    """Put ``endpoint`` into its case of ``registration.transport``."""
    getattr(registration, by_endpoint(endpoint).transport).CopyFrom(endpoint)


def identity_key(registration: registration_pb2.KvRegistration) -> str | None:
    """``"<backend>:<identity>"`` naming the registration's engine; None when unset or empty."""
    spec = of_registration(registration)
    if spec is None:
        return None
    value = spec.identity_of(registration)
    return f"{spec.name}:{value}" if value else None


__all__ = [
    "ALL",
    "MULTI_HOST",
    "NAMES",
    "BackendSpec",
    "Endpoint",
    "by_endpoint",
    "by_enum",
    "by_name",
    "by_transport",
    "identity_key",
    "of_registration",
    "set_endpoint",
]
