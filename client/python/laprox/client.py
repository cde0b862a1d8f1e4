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

Errors: every failure raises laprox.LaproxError with a grpc.StatusCode (`.code`) and a message
(a mistake found here before sending is also a ValueError or TypeError: errors.py).

The pieces a Client uses: _calls (deadlines, region calls, cleanup), _staging (inputs into
requests), _plans (responses into KeepPlans), _target (the default target), _tls (credentials).
Threads: a Client may be shared; calls that stage host arrays or CUDA regions run one at a time.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _cuda, _shm
from . import types as t
# Re-exported where they were before the split (laprox.client.plan_deadline and the others).
from ._calls import (CHANNEL_OPTIONS, PLAN_DEADLINE_S, PLAN_DEADLINE_TOKENS,  # noqa: F401
                     Timeout, _call, _CallTimeout, _register_cuda, _register_shm, _release,
                     _unregister, plan_deadline)
from ._proto import health_pb2, health_pb2_grpc, laprox_pb2_grpc, pb
from ._staging import (_bf16_flag, _fill_keep_plan_request, _fill_region_ref, _per_layer,
                       _Staging)
from ._target import DEFAULT_TARGET, default_target  # noqa: F401
from ._tls import tls_credentials  # noqa: F401
from ._plans import plan_from_proto
from .errors import LaproxError, invalid_argument
from .paged import PagedTensor


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
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS) \
            if credentials is None else grpc.secure_channel(target, credentials,
                                                            options=CHANNEL_OPTIONS)
        self._stub = laprox_pb2_grpc.LaproxStub(self._channel)
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
        """The regions this caller's identity registered (another identity's are not listed),
        ascending by id."""
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
                          cache_positions: Any = None,
                          **policy_options: Any) -> t.KeepPlan:
        """The keep-plan of one prefilled sequence of n tokens, or a decode re-plan.

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
            cache_positions: a decode re-plan of the cache the engine holds after earlier
                plans (laprox.proto, DecodeCache): per layer the token position of every entry,
                integers [Hkv, n_l], strictly ascending along each head; keys and values are
                then [Hkv, n_l, d] per layer (layers may differ), window_queries those of the
                wq most recent tokens, the last wq entries of every head. The plan's kept()
                are token positions, kept_entries() the indices into the cache sent.
            **policy_options: Policy fields applied on top of `policy`, e.g. window=32,
                kind="snapkv", allocation="per_layer".

        Returns: a KeepPlan. Raises LaproxError.
        """
        seq = t.SequenceInputs(keys, values, window_queries, window_attention, window_lse,
                               policy=policy, budget=budget, outputs=outputs, dtype=dtype,
                               cache_positions=cache_positions, **policy_options)
        staging = _Staging()
        request = pb.ComputeKeepMaskRequest()
        out, cache = _fill_keep_plan_request(request, model_id, seq, staging)
        return plan_from_proto(
            self._stage_and_call(staging, self._stub.ComputeKeepMask, request, timeout), out,
            cache)

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
        plans = self._stage_and_call(staging, self._stub.ComputeKeepPlans, request,
                                     timeout).plans
        if len(plans) != len(outs):
            raise LaproxError(grpc.StatusCode.INTERNAL, f"laproxd answered {len(plans)} plans "
                              f"for {len(outs)} sequences")
        return [plan_from_proto(plan, out, cache) for plan, (out, cache) in zip(plans, outs)]

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

