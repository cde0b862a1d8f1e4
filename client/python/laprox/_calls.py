"""How the Client calls laproxd: its channel's options (with the service config whose retry
policy retries a busy laproxd's UnregisterRegion), deadlines of keep-plan calls on an engine's
path, the timeout of the region calls it makes on its own, the region calls and their cleanup,
and releasing what a Client holds."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Union

import grpc

from . import _cuda, _shm
from ._proto import SERVICE_CONFIG, pb
from .errors import from_rpc_error

# Every channel to laproxd: no message size limit of the client's own (laproxd has its limits),
# and the service config (retries: RESOURCE_EXHAUSTED of UnregisterRegion, laproxd's control
# queue being full, up to 5 attempts over about 5 s; laprox.proto says which).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1),
                   ("grpc.enable_retries", 1),
                   ("grpc.service_config", SERVICE_CONFIG)]

# The default deadline of a keep-plan call made on an engine's path (laprox.hf.Compressor,
# the vLLM plugin), and the number of prompt tokens per call it covers: plan_deadline.
PLAN_DEADLINE_S = 2.0
PLAN_DEADLINE_TOKENS = 32768


def plan_deadline(tokens: int, seconds: float = PLAN_DEADLINE_S) -> float:
    """The deadline of one keep-plan call over `tokens` prompt tokens in all (every sequence of
    the call): `seconds`, and `seconds` more per PLAN_DEADLINE_TOKENS tokens, since a plan's
    time grows linearly with n (bench/RESULTS.md: SmolLM2-135M at 32K tokens 0.55 s,
    Llama-3.1-8B at 4K 0.53 s on 2 vCPUs). An engine that waits at most this long for laproxd
    and then goes on with the full cache never stalls on a laproxd that stopped answering."""
    return float(seconds) * (1.0 + max(int(tokens), 0) / PLAN_DEADLINE_TOKENS)


Timeout = Union[float, Callable[[], float]]  # seconds, or a function giving what is left


def _call(method: Any, request: Any, timeout: Optional[Timeout]) -> Any:
    try:
        return method(request, timeout=timeout() if callable(timeout) else timeout)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None


class _CallTimeout:
    """The timeout of the region calls a Client makes on its own (its staging region, CUDA
    regions, a model's temporary region): the client's default, or, in the thread of a call
    that stages its inputs (within()), what is left of that call's deadline, so that the
    call's `timeout` bounds the region calls too. It holds no reference to the Client (the
    finalizer that releases the regions uses it)."""

    def __init__(self, default: float):
        self.default = default
        self._call = threading.local()  # .until: the deadline of this thread's call

    def __call__(self) -> float:
        until = getattr(self._call, "until", None)
        if until is None:
            return self.default
        return max(until - time.monotonic(), 0.0)

    @contextlib.contextmanager
    def within(self, timeout: Optional[float]) -> Iterator["_CallTimeout"]:
        self._call.until = time.monotonic() + (self.default if timeout is None
                                               else float(timeout))
        try:
            yield self
        finally:
            self._call.until = None


# Region calls as plain functions of the stub, so that the finalizer that releases the regions
# holds no reference to the Client.
def _register_shm(stub: Any, timeout: Timeout, name: str, byte_size: int, offset: int = 0,
                  writable: bool = False) -> int:
    request = pb.RegisterRegionRequest(
        shm=pb.ShmRegion(name=name, offset=offset, byte_size=byte_size), writable=writable)
    return _call(stub.RegisterRegion, request, timeout).region_id


def _register_cuda(stub: Any, timeout: Timeout, handle: bytes, device_uuid: str, offset: int,
                   byte_size: int) -> int:
    request = pb.RegisterRegionRequest(cuda_ipc=pb.CudaIpcRegion(
        handle=handle, device_uuid=device_uuid, offset=offset, byte_size=byte_size))
    return _call(stub.RegisterRegion, request, timeout).region_id


def _unregister(stub: Any, timeout: Timeout, region_id: int) -> None:
    """UnregisterRegion, as cleanup (close(), garbage collection) and the region calls use it:
    the channel retries RESOURCE_EXHAUSTED (CHANNEL_OPTIONS); any other error is raised."""
    _call(stub.UnregisterRegion, pb.UnregisterRegionRequest(region_id=region_id), timeout)


def _release(arena: _shm.StagingArena, cuda: _cuda.CudaRegions,
             shared: "weakref.WeakSet[_shm.SharedArray]", channel: grpc.Channel) -> None:
    """Releases what a Client holds; runs once (close(), garbage collection or exit)."""
    try:
        for array in list(shared):
            array.close()
        arena.release()
    finally:
        try:
            if len(cuda):
                cuda.release()
        finally:
            channel.close()

