"""Large state requests: the slot checks read items once per entry, not once per tensor and item.

``check_destination`` runs on the server's event loop at submit time, and a sliding-window
entry may name 16,384 pages for dozens of tensors. Each check is compared with the item by
item walk it replaced (``reference_*`` below), so the errors stay the same, and the per-item
helpers are counted, so the walk cannot come back unnoticed. No test here measures time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdproto.negotiation.slots as slots
from pdproto.errors import DestinationOutOfBoundsError, InvalidFieldError, PdprotoError, Reason
from pdproto.negotiation.extras import AuxPairing, StatePairing, StateTensorPairing
from pdproto.negotiation.shards import Segment
from pdproto.negotiation.slots import check_destination, state_copies
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2
from pdproto_server import transfers

REC, SW = common_pb2.STATE_KIND_RECURRENT, common_pb2.STATE_KIND_SLIDING_WINDOW
PAGES, TENSORS = 1 << 14, 48  # pdproto_server/validate.py Bounds.ENTRIES pages; a large hybrid model's tensors
Outcome = tuple[type, Reason, str, dict[str, str]] | None


def reference_index(value: int, field: str) -> int:
    if value < 0:
        raise InvalidFieldError(field, f"{field} must be >= 0, got {value}", metadata={"index": value})
    return value


def reference_check_dst(length: int, item: int, item_len: int, *, field: str, entry: int) -> None:
    if length and (item + 1) * item_len > length:
        raise DestinationOutOfBoundsError(
            f"state entry {entry}: item {item} reaches byte {(item + 1) * item_len} of the"
            f" {length}-byte region the decode registered for it",
            metadata={"kind": "state", "field": field, "entry": entry, "index": item,
                      "end": (item + 1) * item_len, "registered": length})


def reference_state_check(state: Sequence[StatePairing], registration: registration_pb2.KvRegistration,
                          transfer: transfer_pb2.TransferInfo) -> None:
    """The item by item walk check_destination made over every tensor it writes, once each entry is named."""
    for sp in state:
        field = f"transfer.dst_state_indices[{sp.dst_entry}]"
        lens = registration.state_buffers[sp.dst_entry].data_lens
        for t in (t for t in sp.tensors if t.segments):
            for item in transfer.dst_state_indices[sp.dst_entry].indices:
                reference_check_dst(lens[t.dst_tensor] if lens else 0, reference_index(item, field),
                                    t.dst_item_len, field=field, entry=sp.dst_entry)


def reference_pairs(src: Sequence[int], dst: Sequence[int], field: str) -> tuple[tuple[int, int], ...]:
    """state_copies' pairs as they were built: each index checked in turn."""
    return tuple((reference_index(s, "state_slots"), reference_index(d, field)) for s, d in zip(src, dst))


def outcome(call: Callable[[], object]) -> Outcome:
    try:
        call()
    except PdprotoError as err:
        return type(err), err.reason, err.message, err.metadata
    return None


def entry(kind: int, tensors: Sequence[tuple[int, bool]], dst_entry: int = 0) -> StatePairing:
    """A pairing whose tensor i has dst item length tensors[i][0] and is written when tensors[i][1]."""
    return StatePairing(dst_entry, dst_entry, kind, tuple(
        StateTensorPairing(i, i, n, n, (Segment(0, 0, n),) if writes else ())
        for i, (n, writes) in enumerate(tensors)))


def registration(data_lens: Sequence[Sequence[int]]) -> registration_pb2.KvRegistration:
    reg = registration_pb2.KvRegistration()
    for lens in data_lens:
        reg.state_buffers.add(data_ptrs=[0x1000 * (i + 1) for i in range(len(lens))], data_lens=lens)
    return reg


def transfer(indices: Sequence[Sequence[int]]) -> transfer_pb2.TransferInfo:
    info = transfer_pb2.TransferInfo(room=1)
    for items in indices:
        info.dst_state_indices.add(indices=items)
    return info


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[StatePairing], registration_pb2.KvRegistration,
                                       transfer_pb2.TransferInfo]:
    """Entries of either kind, tensors with and without a known length, items near the bounds."""
    pairings, lens, indices = [], [], []
    for e in range(draw(st.integers(1, 3))):
        tensors = draw(st.lists(st.tuples(st.integers(0, 24), st.booleans()), min_size=1, max_size=4))
        kind = draw(st.sampled_from([REC, SW]))
        pairings.append(entry(kind, tensors, e))
        lens.append([draw(st.integers(0, 400)) for _ in tensors] if draw(st.booleans()) else [])
        # A recurrent entry names one slot (other counts are refused before any item is read).
        indices.append(draw(st.lists(st.integers(-3, 40), min_size=int(kind == REC),
                                     max_size=1 if kind == REC else 12)))
    return pairings, registration(lens), transfer(indices)


@settings(max_examples=400)
@given(requests())
def test_the_check_refuses_what_the_item_by_item_walk_refused(request: tuple) -> None:  # type: ignore[type-arg]
    pairings, reg, info = request
    assert outcome(lambda: check_destination((), pairings, reg, info)) == \
        outcome(lambda: reference_state_check(pairings, reg, info))


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(-2, 30), st.integers(-2, 30)), max_size=12))
def test_state_copies_pair_and_refuse_as_the_walk_did(pairs: list[tuple[int, int]]) -> None:
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    field = "transfer.dst_state_indices[0]"
    pairing = entry(SW, [(8, True)])
    expected = outcome(lambda: reference_pairs(src, dst, field))
    assert outcome(lambda: state_copies([pairing], src_slots=[src], dst_slots=[dst])) == expected
    if expected is None:
        repeated = transfer([dst]).dst_state_indices[0].indices  # as slot_copies passes them
        (copy,) = state_copies([pairing], src_slots=[src], dst_slots=[repeated])
        assert copy.items == reference_pairs(src, dst, field)


