"""Host tensors: numpy arrays staged in POSIX shared memory registered with laproxd.

A Client owns one staging region: a multiprocessing.shared_memory segment named
"laprox-py-<pid>-<random>", registered once and reused by every call. A call copies its arrays
into it (one copy each, strided inputs become contiguous during that copy) and sends
(region_id, byte_offset) references. When a call needs more bytes the segment is replaced by a
larger one (unregistered and unlinked, then a new one created and registered). The segment is
released (UnregisterRegion, close, unlink) by Client.close(), by the Client's finalizer when it
is garbage-collected, and at interpreter exit (weakref.finalize); multiprocessing's resource
tracker unlinks it if the process dies without running either.

A SharedArray (Client.shared_array) is a numpy array in a shared-memory object of its own,
registered once as a region that laproxd reads in place: where an engine on the CPU keeps its
KV block pool, so that paged keys and values are never copied. It follows the same naming
("laprox-py-<pid>-<random>", pages reserved up front) and release rules, and is also released
by SharedArray.close() and when it is garbage-collected.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import types as t
from .errors import LaproxError, from_os_error, invalid_argument

ALIGNMENT = 64                 # bytes between staged tensors
MIN_REGION_BYTES = 1 << 20     # smallest staging region
GROWTH_HEADROOM = 8            # grow to need + need / 8, rounded up to 1 MiB

# numpy dtype -> (wire dtype, the numpy dtype staged)
_HOST_DTYPES = {
    np.dtype(np.float32): (t.DType.F32, np.dtype(np.float32)),
    np.dtype(np.float16): (t.DType.F16, np.dtype(np.float16)),
    np.dtype(np.float64): (t.DType.F32, np.dtype(np.float32)),  # converted while staging
}
_BF16_BITS = np.dtype(np.uint16)


@dataclass
class HostArray:
    """A host tensor ready for staging: `array` is copied as `staged` dtype; sent as `dtype`."""
    array: np.ndarray
    dtype: t.DType
    staged: np.dtype

    @property
    def nbytes(self) -> int:
        return int(self.array.size) * self.staged.itemsize


def host_array(name: str, value: Any, bf16: bool) -> HostArray:
    """Checks a numpy array (or array-like) and picks its wire dtype.

    float32 -> F32, float16 -> F16, float64 -> F32 (converted), a bfloat16 dtype
    (ml_dtypes) -> BF16, uint16/int16 -> BF16 bits when `bf16` (dtype="bf16") is given.
    """
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    dtype = array.dtype
    if dtype in _HOST_DTYPES:
        wire, staged = _HOST_DTYPES[dtype]
        return HostArray(array, wire, staged)
    if dtype.name == "bfloat16" and dtype.itemsize == 2:
        return HostArray(array.view(_BF16_BITS), t.DType.BF16, _BF16_BITS)
    if bf16 and dtype in (np.dtype(np.uint16), np.dtype(np.int16)):
        return HostArray(array.view(_BF16_BITS), t.DType.BF16, _BF16_BITS)
    hint = " (bfloat16 bits: pass dtype=\"bf16\")" if dtype.itemsize == 2 else ""
    raise invalid_argument(f"{name}: dtype {dtype} is not supported (float32, float16, float64, "
                           f"bfloat16){hint}")


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def layout(arrays: Sequence[HostArray]) -> Tuple[List[int], int]:
    """Byte offsets of the arrays in a staging region and the bytes they need."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end = _round_up(end + a.nbytes, ALIGNMENT)
    return offsets, end


def copy_into(buffer: memoryview, offset: int, a: HostArray) -> None:
    """Copies `a` into `buffer` at `offset`, contiguous, as its staged dtype."""
    if a.array.size == 0:
        return
    dst = np.ndarray(a.array.shape, dtype=a.staged, buffer=buffer, offset=offset)
    try:
        np.copyto(dst, a.array, casting="same_kind")
    finally:
        del dst


# Where Linux (glibc's shm_open, and laproxd's) keeps POSIX shared-memory objects.
SHM_DIR = "/dev/shm"


