"""laprox's KV connector: what the plugin does through vLLM's own KV connector API.

vLLM loads it when the engine is started with (`laprox.vllm.KV_TRANSFER_CONFIG`)

    --kv-transfer-config '{"kv_connector": "LaproxConnector",
                           "kv_connector_module_path": "laprox.vllm.connector",
                           "kv_role": "kv_producer"}'

or `LLM(..., kv_transfer_config=laprox.vllm.KV_TRANSFER_CONFIG)`, and makes one in the scheduler's
process (role SCHEDULER) and one in each worker (role WORKER). Through it, and not through
patched internals:
  worker     get_mem_pool_context: the KV cache's one backing buffer is made in a POSIX
             shared-memory object of the plugin's (laproxd reads it in place);
             register_kv_caches: the layers the plugin plans (the one full-attention KV cache
             group: _runner._plan_group), the model's geometry, and the start of the thread that
             registers the pool and the model with laproxd;
             handle_preemptions (the first call of every step, before vLLM updates its batch):
             the scheduler's Channel of this step (generations, compaction orders);
             wait_for_save (once per step, after the forward): the plan calls of the sequences
             whose prefill completed and the decode re-plans (_runner.after_forward);
             build_connector_worker_meta (right after): the requests ready for compaction, to the
             scheduler (Ready);
  scheduler  __init__: the scheduler's counters named and attached;
             build_connector_meta (inside schedule(), once its output is made): the
             generations of the requests scheduled from their first position (the fence), what
             a preemption leaves of the plugin's state dropped, and the compaction orders;
             update_connector_output (inside update_from_output): the worker's Ready reports;
             request_finished_all_groups: what a finished or aborted request leaves dropped.
The connector declares SupportsHMA: without it vLLM turns its hybrid KV cache manager off, and a
hybrid model's sliding-window layers would share the full layers' blocks. It moves no KV
anywhere (get_num_new_matched_tokens: none; the load and save hooks do nothing) and never
delays a request's end (request_finished: False). What no seam covers is still wrapped
(_runner.install, _compact.install_scheduler_hooks; DESIGN.md section 11 lists each symbol)."""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)

from . import _compact
from ._state import STATE


@dataclass
class Channel(KVConnectorMetadata):
    """Scheduler -> worker, on each step's SchedulerOutput: the generations begun since the
    last step (the fence) and the compaction orders decided."""
    generations: Dict[str, int] = field(default_factory=dict)
    orders: Dict[str, _compact.Order] = field(default_factory=dict)


@dataclass
class Reports(KVConnectorWorkerMetadata):
    """Worker -> scheduler, on each step's KVConnectorOutput: the requests ready for
    compaction."""
    ready: Dict[str, _compact.Ready] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "Reports":
        # One worker per engine on the CPU backend; several would each report their own.
        self.ready.update(getattr(other, "ready", {}))
        return self


class LaproxConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        STATE.connector_configured = True
        if STATE.config is None:  # LAPROX_VLLM_TARGET unset: the plugin is off
            return
        # The counters of this process (the scheduler's may be a process of its own).
        STATE.name_model(str(vllm_config.model_config.served_model_name))
        STATE.model_path = vllm_config.model_config.model

    # --- worker -----------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        return None if STATE.config is None else _SharedZeros()

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if STATE.config is None:
            return
        from ._connect import _start_connector
        from ._runner import _plan_group

        if getattr(self._vllm_config, "use_v2_model_runner", False):
            # The plugin's other hooks are the V1 model runner's (_runner.install).
            STATE.warn("vLLM runs its V2 model runner (Triton importable, or "
                       "VLLM_USE_V2_MODEL_RUNNER=1), whose steps the plugin does not hook")
            return
        try:
            _plan_group(self._vllm_config, self._kv_cache_config)
        except ValueError as e:
            STATE.warn(f"this model's KV cache is not one laprox.vllm compresses ({e})")
            return
        _start_connector()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        STATE.channel = kv_connector_metadata if isinstance(kv_connector_metadata, Channel) \
            else Channel()

    def wait_for_save(self) -> None:
        if STATE.config is not None:
            from ._runner import after_forward

            after_forward()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        if not STATE.ready:
            return None
        reports, STATE.ready = Reports(STATE.ready), {}
        return reports

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # it hands no KV off

    # --- scheduler --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        channel = Channel()
        if STATE.config is None:
            return channel
        sched = _compact.SCHED
        for req_id in scheduler_output.preempted_req_ids or ():
            _compact.ended(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            sched.begin(new.req_id)
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids or ():
            sched.begin(req_id)
        channel.generations, sched.announced = sched.announced, {}
        channel.orders, sched.pending = sched.pending, {}
        return channel

    def update_connector_output(self, connector_output: Any) -> None:
        reports = connector_output.kv_connector_worker_meta
        if isinstance(reports, Reports):
            _compact.SCHED.arrived.update(reports.ready)

    def request_finished(self, request: Any, block_ids: Any) -> Tuple[bool, Optional[dict]]:
        if STATE.config is not None:
            _compact.ended(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Any) -> Tuple[bool, Optional[dict]]:
        return self.request_finished(request, block_ids)


class _SharedZeros(torch.overrides.TorchFunctionMode):
    """Around the KV cache's allocation: its one backing buffer, torch.zeros(size, dtype=int8),
    is made in a POSIX shared-memory object of the plugin's instead (STATE.segment), which
    laproxd can read once it is registered (_connect._Connector)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        from laprox import _shm

        kwargs = kwargs or {}
        if (func is torch.zeros and len(args) == 1 and isinstance(args[0], int)
                and kwargs.get("dtype") is torch.int8 and STATE.segment is None):
            try:
                STATE.segment = _shm._Segment(args[0])
            except Exception as e:  # /dev/shm too small: a private buffer as usual
                STATE.warn(f"cannot place the KV cache in shared memory ({e})")
            else:
                atexit.register(STATE.segment.release)
                buffer = torch.frombuffer(STATE.segment.shm.buf, dtype=torch.int8)
                STATE.pool_base = buffer.data_ptr()
                return buffer
        return func(*args, **kwargs)
