"""The pdproto plugin inside SGLang 0.5.23: loaded by SGLang's own loader, checked by SGLang's own code.

The checks run in processes where no plugin is loaded yet (tests/sglang/_run.py), the way SGLang loads plugins:
``load_plugins()`` finds ``pdproto`` through the installed ``sglang.srt.plugins`` entry point.
The checks with the plugin share one process; the one without it has its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.sglang._models import DSV41_RATIOS, DSV41_SOURCES, write_config
from tests.sglang._run import run_sglang

pytestmark = pytest.mark.process

# Every KVClassType of SGLang 0.5.23 -> the class pdproto resolves it to.
PDPROTO_CLASSES = {
    "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
    "manager": "pdproto.integrations.sglang.manager.PdprotoKVManager",
    "sender": "pdproto.integrations.sglang.sender.PdprotoKVSender",
    "receiver": "pdproto.integrations.sglang.receiver.PdprotoKVReceiver",
    "bootstrap_server": "pdproto.integrations.sglang.bootstrap.PdprotoKVBootstrapServer",
}
SGLANG_CLASSES = {
    backend: {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": f"sglang.srt.disaggregation.{backend}.conn.{prefix}KVManager",
        "sender": f"sglang.srt.disaggregation.{backend}.conn.{prefix}KVSender",
        "receiver": f"sglang.srt.disaggregation.{backend}.conn.{prefix}KVReceiver",
        "bootstrap_server": f"sglang.srt.disaggregation.{backend}.conn.{prefix}KVBootstrapServer",
    }
    for backend, prefix in (("mooncake", "Mooncake"), ("nixl", "Nixl"))
}

RESOLVE = """
from sglang.srt.plugins import load_plugins
load_plugins()
import importlib.metadata
from sglang.srt.disaggregation import decode, prefill, utils
from sglang.srt.disaggregation.common import conn as common
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.managers import disagg_service
from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

def name(cls):
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"

out = {
    "entry_points": [f"{e.name}={e.value}" for e in importlib.metadata.entry_points(group="sglang.srt.plugins")],
    "members": {m.name: m.value for m in TransferBackend},
    "by_value_is_member": TransferBackend("pdproto") is TransferBackend.PDPROTO,
    "choices": list(DISAGG_TRANSFER_BACKEND_CHOICES),
    "classes": {b: {t.value: name(get_kv_class(TransferBackend(b), t)) for t in KVClassType}
                for b in ("pdproto", "mooncake", "nixl")},
    # `from utils import name` bindings taken before the hooks were applied
    "rebound": all(
        getattr(mod, attr) is getattr(utils, attr)
        for mod in (prefill, decode, disagg_service)
        for attr in ("TransferBackend", "get_kv_class")
    ),
    "bases": {
        t: issubclass(get_kv_class(TransferBackend.PDPROTO, KVClassType(t)), base)
        for t, base in (("manager", common.CommonKVManager), ("sender", common.CommonKVSender),
                        ("receiver", common.CommonKVReceiver),
                        ("bootstrap_server", common.CommonKVBootstrapServer))
    },
    "rust_registry_stands_in": disagg_service.rust_server_serves_kv_bootstrap("pdproto"),
}
# decode.py:2897 holds a failed transfer's pages until every prefill rank acked the abort
# only when the manager class says its backend acknowledges aborts.
out["deferred_release"] = get_kv_class(TransferBackend.PDPROTO, KVClassType.MANAGER).supports_deferred_decode_kv_release
results["resolve"] = out
"""


def test_plugin_resolves_every_kv_class_and_leaves_other_backends_alone(with_plugin: dict[str, Any]) -> None:
    """SGLang's loader runs the entry point; TransferBackend and get_kv_class then know pdproto."""
    out = with_plugin["resolve"]
    assert "pdproto=pdproto.integrations.sglang.plugin:register" in out["entry_points"]
    assert out["members"] == {
        "MOONCAKE": "mooncake",
        "MORI": "mori",
        "NIXL": "nixl",
        "ASCEND": "ascend",
        "FAKE": "fake",
        "PDPROTO": "pdproto",
    }
    assert out["by_value_is_member"]
    assert out["choices"].count("pdproto") == 1
    assert out["classes"]["pdproto"] == PDPROTO_CLASSES
    assert out["classes"]["mooncake"] == SGLANG_CLASSES["mooncake"]
    assert out["classes"]["nixl"] == SGLANG_CLASSES["nixl"]
    assert out["rebound"], "prefill/decode/disagg_service still hold SGLang's unhooked names"
    assert out["bases"] == {
        "manager": True,
        "sender": True,
        "receiver": True,
        "bootstrap_server": True,
    }
    assert out["rust_registry_stands_in"]
    assert out["deferred_release"] is True


