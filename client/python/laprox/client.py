"""laprox.Client: talk to laproxd with numpy arrays or torch tensors in, KeepPlan out.

    with laprox.Client("unix:/run/laprox/laproxd.sock") as client:
        model = client.register_model("smollm2", geometry, o_proj)        # once
        plan = client.compute_keep_plan(model, keys, values, window_queries,
                                        budget=128)                       # per prefill
        masks = plan.to_masks()                                           # [L, Hkv, n] bool

Tensors (keys, values: per layer [Hkv, n, d]; window_queries [H, wq, d]; window_attention
[H, wq, n]; window_lse [H, wq]; o_proj [D, H * d]) are given as a list with one entry per layer
or as one stacked array with a leading layer dimension. Each entry may be
  - a numpy array (float32, float16, float64 -> sent as float32, bfloat16 from ml_dtypes, or
    uint16/int16 bfloat16 bits with dtype="bf16"), any strides: copied once into the client's
    shared-memory staging region (see laprox._shm) and sent as a reference;
  - a torch tensor: CPU tensors take the numpy path without an extra copy (bfloat16 included),
    CUDA tensors are shared through CUDA IPC without any copy (see laprox._cuda);
  - a laprox.RegionTensor: a reference into a region you registered yourself;
  - keys and values only: a laprox.PagedTensor (laprox.PagedKV), one layer of a paged KV cache
    read in place from its block pool through the sequence's block table (see laprox.paged).
Client.compute_keep_plans sends several sequences in one ComputeKeepPlans call.

Errors: every failure raises laprox.LaproxError with a grpc.StatusCode (`.code`) and a message.
Threads: a Client may be shared; calls that stage host arrays or CUDA regions run one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc
import numpy as np

from . import _cuda, _shm
from . import types as t
from ._proto import health_pb2, health_pb2_grpc, laprox_pb2_grpc, pb
from ._proto import policy_from_proto, policy_to_proto
from .errors import LaproxError, from_rpc_error, invalid_argument
from .paged import BlockTable, PagedTensor

def tls_credentials(ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                    key_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """Channel credentials for laproxd's TLS port: the PEM CA bundle that signed its
    certificate (None: the system roots) and, for mutual TLS (--tls_client_ca_file), this
    client's PEM certificate chain and key."""
    def read(path: Optional[str]) -> Optional[bytes]:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise LaproxError(grpc.StatusCode.NOT_FOUND, f"{path} cannot be read: {e}") from None
    return grpc.ssl_channel_credentials(root_certificates=read(ca_file),
                                        private_key=read(key_file),
                                        certificate_chain=read(cert_file))


