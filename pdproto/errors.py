"""Typed errors with one table of machine-readable reasons (mirrors proto ErrorReason).

Every error pdproto raises is a ``PdprotoError`` carrying a ``Reason`` and the
offending values in ``metadata``; the gRPC edge maps them to status codes once.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Reason(enum.IntEnum):
    """Machine-readable error reason; values equal ``pdproto.v1.ErrorReason`` numbers."""

    WIRE_MALFORMED = 1
    WIRE_TRUNCATED = 2
    WIRE_EMPTY_BODY = 3
    UNSUPPORTED_VERSION = 4
    WIRE_UNKNOWN_BODY = 5
    WIRE_UNEXPECTED_BODY = 6
    LEGACY_FRAME_COUNT = 10
    LEGACY_BAD_INTEGER = 11
    LEGACY_BAD_TEXT = 12
    LEGACY_BAD_LENGTH = 13
    LEGACY_MISSING_GUARD = 14
    LEGACY_BAD_VALUE = 15
    LEGACY_UNREPRESENTABLE = 16
    LEGACY_LIST_LENGTH_MISMATCH = 17
    LEGACY_UNKNOWN_KIND = 18
    PLAN_PREFIX_NOT_ALIGNED = 20
    PLAN_RANK_OUT_OF_RANGE = 21
    PLAN_NOT_ENOUGH_DST_PAGES = 22
    PLAN_TOKENS_BEYOND_SOURCE = 23
    PLAN_BAD_OFFSET = 24
    PLAN_EMPTY_INPUT = 25
    PLAN_BAD_SIZE = 26
    PLAN_BAD_PAGE_INDEX = 27
    TOPOLOGY_DCP_REQUIRES_MLA = 30
    TOPOLOGY_PREFILL_CP_UNSUPPORTED = 31
    TOPOLOGY_KV_DTYPE_MISMATCH = 32
    TOPOLOGY_ROW_SIZE_MISMATCH = 33
    TOPOLOGY_DCP_RANK_MISMATCH = 34
    TOPOLOGY_LAYER_METADATA_ONE_SIDED = 35
    TOPOLOGY_MISSING_LAYER = 36
    TOPOLOGY_ENTRY_COUNT_MISMATCH = 37
    TOPOLOGY_KV_SHARDING_WITH_DCP = 38
    TOPOLOGY_PP_MISMATCH = 39
    TOPOLOGY_PAGE_SIZE_MISMATCH = 40
    TOPOLOGY_RANK_OUT_OF_RANGE = 41
    TOPOLOGY_BACKEND_UNSUPPORTED = 42
    TOPOLOGY_MODEL_MISMATCH = 43
    TOPOLOGY_MEMORY_KIND_MIXED = 44
    TOPOLOGY_LAYER_METADATA_PARTIAL = 45
    TOPOLOGY_ATTENTION_KIND_MISMATCH = 46
    TOPOLOGY_AUX_COUNT_MISMATCH = 47
    TOPOLOGY_AUX_SIZE_MISMATCH = 48
    TOPOLOGY_STATE_COUNT_MISMATCH = 49
    PEER_NOT_FOUND = 50
    REQUEST_NOT_FOUND = 51
    STALE_GENERATION = 52
    ABORTED = 53
    PEER_GONE = 54
    DEADLINE_EXCEEDED = 55
    TRANSFER_FAILED = 56
    DESTINATION_OUT_OF_BOUNDS = 57
    DUPLICATE_REQUEST = 58
    INVALID_FIELD = 59
    TOO_MANY_PEERS = 60
    TOO_MANY_REQUESTS = 61
    MESSAGE_TOO_LARGE = 62
    UNAUTHENTICATED = 63
    SHUTTING_DOWN = 64
    ENGINE_UNAVAILABLE = 65
    UNAVAILABLE = 66
    MATCH_TIMEOUT = 67
    CONFIG_INVALID = 70
    TOPOLOGY_STATE_KIND_MISMATCH = 80
    TOPOLOGY_STATE_SIZE_MISMATCH = 81
    TOPOLOGY_STATE_SLICE_MISMATCH = 82
    TOPOLOGY_STATE_DIMS_MISSING = 83
    TOPOLOGY_TP_NOT_DIVISIBLE = 84
    TOPOLOGY_KV_HEADS_MISMATCH = 85
    TOPOLOGY_STATE_LAYER_IDS_REQUIRED = 86
    TOPOLOGY_STATE_KIND_UNSUPPORTED = 87
    TOPOLOGY_NOT_A_SENDER = 88
    INTERNAL = 99

    @property
    def code(self) -> str:
        """The UPPER_SNAKE_CASE reason string used in google.rpc.ErrorInfo."""
        return self.name


class PdprotoError(Exception):
    """Root of every pdproto error: a reason, a human message and the offending values."""

    default_reason: Reason = Reason.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        reason: Reason | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason: Reason = reason if reason is not None else self.default_reason
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}

    def __str__(self) -> str:
        return f"{self.reason.code}: {self.message}"


class WireError(PdprotoError, ValueError):
    """An Envelope frame could not be decoded."""

    default_reason = Reason.WIRE_MALFORMED


class LegacyFormatError(PdprotoError, ValueError):
    """An SGLang 0.5.23 positional frame list could not be parsed or built."""

    default_reason = Reason.LEGACY_FRAME_COUNT


class PlanError(PdprotoError, ValueError):
    """A relayout plan was asked for with invalid inputs."""

    default_reason = Reason.PLAN_BAD_OFFSET


class TopologyError(PdprotoError, ValueError):
    """A prefill/decode pair cannot be served; raised only where a caller asks for it."""

    default_reason = Reason.TOPOLOGY_ROW_SIZE_MISMATCH


class ConfigError(PdprotoError, ValueError):
    """A deployment setting violates a PD rule."""

    default_reason = Reason.CONFIG_INVALID


class InvalidFieldError(PdprotoError, ValueError):
    """A request field is invalid; ``field`` names it for google.rpc.BadRequest."""

    default_reason = Reason.INVALID_FIELD

    def __init__(self, field: str, message: str, *, reason: Reason | None = None,
                 metadata: Mapping[str, object] | None = None) -> None:
        meta = dict(metadata or {})
        meta.setdefault("field", field)
        super().__init__(message, reason=reason, metadata=meta)
        self.field = field


class NotFoundError(PdprotoError, LookupError):
    """A peer or request id is unknown."""

    default_reason = Reason.PEER_NOT_FOUND


class RequestFailedError(PdprotoError):
    """A request ended in Failed (aborted, peer gone, engine failure, deadline)."""

    default_reason = Reason.TRANSFER_FAILED


class ResourceLimitError(PdprotoError):
    """A configured limit (peers, in-flight requests, message size) was reached."""

    default_reason = Reason.TOO_MANY_PEERS


class AuthError(PdprotoError):
    """Missing or invalid credentials."""

    default_reason = Reason.UNAUTHENTICATED


class TransferError(PdprotoError):
    """A transfer engine reported a failure."""

    default_reason = Reason.TRANSFER_FAILED


class EngineUnavailableError(PdprotoError, ImportError):
    """A transfer engine package is not installed; the message names what to install."""

    default_reason = Reason.ENGINE_UNAVAILABLE


class ShuttingDownError(PdprotoError):
    """The server is draining and takes no new work."""

    default_reason = Reason.SHUTTING_DOWN


__all__ = [
    "AuthError",
    "ConfigError",
    "EngineUnavailableError",
    "InvalidFieldError",
    "LegacyFormatError",
    "NotFoundError",
    "PdprotoError",
    "PlanError",
    "Reason",
    "RequestFailedError",
    "ResourceLimitError",
    "ShuttingDownError",
    "TopologyError",
    "TransferError",
    "WireError",
]


# --- gRPC status code per reason (names, not grpc objects: this module never imports grpc).
# Families by name prefix, then exact entries; a reason matched by neither is absent
# from GRPC_CODE_NAMES, and tests/test_errors_table.py names it.
_GRPC_CODE_FAMILIES: tuple[tuple[str, str], ...] = (
    ("WIRE_", "INVALID_ARGUMENT"),
    ("LEGACY_", "INVALID_ARGUMENT"),
    ("PLAN_", "INVALID_ARGUMENT"),
    ("TOPOLOGY_", "FAILED_PRECONDITION"),
    ("TOO_MANY_", "RESOURCE_EXHAUSTED"),
)
_GRPC_CODE_EXACT: dict[str, str] = {
    "INVALID_FIELD": "INVALID_ARGUMENT",
    "CONFIG_INVALID": "FAILED_PRECONDITION",
    "UNSUPPORTED_VERSION": "FAILED_PRECONDITION",
    "PEER_NOT_FOUND": "NOT_FOUND",
    "REQUEST_NOT_FOUND": "NOT_FOUND",
    # A sequencer check failed (gRPC's own example of ABORTED): retry the whole
    # request with the current generation, not this call.
    "STALE_GENERATION": "ABORTED",
    # The entity (room, generation) the caller tried to create exists already.
    "DUPLICATE_REQUEST": "ALREADY_EXISTS",
    "MESSAGE_TOO_LARGE": "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED": "UNAUTHENTICATED",
    "SHUTTING_DOWN": "UNAVAILABLE",
    "ENGINE_UNAVAILABLE": "FAILED_PRECONDITION",  # retrying cannot install a package
    "UNAVAILABLE": "UNAVAILABLE",
    "DEADLINE_EXCEEDED": "DEADLINE_EXCEEDED",
    "MATCH_TIMEOUT": "DEADLINE_EXCEEDED",
    "ABORTED": "ABORTED",
    "PEER_GONE": "ABORTED",
    "TRANSFER_FAILED": "ABORTED",
    "DESTINATION_OUT_OF_BOUNDS": "OUT_OF_RANGE",
    "INTERNAL": "INTERNAL",
}


def _grpc_code_name(reason: Reason) -> str | None:
    """The gRPC code name for ``reason`` by exact entry, then by family prefix."""
    exact = _GRPC_CODE_EXACT.get(reason.name)
    if exact is not None:
        return exact
    for prefix, code in _GRPC_CODE_FAMILIES:
        if reason.name.startswith(prefix):
            return code
    return None


GRPC_CODE_NAMES: dict[Reason, str] = {
    reason: code for reason in Reason if (code := _grpc_code_name(reason)) is not None
}
"""Reason -> gRPC status code name (e.g. "INVALID_ARGUMENT"); shared by server, docs and tests."""

__all__ += ["GRPC_CODE_NAMES"]