def large(item_lens: Sequence[int], data_lens: Sequence[int], items: Sequence[int]) -> Outcome:
    """check_destination on one sliding-window entry, after checking it agrees with the walk."""
    pairings = [entry(SW, [(n, True) for n in item_lens])]
    reg, info = registration([data_lens]), transfer([items])
    got = outcome(lambda: check_destination((), pairings, reg, info))
    assert got == outcome(lambda: reference_state_check(pairings, reg, info))
    return got


def test_large_requests_are_bounded_by_their_largest_and_smallest_item() -> None:
    item_lens = [64 + 16 * (t % 3) for t in range(TENSORS)]  # three item sizes, regions of PAGES items
    data_lens = [n * PAGES for n in item_lens]
    items = list(range(PAGES))
    assert large(item_lens, data_lens, items) is None
    # The last tensor's region is one page short: only the final item reaches past it.
    err = large(item_lens, [*data_lens[:-1], item_lens[-1] * (PAGES - 1)], items)
    assert err is not None and err[:2] == (DestinationOutOfBoundsError, Reason.DESTINATION_OUT_OF_BOUNDS)
    assert err[3]["index"] == str(PAGES - 1) and err[3]["field"] == "transfer.dst_state_indices[0]"
    # Of a negative item and one past every region, the earlier in the list is refused.
    late_negative = [*items[:9000], PAGES, *items[9001:-1], -5]
    err = large(item_lens, data_lens, late_negative)
    assert err is not None and err[1] is Reason.DESTINATION_OUT_OF_BOUNDS and err[3]["index"] == str(PAGES)
    early_negative = [*items[:100], -5, *items[101:9000], PAGES, *items[9001:]]
    err = large(item_lens, data_lens, early_negative)
    assert err is not None and err[:2] == (InvalidFieldError, Reason.INVALID_FIELD) and err[3]["index"] == "-5"
    # Unknown lengths bound nothing, but negatives are still refused.
    assert large(item_lens, [], [*items[:-1], 10 ** 9]) is None
    assert large(item_lens, [], [*items[:-1], -1]) is not None


def test_a_large_request_calls_no_per_item_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"index": 0, "check_dst": 0}

    def counted(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(slots, "_index", counted("index", slots._index))
    monkeypatch.setattr(slots, "_check_dst", counted("check_dst", slots._check_dst))
    pairing = entry(SW, [(64, True)] * TENSORS)
    items = list(range(PAGES))
    check_destination((), [pairing], registration([[64 * PAGES] * TENSORS]), transfer([items]))
    state_copies([pairing], src_slots=[items], dst_slots=[items])
    assert calls == {"index": 0, "check_dst": 0}  # the walk made PAGES x TENSORS of each


def test_slot_segments_convert_each_entry_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from_rows = transfers.run_arith.from_rows
    calls = []

    def counted(src: np.ndarray, dst: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
        calls.append(len(src))
        return from_rows(src, dst)

    monkeypatch.setattr(transfers.run_arith, "from_rows", counted)
    src, dst = list(range(PAGES)), [*range(10, 10 + PAGES // 2), *range(PAGES, PAGES + PAGES // 2)]
    copies = state_copies([entry(SW, [(64, True)] * TENSORS)], src_slots=[src], dst_slots=[dst])
    source = SimpleNamespace(state=[[SimpleNamespace(addr=0x9000 * (t + 1)) for t in range(TENSORS)]])
    peer = SimpleNamespace(registration=registration([[0] * TENSORS]))
    segments = transfers.slot_segments(source, peer, copies)  # type: ignore[arg-type]
    assert calls == [PAGES]  # one entry, however many tensors it holds
    expected = from_rows(np.array(src), np.array(dst))
    (segment,) = segments  # the entry's tensors share its items: one row set, a layer per tensor
    assert np.array_equal(segment.runs, expected)
    assert [layer.dst_ptr for layer in segment.layers] == [0x1000 * (t + 1) for t in range(TENSORS)]


def test_slot_segments_move_every_aux_buffer_as_one_row_set() -> None:
    """The aux buffers share the request's one slot: one segment, a layer per buffer, each to its own region."""
    lens = (8, 4096, 64)
    copies = slots.aux_copies([AuxPairing(i, i, n) for i, n in enumerate(lens)], src_slot=3, dst_slot=5)
    source = SimpleNamespace(aux=[SimpleNamespace(addr=0x9000 * (i + 1)) for i in range(len(lens))])
    reg = registration_pb2.KvRegistration(aux_ptrs=[0x1000 * (i + 1) for i in range(len(lens))])
    segments = transfers.slot_segments(source, SimpleNamespace(registration=reg), copies)  # type: ignore[arg-type]
    (segment,) = segments
    assert segment.runs.tolist() == [[3, 1, 5, 1, 1]]
    assert [(la.src_ptr, la.dst_ptr, la.nbytes) for la in segment.layers] == [
        (0x9000 * (i + 1), 0x1000 * (i + 1), n) for i, n in enumerate(lens)]
