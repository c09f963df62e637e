"""One declaration per error class, and everything derived from it agrees.

Python ``Reason`` == proto ``ErrorReason``; every reason has exactly one class; every raise
site in pdproto/ and pdproto_server/ uses the class of its reason (so the server's class equals
the one the client derives); docs/errors.md shows exactly the declared codes, classes
and retryability.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdproto import errors
from pdproto.errors import GRPC_CODE_NAMES, PdprotoError, Reason, error_class, error_for
from pdproto.v1 import ErrorReason

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "errors.md"
PREFIX = "ERROR_REASON_"
# Codes the application may send (grpc doc/statuscodes.md), plus the auth, quota,
# availability, deadline and internal ones the brief maps to.
ALLOWED_CODES = {
    "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "ABORTED",
    "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "UNAVAILABLE",
    "DEADLINE_EXCEEDED", "INTERNAL",
}
ROW = re.compile(r"^\|\s*`([A-Z0-9_]+)`\s*\|\s*(\d+)\s*\|\s*([A-Z_]+)\s*\|\s*`(\w+)`\s*\|(.*)\|(.*)\|\s*$")
CLASS_ROW = re.compile(r"^\|\s*`(\w+Error)`\s*\|(.*)\|\s*([A-Z_]+)\s*\|\s*(yes|no)\s*\|(.*)\|\s*$")


def proto_reasons() -> dict[str, int]:
    """ErrorReason values by name without the prefix, UNSPECIFIED left out."""
    out = {}
    for value in ErrorReason.DESCRIPTOR.values:
        assert value.name.startswith(PREFIX)
        if value.number != 0:
            out[value.name.removeprefix(PREFIX)] = value.number
    return out


def doc_rows() -> dict[str, tuple[int, str, str, str, str]]:
    """docs/errors.md reason rows: reason -> (number, code, class, meaning, what to do)."""
    rows: dict[str, tuple[int, str, str, str, str]] = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, number, code, cls, meaning, todo = match.groups()
            assert name not in rows, f"{name} documented twice"
            rows[name] = (int(number), code, cls, meaning.strip(), todo.strip())
    return rows


def test_python_reason_equals_proto_error_reason() -> None:
    assert {r.name: int(r) for r in Reason} == proto_reasons()


def test_proto_zero_value_is_unspecified() -> None:
    assert ErrorReason.Name(0) == "ERROR_REASON_UNSPECIFIED"


def test_every_reason_has_exactly_one_class_and_an_allowed_code() -> None:
    owners = {r: [c for c in errors.declared_classes() if r in c.reasons] for r in Reason}
    assert {r.name: [c.__name__ for c in cs] for r, cs in owners.items() if len(cs) != 1} == {}
    assert all(error_class(r) is owners[r][0] for r in Reason)
    assert GRPC_CODE_NAMES == {r: error_class(r).grpc_code for r in Reason}
    assert set(GRPC_CODE_NAMES.values()) <= ALLOWED_CODES


def test_a_second_owner_of_a_reason_is_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="PEER_GONE is owned by RequestFailedError"):
        @errors._declares(Reason.PEER_GONE, code="ABORTED")
        class _Again(PdprotoError):
            """Claims a reason that is taken."""


@pytest.mark.parametrize("reason", list(Reason), ids=lambda r: r.name)
def test_error_for_builds_the_owning_class(reason: Reason) -> None:
    err = error_for(reason, "why", {"field": "a.b", "room": 7})
    assert type(err) is error_class(reason) and err.reason is reason
    assert err.metadata["room"] == "7" and str(err) == f"{reason.name}: why"


def test_a_class_refuses_a_reason_it_does_not_own() -> None:
    with pytest.raises(TypeError, match="raise RequestFailedError"):
        errors.TransferError("peer died", reason=Reason.PEER_GONE)
    with pytest.raises(TypeError, match="raise DuplicateRequestError"):
        PdprotoError("twice", reason=Reason.DUPLICATE_REQUEST)
    # Families are caught through their bases.
    assert isinstance(errors.UnsupportedVersionError("v"), errors.WireError)
    assert isinstance(errors.UnsupportedVersionError("v"), errors.TopologyError)
    assert isinstance(errors.MessageTooLargeError("big"), errors.ResourceLimitError)
    assert isinstance(errors.DuplicateRequestError("dup"), errors.RequestFailedError)


def raise_sites() -> list[tuple[str, str, Reason]]:
    """Every ``SomeError(..., reason=Reason.X)`` in pdproto/ and pdproto_server/: (where, class, reason)."""
    declared = {c.__name__ for c in errors.declared_classes()}
    sites = []
    for path in sorted([*(ROOT / "pdproto").rglob("*.py"), *(ROOT / "pdproto_server").rglob("*.py")]):
        if "v1" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name not in declared:
                continue
            for kw in node.keywords:
                value = kw.value
                if (kw.arg == "reason" and isinstance(value, ast.Attribute)
                        and isinstance(value.value, ast.Name) and value.value.id == "Reason"):
                    sites.append((f"{path.relative_to(ROOT)}:{node.lineno}", name, Reason[value.attr]))
    return sites


def test_every_raise_site_uses_the_class_of_its_reason() -> None:
    # The client raises error_class(reason); a server or executor raise site naming another
    # class would give one reason two classes. Variable reasons go through error_for.
    sites = raise_sites()
    assert len(sites) > 50  # the scan sees the tree
    wrong = [f"{where}: {name}(reason={reason.name}) should be {error_class(reason).__name__}"
             for where, name, reason in sites if name != error_class(reason).__name__]
    assert not wrong


def test_every_reason_is_documented_with_its_number_code_and_class() -> None:
    rows = doc_rows()
    assert set(rows) == {r.name for r in Reason}, "docs/errors.md and Reason differ"
    for reason in Reason:
        number, code, cls, meaning, todo = rows[reason.name]
        assert number == int(reason), reason.name
        assert code == GRPC_CODE_NAMES[reason], reason.name
        assert cls == error_class(reason).__name__, reason.name
        assert meaning and todo, f"{reason.name}: fill in meaning and what to do"


def test_every_class_is_documented_with_its_bases_code_and_retryability() -> None:
    rows = {m.group(1): m.groups()[1:] for line in DOCS.read_text().splitlines()
            if (m := CLASS_ROW.match(line))}
    assert list(rows) == [c.__name__ for c in errors.declared_classes()]
    for cls in errors.declared_classes():
        bases, code, retryable, _ = rows[cls.__name__]
        assert re.findall(r"`(\w+)`", bases) == [b.__name__ for b in cls.__bases__], cls.__name__
        assert (code, retryable == "yes") == (cls.grpc_code, cls.retryable), cls.__name__


def test_documented_rows_follow_enum_order() -> None:
    assert list(doc_rows()) == [r.name for r in sorted(Reason)]
