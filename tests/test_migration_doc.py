"""docs/migration.md is complete, names real proto fields, and matches the codec.

* every slot of inventory sections 1.2, 1.3, 1.5-1.10 and every PUT /route field
  appears in its table with the inventory's field name (lists below are copied
  from the inventory tables);
* every proto field path named in the doc exists (checked via descriptors);
* every field of the bridged messages is either mapped or listed as having no slot;
* for each mapped slot, changing that proto field in a golden message changes that
  frame when rebuilt, so the doc cannot drift from pdproto.legacy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

import pdproto.v1 as v1
from pdproto.errors import LegacyFormatError
from pdproto.legacy import mooncake, nixl
from tests.golden.generate import GOLDENS

DOC = Path(__file__).resolve().parents[1] / "docs" / "migration.md"

_MC_REG = ["room", "endpoint", "dst_port", "mooncake_session_id", "dst_kv_ptrs", "dst_aux_ptrs",
           "dst_state_data_ptrs", "dst_tp_rank", "dst_attn_tp_size", "dst_kv_item_len",
           "dst_state_item_lens", "dst_state_dim_per_tensor", "dst_kv_layer_ids",
           "dst_state_layer_ids", "staging_base_ptr", "staging_total_size", "dst_dcp_size",
           "dst_dcp_rank", "slot_layer_ids", "dst_kv_item_lens"]
_NX_REG = ["GUARD", "room", "endpoint", "dst_port", "agent_name", "agent_metadata", "dst_kv_ptrs",
           "dst_aux_ptrs", "dst_state_data_ptrs", "gpu_id", "decode_tp_size", "decode_tp_rank",
           "dst_kv_item_len", "dst_state_item_lens", "dst_state_dim_per_tensor",
           "staging_base_ptr", "staging_total_size", "dst_num_slots", "dst_kv_mem_kinds",
           "dst_kv_item_lens", "dst_state_layer_ids", "dst_kv_layer_ids", "dst_dcp_size",
           "dst_dcp_rank", "dst_state_data_lens"]
_ROUTE = ["attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
          "attn_dp_rank", "system_dp_size", "system_dp_rank", "pp_size", "pp_rank", "rank_ip",
          "rank_port", "page_size", "kv_cache_dtype", "kv_layout", "dsv41_spec_layout",
          "prefill_http_port", "decode_allocation_policy", "load_balance_method",
          "enable_dsa_cache_layer_split", "enable_kv_cache_sharding"]

# table title -> inventory field names by slot (None: PUT /route, no slot numbers)
EXPECTED: dict[str, list[str]] = {
    "Mooncake registration": _MC_REG,
    "NIXL registration": _NX_REG,
    "Mooncake TransferInfo": ["room", "endpoint", "dst_port", "mooncake_session_id",
                              "dst_kv_indices", "dst_aux_index", "dst_state_indices",
                              "required_dst_info_num", "decode_prefix_len",
                              "dst_device_kv_indices"],
    "NIXL TransferInfo": ["GUARD", "room", "endpoint", "dst_port", "agent_name",
                          "dst_kv_indices", "dst_aux_index", "required_dst_info_num",
                          "dst_state_indices", "decode_prefix_len", "is_dummy"],
    "Mooncake status": ["room", "status", "prefill_rank"],
    "NIXL status": ["KV_STATUS", "room", "status", "prefill_rank", "reason"],
    "ABORT": ["ABORT", "room", "decode_ip", "decode_port", "generation"],
    "ABORT_ACK": ["ABORT_ACK", "room", "prefill_rank", "generation"],
    "BOOTSTRAP": ["BOOTSTRAP", "room", "decode_ip", "decode_port"],
    "STAGING_REQ": ["STAGING_REQ", "room", "chunk_idx", "chunk_pages", "session_id",
                    "requester_pp_rank"],
    "STAGING_RSP": ["STAGING_RSP", "room", "chunk_idx", "offset", "round", "end", "session_id"],
    "WATERMARK": ["WATERMARK", "round", "tail", "session_id"],
    "CHUNK_READY": ["CHUNK_READY", "room", "chunk_idx", "page_start", "num_pages", "writer_id",
                    "prefill_rank"],
    "AUX_DATA": ["AUX_DATA", "room", "buffer_index", "aux_index", "len", "data"],
    "PUT /route payload": _ROUTE,
}
NO_SLOT = "pdproto fields with no legacy slot"
BRIDGED = ["KvRegistration", "TransferInfo", "TransferStatus", "AbortNotification", "AbortAck",
           "PrefillCompleteBootstrap", "StagingRequest", "StagingResponse", "StagingWatermark",
           "ChunkReady", "AuxData"]
_TICKS = re.compile(r"`([^`]+)`")

Row = dict[str, str]


def _tables() -> dict[str, list[Row]]:
    tables: dict[str, list[Row]] = {}
    title, header = "", list[str]()
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            title, header = line.lstrip("#").strip().split(" (")[0], []
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not header:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                tables.setdefault(title, []).append(dict(zip(header, cells)))
    return tables


def _paths(cell: str) -> list[str]:
    return [] if cell == "none" else _TICKS.findall(cell)


def _resolve(path: str) -> tuple[Descriptor, list[FieldDescriptor]]:
    message, *parts = path.split(".")
    desc: Descriptor = getattr(v1, message).DESCRIPTOR
    fields = []
    for i, part in enumerate(parts):
        name = part.removesuffix("[]")
        assert name in desc.fields_by_name, f"{path}: {desc.full_name} has no field {name!r}"
        field = desc.fields_by_name[name]
        assert part.endswith("[]") == (field.is_repeated and i < len(
            parts) - 1), f"{path}: use [] exactly on repeated fields that are walked into"
        fields.append(field)
        if field.message_type is not None:
            desc = field.message_type
    return desc, fields


def test_every_inventory_slot_has_a_row() -> None:
    tables = _tables()
    for title, names in EXPECTED.items():
        assert title in tables, f"docs/migration.md lacks a table for {title}"
        rows = [r for r in tables[title] if r["slot"] != "—"] if title != "PUT /route payload" \
            else tables[title]
        if title == "PUT /route payload":
            assert [_TICKS.findall(r["SGLang field"])[0] for r in rows] == names
            continue
        assert [int(r["slot"]) for r in rows] == list(range(len(names))), title
        assert [_TICKS.findall(r["SGLang field"]) for r in rows] == [[n] for n in names], title


def test_every_named_proto_path_exists() -> None:
    tables = _tables()
    named = 0
    for title, rows in tables.items():
        for row in rows:
            cell = row.get("proto field", "")
            if cell == "none":
                assert row["notes"], f"{title}: a 'none' row must say why"
            for path in _paths(cell):
                _resolve(path)
                named += 1
    assert named > 100


def test_every_bridged_field_is_mapped_or_explained() -> None:
    tables = _tables()
    mentioned = {p for rows in tables.values() for r in rows
                 for p in _paths(r.get("proto field", ""))}
    mentioned |= {_TICKS.findall(r["proto field"])[0] for r in tables[NO_SLOT]}
    prefixes = {p.split(".")[0] + "." + p.split(".")[1].removesuffix("[]") for p in mentioned}
    for name in BRIDGED:
        for field in getattr(v1, name).DESCRIPTOR.fields:
            key = f"{name}.{field.name}"
            assert key in prefixes or any(p.startswith(key + ".") for p in mentioned), (
                f"{key} is neither mapped in docs/migration.md nor listed as having no slot")


# --- the doc matches the codec -------------------------------------------------------

GOLDEN_FOR = {
    "Mooncake registration": (mooncake, "registration", ["mooncake/registration_v0523.bin"]),
    "NIXL registration": (nixl, "registration", ["nixl/registration_v0523.bin"]),
    "Mooncake TransferInfo": (mooncake, "transfer_info", ["mooncake/transfer_info_v0523.bin"]),
    "NIXL TransferInfo": (nixl, "transfer_info", ["nixl/transfer_info_v0523.bin"]),
    "Mooncake status": (mooncake, "status", ["mooncake/status_success.bin"]),
    "NIXL status": (nixl, "status", ["nixl/status_failed.bin"]),
    "ABORT": (mooncake, "abort", ["mooncake/abort_v0523.bin"]),
    "ABORT_ACK": (mooncake, "abort_ack", ["mooncake/abort_ack_v0523.bin"]),
    "BOOTSTRAP": (mooncake, "bootstrap", ["mooncake/bootstrap.bin"]),
    "STAGING_REQ": (mooncake, "staging_req", ["mooncake/staging_req.bin"]),
    "STAGING_RSP": (mooncake, "staging_rsp", ["mooncake/staging_rsp_granted.bin",
                                              "mooncake/staging_rsp_oversized.bin"]),
    "WATERMARK": (mooncake, "watermark", ["mooncake/watermark.bin"]),
    "CHUNK_READY": (mooncake, "chunk_ready", ["mooncake/chunk_ready.bin"]),
    "AUX_DATA": (mooncake, "aux_data", ["mooncake/aux_data.bin"]),
}


def _perturb(msg: Message, path: str) -> bool:
    """Change the field at ``path`` (first element of repeated parts); False if unset."""
    target: Any = msg
    _, fields = _resolve(path)
    for field in fields[:-1]:
        if field.is_repeated:
            seq = getattr(target, field.name)
            if not seq:
                return False
            target = seq[0]
        else:
            if not target.HasField(field.name):
                return False
            target = getattr(target, field.name)
    leaf = fields[-1]
    if leaf.is_repeated:
        seq = getattr(target, leaf.name)
        if not seq:
            return False
        seq[0] = seq[0] + 1
        return True
    value = getattr(target, leaf.name)
    if leaf.enum_type is not None:
        others = [v.number for v in leaf.enum_type.values if v.number not in (0, value)]
        setattr(target, leaf.name, others[0])
    elif leaf.type == FieldDescriptor.TYPE_BOOL:
        setattr(target, leaf.name, not value)
    elif isinstance(value, (str, bytes)):
        setattr(target, leaf.name, value + (b"x" if isinstance(value, bytes) else "x"))
    else:
        setattr(target, leaf.name, value + 1)
    return True


@pytest.mark.parametrize("title", sorted(GOLDEN_FOR))
def test_doc_slots_match_the_codec(title: str) -> None:
    module, kind, goldens = GOLDEN_FOR[title]
    rows = [r for r in _tables()[title] if r["slot"] != "—"]
    unmapped = {int(r["slot"]) for r in rows if r["proto field"] == "none"}
    checked = 0
    for row in rows:
        for path in _paths(row["proto field"]):
            slot, built = int(row["slot"]), False
            for name in goldens:
                base = getattr(module, f"parse_{kind}")(GOLDENS[name]).message
                msg = type(base)()
                msg.CopyFrom(base)
                if not _perturb(msg, path):
                    continue
                try:
                    frames = getattr(module, f"build_{kind}")(msg)
                except LegacyFormatError:
                    continue
                changed = {i for i, (a, b) in enumerate(zip(frames, GOLDENS[name])) if a != b}
                assert slot in changed, f"{title}: {path} did not change slot {slot}"
                assert changed <= {slot} | unmapped, f"{title}: {path} changed {changed}"
                built = checked = checked + 1  # type: ignore[assignment]
                break
            assert built or "unset" in row["notes"] or "HiSparse" in row["notes"] or \
                "staging" in path, f"{title}: no golden exercises {path}"
    assert checked
