"""Paged KV caches read in place: keys and values as laproxd reads them from an engine's block
pool, through the sequence's block table, without gathering them into [Hkv, n, d] first.

    pool = client.shared_array((2, num_blocks, 16, Hkv, d), "bf16")   # or a CUDA tensor
    keys, values = laprox.PagedKV.vllm_flash_attn(pool, block_table, n)
    plan = client.compute_keep_plan(model, [keys] * L ..., plan_shape="blocks_shared", ...)

A PagedTensor is one layer's keys or values: the logical [Hkv, n, d] tensor whose element
(h, i, c) lies at

    offset + block_ids[i // block_size] * block_stride + (i % block_size) * slot_stride
           + h * head_stride + c * dim_stride

elements from the pool's element 0 (laprox.proto, PagedLayout). The pool is memory laproxd
reads in place, never a copy (copying a whole pool would be the gather paging avoids):
  - a laprox.SharedArray (Client.shared_array): host memory in a registered shm region;
  - a laprox.RegionTensor: a region you registered (its byte_offset is the pool's element 0;
    SharedArray.region_tensor(view) gives one for a view of a shared array);
  - a torch CUDA tensor: shared by CUDA IPC as the client shares every CUDA tensor
    (laprox._cuda), the region being the tensor's storage.
numpy arrays and CPU torch tensors are refused (INVALID_ARGUMENT). The presets of PagedKV read
the pool's shape and strides, so a pool with permuted strides (vLLM's HND physical order of
the FlashAttention shape) is read as it lies.

Every check here raises LaproxArgumentError (a LaproxError and a ValueError) with the code
laproxd would answer; laproxd checks the rest (the pool's extent in its region: OUT_OF_RANGE).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import grpc
import numpy as np

from . import _cuda
from . import types as t
from ._shm import SharedArray
from .errors import LaproxError, invalid_argument

MAX_BLOCK_SIZE = 65536  # laprox.proto BlockTable.block_size
_INT32_MAX = (1 << 31) - 1


def _ids_array(name: str, value: Any) -> np.ndarray:
    """A 1-D array-like of block ids (numpy, list, torch tensor on any device) as a read-only
    int32 copy."""
    if _cuda.is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    ids = np.asarray(value)
    if ids.ndim != 1:
        raise invalid_argument(f"{name}: expected a 1-d array of block ids, got shape "
                               f"{ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise invalid_argument(f"{name}: block ids must be integers, got {ids.dtype}")
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > _INT32_MAX:
            bad = int(np.flatnonzero((ids < 0) | (ids > _INT32_MAX))[0])
            raise invalid_argument(f"{name}[{bad}] = {int(ids[bad])}: block ids must be in "
                                   f"[0, 2^31 - 1]")
    out = ids.astype(np.int32, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class BlockTable:
    """A sequence's block table (laprox.proto BlockTable): block_ids[j] is the physical block
    holding logical block j, i.e. positions [j * block_size, (j + 1) * block_size).

    block_ids is kept as a read-only int32 copy. allow_repeated_ids lets two logical blocks
    name one physical block (laproxd refuses a repeated id otherwise). Tables with equal ids,
    block size and allow_repeated_ids are one table on the wire (vLLM's one table for every
    layer is sent once per request).
    """
    block_ids: np.ndarray
    block_size: int
    allow_repeated_ids: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _ids_array("block_table", self.block_ids))
        try:
            size = operator.index(self.block_size)
        except TypeError:
            raise invalid_argument(f"block_size {self.block_size!r}: expected an int") from None
        if not 1 <= size <= MAX_BLOCK_SIZE:
            raise invalid_argument(f"block_size {size}: must be in [1, {MAX_BLOCK_SIZE}]")
        object.__setattr__(self, "block_size", int(size))
        object.__setattr__(self, "allow_repeated_ids", bool(self.allow_repeated_ids))

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Tokens the table's blocks hold: len(table) * block_size."""
        return len(self.block_ids) * self.block_size

    def blocks_for(self, n: int) -> int:
        """Blocks n tokens occupy: ceil(n / block_size)."""
        return -(-n // self.block_size)

    @functools.cached_property
    def wire_key(self) -> Tuple[int, bool, bytes]:
        """What makes two tables the same table on the wire."""
        return self.block_size, self.allow_repeated_ids, self.block_ids.tobytes()


@dataclass(frozen=True)
class _Pool:
    """What the presets need to know about a pool: its shape, strides (elements) and dtype."""
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: t.DType


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


_HOW = ("allocate it with Client.shared_array(...) (a view of one: "
        "SharedArray.region_tensor(view)), reference a region you registered with "
        "laprox.RegionTensor, or pass a CUDA tensor")


def _pool(name: str, pool: Any) -> _Pool:
    """The shape, strides and dtype of a pool; refuses what laproxd cannot read in place."""
    if isinstance(pool, SharedArray):
        if pool.closed:
            raise LaproxError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{name}: shared array {pool.name} is closed")
        array = pool.array
        return _Pool(tuple(array.shape),
                     tuple(s // array.dtype.itemsize for s in array.strides), pool.dtype)
    if isinstance(pool, t.RegionTensor):
        shape = tuple(int(s) for s in pool.shape)
        strides = _contiguous_strides(shape) if pool.strides is None else \
            tuple(int(s) for s in pool.strides)
        if len(strides) != len(shape):
            raise invalid_argument(f"{name}: RegionTensor shape {shape} and strides {strides} "
                                   "differ in length")
        return _Pool(shape, strides, t.DType.parse(pool.dtype))
    if _cuda.is_torch_tensor(pool):
        if not pool.is_cuda:
            raise invalid_argument(
                f"{name}: a CPU torch tensor cannot be a paged pool: laproxd reads pools in "
                "place, and copying a whole pool would be the gather paging avoids; keep the "
                "pool in Client.shared_array(...) (torch.from_numpy(shared.array) is a CPU "
                "tensor over that memory) or on a GPU")
        return _Pool(tuple(int(s) for s in pool.shape), tuple(int(s) for s in pool.stride()),
                     _cuda.wire_dtype(pool))
    if isinstance(pool, np.ndarray):
        raise invalid_argument(
            f"{name}: a numpy array cannot be a paged pool: laproxd reads pools in place from "
            f"a registered region, and copying a whole pool would be the gather paging "
            f"avoids; {_HOW}")
    raise invalid_argument(f"{name}: expected a laprox.SharedArray, laprox.RegionTensor or "
                           f"torch CUDA tensor as the pool, got {type(pool).__name__}")


def _expect_shape(name: str, pool: _Pool, layout: str, rank: int) -> None:
    if len(pool.shape) != rank:
        raise invalid_argument(f"{name}: expected {layout} (rank {rank}), got shape "
                               f"{list(pool.shape)}")


def _sequence_table(name: str, block_table: Union[BlockTable, Any], block_size: int, n: Any,
                    num_blocks: Optional[int] = None) -> Tuple[BlockTable, int]:
    """The table a sequence of n tokens is read through, and n: block_table's first
    ceil(n / block_size) ids (engines pad their rows, e.g. vLLM's block_table to
    max_num_blocks_per_req). Refuses n outside [1, capacity], a table of another block size
    and (num_blocks given) an id past the pool."""
    try:
        n = operator.index(n)
    except TypeError:
        raise invalid_argument(f"n {n!r}: expected an int") from None
    if isinstance(block_table, BlockTable):
        if block_table.block_size != block_size:
            raise invalid_argument(f"block_table: block_size {block_table.block_size}, but the "
                                   f"{name} has blocks of {block_size} tokens")
        table = block_table
    else:
        table = BlockTable(block_table, block_size)
    if not 1 <= n <= table.capacity:
        raise invalid_argument(
            f"block_table: {len(table)} ids of {block_size} tokens hold {table.capacity} "
            f"tokens, n = {n} needs ceil({n} / {block_size}) = {-(-n // block_size)} "
            f"(and n >= 1)")
    used = table.blocks_for(n)
    if used != len(table):
        table = BlockTable(table.block_ids[:used], block_size, table.allow_repeated_ids)
    if num_blocks is not None:
        past = np.flatnonzero(table.block_ids >= num_blocks)
        if len(past):
            raise invalid_argument(f"block_table[{int(past[0])}] = {int(table.block_ids[past[0]])}: "
                                   f"the {name} has {num_blocks} blocks",
                                   grpc.StatusCode.OUT_OF_RANGE)
    return table, n


@dataclass(frozen=True, eq=False)
class PagedTensor:
    """One layer's keys or values, the logical [Hkv, n, d] tensor, read through a block table
    from a pool in place (laprox.proto TensorRef.paged). Made by the PagedKV presets or
    PagedKV.tensor; given to Client.compute_keep_plan in place of a dense keys/values tensor.

    Element (h, i, c) lies at offset + table.block_ids[i // table.block_size] * block_stride
    + (i % table.block_size) * slot_stride + h * head_stride + c * dim_stride elements from
    the pool's element 0.

    Attributes:
        pool: a SharedArray, RegionTensor or torch CUDA tensor (module docstring).
        table: the BlockTable, exactly ceil(n / block_size) ids.
        shape: (Hkv, n, d).
        dtype: the wire dtype (the pool's).
        offset, block_stride, slot_stride, head_stride, dim_stride: elements, each >= 0.
    """
    pool: Any
    table: BlockTable
    shape: Tuple[int, int, int]
    dtype: t.DType
    offset: int
    block_stride: int
    slot_stride: int
    head_stride: int
    dim_stride: int

    def __post_init__(self) -> None:
        _pool("pool", self.pool)  # refuses what cannot be read in place
        if not isinstance(self.table, BlockTable):
            raise invalid_argument(f"table: expected a laprox.BlockTable, got "
                                   f"{type(self.table).__name__}")
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != 3 or min(shape) < 1:
            raise invalid_argument(f"shape {shape}: expected [Hkv, n, d], each >= 1")
        object.__setattr__(self, "shape", shape)
        if len(self.table) != self.table.blocks_for(shape[1]):
            raise invalid_argument(
                f"table: {len(self.table)} ids, but n = {shape[1]} in blocks of "
                f"{self.table.block_size} needs ceil({shape[1]} / {self.table.block_size}) = "
                f"{self.table.blocks_for(shape[1])}")
        object.__setattr__(self, "dtype", t.DType.parse(self.dtype))
        for field in ("offset", "block_stride", "slot_stride", "head_stride", "dim_stride"):
            value = int(getattr(self, field))
            if value < 0:
                raise invalid_argument(f"{field} {value}: must be >= 0")
            object.__setattr__(self, field, value)

    @property
    def n(self) -> int:
        return self.shape[1]


def _paged(name: str, source: Any, pool: _Pool, table: BlockTable, n: int, num_kv_heads: int,
           head_dim: int, offset: int, block_stride: int, slot_stride: int, head_stride: int,
           dim_stride: int) -> PagedTensor:
    """A preset's PagedTensor over `source`, whose strides are the pool's."""
    if min(pool.strides) < 0:
        raise invalid_argument(f"{name}: strides {list(pool.strides)} include a negative one; "
                               "laproxd reads strides >= 0")
    return PagedTensor(pool=source, table=table, shape=(num_kv_heads, n, head_dim),
                       dtype=pool.dtype, offset=offset, block_stride=block_stride,
                       slot_stride=slot_stride, head_stride=head_stride, dim_stride=dim_stride)


def _vllm_pair(kv_cache: Any, block_table: Any, n: int, layout: str, slot_axis: int,
               head_axis: int) -> Tuple[PagedTensor, PagedTensor]:
    """The (keys, values) of a vLLM cache [2, num_blocks, ...] whose block interiors put the
    slot and the head on axes `slot_axis` and `head_axis` (2 and 3, either way round); `layout`
    spells the shape for messages. Strides are the pool's own."""
    pool = _pool("kv_cache", kv_cache)
    _expect_shape("kv_cache", pool, layout, 5)
    if pool.shape[0] != 2:
        raise invalid_argument(f"kv_cache: expected {layout} (keys, values), got shape "
                               f"{list(pool.shape)}")
    num_blocks, head_dim = pool.shape[1], pool.shape[4]
    block_size, heads = pool.shape[slot_axis], pool.shape[head_axis]
    table, n = _sequence_table("kv_cache", block_table, block_size, n, num_blocks)
    s = pool.strides
    strides = dict(block_stride=s[1], slot_stride=s[slot_axis], head_stride=s[head_axis],
                   dim_stride=s[4])
    return (_paged("kv_cache", kv_cache, pool, table, n, heads, head_dim, 0, **strides),
            _paged("kv_cache", kv_cache, pool, table, n, heads, head_dim, s[0], **strides))


class PagedKV:
    """Presets for engines' paged KV caches: each returns one layer's (keys, values) as
    PagedTensors over the pool, read in place. Call once per layer (the block table is the
    same for every layer of a sequence and is sent once). Layouts, with Hkv KV heads of
    head_dim d:

      vllm_flash_attn    kv_cache [2, num_blocks, block_size, Hkv, d]   (vLLM FlashAttention)
      vllm_head_major    kv_cache [2, num_blocks, Hkv, block_size, d]   (vLLM CPU attention)
      sglang_token_pool  k_buffer, v_buffer [slots, Hkv, d]             (SGLang, block_size 1)
      tensor             any layout: offset and the four strides of laprox.proto PagedLayout

    The presets take the pool's strides as they are (only its shape is fixed).
    """

    @staticmethod
    def vllm_flash_attn(kv_cache: Any, block_table: Any,
                        n: int) -> Tuple[PagedTensor, PagedTensor]:
        """vLLM's FlashAttention layout: kv_cache [2, num_blocks, block_size, Hkv, d], keys =
        kv_cache[0], values = kv_cache[1].

        Args:
            kv_cache: one layer's cache (the pool: SharedArray, RegionTensor or CUDA tensor).
            block_table: the sequence's physical block ids (int array-like, numpy, torch, or a
                BlockTable of this block size), at least ceil(n / block_size) of them; the first
                ceil(n / block_size) are used.
            n: the sequence's tokens, in [1, len(block_table) * block_size].
        """
        return _vllm_pair(kv_cache, block_table, n, "[2, num_blocks, block_size, Hkv, d]",
                          slot_axis=2, head_axis=3)

    @staticmethod
    def vllm_head_major(kv_cache: Any, block_table: Any,
                        n: int) -> Tuple[PagedTensor, PagedTensor]:
        """Head-major blocks, kv_cache [2, num_blocks, Hkv, block_size, d] (vLLM's CPU
        attention backend; a block holds each head's block_size rows in turn). Arguments as
        vllm_flash_attn."""
        return _vllm_pair(kv_cache, block_table, n, "[2, num_blocks, Hkv, block_size, d]",
                          slot_axis=3, head_axis=2)

    @staticmethod
    def sglang_token_pool(k_buffer: Any, v_buffer: Any,
                          slot_indices: Any) -> Tuple[PagedTensor, PagedTensor]:
        """SGLang's token pool: one layer's k_buffer and v_buffer [slots, Hkv, d] (two pools);
        a block is one token (block_size 1) and the block ids are the request's slot indices
        (req_to_token row), n = len(slot_indices)."""
        keys, values = _pool("k_buffer", k_buffer), _pool("v_buffer", v_buffer)
        _expect_shape("k_buffer", keys, "[slots, Hkv, d]", 3)
        _expect_shape("v_buffer", values, "[slots, Hkv, d]", 3)
        if keys.shape != values.shape or keys.strides != values.strides:
            raise invalid_argument(f"k_buffer {list(keys.shape)} strides {list(keys.strides)} "
                                   f"and v_buffer {list(values.shape)} strides "
                                   f"{list(values.strides)} differ")
        ids = _ids_array("slot_indices", slot_indices)
        if not len(ids):
            raise invalid_argument("slot_indices is empty: a sequence has n >= 1 tokens")
        table, n = _sequence_table("k_buffer", BlockTable(ids, 1), 1, len(ids), keys.shape[0])
        slots, heads, head_dim = keys.shape
        s = keys.strides
        layout = dict(block_stride=s[0], slot_stride=0, head_stride=s[1], dim_stride=s[2])
        return (_paged("k_buffer", k_buffer, keys, table, n, heads, head_dim, 0, **layout),
                _paged("v_buffer", v_buffer, values, table, n, heads, head_dim, 0, **layout))

    @staticmethod
    def tensor(pool: Any, block_table: Any, n: int, *, num_kv_heads: int, head_dim: int,
               block_stride: int, slot_stride: int, head_stride: int, dim_stride: int = 1,
               offset: int = 0, block_size: Optional[int] = None) -> PagedTensor:
        """One paged tensor in any layout (laprox.proto PagedLayout): element (h, i, c) at
        offset + block_ids[i // block_size] * block_stride + (i % block_size) * slot_stride +
        h * head_stride + c * dim_stride elements from the pool's element 0; every value
        >= 0.

        block_table is a BlockTable, or an array-like of ids with block_size given; as in the
        presets, its first ceil(n / block_size) ids are used. laproxd checks that the pool's
        region holds the block of the largest id (OUT_OF_RANGE).
        """
        info = _pool("pool", pool)
        if block_size is None:
            if not isinstance(block_table, BlockTable):
                raise invalid_argument("block_size is required unless block_table is a "
                                       "laprox.BlockTable")
            block_size = block_table.block_size
        table, n = _sequence_table("pool", block_table, int(block_size), n)
        return PagedTensor(pool=pool, table=table, shape=(num_kv_heads, n, head_dim),
                           dtype=info.dtype, offset=offset, block_stride=block_stride,
                           slot_stride=slot_stride, head_stride=head_stride,
                           dim_stride=dim_stride)
