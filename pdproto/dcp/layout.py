"""``DcpLayout``: where one rank keeps tokens (page size, DCP group), the one layout value.

Negotiation (``pdproto.negotiation.topology.Decision.src`` / ``.dst``), the planner
(``plan_chunk``) and the plan itself (``RelayoutPlan.src`` / ``.dst``) all pass this
value; the wire carries it as a page size plus a ``ParallelGroup``.
"""

from __future__ import annotations

import dataclasses

from pdproto import v1


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """Where a layout keeps tokens: page size in tokens, DCP group size and this rank (dense: size 1)."""

    page_size: int
    """Physical page size in tokens (rows per page of the sharded target pool)."""
    dcp_size: int = 1
    """DCP group size; 1 means dense."""
    dcp_rank: int = 0
    """This rank in the DCP group."""

    @property
    def virtual_page(self) -> int:
        """Global tokens per page index across the group (``page_size * dcp_size``)."""
        return self.page_size * self.dcp_size

    @classmethod
    def from_proto(cls, page_size: int, group: v1.ParallelGroup) -> DcpLayout:
        """The layout a page size and a ``ParallelGroup`` describe (an unset group size reads as 1)."""
        return cls(page_size=page_size, dcp_size=group.size or 1, dcp_rank=group.rank)

    def group(self) -> v1.ParallelGroup:
        """The DCP group as a ``ParallelGroup`` message."""
        return v1.ParallelGroup(size=self.dcp_size, rank=self.dcp_rank)


__all__ = ["DcpLayout"]
