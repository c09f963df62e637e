"""Entry resolution by layer id and by position, across PP splits (pdproto.dcp.layers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproto.dcp.layers import (
    EntryRef,
    EntryRole,
    positional_offset,
    resolve_entries,
    stage_layer_range,
)
from pdproto.errors import Reason, TopologyError

T, D = EntryRole.TARGET, EntryRole.DRAFT


def refs(ids: list[int | None], roles: list[EntryRole] | None = None) -> list[EntryRef]:
    """EntryRefs from layer ids (None: no id) and roles (default: all target)."""
    return [EntryRef(i, r) for i, r in zip(ids, roles or [T] * len(ids), strict=True)]


def test_pp2_to_pp1_stage1_without_ids_offsets_by_start_layer() -> None:
    # Inventory 4.9, checked example: stage 1 [3,4,5,draft] -> [3,4,5,6].
    src = refs([None] * 4, [T, T, T, D])
    dst = refs([None] * 7, [T] * 6 + [D])
    m = resolve_entries(src, dst, src_pp_size=2, dst_pp_size=1, src_start_layer=3)
    assert m.dst_indices == (3, 4, 5, 6)
    assert not m.by_layer_id and m.offset == 3


def test_pp2_to_pp1_stage0_without_ids() -> None:
    src = refs([None] * 3)
    dst = refs([None] * 7, [T] * 6 + [D])
    assert resolve_entries(src, dst, src_pp_size=2, dst_pp_size=1).dst_indices == (0, 1, 2)


def test_pp2_to_pp2_stage1_by_layer_id() -> None:
    # Inventory 4.9, checked example: stage 1 [3,4,5] -> [0,1,2].
    m = resolve_entries(refs([3, 4, 5]), refs([3, 4, 5]), src_pp_size=2, dst_pp_size=2,
                        src_start_layer=3)
    assert m.dst_indices == (0, 1, 2) and m.by_layer_id


def test_pp2_to_pp2_without_ids_is_identity() -> None:
    m = resolve_entries(refs([None] * 3), refs([None] * 3), src_pp_size=2, dst_pp_size=2,
                        src_start_layer=3)
    assert m.dst_indices == (0, 1, 2) and m.offset == 0


def test_pp2_to_pp2_decode_stage_without_ids_pairs_a_plain_stage_by_position() -> None:
    # SGLang's plain pool: the prefill stage numbers its layers (and its draft after them),
    # the decode stage sends none; the stages hold the same layers, so position i -> i.
    src = refs([3, 4, 5, 6], [T, T, T, D])
    m = resolve_entries(src, refs([None] * 4, [T, T, T, D]), src_pp_size=2, dst_pp_size=2,
                        src_start_layer=3)
    assert m.dst_indices == (0, 1, 2, 3)
    assert not m.by_layer_id and m.offset == 0


@pytest.mark.parametrize(("src", "dst", "dst_pp", "reason"), [
    # Decode PP 1 holds every layer: without ids, which entry is layer 3 is a guess.
    (refs([3, 4, 5]), refs([None] * 6), 1, Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED),
    # A decode stage that sends ids, against a prefill stage that sends none.
    (refs([None] * 3), refs([3, 4, 5]), 2, Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED),
    # A hybrid pool's ids (not the stage's layers in order): position would be a guess.
    (refs([3, 5, 7]), refs([None] * 3), 2, Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED),
    # Ids on the prefill's draft only.
    (refs([None, None, 6], [T, T, D]), refs([None] * 3, [T, T, D]), 2,
     Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED),
    (refs([3, None, 5]), refs([None] * 3), 2, Reason.TOPOLOGY_LAYER_METADATA_PARTIAL),
    # Some ids on the decode stage: not the no-id pool this pairing is for.
    (refs([3, 4, 5]), refs([None, 4, None]), 2, Reason.TOPOLOGY_LAYER_METADATA_PARTIAL),
])
def test_other_one_sided_stages_stay_refused(src: list[EntryRef], dst: list[EntryRef], dst_pp: int,
                                              reason: Reason) -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(src, dst, src_pp_size=2, dst_pp_size=dst_pp, src_start_layer=3)
    assert exc.value.reason is reason


def test_pp2_to_pp1_by_layer_id_with_draft() -> None:
    src = refs([3, 4, 5, 6], [T, T, T, D])
    dst = refs([0, 1, 2, 3, 4, 5, 6], [T] * 6 + [D])
    m = resolve_entries(src, dst, src_pp_size=2, dst_pp_size=1, src_start_layer=3)
    assert m.dst_indices == (3, 4, 5, 6)


def test_ids_pair_in_any_order_and_repeats_in_order() -> None:
    # Hybrid pools can list one layer id twice (e.g. two tensors per layer).
    src = refs([7, 5, 5, 9])
    dst = refs([5, 9, 7, 5, 1])
    assert resolve_entries(src, dst).dst_indices == (2, 0, 3, 1)


def test_roles_never_cross() -> None:
    # A draft with id 3 must not take the target entry with id 3.
    src = refs([3, 3], [T, D])
    dst = refs([3, 3], [D, T])
    assert resolve_entries(src, dst).dst_indices == (1, 0)


def test_missing_layer() -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs([0, 1, 2]), refs([0, 2]))
    assert exc.value.reason is Reason.TOPOLOGY_MISSING_LAYER
    assert exc.value.metadata["layerId"] == "1"


def test_repeat_beyond_decode_count_is_missing() -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs([4, 4]), refs([4]))
    assert exc.value.reason is Reason.TOPOLOGY_MISSING_LAYER
    assert exc.value.metadata["occurrence"] == "2"


@pytest.mark.parametrize(("src", "dst"), [([0, 1], [None, None]), ([None, None], [0, 1])])
def test_one_sided_layer_metadata(src: list[int | None], dst: list[int | None]) -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs(src), refs(dst))
    assert exc.value.reason is Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED


def test_one_sided_within_a_role() -> None:
    # Targets carry ids on both sides, but only the decode's draft does.
    src = refs([0, None], [T, D])
    dst = refs([0, 1], [T, D])
    with pytest.raises(TopologyError) as exc:
        resolve_entries(src, dst)
    assert exc.value.reason is Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED


def test_partial_layer_metadata() -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs([0, None, 2]), refs([0, 1, 2]))
    assert exc.value.reason is Reason.TOPOLOGY_LAYER_METADATA_PARTIAL
    assert exc.value.metadata["side"] == "prefill"


def test_positional_needs_enough_decode_entries() -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs([None] * 3), refs([None] * 5), src_pp_size=2, dst_pp_size=1,
                        src_start_layer=3)
    assert exc.value.reason is Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH


def test_draft_without_decode_draft() -> None:
    with pytest.raises(TopologyError) as exc:
        resolve_entries(refs([None, None], [T, D]), refs([None, None]))
    assert exc.value.reason is Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH
    assert exc.value.metadata["role"] == "DRAFT"


def test_pp_mismatch() -> None:
    with pytest.raises(TopologyError) as exc:
        positional_offset(src_pp_size=4, dst_pp_size=2, src_start_layer=0)
    assert exc.value.reason is Reason.TOPOLOGY_PP_MISMATCH


def test_stage_range_rejects_bad_rank() -> None:
    with pytest.raises(TopologyError) as exc:
        stage_layer_range(8, 2, 2)
    assert exc.value.reason is Reason.TOPOLOGY_RANK_OUT_OF_RANGE


@given(num_layers=st.integers(1, 64), pp=st.integers(1, 8), with_ids=st.booleans(),
       num_draft=st.integers(0, 2))
def test_every_stage_lands_on_its_own_layers(num_layers: int, pp: int, with_ids: bool,
                                             num_draft: int) -> None:
    # PP=N -> PP=1: the stages together fill each decode target entry exactly once,
    # layer L landing on decode entry L, and the drafts land on the decode drafts.
    dst = refs([L if with_ids else None for L in range(num_layers)]
               + [num_layers + k if with_ids else None for k in range(num_draft)],
               [T] * num_layers + [D] * num_draft)
    landed: list[int] = []
    for rank in range(pp):
        start, end = stage_layer_range(num_layers, pp, rank)
        drafts = num_draft if rank == pp - 1 else 0
        src = refs([L if with_ids else None for L in range(start, end)]
                   + [num_layers + k if with_ids else None for k in range(drafts)],
                   [T] * (end - start) + [D] * drafts)
        m = resolve_entries(src, dst, src_pp_size=pp, dst_pp_size=1, src_start_layer=start)
        assert m.dst_indices[: end - start] == tuple(range(start, end))
        landed += m.dst_indices
    assert sorted(landed) == list(range(num_layers + num_draft))
