"""Topology negotiation: (PrefillServerInfo, KvRegistration) -> Decision or Rejection.

One pure function decides, per decode peer, how the prefill lays rows out for it, so
the prefill and a decode (or ``pdproto check``) that runs ``negotiate`` compute the same
answer from the same pair. SGLang 0.5.23 ran two different rule sets on two threads and
raised in a listener that served every peer; here an unsupported pair is a value.

The rules, their order (the first failing rule is the one reported) and their reasons are
the numbered table of ``docs/protocol.md`` section 1; ``_decide`` applies them in that order,
and the rule numbers in comments here are that table's.

Malformed input raises ``InvalidFieldError`` (reason INVALID_FIELD, ``field`` names the
path) instead of returning a rejection: a page size of 0, an entry list that is empty,
an item_len of 0 that no legacy scalar can stand in for, or a legacy ``kv_item_len``
that contradicts entry 0. Optional data that legacy peers never sent (dtype, model id,
attention kind, version) is compared only when present; an absent version is read as
the version this package speaks.
"""

from __future__ import annotations

import enum
import math
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from pdproto import PROTOCOL_MAJOR, PROTOCOL_MINOR, backends, v1
from pdproto.negotiation._topology_examples import example_registration, example_server_info
from pdproto.dcp.layers import EntryRef, EntryRole, resolve_entries
from pdproto.dcp.layout import DcpLayout
from pdproto.errors import InvalidFieldError, PdprotoError, Reason, TopologyError, error_for
from pdproto.negotiation.extras import MLA_ATTENTION_KINDS, enum_name, every_head
from pdproto.negotiation.tpmap import TpPlan, plan_tp


PAGE_RELAYOUT = "page-relayout"
"""Decode capability: its rows may be planned token by token into pages of another size, so equal DCP
layouts need not share a page size (rule 12). The executors always move planned runs; the rule
stays for decodes (SGLang's own) that copy whole pages."""


class Mode(enum.IntEnum):
    """How rows are laid out for a peer; values equal ``pdproto.v1.NegotiationMode``."""

    SAME_LAYOUT = 1
    DENSE_TO_DCP = 2
    DCP_TO_DCP = 3
    DCP_TO_DENSE = 4

    @property
    def requires_relayout(self) -> bool:
        """True unless pages copy as pages."""
        return self is not Mode.SAME_LAYOUT


