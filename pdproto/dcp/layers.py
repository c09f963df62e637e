"""Layer/entry resolution: which decode KV entry receives each prefill KV entry.

A prefill pipeline stage holds the layers ``[start_layer, start_layer + n)`` of the
model, plus (on the stage that runs it) the draft model's entries. The decode either
runs the same pipeline split (PP N -> N: its stage holds the same layers) or none at
all (PP N -> 1: it holds every layer). Entries are paired role by role (target with
target, draft with draft):

* both sides carry layer ids: pair by id; a repeated id pairs its k-th occurrence on
  the prefill with its k-th occurrence on the decode;
* neither side carries ids: pair by position, offset by the stage's first layer when
  the decode holds the whole model. SGLang's NIXL DCP path used the bare identity and
  mapped every stage onto decode entries ``0..n-1``; the offset applies on every
  backend here. Draft entries pair by position among drafts;
* the decode of an equal PP size > 1 carries none, the prefill's targets ``start_layer + i``:
  pair by position, offset 0. SGLang sends a plain pool's decode stage no ids
  (``build_kv_layer_ids``) and pairs stage r with prefill stage r only, so the stages hold
  the same layers; negotiation checks that this prefill is that stage (rule 16);
* any other one-sided case: rejected, because guessing would silently move a layer's rows
  into another layer.

Every failure is a ``TopologyError`` with a specific ``Reason``; nothing is trimmed.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pdproto.errors import Reason, TopologyError


class EntryRole(enum.IntEnum):
    """Target or draft KV entry; values equal ``pdproto.v1.KvEntryRole`` numbers."""

    TARGET = 1
    DRAFT = 2

    @classmethod
    def from_proto(cls, value: int) -> EntryRole:
        """Read a ``KvEntryRole`` number; UNSPECIFIED (0) means target, as the schema says."""
        return cls.DRAFT if value == cls.DRAFT else cls.TARGET


@dataclass(frozen=True)
class EntryRef:
    """One KV entry as the resolver sees it: its layer id (if sent) and its role."""

    layer_id: int | None
    """Global model layer id, or None when the pool sends no layer metadata."""
    role: EntryRole = EntryRole.TARGET
    """Target or draft entry."""


@dataclass(frozen=True)
class EntryMapping:
    """The resolved destination entry of every source entry, in source order."""

    dst_indices: tuple[int, ...]
    """``dst_indices[i]`` is the decode entry index that receives prefill entry ``i``."""
    by_layer_id: bool
    """True when target entries were paired by layer id, False when by position."""
    offset: int
    """Positional offset applied to target entries (0 when paired by id)."""


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The ``[start, end)`` layers of a PP stage under an even split (earlier stages get fewer)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size or num_layers < 0:
        raise TopologyError(
            f"bad pipeline stage: rank {pp_rank} of {pp_size} over {num_layers} layers",
            reason=Reason.TOPOLOGY_RANK_OUT_OF_RANGE,
            metadata={"ppSize": pp_size, "ppRank": pp_rank, "numLayers": num_layers},
        )
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size


def positional_offset(*, src_pp_size: int, dst_pp_size: int, src_start_layer: int) -> int:
    """Decode target-entry index of the prefill stage's first layer when pairing by position.

    Equal PP sizes: the decode stage holds the same layers, so the offset is 0.
    Decode PP 1: it holds every layer, so the stage's rows go to ``start_layer + i``.
    """
    if src_pp_size == dst_pp_size:
        return 0
    if dst_pp_size == 1:
        return src_start_layer
    raise TopologyError(
        f"decode PP {dst_pp_size} must equal prefill PP {src_pp_size} or be 1",
        reason=Reason.TOPOLOGY_PP_MISMATCH,
        metadata={"prefillPpSize": src_pp_size, "decodePpSize": dst_pp_size},
    )


def _ids_present(entries: Sequence[EntryRef], role: EntryRole, side: str) -> bool:
    """Whether the entries of ``role`` carry layer ids: all of them, or none (else an error)."""
    flags = [e.layer_id is not None for e in entries if e.role == role]
    if all(flags):
        return bool(flags)
    if not any(flags):
        return False
    missing = [i for i, e in enumerate(entries) if e.role == role and e.layer_id is None]
    raise TopologyError(
        f"{side} {role.name.lower()} entries carry layer ids only partly (entries {missing} lack one)",
        reason=Reason.TOPOLOGY_LAYER_METADATA_PARTIAL,
        metadata={"side": side, "role": role.name, "entriesWithoutLayerId": missing},
    )


def _pair_by_id(
    src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]], role: EntryRole
) -> dict[int, int]:
    """Pair (index, layer id) lists by id, the k-th repeat of an id with the k-th repeat."""
    queues: dict[int, list[int]] = defaultdict(list)
    for index, layer in dst:
        queues[layer].append(index)
    used: dict[int, int] = defaultdict(int)
    out: dict[int, int] = {}
    for index, layer in src:
        k = used[layer]
        candidates = queues.get(layer, [])
        if k >= len(candidates):
            raise TopologyError(
                f"decode has no {role.name.lower()} entry for model layer {layer}"
                f" (occurrence {k + 1}, prefill entry {index})",
                reason=Reason.TOPOLOGY_MISSING_LAYER,
                metadata={"layerId": layer, "occurrence": k + 1, "prefillEntry": index,
                          "role": role.name},
            )
        out[index] = candidates[k]
        used[layer] = k + 1
    return out


def _pair_by_position(
    src: Sequence[int], dst: Sequence[int], offset: int, role: EntryRole
) -> dict[int, int]:
    """Pair the i-th source index with the (offset+i)-th destination index."""
    if offset + len(src) > len(dst):
        raise TopologyError(
            f"decode has {len(dst)} {role.name.lower()} entries; prefill needs"
            f" {len(src)} starting at {offset}",
            reason=Reason.TOPOLOGY_ENTRY_COUNT_MISMATCH,
            metadata={"role": role.name, "prefillEntries": len(src),
                      "decodeEntries": len(dst), "offset": offset},
        )
    return {s: dst[offset + i] for i, s in enumerate(src)}


def resolve_entries(
    src: Sequence[EntryRef],
    dst: Sequence[EntryRef],
    *,
    src_pp_size: int = 1,
    dst_pp_size: int = 1,
    src_start_layer: int = 0,
) -> EntryMapping:
    """Resolve the decode entry of every prefill entry (see the module docstring).

    Raises ``TopologyError`` with reason LAYER_METADATA_ONE_SIDED, LAYER_METADATA_PARTIAL,
    MISSING_LAYER, ENTRY_COUNT_MISMATCH or PP_MISMATCH.
    """
    offset = positional_offset(
        src_pp_size=src_pp_size, dst_pp_size=dst_pp_size, src_start_layer=src_start_layer
    )
    if not src:
        # A stage holding no layers (more stages than layers) has nothing to pair.
        return EntryMapping(dst_indices=(), by_layer_id=False, offset=offset)
    # Layer metadata is a property of the pool, so judge it over all of a side's entries.
    src_has = any(e.layer_id is not None for e in src)
    dst_has = any(e.layer_id is not None for e in dst)
    if src_has and not dst_has and src_pp_size == dst_pp_size > 1:
        src = _stage_by_position(src, src_start_layer)
        src_has = False
    if src_has != dst_has:
        raise TopologyError(
            "layer metadata must be sent by both peers or neither"
            f" (prefill: {'yes' if src_has else 'no'}, decode: {'yes' if dst_has else 'no'})",
            reason=Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED,
            metadata={"prefillHasLayerIds": src_has, "decodeHasLayerIds": dst_has},
        )
    pairs: dict[int, int] = {}
    by_id = False
    for role in (EntryRole.TARGET, EntryRole.DRAFT):
        src_ids = _ids_present(src, role, "prefill")
        dst_ids = _ids_present(dst, role, "decode")
        src_idx = [i for i, e in enumerate(src) if e.role == role]
        dst_idx = [i for i, e in enumerate(dst) if e.role == role]
        if src_ids and dst_ids:
            by_id = by_id or role == EntryRole.TARGET
            pairs.update(_pair_by_id(
                [(i, _layer(src[i])) for i in src_idx],
                [(i, _layer(dst[i])) for i in dst_idx],
                role,
            ))
        elif src_ids != dst_ids and src_idx and dst_idx:
            # E.g. ids on targets only on one side's drafts: the same guess we refuse above.
            raise TopologyError(
                f"{role.name.lower()} entries carry layer ids on one side only",
                reason=Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED,
                metadata={"role": role.name, "prefillHasLayerIds": src_ids,
                          "decodeHasLayerIds": dst_ids},
            )
        else:
            # Drafts belong to the stage that runs the draft model; they are never offset.
            role_offset = offset if role == EntryRole.TARGET else 0
            pairs.update(_pair_by_position(src_idx, dst_idx, role_offset, role))
    return EntryMapping(
        dst_indices=tuple(pairs[i] for i in range(len(src))),
        by_layer_id=by_id,
        offset=0 if by_id else offset,
    )


def _stage_by_position(src: Sequence[EntryRef], start_layer: int) -> list[EntryRef]:
    """A prefill stage's entries without their ids, once they show it holds its layers in order.

    Only a plain pool's stage (targets ``start_layer + i``) holds what a decode stage without
    ids holds at the same positions; any other ids (a hybrid pool's) would be paired by guess.
    """
    for role in (EntryRole.TARGET, EntryRole.DRAFT):
        _ids_present(src, role, "prefill")
    targets = [e.layer_id for e in src if e.role == EntryRole.TARGET]
    plain = list(range(start_layer, start_layer + len(targets)))
    if targets and targets != plain:
        raise TopologyError(
            f"the decode stage sends no layer ids, and the prefill stage's target ids {targets}"
            f" are not its layers {start_layer}.. in order, so entries cannot pair by position;"
            " send layer ids from the decode too",
            reason=Reason.TOPOLOGY_LAYER_METADATA_ONE_SIDED,
            metadata={"prefillHasLayerIds": True, "decodeHasLayerIds": False,
                      "prefillStartLayer": start_layer},
        )
    return [EntryRef(None, e.role) for e in src]


def _layer(entry: EntryRef) -> int:
    """The layer id of an entry already known to carry one."""
    assert entry.layer_id is not None  # guaranteed by _ids_present
    return entry.layer_id


__all__ = [
    "EntryMapping",
    "EntryRef",
    "EntryRole",
    "positional_offset",
    "resolve_entries",
    "stage_layer_range",
]