SERVER_ARGS = """
import os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args

MODEL = {model!r}

def resolve(*flags, env=None, model=MODEL):
    os.environ.pop("SGLANG_DISAGG_STAGING_BUFFER", None)
    os.environ.update(env or {{}})
    argv = ["--model-path", model, "--device", "cpu", "--skip-tokenizer-init", *flags]
    try:
        args = prepare_server_args(argv)
    except SystemExit as exc:
        return {{"rejected": "argparse", "code": exc.code}}
    try:
        args.resolve_once()
    except ValueError as exc:
        return {{"rejected": str(exc)}}
    view = resolving_view(args)
    return {{"backend": view.disaggregation_transfer_backend, "dcp": view.dcp_size,
             "radix_disabled": view.disable_radix_cache}}

def decode(backend, dcp=4):
    return ["--disaggregation-mode", "decode", "--tp-size", str(dcp), "--dcp-size", str(dcp),
            "--disaggregation-transfer-backend", backend]

results["server_args"] = {{
    "pdproto_dcp4": resolve(*decode("pdproto")),
    "mooncake_dcp4": resolve(*decode("mooncake")),
    "pdproto_dcp1": resolve(*decode("pdproto", dcp=1)),
    "pdproto_prefill": resolve("--disaggregation-mode", "prefill",
                               "--disaggregation-transfer-backend", "pdproto"),
    "pdproto_dcp4_staging": resolve(*decode("pdproto"), env={{"SGLANG_DISAGG_STAGING_BUFFER": "1"}}),
}}

def layer_split(backend):
    import torch
    capability = torch.cuda.get_device_capability
    # A DSA config's step asks CUDA for the device capability (model_hook.py:341), which this host lacks.
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    try:
        return resolve("--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
                       "--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "interleave",
                       "--enable-dsa-cache-layer-split", model={dsa!r})
    finally:
        torch.cuda.get_device_capability = capability

results["layer_split"] = {{backend: layer_split(backend) for backend in ("pdproto", "nixl")}}

from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

seen = []

@register_resolution_hook("handle_speculative_decoding")
def spec_step(server_args, previous):
    # The step after the model step: what it sees of the backend name.
    seen.append(resolving_view(server_args).disaggregation_transfer_backend)
    previous(server_args)

def dspark(backend, mode="prefill", env=None):
    import torch
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    seen.clear()
    try:
        out = resolve("--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend,
                      "--speculative-algorithm", "DSPARK", "--page-size", "256", model={dsv41!r},
                      env={{"SGLANG_RAGGED_VERIFY_MODE": "static", **(env or {{}})}})
    finally:
        torch.cuda.get_device_capability = capability
    return {{**out, "next_step_saw": list(seen)}}

results["dsv41_dspark"] = {{
    "pdproto": dspark("pdproto"), "pdproto_decode": dspark("pdproto", "decode"), "nixl": dspark("nixl"),
    "mori": dspark("mori"), "pdproto_compact": dspark("pdproto", env={{"SGLANG_RAGGED_VERIFY_MODE": "compact"}}),
}}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V3 (MLA) config.json: what SGLang's argument checks read from a model."""
    return write_config("mla", tmp_path_factory.mktemp("mla"))


