"""DCP relayout planning: exact source -> destination row runs for decode context parallelism.

Reading order: layout.py (``DcpLayout``, the one layout value), plan.py (coordinates,
``plan_chunk`` and its keyword wrapper ``plan_relayout``, ``RelayoutPlan``), runs.py (the
run format executors receive, expansion, descriptor segments), then _checks.py (typed
input errors). layers.py pairs prefill and decode entries.
"""

from pdproto.dcp.layout import DcpLayout
from pdproto.dcp.plan import RelayoutPlan, plan_chunk, plan_relayout, token_rows

__all__ = ["DcpLayout", "RelayoutPlan", "plan_chunk", "plan_relayout", "token_rows"]
