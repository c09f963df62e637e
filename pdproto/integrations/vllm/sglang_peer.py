"""What a vLLM prefill adds to serve SGLang 0.5.23 decodes (pdproto's SGLang backend), with
``kv_connector_extra_config`` ``sglang_bootstrap_port``.

An SGLang decode finds its prefill through SGLang's bootstrap server, not ``kv_transfer_params``:
its router gives it ``bootstrap_host``/``bootstrap_port``, and it asks ``GET /route`` for the
prefill's parallel sizes, then for each rank's record, whose ``pdproto_port`` names the rank's
handshake service (``pdproto/integrations/sglang/bootstrap.py``). ``BootstrapServer`` answers
those questions for a vLLM prefill from its own config (run by its scheduler-side connector, as
SGLang's tokenizer manager runs SGLang's): its TP ranks listen on ``port + r``; it publishes no
page size and no dtype, which pdproto's negotiation compares itself (rules 6 and 12), where
SGLang's check of equal pages would refuse the relayout pdproto performs.

An SGLang decode also waits, per request, for its metadata row (aux: the first output token,
the room it belongs to, logprobs; ``disaggregation/utils.py:245-260`` gates on the room).
``MetadataRows`` registers SGLang's default metadata buffers on each prefill worker and writes
a request's row: the first token vLLM sampled, the room, and zeros for the rest (no logprobs,
no cached-token counts, no draft hidden states). A decode with another metadata layout
(speculative decoding, DSA index seeds, sampling masks, KV checksums) is refused at
registration by the aux count or size (rule 16b).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from pdproto import v1
from pdproto.errors import ConfigError, Reason
from pdproto.transfer import TransferExecutor

from ..sglang.layout import host_port

METADATA_ITEM_LENS = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
"""Bytes per slot of SGLang's ``MetadataBuffers`` in ``get_buf_infos`` order (utils.py:524-544), as an
SGLang scheduler builds them without speculative decoding (hidden size 16, float32: scheduler.py:1555),
sampling masks, DSA index seeds or KV checksums: output ids, cached tokens, logprob value and index,
top-128 logprob values and indices, top-k p and index, hidden states, bootstrap room."""
OUTPUT_IDS, BOOTSTRAP_ROOM = 0, 9
"""The buffers a vLLM prefill fills: the first output token (int32) and the room (uint64)."""
SLOTS = 256
"""Metadata rows per prefill worker: requests held for their decode at once."""


class MetadataRows:
    """SGLang's metadata buffers on one vLLM prefill worker, a row per held request (module docstring)."""

    def __init__(self, executor: TransferExecutor, slots: int = SLOTS) -> None:
        self.buffers = tuple(executor.allocate(n * slots) for n in METADATA_ITEM_LENS)
        executor.register_memory(self.buffers)
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))

    def entries(self) -> list[v1.AuxEntryInfo]:
        """What the prefill publishes (``PrefillServerInfo.aux_entries``)."""
        return [v1.AuxEntryInfo(item_len=n) for n in METADATA_ITEM_LENS]

    def write(self, room: int, first_token: int) -> int | None:
        """A free row holding ``first_token`` and ``room``, zeros elsewhere; None when every row is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        for n, buf in zip(METADATA_ITEM_LENS, self.buffers, strict=True):
            np.asarray(buf.array)[slot * n:(slot + 1) * n] = 0
        self._row(OUTPUT_IDS, slot).view(np.int32)[0] = first_token
        self._row(BOOTSTRAP_ROOM, slot).view(np.uint64)[0] = room
        return slot

    def free(self, slot: int) -> None:
        """The row may hold another request."""
        self._free.append(slot)

    def _row(self, buffer: int, slot: int) -> np.ndarray:
        n = METADATA_ITEM_LENS[buffer]
        return np.asarray(self.buffers[buffer].array)[slot * n:(slot + 1) * n]


class BootstrapServer:
    """SGLang's bootstrap server, answered read-only for a vLLM prefill of ``tp_size`` ranks (module docstring)."""

    def __init__(self, listen: int, *, rank_host: str, pdproto_port: int, tp_size: int) -> None:
        info = {"attn_tp_size": tp_size, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": None,
                "kv_cache_dtype": None, "follow_bootstrap_room": True, "decode_allocation_policy": "early"}
        # rank_port is what SGLang's own decodes dial with ZMQ: a vLLM prefill has no such listener, and a
        # pdproto decode dials pdproto_port (a record with it is a pdproto prefill).
        ranks = [{"rank_ip": rank_host, "rank_port": pdproto_port + r, "pdproto_port": pdproto_port + r}
                 for r in range(tp_size)]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                if url.path == "/health":
                    return self._answer(200, "OK")
                if url.path != "/route":
                    return self._answer(404, f"no {url.path} here")
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                try:
                    dp, cp, tp, pp = (int(query[k]) for k in ("prefill_dp_rank", "prefill_cp_rank",
                                                               "target_tp_rank", "target_pp_rank"))
                except (KeyError, ValueError):
                    return self._answer(400, "Missing inputs for bootstrap server.")
                if (dp, cp, tp, pp) == (-1, -1, -1, -1):
                    return self._answer(200, info)
                if (dp, cp, pp) != (0, 0, 0) or not 0 <= tp < tp_size:
                    return self._answer(404, f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} "
                                             f"tp_rank={tp} pp_rank={pp}: this vLLM prefill has TP {tp_size} only")
                return self._answer(200, ranks[tp])

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                # One DP rank: a room's DP rank is always 0, which a decode assumes when none is known.
                self._answer(200, {} if self.path.startswith("/query_dp_ranks") else "OK")

            def do_PUT(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer(405, "this bootstrap server answers for a vLLM prefill; its ranks come from its config")

            def _answer(self, status: int, body: Any) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                """Quiet: a decode's heartbeat asks /health every few seconds."""

        try:
            self._server = ThreadingHTTPServer((rank_host, listen), Handler)
        except OSError as exc:
            raise ConfigError(f"kv_connector_extra_config sglang_bootstrap_port={listen}: SGLang's bootstrap server "
                              f"cannot listen on {host_port(rank_host, listen)}: {exc}", reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "sglang_bootstrap_port", "value": str(listen)}) from exc
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.address = host_port(rank_host, self.port)
        """What an SGLang decode's router gives it as ``bootstrap_host:bootstrap_port``."""
        threading.Thread(target=self._server.serve_forever, name="pdproto-vllm-sglang-bootstrap",
                         daemon=True).start()

    def close(self) -> None:
        """Stop answering."""
        self._server.shutdown()
        self._server.server_close()


__all__ = ["BOOTSTRAP_ROOM", "METADATA_ITEM_LENS", "OUTPUT_IDS", "SLOTS", "BootstrapServer", "MetadataRows"]
