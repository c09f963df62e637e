"""The per-token relayout formula, written straight from ``pdproto/dcp/plan.py``'s docstring.

Planner tests compare ``RelayoutPlan.expand()`` with it; transfer tests compare the bytes
an executor wrote from the plan's runs with it. It loops per token on purpose: it is the
definition, not an implementation.
"""

from __future__ import annotations

import numpy as np


def reference(src_pages, dst_pages, *, Ps, Ns, s, Pd, Nd, d, off, N):
    """Per-token reference of the general layout, straight from the plan.py docstring."""
    start = off * Ps * Ns
    t_src, t_dst, d_src, d_dst = [], [], [], []
    for q in range(start, start + N):
        if q % Ns != s:
            continue
        if q % Nd == d:
            ls = q // Ns - off * Ps
            ld = q // Nd
            t_src.append(src_pages[ls // Ps] * Ps + ls % Ps)
            t_dst.append(dst_pages[ld // Pd] * Pd + ld % Pd)
        # Draft: unsharded pools with virtual-page-sized pages; the owning source rank sends it.
        Vs, Vd = Ps * Ns, Pd * Nd
        x = q - start
        d_src.append(src_pages[x // Vs] * Vs + x % Vs)
        d_dst.append(dst_pages[q // Vd] * Vd + q % Vd)
    return [np.array(a, dtype=np.int64) for a in (t_src, t_dst, d_src, d_dst)]
