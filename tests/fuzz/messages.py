"""Fill any protobuf message from its descriptor, so new fields are covered automatically.

One filler, two sources of choices: Hypothesis (``messages(cls)``, shrinkable)
and ``random.Random`` (``random_message``, for fuzz seed corpora). Every field
kind is handled: scalars of each wire type, enums (known and unknown values),
nested messages, repeated fields, maps, real oneofs and proto3 ``optional``.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from google.protobuf.descriptor import FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

M = TypeVar("M", bound=Message)
T = TypeVar("T")

MAX_DEPTH = 4
"""Nesting depth below which optional sub-messages are still filled."""

MAX_ITEMS = 4
"""Largest repeated field or map the filler makes."""

_F = FieldDescriptor
_INT_RANGES: dict[int, tuple[int, int]] = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1),
    _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1),
    _F.TYPE_FIXED64: (0, 2**64 - 1),
}
# Proto3 enums are open: a newer writer's value must survive, so generate some.
_UNKNOWN_ENUM_VALUES = (1000, 2**31 - 1, -1)


class Chooser(Protocol):
    """Where the filler's choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""

    def boolean(self) -> bool:
        """A coin flip."""

    def text(self) -> str:
        """A short str (valid Unicode, no surrogates)."""

    def binary(self) -> bytes:
        """A short bytes value."""

    def floating(self, width: int) -> float:
        """A finite float representable in ``width`` bits (NaN never equals itself)."""

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""


class DrawChooser:
    """Choices drawn from Hypothesis, so failing messages shrink."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
        self._draw = draw

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""
        return int(self._draw(st.integers(lo, hi)))

    def boolean(self) -> bool:
        """A coin flip."""
        return bool(self._draw(st.booleans()))

    def text(self) -> str:
        """A short str."""
        return str(self._draw(st.text(max_size=12)))

    def binary(self) -> bytes:
        """A short bytes value."""
        return bytes(self._draw(st.binary(max_size=24)))

    def floating(self, width: int) -> float:
        """A finite float of ``width`` bits."""
        return float(self._draw(st.floats(allow_nan=False, width=width)))  # type: ignore[arg-type]

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self.integer(0, len(options) - 1)]


class RandomChooser:
    """Choices from a seeded ``random.Random`` (deterministic seed corpora)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi], biased towards the ends where encodings change size."""
        pick = self._rng.random()
        if pick < 0.2:
            return lo
        if pick < 0.4:
            return hi
        if pick < 0.7:
            return max(lo, min(hi, self._rng.randint(-300, 300)))
        return self._rng.randint(lo, hi)

    def boolean(self) -> bool:
        """A coin flip."""
        return self._rng.random() < 0.5

    def text(self) -> str:
        """A short str from a mixed alphabet."""
        alphabet = "abcXYZ019:._-/ é€😀"
        return "".join(self._rng.choice(alphabet) for _ in range(self._rng.randint(0, 12)))

    def binary(self) -> bytes:
        """A short bytes value."""
        return bytes(self._rng.getrandbits(8) for _ in range(self._rng.randint(0, 24)))

    def floating(self, width: int) -> float:
        """A finite float of ``width`` bits."""
        value = self._rng.uniform(-1e6, 1e6)
        return float(struct.unpack("<f", struct.pack("<f", value))[0]) if width == 32 else value

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self._rng.randrange(len(options))]


def is_synthetic_oneof(oneof: OneofDescriptor) -> bool:
    """True for the hidden oneof protoc makes for a proto3 ``optional`` field."""
    fields = list(oneof.fields)
    return len(fields) == 1 and oneof.name == "_" + fields[0].name


def is_map(field: FieldDescriptor) -> bool:
    """True for a ``map<K, V>`` field."""
    return bool(
        field.message_type is not None
        and field.is_repeated
        and field.message_type.GetOptions().map_entry
    )


def scalar(field: FieldDescriptor, chooser: Chooser) -> object:
    """A value for one non-message field (or map key/value)."""
    kind = field.type
    if kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        return chooser.integer(lo, hi)
    if kind == _F.TYPE_BOOL:
        return chooser.boolean()
    if kind == _F.TYPE_STRING:
        return chooser.text()
    if kind == _F.TYPE_BYTES:
        return chooser.binary()
    if kind == _F.TYPE_FLOAT:
        return chooser.floating(32)
    if kind == _F.TYPE_DOUBLE:
        return chooser.floating(64)
    if kind == _F.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        closed = getattr(field.enum_type, "is_closed", False)
        options = known if closed else known + list(_UNKNOWN_ENUM_VALUES)
        return chooser.choice(options)
    raise NotImplementedError(f"field type {kind} of {field.full_name}")


def fill(message: Message, chooser: Chooser, depth: int = 0) -> Message:
    """Fill ``message`` in place from ``chooser`` and return it."""
    descriptor = message.DESCRIPTOR
    chosen: set[str] = set()
    skipped: set[str] = set()
    for oneof in descriptor.oneofs:
        members = list(oneof.fields)
        if is_synthetic_oneof(oneof):
            continue
        pick = chooser.integer(-1, len(members) - 1)
        for index, member in enumerate(members):
            (chosen if index == pick else skipped).add(member.name)
    for field in descriptor.fields:
        if field.name in skipped:
            continue
        _fill_field(message, field, chooser, depth, force=field.name in chosen)
    return message


def _fill_field(
    message: Message, field: FieldDescriptor, chooser: Chooser, depth: int, *, force: bool
) -> None:
    """Fill one field; ``force`` sets a oneof member even at its default."""
    target = getattr(message, field.name)
    if is_map(field):
        entry = field.message_type
        assert entry is not None
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for _ in range(chooser.integer(0, MAX_ITEMS)):
            key = scalar(key_field, chooser)
            if value_field.message_type is not None:
                fill(target[key], chooser, depth + 1)
            else:
                target[key] = scalar(value_field, chooser)
        return
    if field.is_repeated:
        for _ in range(chooser.integer(0, MAX_ITEMS if depth < MAX_DEPTH else 0)):
            if field.message_type is not None:
                fill(target.add(), chooser, depth + 1)
            else:
                target.append(scalar(field, chooser))
        return
    if field.message_type is not None:
        if force or (depth < MAX_DEPTH and chooser.boolean()):
            target.SetInParent()
            fill(target, chooser, depth + 1)
        return
    if field.has_presence and not force and not chooser.boolean():
        return  # proto3 optional left unset: presence itself is under test
    setattr(message, field.name, scalar(field, chooser))


@st.composite
def messages(draw: Callable[[st.SearchStrategy[Any]], Any], cls: type[M]) -> M:
    """Hypothesis strategy: a ``cls`` with every kind of field filled generically."""
    message = cls()
    fill(message, DrawChooser(draw))
    return message


def random_message(cls: type[M], rng: random.Random) -> M:
    """A ``cls`` filled from ``rng`` (deterministic for a given seed)."""
    message = cls()
    fill(message, RandomChooser(rng))
    return message
