"""The generated ``pdproto.v1`` namespace: complete, typed for users, stubs on demand."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pdproto import v1
from pdproto.v1 import common_pb2, handshake_service_pb2, registration_pb2

ROOT = Path(__file__).resolve().parents[1]
# Every generated message module, found on disk: a new .proto is covered without editing this list.
MODULES = tuple(importlib.import_module(f"pdproto.v1.{p.stem}")
                for p in sorted((ROOT / "pdproto" / "v1").glob("*_pb2.py")))


def test_every_top_level_message_enum_and_value_is_re_exported() -> None:
    expected = set()
    for module in MODULES:
        fd = module.DESCRIPTOR
        expected |= set(fd.message_types_by_name) | set(fd.enum_types_by_name)
        expected |= {v.name for e in fd.enum_types_by_name.values() for v in e.values}
    missing = sorted(n for n in expected if not hasattr(v1, n))
    assert not missing
    assert "LocalEndpoint" in v1.__all__ and v1.LocalEndpoint is registration_pb2.LocalEndpoint
    assert v1.ATTENTION_KIND_MLA == common_pb2.ATTENTION_KIND_MLA
    assert set(v1.__all__) == expected | {"SERVICE_NAME", "HandshakeServiceStub",
                                          "HandshakeServiceServicer",
                                          "add_HandshakeServiceServicer_to_server"}


def test_service_name_comes_from_the_proto() -> None:
    service = handshake_service_pb2.DESCRIPTOR.services_by_name["HandshakeService"]
    assert v1.SERVICE_NAME == service.full_name


def test_only_protos_with_a_service_have_a_stubs_module() -> None:
    stubs = sorted(p.name for p in (ROOT / "pdproto" / "v1").glob("*_pb2_grpc.py"))
    with_service = sorted(f"{m.__name__.rsplit('.', 1)[1]}_grpc.py" for m in MODULES
                          if m.DESCRIPTOR.services_by_name)
    assert stubs == with_service == ["handshake_service_pb2_grpc.py"]


@pytest.mark.process
def test_the_grpc_stubs_load_on_their_own_and_on_first_use() -> None:
    code = ("import sys, pdproto.v1 as v1\n"
            "assert 'grpc' not in sys.modules\n"
            "stub = v1.HandshakeServiceStub\n"
            "assert 'grpc' in sys.modules\n"
            "from pdproto.v1 import handshake_service_pb2_grpc as g\n"
            "assert stub is g.HandshakeServiceStub\n"
            "try:\n    v1.NoSuchName\nexcept AttributeError:\n    pass\n"
            "else:\n    raise SystemExit('unknown names must raise AttributeError')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    alone = subprocess.run([sys.executable, "-c", "import pdproto.v1.handshake_service_pb2_grpc"],
                           capture_output=True, text=True, check=False)
    assert alone.returncode == 0, alone.stderr


USER_CODE = '''\
import grpc
from pdproto import v1

reg = v1.KvRegistration(page_size=64, attention_kind=v1.ATTENTION_KIND_MLA,
                        dcp=v1.ParallelGroup(size=4, rank=1), local=v1.LocalEndpoint())
kind: v1.AttentionKind.ValueType = reg.attention_kind
stub = v1.HandshakeServiceStub(grpc.insecure_channel("localhost:1"))
name: str = v1.SERVICE_NAME
typo = v1.KvRegistratoin()
'''


@pytest.mark.process
def test_user_code_type_checks_against_the_namespace_and_typos_do_not(tmp_path: Path) -> None:
    # The lazy stub loader is hidden from type checkers, so an unknown name is an error
    # rather than Any, and the stubs keep their real types.
    user = tmp_path / "user.py"
    user.write_text(USER_CODE)
    run = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
                          "--cache-dir", str(ROOT / ".mypy_cache"), str(user)],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    errors = [line for line in run.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and ":9: error: Module has no attribute \"KvRegistratoin\"" in errors[0], \
        run.stdout + run.stderr
