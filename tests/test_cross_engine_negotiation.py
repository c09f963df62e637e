"""An SGLang prefill rank and a vLLM decode worker as each adapter describes them: where the engines disagree,
negotiation decides (docs/protocol.md). Pure: both adapters' layout modules import no engine; the bytes
moving between the two real engines are tests/vllm/test_cross_engine.py.
"""

from __future__ import annotations

import pytest

from pdproto import v1
from pdproto.errors import Reason
from pdproto.integrations.dtypes import kv_dtype
from pdproto.integrations.sglang import layout as sglang
from pdproto.integrations.vllm import layout as vllm
from pdproto.integrations.vllm.sglang_peer import METADATA_ITEM_LENS
from pdproto.negotiation.registration import Region, make_registration
from pdproto.negotiation.topology import Decision, Mode, Rejection, negotiate

from .test_sglang_layout import kimi_state, kv_args


def _vllm_decode(dtype: object, block: int = 16, dcp: int = 1, rank: int = 0) -> v1.KvRegistration:
    """A vLLM MLA decode worker of 4 layers, its cache dtype as vLLM names it."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    cache = vllm.KvCache(names, vllm.layer_ids(names), block, 1152, 64, kv_dtype(dtype))
    ranks = vllm.Ranks(tp=(dcp, rank), dcp=(dcp, rank))
    dec = vllm.decode_layout(cache, ranks, notify_host="10.0.0.2", notify_port=7000, gpu_id=0)
    regions = [Region(0x10_0000 * (i + 1), 64 * block * 1152, v1.MEMORY_KIND_VRAM) for i in range(4)]
    return make_registration(dec, v1.MooncakeEndpoint(session_id="10.0.0.2:15000"), regions)


def _vllm_prefill(*, sglang_rows: bool) -> v1.PrefillServerInfo:
    """A vLLM MLA prefill worker of 4 layers, block 16, with SGLang's metadata rows or none."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    cache = vllm.KvCache(names, vllm.layer_ids(names), 16, 1152, 64, kv_dtype("torch.bfloat16"))
    info = vllm.server_info(cache, vllm.Ranks(), host="10.0.0.1", port=50051, backend=v1.BACKEND_MOONCAKE)
    if sglang_rows:
        info.aux_entries.extend(v1.AuxEntryInfo(item_len=n) for n in METADATA_ITEM_LENS)
    return info


def _sglang_decode(aux: list[int]) -> v1.KvRegistration:
    """An SGLang MLA decode rank (page 64) with metadata buffers of these bytes per slot."""
    args = kv_args()
    args.aux_item_lens, args.aux_data_lens = aux, [n * 16 for n in aux]
    args.aux_data_ptrs = [0x8000_0000 + i * 0x1_0000 for i in range(len(aux))]
    dec = sglang.decode_layout(args, sglang.Ranks(attn_tp=(1, 0)), is_mla_backend=True, notify_host="10.0.0.2",
                               notify_port=7000)
    regions = sglang.regions(args, on_device=True)
    return make_registration(dec, v1.MooncakeEndpoint(session_id="10.0.0.2:15000"), list(regions.kv),
                             aux=list(regions.aux))


def test_a_vllm_prefill_serves_an_sglang_decode_its_metadata_row_in_pages_of_64() -> None:
    """vLLM block 16 -> SGLang page 64 (the decode announces page-relayout); the vLLM prefill's metadata rows
    pair with SGLang's default ones (no speculative decoding) buffer for buffer."""
    decision = negotiate(_vllm_prefill(sglang_rows=True), _sglang_decode(list(METADATA_ITEM_LENS)))
    assert isinstance(decision, Decision), decision
    assert decision.mode is Mode.SAME_LAYOUT and decision.tp is not None
    assert [(a.src_entry, a.dst_entry, a.item_len) for a in decision.tp.aux] == [
        (i, i, n) for i, n in enumerate(METADATA_ITEM_LENS)]


def test_an_sglang_decode_is_refused_a_prefill_that_writes_no_metadata_row() -> None:
    """Without ``sglang_bootstrap_port`` a vLLM prefill has no aux: an SGLang decode would wait for its row."""
    rejection = negotiate(_vllm_prefill(sglang_rows=False), _sglang_decode(list(METADATA_ITEM_LENS)))
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_AUX_COUNT_MISMATCH
    assert "sglang_bootstrap_port" in rejection.message


def test_an_sglang_decode_with_draft_hidden_states_is_refused_by_size() -> None:
    """A speculative-decoding SGLang decode's hidden-state buffer is wider than the padding a vLLM prefill has."""
    aux = [*METADATA_ITEM_LENS[:8], 7168 * 2, METADATA_ITEM_LENS[9]]
    rejection = negotiate(_vllm_prefill(sglang_rows=True), _sglang_decode(aux))
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_AUX_SIZE_MISMATCH


def _sglang_prefill(dtype: str) -> v1.PrefillServerInfo:
    args = kv_args()
    args.kv_cache_dtype_str = dtype
    return sglang.server_info(args, sglang.Ranks(attn_tp=(1, 0)), is_mla_backend=True, host="10.0.0.1", port=50051,
                              backend=v1.BACKEND_MOONCAKE)


