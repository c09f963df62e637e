"""The decode rank every test, bench and the demo writes into: registered memory with known contents, byte checks.

As a process (``python -m pdproto_demo.decode --backend nixl --dcp-size 4 ...``, flags: the fields of
``DecodeConfig``; driven through ``DecodeProcess``) it prints ``{"ready": true, "pid": N, "registration":
HEX}`` (its ``KvRegistration``, serialized), then answers the JSON-line commands of ``main``
(``pdproto_demo.proc``); ``quit`` or end of input closes it. In process (``DecodeRank``) it serves tests that
drive their own client. Registering, submitting, folding the prefill ranks' statuses and aborting are the
library's decode peer (``pdproto.client.DecodePeer``); the commands: ``pdproto_demo/README.md``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdproto import PROTOCOL_MINOR, backends
from pdproto.client import DecodePeer, PrefillRank
from pdproto.errors import PdprotoError, Reason, error_for
from pdproto.negotiation.fanin import KindTotals
from pdproto.negotiation.registration import make_registration
from pdproto.negotiation.tpmap import PACKED_FAN_IN, SPLIT_KV
from pdproto.transfer import VRAM, Buffer, CredentialSlot, Notification, TransferExecutor, create_executor
from pdproto.transfer.notice import decode_chunk_notice
from pdproto.transfer.packing import unpack_buffers
from pdproto.v1 import common_pb2, registration_pb2, transfer_pb2

from . import data
from .model import HeadReference, RankConfig
from .proc import Child, Reply, redirect_stdout_to_stderr, serve_commands
from .synthetic import SyntheticSpec

# Control endpoints only name a rank (nothing listens on them); each rank of a process gets its own.
_notify_ports = itertools.count(20000 + (os.getpid() % 4000) * 10)


@dataclass(frozen=True)
class DecodeConfig(RankConfig):
    """Shape of one decode rank; each field is also a command-line flag of the process."""

    notify_port: int = 0
    """Control endpoint port; the prefill knows a restarted decode by it. 0: a fresh one."""
    device: str = "cpu"
    """``cpu`` or ``cuda:N`` (VRAM buffers: dump, fill and notices only)."""
    kv_dtype: str = "bfloat16"
    """KV dtype the rank registers."""
    model_id: str = ""
    """Model id the rank registers (empty: unchecked)."""
    layer_ids: bool = True
    """Register global layer ids (the prefill pairs entries by them)."""
    background: int = data.BACKGROUND
    """Byte every buffer starts with; rows nobody wrote must still hold it."""
    advertise_host: str = ""
    """Address the engine advertises to prefills (empty: ``PDPROTO_ADVERTISE_HOST``, else a routable one)."""
    packed_fan_in: bool = True
    """Ask for MHA heads packed per page (``PACKED_FAN_IN``), and put them back in row order once a request succeeded."""
    split_kv: bool = True
    """Let an MLA fan-in's prefill ranks write the KV entries in turn (``SPLIT_KV``); False: as a decode before it."""


@dataclass
class _Pending:
    """One submitted request and where its tokens must land."""

    placements: list[data.Placement]
    generation: int
    slot: int
    """The aux and state slot (hybrid); 0 when none."""
    index: list[int] = field(default_factory=list)
    """The request's DSA index pages (``ModelShape.index_pages``)."""
    pooled: bool = False
    """The slot came from the free list and goes back to it."""
    submitted: float = field(default_factory=time.monotonic)


