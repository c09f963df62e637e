"""Writes the SGLang 0.5.23 legacy golden frame files, by hand from the inventory slot tables.

Run ``.venv/bin/python -m tests.golden.generate`` to rewrite ``tests/golden/*/*.bin``.
This script deliberately does not import ``pdproto.legacy``: every frame below is
spelled out with ``struct`` exactly as SGLang's builders write it (inventory
sections 0, 1.2-1.10), so the golden tests can catch mistakes in our codec.
Native ``Q``/``I``/int32 arrays are written little-endian, i.e. as SGLang writes
them on x86-64 and aarch64 hosts. The container format is in README.md.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAGIC = b"PDLF"
GUARD = b"NixlMsgGuard"


def A(value: int) -> bytes:  # noqa: N802 - the inventory's encoding codes
    """ASCII decimal integer."""
    return str(value).encode("ascii")


def S(text: str) -> bytes:  # noqa: N802
    """ASCII string."""
    return text.encode("ascii")


def Q(*values: int) -> bytes:  # noqa: N802
    """Concatenated 8-byte unsigned (SGLang native Q; little-endian hosts)."""
    return struct.pack(f"<{len(values)}Q", *values)


def I(*values: int) -> bytes:  # noqa: N802, E743
    """Concatenated 4-byte unsigned (SGLang native I)."""
    return struct.pack(f"<{len(values)}I", *values)


def i32(*values: int) -> bytes:
    """ndarray(int32).tobytes()."""
    return struct.pack(f"<{len(values)}i", *values)


def PIL(lists: Sequence[Sequence[int]], fmt: str) -> bytes:  # noqa: N802
    """common/utils.py pack_int_lists: <(n+1)I header of byte lengths, then each list."""
    if not lists:
        return b""
    size = struct.calcsize("<" + fmt)
    header = struct.pack(f"<{len(lists) + 1}I", len(lists), *(len(x) * size for x in lists))
    return header + b"".join(struct.pack(f"<{len(x)}{fmt}", *x) for x in lists)


def BE32(value: int) -> bytes:  # noqa: N802
    """Big-endian 4-byte length (AUX_DATA)."""
    return struct.pack(">I", value)


def pack_container(frames: Sequence[bytes]) -> bytes:
    """``PDLF``, <I frame count, then <I length + bytes per frame."""
    out = [MAGIC, struct.pack("<I", len(frames))]
    for frame in frames:
        out += [struct.pack("<I", len(frame)), frame]
    return b"".join(out)


def unpack_container(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack_container`; rejects trailing or missing bytes."""
    if data[:4] != MAGIC:
        raise ValueError("not a PDLF golden container")
    (count,) = struct.unpack_from("<I", data, 4)
    offset, frames = 8, []
    for _ in range(count):
        (n,) = struct.unpack_from("<I", data, offset)
        frames.append(data[offset + 4: offset + 4 + n])
        offset += 4 + n
        if len(frames[-1]) != n:
            raise ValueError("truncated PDLF container")
    if offset != len(data):
        raise ValueError("trailing bytes in PDLF container")
    return frames


# Mooncake registration, inventory 1.2 (builder order mooncake/conn.py:3255-3279).
MC_REGISTRATION = [
    S("None"),                          # 0 room sentinel
    S("10.1.2.3"),                      # 1 endpoint (decode local_ip)
    A(17001),                           # 2 dst_port (decode rank_port)
    S("10.1.2.3:15001"),                # 3 mooncake_session_id
    Q(0x7F0000001000, 0x7F0000101000, 0x7F0000201000),  # 4 dst_kv_ptrs (2 target + 1 draft)
    Q(0x7E0000000000),                  # 5 dst_aux_ptrs
    PIL([[0x7D0000000000, 0x7D0000100000], [0x7D0000200000]], "Q"),  # 6 state data ptrs
    A(1),                               # 7 dst_tp_rank
    A(4),                               # 8 dst_attn_tp_size
    A(36864),                           # 9 dst_kv_item_len (64 tokens * 576 B)
    PIL([[4096, 8192], [2048]], "I"),   # 10 dst_state_item_lens
    PIL([[16, 32]], "I"),               # 11 dst_state_dim_per_tensor (outer length 1 of 2)
    I(0, 1, 61),                        # 12 dst_kv_layer_ids (4-byte)
    PIL([[3], [7]], "I"),               # 13 dst_state_layer_ids
    Q(0x7C0000000000),                  # 14 staging base ptr (single Q)
    A(1 << 30),                         # 15 staging total size
    A(4),                               # 16 dst_dcp_size
    A(1),                               # 17 dst_dcp_rank
    Q(0, 1, 61),                        # 18 staging slot_layer_ids (8-byte)
    Q(36864, 36864, 147456),            # 19 dst_kv_item_lens (draft page holds 4x rows)
]

