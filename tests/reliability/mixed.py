"""Mixed fleet: one pdproto prefill rank serving a pdproto decode and SGLang 0.5.23's own Mooncake decodes at
once, in real SGLang processes (``tests/sglang/pd_harness.py``), after hostile frames on its rank port."""

from __future__ import annotations

from .harness import Outcome

SIZES = (63, 5, 300, 1000, 64, 700, 129, 2048)
"""Prompt lengths (tokens) the requests cycle through: sub-page, one page, partial last pages, long ones."""


def mixed_fleet() -> Outcome:
    """A request per aux slot of the harness's prefill over three decode servers (pdproto TP 1, SGLang
    Mooncake TP 1 and DCP 2), every byte of each decode's pool checked; the hostile frames must each be
    refused and counted."""
    from tests.sglang._models import AUX_SLOTS
    from tests.sglang.pd_harness import HOSTILE_REFUSALS, LEGACY, SUCCESS, Request, hostile_frames, run

    rounds = AUX_SLOTS  # the harness's prefill never frees an aux slot

    out = Outcome("mixed fleet, SGLang+pdproto decodes", "mooncake")
    requests = tuple(Request(room=300 + i, tokens=SIZES[i % len(SIZES)], chunk=256 if i % 3 == 0 else 0,
                             decode=i % 3) for i in range(rounds))
    hostile = hostile_frames()
    res = run("pdproto", requests, decodes=(("pdproto", 1), ("mooncake_tcp", 1), ("mooncake_tcp", 2)),
              env=LEGACY, hostile=hostile)
    out.runs, out.faults = rounds, len(hostile)
    if res["prefill"] is None or None in res["decode"]:
        out.problems.append(f"a rank printed no report: {res['prefill_stderr'][-400:]}")
        out.lost = rounds
        return out
    polls = {int(room): r["poll"] for room, r in res["prefill"]["results"].items()}
    for req in requests:
        ranks = [d for d in res["decode"] if d["instance"] == req.decode]
        states = {d["polls"][[r.room for r in requests if r.decode == req.decode].index(req.room)] for d in ranks}
        if polls.get(req.room) == SUCCESS and states == {SUCCESS}:
            out.ok += 1
        else:
            out.lost += 1
            out.problems.append(f"room {req.room}: prefill {polls.get(req.room)}, decode {sorted(states)}")
    out.corrupted = sum(1 for d in res["decode"] if d["mismatches"])
    out.bytes_verified = sum(r.get("metric_bytes", 0) for r in res["prefill"]["results"].values())
    refused = {k: n for k, n in res["prefill"]["legacy"].items() if not k.endswith("ACCEPTED")}
    out.failed_expected = sum(refused.values())
    if refused != HOSTILE_REFUSALS:
        out.problems.append(f"hostile frames counted {refused}, expected {HOSTILE_REFUSALS}")
    out.notes.append(f"{res['prefill']['legacy']}; {res['prefill']['sessions']['connected']} pdproto session(s)")
    return out


__all__ = ["mixed_fleet"]
