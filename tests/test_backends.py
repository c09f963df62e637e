"""The backend registry: one row per engine, matching the schema, read by every place that names one."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pdproto import backends, v1
from pdproto.negotiation.config import KNOWN_BACKENDS, DeploymentConfig, Role, check_deployment
from pdproto.errors import InvalidFieldError, Reason, TopologyError
from pdproto.negotiation.topology import backend_of, example_registration
from pdproto.transfer import create_executor
from pdproto.v1 import handshake_service_pb2 as hs
from pdproto_server.registry import identity_of
from pdproto_server.validate import check_registration

ROWS = [pytest.param(spec, id=spec.name) for spec in backends.ALL]
TRANSPORT = v1.KvRegistration.DESCRIPTOR.oneofs_by_name["transport"]


def test_every_schema_backend_and_transport_has_exactly_one_row() -> None:
    enums = [v.number for v in v1.Backend.DESCRIPTOR.values if v.number != v1.BACKEND_UNSPECIFIED]
    assert sorted(b.enum for b in backends.ALL) == sorted(enums)
    assert sorted(b.transport for b in backends.ALL) == sorted(f.name for f in TRANSPORT.fields)
    assert len(set(backends.NAMES)) == len(backends.ALL)


@pytest.mark.parametrize("spec", ROWS)
def test_row_matches_its_oneof_field_and_executor(spec: backends.BackendSpec) -> None:
    field = next(f for f in TRANSPORT.fields if f.name == spec.transport)
    assert field.message_type is spec.endpoint.DESCRIPTOR
    assert spec.endpoint.DESCRIPTOR.fields_by_name[spec.identity].type == field.TYPE_STRING
    module, _, cls = spec.executor.partition(":")
    # Importing the executor module must not need its engine (that happens on construction).
    assert getattr(importlib.import_module(module), cls).backend == spec.name


@pytest.mark.parametrize("spec", ROWS)
def test_lookups_agree_and_set_endpoint_fills_the_rows_case(spec: backends.BackendSpec) -> None:
    assert backends.by_name(spec.name) is backends.by_enum(spec.enum) is backends.by_transport(spec.transport)
    reg = v1.KvRegistration()
    backends.set_endpoint(reg, spec.endpoint(**{spec.identity: "rank-7"}))
    assert reg.WhichOneof("transport") == spec.transport
    assert backends.of_registration(reg) is spec
    assert backend_of(reg) == spec.enum
    assert backends.identity_key(reg) == f"{spec.name}:rank-7"
    reg.notify_endpoint.host, reg.notify_endpoint.port = "10.0.0.2", 7000
    assert identity_of(reg) == ("notify:10.0.0.2:7000", f"{spec.name}:rank-7")


@pytest.mark.parametrize(("lookup", "value"), [
    (backends.by_name, "carrier-pigeon"),
    (backends.by_enum, v1.BACKEND_UNSPECIFIED),
    (backends.by_enum, 99),
    (backends.by_transport, "tcp"),
    (backends.by_endpoint, v1.Endpoint(host="h")),
])
def test_unknown_backend_is_a_typed_error(lookup: object, value: object) -> None:
    with pytest.raises(TopologyError) as info:
        lookup(value)  # type: ignore[operator]
    assert info.value.reason is Reason.TOPOLOGY_BACKEND_UNSUPPORTED
    assert info.value.metadata["known"] == ",".join(backends.NAMES)


def test_set_endpoint_refuses_a_message_that_is_no_endpoint() -> None:
    reg = v1.KvRegistration()
    with pytest.raises(TopologyError):
        backends.set_endpoint(reg, v1.Endpoint(host="h"))
    assert reg.WhichOneof("transport") is None  # nothing silently became "local"


def test_unset_transport_has_no_backend_and_no_identity() -> None:
    reg = v1.KvRegistration()
    assert backends.of_registration(reg) is None
    assert backend_of(reg) == v1.BACKEND_UNSPECIFIED
    assert backends.identity_key(reg) is None and identity_of(reg) == ()


def test_create_executor_unknown_name_is_typed() -> None:
    with pytest.raises(TopologyError) as info:
        create_executor("carrier-pigeon")
    assert info.value.reason is Reason.TOPOLOGY_BACKEND_UNSUPPORTED


@pytest.mark.parametrize("spec", ROWS)
def test_registration_without_engine_identity_names_the_field(spec: backends.BackendSpec) -> None:
    reg = example_registration(backend=spec.enum)
    assert spec.identity_of(reg)
    check_registration(hs.RegisterRequest(registration=reg))
    getattr(reg, spec.transport).ClearField(spec.identity)
    with pytest.raises(InvalidFieldError) as info:
        check_registration(hs.RegisterRequest(registration=reg))
    assert info.value.field == f"registration.{spec.transport}.{spec.identity}"


def test_registration_without_transport_lists_every_case() -> None:
    reg = example_registration(backend=v1.BACKEND_UNSPECIFIED)
    with pytest.raises(InvalidFieldError) as info:
        check_registration(hs.RegisterRequest(registration=reg))
    assert info.value.field == "registration.transport"
    assert all(b.transport in info.value.message for b in backends.ALL)


@pytest.mark.parametrize("spec", ROWS)
def test_deployment_checker_knows_every_row(spec: backends.BackendSpec) -> None:
    assert spec.name in KNOWN_BACKENDS
    codes = {f.code for f in check_deployment(DeploymentConfig(Role.DECODE, backend=spec.name,
                                                               dcp_size=4, attention="mla", cache=None))}
    assert "BACKEND_UNKNOWN" not in codes
    assert ("DECODE_DCP_LOCAL_BACKEND" in codes) is spec.single_host


@pytest.mark.process
def test_registry_imports_no_engine() -> None:
    code = ("import sys, pdproto.backends; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mooncake', 'nixl', 'nixl_cu12', 'torch', 'numpy') or m.startswith('pdproto.transfer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