def default_target() -> str:
    """Where `laproxd` listens when started without --socket: unix:/run/laprox/laproxd.sock for
    root, unix:$XDG_RUNTIME_DIR/laprox/laproxd.sock for other users (the root path when
    XDG_RUNTIME_DIR is unset or relative)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.geteuid() != 0 and runtime.startswith("/"):
        return f"unix:{runtime.rstrip('/')}/laprox/laproxd.sock"
    return "unix:/run/laprox/laproxd.sock"


DEFAULT_TARGET = default_target()

# Tensor fields of LayerInputs and the rank of one layer's tensor.
_LAYER_FIELDS = (("keys", 3), ("values", 3), ("window_queries", 3), ("window_attention", 3),
                 ("window_lse", 2))


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


# How long cleanup (close(), garbage collection) retries a busy server's RESOURCE_EXHAUSTED.
CLEANUP_RETRY_S = 5.0


def _unregister(stub: Any, timeout: Timeout, region_id: int,
                retry_for: float = CLEANUP_RETRY_S) -> None:
    """UnregisterRegion for cleanup: RESOURCE_EXHAUSTED (a busy server) is retried with backoff
    (50 ms, doubling to 1 s) for `retry_for` seconds; any other error is raised at once."""
    give_up = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            _call(stub.UnregisterRegion, pb.UnregisterRegionRequest(region_id=region_id),
                  timeout)
            return
        except LaproxError as e:
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or \
                    time.monotonic() + delay > give_up:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


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


# --- response decoding --------------------------------------------------------------------------

def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _packed_chunks(data: bytes, fields: Tuple[int, ...]) -> Dict[int, List[memoryview]]:
    """The length-delimited records of the given top-level fields of a serialized message."""
    view = memoryview(data)
    chunks: Dict[int, List[memoryview]] = {}
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            if number in fields:
                chunks.setdefault(number, []).append(view[pos:pos + length])
            pos += length
        else:
            raise ValueError(f"wire type {wire_type}")
    return chunks


def _repeated(chunks: Dict[int, List[memoryview]], number: int, container: Any,
              dtype: str) -> np.ndarray:
    """A packed repeated fixed-width field as a numpy array: a view of the response bytes
    (no per-element conversion), or converted from the parsed message if it is not packed."""
    parts = chunks.get(number, [])
    if parts:
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        array = np.frombuffer(raw, dtype=dtype)
        if array.size == len(container):
            return array
    return np.array(container, dtype=dtype)


# --- inputs -------------------------------------------------------------------------------------

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


def _fill_keep_plan_request(request: Any, model_id: int, seq: t.SequenceInputs,
                            staging: _Staging) -> t.Outputs:
    """Fills a ComputeKeepMaskRequest with one sequence's inputs, adding its tensors to
    `staging` (each paged tensor's block table once per distinct table); returns the outputs
    requested. Raises LaproxError (INVALID_ARGUMENT) for inputs that cannot be sent."""
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
    return out


class Client:
    """A connection to laproxd.

    Args:
        target: a gRPC target, "unix:/path/to/socket" or "host:port". Connects lazily: the
            first call raises LaproxError(UNAVAILABLE) when nothing listens.
        timeout: deadline of each call in seconds (the methods that take a `timeout`
            override it per call; the region calls a call makes to stage its inputs count
            against its deadline).
        inline_max_bytes: requests whose host tensors total at most this many bytes send them
            inline in the message instead of through shared memory (0: never).
        credentials: for a TCP target served with TLS (laproxd --tls_cert_file):
            laprox.tls_credentials(...); None: plaintext (Unix sockets, loopback TCP).

    The client owns one shared-memory staging region for host arrays (created on first use,
    registered once, grown when a call needs more), the CUDA IPC regions of the torch
    storages it has shared and the SharedArrays it made (shared_array); close() (or leaving a
    `with` block, also by an exception), garbage collection and interpreter exit unregister
    and free them.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float = 60.0,
                 inline_max_bytes: int = 0,
                 credentials: Optional[grpc.ChannelCredentials] = None):
        if not target:
            raise invalid_argument("target is empty")
        self.target = target
        self.timeout = float(timeout)
        self.inline_max_bytes = int(inline_max_bytes)
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]
        self._channel = grpc.insecure_channel(target, options=options) if credentials is None \
            else grpc.secure_channel(target, credentials, options=options)
        self._stub = laprox_pb2_grpc.LaproxStub(self._channel)
        # Plans are decoded here from the response bytes (see _decode_plan).
        self._compute_raw = self._channel.unary_unary(
            "/laprox.v1.Laprox/ComputeKeepMask",
            request_serializer=pb.ComputeKeepMaskRequest.SerializeToString,
            response_deserializer=None)
        self._compute_batch_raw = self._channel.unary_unary(
            "/laprox.v1.Laprox/ComputeKeepPlans",
            request_serializer=pb.ComputeKeepPlansRequest.SerializeToString,
            response_deserializer=None)
        self._lock = threading.RLock()
        self._closed = False
        self._call_timeout = _CallTimeout(self.timeout)
        self._register_shm = functools.partial(_register_shm, self._stub, self._call_timeout)
        self._unregister = functools.partial(_unregister, self._stub, self._call_timeout)
        self._arena = _shm.StagingArena(self._register_shm, self._unregister)
        self._cuda = _cuda.CudaRegions(
            functools.partial(_register_cuda, self._stub, self._call_timeout), self._unregister)
        self._shared: "weakref.WeakSet[_shm.SharedArray]" = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _release, self._arena, self._cuda,
                                           self._shared, self._channel)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unregisters and frees the staging region, the CUDA regions and the SharedArrays
        this client made, closes the channel. Idempotent; server errors while unregistering
        are ignored (the server may be gone)."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LaproxError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")

    def _rpc(self, method: Any, request: Any, timeout: Optional[float] = None) -> Any:
        self._check_open()
        return _call(method, request, self.timeout if timeout is None else timeout)

    # --- server -----------------------------------------------------------------------------

    def info(self) -> t.ServerInfo:
        """Version, backend, devices, limits and what the server supports."""
        r = self._rpc(self._stub.GetServerInfo, pb.GetServerInfoRequest())
        lim = r.limits

        def known(enum_type: Any, values: Any) -> Tuple[Any, ...]:
            return tuple(enum_type(v) for v in values if v in enum_type._value2member_map_)

        return t.ServerInfo(
            version=r.version,
            backend="cuda" if r.backend == pb.BACKEND_KIND_CUDA else "cpu",
            description=r.backend_description,
            devices=tuple(t.DeviceInfo(d.uuid, d.name, d.ordinal, d.total_memory_bytes,
                                       (d.compute_capability_major,
                                        d.compute_capability_minor), d.active)
                          for d in r.devices),
            limits=t.ServerLimits(lim.max_regions, lim.max_models, lim.max_request_bytes,
                                  lim.max_response_bytes, lim.max_tokens, lim.max_window,
                                  lim.max_pool_kernel, lim.max_tokens_per_head,
                                  lim.max_request_memory_bytes, lim.max_model_memory_bytes,
                                  lim.max_batch_sequences, lim.max_request_work,
                                  lim.heavy_request_work),
            supported_policies=known(t.PolicyKind, r.supported_policies),
            supported_dtypes=known(t.DType, r.supported_dtypes),
            supported_region_kinds=known(t.RegionKind, r.supported_region_kinds))

    def health(self, service: str = "") -> bool:
        """grpc.health.v1 Check: True when `service` ("" = the server; "laprox.v1.Laprox" =
        ready, i.e. a model is registered) is SERVING. NOT_FOUND for an unknown service."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        r = self._rpc(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return r.status == health_pb2.HealthCheckResponse.SERVING

    # --- regions ----------------------------------------------------------------------------

    def register_shm_region(self, name: str, byte_size: int, offset: int = 0,
                            writable: bool = False, *, timeout: Optional[float] = None) -> int:
        """Registers an existing shared-memory object ("laprox-" prefix) that you manage;
        returns its region id for RegionTensor references. `timeout`: this call's deadline in
        seconds (default: the client's)."""
        self._check_open()
        return _register_shm(self._stub, self.timeout if timeout is None else timeout, name,
                             byte_size, offset, writable)

    def shared_array(self, shape: Union[int, Sequence[int]], dtype: Any, *,
                     writable: bool = False) -> _shm.SharedArray:
        """A numpy array in a new POSIX shared-memory object ("laprox-py-<pid>-<random>",
        pages reserved up front), registered once as a region that laproxd reads in place:
        where a CPU engine keeps its KV block pool so that paged keys and values (PagedKV) are
        never copied, or any input it writes once and sends many times (region_tensor()).

        Args:
            shape: the array's shape, every dimension > 0.
            dtype: float32 / "f32", float16 / "f16", or "bf16" / "bfloat16" (numpy has no
                bfloat16: the array is uint16 and holds the bits; an ml_dtypes bfloat16 dtype
                gives an array of that dtype).
            writable: register it writable (laproxd may then write outputs into it).

        Returns: a SharedArray (.array, .region_id, .byte_offset, .dtype, region_tensor(),
        close(); a context manager). It is released by its close(), by this client's close(),
        when garbage-collected and at interpreter exit. Raises LaproxError: INVALID_ARGUMENT
        for a dtype or shape, RESOURCE_EXHAUSTED when /dev/shm is full, the server's status
        when it refuses the region (e.g. RESOURCE_EXHAUSTED at --max_regions).
        """
        with self._lock:  # close() must see every array made before it
            self._check_open()
            array = _shm.SharedArray(
                shape, dtype, functools.partial(self._register_shm, writable=writable),
                self._unregister, writable)
            self._shared.add(array)
            return array

    def unregister_region(self, region_id: int) -> None:
        """Closes a region; returns when the requests using it have finished."""
        self._rpc(self._stub.UnregisterRegion, pb.UnregisterRegionRequest(region_id=region_id))

    def list_regions(self) -> List[t.RegionInfo]:
        """Every region registered with the server (by any client), ascending by id."""
        r = self._rpc(self._stub.ListRegions, pb.ListRegionsRequest())
        return [t.RegionInfo(x.region_id, t.RegionKind(x.kind), x.name, x.device_uuid,
                             x.offset, x.byte_size, x.writable, x.in_flight_requests,
                             x.draining) for x in r.regions]

    @property
    def staging_region(self) -> Optional[t.SharedRegion]:
        """The client's shared-memory staging region, None before the first staged call."""
        return self._arena.info()

    def release_cuda_regions(self) -> None:
        """Unregisters the CUDA IPC regions of every torch storage shared so far."""
        with self._lock:
            self._cuda.release()

    # --- models -----------------------------------------------------------------------------

    def register_model(self, name: str, geometry: Union[t.ModelGeometry, Mapping[str, Any]],
                       o_proj: Any, prepare_cross_grams: bool = False, *,
                       dtype: Optional[str] = None, timeout: Optional[float] = None) -> int:
        """Registers a model; returns its id.

        Args:
            name: for logs and metrics; [A-Za-z0-9._/:-], at most 128 bytes ("" = the id).
            geometry: ModelGeometry or a mapping of its fields.
            o_proj: each layer's output projection weight [D, H * d] (Hugging Face
                o_proj.weight): a list of L tensors or one [L, D, H * d] tensor. Host arrays
                go through a temporary shared-memory region freed when the call returns.
            prepare_cross_grams: also prepare what GqaValue.EXACT_BLOCK needs.
            dtype: "bf16" to send uint16/int16 arrays as bfloat16 bits.
            timeout: this call's deadline in seconds, the temporary region's registration
                included (default: the client's).
        """
        g = t.ModelGeometry.of(geometry)
        request = pb.RegisterModelRequest(
            name=name, prepare_cross_grams=prepare_cross_grams,
            geometry=pb.ModelGeometry(num_layers=g.num_layers, num_heads=g.num_heads,
                                      num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                      hidden_size=g.hidden_size,
                                      softmax_scale=g.softmax_scale))
        staging, bf16 = _Staging(), _bf16_flag(dtype)
        for l, weight in enumerate(_per_layer("o_proj", o_proj, 2)):
            staging.add(f"o_proj[{l}]", weight, request.o_proj.add(), bf16)
        with self._lock, self._call_timeout.within(timeout) as left:
            self._check_open()
            self._share_cuda(staging)
            if staging.arrays and staging.nbytes > self.inline_max_bytes:
                with _shm.TemporaryRegion(staging.arrays, self._register_shm,
                                          self._unregister) as (region_id, offsets):
                    self._point_at(staging, region_id, offsets)
                    return self._rpc(self._stub.RegisterModel, request, left()).model_id
            self._inline(staging)
            return self._rpc(self._stub.RegisterModel, request, left()).model_id

    def unregister_model(self, model_id: int) -> None:
        """Forgets a model (NOT_FOUND if unknown); running requests finish normally."""
        self._rpc(self._stub.UnregisterModel, pb.UnregisterModelRequest(model_id=model_id))

    # --- keep plans -------------------------------------------------------------------------

    def compute_keep_plan(self, model_id: int, keys: Any, values: Any,
                          window_queries: Any = None, window_attention: Any = None,
                          window_lse: Any = None, *,
                          policy: Union[t.Policy, str, Mapping[str, Any], None] = None,
                          budget: Union[t.Budget, int, float, None] = None,
                          outputs: Union[t.Outputs, Mapping[str, bool], Sequence[str],
                                         None] = None,
                          dtype: Optional[str] = None, timeout: Optional[float] = None,
                          **policy_options: Any) -> t.KeepPlan:
        """The keep-plan of one prefilled sequence of n tokens.

        Args:
            model_id: from register_model.
            keys, values: per layer [Hkv, n, d] (list of L, or stacked [L, Hkv, n, d]); per
                layer also a PagedTensor (laprox.PagedKV: one layer of a paged cache read in
                place through the sequence's block table; lists only).
            window_queries: per layer [H, wq, d], post-RoPE queries of the last wq positions;
                or window_attention: per layer [H, wq, n] softmax rows. Exactly one.
            window_lse: optional per layer [H, wq] log-sum-exp of the window rows (queries
                only).
            policy: a Policy, a policy kind ("laprox", "snapkv", ...), a mapping of options,
                or None (LAPROX with the server's defaults). plan_shape="blocks_shared" (or
                "blocks_per_layer") asks for whole blocks; with paged keys the plan's `blocks`
                then has the new block table and the freed block ids.
            budget: Budget, an int (tokens per head) or a float (compression ratio).
            outputs: Outputs or names ("positions", "bitmask", "scores"); default positions.
            dtype: "bf16" to send uint16/int16 arrays as bfloat16 bits.
            timeout: this call's deadline in seconds, staging the inputs included (default:
                the client's); laprox.client.plan_deadline(n) suits an engine's path.
            **policy_options: Policy fields applied on top of `policy`, e.g. window=32,
                kind="snapkv", allocation="per_layer".

        Returns: a KeepPlan. Raises LaproxError.
        """
        seq = t.SequenceInputs(keys, values, window_queries, window_attention, window_lse,
                               policy=policy, budget=budget, outputs=outputs, dtype=dtype,
                               **policy_options)
        staging = _Staging()
        request = pb.ComputeKeepMaskRequest()
        out = _fill_keep_plan_request(request, model_id, seq, staging)
        return _decode_plan(self._stage_and_call(staging, self._compute_raw, request, timeout),
                            out)

    def compute_keep_plans(self, model_id: int,
                           sequences: Sequence[Union[t.SequenceInputs, Mapping[str, Any]]], *,
                           timeout: Optional[float] = None) -> List[t.KeepPlan]:
        """The keep-plans of several prefilled sequences of one model in one ComputeKeepPlans
        call, in order; each equals what compute_keep_plan returns for it (but for timing).

        Args:
            model_id: from register_model; every sequence uses it.
            sequences: each a laprox.SequenceInputs or a mapping of compute_keep_plan's
                arguments ({"keys": ..., "values": ..., "window_queries": ...,
                "budget": 128, "window": 16}); each has its own n, policy, budget, outputs and
                block tables. At least 1, at most ServerLimits.max_batch_sequences.
            timeout: this call's deadline in seconds, staging the inputs included (default:
                the client's); laprox.client.plan_deadline(total n) suits an engine's path.

        The host arrays of every sequence go through the staging region together (one copy
        each). All or nothing: the first failing sequence fails the call with LaproxError,
        its message naming it ("sequences[1]: ..." here, "sequences[1].layers[0].keys ..."
        from laproxd).
        """
        staging = _Staging()
        request = pb.ComputeKeepPlansRequest()
        outs = []
        for i, sequence in enumerate(sequences):
            try:
                outs.append(_fill_keep_plan_request(request.sequences.add(), model_id,
                                                    t.SequenceInputs.of(sequence), staging))
            except LaproxError as e:  # the same class (a ValueError stays one), prefixed
                raise type(e)(e.code, f"sequences[{i}]: {e.message}") from None
        raw = self._stage_and_call(staging, self._compute_batch_raw, request, timeout)
        plans = _packed_chunks(raw, (1,)).get(1, [])  # ComputeKeepPlansResponse.plans
        if len(plans) != len(outs):
            raise LaproxError(grpc.StatusCode.INTERNAL, f"laproxd answered {len(plans)} plans "
                              f"for {len(outs)} sequences")
        return [_decode_plan(plan, out) for plan, out in zip(plans, outs)]

    # --- helpers ----------------------------------------------------------------------------

    def _stage_and_call(self, staging: _Staging, method: Any, request: Any,
                        timeout: Optional[float]) -> bytes:
        """Shares the call's CUDA tensors, copies its host arrays into the staging region (or
        inline), points their TensorRefs at them and calls `method`; the raw response. The
        region calls this makes (growing the staging region) count against `timeout`."""
        with self._lock, self._call_timeout.within(timeout) as left:
            self._check_open()
            self._share_cuda(staging)
            if staging.arrays and staging.nbytes > self.inline_max_bytes:
                offsets, need = _shm.layout(staging.arrays)
                self._arena.ensure(need)
                buffer = self._arena.buffer
                try:
                    for a, offset in zip(staging.arrays, offsets):
                        _shm.copy_into(buffer, offset, a)
                finally:
                    del buffer
                self._point_at(staging, self._arena.region_id, offsets)
            else:
                self._inline(staging)
            return self._rpc(method, request, left())

    def _share_cuda(self, staging: _Staging) -> None:
        if not staging.cuda:
            return
        _cuda.synchronize({tensor.device.index for tensor, _, _ in staging.cuda})
        for tensor, message, paged_offset in staging.cuda:
            ref = self._cuda.reference(tensor)
            if paged_offset is None:
                _fill_region_ref(message, ref)
            else:  # a pool: the slice starts at the paged tensor's element 0
                message.region.region_id = ref.region_id
                message.region.byte_offset = \
                    ref.byte_offset + paged_offset * tensor.element_size()

    @staticmethod
    def _point_at(staging: _Staging, region_id: int, offsets: Sequence[int]) -> None:
        for message, offset in zip(staging.targets, offsets):
            message.region.region_id = region_id
            message.region.byte_offset = offset

    @staticmethod
    def _inline(staging: _Staging) -> None:
        for a, message in zip(staging.arrays, staging.targets):
            message.inline_bytes = np.ascontiguousarray(a.array, dtype=a.staged).tobytes()


def _decode_plan(raw: Union[bytes, memoryview], outputs: t.Outputs) -> t.KeepPlan:
    """A KeepPlan from the serialized ComputeKeepMaskResponse (with the `outputs` requested;
    for a batch, a view of one plan inside the ComputeKeepPlansResponse bytes). Positions and
    scores are read straight from the packed bytes (sfixed32 / float), not element by
    element."""
    r = pb.ComputeKeepMaskResponse.FromString(raw)
    L, Hkv, n = r.num_layers, r.num_kv_heads, r.n
    chunks = _packed_chunks(raw, (6, 8))
    positions = _repeated(chunks, 6, r.positions, "<i4") if outputs.positions else None
    scores = _repeated(chunks, 8, r.scores, "<f4") if outputs.scores else None
    bitmask = None
    if outputs.bitmask:
        bitmask = np.frombuffer(r.bitmask, dtype=np.uint8).reshape(L, Hkv, (n + 7) // 8)
    timing = r.timing
    return t.KeepPlan(
        num_layers=L, num_kv_heads=Hkv, n=n,
        counts=np.array(r.counts, dtype=np.int32).reshape(L, Hkv),
        offsets=np.array(r.offsets, dtype=np.int64),
        positions=positions,
        bitmask=bitmask,
        scores=None if scores is None else scores.reshape(L, Hkv, n),
        layer_sums=np.array(r.layer_sums, dtype=np.float64),
        window=r.window, sinks=r.sinks, quota=r.quota, selected_total=r.selected_total,
        tokens_per_head=r.tokens_per_head,
        effective_policy=policy_from_proto(r.effective_policy),
        timing=t.Timing(timing.queue_seconds, timing.validate_seconds, timing.score_seconds,
                        timing.select_seconds, timing.respond_seconds, timing.total_seconds),
        blocks=_decode_blocks(r) if r.HasField("blocks") else None)


def _decode_blocks(r: Any) -> t.BlockPlan:
    b = r.blocks
    paged = len(b.freed_offsets) > 0
    units = max(len(b.offsets) - 1, 0)
    return t.BlockPlan(
        block_size=b.block_size, num_blocks=b.num_blocks,
        offsets=np.array(b.offsets, dtype=np.int64),
        kept_blocks=np.array(b.kept_blocks, dtype=np.int32),
        block_scores=(np.array(b.block_scores, dtype=np.float64).reshape(units, b.num_blocks)
                      if len(b.block_scores) else None),
        new_block_table=np.array(b.new_block_table, dtype=np.int32) if paged else None,
        freed_block_ids=np.array(b.freed_block_ids, dtype=np.int32) if paged else None,
        freed_offsets=np.array(b.freed_offsets, dtype=np.int64) if paged else None)
