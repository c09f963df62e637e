"""Request validation: malformed input becomes INVALID_ARGUMENT with BadRequest field violations."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pdproto import backends
from pdproto.reach import unreachable
from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError, Reason
from pdproto.slots import check_destination
from pdproto.v1 import handshake_service_pb2 as hs
from pdproto.v1 import registration_pb2, transfer_pb2

from .registry import Peer

_MAX_PAGE = (1 << 31) - 1


def check_registration(request: hs.RegisterRequest, origin: str = "") -> registration_pb2.KvRegistration:
    """The registration, or an ``InvalidFieldError`` naming every malformed field.

    ``origin`` is the gRPC peer of the call: an engine advertising loopback to a prefill it
    reached from another host is refused here (``pdproto.reach.unreachable``).
    """
    bad: list[tuple[str, str]] = []
    if not request.HasField("registration"):
        raise InvalidFieldError.of([("registration", "required")])
    reg = request.registration
    spec = backends.of_registration(reg)
    if spec is None:
        bad.append(("registration.transport",
                     f"one of {', '.join(b.transport for b in backends.ALL)} is required"))
    elif not spec.identity_of(reg):
        bad.append((f"registration.{spec.transport}.{spec.identity}", "must be non-empty"))
    if reg.page_size == 0:
        bad.append(("registration.page_size", "must be > 0"))
    if not reg.kv_buffers:
        bad.append(("registration.kv_buffers", "at least one KV buffer is required"))
    if reg.notify_endpoint.port > 65535:
        bad.append(("registration.notify_endpoint.port", "must be <= 65535"))
    for name in ("attn_tp", "dcp", "pp"):
        group = getattr(reg, name)
        if group.size and group.rank >= group.size:
            bad.append((f"registration.{name}.rank", f"rank {group.rank} is outside size {group.size}"))
    for i, buf in enumerate(reg.kv_buffers):
        if buf.length and buf.item_len and buf.length < buf.item_len:
            bad.append((f"registration.kv_buffers[{i}].length", "smaller than one page (item_len)"))
    bad += unreachable(reg, origin)
    if bad:
        raise InvalidFieldError.of(bad)
    return reg


def check_transfer(request: hs.SubmitTransferRequest, peer: Peer) -> tuple[transfer_pb2.TransferInfo,
                                                                          npt.NDArray[np.int64]]:
    """The transfer info and its destination pages, aux index and state slots, checked against the
    memory the peer registered."""
    if not request.HasField("transfer"):
        raise InvalidFieldError.of([("transfer", "required")])
    t = request.transfer
    pages = np.asarray(t.dst_kv_pages, dtype=np.int64)
    bad: list[tuple[str, str]] = []
    if not t.is_dummy and pages.size == 0:
        bad.append(("transfer.dst_kv_pages", "a non-dummy request needs destination pages"))
    if pages.size and int(pages.min()) < 0:
        bad.append(("transfer.dst_kv_pages", "page indexes must be >= 0"))
    if bad:
        raise InvalidFieldError.of(bad)
    if pages.size:
        _check_bounds(peer, int(pages.max()))
    tp = peer.decision.tp
    if tp is not None:
        # Refused here, before anything moves; the executor bounds every write again.
        check_destination(tp.aux, tp.state, peer.registration, t)
    return t, pages


def _check_bounds(peer: Peer, max_page: int) -> None:
    """Every paired destination buffer must hold ``max_page`` (when its length is known)."""
    for pairing in peer.decision.pairings:
        buf = peer.registration.kv_buffers[pairing.dst_entry]
        if not buf.length or not buf.item_len:
            continue  # length 0 means unknown; the executor still bounds each write
        pages = buf.length // buf.item_len
        if max_page >= pages:
            raise DestinationOutOfBoundsError(
                f"destination page {max_page} is outside the {pages} pages registered for entry "
                f"{pairing.dst_entry}", reason=Reason.DESTINATION_OUT_OF_BOUNDS,
                metadata={"maxPage": max_page, "registeredPages": pages, "entry": pairing.dst_entry})
    if max_page > _MAX_PAGE:
        raise InvalidFieldError.of([("transfer.dst_kv_pages", "page index too large")])


__all__ = ["check_registration", "check_transfer"]
