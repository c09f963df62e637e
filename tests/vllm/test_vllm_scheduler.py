"""PdprotoConnector as vLLM 0.33.0 builds and drives it, without a worker: its factory, its config
validation, what the connector refuses at start-up, and a real ``Scheduler`` on both sides of a
transfer (VLLM_TARGET_DEVICE=cpu, a tiny local MLA model config).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from . import _rig  # noqa: I001 - sets VLLM_TARGET_DEVICE before vLLM is imported

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from pdproto.errors import ConfigError, PdprotoError, Reason, TopologyError
from pdproto.integrations.vllm.connector import PdprotoConnector, PdprotoMeta
from pdproto.integrations.vllm.layout import room_of

BLOCK = 16
BLOCKS = 100
PROMPT = 100


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _rig.model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.process
def test_factory_builds_both_roles_in_a_fresh_interpreter(model: str) -> None:
    """vLLM's own factory takes the class from kv_connector_module_path; its config validation takes DCP 4."""
    script = textwrap.dedent(f"""
        import json, sys
        from tests.vllm import _rig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
        out = []
        for role, dcp, extra in (("kv_producer", 1, {{"port": 5757}}), ("kv_consumer", 4, {{}})):
            config = _rig.vllm_config({model!r}, role, tp=dcp, dcp=dcp, extra=extra)
            cache = _rig.mla_cache_config(16, 64)
            for r in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
                c = KVConnectorFactory.create_connector(config, r, cache)
                out.append([role, r.name, type(c).__module__, type(c).__name__, supports_hma(c),
                            config.parallel_config.decode_context_parallel_size])
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == [[role, r, "pdproto.integrations.vllm.connector", "PdprotoConnector", True, dcp]
                   for role, dcp in (("kv_producer", 1), ("kv_consumer", 4)) for r in ("SCHEDULER", "WORKER")]


def _refusal(model: str, cache: KVCacheConfig | None = None, role: str = "kv_consumer", **kw: Any) -> PdprotoError:
    config = _rig.vllm_config(model, role, **kw)
    with pytest.raises(PdprotoError) as info:
        PdprotoConnector(config, KVConnectorRole.SCHEDULER, cache or _rig.mla_cache_config(BLOCK, BLOCKS))
    return info.value


def test_what_is_not_served_is_refused_at_start_up(model: str, tmp_path: Path) -> None:
    """Each layout or setting the connector cannot move stops the engine at start-up, with a typed reason."""
    names = _rig.layer_names()
    mha = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    head_major = KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names, mha)], kv_cache_layout="LBHNC")
    e = _refusal(model, head_major)
    assert isinstance(e, ConfigError) and e.reason is Reason.CONFIG_INVALID and "LBNHC" in e.message
    e = _refusal(model, _rig.mla_cache_config(BLOCK, BLOCKS, mha_heads=2), tp=4, dcp=4)
    assert e.metadata["setting"] == "decode_context_parallel_size"
    gqa = _rig.model_dir(tmp_path / "gqa", {**_rig.MHA_MODEL, "num_attention_heads": 8, "num_key_value_heads": 2})
    e = _refusal(gqa, _rig.mla_cache_config(BLOCK, BLOCKS, mha_heads=1), tp=4)  # 2 KV heads over 4 ranks
    assert e.metadata["setting"] == "tensor_parallel_size"
    window = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                               sliding_window=128)
    assert "sliding" in _refusal(model, KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names, window)])).message
    e = _refusal(model, KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names[:2], mha),
                                                   KVCacheGroupSpec(names[2:], window)]))
    assert e.reason is Reason.CONFIG_INVALID and "sliding-window" in e.message  # a hybrid of attention kinds
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32))
    e = _refusal(model, KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names, mamba)]))  # no attention group
    assert isinstance(e, TopologyError) and e.reason is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED
    config = _rig.vllm_config(model, "kv_consumer")
    config.cache_config.mamba_cache_mode = "align"
    e = _refusal(model, _rig.hybrid_cache_config(config, BLOCKS))  # a state per block position
    assert e.reason is Reason.TOPOLOGY_STATE_KIND_UNSUPPORTED and e.metadata["mode"] == "align"
    blocky = _rig.mla_cache_config(BLOCK, BLOCKS)
    blocky.kv_cache_tensors[0].layer_stride = blocky.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    blocky.kv_cache_tensors[0].block_stride *= _rig.LAYERS  # BLNHC: a block holds every layer's page
    assert "LBNHC" in _refusal(model, blocky).message
    assert _refusal(model, role="kv_producer").metadata["setting"] == "port"
    assert _refusal(model, role="kv_both").metadata["setting"] == "kv_role"
    assert _refusal(model, extra={"lease": 3}).metadata["setting"] == "kv_connector_extra_config"
    assert _refusal(model, extra={"engine": "carrier-pigeon"}).metadata["setting"] == "PDPROTO_ENGINE"
    e = _refusal(model, extra={"sglang_bootstrap_port": 8998})  # a decode answers no SGLang decode
    assert e.metadata["setting"] == "sglang_bootstrap_port" and "kv_producer" in e.message
    assert _refusal(model, role="kv_producer", port=5758,
                    extra={"sglang_bootstrap_port": "8998"}).metadata["setting"] == "sglang_bootstrap_port"
    with socket.socket() as taken:  # a port another server holds: refused with the port named
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        e = _refusal(model, role="kv_producer", port=5758, extra={"sglang_bootstrap_port": busy})
    assert e.metadata == {"setting": "sglang_bootstrap_port", "value": str(busy)}, e


def _scheduler(model: str, role: str, policy: str = "fail", *, hybrid: bool = False) -> Scheduler:
    return _rig.scheduler(_rig.vllm_config(model, role, port=5758, policy=policy), BLOCK, BLOCKS, hybrid=hybrid)


def _request(request_id: str, params: dict[str, Any]) -> Request:
    return _rig.request(request_id, PROMPT, params, BLOCK)


def _output(reqs: list[Request], **kv: set[str]) -> ModelRunnerOutput:
    return _rig.runner_output(reqs, **kv)


def _receiving(model: str, policy: str = "fail") -> tuple[Scheduler, Request, PdprotoMeta]:
    s = _scheduler(model, "kv_consumer", policy)
    req = _request("d1", {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 5758,
                          "remote_tp_size": 2, "transfer_id": "t-1"})
    s.add_request(req)
    out = s.schedule()
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert isinstance(meta, PdprotoMeta)
    return s, req, meta


def test_decode_waits_for_remote_kv_then_runs(model: str) -> None:
    s, req, meta = _receiving(model)
    (recv,) = meta.recvs
    assert (recv.request_id, recv.room, recv.prefix) == ("d1", room_of("t-1"), 0)
    assert recv.addresses == ("10.1.2.3:5758", "10.1.2.3:5759")
    assert len(recv.blocks) >= -(-PROMPT // BLOCK) and 0 not in recv.blocks
    assert list(recv.blocks) == s.kv_cache_manager.get_block_ids("d1")[0][:len(recv.blocks)]
    out = s.schedule()  # nothing arrived: the request keeps waiting, nothing is submitted twice
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not out.kv_connector_metadata.recvs
    s.update_from_output(out, _output([], finished_recving={"d1"}))
    out = s.schedule()
    assert req.status is RequestStatus.RUNNING and "d1" in out.num_scheduled_tokens
    # vLLM recomputes the last prompt token itself once the rest is loaded.
    assert out.num_scheduled_tokens["d1"] == 1


def test_a_decode_aborted_while_receiving_keeps_its_blocks_until_the_receive_ends(model: str) -> None:
    s, req, _ = _receiving(model)
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free  # the prefill may still write them
    out = s.schedule()
    assert out.kv_connector_metadata.cancels == ["d1"]  # the workers abort the room on its prefill ranks
    s.update_from_output(out, _output([], finished_recving={"d1"}, failed_recving={"d1"}))
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() > free


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_receive_follows_the_load_failure_policy(model: str, policy: str) -> None:
    s, req, _ = _receiving(model, policy)
    out = s.schedule()
    s.update_from_output(out, _output([], finished_recving={"d1"}, failed_recving={"d1"}))
    if policy == "fail":
        assert req.status is RequestStatus.FINISHED_ERROR and "d1" not in s.requests
    else:
        out = s.schedule()
        assert req.status is RequestStatus.RUNNING and out.num_scheduled_tokens["d1"] == PROMPT


def test_prefill_holds_its_blocks_until_sent(model: str) -> None:
    s = _scheduler(model, "kv_producer")
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    req = _request("p1", {"do_remote_decode": True, "transfer_id": "t-2"})
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens["p1"] == PROMPT
    blocks = s.kv_cache_manager.get_block_ids("p1")[0]
    results = s.update_from_output(out, _output([req]))
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    params = next(o for r in results.values() for o in r.outputs).kv_transfer_params
    assert params is not None and params["transfer_id"] == "t-2" and params["do_remote_prefill"]
    assert (params["remote_port"], params["remote_tp_size"], params["remote_num_tokens"]) == (5758, 1, PROMPT)
    assert s.connector.has_pending_push_work()
    out = s.schedule()
    (send,) = out.kv_connector_metadata.sends
    assert (send.request_id, send.room, list(send.blocks), send.num_tokens) == ("p1", room_of("t-2"), blocks, PROMPT)
    assert send.first_token == 7  # what the model runner sampled: an SGLang decode's metadata row carries it
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() < free  # held for the decode
    s.update_from_output(out, _output([], finished_sending={"p1"}))
    assert not s.connector.has_pending_push_work()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_an_sglang_bootstrap_room_is_the_room_on_both_sides(model: str) -> None:
    """Facing SGLang, ``kv_transfer_params`` carry its ``bootstrap_room``: the room its senders and receivers use,
    taken as is by a decode and by a prefill (which hands it on to its decode)."""
    room = (1 << 62) + 5
    d = _scheduler(model, "kv_consumer")
    d.add_request(_request("d1", {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 5758,
                                  "transfer_id": "t-1", "bootstrap_room": room}))
    (recv,) = d.schedule().kv_connector_metadata.recvs
    assert recv.room == room
    p = _scheduler(model, "kv_producer")
    req = _request("p1", {"do_remote_decode": True, "transfer_id": "t-2", "bootstrap_room": str(room)})
    p.add_request(req)
    out = p.schedule()
    results = p.update_from_output(out, _output([req]))
    params = next(o for r in results.values() for o in r.outputs).kv_transfer_params
    assert params is not None and params["bootstrap_room"] == room
    (send,) = p.schedule().kv_connector_metadata.sends
    assert send.room == room
    bad = _scheduler(model, "kv_consumer")
    bad.add_request(_request("d2", {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 5758,
                                    "bootstrap_room": -3}))
    with pytest.raises(ConfigError) as caught:
        bad.schedule()
    assert caught.value.metadata["setting"] == "kv_transfer_params.bootstrap_room"


def test_a_hybrid_prefill_computes_n_minus_1_tokens_and_the_decode_the_last(model: str) -> None:
    """A Mamba2/MLA hybrid (mode none), as vLLM's NixlConnector does it: the prefill computes the prompt but its
    last token, whose state it hands over with the rows; the decode loads those N-1 and computes token N from
    that state. Each side names its Mamba group's one block (the state slot) beside the MLA blocks."""
    p = _scheduler(model, "kv_producer", hybrid=True)
    req = _request("p1", {"do_remote_decode": True, "transfer_id": "t-3"})
    p.add_request(req)
    out = p.schedule()
    assert out.num_scheduled_tokens["p1"] == PROMPT - 1
    attention, (state,) = p.kv_cache_manager.get_block_ids("p1")
    results = p.update_from_output(out, _output([req]))
    params = next(o for r in results.values() for o in r.outputs).kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == PROMPT - 1
    (send,) = p.schedule().kv_connector_metadata.sends
    assert (list(send.blocks), send.state, send.num_tokens) == (attention, (state,), PROMPT - 1)
    d = _scheduler(model, "kv_consumer", hybrid=True)
    dreq = _request("d1", {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 5758,
                           "transfer_id": "t-3"})
    d.add_request(dreq)
    (recv,) = d.schedule().kv_connector_metadata.recvs
    attention, (state,) = d.kv_cache_manager.get_block_ids("d1")
    assert (list(recv.blocks), recv.state, recv.prefix) == (attention, (state,), 0)
    out = d.schedule()
    d.update_from_output(out, _output([], finished_recving={"d1"}))
    out = d.schedule()
    assert dreq.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d1": 1}
    assert dreq.num_computed_tokens == PROMPT  # 99 loaded, the 100th computed here