class DecodeRank:
    """One decode rank: registered KV memory, its registration, clients, byte checks."""

    def __init__(self, config: DecodeConfig, reference: data.Reference | None = None) -> None:
        self.config = c = config
        self.name = c.name or f"decode-{os.getpid()}"
        self.notify_port = c.notify_port or next(_notify_ports)
        self.model = m = c.shape()
        self.reference = reference or HeadReference(m, c.tp_size, c.tp_rank)
        rows, row_bytes = c.pages * c.page_size, m.kv_row_bytes(c.tp_size)
        layout = m.decode_layout(tp=c.tp_size, rank=c.tp_rank, page_size=c.page_size)
        # A DSA index holds every token's page: a DCP rank's KV page stands for dcp of them.
        items = [m.entry_items(i, c.slots, c.pages * c.dcp_size) for i in range(len(layout.state))]
        extra_bytes = sum(a.item_len * c.slots for a in layout.aux) + sum(
            t.item_len * n for n, e in zip(items, layout.state, strict=True) for t in e.tensors)
        # The local backend names its arena itself (pid + uuid), so a restart never collides.
        self.executor: TransferExecutor = create_executor(
            c.backend, name=None if c.backend == "local" else self.name, host=c.advertise_host or None,
            arena_bytes=len(layout.kv) * rows * row_bytes + extra_bytes + (2 << 20))
        vram = c.device.startswith("cuda")
        device = int(c.device.partition(":")[2] or 0) if vram else 0
        self.buffers: list[Buffer] = [
            self.executor.allocate(rows * row_bytes, kind=VRAM, device=device) if vram
            else self.executor.allocate(rows * row_bytes) for _ in layout.kv]
        self.aux = [self.executor.allocate(a.item_len * c.slots) for a in layout.aux]
        self.state = [[self.executor.allocate(t.item_len * n) for t in e.tensors]
                      for n, e in zip(items, layout.state, strict=True)]
        self.extras = [*self.aux, *(b for e in self.state for b in e)]
        """Every aux buffer, then every state tensor's (``ModelShape.extra_items``'s order)."""
        self.extra_item_bytes = [a.item_len for a in layout.aux] + [t.item_len for e in layout.state for t in e.tensors]
        """Bytes of one item of each of ``extras``."""
        self.executor.register_memory([*self.buffers, *self.extras])
        self.credential = CredentialSlot(self.executor, self.buffers[0])
        """Where each prefill writes its part of this rank's peer credential (``connect`` binds it)."""
        self.pool = [] if vram else [np.asarray(b.array).reshape(rows, row_bytes) for b in self.buffers]
        """Host views of the buffers, one (rows x row_bytes) array per layer; empty for VRAM."""
        self._free_slots = list(range(c.slots - 1, 0, -1))
        self.fill(c.background)
        self.shard = data.Shard(c.dcp_size, c.dcp_rank)
        self.peer: DecodePeer | None = None
        """Registered with the prefill ranks of the last ``connect``."""
        self.addresses: list[str] = []
        """host:port of those prefill ranks, in ``connect``'s order."""
        self.pending: dict[int, _Pending] = {}
        self._notices: list[Notification] = []

    @classmethod
    def for_spec(cls, spec: SyntheticSpec, *, pages: int, dcp_size: int = 1, dcp_rank: int = 0,
                 backend: str = "local", kv_dtype: str | None = None, name: str = "") -> DecodeRank:
        """A rank shaped for the synthetic prefill of ``pdproto serve`` and checked against it."""
        return cls(DecodeConfig(name=name, backend=backend, layers=spec.layers, pages=pages, page_size=spec.page_size,
                                row_bytes=spec.row_bytes, dcp_size=dcp_size, dcp_rank=dcp_rank,
                                kv_dtype=kv_dtype or spec.kv_cache_dtype, model_id=spec.model_id,
                                layer_ids=False), reference=spec)

    # -- what tests driving their own client use ---------------------------------------

    def registration(self, minor: int = PROTOCOL_MINOR, bound: bool = False) -> registration_pb2.KvRegistration:
        """This rank's ``KvRegistration`` (call again after a restart of the engine: endpoints change);
        ``bound``: with its ``credential_buffer`` (then Register needs ``self.credential.read``)."""
        c = self.config
        layout = self.model.decode_layout(
            tp=c.tp_size, rank=c.tp_rank, page_size=c.page_size, dcp_size=c.dcp_size, dcp_rank=c.dcp_rank,
            layer_ids=c.layer_ids, kv_cache_dtype=c.kv_dtype, model_id=c.model_id,
            notify_host="127.0.0.1", notify_port=self.notify_port,
            capabilities=("dcp-relayout", "packed", *((PACKED_FAN_IN,) if c.packed_fan_in else ()),
                          *((SPLIT_KV,) if c.split_kv else ())),
            gpu_id=self.buffers[0].device, minor=minor)
        reg = make_registration(layout, self.executor.endpoint(), self.buffers, aux=self.aux, state=self.state)
        if bound:
            reg.credential_buffer.CopyFrom(self.credential.proto())
        return reg

    def pages_for(self, tokens: int, first_page: int = 0) -> list[int]:
        """Destination pages this rank needs for ``tokens`` global tokens (reversed, to be non-trivial)."""
        local = -(-tokens // self.config.dcp_size)
        n = -(-local // self.config.page_size)
        return list(range(first_page + n - 1, first_page - 1, -1))

    def transfer_info(self, room: int, pages: Sequence[int], generation: int = 0, prefix: int = 0,
                      required: int = 1, slot: int | None = None, dummy: bool = False,
                      index: Sequence[int] = ()) -> transfer_pb2.TransferInfo:
        """The ``TransferInfo`` of one request; ``required`` decode ranks submit it to each prefill rank.

        ``slot`` names the aux slot and every state entry's slot (hybrid models), ``index`` a DSA
        model's index pages.
        """
        info = transfer_pb2.TransferInfo(
            room=room, generation=generation, peer_name=self.name, dst_kv_pages=pages,
            required_dst_info_num=required, decode_prefix_len=prefix, is_dummy=dummy,
            notify_endpoint=common_pb2.Endpoint(host="127.0.0.1", port=self.notify_port))
        if slot is not None and self.aux:
            info.dst_aux_index = slot
        if slot is not None:
            info.dst_state_indices.extend(
                transfer_pb2.StateIndices(indices=self.model.state_pages(i, slot, "decode", index))
                for i in range(len(self.state)))
        return info

    def verify_extras(self, rooms: Mapping[int, tuple[int, Sequence[int]]]) -> tuple[int, str | None]:
        """Check every aux and state byte: each room's items hold the model's bytes, the rest background.

        ``rooms`` maps room -> (slot, DSA index pages); returns (bytes checked, first problem or None).
        """
        c = self.config
        placed = [self.model.extra_writes(room, slot, index, "decode", c.tp_size, c.tp_rank)
                  for room, (slot, index) in rooms.items()]
        checked = 0
        for n, buf in enumerate(self.extras):
            arr = np.asarray(buf.array)
            expected = np.full(arr.shape, c.background, dtype=np.uint8)
            for writes in placed:
                for item, block in writes[n]:
                    expected[item * block.size:(item + 1) * block.size] = block
            checked += arr.nbytes
            if not np.array_equal(arr, expected):
                at = int(np.argwhere(arr != expected)[0][0])
                name, i = ("aux", n) if n < len(self.aux) else ("state", n - len(self.aux))
                return checked, f"{name} buffer {i}: byte {at} is {arr[at]}, expected {expected[at]}"
        return checked, None

    def verify(self, rooms: Mapping[int, Sequence[int]], tokens: int) -> int:
        """Assert every pool byte: ``tokens`` tokens of each room on its pages, background elsewhere."""
        placements = [data.Placement(room, 0, tokens, pages) for room, pages in rooms.items()]
        checked, bad = self._check(placements)
        assert bad is None, f"first differing byte: {bad}"
        return checked

    def _check(self, placements: Sequence[data.Placement]) -> tuple[int, data.Mismatch | None]:
        if not self.pool:
            raise PdprotoError("byte checks read host memory; this rank's buffers are in VRAM",
                               reason=Reason.INVALID_FIELD)
        return data.verify(self.pool, self.shard, placements, page_size=self.config.page_size,
                           reference=self.reference, background=self.config.background)

    # -- commands of the process --------------------------------------------------------

    def connect(self, targets: list[str], token: str | None = None, minor: int = PROTOCOL_MINOR,
                timeout: float = 20.0, unknown_field: bool = False, root_cert: str | None = None) -> Reply:
        """Register with every prefill rank in ``targets`` (host:port); optionally as a newer build.

        The ranks of an earlier ``connect`` are let go as after a crash (no Deregister): a
        registration from the same identity then replaces them on the prefill.
        """
        if self.peer is not None:
            self.peer.close(deregister=False)
        reg = self.registration(minor, bound=True)
        if unknown_field:
            reg.MergeFromString(data.FUTURE_FIELD)
        self.peer = DecodePeer(reg, token=token, root_cert=root_cert, timeout=min(timeout, 5.0),
                               server_name="localhost" if root_cert else None, read_credential=self.credential.read)
        self.addresses = list(targets)
        ranks = [self.peer.connect(address, timeout=timeout) for address in targets]
        return {"peers": [r.peer_id for r in ranks], "modes": [int(r.result.mode) for r in ranks],
                "dummies": [r.dummy for r in ranks], "required": [r.senders.required_responses for r in ranks]}

    def _connected(self) -> DecodePeer:
        if self.peer is None:
            raise error_for(Reason.PEER_NOT_FOUND, "this decode rank is registered with no prefill rank: "
                            "send connect first")
        return self.peer

    def request(self, room: int, prefix: int, total: int, prefix_pages: list[int],
                dst_pages: list[int], generation: int = 0, timeout: float = 20.0,
                slot: int | None = None, aux_slot: int | None = None) -> Reply:
        """Lay down the decode prefix and hand every prefill rank this request's destination.

        A hybrid model's aux and state go to a free slot, or to ``slot`` (state) and
        ``aux_slot`` (aux, default: ``slot``), which may even lie outside the registered
        buffers: a prefill must refuse them and write nothing.
        """
        cached = data.Placement(room, 0, prefix, prefix_pages)
        if not self.pool:
            raise PdprotoError("requests need host memory; this rank's buffers are in VRAM",
                               reason=Reason.INVALID_FIELD)
        pooled = slot is None and bool(self.aux or self.state)
        if pooled:
            slot = self._free_slots.pop()
        data.fill(self.pool, self.shard, cached, page_size=self.config.page_size, reference=self.reference)
        index = self.model.index_pages(dst_pages, total - prefix, self.config.dcp_size)
        self.pending[room] = _Pending([cached, data.Placement(room, prefix, total, dst_pages)], generation,
                                      slot or 0, index, pooled)

        def info(_: PrefillRank) -> transfer_pb2.TransferInfo:
            out = self.transfer_info(room, dst_pages, generation, prefix, slot=slot, index=index)
            if aux_slot is not None and self.aux:
                out.dst_aux_index = aux_slot
            return out

        peer = self._connected()
        try:
            peer.submit(room, self.addresses, info, generation=generation, timeout=timeout)
            statuses = peer.submitted(room, timeout)
        except PdprotoError:
            peer.forget(room)
            self._release(self.pending.pop(room))
            raise
        return {"states": [int(st.state) for st in statuses], "slot": slot}

    def untouched(self) -> Reply:
        """Check that no request wrote anything: every KV, aux and state byte still holds the background."""
        checked, bad = self._check([])
        extra_checked, extra_bad = self.verify_extras({})
        return {"ok": bad is None and extra_bad is None, "checked": checked + extra_checked,
                "problem": extra_bad or (bad.__dict__ if bad is not None else None)}

    def _release(self, p: _Pending) -> None:
        """Put a request's KV pages, aux slot and state slots back to the background, and the slot back."""
        c = self.config
        data.reset(self.pool, [pg for at in p.placements for pg in at.pages], page_size=c.page_size,
                   background=c.background)
        if p.slot and p.slot < c.slots:
            items = self.model.extra_items(p.slot, p.index, "decode")
            for buf, held, n in zip(self.extras, items, self.extra_item_bytes, strict=True):
                for item in held:
                    buf.array[item * n:(item + 1) * n] = c.background
        if p.pooled:
            self._free_slots.append(p.slot)

    def wait(self, room: int, timeout: float = 120.0, check: bool = True) -> Reply:
        """Wait for the outcome of ``room`` over its prefill ranks, then check every byte.

        The first failure fails the request with that rank's reason, and the ranks that did
        not succeed are aborted (an abort answers once their in-flight chunks drained, so the
        pages and slots are safe to reuse).
        """
        p = self.pending.pop(room)
        peer = self._connected()
        deadline = time.monotonic() + timeout
        where = {r.index: r.address for r in peer.ranks}
        outcome = peer.wait(room, timeout)
        finals = peer.statuses(room)
        failures: list[str] = []
        if outcome.state == common_pb2.TRANSFER_STATE_FAILED:
            failed = "decode" if outcome.failed_rank is None else where.get(outcome.failed_rank, "decode")
            failures.append(f"{failed}: {outcome.failure_code}: {outcome.failure_reason}")
            # A prefill unreachable for the whole wait gets one short abort try, not another full deadline.
            abort_s = 5.0 if outcome.failure_code == Reason.UNAVAILABLE.name else 30.0
            ranks = {r.address: r for r in peer.ranks}
            unfinished = [a for a in self.addresses if a not in ranks
                          or not ranks[a].dummy and ranks[a].index not in outcome.reported]
            for address, acked in zip(unfinished, peer.abort(room, p.generation, unfinished, timeout=abort_s),
                                      strict=True):
                try:
                    acked.result(2 * abort_s)
                except (PdprotoError, concurrent.futures.TimeoutError) as exc:
                    reason = exc.reason.name if isinstance(exc, PdprotoError) else Reason.DEADLINE_EXCEEDED.name
                    failures.append(f"{address}: abort after failure: {reason}")
        packed = peer.fan_in(room)
        if packed is not None and not failures:
            unpack_buffers(self.buffers, packed.row_bytes, packed.pages, packed.page_size, packed.slices)
        peer.forget(room)
        totals = KindTotals.of(finals)
        chunks = sum(st.chunks_done for st in finals)
        done_at = time.monotonic()
        if not failures and backends.by_name(self.config.backend).notifications:
            # Every chunk must be announced through the engine, including chunks where this
            # rank owns no rows (e.g. the 1-token tail of a 65-token prompt on DCP 4).
            got = self._await_notices(room, p.generation, chunks, deadline)
            if got != chunks:
                failures.append(f"expected {chunks} chunk notices through {self.config.backend}, got {got}")
        checked, bad = self._check(p.placements) if check and not failures else (0, None)
        extra_checked, extra_bad = self.verify_extras({room: (p.slot, p.index)}) if check and not failures and p.slot \
            else (0, None)
        if extra_bad is not None:
            failures.append(extra_bad)
        self._release(p)
        return {"room": room, "ok": not failures and bad is None, "failures": failures,
                "mismatch": None if bad is None else bad.__dict__, "checked": checked + extra_checked,
                "bytes": totals.kv_bytes, "descriptors": totals.kv_descriptors,
                "aux_bytes": totals.aux_bytes, "state_bytes": totals.state_bytes,
                "aux_descriptors": totals.aux_descriptors, "state_descriptors": totals.state_descriptors,
                "failure_code": outcome.failure_code,
                "seconds": done_at - p.submitted, "done_at": done_at}

    def _await_notices(self, room: int, generation: int, expected: int, deadline: float) -> int:
        """Count chunk notices of this generation of ``room`` until ``expected`` arrived or time ran out.

        Notices trail the data, and an aborted generation's chunks may still announce
        themselves after the room was reused, so they are counted per generation.
        """
        stop = min(deadline, time.monotonic() + 5.0)
        while True:
            self._notices += self.executor.notifications()
            parsed = [(n, decode_chunk_notice(n)) for n in self._notices]
            got = sum(1 for _, c in parsed if c is not None and (c.room, c.generation) == (room, generation))
            if got >= expected or time.monotonic() >= stop:
                self._notices = [n for n, c in parsed
                                 if c is None or c.room != room or c.generation > generation]
                return got
            time.sleep(0.005)

    def abort(self, room: int, generation: int = 0, timeout: float = 20.0) -> Reply:
        """Abort a request generation on every prefill rank; returns once each acknowledged."""
        acks = [f.result(2 * timeout) for f in self._connected().abort(room, generation, self.addresses,
                                                                        timeout=timeout)]
        return {"acks": [[room, generation] if a is None else [a.room, a.generation] for a in acks]}

    def dump(self, path: str) -> Reply:
        """Write every KV buffer, back to back, to ``path``."""
        with open(path, "wb") as f:
            for b in self.buffers:
                host = b.array.cpu().numpy() if b.kind == VRAM else b.array
                f.write(memoryview(host).cast("B"))
        return {"bytes": sum(b.length for b in self.buffers)}

    def fill(self, value: int) -> Reply:
        """Set every byte of every KV, aux and state buffer to ``value``."""
        for b in [*self.buffers, *self.extras]:
            b.array[:] = value
        return {}

    def notices(self, wait: float = 0.0) -> Reply:
        """Rooms of the notifications received since the last call, waiting up to ``wait`` s for the first."""
        deadline = time.monotonic() + wait
        while True:
            self._notices += self.executor.notifications()
            if self._notices or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        rooms, self._notices = [n.room for n in self._notices], []
        return {"rooms": rooms}

    def close(self) -> None:
        """Close clients (as a crash would: no Deregister) and the executor."""
        if self.peer is not None:
            self.peer.close(deregister=False)
        self.executor.close()


class DecodeProcess(Child):
    """A decode rank in its own process (``python -m pdproto_demo.decode``), seen from its parent."""

    registration: registration_pb2.KvRegistration
    """The rank's registration, as its ready line reported it (set by ``await_ready``)."""

    @classmethod
    def spawn_rank(cls, config: DecodeConfig, *, label: str = "decode", env: dict[str, str] | None = None,
                   log_dir: str | None = None) -> DecodeProcess:
        """Start a decode rank process without waiting for it (``await_ready`` next)."""
        return cls.spawn(label, "pdproto_demo.decode", config.argv(), env=env, log_dir=log_dir)

    @classmethod
    def launch(cls, config: DecodeConfig, *, label: str = "decode", timeout: float = 120.0,
               env: dict[str, str] | None = None, log_dir: str | None = None) -> DecodeProcess:
        """Start a decode rank process and wait until it is ready."""
        child = cls.spawn_rank(config, label=label, env=env, log_dir=log_dir)
        try:
            child.await_ready(timeout)
        except BaseException:
            child.close(timeout=5)
            raise
        return child

    def await_ready(self, timeout: float) -> Reply:
        """Read the ready line (its registration included)."""
        ready = self.recv(timeout)
        self.registration = registration_pb2.KvRegistration.FromString(bytes.fromhex(ready["registration"]))
        return ready


def main(argv: list[str] | None = None) -> int:
    """Entry point of the decode rank process."""
    config = DecodeConfig.parse(argv)
    out = redirect_stdout_to_stderr()
    rank = DecodeRank(config)
    try:
        commands: dict[str, Any] = {
            "connect": rank.connect, "request": rank.request, "wait": rank.wait, "abort": rank.abort,
            "dump": rank.dump, "fill": rank.fill, "notices": rank.notices, "untouched": rank.untouched}
        serve_commands(commands, out, {"registration": rank.registration().SerializeToString().hex()})
    finally:
        rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
