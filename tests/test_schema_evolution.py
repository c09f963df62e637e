"""Two generations of a small schema, compiled at test time, talking through pdproto.wire.

Generation 2 (tests/evolution/gen2) adds a field, a presence-tracked field, an
enum value and a body kind to generation 1. Both use the same package and names
(as two releases of one schema would), so each is loaded into its own
descriptor pool.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto import wire
from pdproto.errors import Reason, WireError
from tests.fuzz.messages import messages

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
EVOLUTION = ROOT / "tests" / "evolution"
PROTO = "pdevo/v1/evo.proto"


def load_generation(name: str, tmp: Path) -> dict[str, type[Message]]:
    """Compile one generation with grpc_tools.protoc into ``tmp``; return its classes by name."""
    out = tmp / f"{name}.binpb"
    # In a subprocess: protoc's bundled C++ protobuf and NIXL's cannot share a process
    # (loading NIXL after it aborts the interpreter, and later tests load NIXL).
    run = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{EVOLUTION / name}",
         f"--descriptor_set_out={out}", PROTO],
        capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, f"protoc failed on {name}: {run.stderr}"
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    package = pool.FindFileByName(PROTO)
    return {
        msg_name: message_factory.GetMessageClass(msg)
        for msg_name, msg in package.message_types_by_name.items()
    }


@pytest.fixture(scope="module")
def gens(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, type[Message]], dict[str, type[Message]]]:
    """(generation 1 classes, generation 2 classes)."""
    tmp = tmp_path_factory.mktemp("evolution")
    return load_generation("gen1", tmp), load_generation("gen2", tmp)


Gens = tuple[dict[str, type[Message]], dict[str, type[Message]]]
RED, BLUE = 1, 2


def gen2_note_frame(g2: dict[str, type[Message]], **note: object) -> bytes:
    """A generation-2 writer's frame carrying a Note, at version 1.1."""
    envelope = g2["Envelope"](version=g2["Version"](major=1, minor=1), capabilities=["evo"])
    getattr(envelope, "note").CopyFrom(g2["Note"](**note))
    return wire.encode_envelope(envelope)


def test_generation_2_is_an_additive_change() -> None:
    # buf's own breaking check agrees that gen2 only adds (the schemas follow our rules).
    run = subprocess.run(
        [str(ROOT / ".venv/bin/buf"), "breaking", str(EVOLUTION / "gen2"),
         "--against", str(EVOLUTION / "gen1")],
        capture_output=True, text=True, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_old_reader_keeps_new_fields_and_enum_values(gens: Gens) -> None:
    g1, g2 = gens
    data = gen2_note_frame(g2, room=9, text="hi", color=BLUE, palette=[RED, BLUE],
                           generation=7, trace_id="t-1")
    old = wire.decode_envelope(data, g1["Envelope"])
    note = getattr(old, "note")
    assert (note.room, note.text) == (9, "hi")
    assert note.color == BLUE  # unknown to gen1, kept as its number (open enum)
    assert list(note.palette) == [RED, BLUE]
    assert "generation" not in note.DESCRIPTOR.fields_by_name
    assert (old.version.major, old.version.minor) == (1, 1)  # type: ignore[attr-defined]

    # The old reader forwards the frame unchanged, byte for byte...
    assert wire.encode_envelope(old) == data
    # ...and after editing a field it knows, the new fields still survive.
    note.room = 10
    new = wire.decode_envelope(wire.encode_envelope(old), g2["Envelope"])
    new_note = getattr(new, "note")
    assert (new_note.room, new_note.generation, new_note.trace_id) == (10, 7, "t-1")
    assert new_note.HasField("trace_id")
    assert new_note.color == BLUE and list(new_note.palette) == [RED, BLUE]


def test_old_reader_body_is_the_note_with_unknowns(gens: Gens) -> None:
    g1, g2 = gens
    data = gen2_note_frame(g2, room=3, generation=5)
    body = wire.decode(data, envelope_type=g1["Envelope"])
    assert type(body) is g1["Note"]
    # Forwarded inside a fresh old envelope, generation 2 still reads its field.
    fresh = g1["Envelope"]()
    getattr(fresh, "note").CopyFrom(body)
    again = wire.decode(wire.encode_envelope(fresh), envelope_type=g2["Envelope"])
    assert getattr(again, "generation") == 5


def test_old_reader_and_a_new_body_kind(gens: Gens) -> None:
    g1, g2 = gens
    envelope = g2["Envelope"](version=g2["Version"](major=1, minor=1), ping=g2["Ping"](seq=4))
    data = wire.encode_envelope(envelope)
    with pytest.raises(WireError) as info:
        wire.decode(data, envelope_type=g1["Envelope"])
    assert info.value.reason is Reason.WIRE_UNKNOWN_BODY
    kept = wire.decode_envelope(data, g1["Envelope"])
    assert wire.encode_envelope(kept) == data
    assert wire.decode_envelope(wire.encode_envelope(kept), g2["Envelope"]) == envelope


def test_new_reader_fills_defaults_for_an_old_writer(gens: Gens) -> None:
    g1, g2 = gens
    old = g1["Envelope"](version=g1["Version"](major=1, minor=0), note=g1["Note"](room=2, color=RED))
    new = wire.decode_envelope(wire.encode_envelope(old), g2["Envelope"])
    note = getattr(new, "note")
    assert (note.room, note.color, note.generation) == (2, RED, 0)
    assert not note.HasField("trace_id")
    assert (new.version.major, new.version.minor) == (1, 0)  # type: ignore[attr-defined]
    assert wire.decode(wire.encode_envelope(old), envelope_type=g2["Envelope"]) == note


def test_another_major_is_rejected_across_generations(gens: Gens) -> None:
    g1, g2 = gens
    envelope = g2["Envelope"](version=g2["Version"](major=2, minor=0), note=g2["Note"](room=1))
    with pytest.raises(WireError) as info:
        wire.decode_envelope(wire.encode_envelope(envelope), g1["Envelope"])
    assert info.value.reason is Reason.UNSUPPORTED_VERSION


@settings(max_examples=max(10, settings().max_examples // 4))
@given(data=st.data())
def test_any_generation_2_note_survives_a_generation_1_hop(gens: Gens, data: st.DataObject) -> None:
    g1, g2 = gens
    note = data.draw(messages(g2["Note"]))
    envelope = g2["Envelope"](version=g2["Version"](major=1, minor=1))
    getattr(envelope, "note").CopyFrom(note)
    hop = wire.decode_envelope(wire.encode_envelope(envelope), g1["Envelope"])
    assert wire.decode_envelope(wire.encode_envelope(hop), g2["Envelope"]) == envelope