def test_engine_spellings_of_one_dtype_are_one_name() -> None:
    assert {kv_dtype(s) for s in ("bf16", "bfloat16", "torch.bfloat16", "BFloat16")} == {"bfloat16"}
    assert {kv_dtype(s) for s in ("fp8", "fp8_e4m3", "torch.float8_e4m3fn")} == {"fp8_e4m3"}
    assert {kv_dtype(s) for s in ("fp16", "half", "torch.float16")} == {"float16"}
    assert kv_dtype("auto") == kv_dtype(None) == ""  # the model's dtype, unnamed: not compared (rule 6)
    assert kv_dtype("fp8_ds_mla") == "fp8_ds_mla"  # a layout of its own stays as its engine names it


@pytest.mark.parametrize("dcp", [1, 4])
def test_an_sglang_prefill_serves_a_vllm_decode_without_aux_in_blocks_of_16(dcp: int) -> None:
    """SGLang page 64, aux buffers, "bf16"; vLLM block 16 (page-relayout), no aux, torch's bfloat16."""
    info = _sglang_prefill("bf16")
    assert info.kv_cache_dtype == "bfloat16" and len(info.aux_entries) > 0
    for rank in range(dcp):
        decision = negotiate(info, _vllm_decode("torch.bfloat16", dcp=dcp, rank=rank))
        assert isinstance(decision, Decision), decision
        assert decision.mode is (Mode.DENSE_TO_DCP if dcp > 1 else Mode.SAME_LAYOUT)
        assert decision.tp is not None and decision.tp.aux == ()  # no aux reaches a decode that has none
        assert [(p.src_entry, p.dst_entry, p.src_token_bytes) for p in decision.pairings] == [
            (i, i, 1152) for i in range(4)]


def test_different_dtypes_are_refused_whatever_the_spelling() -> None:
    rejection = negotiate(_sglang_prefill("bf16"), _vllm_decode("fp8"))
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_KV_DTYPE_MISMATCH


MAMBA2 = "vllm mamba2 conv SD: bfloat16(3, 288), float32(8, 32, 16)"


def _vllm_hybrid() -> vllm.KvCache:
    """A vLLM Mamba2/MLA hybrid rank: MLA layers 0 and 2, Mamba2 layers 1 and 3 (padded pages of 18,432 B)."""
    names, mixers = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"), \
        ("model.layers.1.mixer", "model.layers.3.mixer")
    group = vllm.MambaGroup(1, mixers, vllm.layer_ids(mixers), 16 * 1152, MAMBA2)
    return vllm.KvCache(names, vllm.layer_ids(names), 16, 1152, 64, "bfloat16", group=0, mamba=(group,))


def _vllm_hybrid_decode(cache: vllm.KvCache, tp: int = 1, rank: int = 0) -> v1.KvRegistration:
    dec = vllm.decode_layout(cache, vllm.Ranks(tp=(tp, rank)), notify_host="10.0.0.2", notify_port=7000, gpu_id=0)
    # Mamba layer l overlays MLA layer l's region (vLLM's groups share one allocation).
    regions = [Region(0x10_0000 * (i + 1), 64 * cache.page_bytes, v1.MEMORY_KIND_VRAM) for i in range(2)]
    return make_registration(dec, v1.MooncakeEndpoint(session_id="10.0.0.2:15000"), regions, state=[regions])


def test_a_vllm_hybrid_moves_its_mamba_pages_whole_between_equal_tp_sizes_only() -> None:
    """vLLM to vLLM: each Mamba layer's padded page is one item, paired by layer id; TP 1 to TP 2 is refused at
    Register (the page packs conv and temporal state: no slicing by head)."""
    info = vllm.server_info(_vllm_hybrid(), vllm.Ranks(), host="10.0.0.1", port=50051, backend=v1.BACKEND_MOONCAKE)
    decision = negotiate(info, _vllm_hybrid_decode(_vllm_hybrid()))
    assert isinstance(decision, Decision) and decision.tp is not None, decision
    (entry,) = decision.tp.state
    assert [(t.src_tensor, t.dst_tensor, t.src_item_len) for t in entry.tensors] == [(0, 0, 18432), (1, 1, 18432)]
    rejection = negotiate(info, _vllm_hybrid_decode(_vllm_hybrid(), tp=2))
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_STATE_TP_REFUSED, rejection


def test_an_sglang_hybrid_prefill_and_a_vllm_hybrid_decode_are_refused() -> None:
    """SGLang's Mamba state (conv and temporal apart, all N tokens computed) is not vLLM's padded page after N-1
    tokens: the pair is refused at Register (SGLang's hybrid pool kind says so first), never moved."""
    info = sglang.server_info(kv_args(layers=2, state=[kimi_state(1)], hybrid=True), sglang.Ranks(attn_tp=(1, 0)),
                              is_mla_backend=True, host="10.0.0.1", port=50051, backend=v1.BACKEND_MOONCAKE)
    rejection = negotiate(info, _vllm_hybrid_decode(_vllm_hybrid()))
    assert isinstance(rejection, Rejection) and rejection.reason is Reason.TOPOLOGY_ATTENTION_KIND_MISMATCH, rejection
