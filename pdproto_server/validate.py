"""Request validation: malformed input becomes INVALID_ARGUMENT with BadRequest field violations.

Besides what must hold for a request to mean anything (a page size, a transport, ranks
inside their groups), every size, count, rank and name a peer sends has a sanity bound
(``Bounds``), far above any real deployment and far below what would make the service
allocate or compute without bound. A value past one is refused at the call that carries it
(Register or SubmitTransfer), with the field named, instead of being accepted and failing
every transfer later (DCP size 2^31 used to be).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeVar

from pdproto import backends
from pdproto.negotiation.reach import unreachable
from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError, Reason
from pdproto.negotiation.slots import check_destination
from pdproto.v1 import handshake_service_pb2 as hs
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2

from .engine import page_extent
from .registry import ENGINE_BYTES, Peer

_MAX_PAGE = (1 << 31) - 1


class Bounds:
    """Sanity bounds on what a peer may send (docs/security.md, "What is checked, where")."""

    GROUP = 1 << 12
    """Ranks in a TP, DCP or PP group."""
    PAGE_SIZE = 1 << 20
    """Tokens per page."""
    ENTRIES = 1 << 14
    """KV buffers, aux buffers, state entries, tensors of one state entry, slots in one request."""
    NAME = 256
    """Characters in a name: engine identity, host, dtype, model id, capability, peer name."""
    CAPABILITIES = 64
    """Capabilities one message lists."""
    HEADS = 1 << 16
    """KV heads of a model."""
    DEVICE = 1 << 16
    """A GPU index."""
    SLOTS = 1 << 24
    """Request slots (``num_slots``)."""
    PREFIX = 1 << 62
    """Tokens of a decode prefix (the planner's own limit on row arithmetic)."""
    ADDRESS = 1 << 64
    """End of a registered region (pointer + length) in a 64-bit address space."""
    REGIONS = 1 << 16
    """Buffers and tensors of one registration in all (KV buffers, aux buffers, state tensors)."""


def registration_entries(reg: registration_pb2.KvRegistration) -> int:
    """Buffers and tensors ``reg`` lists (KV, aux, state entries and their tensors); the count stops
    once past ``Bounds.REGIONS``, so it costs little whatever the message holds."""
    n = len(reg.kv_buffers) + len(reg.aux_ptrs) + len(reg.state_buffers)
    for sb in reg.state_buffers:
        if n > Bounds.REGIONS:
            break
        n += len(sb.data_ptrs)
    return n


def _name(field: str, value: str, bad: list[tuple[str, str]], *, required: bool = False) -> None:
    """A name: at most Bounds.NAME printable characters (no NUL or control characters)."""
    if required and not value:
        bad.append((field, "must be non-empty"))
    elif len(value) > Bounds.NAME:
        bad.append((field, f"longer than {Bounds.NAME} characters ({len(value)})"))
    elif not value.isprintable():
        bad.append((field, "must be printable (no NUL or control characters)"))


def _count(field: str, n: int, limit: int, bad: list[tuple[str, str]]) -> None:
    if n > limit:
        bad.append((field, f"{n} entries, more than the {limit} this server accepts"))


def _most(field: str, value: int, limit: int, bad: list[tuple[str, str]]) -> None:
    if value > limit:
        bad.append((field, f"{value} is more than the {limit} this server accepts"))


@functools.cache
def _string_fields(transport: str) -> tuple[tuple[str, str], ...]:
    """(path, attribute) of every string field of the ``transport`` endpoint (read once per transport)."""
    endpoint = registration_pb2.KvRegistration.DESCRIPTOR.fields_by_name[transport].message_type
    assert endpoint is not None, "every transport of the oneof is a message"
    return tuple((f"registration.{transport}.{fd.name}", fd.name) for fd in endpoint.fields
                 if fd.type == fd.TYPE_STRING)


_GROUPS = ("attn_tp", "dcp", "pp")
_T = TypeVar("_T")


def _first_entries(items: Sequence[_T]) -> Sequence[_T]:
    """The first ``Bounds.ENTRIES`` of ``items``: the field itself when it has no more (slicing a
    repeated field copies it)."""
    return items[:Bounds.ENTRIES] if len(items) > Bounds.ENTRIES else items


def _sanity(reg: registration_pb2.KvRegistration, groups: Sequence[common_pb2.ParallelGroup],
            transport: str | None, bad: list[tuple[str, str]]) -> None:
    """Every size, count, rank and name of a registration inside ``Bounds`` (``groups`` and ``transport``
    as ``check_registration`` read them: each field is read once per Register)."""
    _most("registration.page_size", reg.page_size, Bounds.PAGE_SIZE, bad)
    for name, group in zip(_GROUPS, groups):
        _most(f"registration.{name}.size", group.size, Bounds.GROUP, bad)
    for field, value in (("registration.kv_cache_dtype", reg.kv_cache_dtype), ("registration.model_id", reg.model_id),
                         ("registration.notify_endpoint.host", reg.notify_endpoint.host)):
        _name(field, value, bad)
    _count("registration.capabilities", len(reg.capabilities), Bounds.CAPABILITIES, bad)
    for i, cap in enumerate(reg.capabilities[:Bounds.CAPABILITIES]):
        _name(f"registration.capabilities[{i}]", cap, bad)
    if transport is not None:
        endpoint = getattr(reg, transport)
        for field, attr in _string_fields(transport):
            _name(field, getattr(endpoint, attr), bad)
    kv, states = reg.kv_buffers, reg.state_buffers
    for field, n in (("registration.kv_buffers", len(kv)), ("registration.aux_ptrs", len(reg.aux_ptrs)),
                     ("registration.aux_item_lens", len(reg.aux_item_lens)),
                     ("registration.aux_data_lens", len(reg.aux_data_lens)),
                     ("registration.state_buffers", len(states))):
        _count(field, n, Bounds.ENTRIES, bad)
    for i, sb in enumerate(_first_entries(states)):
        _count(f"registration.state_buffers[{i}].data_ptrs", len(sb.data_ptrs), Bounds.ENTRIES, bad)
    # Each buffer and tensor costs the server time at registration and a bound at every transfer.
    listed = registration_entries(reg)
    if listed > Bounds.REGIONS:
        bad.append(("registration", f"more than {Bounds.REGIONS} buffers and tensors in all (KV buffers, aux "
                                    f"buffers, state entries and their tensors: {listed} counted so far)"))
    for i, buf in enumerate(_first_entries(kv)):
        if buf.ptr + buf.length > Bounds.ADDRESS:
            bad.append((f"registration.kv_buffers[{i}].length", "ptr + length runs past the 64-bit address space"))
    _most("registration.total_kv_heads", reg.total_kv_heads, Bounds.HEADS, bad)
    _most("registration.gpu_id", reg.gpu_id, Bounds.DEVICE, bad)
    _most("registration.num_slots", reg.num_slots, Bounds.SLOTS, bad)


def check_registration(request: hs.RegisterRequest, origin: str = "") -> registration_pb2.KvRegistration:
    """The registration, or an ``InvalidFieldError`` naming every malformed field.

    ``origin`` is the gRPC peer of the call: an engine advertising loopback to a prefill it
    reached from another host is refused here (``pdproto.negotiation.reach.unreachable``).
    """
    bad: list[tuple[str, str]] = []
    if not request.HasField("registration"):
        raise InvalidFieldError.of([("registration", "required")])
    reg = request.registration
    transport = reg.WhichOneof("transport")
    if transport is None:
        bad.append(("registration.transport",
                     f"one of {', '.join(b.transport for b in backends.ALL)} is required"))
    else:
        spec = backends.by_transport(transport)
        if not spec.identity_of(reg):
            bad.append((f"registration.{spec.transport}.{spec.identity}", "must be non-empty"))
    if reg.page_size == 0:
        bad.append(("registration.page_size", "must be > 0"))
    kv = reg.kv_buffers
    if not kv:
        bad.append(("registration.kv_buffers", "at least one KV buffer is required"))
    if reg.notify_endpoint.port > 65535:
        bad.append(("registration.notify_endpoint.port", "must be <= 65535"))
    groups = (reg.attn_tp, reg.dcp, reg.pp)
    for name, group in zip(_GROUPS, groups):
        size = group.size
        if size and group.rank >= size:
            bad.append((f"registration.{name}.rank", f"rank {group.rank} is outside size {size}"))
    for i, buf in enumerate(_first_entries(kv)):
        length, item_len = buf.length, buf.item_len
        if length and item_len and length < item_len:
            bad.append((f"registration.kv_buffers[{i}].length", "smaller than one page (item_len)"))
    if reg.HasField("credential_buffer"):
        cb = reg.credential_buffer
        if cb.length < ENGINE_BYTES:
            bad.append(("registration.credential_buffer.length", f"must be at least {ENGINE_BYTES} bytes"))
        if kv and cb.memory_kind != kv[0].memory_kind:
            bad.append(("registration.credential_buffer.memory_kind", "must be the KV buffers' memory kind"))
    bad += unreachable(reg, origin)
    _sanity(reg, groups, transport, bad)
    if bad:
        raise InvalidFieldError.of(bad)
    return reg


def check_transfer(t: transfer_pb2.TransferInfo, peer: Peer) -> Sequence[int]:
    """The destination pages of ``t`` (the message's own list, not a copy), checked with its aux
    index and state slots against the memory the peer registered."""
    pages = t.dst_kv_pages
    bad: list[tuple[str, str]] = []
    if not t.is_dummy and not pages:
        bad.append(("transfer.dst_kv_pages", "a non-dummy request needs destination pages"))
    if pages:
        low, high = page_extent(pages)
        if low < 0:
            bad.append(("transfer.dst_kv_pages", "page indexes must be >= 0"))
    _most("transfer.decode_prefix_len", t.decode_prefix_len, Bounds.PREFIX, bad)
    _most("transfer.required_dst_info_num", t.required_dst_info_num, Bounds.GROUP, bad)
    _count("transfer.dst_state_indices", len(t.dst_state_indices), Bounds.ENTRIES, bad)
    for i, slots in enumerate(t.dst_state_indices[:Bounds.ENTRIES]):
        _count(f"transfer.dst_state_indices[{i}].indices", len(slots.indices), Bounds.ENTRIES, bad)
    _name("transfer.peer_name", t.peer_name, bad)
    _name("transfer.notify_endpoint.host", t.notify_endpoint.host, bad)
    if t.notify_endpoint.port > 65535:
        bad.append(("transfer.notify_endpoint.port", "must be <= 65535"))
    if bad:
        raise InvalidFieldError.of(bad)
    if pages:
        _check_bounds(peer, high)
    tp = peer.decision.tp
    if tp is not None:
        # Refused here, before anything moves; the executor bounds every write again.
        check_destination(tp.aux, tp.state, peer.registration, t)
    return pages


def page_limit(peer: Peer) -> tuple[int, int]:
    """(pages, entry) of the smallest paired destination buffer whose length is known; (-1, -1) if none."""
    limit, entry = -1, -1
    for pairing in peer.decision.pairings:
        buf = peer.registration.kv_buffers[pairing.dst_entry]
        if not buf.length or not buf.item_len:
            continue  # length 0 means unknown; the executor still bounds each write
        pages = buf.length // buf.item_len
        if limit < 0 or pages < limit:
            limit, entry = pages, pairing.dst_entry
    return limit, entry


def _check_bounds(peer: Peer, max_page: int) -> None:
    """Every paired destination buffer must hold ``max_page`` (when its length is known)."""
    pages, entry = peer.page_limit
    if 0 <= pages <= max_page:
        raise DestinationOutOfBoundsError(
            f"destination page {max_page} is outside the {pages} pages registered for entry "
            f"{entry}", reason=Reason.DESTINATION_OUT_OF_BOUNDS,
            metadata={"maxPage": max_page, "registeredPages": pages, "entry": entry})
    if max_page > _MAX_PAGE:
        raise InvalidFieldError.of([("transfer.dst_kv_pages", "page index too large")])


__all__ = ["Bounds", "check_registration", "check_transfer", "page_limit", "registration_entries"]