class _Segment:
    """One created-and-mapped shared-memory object."""

    def __init__(self, size: int):
        name = f"laprox-py-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except OSError as e:
            raise from_os_error(f"cannot create shared memory {name!r} of {size} bytes", e)
        # Reserve the pages now: writing past a full /dev/shm later would be SIGBUS. The object
        # is opened again by its path (Linux keeps POSIX shared memory in /dev/shm) rather than
        # through SharedMemory's private descriptor; elsewhere nothing is reserved.
        path = os.path.join(SHM_DIR, name)
        if hasattr(os, "posix_fallocate") and os.path.exists(path):
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
            except OSError as e:
                self.release()
                raise from_os_error(f"cannot allocate {size} bytes of shared memory for "
                                    f"{name!r} (is /dev/shm large enough?)", e)
        self.name = self.shm.name.lstrip("/")
        self.size = size

    def release(self) -> None:
        """Unmaps (when nothing still views the buffer) and unlinks; idempotent."""
        shm, self.shm = getattr(self, "shm", None), None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def _release_region(segment: _Segment, unregister: Callable[[int], None], region_id: int) -> None:
    """Unregisters `region_id` (best effort: the server may be gone), then unlinks `segment`."""
    try:
        if region_id:
            unregister(region_id)
    except LaproxError:
        pass
    except Exception:  # interpreter shutdown: gRPC may already be half torn down
        if not sys.is_finalizing():
            raise
    finally:
        segment.release()


