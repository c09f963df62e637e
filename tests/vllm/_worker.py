"""One vLLM worker process with PdprotoConnector, driven by JSON lines (``pdproto_demo.proc``).

vLLM's own code from the process group to the step: ``init_distributed_environment`` and
``initialize_model_parallel`` (gloo, on CPU), ``ensure_kv_transfer_initialized`` (which
builds the worker connector through ``KVConnectorFactory``), ``allocate_kv_cache`` (the KV
cache as vLLM lays it out), the connector's ``register_kv_caches``, and each step through
``KVConnectorModelRunnerMixin.kv_connector_no_forward`` (the model runner's calls, in its
order, on a step without a forward). Commands:

  step      one step with the given connector metadata; answers what finished
  fill      prefill: write the rows of a request's tokens into its blocks (and its Mamba state pages)
  check     decode: compare the rows this rank holds of a request's tokens (and its state) with the prefill's
  connect   decode: register with a prefill rank; answers the refusal's reason, if any
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pdproto_demo.proc import Reply, redirect_stdout_to_stderr, serve_commands

from . import _rig


def main() -> None:
    """Start the worker, print ready, serve commands."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--role", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--engine", default="mooncake")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dist-port", type=int, required=True)
    p.add_argument("--mha-heads", type=int, default=0, help="MHA with this many KV heads on this rank (0: MLA)")
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    p.add_argument("--hybrid", default="", help="a Mamba2/MLA hybrid with this temporal state dtype (float32, ...)")
    p.add_argument("--conv-layout", default="SD", help="VLLM_SSM_CONV_STATE_LAYOUT of the hybrid")
    a = p.parse_args()
    out = redirect_stdout_to_stderr()
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = a.conv_layout

    import numpy as np
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized, get_kv_transfer_group
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    from vllm.v1.worker.utils import allocate_kv_cache

    from pdproto.errors import PdprotoError
    from pdproto.integrations.vllm.connector import PdprotoMeta
    from pdproto.integrations.vllm.worker import Recv, Send

    config = _rig.vllm_config(a.model, a.role, tp=a.tp, dcp=a.dcp, block_size=a.block_size, port=a.port,
                              engine=a.engine, engine_id=f"{a.role}-{a.dist_port}", extra=json.loads(a.extra))
    cache_config = (_rig.hybrid_cache_config(config, a.blocks, a.hybrid) if a.hybrid
                    else _rig.mla_cache_config(a.block_size, a.blocks, a.mha_heads))
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=a.tp, rank=a.rank, local_rank=a.rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{a.dist_port}")
        ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, decode_context_model_parallel_size=a.dcp)
        ensure_kv_transfer_initialized(config, cache_config)
        connector = get_kv_transfer_group()
        kv_caches = allocate_kv_cache(cache_config, torch.device("cpu"), KVCacheLayout.LBNHC)
        connector.register_kv_caches(kv_caches)
    names, mixers = _rig.hybrid_layer_names() if a.hybrid else (_rig.layer_names(), [])
    width = cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes // a.block_size // 2
    # vLLM's per-layer view is logical [blocks, heads, tokens, C]; LBNHC stores [blocks, tokens, heads, C]:
    # that order is a view of the memory itself (a reshape of the logical one would copy it).
    physical = [kv_caches[n].permute(0, 2, 1, 3) for n in names]
    assert all(t.is_contiguous() for t in physical)
    words = [t.view(torch.int16).reshape(a.blocks * a.block_size, width).numpy() for t in physical]
    # MHA: this TP rank holds a slice of every row's heads; MLA: every rank the whole row.
    heads_of = slice(a.rank * width, (a.rank + 1) * width) if a.mha_heads else slice(0, width)
    full = width * a.tp if a.mha_heads else width
    # A Mamba layer's page per block (conv bytes, then temporal, then the padding to the MLA page), as int16
    # words: vLLM's [blocks, 1, 1, C] view holds the state bytes, a page's stride the padded page.
    page = cache_config.kv_cache_groups[-1].kv_cache_spec.page_size_bytes // 2
    pages = [torch.as_strided(kv_caches[n].view(torch.int8), (a.blocks, page * 2), (page * 2, 1)).view(torch.int16)
             .numpy() for n in mixers]

    def step(sends: list[dict[str, Any]] = (), recvs: list[dict[str, Any]] = (),  # type: ignore[assignment]
             finished: list[str] = (), cancels: list[str] = ()) -> Reply:  # type: ignore[assignment]
        meta = PdprotoMeta(sends=[Send(**{**s, "blocks": tuple(s["blocks"])}) for s in sends],
                           recvs=[Recv(**{**r, "blocks": tuple(r["blocks"]), "addresses": tuple(r["addresses"])})
                                  for r in recvs], cancels=list(cancels))
        so = SchedulerOutput.make_empty()
        so.kv_connector_metadata = meta
        so.finished_req_ids = set(finished)
        with set_current_vllm_config(config):
            output = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, config).kv_connector_output
        if output is None:
            return {"sent": [], "received": [], "failed": []}
        return {"sent": sorted(output.finished_sending or ()), "received": sorted(output.finished_recving or ()),
                "failed": sorted(output.failed_recving or ())}

    def state(layer: int, seed: int) -> np.ndarray:
        return _rig.rows(100 + layer, np.arange(1), seed, page)[0]  # every word of the page, never 0

    def fill(blocks: list[int], tokens: int, seed: int, state_block: int = 0) -> Reply:
        t = np.arange(tokens)
        at = np.asarray(blocks)[t // a.block_size] * a.block_size + t % a.block_size
        for layer, w in enumerate(words):
            w[at] = _rig.rows(layer, t, seed, full)[:, heads_of]
        for layer, pg in enumerate(pages):
            pg[state_block] = state(layer, seed)
        return {"rows": int(tokens)}

    def check(blocks: list[int], tokens: int, seed: int = 0, prefix: int = 0, expected: str = "",
              state_block: int = 0) -> Reply:
        """Rows of tokens [prefix, tokens) this DCP rank owns (t % dcp == rank) at local row t // dcp, against
        ``_rig.rows`` or the ``expected`` rows (an .npy file: [layer, token, word], from another engine), and a
        hybrid's Mamba pages of ``state_block``. ``written``: nonzero rows anywhere, state pages included (they
        overlay the attention layers' memory, a page per block)."""
        t = np.arange(prefix, tokens)
        t = t[t % a.dcp == ps.get_dcp_group().rank_in_group]
        local = t // a.dcp
        at = np.asarray(blocks)[local // a.block_size] * a.block_size + local % a.block_size
        given = np.load(expected) if expected else None

        def want(layer: int) -> np.ndarray:
            return given[layer][t] if given is not None else _rig.rows(layer, t, seed, full)[:, heads_of]

        bad = sum(int((w[at] != want(layer)).any(axis=1).sum()) for layer, w in enumerate(words))
        written = sum(int((w != 0).any(axis=1).sum()) for w in words)
        state_bad = sum(int((pg[state_block] != state(layer, seed)).sum()) for layer, pg in enumerate(pages))
        return {"checked": int(t.size) * len(words), "bad": bad, "written": written, "state_bad": state_bad,
                "state_words": page * len(pages), "state_rows": a.block_size * len(pages)}

    def connect(address: str) -> Reply:
        try:
            rank = connector._worker.peer.connect(address)
        except PdprotoError as exc:
            return {"reason": exc.reason.name, "message": exc.message}
        return {"reason": "", "packed": any(e.packed_fan_in for e in rank.result.entries)}

    def zero() -> Reply:
        for w in words:
            w[:] = 0
        return {}

    serve_commands({"step": step, "fill": fill, "check": check, "zero": zero, "connect": connect}, out, {})
    connector.shutdown()


if __name__ == "__main__":
    main()
