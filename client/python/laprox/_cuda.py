"""PyTorch tensors: CUDA tensors by CUDA IPC (no copy), CPU tensors through numpy.

A CUDA tensor is sent as a reference into a cuda_ipc region. The region is the tensor's whole
storage, described the way torch's own inter-process sharing describes it:
`storage._share_cuda_()` returns the cudaIpcMemHandle of the caching allocator's base
allocation, the storage's size and its byte offset inside that allocation; the tensor's byte
offset inside the storage is `tensor.storage_offset() * element_size`, its strides are
`tensor.stride()`, and the device is named by `torch.cuda.get_device_properties(i).uuid`.

Each storage is registered once and cached (keyed by device and data pointer; the cache holds
a reference to the storage so its memory stays valid while the server has it mapped).
Client.release_cuda_regions() and Client.close() unregister them and tell torch the server is
done (torch's IPC reference counter, which `_share_cuda_` arms, is released). Before a call
with CUDA inputs the current stream of each device involved is synchronised: the server reads
the memory from its own context after the call starts.

Limits: memory from PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True) cannot be exported with legacy CUDA IPC (INVALID_ARGUMENT here);
the server must see the same GPU (same UUID) and share the PID namespace (docs/design.md
§10). A CPU-only laproxd answers UNIMPLEMENTED to cuda_ipc regions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from . import types as t
from .errors import LaproxError, invalid_argument

IPC_HANDLE_BYTES = 64
# torch >= 2.4 prefixes the handle with a format version byte and a kind byte.
_KIND_CUDA_MALLOC = ord("c")
_KIND_EXPANDABLE_SEGMENT = ord("e")


def torch_module() -> Optional[Any]:
    """torch if it is already imported (a torch tensor implies it), else None."""
    return sys.modules.get("torch")


def is_torch_tensor(value: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def wire_dtype(tensor: Any) -> t.DType:
    torch = torch_module()
    mapping = {torch.float32: t.DType.F32, torch.float16: t.DType.F16,
               torch.bfloat16: t.DType.BF16}
    if tensor.dtype not in mapping:
        raise invalid_argument(f"tensor dtype {tensor.dtype} is not supported (float32, "
                               "float16, bfloat16)")
    return mapping[tensor.dtype]


def cpu_tensor_as_numpy(tensor: Any) -> Tuple[np.ndarray, bool]:
    """A CPU tensor as a numpy view (no copy) and whether it holds bfloat16 bits."""
    torch = torch_module()
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), True
    if tensor.dtype == torch.float64:
        return tensor.numpy(), False
    wire_dtype(tensor)  # rejects what the wire cannot carry
    return tensor.numpy(), False


def ipc_handle(raw: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside what `_share_cuda_` returned."""
    if len(raw) == IPC_HANDLE_BYTES:
        return raw  # torch < 2.4: the handle itself
    if len(raw) == IPC_HANDLE_BYTES + 2 and raw[1] == _KIND_CUDA_MALLOC:
        return raw[2:]
    if len(raw) >= 2 and raw[1] == _KIND_EXPANDABLE_SEGMENT:
        raise invalid_argument(
            "CUDA tensor memory comes from PyTorch's expandable segments, which cannot be "
            "exported with CUDA IPC: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise invalid_argument(f"unrecognised CUDA IPC handle from torch ({len(raw)} bytes)")


def device_uuid(index: int) -> str:
    uuid = str(torch_module().cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid


@dataclass
class _Shared:
    region_id: int
    storage: Any           # keeps the memory alive while registered
    ref_counter: Tuple[Any, Any]  # torch's IPC reference counter (handle, offset)


class CudaRegions:
    """cuda_ipc regions of torch storages, registered once per storage.

    `register(handle, device_uuid, offset, byte_size) -> region_id` and
    `unregister(region_id)` are the Client's calls. Not thread-safe on its own.
    """

    def __init__(self, register: Callable[[bytes, str, int, int], int],
                 unregister: Callable[[int], None]):
        self._register = register
        self._unregister = unregister
        self._by_storage: Dict[Tuple[int, int], _Shared] = {}

    def __len__(self) -> int:
        return len(self._by_storage)

    def reference(self, tensor: Any) -> t.RegionTensor:
        """The region reference of a CUDA tensor, registering its storage on first use."""
        storage = tensor.untyped_storage()
        key = (tensor.device.index, storage.data_ptr())
        shared = self._by_storage.get(key)
        if shared is None:
            (device, raw_handle, size_bytes, offset_bytes, ref_handle, ref_offset, _event,
             _sync) = storage._share_cuda_()
            handle = ipc_handle(bytes(raw_handle))
            region_id = self._register(handle, device_uuid(device), int(offset_bytes),
                                       int(size_bytes))
            shared = _Shared(region_id, storage, (ref_handle, ref_offset))
            self._by_storage[key] = shared
        return t.RegionTensor(region_id=shared.region_id,
                              byte_offset=tensor.storage_offset() * tensor.element_size(),
                              dtype=wire_dtype(tensor), shape=tuple(tensor.shape),
                              strides=tuple(tensor.stride()))

    def release(self) -> None:
        """Unregisters every region (best effort) and releases torch's IPC counters."""
        torch = torch_module()
        shared_all, self._by_storage = list(self._by_storage.values()), {}
        for shared in shared_all:
            try:
                self._unregister(shared.region_id)
            except LaproxError:
                pass
            except Exception:
                if not sys.is_finalizing():
                    raise
            try:
                # What a torch consumer does when it drops a shared storage.
                torch.UntypedStorage._release_ipc_counter_cuda(*shared.ref_counter)
            except Exception:  # a private API: never fail a release over it
                pass


def synchronize(devices: "set[int]") -> None:
    """Waits for the current stream of each device (the inputs must be written)."""
    torch = torch_module()
    for index in sorted(devices):
        torch.cuda.current_stream(index).synchronize()