@dataclass(frozen=True)
class Pairing:
    """One prefill entry paired with one decode entry, with each side's bytes per token."""

    src_entry: int
    """Index into ``PrefillServerInfo.kv_entries``."""
    dst_entry: int
    """Index into ``KvRegistration.kv_buffers``."""
    src_token_bytes: int
    """Bytes of one token row on the prefill."""
    dst_token_bytes: int
    """Bytes of one token row on the decode (equal to the source today)."""
    role: EntryRole
    """Target or draft."""

    def to_proto(self) -> v1.EntryPairing:
        """The ``EntryPairing`` message."""
        return v1.EntryPairing(
            src_entry=self.src_entry, dst_entry=self.dst_entry,
            src_token_bytes=self.src_token_bytes, dst_token_bytes=self.dst_token_bytes,
            role=int(self.role),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Decision:
    """An accepted pair: the layout mode and everything the planner and executor need."""

    mode: Mode
    """Layout mode."""
    pairings: tuple[Pairing, ...]
    """One pairing per prefill entry, in prefill entry order."""
    src: DcpLayout
    """Prefill layout (page size, DCP group and rank); the planner's source."""
    dst: DcpLayout
    """Decode layout; the planner's destination."""
    backend: int
    """``pdproto.v1.Backend`` value that moves the bytes."""
    version: tuple[int, int]
    """Agreed (major, minor): the common major and the smaller minor."""
    tp: TpPlan
    """What this prefill rank writes besides token rows: senders, aux, state, MHA row slices."""

    def to_proto(self, peer_id: str = "") -> v1.NegotiationResult:
        """The ``NegotiationResult`` message for this peer."""
        result = v1.NegotiationResult(
            peer_id=peer_id,
            mode=int(self.mode),  # type: ignore[arg-type]
            entries=[p.to_proto() for p in self.pairings],
            src_dcp=self.src.group(),
            dst_dcp=self.dst.group(),
            backend=self.backend,  # type: ignore[arg-type]
            version=v1.ProtocolVersion(major=self.version[0], minor=self.version[1]),
            src_page_size=self.src.page_size,
            dst_page_size=self.dst.page_size,
        )
        self.tp.fill(result)
        return result


@dataclass(frozen=True)
class Rejection:
    """A pair that cannot be served: the reason, a message, and the offending values."""

    reason: Reason
    """Machine-readable reason."""
    message: str
    """Human explanation naming the values."""
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Offending values, keys in lowerCamelCase (they become ErrorInfo metadata)."""

    def __post_init__(self) -> None:
        # Freeze the mapping too, so a Rejection is a value all the way down.
        frozen = types.MappingProxyType({str(k): str(v) for k, v in self.metadata.items()})
        object.__setattr__(self, "metadata", frozen)

    def to_proto(self, peer_id: str = "") -> v1.NegotiationResult:
        """A ``NegotiationResult`` with only ``rejection`` (and ``peer_id``) set."""
        return v1.NegotiationResult(
            peer_id=peer_id,
            rejection=v1.Rejection(
                reason=self.reason.code, message=self.message, metadata=dict(self.metadata)
            ),
        )

    def to_error(self) -> PdprotoError:
        """The same verdict as a raisable error of its reason's class (a ``TopologyError``
        for every reason ``negotiate`` gives)."""
        return error_for(self.reason, self.message, self.metadata)


def backend_of(registration: v1.KvRegistration) -> int:
    """The ``Backend`` a registration's transport oneof names (UNSPECIFIED when unset)."""
    spec = backends.of_registration(registration)
    return v1.BACKEND_UNSPECIFIED if spec is None else spec.enum


def _reject(reason: Reason, message: str, **metadata: object) -> PdprotoError:
    """An internal short-circuit carrying a rejection; ``negotiate`` turns it into a value.

    Every reason given here has a ``TopologyError`` class (UNSUPPORTED_VERSION's is a
    subclass), which is what ``negotiate`` catches.
    """
    return error_for(reason, message, metadata)


def _validate(info: v1.PrefillServerInfo, reg: v1.KvRegistration) -> None:
    """Raise ``InvalidFieldError`` for input that cannot be interpreted at all."""
    if info.page_size == 0:
        raise InvalidFieldError("info.page_size", "prefill page_size must be > 0")
    if reg.page_size == 0:
        raise InvalidFieldError("registration.page_size", "decode page_size must be > 0")
    if not info.kv_entries:
        raise InvalidFieldError("info.kv_entries", "prefill publishes no KV entries")
    if not reg.kv_buffers:
        raise InvalidFieldError("registration.kv_buffers", "decode registers no KV buffers")
    for i, e in enumerate(info.kv_entries):
        if e.item_len == 0:
            raise InvalidFieldError(f"info.kv_entries[{i}].item_len", "item_len must be > 0")
    first = reg.kv_buffers[0].item_len
    if reg.kv_item_len and first and reg.kv_item_len != first:
        raise InvalidFieldError(
            "registration.kv_item_len",
            f"legacy kv_item_len {reg.kv_item_len} contradicts kv_buffers[0].item_len {first}",
            metadata={"kvItemLen": reg.kv_item_len, "firstItemLen": first},
        )
    for i, b in enumerate(reg.kv_buffers):
        role = EntryRole.from_proto(b.role)
        if b.item_len == 0 and (role is EntryRole.DRAFT or reg.kv_item_len == 0):
            raise InvalidFieldError(
                f"registration.kv_buffers[{i}].item_len",
                "item_len must be > 0 (a target entry may fall back to kv_item_len)",
            )


