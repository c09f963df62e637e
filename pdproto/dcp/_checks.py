"""Input checks for the relayout planner: each bad input raises one typed PlanError.

Kept apart from the arithmetic so that plan.py reads as the formula; every check
names the argument and carries the offending values in the error metadata.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pdproto.errors import PlanError, Reason

I64 = npt.NDArray[np.int64]

MAX_SIZE = 2**31 - 1
"""Largest page size or DCP size: the proto fields are uint32 and products must stay in int64."""

MAX_ROW = 2**62
"""Largest row index (and token position) the planner will compute, far from int64 overflow."""

PageList = Sequence[int] | npt.NDArray[np.integer]


def _int_in(name: str, value: object, low: int, high: int, reason: Reason) -> int:
    """The value as a Python int in ``low..high``; bools, non-integers and values outside raise ``reason``."""
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PlanError(f"{name} must be an integer, got {value!r}", reason=reason,
                        metadata={"argument": name, "value": value}) from None
    if not low <= n <= high:
        raise PlanError(f"{name}={n} is outside {low}..{high}", reason=reason,
                        metadata={"argument": name, "value": n, "low": low, "high": high})
    return n


def size(name: str, value: object) -> int:
    """A page size or DCP size: an integer in 1..2**31-1 (PLAN_BAD_SIZE otherwise)."""
    return _int_in(name, value, 1, MAX_SIZE, Reason.PLAN_BAD_SIZE)


def rank(name: str, value: object, group_size: int) -> int:
    """A DCP rank: an integer in 0..group_size-1 (PLAN_RANK_OUT_OF_RANGE otherwise)."""
    return _int_in(name, value, 0, group_size - 1, Reason.PLAN_RANK_OUT_OF_RANGE)


def offset(name: str, value: object) -> int:
    """A non-negative offset or count, bounded so positions stay in int64 (PLAN_BAD_OFFSET otherwise)."""
    return _int_in(name, value, 0, MAX_ROW, Reason.PLAN_BAD_OFFSET)


def pages(name: str, value: PageList, rows_per_page: int) -> I64:
    """A 1-D array of non-negative integer page indexes whose rows fit int64 (PLAN_BAD_PAGE_INDEX)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D list of page indexes, got shape {arr.shape}",
                        reason=Reason.PLAN_BAD_PAGE_INDEX, metadata={"argument": name, "shape": arr.shape})
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}",
                        reason=Reason.PLAN_BAD_PAGE_INDEX, metadata={"argument": name, "dtype": arr.dtype})
    if arr.dtype.kind == "u" and int(arr.max()) > MAX_ROW:
        # Checked before the int64 cast, which would wrap these to negative values.
        big = int(np.argmax(arr))
        raise PlanError(f"{name}[{big}]={int(arr[big])} is too large",
                        reason=Reason.PLAN_BAD_PAGE_INDEX,
                        metadata={"argument": name, "index": big, "value": int(arr[big])})
    out = arr.astype(np.int64, copy=False)
    if int(out.min()) < 0:
        bad = int(np.argmax(out < 0))
        raise PlanError(f"{name}[{bad}]={int(out[bad])} is negative",
                        reason=Reason.PLAN_BAD_PAGE_INDEX,
                        metadata={"argument": name, "index": bad, "value": int(out[bad])})
    high = int(out.max())
    if (high + 1) * rows_per_page > MAX_ROW:
        bad = int(np.argmax(out))
        raise PlanError(f"{name}[{bad}]={high} times {rows_per_page} rows per page overflows row indexes",
                        reason=Reason.PLAN_BAD_PAGE_INDEX,
                        metadata={"argument": name, "index": bad, "value": high,
                                  "rows_per_page": rows_per_page})
    return out
