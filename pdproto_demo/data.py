"""Deterministic KV contents, their monolithic reference, and the whole-pool byte check.

Every row byte is a function of (layer, token, byte offset), so what a decode rank should
hold after a transfer is computed from first principles, never copied from the sender. A
row is viewed as little-endian uint32 words (1152 bytes, the MLA row, by default):
``word[w] = mix(layer, token) ^ pattern(layer, w)``. ``mix`` is a bijection of the token for a
fixed layer, so two different tokens never produce the same row and a misplaced row is caught;
``pattern`` differs per word, so a shifted row is caught too.

The demo's prefill writes ``token_rows`` of each global token (``model.HeadReference``); the
synthetic prefill of ``pdproto serve`` holds ``token_rows`` of each source row
(``SyntheticSpec.rows``). Either is a ``Reference`` that ``verify`` checks a pool against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

ROW_BYTES = 1152
"""Bytes per token per layer: 576 values of bf16 (the MLA latent row)."""

BACKGROUND = 0xA5
"""Byte every decode buffer starts with; rows nobody writes must still hold it."""

FUTURE_FIELD = bytes([0xF8, 0xF0, 0x04, 0x01])
"""Field 9999, varint 1: what a newer schema generation would add; protobuf keeps it as unknown."""

_U32 = np.uint32
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
Pool = Sequence[U8]
"""One (rows x row bytes) uint8 array per layer."""


def _mix(x: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """A bijective 32-bit finalizer (xorshift-multiply), vectorised."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U32(16))
        x = x * _U32(0x7FEB352D)
        x = x ^ (x >> _U32(15))
        x = x * _U32(0x846CA68B)
        x = x ^ (x >> _U32(16))
    return x


def _word_pattern(layer: int, words: int) -> npt.NDArray[np.uint32]:
    """Per-word pattern of one layer (``words`` words)."""
    w = np.arange(words, dtype=_U32)
    with np.errstate(over="ignore"):
        return _mix(w * _U32(0x9E3779B9) + _U32((layer * 0x632BE5AB + 0x1234567) & 0xFFFFFFFF))


def token_rows(layer: int, tokens: I64, row_bytes: int = ROW_BYTES) -> U8:
    """Rows (len(tokens) x row_bytes) a monolithic run holds for these tokens of a layer."""
    t = np.asarray(tokens, dtype=np.int64).astype(_U32)
    words = -(-row_bytes // 4)
    with np.errstate(over="ignore"):
        h = _mix(t + _U32((layer * 0x85EBCA77) & 0xFFFFFFFF))
    rows = h[:, None] ^ _word_pattern(layer, words)[None, :]
    out: U8 = rows.astype("<u4", copy=False).view(np.uint8).reshape(len(t), words * 4)[:, :row_bytes]
    return out


class Reference(Protocol):
    """What a decode must hold: the rows of a request's tokens, per layer."""

    def rows(self, layer: int, room: int, tokens: I64) -> U8:
        """Rows (len(tokens) x row bytes) of ``tokens`` (positions in the request) of ``layer``."""
        ...


@dataclass(frozen=True)
class Shard:
    """Which tokens of a request one rank holds: global token p on rank p % size."""

    size: int
    """DCP size of the side; dense is 1."""
    rank: int
    """This rank's index in the DCP group."""


@dataclass(frozen=True)
class Placement:
    """Tokens [first, end) of a request, laid over a rank's ``pages`` from rank-local position 0."""

    room: int
    """Request id."""
    first: int
    """First global token."""
    end: int
    """One past the last global token."""
    pages: Sequence[int]
    """The rank's pages, in token order."""


def local_rows(pages: Sequence[int] | I64, count: int, page_size: int) -> I64:
    """Physical rows of the first ``count`` rank-local positions laid out over ``pages``."""
    loc = np.arange(count, dtype=np.int64)
    pg = np.asarray(pages, dtype=np.int64)
    if count > len(pg) * page_size:
        raise ValueError(f"{count} rows do not fit in {len(pg)} pages of {page_size}")
    return pg[loc // page_size] * page_size + loc % page_size


def _placed(shard: Shard, at: Placement, page_size: int) -> tuple[I64, I64]:
    """(global tokens, physical rows) of one placement on this rank: the tokens it holds, in rank-local order."""
    toks = np.arange(at.first + (shard.rank - at.first) % shard.size, at.end, shard.size, dtype=np.int64)
    return toks, local_rows(at.pages, len(toks), page_size)


def fill(pool: Pool, shard: Shard, at: Placement, *, page_size: int, reference: Reference) -> int:
    """Write this rank's rows of a placement (a prefill's source, or a decode's cached prefix); returns rows."""
    toks, rows = _placed(shard, at, page_size)
    for layer, arr in enumerate(pool):
        arr[rows] = reference.rows(layer, at.room, toks)
    return len(toks)


@dataclass(frozen=True)
class Mismatch:
    """First differing byte found by ``verify``."""

    layer: int
    row: int
    byte: int
    expected: int
    actual: int


def verify(pool: Pool, shard: Shard, placements: Sequence[Placement], *, page_size: int,
           reference: Reference, background: int = BACKGROUND) -> tuple[int, Mismatch | None]:
    """Compare every byte of a decode pool with what a monolithic run holds there; (bytes checked, first mismatch).

    Rows of the placements must hold the reference's rows; every other byte must still
    hold ``background``.
    """
    placed = [(at.room, *_placed(shard, at, page_size)) for at in placements]
    checked = 0
    for layer, arr in enumerate(pool):
        expected = np.full(arr.shape, background, dtype=np.uint8)
        for room, toks, rows in placed:
            expected[rows] = reference.rows(layer, room, toks)
        checked += arr.nbytes
        if not np.array_equal(arr, expected):
            bad = np.argwhere(arr != expected)[0]
            r, b = int(bad[0]), int(bad[1])
            return checked, Mismatch(layer, r, b, int(expected[r, b]), int(arr[r, b]))
    return checked, None


def page_list(first: int, count: int, *, scramble: bool) -> list[int]:
    """``count`` distinct pages from ``first``; scrambled ones are non-contiguous (exercise run breaks)."""
    pages = list(range(first, first + count))
    if scramble and count > 2:
        # Reverse pairs of pages so consecutive pages are never adjacent in memory.
        for i in range(0, count - 1, 2):
            pages[i], pages[i + 1] = pages[i + 1], pages[i]
    return pages


def reset(pool: Pool, pages: Sequence[int], *, page_size: int, background: int = BACKGROUND) -> None:
    """Put the background back on every page a request used, so the next request starts clean."""
    pg = np.asarray(list(pages), dtype=np.int64)
    if pg.size == 0:
        return
    rows = (pg[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).ravel()
    for arr in pool:
        arr[rows] = background
