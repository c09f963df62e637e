"""The reason table is one table: Python enum == proto enum == docs/errors.md == gRPC codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdproto.errors import GRPC_CODE_NAMES, Reason
from pdproto.v1 import ErrorReason

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
PREFIX = "ERROR_REASON_"
# Codes the application may send (grpc doc/statuscodes.md), plus the auth, quota,
# availability, deadline and internal ones the brief maps to.
ALLOWED_CODES = {
    "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "ABORTED",
    "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "UNAVAILABLE",
    "DEADLINE_EXCEEDED", "INTERNAL",
}
ROW = re.compile(r"^\|\s*`([A-Z0-9_]+)`\s*\|\s*(\d+)\s*\|\s*([A-Z_]+)\s*\|(.*)\|(.*)\|\s*$")


def proto_reasons() -> dict[str, int]:
    """ErrorReason values by name without the prefix, UNSPECIFIED left out."""
    out = {}
    for value in ErrorReason.DESCRIPTOR.values:
        assert value.name.startswith(PREFIX)
        if value.number != 0:
            out[value.name.removeprefix(PREFIX)] = value.number
    return out


def doc_rows() -> dict[str, tuple[int, str, str, str]]:
    """docs/errors.md table rows: reason -> (number, code, meaning, what to do)."""
    rows: dict[str, tuple[int, str, str, str]] = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, number, code, meaning, todo = match.groups()
            assert name not in rows, f"{name} documented twice"
            rows[name] = (int(number), code, meaning.strip(), todo.strip())
    return rows


def test_python_reason_equals_proto_error_reason() -> None:
    assert {r.name: int(r) for r in Reason} == proto_reasons()


def test_proto_zero_value_is_unspecified() -> None:
    assert ErrorReason.Name(0) == "ERROR_REASON_UNSPECIFIED"


def test_every_reason_has_a_grpc_code() -> None:
    missing = [r.name for r in Reason if r not in GRPC_CODE_NAMES]
    assert not missing, f"add these to pdproto.errors._GRPC_CODE_EXACT: {missing}"
    assert set(GRPC_CODE_NAMES.values()) <= ALLOWED_CODES


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (Reason.WIRE_MALFORMED, "INVALID_ARGUMENT"),
        (Reason.LEGACY_BAD_INTEGER, "INVALID_ARGUMENT"),
        (Reason.PLAN_BAD_SIZE, "INVALID_ARGUMENT"),
        (Reason.INVALID_FIELD, "INVALID_ARGUMENT"),
        (Reason.TOPOLOGY_KV_DTYPE_MISMATCH, "FAILED_PRECONDITION"),
        (Reason.CONFIG_INVALID, "FAILED_PRECONDITION"),
        (Reason.UNSUPPORTED_VERSION, "FAILED_PRECONDITION"),
        (Reason.PEER_NOT_FOUND, "NOT_FOUND"),
        (Reason.REQUEST_NOT_FOUND, "NOT_FOUND"),
        (Reason.STALE_GENERATION, "ABORTED"),
        (Reason.DUPLICATE_REQUEST, "ALREADY_EXISTS"),
        (Reason.TOO_MANY_PEERS, "RESOURCE_EXHAUSTED"),
        (Reason.MESSAGE_TOO_LARGE, "RESOURCE_EXHAUSTED"),
        (Reason.UNAUTHENTICATED, "UNAUTHENTICATED"),
        (Reason.SHUTTING_DOWN, "UNAVAILABLE"),
        (Reason.ENGINE_UNAVAILABLE, "FAILED_PRECONDITION"),
        (Reason.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
        (Reason.ABORTED, "ABORTED"),
        (Reason.PEER_GONE, "ABORTED"),
        (Reason.TRANSFER_FAILED, "ABORTED"),
        (Reason.DESTINATION_OUT_OF_BOUNDS, "OUT_OF_RANGE"),
        (Reason.INTERNAL, "INTERNAL"),
    ],
)
def test_grpc_code_mapping(reason: Reason, code: str) -> None:
    assert GRPC_CODE_NAMES[reason] == code


def test_every_reason_is_documented_with_its_number_and_code() -> None:
    rows = doc_rows()
    assert set(rows) == {r.name for r in Reason}, "docs/errors.md and Reason differ"
    for reason in Reason:
        number, code, meaning, todo = rows[reason.name]
        assert number == int(reason), reason.name
        assert code == GRPC_CODE_NAMES.get(reason), reason.name
        assert meaning and todo, f"{reason.name}: fill in meaning and what to do"


def test_documented_rows_follow_enum_order() -> None:
    assert list(doc_rows()) == [r.name for r in sorted(Reason)]

