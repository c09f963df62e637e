"""Typed errors, declared once: each class names its reasons, gRPC code and retryability.

How the declarations (``@_declares``) work and what is derived from them: docs/errors.md,
"Classes: where each fact is declared". Code names are strings: this module never imports grpc.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, TypeVar


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
    TOO_MANY_STREAMS = 68
    SESSION_NOT_FOUND = 69
    CONFIG_INVALID = 70
    IDENTITY_IN_USE = 71
    TOO_MANY_REGISTRATIONS = 72
    TOO_MANY_CALLS = 73
    RANK_UNPROVEN = 74
    TOPOLOGY_STATE_KIND_MISMATCH = 80
    TOPOLOGY_STATE_SIZE_MISMATCH = 81
    TOPOLOGY_STATE_SLICE_MISMATCH = 82
    TOPOLOGY_STATE_DIMS_MISSING = 83
    TOPOLOGY_TP_NOT_DIVISIBLE = 84
    TOPOLOGY_KV_HEADS_MISMATCH = 85
    TOPOLOGY_STATE_LAYER_IDS_REQUIRED = 86
    TOPOLOGY_STATE_KIND_UNSUPPORTED = 87
    TOPOLOGY_NOT_A_SENDER = 88
    TOPOLOGY_STATE_TP_REFUSED = 89
    INTERNAL = 99

    @property
    def code(self) -> str:
        """The UPPER_SNAKE_CASE reason string used in google.rpc.ErrorInfo."""
        return self.name


_OWNER: dict[Reason, type[PdprotoError]] = {}
"""Reason -> the one class that owns it, filled by ``_declares``."""

_E = TypeVar("_E", bound="type[PdprotoError]")


def _declares(*reasons: Reason, family: str = "", code: str,
              retryable: bool = False) -> Callable[[_E], _E]:
    """Declare an error class: the reasons it owns, its gRPC code name, its retryability.

    ``family`` claims every reason whose name starts with it. The class's default reason
    is the first one listed, else the lowest-numbered family member. A reason claimed by
    two classes is a bug, reported when the second class is defined.
    """
    owned = list(reasons) + [r for r in Reason if family and r.name.startswith(family)]

    def apply(cls: _E) -> _E:
        if not owned:
            raise TypeError(f"{cls.__name__} declares no reason")
        for reason in owned:
            if reason in _OWNER:
                raise TypeError(f"{reason.name} is owned by {_OWNER[reason].__name__} and {cls.__name__}")
            _OWNER[reason] = cls
        cls.reasons = frozenset(owned)
        cls.grpc_code = code
        cls.retryable = retryable
        cls.default_reason = owned[0]
        cls._declared = cls
        return cls

    return apply


@_declares(Reason.INTERNAL, code="INTERNAL")
class PdprotoError(Exception):
    """Root of every pdproto error: a reason, a human message and the offending values."""

    reasons: ClassVar[frozenset[Reason]]
    """The reasons this class may carry (an undeclared subclass inherits them)."""
    grpc_code: ClassVar[str]
    """Name of the gRPC status code the server answers with, e.g. ``"INVALID_ARGUMENT"``."""
    retryable: ClassVar[bool]
    """Whether the same call may be sent again as is; the client does so within its deadline."""
    default_reason: ClassVar[Reason]
    """The reason used when none is given."""
    _declared: ClassVar[type[PdprotoError]]
    """The nearest declared class: an instance may carry only the reasons it owns."""

    def __init__(
        self,
        message: str,
        *,
        reason: Reason | None = None,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        reason = reason if reason is not None else self.default_reason
        if _OWNER[reason] is not self._declared:
            raise TypeError(f"{type(self).__name__} cannot carry {reason.name}: raise "
                            f"{_OWNER[reason].__name__} (or use errors.error_for)")
        super().__init__(message)
        self.message = message
        self.reason: Reason = reason
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}

    def __str__(self) -> str:
        return f"{self.reason.code}: {self.message}"


@_declares(family="WIRE_", code="INVALID_ARGUMENT")
class WireError(PdprotoError, ValueError):
    """An Envelope frame could not be decoded."""


@_declares(family="LEGACY_", code="INVALID_ARGUMENT")
class LegacyFormatError(PdprotoError, ValueError):
    """An SGLang 0.5.23 positional frame list could not be parsed or built."""


@_declares(family="PLAN_", code="INVALID_ARGUMENT")
class PlanError(PdprotoError, ValueError):
    """A relayout plan was asked for with invalid inputs."""


@_declares(family="TOPOLOGY_", code="FAILED_PRECONDITION")
class TopologyError(PdprotoError, ValueError):
    """A prefill/decode pair cannot be served; raised only where a caller asks for it."""


@_declares(family="TOO_MANY_", code="RESOURCE_EXHAUSTED")
class ResourceLimitError(PdprotoError):
    """A configured limit (peers, in-flight requests, message size) was reached."""


# A version mismatch is found both by the frame reader and by negotiation, so it is both.
@_declares(Reason.UNSUPPORTED_VERSION, code="FAILED_PRECONDITION")
class UnsupportedVersionError(WireError, TopologyError):
    """The peer speaks a protocol major version this package does not."""


# wire.decode promises WireError; over gRPC the same limit is a resource limit.
@_declares(Reason.MESSAGE_TOO_LARGE, code="RESOURCE_EXHAUSTED")
class MessageTooLargeError(WireError, ResourceLimitError):
    """A frame or message is larger than the configured limit."""


@_declares(Reason.CONFIG_INVALID, code="FAILED_PRECONDITION")
class ConfigError(PdprotoError, ValueError):
    """A deployment setting violates a PD rule."""


@_declares(Reason.INVALID_FIELD, code="INVALID_ARGUMENT")
class InvalidFieldError(PdprotoError, ValueError):
    """Request fields are invalid: ``field`` names the first, ``violations`` lists them all.

    Over gRPC the violations travel as one ``google.rpc.BadRequest``.
    """

    def __init__(self, field: str, message: str, *, reason: Reason | None = None,
                 metadata: Mapping[str, object] | None = None,
                 violations: Sequence[tuple[str, str]] | None = None) -> None:
        meta = dict(metadata or {})
        meta.setdefault("field", field)
        super().__init__(message, reason=reason, metadata=meta)
        self.field = field
        self.violations: tuple[tuple[str, str], ...] = tuple(violations or ((field, message),))

    @classmethod
    def of(cls, violations: Sequence[tuple[str, str]]) -> InvalidFieldError:
        """One error for several invalid fields of one request, each (field, description)."""
        (field, text), rest = violations[0], violations[1:]
        more = f" (+{len(rest)} more)" if rest else ""
        return cls(field, text + more, metadata={"fields": ",".join(f for f, _ in violations)},
                   violations=violations)


@_declares(Reason.PEER_NOT_FOUND, Reason.REQUEST_NOT_FOUND, Reason.SESSION_NOT_FOUND, code="NOT_FOUND")
class NotFoundError(PdprotoError, LookupError):
    """A peer, request or session id is unknown."""


@_declares(Reason.ABORTED, Reason.PEER_GONE, Reason.STALE_GENERATION, code="ABORTED")
class RequestFailedError(PdprotoError):
    """A request (generation) is over: aborted, its peer gone, or superseded; retry it whole."""


@_declares(Reason.DEADLINE_EXCEEDED, Reason.MATCH_TIMEOUT, code="DEADLINE_EXCEEDED")
class DeadlineExceededError(RequestFailedError):
    """A wait ran past its deadline."""


@_declares(Reason.DUPLICATE_REQUEST, code="ALREADY_EXISTS")
class DuplicateRequestError(RequestFailedError):
    """The same room and generation were submitted twice; watch the first instead."""


@_declares(Reason.IDENTITY_IN_USE, code="ALREADY_EXISTS")
class IdentityInUseError(PdprotoError):
    """A registration names a live decode's endpoint or engine: that decode still holds a status stream."""


