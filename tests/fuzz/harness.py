"""Run one fuzz input against one target and classify what came out.

Outcomes: ``ok`` (accepted), ``typed`` (a typed error the target may raise),
``crash`` (anything else, a hang included). Crashes are findings: the input and
traceback are saved so they can be replayed with ``python -m tests.fuzz.run
--replay FILE``.
"""

from __future__ import annotations

import hashlib
import random
import signal
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from tests.fuzz.targets import INTERESTING_FRAMES, Target, pack_frames, unpack_frames

PER_INPUT_SECONDS = 10.0
"""Time bound per input; past it the input counts as a hang (a crash)."""

MAX_SAVED_FINDINGS = 20
"""Distinct findings saved per target (the count still covers all of them)."""


class InputTimeout(Exception):
    """One input ran past PER_INPUT_SECONDS."""


@dataclass
class Stats:
    """Counts for one target."""

    target: str
    inputs: int = 0
    ok: int = 0
    typed: int = 0
    crashes: int = 0
    findings: list[str] = field(default_factory=list)
    signatures: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly form (used by the atheris subprocess)."""
        return {"target": self.target, "inputs": self.inputs, "ok": self.ok,
                "typed": self.typed, "crashes": self.crashes, "findings": self.findings}


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise InputTimeout("input ran past its time bound")


def check_one(target: Target, data: bytes, stats: Stats, findings_dir: Path | None,
              *, time_bound: bool = True, seconds: float = PER_INPUT_SECONDS) -> str:
    """Run ``target`` on ``data``; count and return the outcome ('ok', 'typed', 'crash')."""
    stats.inputs += 1
    previous = None
    outer = (0.0, 0.0)
    started = time.monotonic()
    if time_bound:
        # SIGALRM only interrupts Python code; a hang inside C is caught by the
        # caller's whole-run timeout (atheris: libFuzzer -timeout).
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        outer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        target.run(data)
    except target.allowed:
        stats.typed += 1
        return "typed"
    except Exception as exc:  # the point of fuzzing: any other exception is a finding
        stats.crashes += 1
        _save(target, data, exc, stats, findings_dir)
        return "crash"
    finally:
        if time_bound:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer[0] > 0:
                # Someone else's alarm (pytest-timeout) was pending: put it back.
                left = max(outer[0] - (time.monotonic() - started), 0.001)
                signal.setitimer(signal.ITIMER_REAL, left, outer[1])
    stats.ok += 1
    return "ok"


def _save(target: Target, data: bytes, exc: BaseException, stats: Stats,
          findings_dir: Path | None) -> None:
    """Keep one input per distinct (exception type, raising line)."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
    signature = f"{type(exc).__name__}@{where}"
    if signature in stats.signatures or len(stats.signatures) >= MAX_SAVED_FINDINGS:
        return
    stats.signatures.add(signature)
    summary = f"{signature}: {exc!r}"[:300]
    if findings_dir is not None:
        folder = findings_dir / target.name
        folder.mkdir(parents=True, exist_ok=True)
        stem = hashlib.sha1(data).hexdigest()[:16]
        (folder / f"{stem}.bin").write_bytes(data)
        text = "".join(traceback.format_exception(exc))
        (folder / f"{stem}.txt").write_text(f"target: {target.name}\n{text}")
        summary += f" -> {folder / stem}.bin"
    stats.findings.append(summary)


# ---------------------------------------------------------------- mutation engine


def mutate(data: bytes, rng: random.Random, *, frames: bool, pool: list[bytes]) -> bytes:
    """One random mutation of ``data`` (byte level, or frame level for frame targets)."""
    if frames and rng.random() < 0.5:
        return pack_frames(_mutate_frames(unpack_frames(data), rng, pool))
    buf = bytearray(data)
    op = rng.randrange(7)
    if op == 0 and buf:  # flip a bit
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:  # set a byte to an edge value
        buf[rng.randrange(len(buf))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    elif op == 2:  # insert random bytes
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif op == 3 and buf:  # delete a range
        i = rng.randrange(len(buf))
        del buf[i:i + rng.randint(1, 16)]
    elif op == 4:  # truncate
        del buf[rng.randrange(len(buf) + 1):]
    elif op == 5:  # splice with another seed
        other = rng.choice(pool)
        cut = rng.randrange(len(buf) + 1)
        buf = buf[:cut] + other[rng.randrange(len(other) + 1):]
    elif buf:  # duplicate a range
        i = rng.randrange(len(buf))
        buf[i:i] = buf[i:i + rng.randint(1, 32)]
    return bytes(buf)


_EDGE_INTS = (0, 1, -1, 2, 7, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)


def _mutate_frames(frames: list[bytes], rng: random.Random, pool: list[bytes]) -> list[bytes]:
    """One frame-level mutation; some keep each frame's encoding valid to reach deeper checks."""
    op = rng.randrange(7)
    if op >= 5 and frames:
        i = rng.randrange(len(frames))
        if frames[i].lstrip(b"-").isdigit():  # an ASCII integer slot: another valid integer
            frames[i] = str(rng.choice(_EDGE_INTS) if rng.random() < 0.7
                            else rng.randint(-5, 5000)).encode()
        elif op == 5:  # a packed array slot: grow or shrink by whole elements
            width = rng.choice((4, 8))
            frames[i] = frames[i] + bytes(rng.randrange(256) for _ in range(width))
        else:
            frames[i] = frames[i][: -rng.choice((4, 8))]
        return frames
    if op == 0 and frames:  # drop a frame
        del frames[rng.randrange(len(frames))]
    elif op == 1 and frames:  # replace a frame with an interesting value
        frames[rng.randrange(len(frames))] = rng.choice(INTERESTING_FRAMES)
    elif op == 2:  # insert a frame
        frames.insert(rng.randrange(len(frames) + 1), rng.choice(INTERESTING_FRAMES))
    elif op == 3 and len(frames) > 1:  # swap two frames
        i, j = rng.randrange(len(frames)), rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    elif frames:  # borrow a frame from another seed
        other = unpack_frames(rng.choice(pool)) or [b""]
        frames[rng.randrange(len(frames))] = rng.choice(other)
    return frames


def mutation_inputs(seeds: list[bytes], runs: int, *, frames: bool, seed: int = 0) -> Iterator[bytes]:
    """``runs`` inputs: the seeds first, then stacked mutations of them and random bytes."""
    rng = random.Random(seed)
    pool = list(seeds) or [b""]
    for data in pool[:runs]:
        yield data
    for _ in range(max(0, runs - len(pool))):
        if rng.random() < 0.05:
            yield bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
            continue
        data = rng.choice(pool)
        for _ in range(rng.choice((1, 1, 2, 3, 6))):
            data = mutate(data, rng, frames=frames, pool=pool)
        yield data
