"""Bootstrap server of the pdproto SGLang backend: SGLang's own registry, plus one field.

Discovery stays SGLang's: each prefill rank registers itself with ``PUT /route`` and a
decode resolves ranks with ``GET /route`` by prefill DP, CP, TP and PP rank, plus
``/query_dp_ranks`` and ``/health``. A pdproto prefill rank also sends ``pdproto_port``, the
port of its gRPC handshake service, and this server returns it in that rank's record
(``PdprotoRankInfo``). SGLang's own decode reads only ``rank_ip``/``rank_port`` from the
record, so it ignores the field; a pdproto decode that finds no ``pdproto_port`` knows the
prefill is an unmodified SGLang one (its bootstrap server is SGLang's class).

In SGLang's Rust-server mode, which stands in for this class (``managers/disagg_service.py:54-66``),
the field is not kept: pdproto decodes then cannot find the gRPC service.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, PrefillRankInfo

PDPROTO_PORT = "pdproto_port"
"""The key a pdproto prefill rank adds to its ``PUT /route`` payload and its ``/route`` record."""


@dataclasses.dataclass
class PdprotoRankInfo(PrefillRankInfo):  # type: ignore[misc]
    """SGLang's record of one prefill rank, with the port of its pdproto handshake service."""

    pdproto_port: int | None = None


class PdprotoKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """The HTTP registry prefill ranks register with and decodes query (SGLang's, plus ``pdproto_port``)."""

    async def _handle_route_put(self, request: Any) -> Any:
        response = await super()._handle_route_put(request)
        data = await request.json()  # aiohttp keeps the body: a second read parses the same bytes
        port = data.get(PDPROTO_PORT) if isinstance(data, dict) else None
        if response.status != 200 or port is None:
            return response
        dp_group = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
        async with self.lock:
            table = self.prefill_port_table[dp_group][data["attn_cp_rank"]][data["attn_tp_rank"]]
            info = table[data["pp_rank"]]
            table[data["pp_rank"]] = PdprotoRankInfo(rank_ip=info.rank_ip, rank_port=info.rank_port,
                                                     pdproto_port=int(port))
        return response