# A sender from before DCP and staging slot ids: stops after slot 15, no staging.
MC_REGISTRATION_PRE_DCP = [
    S("None"), S("10.1.2.4"), A(17002), S("10.1.2.4:15002"), Q(0x7F0000001000, 0x7F0000101000),
    Q(0x7E0000000000), b"", A(0), A(2), A(36864), b"", b"", b"", b"", b"", b"",
]

MC_TRANSFER_INFO = [
    A(9001), S("10.1.2.3"), A(17001), S("10.1.2.3:15001"),
    i32(12, 13, 40),                    # 4 dst_kv_indices
    A(5),                               # 5 dst_aux_index
    PIL([[2], []], "i"),                # 6 dst_state_indices
    A(1),                               # 7 required_dst_info_num
    A(256),                             # 8 decode_prefix_len (always sent as str(x or 0))
    b"",                                # 9 dst_device_kv_indices: not HiSparse
]

# Dummy peer: the sentinel pair b"" / b"" in slots 4 and 5.
MC_TRANSFER_INFO_DUMMY = [
    A(9001), S("10.1.2.5"), A(17003), S("10.1.2.5:15003"), b"", b"", b"", A(1), A(0), b"",
]

# An older sender without decode_prefix_len and device indices (8 frames).
MC_TRANSFER_INFO_PRE_PREFIX = [
    A(77), S("10.1.2.3"), A(17001), S("10.1.2.3:15001"), i32(3), A(0), b"", A(2),
]

# NIXL registration, inventory 1.3 (builder order nixl/conn.py:3467-3493), wire numbering.
NX_REGISTRATION = [
    GUARD,                              # 0 guard
    S("None"),                          # 1 room
    S("10.2.0.7"),                      # 2 endpoint
    A(18001),                           # 3 dst_port
    S("0b5a0f9e-2c7d-4f35-9a51-6c1d1e0f0a11"),  # 4 agent_name (uuid4)
    b"\x00\x01nixl-agent-metadata\xff",  # 5 agent_metadata (opaque)
    Q(0x7F0000001000, 0x7F0000101000),  # 6 dst_kv_ptrs
    Q(0x7E0000000000),                  # 7 dst_aux_ptrs
    PIL([[0x7D0000000000]], "Q"),       # 8 dst_state_data_ptrs
    A(3),                               # 9 gpu_id
    A(8),                               # 10 decode_tp_size
    A(3),                               # 11 decode_tp_rank (engine_rank)
    A(36864),                           # 12 dst_kv_item_len
    PIL([[4096]], "I"),                 # 13 dst_state_item_lens
    PIL([[16]], "I"),                   # 14 dst_state_dim_per_tensor
    b"",                                # 15 staging base: none
    b"",                                # 16 staging size: none
    A(4096),                            # 17 dst_num_slots
    S("VRAM,DRAM"),                     # 18 dst_kv_mem_kinds
    Q(36864, 36864),                    # 19 dst_kv_item_lens
    PIL([[5]], "I"),                    # 20 dst_state_layer_ids
    I(0, 1),                            # 21 dst_kv_layer_ids
    A(2),                               # 22 dst_dcp_size
    A(1),                               # 23 dst_dcp_rank
    PIL([[1 << 20]], "Q"),              # 24 dst_state_data_lens
]

# A NIXL decode from before DCP: stops after the kv layer ids (wire frame 21).
NX_REGISTRATION_PRE_DCP = [
    GUARD, S("None"), S("10.2.0.8"), A(18002), S("agent-pre-dcp"), b"meta", Q(0x1000), Q(0x2000),
    b"", A(0), A(1), A(0), A(36864), b"", b"", b"", b"", b"", b"", b"", b"", b"",
]

NX_TRANSFER_INFO = [
    GUARD, A(9002), S("10.2.0.7"), A(18001), S("0b5a0f9e-2c7d-4f35-9a51-6c1d1e0f0a11"),
    i32(100, 101), A(9), A(1), PIL([[4]], "i"), A(0), A(0),
]