class StagingArena:
    """The client's staging region: grown on demand, released once.

    `register(name, byte_size) -> region_id` and `unregister(region_id)` talk to the server;
    they are the Client's bound calls. Not thread-safe: the Client serialises its users.
    """

    def __init__(self, register: Callable[[str, int], int],
                 unregister: Callable[[int], None]):
        self._register = register
        self._unregister = unregister
        self.segment: Optional[_Segment] = None
        self.region_id = 0
        self.registrations = 0

    def ensure(self, need: int, exact: bool = False) -> None:
        """Makes the region at least `need` bytes: grown with headroom and at least
        MIN_REGION_BYTES, or (exact) `need` rounded up to a page."""
        if self.segment is not None and self.segment.size >= need:
            return
        if exact:
            size = _round_up(max(need, 1), 4096)
        else:
            size = max(MIN_REGION_BYTES, _round_up(need + need // GROWTH_HEADROOM, 1 << 20))
        self.release()  # the old one first: peak memory stays at the new size
        segment = _Segment(size)
        try:
            region_id = self._register(segment.name, size)
        except BaseException:
            segment.release()
            raise
        self.segment, self.region_id = segment, region_id
        self.registrations += 1

    @property
    def buffer(self) -> memoryview:
        assert self.segment is not None and self.segment.shm is not None
        return self.segment.shm.buf

    def info(self) -> Optional[t.SharedRegion]:
        if self.segment is None:
            return None
        return t.SharedRegion(self.segment.name, self.region_id, self.segment.size,
                              self.registrations)

    def release(self) -> None:
        """Unregisters (best effort: the server may be gone) and unlinks the region."""
        segment, region_id = self.segment, self.region_id
        self.segment, self.region_id = None, 0
        if segment is not None:
            _release_region(segment, self._unregister, region_id)


class TemporaryRegion:
    """A one-off registered segment for RegisterModel's weights (read during that call only):
    `with TemporaryRegion(arrays, register, unregister) as (region_id, offsets): ...`."""

    def __init__(self, arrays: Sequence[HostArray], register: Callable[[str, int], int],
                 unregister: Callable[[int], None]):
        self._arena = StagingArena(register, unregister)
        self._arrays = arrays

    def __enter__(self) -> Tuple[int, List[int]]:
        offsets, need = layout(self._arrays)
        self._arena.ensure(need, exact=True)
        try:
            for a, off in zip(self._arrays, offsets):
                copy_into(self._arena.buffer, off, a)
        except BaseException:
            self._arena.release()
            raise
        return self._arena.region_id, offsets

    def __exit__(self, *exc: Any) -> None:
        self._arena.release()


def shared_dtype(dtype: Any) -> Tuple[t.DType, np.dtype]:
    """The wire dtype and the numpy dtype of a SharedArray of `dtype`: float32 / "f32",
    float16 / "f16", or bfloat16 ("bf16", "bfloat16": uint16 bits; an ml_dtypes bfloat16 dtype:
    that dtype)."""
    if isinstance(dtype, (str, t.DType)):
        key = dtype if isinstance(dtype, t.DType) else dtype.strip().lower()
        if key in ("bf16", "bfloat16", t.DType.BF16):
            return t.DType.BF16, _BF16_BITS
        if key in ("f32", t.DType.F32):
            return t.DType.F32, np.dtype(np.float32)
        if key in ("f16", t.DType.F16):
            return t.DType.F16, np.dtype(np.float16)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype == np.dtype(np.float32):
        return t.DType.F32, np_dtype
    if np_dtype == np.dtype(np.float16):
        return t.DType.F16, np_dtype
    if np_dtype is not None and np_dtype.name == "bfloat16" and np_dtype.itemsize == 2:
        return t.DType.BF16, np_dtype
    raise invalid_argument(f"shared array dtype {dtype!r}: laproxd reads float32, float16 or "
                           "bfloat16 (\"bf16\": a uint16 array of the bits)")


class SharedArray:
    """A numpy array in POSIX shared memory registered with laproxd as one region, which
    laproxd reads in place. Made by Client.shared_array(shape, dtype, writable=...).

    Attributes:
        array: the numpy array (C-contiguous; bfloat16 as uint16 bits unless an ml_dtypes
            bfloat16 dtype was asked for). Write the pool through it. FAILED_PRECONDITION
            after close().
        region_id: the region laproxd knows it by.
        byte_offset: bytes from the start of the region to array element 0 (always 0).
        dtype: the wire dtype (laprox.DType) that laproxd reads.
        name: the shared-memory object's name, as /dev/shm lists it.
        writable: whether laproxd may write into it (registered writable).
        closed: whether close() (or the client's close()) has released it.

    close() unregisters the region (best effort: the server may be gone) and unlinks the
    object; it is idempotent and also runs when the SharedArray is garbage-collected, when its
    Client closes, and at interpreter exit. A numpy view still alive after close() stays
    readable (the mapping lives until the view dies) but laproxd no longer reads it.
    Use it as a context manager to close it on leaving the block.
    """

    def __init__(self, shape: Sequence[int], dtype: Any,
                 register: Callable[[str, int], int], unregister: Callable[[int], None],
                 writable: bool = False):
        self.dtype, np_dtype = shared_dtype(dtype)
        try:
            dims = tuple(int(s) for s in shape)
        except TypeError:
            dims = (int(shape),)
        if any(s < 0 for s in dims) or math.prod(dims) == 0:
            raise invalid_argument(f"shared array shape {dims}: every dimension must be > 0")
        nbytes = math.prod(dims) * np_dtype.itemsize  # Python ints: no overflow
        segment = _Segment(nbytes)
        try:
            region_id = register(segment.name, nbytes)
        except BaseException:
            segment.release()
            raise
        self._segment: Optional[_Segment] = segment
        self._array: Optional[np.ndarray] = np.ndarray(dims, dtype=np_dtype,
                                                       buffer=segment.shm.buf)
        self.region_id = region_id
        self.byte_offset = 0
        self.byte_size = nbytes
        self.name = segment.name
        self.writable = bool(writable)
        self._finalizer = weakref.finalize(self, _release_region, segment, unregister,
                                           region_id)

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise LaproxError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shared array {self.name} is closed (its region was released)")
        return self._array

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.array.shape

    def region_tensor(self, view: Optional[np.ndarray] = None) -> t.RegionTensor:
        """A RegionTensor of `array` or of a numpy view into it (e.g. `shared.array[layer]` or
        a transposed view): its byte offset in the region and its strides in elements, for
        dense tensors laproxd then reads in place and for pools of paged tensors. A view that
        is not inside this array, or has negative strides or another dtype: INVALID_ARGUMENT."""
        array = self.array
        view = array if view is None else view
        if not isinstance(view, np.ndarray) or view.dtype != array.dtype:
            raise invalid_argument(
                f"region_tensor: expected a numpy view of shared array {self.name} "
                f"({array.dtype}), got {type(view).__name__}"
                f"{' of ' + str(view.dtype) if isinstance(view, np.ndarray) else ''}")
        itemsize = array.dtype.itemsize
        if any(s < 0 or s % itemsize for s in view.strides):
            raise invalid_argument(f"region_tensor: view strides {view.strides} (bytes) must "
                                   f"be >= 0 and multiples of {itemsize}")
        base = array.__array_interface__["data"][0]
        start = view.__array_interface__["data"][0]
        extent = 0 if view.size == 0 else \
            itemsize * (1 + sum((n - 1) * s // itemsize for n, s in zip(view.shape, view.strides)))
        if start < base or start + extent > base + array.nbytes:
            raise invalid_argument(f"region_tensor: the view does not lie inside shared array "
                                   f"{self.name}")
        return t.RegionTensor(region_id=self.region_id,
                              byte_offset=self.byte_offset + start - base, dtype=self.dtype,
                              shape=tuple(int(n) for n in view.shape),
                              strides=tuple(int(s) // itemsize for s in view.strides))

    def close(self) -> None:
        """Unregisters the region and unlinks the shared-memory object; idempotent."""
        self._array = None  # the mapping can go as soon as no view of it is left
        self._finalizer()

    def __enter__(self) -> "SharedArray":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.array.shape} {self.array.dtype}"
        return f"SharedArray({self.name}, region {self.region_id}, {state}, {self.dtype.name})"
