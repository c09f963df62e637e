"""Page-aligned host and device allocations used as KV, staging and test buffers."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

from pdproto.errors import EngineUnavailableError
from pdproto.v1 import registration_pb2

from .base import DRAM, VRAM, Buffer, MemoryKind, TransferExecutor


def aligned_dram(nbytes: int) -> npt.NDArray[np.uint8]:
    """A zeroed, page-aligned uint8 array (anonymous mmap, so pages are touched only when used)."""
    # mmap of length 0 is invalid; a one-page map keeps zero-size buffers addressable.
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)


def array_addr(array: Any) -> int:
    """The address of a numpy array's or torch tensor's first byte."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data_ptr())


def host_view(addr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """A uint8 numpy view of ``nbytes`` of host memory at ``addr`` (the caller keeps it alive)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def torch_module() -> Any:
    """Import torch or raise ``EngineUnavailableError`` naming the package."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is part of the engines extra
        raise EngineUnavailableError("torch is required for VRAM buffers and GPU packing: "
                                     "pip install 'pdproto[engines]' (torch)",
                                     metadata={"package": "torch"}) from exc
    return torch


def allocate(nbytes: int, *, kind: MemoryKind = DRAM, device: int = 0) -> Buffer:
    """Allocate a zeroed buffer whose advertised pointer is its real address."""
    if kind == VRAM:
        torch = torch_module()
        tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=f"cuda:{device}")
        addr = int(tensor.data_ptr())
        return Buffer(addr=addr, length=nbytes, ptr=addr, kind=VRAM, device=device, array=tensor)
    array = aligned_dram(nbytes)
    addr = array_addr(array)
    return Buffer(addr=addr, length=nbytes, ptr=addr, kind=DRAM, device=0, array=array)


class _DeviceRegion:
    """A CUDA byte range described by ``__cuda_array_interface__``, so torch can view it without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def at_address(addr: int, nbytes: int, *, kind: MemoryKind = DRAM, device: int = 0) -> Buffer:
    """A ``Buffer`` over memory some other component owns and knows only by address (an engine's
    KV pool given as pointers): a numpy view for DRAM, a torch view for VRAM; the owner keeps it alive."""
    if kind == VRAM:
        torch = torch_module()
        view = torch.as_tensor(_DeviceRegion(addr, nbytes), device=f"cuda:{device}")
        return Buffer(addr=addr, length=nbytes, ptr=addr, kind=VRAM, device=device, array=view)
    return Buffer(addr=addr, length=nbytes, ptr=addr, kind=DRAM, device=0, array=host_view(addr, nbytes))


class CredentialSlot:
    """Engine-registered memory a prefill writes part of this decode's peer credential into.

    Set ``KvRegistration.credential_buffer`` to ``proto()`` and hand ``read`` to Register
    (``read_credential``); create it before the engine's endpoint (NIXL's metadata lists the
    registered memory). It lives where ``kv`` (one of the KV buffers) does: a prefill refuses a
    credential buffer of another memory kind. One slot per client that registers: a read follows
    each Register.
    """

    def __init__(self, executor: TransferExecutor, kv: Buffer, *, nbytes: int = 64) -> None:
        self.buffer: Buffer = executor.allocate(nbytes, kind=kv.kind, device=kv.device)
        executor.register_memory([self.buffer])

    def proto(self) -> registration_pb2.CredentialBuffer:
        """The ``credential_buffer`` of the registration."""
        b = self.buffer
        return registration_pb2.CredentialBuffer(ptr=b.ptr, length=b.length, memory_kind=b.kind)

    def read(self, n: int) -> bytes:
        """The first ``n`` bytes (what the prefill wrote during the last Register)."""
        head = self.buffer.array[:n]
        return bytes(head if isinstance(head, np.ndarray) else head.cpu().numpy())


__all__ = ["CredentialSlot", "aligned_dram", "allocate", "array_addr", "at_address", "host_view", "torch_module"]
