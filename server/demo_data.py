"""Deterministic KV contents for the demo and reliability runs, and their monolithic reference.

Every row byte is a function of (layer, global token, byte offset), so what a decode rank
should hold after a transfer is computed from first principles, never copied from the sender.
A row is 1152 bytes (576 bf16 values, the MLA row) viewed as 288 little-endian uint32 words:
``word[w] = mix(layer, token) ^ pattern(layer, w)``. ``mix`` is a bijection of the token for a
fixed layer, so two different tokens never produce the same row and a misplaced row is caught;
``pattern`` differs per word, so a shifted row is caught too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

ROW_BYTES = 1152
"""Bytes per token per layer: 576 values of bf16 (the MLA latent row)."""

WORDS = ROW_BYTES // 4
BACKGROUND = 0xA5
"""Byte every decode buffer starts with; rows nobody writes must still hold it."""

_U32 = np.uint32
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
Pool = Sequence[U8]
"""One (rows x 1152) uint8 array per layer."""


def _mix(x: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """A bijective 32-bit finalizer (xorshift-multiply), vectorised."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U32(16))
        x = x * _U32(0x7FEB352D)
        x = x ^ (x >> _U32(15))
        x = x * _U32(0x846CA68B)
        x = x ^ (x >> _U32(16))
    return x


def _word_pattern(layer: int) -> npt.NDArray[np.uint32]:
    """Per-word pattern of one layer (288 words)."""
    w = np.arange(WORDS, dtype=_U32)
    with np.errstate(over="ignore"):
        return _mix(w * _U32(0x9E3779B9) + _U32((layer * 0x632BE5AB + 0x1234567) & 0xFFFFFFFF))


def token_rows(layer: int, tokens: I64) -> U8:
    """Rows (len(tokens) x 1152 bytes) a monolithic run holds for these global tokens of a layer."""
    t = np.asarray(tokens, dtype=np.int64).astype(_U32)
    with np.errstate(over="ignore"):
        h = _mix(t + _U32((layer * 0x85EBCA77) & 0xFFFFFFFF))
    words = h[:, None] ^ _word_pattern(layer)[None, :]
    return words.astype("<u4", copy=False).view(np.uint8).reshape(len(t), ROW_BYTES)


@dataclass(frozen=True)
class Shard:
    """Which tokens of a request one rank holds: global token p on rank p % size."""

    size: int
    """DCP size of the side; dense is 1."""
    rank: int
    """This rank's index in the DCP group."""


def owned_tokens(shard: Shard, prefix: int, total: int) -> I64:
    """Global tokens in [prefix, total) that this rank holds, in rank-local order."""
    first = prefix + ((shard.rank - prefix) % shard.size)
    return np.arange(first, total, shard.size, dtype=np.int64)


def local_rows(pages: list[int] | npt.NDArray[np.int64], count: int, page_size: int) -> I64:
    """Physical rows of the first ``count`` rank-local positions laid out over ``pages``."""
    loc = np.arange(count, dtype=np.int64)
    pg = np.asarray(pages, dtype=np.int64)
    if count > len(pg) * page_size:
        raise ValueError(f"{count} rows do not fit in {len(pg)} pages of {page_size}")
    return pg[loc // page_size] * page_size + loc % page_size


def fill_source(
    pool: Pool, shard: Shard, pages: list[int], *, prefix: int, total: int, page_size: int
) -> int:
    """Write a prefill rank's rows of tokens [prefix, total) into ``pool``; returns rows."""
    toks = owned_tokens(shard, prefix, total)
    rows = local_rows(pages, len(toks), page_size)
    for layer, arr in enumerate(pool):
        arr[rows] = token_rows(layer, toks)
    return len(toks)


def fill_prefix(pool: Pool, shard: Shard, pages: list[int], *, prefix: int, page_size: int) -> None:
    """Write the decode-side prefix tokens [0, prefix) this rank already holds (the cache hit)."""
    toks = owned_tokens(shard, 0, prefix)
    rows = local_rows(pages, len(toks), page_size)
    for layer, arr in enumerate(pool):
        arr[rows] = token_rows(layer, toks)


@dataclass(frozen=True)
class Mismatch:
    """First differing byte found by ``verify``."""

    layer: int
    row: int
    byte: int
    expected: int
    actual: int


def verify(
    pool: Pool,
    shard: Shard,
    *,
    prefix_pages: list[int],
    dst_pages: list[int],
    prefix: int,
    total: int,
    page_size: int,
) -> tuple[int, Mismatch | None]:
    """Compare every byte of a decode pool with what a monolithic run holds there; (bytes checked, first mismatch)."""
    pre = owned_tokens(shard, 0, prefix)
    post = owned_tokens(shard, prefix, total)
    pre_rows = local_rows(prefix_pages, len(pre), page_size)
    post_rows = local_rows(dst_pages, len(post), page_size)
    checked = 0
    for layer, arr in enumerate(pool):
        expected = np.full(arr.shape, BACKGROUND, dtype=np.uint8)
        expected[pre_rows] = token_rows(layer, pre)
        expected[post_rows] = token_rows(layer, post)
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


def reset(pool: Pool, *, prefix_pages: list[int], dst_pages: list[int], page_size: int) -> None:
    """Put the background back on every page a request used, so the next request starts clean."""
    pages = np.asarray(list(prefix_pages) + list(dst_pages), dtype=np.int64)
    if pages.size == 0:
        return
    rows = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).ravel()
    for arr in pool:
        arr[rows] = BACKGROUND