def _version(info: v1.PrefillServerInfo, reg: v1.KvRegistration) -> tuple[int, int]:
    """Agreed protocol version, or a rejection when the majors differ."""
    ours = (PROTOCOL_MAJOR, PROTOCOL_MINOR)
    p = (info.version.major, info.version.minor) if info.HasField("version") else ours
    d = (reg.version.major, reg.version.minor) if reg.HasField("version") else ours
    if p[0] != d[0] or p[0] != PROTOCOL_MAJOR:
        raise _reject(
            Reason.UNSUPPORTED_VERSION,
            f"protocol major versions differ or are unsupported: prefill {p[0]}, decode {d[0]},"
            f" supported {PROTOCOL_MAJOR}",
            prefillMajor=p[0], decodeMajor=d[0], supportedMajor=PROTOCOL_MAJOR,
        )
    return p[0], min(p[1], d[1])


def _check_ranks(**groups: v1.ParallelGroup) -> None:
    """Reject the first group (in keyword order) whose rank is outside its size (an unset size reads as 1)."""
    for name, g in groups.items():
        size = g.size or 1
        if g.rank >= size:
            raise _reject(
                Reason.TOPOLOGY_RANK_OUT_OF_RANGE,
                f"{name} rank {g.rank} is outside 0..{size - 1}",
                group=name, rank=g.rank, size=size,
            )


def _mode(src: DcpLayout, dst: DcpLayout) -> Mode:
    """The layout mode of a DCP pair, or a rejection when the two ranks share no tokens."""
    if src.dcp_size == dst.dcp_size:
        if src.dcp_rank != dst.dcp_rank:
            raise _reject(
                Reason.TOPOLOGY_DCP_RANK_MISMATCH,
                f"equal DCP sizes ({src.dcp_size}) copy pages rank to rank, but prefill DCP rank"
                f" {src.dcp_rank} != decode DCP rank {dst.dcp_rank}",
                prefillDcpSize=src.dcp_size, prefillDcpRank=src.dcp_rank,
                decodeDcpSize=dst.dcp_size, decodeDcpRank=dst.dcp_rank,
            )
        return Mode.SAME_LAYOUT
    g = math.gcd(src.dcp_size, dst.dcp_size)
    # Token p lives on source rank p % Ns and destination rank p % Nd: both hold some p
    # iff the ranks agree modulo gcd(Ns, Nd). A pair sharing nothing is a wiring error.
    if src.dcp_rank % g != dst.dcp_rank % g:
        raise _reject(
            Reason.TOPOLOGY_DCP_RANK_MISMATCH,
            f"prefill DCP rank {src.dcp_rank}/{src.dcp_size} and decode DCP rank {dst.dcp_rank}/{dst.dcp_size}"
            f" share no tokens (ranks must agree modulo {g})",
            prefillDcpSize=src.dcp_size, prefillDcpRank=src.dcp_rank,
            decodeDcpSize=dst.dcp_size, decodeDcpRank=dst.dcp_rank, gcd=g,
        )
    if src.dcp_size == 1:
        return Mode.DENSE_TO_DCP
    if dst.dcp_size == 1:
        return Mode.DCP_TO_DENSE
    return Mode.DCP_TO_DCP


def _token_bytes(item_len: int, page_size: int, dcp_size: int, role: EntryRole,
                 side: str, entry: int) -> int:
    """Bytes per token row of an entry; a remainder is a rejection, not a floor."""
    rows = page_size * (dcp_size if role is EntryRole.DRAFT else 1)
    if item_len % rows:
        raise _reject(
            Reason.TOPOLOGY_ROW_SIZE_MISMATCH,
            f"{side} entry {entry} ({role.name.lower()}): item_len {item_len} is not a multiple"
            f" of its {rows} rows per page",
            side=side, entry=entry, role=role.name, itemLen=item_len, rowsPerPage=rows,
        )
    return item_len // rows