@_declares(Reason.TRANSFER_FAILED, code="ABORTED")
class TransferError(PdprotoError):
    """A transfer engine reported a failure."""


@_declares(Reason.DESTINATION_OUT_OF_BOUNDS, code="OUT_OF_RANGE")
class DestinationOutOfBoundsError(TransferError):
    """Destination rows fall outside the memory the peer registered."""


@_declares(Reason.UNAUTHENTICATED, Reason.RANK_UNPROVEN, code="UNAUTHENTICATED")
class AuthError(PdprotoError):
    """Missing or invalid credentials, or (``RANK_UNPROVEN``) a server that did not prove the token."""


@_declares(Reason.ENGINE_UNAVAILABLE, code="FAILED_PRECONDITION")  # retrying cannot install it
class EngineUnavailableError(PdprotoError, ImportError):
    """A transfer engine package is not installed; the message names what to install."""


@_declares(Reason.SHUTTING_DOWN, code="UNAVAILABLE", retryable=True)
class ShuttingDownError(PdprotoError):
    """The server is draining and takes no new work; another replica (or a restart) will."""


@_declares(Reason.UNAVAILABLE, code="UNAVAILABLE", retryable=True)
class UnavailableError(PdprotoError, ConnectionError):
    """The server could not be reached (after retries) or dropped the connection."""


_unowned = [r.name for r in Reason if r not in _OWNER]
if _unowned:
    raise TypeError(f"reasons without an error class (declare them with @_declares): {_unowned}")


def error_class(reason: Reason) -> type[PdprotoError]:
    """The one class that carries ``reason`` (on the server and in the client)."""
    return _OWNER[reason]


def error_for(reason: Reason, message: str, metadata: Mapping[str, object] | None = None,
              violations: Sequence[tuple[str, str]] = ()) -> PdprotoError:
    """An error of ``reason``'s class, for code whose reason is a value rather than a literal.

    An ``InvalidFieldError`` names the first of ``violations``, else ``metadata["field"]``.
    """
    cls = error_class(reason)
    if issubclass(cls, InvalidFieldError):
        field = violations[0][0] if violations else str((metadata or {}).get("field", ""))
        return cls(field, message, reason=reason, metadata=metadata, violations=list(violations) or None)
    return cls(message, reason=reason, metadata=metadata)


GRPC_CODE_NAMES: Mapping[Reason, str] = {reason: error_class(reason).grpc_code for reason in Reason}
"""Reason -> gRPC status code name, derived from the class declarations."""


def declared_classes() -> list[type[PdprotoError]]:
    """Every declared error class, in declaration order (docs and tests walk them)."""
    return list(dict.fromkeys(_OWNER.values()))


__all__ = [
    "AuthError",
    "ConfigError",
    "DeadlineExceededError",
    "DestinationOutOfBoundsError",
    "DuplicateRequestError",
    "EngineUnavailableError",
    "GRPC_CODE_NAMES",
    "IdentityInUseError",
    "InvalidFieldError",
    "LegacyFormatError",
    "MessageTooLargeError",
    "NotFoundError",
    "PdprotoError",
    "PlanError",
    "Reason",
    "RequestFailedError",
    "ResourceLimitError",
    "ShuttingDownError",
    "TopologyError",
    "TransferError",
    "UnavailableError",
    "UnsupportedVersionError",
    "WireError",
    "declared_classes",
    "error_class",
    "error_for",
]
