"""DCP relayout planning: exact source -> destination row runs for decode context parallelism.

Reading order: plan.py (coordinates, ``plan_relayout``, ``RelayoutPlan``), then _runs.py
(run arithmetic, expansion, descriptor segments), then _checks.py (typed input errors).
"""

from pdproto.dcp.plan import DcpLayout, RelayoutPlan, draft_token_rows, plan_relayout, token_rows

__all__ = ["DcpLayout", "RelayoutPlan", "draft_token_rows", "plan_relayout", "token_rows"]