def _decide(info: v1.PrefillServerInfo, reg: v1.KvRegistration,
            backends: Collection[int] | None) -> Decision:
    """Apply the rules of docs/protocol.md section 1 in order; raise ``TopologyError`` on the first failure."""
    version = _version(info, reg)

    backend = backend_of(reg)
    served = list(info.backends) if backends is None else list(backends)
    # An empty list means the prefill did not publish one (legacy): any real backend goes.
    if backend == v1.BACKEND_UNSPECIFIED or (served and backend not in served):
        raise _reject(
            Reason.TOPOLOGY_BACKEND_UNSUPPORTED,
            "decode registration names no transport (mooncake, nixl or local)"
            if backend == v1.BACKEND_UNSPECIFIED else
            f"decode backend {enum_name(v1.Backend, backend)} is not served by this prefill",
            decodeBackend=enum_name(v1.Backend, backend),
            servedBackends=",".join(enum_name(v1.Backend, b) for b in served),
        )

    if info.model_id and reg.model_id and info.model_id != reg.model_id:
        raise _reject(Reason.TOPOLOGY_MODEL_MISMATCH,
                      f"model {info.model_id!r} on prefill, {reg.model_id!r} on decode",
                      prefillModelId=info.model_id, decodeModelId=reg.model_id)

    # The decode's attn_tp rank is not checked: SGLang sends its global TP rank there
    # (dst_tp_rank), which exceeds the attention TP size under DP attention.
    _check_ranks(decodeDcp=reg.dcp, decodePp=reg.pp, prefillDcp=info.dcp, prefillPp=info.pp,
                 prefillAttnTp=info.attn_tp, prefillAttnCp=info.attn_cp)
    src_pp, dst_pp, src_cp = info.pp.size or 1, reg.pp.size or 1, info.attn_cp.size or 1
    # From here on each side's DCP group and page size travel together, as one layout.
    src, dst = DcpLayout.from_proto(info.page_size, info.dcp), DcpLayout.from_proto(reg.page_size, reg.dcp)

    pk, dk = info.attention_kind, reg.attention_kind
    if pk and dk and pk != dk:
        raise _reject(Reason.TOPOLOGY_ATTENTION_KIND_MISMATCH,
                      f"prefill KV pool is {enum_name(v1.AttentionKind, pk)},"
                      f" decode is {enum_name(v1.AttentionKind, dk)}",
                      prefillAttentionKind=enum_name(v1.AttentionKind, pk),
                      decodeAttentionKind=enum_name(v1.AttentionKind, dk))

    if info.kv_cache_dtype and reg.kv_cache_dtype and info.kv_cache_dtype != reg.kv_cache_dtype:
        raise _reject(Reason.TOPOLOGY_KV_DTYPE_MISMATCH,
                      f"KV dtype {info.kv_cache_dtype!r} on prefill, {reg.kv_cache_dtype!r} on decode",
                      prefillKvCacheDtype=info.kv_cache_dtype, decodeKvCacheDtype=reg.kv_cache_dtype)

    dcp_used = src.dcp_size > 1 or dst.dcp_size > 1
    # SGLang 0.5.23 frames never carry the decode's pool kind (a bridged registration
    # leaves it unset) and its decode refuses DCP without MLA itself, so an unset decode
    # kind is judged by the prefill's; a decode that does send a kind must match it.
    if dcp_used and not (pk in MLA_ATTENTION_KINDS and (dk in MLA_ATTENTION_KINDS or not dk)):
        raise _reject(Reason.TOPOLOGY_DCP_REQUIRES_MLA,
                      "DCP needs an MLA or hybrid-MLA KV pool on both sides",
                      prefillDcpSize=src.dcp_size, decodeDcpSize=dst.dcp_size,
                      prefillAttentionKind=enum_name(v1.AttentionKind, pk),
                      decodeAttentionKind=enum_name(v1.AttentionKind, dk))
    if dcp_used and info.enable_kv_cache_sharding:
        raise _reject(Reason.TOPOLOGY_KV_SHARDING_WITH_DCP,
                      "prefill KV cache sharding cannot be combined with DCP",
                      prefillDcpSize=src.dcp_size, decodeDcpSize=dst.dcp_size)
    if dcp_used and src_cp > 1:
        raise _reject(Reason.TOPOLOGY_PREFILL_CP_UNSUPPORTED,
                      f"prefill attention CP {src_cp} cannot feed a DCP layout",
                      prefillAttnCpSize=src_cp, prefillDcpSize=src.dcp_size,
                      decodeDcpSize=dst.dcp_size)
    if dst_pp not in (src_pp, 1):
        raise _reject(Reason.TOPOLOGY_PP_MISMATCH,
                      f"decode PP {dst_pp} must equal prefill PP {src_pp} or be 1",
                      prefillPpSize=src_pp, decodePpSize=dst_pp)

    mode = _mode(src, dst)
    if mode is Mode.SAME_LAYOUT and src.page_size != dst.page_size and PAGE_RELAYOUT not in reg.capabilities:
        raise _reject(Reason.TOPOLOGY_PAGE_SIZE_MISMATCH,
                      f"same layout copies pages: page sizes must match (prefill {src.page_size},"
                      f" decode {dst.page_size})",
                      prefillPageSize=src.page_size, decodePageSize=dst.page_size)

    src_refs = [EntryRef(e.layer_id if e.HasField("layer_id") else None,
                         EntryRole.from_proto(e.role)) for e in info.kv_entries]
    dst_refs = [EntryRef(b.layer_id if b.HasField("layer_id") else None,
                         EntryRole.from_proto(b.role)) for b in reg.kv_buffers]
    mapping = resolve_entries(src_refs, dst_refs, src_pp_size=src_pp,
                              dst_pp_size=dst_pp, src_start_layer=info.start_layer)

    # MHA rows of different attention TP sizes hold different numbers of heads, and so do those of a
    # prefill rank that holds every head (extras.every_head); rule 16 compares their bytes per head instead.
    p_tp, d_tp, heads = info.attn_tp.size or 1, reg.attn_tp.size or 1, info.total_kv_heads or reg.total_kv_heads
    pairings = []
    for i, (ref, j) in enumerate(zip(src_refs, mapping.dst_indices, strict=True)):
        if dst_refs[j].role is not ref.role:  # resolve_entries pairs within a role
            raise AssertionError("role changed across a pairing")
        dst_item = reg.kv_buffers[j].item_len or reg.kv_item_len
        sb = _token_bytes(info.kv_entries[i].item_len, src.page_size, src.dcp_size,
                          ref.role, "prefill", i)
        db = _token_bytes(dst_item, dst.page_size, dst.dcp_size, ref.role, "decode", j)
        if sb != db and not (pk == v1.ATTENTION_KIND_MHA and (p_tp != d_tp or every_head(heads, sb, db, p_tp, d_tp))):
            raise _reject(Reason.TOPOLOGY_ROW_SIZE_MISMATCH,
                          f"{ref.role.name.lower()} entry {i} -> {j}: {sb} bytes per token on"
                          f" prefill, {db} on decode",
                          prefillEntry=i, decodeEntry=j, role=ref.role.name,
                          prefillTokenBytes=sb, decodeTokenBytes=db)
        pairings.append(Pairing(i, j, sb, db, ref.role))

    if mode.requires_relayout:
        kinds = {reg.kv_buffers[p.dst_entry].memory_kind or v1.MEMORY_KIND_VRAM for p in pairings}
        if len(kinds) > 1:
            raise _reject(Reason.TOPOLOGY_MEMORY_KIND_MIXED,
                          "relayout destinations must all live in one memory kind",
                          decodeMemoryKinds=",".join(
                              sorted(enum_name(v1.MemoryKind, k) for k in kinds)))

    tp = plan_tp(info, reg, kv_rows=[(p.src_token_bytes, p.dst_token_bytes) for p in pairings])
    return Decision(mode=mode, pairings=tuple(pairings), src=src, dst=dst,
                    backend=backend, version=version, tp=tp)