# Dummy with the explicit flag: empty kv, aux still sent.
NX_TRANSFER_INFO_DUMMY = [
    GUARD, A(9002), S("10.2.0.9"), A(18003), S("agent-dummy"), b"", A(0), A(1), b"", A(0), A(1),
]

# An older sender without the flag frame: empty kv and prefix 0 infer a dummy.
NX_TRANSFER_INFO_NO_FLAG = [
    GUARD, A(9003), S("10.2.0.9"), A(18003), S("agent-old"), b"", A(0), A(1), b"", A(0),
]

GOLDENS: dict[str, list[bytes]] = {
    "mooncake/registration_v0523.bin": MC_REGISTRATION,
    "mooncake/registration_pre_dcp.bin": MC_REGISTRATION_PRE_DCP,
    "mooncake/transfer_info_v0523.bin": MC_TRANSFER_INFO,
    "mooncake/transfer_info_dummy.bin": MC_TRANSFER_INFO_DUMMY,
    "mooncake/transfer_info_pre_prefix.bin": MC_TRANSFER_INFO_PRE_PREFIX,
    "mooncake/status_success.bin": [A(9001), A(4), A(5)],
    "mooncake/abort_room_only.bin": [b"ABORT", A(9001)],
    "mooncake/abort_v0523.bin": [b"ABORT", A(9001), S("10.1.2.3"), A(17001), A(3)],
    "mooncake/abort_ack_legacy.bin": [b"ABORT_ACK", A(9001)],
    "mooncake/abort_ack_v0523.bin": [b"ABORT_ACK", A(9001), A(5), A(3)],
    "mooncake/bootstrap.bin": [b"BOOTSTRAP", A(9001), S("10.1.2.3"), A(17001)],
    "mooncake/staging_req.bin": [b"STAGING_REQ", A(9001), A(2), A(16), S("10.0.0.9:15000"),
                                 A(1)],
    "mooncake/staging_rsp_granted.bin": [b"STAGING_RSP", A(9001), A(2), A(65536), A(3),
                                         A(131072), S("10.0.0.9:15000")],
    "mooncake/staging_rsp_oversized.bin": [b"STAGING_RSP", A(9001), A(2), A(-2), A(0), A(-1),
                                           S("10.0.0.9:15000")],
    "mooncake/watermark.bin": [b"WATERMARK", A(3), A(65536), S("10.0.0.9:15000")],
    "mooncake/chunk_ready.bin": [b"CHUNK_READY", A(9001), A(2), A(32), A(16), S("w-0"), A(5)],
    "mooncake/aux_data.bin": [b"AUX_DATA", A(9001), A(0), A(5), BE32(6), b"\x01\x02aux\x00"],
    "nixl/registration_v0523.bin": NX_REGISTRATION,
    "nixl/registration_pre_dcp.bin": NX_REGISTRATION_PRE_DCP,
    "nixl/transfer_info_v0523.bin": NX_TRANSFER_INFO,
    "nixl/transfer_info_dummy.bin": NX_TRANSFER_INFO_DUMMY,
    "nixl/transfer_info_no_flag.bin": NX_TRANSFER_INFO_NO_FLAG,
    "nixl/status_failed.bin": [b"KV_STATUS", A(9002), A(0), A(2),
                               "KV transfer failed: ünreachable".encode()],
    "nixl/status_no_reason.bin": [b"KV_STATUS", A(9002), A(4), A(2)],
    "nixl/abort_v0523.bin": [b"ABORT", A(9002), S("10.2.0.7"), A(18001), A(7)],
    "nixl/abort_ack_v0523.bin": [b"ABORT_ACK", A(9002), A(2)],
    "nixl/staging_req.bin": [b"STAGING_REQ", A(9002), A(0), A(8), S("agent-x")],
    "nixl/staging_rsp_pending.bin": [b"STAGING_RSP", A(9002), A(0), A(-1), A(1), A(0),
                                     S("agent-x")],
    "nixl/watermark_no_session.bin": [b"WATERMARK", A(2), A(4096)],
    "nixl/chunk_ready.bin": [b"CHUNK_READY", A(9002), A(0), A(0), A(8), S("agent-x"), A(2)],
}


def main() -> int:
    """Write every golden file; print what changed."""
    for name, frames in GOLDENS.items():
        path = HERE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        data = pack_container(frames)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            print(f"wrote {name} ({len(frames)} frames, {len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
