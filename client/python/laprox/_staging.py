"""Turning a call's inputs into a request: the tensors of each layer (numpy arrays, torch
tensors, region references, paged tensors) become TensorRef messages, their host arrays staged
for one copy into the client's shared-memory region, CUDA tensors for sharing through CUDA IPC."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import grpc
import numpy as np

from . import _cuda, _shm
from . import types as t
from ._proto import policy_to_proto
from .errors import LaproxError, invalid_argument
from .paged import BlockTable, PagedTensor

# Tensor fields of LayerInputs and the rank of one layer's tensor.
_LAYER_FIELDS = (("keys", 3), ("values", 3), ("window_queries", 3), ("window_attention", 3),
                 ("window_lse", 2))


def _per_layer(name: str, value: Any, rank: int) -> List[Any]:
    """One entry per layer: a list/tuple as given, a stacked array split along axis 0."""
    if isinstance(value, (list, tuple)):
        return list(value)
    shape = getattr(value, "shape", None)
    if shape is None:
        value = np.asarray(value)
        shape = value.shape
    if len(shape) != rank + 1:
        raise invalid_argument(f"{name}: expected a list of per-layer [{rank}-d] tensors or one "
                               f"stacked [{rank + 1}-d] tensor, got shape {tuple(shape)}")
    return [value[i] for i in range(shape[0])]


class _Staging:
    """The host arrays of one call (one or several sequences) and the TensorRef messages they
    fill; CUDA tensors to share before the call."""

    def __init__(self) -> None:
        self.arrays: List[_shm.HostArray] = []
        self.targets: List[Any] = []
        # (torch tensor, TensorRef message, None or a paged tensor's offset in elements)
        self.cuda: List[Tuple[Any, Any, Optional[int]]] = []

    def add(self, name: str, value: Any, message: Any, bf16: bool) -> None:
        if isinstance(value, PagedTensor):
            raise invalid_argument(f"{name}: only keys and values may be paged")
        if isinstance(value, t.RegionTensor):
            _fill_region_ref(message, value)
            return
        if isinstance(value, _shm.SharedArray):
            _fill_region_ref(message, value.region_tensor())
            return
        if _cuda.is_torch_tensor(value):
            if value.is_cuda:
                self.cuda.append((value, message, None))
                return
            value, is_bf16 = _cuda.cpu_tensor_as_numpy(value)
            host = _shm.host_array(name, value, bf16 or is_bf16)
        else:
            host = _shm.host_array(name, value, bf16)
        self.arrays.append(host)
        self.targets.append(message)
        message.dtype = int(host.dtype)
        message.shape[:] = [int(s) for s in host.array.shape]

    def add_paged(self, name: str, value: PagedTensor, message: Any, table_index: int) -> None:
        """A paged tensor: the region slice at its element 0 of physical block 0, its layout
        naming block table `table_index`, no strides, shape [Hkv, n, d]."""
        message.dtype = int(value.dtype)
        message.shape[:] = list(value.shape)
        layout = message.paged
        layout.block_table = table_index
        layout.block_stride = value.block_stride
        layout.slot_stride = value.slot_stride
        layout.head_stride = value.head_stride
        layout.dim_stride = value.dim_stride
        pool = value.pool
        if isinstance(pool, _shm.SharedArray):
            if pool.closed:
                raise LaproxError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"{name}: its pool, shared array {pool.name}, is closed")
            region_id, base = pool.region_id, pool.byte_offset
        elif isinstance(pool, t.RegionTensor):
            region_id, base = int(pool.region_id), int(pool.byte_offset)
        else:  # a CUDA tensor (PagedTensor refuses anything else): registered in _share_cuda
            self.cuda.append((pool, message, value.offset))
            return
        message.region.region_id = region_id
        message.region.byte_offset = base + value.offset * value.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _fill_region_ref(message: Any, ref: t.RegionTensor) -> None:
    message.region.region_id = int(ref.region_id)
    message.region.byte_offset = int(ref.byte_offset)
    message.dtype = int(t.DType.parse(ref.dtype))
    message.shape[:] = [int(s) for s in ref.shape]
    if ref.strides is not None:
        message.strides[:] = [int(s) for s in ref.strides]


def _bf16_flag(dtype: Optional[str]) -> bool:
    if dtype is None:
        return False
    if str(dtype).lower() in ("bf16", "bfloat16"):
        return True
    raise invalid_argument(f"dtype {dtype!r}: only \"bf16\" (reinterpret uint16 arrays) is "
                           "accepted here; float arrays carry their own dtype")


def _cache_positions(value: Any, num_layers: int) -> List[np.ndarray]:
    """A decode re-plan's positions: per layer an integer array [Hkv, n_l] in the int32 range
    (a list, or one stacked [L, Hkv, n] array)."""
    layers = _per_layer("cache_positions", value, 2)
    if len(layers) != num_layers:
        raise invalid_argument(f"cache_positions: {len(layers)} layers given, keys have "
                               f"{num_layers}")
    out = []
    for l, positions in enumerate(layers):
        if hasattr(positions, "detach"):  # a torch tensor
            positions = positions.detach().cpu().numpy()
        a = np.asarray(positions)
        if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
            raise invalid_argument(f"cache_positions[{l}]: expected integers [Hkv, n_l], got "
                                   f"{a.dtype} {a.shape}")
        if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
            raise invalid_argument(f"cache_positions[{l}]: values outside the int32 range")
        out.append(a.astype(np.int32))
    return out


def _fill_keep_plan_request(request: Any, model_id: int, seq: t.SequenceInputs,
                            staging: _Staging) -> Tuple[t.Outputs, Optional[List[np.ndarray]]]:
    """Fills a ComputeKeepMaskRequest with one sequence's inputs, adding its tensors to
    `staging` (each paged tensor's block table once per distinct table); returns the outputs
    requested and a decode re-plan's positions (None for a prefill). Raises LaproxError
    (INVALID_ARGUMENT) for inputs that cannot be sent."""
    pol = t.Policy.of(seq.policy, **seq.policy_options)
    bud = t.Budget.of(seq.budget)
    out = t.Outputs.of(seq.outputs)
    bf16 = _bf16_flag(seq.dtype)
    given = {name: getattr(seq, name) for name, _ in _LAYER_FIELDS}
    per_layer = {name: _per_layer(name, given[name], rank)
                 for name, rank in _LAYER_FIELDS if given[name] is not None}
    if "keys" not in per_layer or "values" not in per_layer:
        raise invalid_argument("keys and values are required")
    num_layers = len(per_layer["keys"])
    for name, tensors in per_layer.items():
        if len(tensors) != num_layers:
            raise invalid_argument(f"{name}: {len(tensors)} layers given, keys have "
                                   f"{num_layers}")
    if num_layers == 0:
        raise invalid_argument("keys: no layers given")
    key_shape = tuple(per_layer["keys"][0].shape)
    if len(key_shape) != 3:
        raise invalid_argument(f"keys[0]: expected [Hkv, n, d], got shape {key_shape}")

    request.model_id = model_id
    request.n = int(key_shape[1])
    cache = None
    if seq.cache_positions is not None:
        # A decode re-plan: layers may hold different counts; n is the longest.
        cache = _cache_positions(seq.cache_positions, num_layers)
        request.n = max(int(k.shape[1]) for k in per_layer["keys"])
        for positions in cache:
            request.cache.layers.add(entries=positions.shape[1],
                                     positions=positions.ravel().tolist())
    policy_to_proto(pol, request.policy)
    if bud is not None:
        if bud.tokens_per_head is not None:
            request.budget.tokens_per_head = bud.tokens_per_head
        if bud.compression_ratio is not None:
            request.budget.compression_ratio = bud.compression_ratio
    request.outputs.positions = out.positions
    request.outputs.bitmask = out.bitmask
    request.outputs.scores = out.scores

    tables: Dict[Tuple[int, bool, bytes], int] = {}

    def table_index(table: BlockTable) -> int:
        index = tables.get(table.wire_key)
        if index is None:
            index = tables[table.wire_key] = len(request.block_tables)
            request.block_tables.add(block_ids=table.block_ids.tolist(),
                                     block_size=table.block_size,
                                     allow_repeated_ids=table.allow_repeated_ids)
        return index

    for l in range(num_layers):
        layer = request.layers.add()
        for name, tensors in per_layer.items():
            value, field = tensors[l], f"{name}[{l}]"
            if isinstance(value, PagedTensor) and name in ("keys", "values"):
                staging.add_paged(field, value, getattr(layer, name), table_index(value.table))
            else:
                staging.add(field, value, getattr(layer, name), bf16)
    return out, cache

