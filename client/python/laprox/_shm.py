"""Host tensors: numpy arrays staged in POSIX shared memory registered with laproxd.

A Client owns one staging region: a multiprocessing.shared_memory segment named
"laprox-py-<pid>-<random>", registered once and reused by every call. A call copies its arrays
into it (one copy each, strided inputs become contiguous during that copy) and sends
(region_id, byte_offset) references. When a call needs more bytes the segment is replaced by a
larger one (unregistered and unlinked, then a new one created and registered). The segment is
released (UnregisterRegion, close, unlink) by Client.close(), by the Client's finalizer when it
is garbage-collected, and at interpreter exit (weakref.finalize); multiprocessing's resource
tracker unlinks it if the process dies without running either.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable, List, Optional, Sequence, Tuple

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


class _Segment:
    """One created-and-mapped shared-memory object."""

    def __init__(self, size: int):
        name = f"laprox-py-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        except OSError as e:
            raise from_os_error(f"cannot create shared memory {name!r} of {size} bytes", e)
        fd = getattr(self.shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            # Reserve the pages now: writing past a full /dev/shm later would be SIGBUS.
            try:
                os.posix_fallocate(fd, 0, size)
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
        if segment is None:
            return
        try:
            if region_id:
                self._unregister(region_id)
        except LaproxError:
            pass
        except Exception:  # interpreter shutdown: gRPC may already be half torn down
            if not sys.is_finalizing():
                raise
        finally:
            segment.release()


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
