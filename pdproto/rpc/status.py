"""Typed errors to gRPC statuses and back: the one conversion both ends use (README.md here).

Every status pdproto sends carries exactly one ``google.rpc.ErrorInfo`` (and a ``BadRequest``
for invalid fields); the client reads it, or a session's ``CommandError``, back into the class
of the reason, so both paths raise the same class with the same metadata.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status

from pdproto import errors as E
from pdproto.errors import GRPC_CODE_NAMES, PdprotoError, Reason, error_for
from pdproto.v1 import session_pb2

DOMAIN = "pdproto"
"""``ErrorInfo.domain`` of every error pdproto sends."""


# -- error -> status (the server's answers) -----------------------------------

def grpc_code(reason: Reason) -> grpc.StatusCode:
    """The gRPC status code a reason is answered with (declared on its error class)."""
    code: grpc.StatusCode = getattr(grpc.StatusCode, GRPC_CODE_NAMES[reason])
    return code


_CAMEL = re.compile(r"_([a-z0-9])")


def _camel(metadata: Mapping[str, object]) -> dict[str, str]:
    """The metadata with lowerCamelCase keys (AIP-193; keys already camel stay as they are)."""
    return {_CAMEL.sub(lambda m: m.group(1).upper(), k): str(v) for k, v in metadata.items()}


def build_status(
    reason: Reason,
    message: str,
    metadata: Mapping[str, object] | None = None,
    *,
    field_violations: Sequence[tuple[str, str]] = (),
) -> grpc.Status:
    """A grpc.Status with one ErrorInfo and, when fields are named, one BadRequest."""
    details: list[Message] = [
        error_details_pb2.ErrorInfo(reason=reason.code, domain=DOMAIN, metadata=_camel(metadata or {}))]
    if field_violations:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in field_violations]))
    packed = [any_pb2.Any() for _ in details]
    for any_msg, detail in zip(packed, details):
        any_msg.Pack(detail)
    proto = status_pb2.Status(code=getattr(code_pb2, grpc_code(reason).name), message=message, details=packed)
    result: grpc.Status = rpc_status.to_status(proto)
    return result


def status_for(error: PdprotoError) -> grpc.Status:
    """The status for a typed pdproto error (BadRequest added for InvalidFieldError)."""
    violations = error.violations if isinstance(error, E.InvalidFieldError) else ()
    return build_status(error.reason, error.message, error.metadata, field_violations=violations)


def command_error(error: PdprotoError) -> session_pb2.CommandError:
    """What a unary call would answer for ``error``, as a session CommandError (same code, reason, metadata)."""
    violations = error.violations if isinstance(error, E.InvalidFieldError) else ()
    return session_pb2.CommandError(
        code=grpc_code(error.reason).value[0], reason=error.reason.code, message=error.message,
        metadata=_camel(error.metadata),
        field_violations=[session_pb2.FieldViolation(field=f, description=d) for f, d in violations])


# -- status -> error (the client's reading) -----------------------------------

# Statuses without an ErrorInfo come from the transport or gRPC itself: read each code as
# the reason it stands for (the class and retryability then follow from pdproto.errors).
_BARE_CODES: Mapping[grpc.StatusCode, Reason] = {
    grpc.StatusCode.UNAVAILABLE: Reason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.MESSAGE_TOO_LARGE,
    grpc.StatusCode.CANCELLED: Reason.ABORTED,
}


_GRPC_SIZES = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")


def error_from_parts(code_name: str, reason_name: str, domain: str, message: str,
                     metadata: Mapping[str, str], violations: Sequence[tuple[str, str]] = ()) -> PdprotoError:
    """The typed error for a refusal: its reason's class, the metadata, the code name as ``grpcCode``."""
    meta: dict[str, str] = {"grpcCode": code_name}
    if domain == DOMAIN and reason_name in Reason.__members__:
        reason = Reason[reason_name]
        meta.update(metadata)
    else:
        reason = _BARE_CODES.get(getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN), Reason.INTERNAL)
        sizes = _GRPC_SIZES.search(message) if reason is Reason.MESSAGE_TOO_LARGE else None
        if sizes:  # gRPC's own refusal of a message over the channel's limit names both only in its text
            meta.update(size=sizes[1], limit=sizes[2])
        if reason_name:
            meta.update(metadata, foreignReason=reason_name, foreignDomain=domain)
    return error_for(reason, message, meta, violations)


def error_from_rpc(exc: grpc.RpcError) -> PdprotoError:
    """Turn a failed call into the typed error of its ErrorInfo reason (BadRequest -> field)."""
    code: grpc.StatusCode = exc.code()
    status = rpc_status.from_call(exc)
    info: error_details_pb2.ErrorInfo | None = None
    violations: list[tuple[str, str]] = []
    for any_msg in status.details if status is not None else ():
        if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and info is None:
            info = error_details_pb2.ErrorInfo()
            any_msg.Unpack(info)
        elif any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    if info is None:  # a status from gRPC or the transport: no reason, domain or metadata
        info = error_details_pb2.ErrorInfo()
    return error_from_parts(code.name, info.reason, info.domain, exc.details() or "", dict(info.metadata),
                            violations)


_CODE_NAMES: Mapping[int, str] = {c.value[0]: c.name for c in grpc.StatusCode}


def error_from_command(error: session_pb2.CommandError) -> PdprotoError:
    """The typed error of a command a session refused (the same one the unary call raises)."""
    return error_from_parts(_CODE_NAMES.get(error.code, "UNKNOWN"), error.reason, DOMAIN, error.message,
                            dict(error.metadata), [(v.field, v.description) for v in error.field_violations])


__all__ = [
    "DOMAIN",
    "build_status",
    "command_error",
    "error_from_command",
    "error_from_parts",
    "error_from_rpc",
    "grpc_code",
    "status_for",
]