@pytest.fixture(scope="module")
def with_plugin(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plugin's checks in one process: each starts SGLang's runtime anew, which takes seconds on two cores."""
    # DeepSeek-V3.2: the MLA config with a DSA indexer and a q LoRA rank (what is_deepseek_dsa and its config read).
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=256,
                  index_topk=2048, index_n_heads=4, index_head_dim=128)
    dsa = tmp_path_factory.mktemp("dsa")
    (dsa / "config.json").write_text(json.dumps(config))
    # DeepSeek-V4.1 (SGLang's DeepseekV41Config): the dsv41 pool's ratios and kv_source layers.
    v41 = json.loads((write_config("dsv41", tmp_path_factory.mktemp("dsv41")) / "config.json").read_text())
    v41.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v41", compress_ratios=DSV41_RATIOS,
               kv_source_layer_ids=DSV41_SOURCES, q_lora_rank=256, index_topk=512, index_n_heads=4,
               index_head_dim=128, qk_nope_head_dim=448, window_size=128, sliding_window=128, o_lora_rank=256,
               o_groups=2, num_key_value_heads=1)
    dsv41 = tmp_path_factory.mktemp("dsv41_config")
    (dsv41 / "config.json").write_text(json.dumps(v41))
    return run_sglang("results = {}\n" + RESOLVE + SERVER_ARGS.format(model=str(model_dir), dsa=str(dsa),
                                                                      dsv41=str(dsv41))
                      + BOOTSTRAP.format() + "print(json.dumps(results))\n")


def test_server_args_accept_dcp4_decode_with_plugin(with_plugin: dict[str, Any]) -> None:
    """SGLang's own resolution pipeline accepts a DCP 4 pdproto decode and keeps the name."""
    out = with_plugin["server_args"]
    assert out["pdproto_dcp4"] == {"backend": "pdproto", "dcp": 4, "radix_disabled": True}
    assert out["mooncake_dcp4"] == {"backend": "mooncake", "dcp": 4, "radix_disabled": True}
    assert out["pdproto_dcp1"] == {"backend": "pdproto", "dcp": 1, "radix_disabled": True}
    assert out["pdproto_prefill"]["backend"] == "pdproto"
    # The stand-in name the hook uses for the DCP check must not let this through.
    assert "SGLANG_DISAGG_STAGING_BUFFER requires" in out["pdproto_dcp4_staging"]["rejected"]


def test_server_args_accept_a_dsa_layer_split_prefill_with_plugin(with_plugin: dict[str, Any]) -> None:
    """SGLang allows the DSA cache layer split with Mooncake only (model_hook.py:393-408); pdproto serves it."""
    out = with_plugin["layer_split"]
    assert out["pdproto"]["backend"] == "pdproto", out
    assert "only supports the mooncake transfer backend" in out["nixl"]["rejected"], out


DSPARK_CPU = "DSpark speculative decoding only supports CUDA, NPU or XPU device."
"""What the step after the model step (speculative_hook.py:666-672) answers every DSpark server on a CPU host."""
V41_PD = "DeepSeek-V4.1 DSpark PD requires static verify, Mooncake or NIXL"


def test_server_args_pass_a_deepseek_v41_dspark_pd_server_with_plugin(with_plugin: dict[str, Any]) -> None:
    """SGLang allows DeepSeek-V4.1 DSpark PD with Mooncake or NIXL only (deepseek_v4_hook.py:355-382); a pdproto
    prefill or decode passes that check, and the next step sees pdproto's name again. Its other rules still apply
    (a ragged verify mode other than static). DSpark itself then refuses a CPU device, so no V4.1 server resolves
    whole here, whatever the backend."""
    out = with_plugin["dsv41_dspark"]
    for name in ("pdproto", "pdproto_decode", "nixl"):
        assert out[name]["rejected"] == DSPARK_CPU, out
    assert out["pdproto"]["next_step_saw"] == out["pdproto_decode"]["next_step_saw"] == ["pdproto"], out
    assert out["nixl"]["next_step_saw"] == ["nixl"], out
    for name in ("mori", "pdproto_compact"):
        assert out[name]["rejected"].startswith(V41_PD) and out[name]["next_step_saw"] == [], out


WITHOUT_PLUGIN = """
from sglang.srt.plugins import load_plugins
load_plugins()  # as launch_server.py does; SGLANG_PLUGINS leaves pdproto out
from sglang.srt.disaggregation.utils import TransferBackend
from sglang.srt.server_args import ServerArgs, prepare_server_args

MODEL = {model!r}
out = {{}}
try:
    TransferBackend("pdproto")
    out["enum"] = "resolved"
except ValueError as exc:
    out["enum"] = str(exc)
try:
    prepare_server_args(["--model-path", MODEL, "--disaggregation-transfer-backend", "pdproto"])
    out["cli"] = "parsed"
except SystemExit as exc:
    out["cli"] = exc.code
args = ServerArgs(model_path=MODEL, device="cpu", skip_tokenizer_init=True, tp_size=4, dcp_size=4,
                  disaggregation_mode="decode", disaggregation_transfer_backend="pdproto")
try:
    args.resolve_once()
    out["dcp_check"] = "accepted"
except ValueError as exc:
    out["dcp_check"] = str(exc)
print(json.dumps(out))
"""


def test_without_plugin_sglang_rejects_pdproto(model_dir: Path) -> None:
    """With the plugin left out (SGLANG_PLUGINS), SGLang refuses the name at every gate."""
    out = run_sglang(
        WITHOUT_PLUGIN.format(model=str(model_dir)), env={"SGLANG_PLUGINS": "someone_else"}
    )
    assert "'pdproto' is not a valid TransferBackend" in out["enum"]
    assert out["cli"] == 2  # argparse: invalid choice
    assert "PD decode DCP requires --disaggregation-transfer-backend" in out["dcp_check"]


BOOTSTRAP = """
import socket, time, requests
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = get_kv_class(TransferBackend("pdproto"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
url = f"http://127.0.0.1:{{port}}"
for _ in range(200):
    try:
        if requests.get(url + "/health", timeout=1).status_code == 200:
            break
    except requests.ConnectionError:
        time.sleep(0.05)
ROUTE_QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
before = requests.get(url + ROUTE_QUERY).status_code
# Two prefill TP ranks register as common/conn.py:1584-1612 does: a pdproto one with its gRPC
# port, and an unmodified SGLang one (a fleet in migration).
for rank, grpc_port in ((0, 50051), (1, None)):
    body = dict(attn_tp_size=2, attn_tp_rank=rank, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
                attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0,
                rank_ip="10.0.0.7", rank_port=17000 + rank, page_size=64, kv_cache_dtype="bfloat16")
    if grpc_port is not None:
        body["pdproto_port"] = grpc_port
    assert requests.put(url + "/route", json=body).status_code == 200
info = requests.get(url + ROUTE_QUERY).json()
ranks = [requests.get(url + f"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={{r}}&target_pp_rank=0").json()
         for r in (0, 1)]
missing = requests.get(url + "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=2&target_pp_rank=0").status_code
# Several prefill DP ranks: a sender files its room's DP rank (common/conn.py:2183-2199), and the
# decode asks for it through SGLang's own class, as decode.py:1256 does.
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
assert requests.post(url + "/register_dp_rank", json={{"bootstrap_room": 77, "dp_rank": 1}}).status_code == 200
dp_ranks = CommonKVReceiver.query_prefill_dp_ranks(f"127.0.0.1:{{port}}", [77, 78])
server.close()
results["bootstrap"] = {{"before": before, "info": info, "ranks": ranks, "missing": missing, "dp_ranks": dp_ranks}}
"""


def test_bootstrap_server_resolves_each_prefill_rank_to_its_grpc_endpoint(with_plugin: dict[str, Any]) -> None:
    """The registry pdproto uses is SGLang's: ranks register ip:port (and pdproto's gRPC port), decodes look them up."""
    out = with_plugin["bootstrap"]
    assert out["before"] == 503  # not every rank has registered yet
    assert out["info"]["attn_tp_size"] == 2
    assert out["info"]["page_size"] == 64
    assert out["ranks"] == [
        {"rank_ip": "10.0.0.7", "rank_port": 17000, "pdproto_port": 50051},
        {"rank_ip": "10.0.0.7", "rank_port": 17001},  # SGLang's record, as SGLang's server keeps it
    ]

    assert out["missing"] == 404
    assert out["dp_ranks"] == {"77": 1}  # room 78 was never filed
