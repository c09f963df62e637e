"""Coverage-guided fuzzing of one target with atheris (libFuzzer), in its own process.

Usage (tests.fuzz.run starts it):
    python -m tests.fuzz.atheris_main TARGET RUNS STATS_JSON FINDINGS_DIR CORPUS_DIR [libFuzzer flags]

Crashes are counted and saved by the harness and fuzzing goes on, so one run
reports every distinct finding; libFuzzer's -timeout catches hangs.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import atheris

# Instrument pdproto (not its generated code) so coverage guides the mutations.
with atheris.instrument_imports(include=["pdproto"], exclude=["pdproto.v1"]):
    from pdproto import wire
    from tests.fuzz.harness import Stats, _mutate_frames, check_one
    from tests.fuzz.targets import Target, discover, pack_frames, seeds_for, unpack_frames

    # Discovery imports the legacy modules, so it runs inside the instrumented block.
    TARGETS = {t.name: t for t in discover()}

STATS_EVERY = 1000


def structured_mutator(target: Target) -> Callable[[bytes, int, int], bytes]:
    """A libFuzzer custom mutator that keeps inputs well framed most of the time.

    Byte-level mutations of a packed frame list or an Envelope frame mostly break
    the length fields, so parsers would rarely get past them. Here frame lists are
    mutated frame by frame (or whole frames dropped, swapped, replaced), and
    Envelope payloads are mutated with the header length fixed up afterwards.
    """
    pool = seeds_for(target)

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.2:  # plain libFuzzer mutation, lengths and all
            return bytes(atheris.Mutate(data, max_size))
        if target.frames:
            frames = unpack_frames(data)
            if frames and rng.random() < 0.6:
                i = rng.randrange(len(frames))
                frames[i] = bytes(atheris.Mutate(frames[i], len(frames[i]) + 16))
            else:
                frames = _mutate_frames(frames, rng, pool)
            return pack_frames(frames)[:max_size]
        header, payload = data[: wire.HEADER_SIZE], data[wire.HEADER_SIZE:]
        if len(header) < wire.HEADER_SIZE or not wire.is_envelope_frame(header):
            header = wire.encode(wire.decode_envelope(rng.choice(pool[:-8])))[: wire.HEADER_SIZE]
        payload = bytes(atheris.Mutate(payload, max(0, max_size - wire.HEADER_SIZE)))
        return (header[:6] + len(payload).to_bytes(4, "big") + payload)[:max_size]

    return mutator


def main() -> None:
    """Fuzz one target for RUNS inputs, writing stats as it goes (libFuzzer exits without atexit)."""
    name, runs_text, stats_path, findings, corpus, *flags = sys.argv[1:]
    runs = int(runs_text)
    target = TARGETS[name]
    stats = Stats(name)
    stats_file = Path(stats_path)
    findings_dir = Path(findings)

    def write_stats() -> None:
        stats_file.write_text(json.dumps(stats.as_dict()))

    def one_input(data: bytes) -> None:
        # libFuzzer owns SIGALRM for -timeout, so the harness's own alarm is off here.
        check_one(target, data, stats, findings_dir, time_bound=False)
        if stats.inputs % STATS_EVERY == 0 or stats.inputs >= runs:
            write_stats()

    write_stats()
    atheris.Setup([sys.argv[0], f"-runs={runs}", *flags, corpus], one_input,
                  custom_mutator=structured_mutator(target))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
