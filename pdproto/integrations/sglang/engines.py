"""The transfer engine of one SGLang scheduler rank: SGLang's own Mooncake engine when it runs one, else ours.

SGLang keeps one Mooncake ``TransferEngine`` per process
(``distributed/device_communicators/mooncake_transfer_engine.py``), started by
``init_parallel_runtime`` when something in the process needs it (HiCache's Mooncake
store, elastic EP, encoder disaggregation). A second engine would register the same GPU
memory twice and open a second set of NIC queues, so the pdproto executor adopts that one
(``MooncakeExecutor(engine=...)``) whenever it exists. SGLang has no shared NIXL agent,
so a NIXL executor is always pdproto's own.

The pools are registered as SGLang describes them, by address (``pdproto.transfer.at_address``).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from pdproto.negotiation.registration import Region
from pdproto.transfer import Buffer, TransferExecutor, at_address, create_executor

from . import layout
from .settings import BackendSettings

log = logging.getLogger(__name__)


_SHARED_MOONCAKE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"


def sglang_shared_mooncake() -> Any:
    """SGLang's shared Mooncake engine wrapper of this process, or None when it started none."""
    # SGLang imports its engine module before it starts that engine, so a process where the
    # module was never imported has none; importing SGLang here would start nothing either.
    module = sys.modules.get(_SHARED_MOONCAKE)
    getter = getattr(module, "get_mooncake_transfer_engine", None)
    return None if getter is None else getter()


def make_executor(settings: BackendSettings, *, host: str, device: str, gpu_id: int,
                  ib_device: str = "") -> TransferExecutor:
    """The rank's executor: ``settings.engine``, on ``host``, staging on ``device`` ("cpu" or "cuda").

    A Mooncake engine of our own takes SGLang's transport setting (``MOONCAKE_PROTOCOL``;
    unset: RDMA when the host has an RDMA device, else TCP) and ``--disaggregation-ib-device``.
    """
    staging = settings.staging_mb << 20
    where = f"cuda:{gpu_id}" if device == "cuda" else "cpu"
    if settings.engine == "mooncake":
        shared = sglang_shared_mooncake()
        if shared is not None:
            from pdproto.transfer.engines.mooncake import MooncakeExecutor

            log.info("pdproto: adopting SGLang's shared Mooncake engine %s", shared.get_session_id())
            return MooncakeExecutor(engine=shared.engine, session_id=shared.get_session_id(),
                                    staging_bytes=staging, device=where)
    return create_executor(settings.engine, host=host, protocol=os.environ.get("MOONCAKE_PROTOCOL", "auto"),
                           device_name=ib_device, staging_bytes=staging, device=where)


def register(executor: TransferExecutor, regions: list[Region], *, gpu_id: int) -> list[Buffer]:
    """Register memory SGLang owns with ``executor``; returns the buffers, in ``regions`` order."""
    buffers = [at_address(r.ptr, r.length, kind=r.kind, device=gpu_id) for r in regions]
    executor.register_memory(buffers)
    return buffers


@dataclass(frozen=True)
class RankMemory:
    """A rank's executor and SGLang's pools registered with it, in ``KVArgs`` order."""

    executor: TransferExecutor
    kv: tuple[Buffer, ...]
    """One per KV entry."""
    aux: tuple[Buffer, ...]
    """One per aux buffer."""
    state: tuple[tuple[Buffer, ...], ...]
    """Per state component, one per tensor."""


def open_rank(kv_args: Any, settings: BackendSettings, *, host: str, device: str) -> RankMemory:
    """The rank's executor with every pool of ``kv_args`` registered; the executor is closed on failure."""
    gpu_id = int(getattr(kv_args, "gpu_id", 0) or 0)
    executor = make_executor(settings, host=host, device=device, gpu_id=gpu_id,
                             ib_device=str(getattr(kv_args, "ib_device", None) or ""))
    try:
        regions = layout.regions(kv_args, on_device=device == "cuda")
        return RankMemory(executor, tuple(register(executor, list(regions.kv), gpu_id=gpu_id)),
                          tuple(register(executor, list(regions.aux), gpu_id=gpu_id)),
                          tuple(tuple(register(executor, list(entry), gpu_id=gpu_id)) for entry in regions.state))
    except BaseException:
        executor.close()
        raise


__all__ = ["RankMemory", "make_executor", "open_rank", "register", "sglang_shared_mooncake"]
