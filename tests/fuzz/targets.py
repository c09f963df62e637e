"""Fuzz targets: pdproto.wire decoders and every legacy parser, found by name.

A target takes one bytes input. Wire targets read it as one frame; legacy
targets read it as a frame list packed by ``pack_frames``;
the ``*.any_value`` targets read it as a Python value of any type (``python_value``:
None, a huge integer, a str, a float, a list mixing frames and non-frames...),
because callers hand these functions whatever a socket or a caller produced.
Legacy parsers are discovered with getattr (``parse_*`` in pdproto.legacy.mooncake
/ .nixl, plus ``parse_any`` and ``classify``), so parsers added later are fuzzed too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import struct
import typing
from typing import cast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

from google.protobuf.message import Message

from pdproto import wire
from pdproto.errors import PdprotoError, WireError
from pdproto.v1 import AbortNotification, Envelope
from tests.fuzz.messages import random_message

LEGACY_MODULES = ("pdproto.legacy.mooncake", "pdproto.legacy.nixl")
LEGACY_PACKAGE = "pdproto.legacy"
LEGACY_PACKAGE_FUNCTIONS = ("parse_any", "classify")
MAX_FRAMES = 64
"""Frame lists longer than this are cut (SGLang's longest layout has ~20 frames)."""

SGLANG_FRAMES = (b"None", b"123", b"ABORT", b"ABORT_ACK", b"NixlMsgGuard", b"", b"-1", b"0")
INTERESTING_FRAMES = SGLANG_FRAMES + (
    b"18446744073709551615", b"18446744073709551616", b"-9223372036854775809", b"007",
    b" 1", b"1 ", b"+1", b"1e3", b"nan", b"\x00" * 8, b"\xff" * 8, b"\xff" * 7,
    b"127.0.0.1", b"[::1]", b"\xc3\x28", b"KV_STATUS",
)


class FuzzFinding(Exception):
    """A property the harness checks on success failed (e.g. a wire round trip)."""


@dataclass(frozen=True)
class Target:
    """One fuzzed callable with its input shape and the errors it may raise."""

    name: str
    """Stable name, e.g. ``wire.decode`` or ``legacy.nixl.parse_registration``."""
    run: Callable[[bytes], object]
    """Calls the code under test on one input (and checks properties of a success)."""
    allowed: type[BaseException]
    """Exceptions that are expected answers to bad input; anything else is a finding."""
    frames: bool
    """True when the input is a packed frame list."""
    values: bool = False
    """True when the input is a ``python_value`` encoding (any Python object)."""


def pack_frames(frames: list[bytes]) -> bytes:
    """One bytes input for a frame list: per frame, a 1-byte length (255: 4-byte length follows)."""
    out = bytearray()
    for frame in frames:
        if len(frame) < 255:
            out.append(len(frame))
        else:
            out += b"\xff" + struct.pack(">I", len(frame))
        out += frame
    return bytes(out)


def unpack_frames(data: bytes) -> list[bytes]:
    """Inverse of ``pack_frames``; total on any input (short lengths take what is left)."""
    frames: list[bytes] = []
    pos = 0
    while pos < len(data) and len(frames) < MAX_FRAMES:
        size = data[pos]
        pos += 1
        if size == 255:
            size = int.from_bytes(data[pos:pos + 4], "big")
            pos += 4
        frames.append(data[pos:pos + size])
        pos += size
    return frames


VALUE_KINDS = ("bytes", "int", "str", "none", "float", "list", "tuple", "bytearray")
"""What ``python_value`` builds, chosen by the first input byte (modulo the count)."""


def python_value(data: bytes, depth: int = 0) -> object:
    """Any Python value from fuzz bytes: byte 0 picks the kind, the rest fills it (total on any input).

    Integers run up to 2**64, so a decoder that calls ``bytes(n)`` on one tries to
    allocate exabytes (a MemoryError, which the harness reports as a finding). Lists
    hold one element per packed frame, each itself a value, so frames and non-frames mix.
    """
    if not data:
        return b""
    kind, rest = VALUE_KINDS[data[0] % len(VALUE_KINDS)], data[1:]
    if kind == "bytes":
        return rest
    if kind == "int":
        return int.from_bytes(rest[:8].ljust(8, b"\0"), "big", signed=bool(rest[8:9]))
    if kind == "str":
        return rest.decode("latin-1")
    if kind == "none":
        return None
    if kind == "float":
        return float(len(rest)) / 3
    if kind == "bytearray":
        return bytearray(rest)
    items = [python_value(f, depth + 1) if depth < 3 else f for f in unpack_frames(rest)]
    return items if kind == "list" else tuple(items)


def value_input(value: object) -> bytes:
    """The ``python_value`` encoding of bytes, or of a list of bytes frames (for seeds)."""
    if isinstance(value, bytes):
        return bytes([VALUE_KINDS.index("bytes")]) + value
    assert isinstance(value, list)
    return bytes([VALUE_KINDS.index("list")]) + pack_frames([value_input(f) for f in value])


def _check_wire_decode(data: bytes) -> object:
    body = wire.decode(data)
    again = wire.decode(wire.encode(body))
    if again != body:
        raise FuzzFinding(f"wire round trip changed a {type(body).__name__}")
    return body


def _check_wire_decode_envelope(data: bytes) -> object:
    envelope = wire.decode_envelope(data)
    again = wire.decode_envelope(wire.encode(envelope))
    if again != envelope:
        raise FuzzFinding("wire round trip changed an Envelope")
    return envelope


def _legacy_runner(fn: Callable[[list[bytes]], object]) -> Callable[[bytes], object]:
    def run(data: bytes) -> object:
        return fn(unpack_frames(data))

    return run


def _legacy_modules() -> Iterator[ModuleType]:
    for name in LEGACY_MODULES:
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue  # not written yet: fuzzed once it lands


def _own_functions(module: ModuleType, prefix: str) -> list[tuple[str, Callable[..., object]]]:
    """Public functions named ``prefix*`` defined in (not imported into) ``module``."""
    found: list[tuple[str, Callable[..., object]]] = []
    for name in sorted(dir(module)):
        fn = getattr(module, name)
        if name.startswith(prefix) and inspect.isfunction(fn) and fn.__module__ == module.__name__:
            found.append((name, fn))
    return found


def discover() -> list[Target]:
    """Every fuzz target available in this tree."""
    targets = [
        Target("wire.decode", _check_wire_decode, WireError, frames=False),
        Target("wire.decode_envelope", _check_wire_decode_envelope, WireError, frames=False),
        Target("wire.decode.any_value", lambda data: _check_wire_decode(python_value(data)),  # type: ignore[arg-type]
               WireError, frames=False, values=True),
    ]
    for module in _legacy_modules():
        short = module.__name__.rsplit(".", 1)[-1]
        for name, fn in _own_functions(module, "parse_"):
            targets.append(Target(f"legacy.{short}.{name}", _legacy_runner(fn), PdprotoError, True))
    try:
        package = importlib.import_module(LEGACY_PACKAGE)
    except ImportError:
        package = None
    for name in LEGACY_PACKAGE_FUNCTIONS:
        entry = getattr(package, name, None)
        if callable(entry):
            targets.append(Target(f"legacy.{name}", _legacy_runner(entry), PdprotoError, True))
    return targets


def _body_kinds() -> list[type[Message]]:
    return [
        f.message_type._concrete_class  # type: ignore[union-attr]
        for f in Envelope.DESCRIPTOR.oneofs_by_name[wire.BODY_ONEOF].fields
    ]


@functools.cache
def wire_seeds(per_kind: int = 4, seed: int = 0) -> tuple[bytes, ...]:
    """Valid Envelope frames of every body kind, plus SGLang's ASCII frames."""
    rng = random.Random(seed)
    seeds = [wire.encode(random_message(kind, rng)) for kind in _body_kinds() for _ in range(per_kind)]
    seeds.append(wire.encode(Envelope(capabilities=["packed"], abort=AbortNotification())))
    return tuple(seeds) + SGLANG_FRAMES


def _message_param(fn: Callable[..., object]) -> type[Message] | None:
    """The protobuf type of a ``build_*`` function's first parameter."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # a builder with unresolvable hints is simply not used for seeds
        return None
    params = list(inspect.signature(fn).parameters)
    kind = hints.get(params[0]) if params else None
    return kind if isinstance(kind, type) and issubclass(kind, Message) else None


@functools.cache
def legacy_seeds_by_parser(attempts: int = 40, seed: int = 0) -> dict[str, tuple[bytes, ...]]:
    """Frame lists from every legacy ``build_*`` on generated messages, keyed by the parser.

    ``legacy.mooncake.build_abort``'s output seeds ``legacy.mooncake.parse_abort``.
    """
    rng = random.Random(seed)
    seeds: dict[str, tuple[bytes, ...]] = {}
    for module in _legacy_modules():
        short = module.__name__.rsplit(".", 1)[-1]
        for name, build in _own_functions(module, "build_"):
            kind = _message_param(build)
            if kind is None:
                continue
            built: list[bytes] = []
            for _ in range(attempts):
                message = random_message(kind, rng)
                if short in kind.DESCRIPTOR.fields_by_name:
                    # A registration's transport oneof named like the module (mooncake, nixl).
                    getattr(message, short).SetInParent()
                try:
                    frames = build(message)
                except Exception:  # builders are not under test here; skip what they refuse
                    continue
                built.append(pack_frames(list(cast(list[bytes], frames))))
                if len(built) >= 6:
                    break
            seeds[f"legacy.{short}.parse_{name.removeprefix('build_')}"] = tuple(built)
    return seeds


def legacy_seeds() -> list[bytes]:
    """Every legacy seed, plus single interesting frames."""
    out = [data for group in legacy_seeds_by_parser().values() for data in group]
    return out + [pack_frames([frame]) for frame in INTERESTING_FRAMES]


def seeds_for(target: Target) -> list[bytes]:
    """Seed corpus for one target: its own builder's frames when it has one."""
    if target.values:
        frame_lists = [unpack_frames(data) for data in legacy_seeds()]
        return ([value_input(seed) for seed in wire_seeds()] + [value_input([s]) for s in wire_seeds()]
                + [value_input(frames) for frames in frame_lists]
                + [bytes([i]) + b"\xff" * 9 for i in range(len(VALUE_KINDS))])
    if not target.frames:
        return list(wire_seeds())
    own = legacy_seeds_by_parser().get(target.name)
    if own:
        return list(own) + [pack_frames([frame]) for frame in INTERESTING_FRAMES]
    return legacy_seeds()
