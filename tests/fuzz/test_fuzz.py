"""Short fuzz runs (part of make test) and checks that the harness itself works.

``make fuzz`` runs the long version: 100,000 atheris inputs per target.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproto.errors import PdprotoError, Reason, WireError
from tests.fuzz import run
from tests.fuzz.harness import Stats, check_one, mutation_inputs
from tests.fuzz.targets import (
    LEGACY_MODULES,
    Target,
    discover,
    pack_frames,
    seeds_for,
    unpack_frames,
)

TARGETS = discover()
SHORT_RUNS = 1000


def test_targets_cover_wire_and_every_legacy_parser() -> None:
    names = {t.name for t in TARGETS}
    assert {"wire.decode", "wire.decode_envelope", "wire.decode.any_value"} <= names
    for module_name in LEGACY_MODULES:
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        short = module_name.rsplit(".", 1)[-1]
        parsers = [n for n, f in inspect.getmembers(module, inspect.isfunction)
                   if n.startswith("parse_") and f.__module__ == module_name]
        assert parsers, f"{module_name} has no parse_* functions"
        assert {f"legacy.{short}.{n}" for n in parsers} <= names


def test_every_target_has_seeds_its_parser_accepts() -> None:
    # Seeds come from valid encodings; at least one per target must parse.
    for target in TARGETS:
        stats = Stats(target.name)
        for data in seeds_for(target):
            check_one(target, data, stats, None)
        assert stats.ok > 0, target.name
        assert stats.crashes == 0, stats.findings


def test_short_mutation_run_over_every_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = run.main(["--runs", str(SHORT_RUNS), "--engine", "mutate", "--findings", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    for target in TARGETS:
        line = next(l for l in out.splitlines() if l.startswith(target.name + " "))
        assert int(line.split()[2]) >= SHORT_RUNS, line
    assert not list(tmp_path.iterdir())  # no findings saved


@pytest.mark.process
@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_short_atheris_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = run.main(["--runs", "2000", "--engine", "atheris", "--jobs", "2",
                       "--targets", r"^(wire\.decode|legacy\.parse_any)$",
                       "--findings", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 targets, " in out


@settings(max_examples=max(50, settings().max_examples))
@given(target=st.sampled_from(TARGETS), data=st.binary(max_size=300))
def test_hypothesis_bytes_raise_only_typed_errors(target: Target, data: bytes) -> None:
    stats = Stats(target.name)
    assert check_one(target, data, stats, None) != "crash", stats.findings


@settings(max_examples=max(50, settings().max_examples))
@given(target=st.sampled_from(TARGETS), seed=st.integers(0, 2**32 - 1))
def test_hypothesis_mutated_seeds_raise_only_typed_errors(target: Target, seed: int) -> None:
    stats = Stats(target.name)
    for data in mutation_inputs(seeds_for(target), 40, frames=target.frames, seed=seed):
        check_one(target, data, stats, None)
    assert stats.crashes == 0, stats.findings


@given(st.lists(st.binary(max_size=300), max_size=20))
def test_frame_packing_round_trips(frames: list[bytes]) -> None:
    assert unpack_frames(pack_frames(frames)) == frames


def _raise_key_error(data: bytes) -> object:
    table: dict[bytes, object] = {}
    return table[data]


def _raise_typed(data: bytes) -> object:
    raise WireError("typed", reason=Reason.WIRE_MALFORMED)


def _spin(data: bytes) -> object:
    while True:  # a pure-Python hang
        time.sleep(0.001)


def test_harness_counts_typed_errors_and_saves_crashes(tmp_path: Path) -> None:
    stats = Stats("t")
    assert check_one(Target("t", _raise_typed, PdprotoError, False), b"x", stats, tmp_path) == "typed"
    assert check_one(Target("t", _raise_key_error, PdprotoError, False), b"y", stats, tmp_path) == "crash"
    assert (stats.inputs, stats.typed, stats.crashes) == (2, 1, 1)
    saved = list((tmp_path / "t").glob("*.bin"))
    assert [p.read_bytes() for p in saved] == [b"y"]
    assert "KeyError" in stats.findings[0]


def test_harness_bounds_the_time_per_input() -> None:
    stats = Stats("hang")
    assert check_one(Target("hang", _spin, PdprotoError, False), b"", stats, None, seconds=0.05) == "crash"
    assert "InputTimeout" in stats.findings[0]


def test_replay_reruns_a_saved_input(tmp_path: Path) -> None:
    saved = tmp_path / "input.bin"
    saved.write_bytes(b"None")
    assert run.main(["--replay", str(saved), "--target", "wire.decode"]) == 0


def test_harness_puts_back_an_outer_alarm() -> None:
    # pytest-timeout and other callers may have their own SIGALRM timer pending.
    import signal

    signal.setitimer(signal.ITIMER_REAL, 1000.0)
    try:
        check_one(TARGETS[0], b"x", Stats("t"), None)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 1000.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