def legacy_defaults(info: v1.PrefillServerInfo, reg: v1.KvRegistration) -> v1.KvRegistration:
    """Read what an SGLang 0.5.23 decode leaves out of its registration (it has no page size) as it means it.

    The legacy listener applies it before admission, and ``negotiate`` again (a no-op then):

    * An unset decode page size is the prefill's: SGLang's frames never carry it; the decode
      compared its physical page size with the prefill's ``/route`` answer before registering.
    * An MHA decode sends no head split for its ``swa`` window pages, which SGLang's backends slice
      by head between TP sizes: each rank holds ``total_kv_heads / attn_tp`` of them, as the
      prefill's split says (rule 16e).
    * A plain pool sends no layer ids, and SGLang pairs its entries by position
      (``disaggregation/utils.py:1130``): with as many KV entries as the prefill, each takes the id
      and the role (target or draft) of the prefill's entry at its position. A single-stage decode facing a prefill that holds
      only some layers (a PP stage, a layer-split CP rank) holds more, and SGLang's backends
      address its lists by layer (``get_mla_kv_ptrs_with_pp`` cuts them by the stage's layers):
      its i-th target KV entry (MHA: of the K half and of the V half) and its i-th ``dsa`` index
      tensor are layer i's. A speculative draft's entries come last on both sides (SGLang's frames name
      no roles): as many as the prefill's are read as drafts. Whatever does not fit that reading is
      refused as before (rules 13-15, 16d).

    Nothing else is assumed (an unset pool kind is handled by rule 7).
    """
    if reg.page_size:  # a pdproto decode, or one read already: nothing left out
        return reg
    filled = v1.KvRegistration()
    filled.CopyFrom(reg)
    filled.page_size = info.page_size
    heads = info.total_kv_heads // (filled.attn_tp.size or 1)
    for src, dst in zip(info.state_entries, filled.state_buffers, strict=False):
        if src.type_name == "swa" and heads and not dst.dim_per_tensors and any(t.dim for t in src.tensors):
            dst.dim_per_tensors.extend([heads] * len(dst.data_ptrs))
    if any(b.HasField("layer_id") for b in filled.kv_buffers):
        return filled
    n = len(filled.kv_buffers)
    if n == len(info.kv_entries):
        for buf, entry in zip(filled.kv_buffers, info.kv_entries, strict=True):
            buf.role = entry.role
            if entry.HasField("layer_id"):
                buf.layer_id = entry.layer_id
    elif ((info.pp.size or 1) > 1 or info.enable_dsa_cache_layer_split) and (filled.pp.size or 1) == 1:
        mha = info.attention_kind == v1.ATTENTION_KIND_MHA and n % 2 == 0
        # A speculative draft's entries follow the target's on both sides (the last stage holds them).
        drafts = 0 if mha else sum(e.role == v1.KV_ENTRY_ROLE_DRAFT for e in info.kv_entries)
        for i, buf in enumerate(filled.kv_buffers):
            buf.layer_id = i % (n // 2) if mha else i
            if i >= n - drafts:
                buf.role = v1.KV_ENTRY_ROLE_DRAFT
        for src, dst in zip(info.state_entries, filled.state_buffers, strict=False):
            if src.type_name == "dsa" and not dst.layer_ids:
                dst.layer_ids.extend(range(len(dst.data_ptrs)))
    return filled


def negotiate(info: v1.PrefillServerInfo, registration: v1.KvRegistration, *,
              backends: Collection[int] | None = None) -> Decision | Rejection:
    """Decide how the prefill serves this decode peer (rules: docs/protocol.md section 1).

    ``backends`` overrides ``info.backends`` as the set of ``Backend`` values served.
    Returns a ``Rejection`` for a well-formed pair that cannot be served; raises
    ``InvalidFieldError`` only for malformed input.
    """
    registration = legacy_defaults(info, registration)
    _validate(info, registration)
    try:
        return _decide(info, registration, backends)
    except TopologyError as exc:
        return Rejection(exc.reason, exc.message, exc.metadata)


__all__ = [
    "Decision",
    "Mode",
    "Pairing",
    "Rejection",
    "backend_of",
    "example_registration",
    "example_server_info",
    "legacy_defaults",
    "negotiate",
]
