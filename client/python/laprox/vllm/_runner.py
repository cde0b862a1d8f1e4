"""The hooks of laprox.vllm in vLLM 0.32's model runner and CPU attention backend.

Five functions are wrapped, each calling the original and adding only what the plugin needs:
  vllm.v1.worker.gpu_model_runner.allocate_kv_cache   the one backing buffer of every layer's
      KV cache is a POSIX shared-memory object of the plugin's (registered by _Connector);
  CPUModelRunner.load_model                           notes the model's geometry and path;
  GPUModelRunner._prepare_inputs                      notes which batch rows are prefill and
      which decode under a plan;
  CPUAttentionBackendImpl.forward                     captures the last w prompt queries, and
      recomputes the decode rows of compressed sequences with the evicted entries masked;
  GPUModelRunner.execute_model                        after the forward, one ComputeKeepPlans
      call for every sequence whose prefill completed in this step.
A failure of laproxd (down, restarted, stopped, refusing a request) never stops the engine: the
sequence goes on with its full cache, the failure is counted and logged at most once per
LOG_INTERVAL seconds, and the registrations are made again when laproxd answers.

No step waits on laproxd longer than a plan's deadline (Config.deadline, scaled by
laprox.client.plan_deadline), nor on the disk: connecting, registering the KV pool and the model
(whose o_proj weights are read from the checkpoint's files) happen on a thread of the plugin's
own (_Connector); while they are not done, sequences go uncompressed (counted: not_ready).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..client import PLAN_DEADLINE_S, plan_deadline
from .._attention import masked_attention
from ..types import model_name
from . import _compact, _metrics

logger = logging.getLogger("laprox.vllm")

LOG_INTERVAL = 60.0  # seconds between two warnings about laproxd
RETRY_INTERVAL = 10.0  # seconds between two attempts to register with laproxd
PROBE_INTERVAL = 1.0  # seconds between two checks of a laproxd that let a plan call time out
REGISTER_DEADLINE_S = 30.0  # default deadline of a registration call (Config.register_deadline)
MAX_PLANS = 1024  # plans kept for plans(), newest last
# The compacting plugin's cap on a layer's share of the model-wide selection
# (Policy.max_layer_share): bench/quality/LAYERSHARE.md and LAYERCAP.md (SmolLM2-135M, 4K
# tokens) found the longest layer at up to 1.9x the mean uncapped, 1.23x at 1.25, and no
# significant quality cost against the uncapped LAYER_UNIFORM plan.
COMPACT_LAYER_SHARE = 1.25
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Config:
    """The plugin's settings (module docstring of laprox.vllm)."""
    target: str
    budget: Any = 128
    policy: Dict[str, Any] = field(default_factory=dict)
    window: int = 32
    model_name: str = ""
    # Seconds a step waits for its plans: the deadline of a ComputeKeepPlans call is
    # plan_deadline(prompt tokens of the call, deadline).
    deadline: float = PLAN_DEADLINE_S
    # Seconds for each registration call (made off the steps), and the longest the engine's
    # start-up waits for the first registration.
    register_deadline: float = REGISTER_DEADLINE_S
    # "compact": a planned sequence's evicted entries leave the cache and its blocks go back to
    # vLLM (LAYER_UNIFORM plans; _compact); "mask": they stay and decode leaves them out.
    mode: str = "compact"

    @property
    def compacts(self) -> bool:
        return self.mode == "compact"

    @property
    def layer_uniform(self) -> bool:
        shape = str(self.plan_policy().get("plan_shape", "")).lower()
        return shape in ("layer_uniform", "plan_shape_layer_uniform")

    def plan_policy(self) -> Dict[str, Any]:
        """The policy options sent: compaction applies LAYER_UNIFORM plans, and no layer keeps
        more than COMPACT_LAYER_SHARE times the mean layer (the engine holds blocks for the
        longest layer); an option set to null in LAPROX_VLLM_POLICY is left unset."""
        policy = dict(self.policy)
        if self.compacts:
            policy = {"plan_shape": "layer_uniform", "max_layer_share": COMPACT_LAYER_SHARE,
                      **policy}
        return {key: value for key, value in policy.items() if value is not None}

    @staticmethod
    def from_env() -> "Config":
        budget_text = os.environ.get("LAPROX_VLLM_BUDGET", "128")
        budget = float(budget_text) if "." in budget_text else int(budget_text)
        policy = json.loads(os.environ.get("LAPROX_VLLM_POLICY", "{}"))
        if not isinstance(policy, dict):
            raise ValueError("LAPROX_VLLM_POLICY must be a JSON object of policy options")
        mode = os.environ.get("LAPROX_VLLM_MODE", "compact")
        if mode not in ("compact", "mask"):
            raise ValueError(f"LAPROX_VLLM_MODE must be compact or mask, not {mode!r}")
        shape = str(policy.get("plan_shape", "layer_uniform")).lower()
        if mode == "compact" and shape not in ("layer_uniform", "plan_shape_layer_uniform"):
            logger.warning("laprox: LAPROX_VLLM_POLICY asks for plan_shape %s; compaction "
                           "applies layer_uniform plans only, so the plugin masks instead",
                           policy["plan_shape"])
            mode = "mask"
        return Config(target=os.environ["LAPROX_VLLM_TARGET"], budget=budget, policy=policy,
                      mode=mode,
                      window=int(os.environ.get("LAPROX_VLLM_WINDOW", "32")),
                      model_name=os.environ.get("LAPROX_VLLM_MODEL", ""),
                      deadline=_seconds("LAPROX_VLLM_DEADLINE_SECONDS", PLAN_DEADLINE_S),
                      register_deadline=_seconds("LAPROX_VLLM_REGISTER_DEADLINE_SECONDS",
                                                 REGISTER_DEADLINE_S))


def _seconds(variable: str, default: float) -> float:
    seconds = float(os.environ.get(variable, default))
    if not seconds > 0:
        raise ValueError(f"{variable} must be a number of seconds > 0, not {seconds}")
    return seconds


@dataclass(frozen=True)
class _Link:
    """A client of laproxd through which the KV pool and the model are registered."""
    client: Any
    region_id: int
    model_id: int


@dataclass
class _Prefill:
    """A sequence being prefilled: its window queries so far and where it lies."""
    prompt_len: int
    queries: np.ndarray                   # [L, H, w, d] float32, rows of the last w positions
    block_ids: Optional[np.ndarray] = None
    computed: int = 0                     # positions in the cache after the last prefill step


@dataclass
class _Compressed:
    """A sequence decoding under its plan: kept[l] [Hkv, prompt_len] says which prompt
    entries take part in attention; the kept keys and values of each layer are gathered from
    the cache once, at the first decode step that needs them ([Hkv, c, d], heads padded to the
    largest count c, `valid` [Hkv, c] marking real entries)."""
    prompt_len: int
    kept: np.ndarray
    block_ids: np.ndarray
    layers: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)


class _State:
    def __init__(self) -> None:
        self.config: Optional[Config] = None
        self.segment: Any = None              # the shared-memory object behind the KV cache
        self.pool_base: int = 0               # its data pointer
        # Set by the connector thread once the pool and the model are registered; the steps
        # only read it, and drop it (connector.give_back) when a call fails.
        self.link: Optional[_Link] = None
        self.connector: Optional["_Connector"] = None
        self.model_name = ""
        self.model_path = ""
        self.geometry: Any = None
        # This step's prefill rows: batch index -> (request id, first position, count).
        self.step: Dict[int, Tuple[str, int, int]] = {}
        self.prefills: Dict[str, _Prefill] = {}
        # Sequences decoding under a plan, and this step's decode rows of them: batch index ->
        # (request id, first position, count).
        self.compressed: Dict[str, "_Compressed"] = {}
        self.decode_rows: Dict[int, Tuple[str, int, int]] = {}
        # Compaction (_compact): plans waiting for the scheduler's order, the requests reported
        # ready on the next ModelRunnerOutput, the compacted requests, and this step's rows of
        # them.
        self.pending: Dict[str, _compact.Pending] = {}
        self.ready: Dict[str, _compact.Ready] = {}
        self.compacted: Dict[str, _compact.Compacted] = {}
        self.shift: Optional[_compact.Shift] = None
        self.plans: "OrderedDict[str, Any]" = OrderedDict()  # the last MAX_PLANS requests
        self.metrics = _metrics.Metrics()
        # Seconds of this step's capture and masked decode, observed at its end (_execute_model).
        self.step_seconds: Dict[str, float] = {"capture": 0.0, "apply": 0.0}
        self.last_warning = 0.0
        self.warning_lock = threading.Lock()  # the steps and the connector thread warn

    def warn(self, message: str, sequences: int = 1) -> None:
        """Counts `sequences` sequences that keep their full cache (or a failed set-up step: 1;
        a failed registration: 0, its sequences are counted when they miss their plan) and
        logs the message at most once per LOG_INTERVAL. Only the engine's thread counts (the
        connector thread passes 0): the counters are not atomic."""
        if sequences:
            self.metrics.failures += sequences
        with self.warning_lock:
            now = time.monotonic()
            if now - self.last_warning < LOG_INTERVAL:
                return
            self.last_warning = now
        logger.warning("laprox: %s; the sequence keeps its full KV cache (failures so far: "
                       "%d)", message, self.metrics.failures)


STATE = _State()


def _wire_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]


# The codes after which the registrations may be gone (laproxd restarted, or reclaimed them):
# the client (its channel and staging region too) is replaced and everything registered again.
_RECONNECT_CODES = ("NOT_FOUND", "UNAVAILABLE", "FAILED_PRECONDITION")


def _code(error: BaseException) -> str:
    return getattr(getattr(error, "code", None), "name", "")


def _close(client: Any, link: Optional["_Link"] = None) -> None:
    """Closes `client`, after unregistering `link`'s model and region (laproxd may still hold
    them); best effort on a server that may be gone, each call within the client's timeout
    (Config.deadline)."""
    calls = [] if link is None else [(client.unregister_model, link.model_id),
                                     (client.unregister_region, link.region_id)]
    for call, argument in calls:
        try:
            call(argument)
        except Exception as e:  # noqa: BLE001
            if _code(e) in ("DEADLINE_EXCEEDED", "UNAVAILABLE"):
                break
    try:
        client.close()
    except Exception:  # noqa: BLE001
        pass


class _Connector:
    """Registers the KV pool and the model with laproxd on a thread of its own, so that no
    engine step waits on laproxd, nor on the disk (o_proj is read from the checkpoint), and
    publishes the result as STATE.link; a step that finds no link lets its sequences go
    uncompressed (counted: not_ready). Every call has a deadline: the registrations
    Config.register_deadline, the other calls of the link's client Config.deadline.

    A step whose plan call fails hands the link back (give_back):
      - after a timeout (laproxd stopped or overloaded) the thread asks laproxd's health
        every PROBE_INTERVAL and publishes the same link again once it answers;
      - after a code of _RECONNECT_CODES (laproxd restarted, or reclaimed the registrations)
        it closes that client and registers everything again through a new one;
    while registering fails it tries again every RETRY_INTERVAL (and warns, rate-limited)."""

    def __init__(self) -> None:
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._returned: List[Tuple[_Link, bool]] = []  # (link, stale), from give_back
        self._thread: Optional[threading.Thread] = None
        self.attempted = threading.Event()  # set after the first registration attempt

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="laprox-connect",
                                            daemon=True)
            self._thread.start()

    def give_back(self, link: _Link, stale: bool) -> None:
        """From a step that dropped STATE.link: `link`'s call timed out (stale False: checked,
        then published again) or its registrations may be gone (stale True: replaced)."""
        with self._lock:
            self._returned.append((link, stale))
        self._wake.set()

    def _run(self) -> None:
        checking: Optional[_Link] = None  # a link whose plan call timed out
        while True:
            self._wake.clear()
            with self._lock:
                returned, self._returned = self._returned, []
            for link, stale in returned:
                if stale:
                    _close(link.client, link)
                else:
                    checking = link
            delay = None  # wait for give_back
            if STATE.link is None and checking is not None:
                answered = self._check(checking)
                if answered:
                    STATE.link, checking = checking, None
                elif answered is None:
                    delay = PROBE_INTERVAL
                else:
                    _close(checking.client, checking)
                    checking = None
            if STATE.link is None and checking is None:
                try:
                    STATE.link = _register()
                except Exception as e:  # noqa: BLE001 - the engine goes on uncompressed
                    STATE.warn(f"cannot register the KV pool and the model with laproxd ({e})",
                               0)
                    delay = RETRY_INTERVAL
            self.attempted.set()
            self._wake.wait(delay)

    @staticmethod
    def _check(link: _Link) -> Optional[bool]:
        """True when laproxd answers its health check (SERVING), None when it still does not
        answer in time (or is not serving), False when the call fails otherwise."""
        try:
            return True if link.client.health() else None
        except Exception as e:  # noqa: BLE001
            return None if _code(e) == "DEADLINE_EXCEEDED" else False


def _register() -> _Link:
    """A new client with the KV pool and the model registered (the connector thread)."""
    import laprox

    config = STATE.config
    client = laprox.Client(config.target, timeout=config.deadline)
    try:
        region_id = client.register_shm_region(STATE.segment.name, STATE.segment.size,
                                               timeout=config.register_deadline)
        # Read only once laproxd answered: a laproxd that is down costs no disk reads.
        o_proj = _o_proj(STATE.model_path, STATE.geometry.num_layers)
        model_id = client.register_model(STATE.model_name, STATE.geometry, o_proj,
                                         timeout=config.register_deadline)
    except BaseException:
        _close(client)
        raise
    return _Link(client, region_id, model_id)


def _start_connector() -> None:
    """Starts the connector thread once the KV pool and the geometry are known, and waits
    for its first attempt at most Config.register_deadline (the engine is starting up: no
    step runs yet), so that the first requests find the registrations made."""
    if STATE.connector is not None or STATE.segment is None or STATE.geometry is None:
        return
    STATE.connector = _Connector()
    STATE.connector.start()
    if not STATE.connector.attempted.wait(STATE.config.register_deadline):
        STATE.warn(f"laproxd did not take the registrations within "
                   f"{STATE.config.register_deadline:g} s; the engine starts without them and "
                   f"compresses once they are made", 0)


def _allocate_kv_cache(original: Any) -> Any:
    """allocate_kv_cache with its backing buffer in a POSIX shared-memory object of ours, which
    laproxd can read once it is registered (_Connector)."""

    def allocate(kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes=None):
        from torch.overrides import TorchFunctionMode

        from laprox import _shm

        class SharedZeros(TorchFunctionMode):
            # The buffer is torch.zeros(size, dtype=int8): made in the shared object instead.
            def __torch_function__(self, func, types, args=(), kwargs=None):
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

        with SharedZeros():
            caches = original(kv_cache_config, device, layout, kernel_block_sizes)
        _start_connector()
        return caches

    return allocate


def _o_proj(model_path: str, num_layers: int) -> List[np.ndarray]:
    """Each layer's o_proj.weight [D, H * d] as fp32, read from the checkpoint's safetensors
    (vLLM's CPU backend may repack the loaded weight for its GEMM and drop the original)."""
    import glob

    from safetensors import safe_open

    if not os.path.isdir(model_path):
        from huggingface_hub import snapshot_download

        model_path = snapshot_download(model_path, allow_patterns=["*.safetensors"])
    found: Dict[int, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                match = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", name)
                if match:
                    found[int(match.group(1))] = f.get_tensor(name).float().numpy()
    missing = sorted(set(range(num_layers)) - set(found))
    if missing:
        raise ValueError(f"no o_proj.weight of layers {missing} in {model_path}")
    return [found[l] for l in range(num_layers)]


def _geometry(runner: Any) -> Any:
    import laprox

    layers = runner.model.model.layers
    attn = layers[0].self_attn
    return laprox.ModelGeometry(num_layers=len(layers), num_heads=attn.num_heads,
                                num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                                hidden_size=runner.model_config.get_hidden_size(),
                                softmax_scale=float(attn.scaling))


def _load_model(original: Any) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            STATE.geometry = _geometry(self)
        except Exception as e:
            STATE.warn(f"the model is not one laprox.vllm knows ({e})")
        name = STATE.config.model_name or str(self.model_config.served_model_name)
        STATE.model_name = model_name(name)
        STATE.model_path = self.model_config.model
        STATE.metrics = _metrics.attach(STATE.metrics, STATE.model_name)
        return result

    return load_model


def _prepare_inputs(original: Any) -> Any:
    def prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = original(self, scheduler_output, num_scheduled_tokens)
        STATE.step = {}
        STATE.decode_rows = {}
        STATE.shift = None
        if STATE.geometry is None or STATE.segment is None:
            return result
        try:
            _note_rows(self.input_batch, num_scheduled_tokens)
        except Exception as e:  # never the engine's failure: this step runs uncompressed
            STATE.warn(f"reading the batch failed ({e!r})", len(STATE.compressed))
            STATE.step, STATE.decode_rows = {}, {}
            STATE.prefills.clear()
            STATE.compressed.clear()
        # Compacted requests cannot go back: their positions are no longer their slots.
        STATE.shift = _shift(self.input_batch, num_scheduled_tokens)
        return result

    return prepare_inputs


def _note_rows(batch: Any, num_scheduled_tokens: np.ndarray) -> None:
    """STATE.step and STATE.decode_rows of this step's batch (prepare_inputs)."""
    # Prefills no longer in the batch (finished, aborted, preempted, or not scheduled in this
    # step) lose their captures; planned requests are forgotten when they end (_update_states).
    for req_id in set(STATE.prefills) - set(batch.req_ids):
        del STATE.prefills[req_id]
    for i, req_id in enumerate(batch.req_ids):
        if req_id in STATE.compacted:
            continue
        start = int(batch.num_computed_tokens_cpu[i])
        prompt_len = int(batch.num_prompt_tokens[i])
        if start >= prompt_len:
            if req_id in STATE.compressed and num_scheduled_tokens[i] > 0:
                STATE.decode_rows[i] = (req_id, start, int(num_scheduled_tokens[i]))
            continue
        w = min(STATE.config.window, prompt_len)
        if req_id not in STATE.prefills:
            if start > prompt_len - w:
                # A prefix-cache hit covers window positions whose queries were never
                # computed: no plan for this sequence (counted).
                STATE.metrics.not_captured += 1
                continue
            g = STATE.geometry
            STATE.prefills[req_id] = _Prefill(prompt_len, np.zeros(
                (g.num_layers, g.num_heads, w, g.head_dim), np.float32))
        STATE.step[i] = (req_id, start, int(num_scheduled_tokens[i]))
        STATE.metrics.prefill_steps += 1


def _shift(batch: Any, num_scheduled_tokens: np.ndarray) -> Optional[_compact.Shift]:
    """This step's slots and lengths of the compacted requests' rows (_compact.shift)."""
    if not STATE.compacted:
        return None
    rows = []
    for i, req_id in enumerate(batch.req_ids):
        compacted = STATE.compacted.get(req_id)
        if compacted is not None and num_scheduled_tokens[i] > 0:
            rows.append((i, int(batch.num_computed_tokens_cpu[i]), int(num_scheduled_tokens[i]),
                         compacted.drops))
    table = batch.block_table.block_tables[0]
    starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)])
    return _compact.shift(rows, starts, table.block_table.np, table.block_size,
                          STATE.geometry.num_layers, len(batch.req_ids))


def _update_states(original: Any) -> Any:
    """After vLLM's update of the batch: forgets requests that ended or restart, and carries
    out the scheduler's compaction orders (_compact.move) before anything of the step is
    written."""

    def update_states(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        ended = set(scheduler_output.finished_req_ids)
        ended |= set(scheduler_output.preempted_req_ids or ())
        ended |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
        for req_id in ended:
            for table in (STATE.compressed, STATE.pending, STATE.ready, STATE.compacted):
                table.pop(req_id, None)
        for req_id, order in (getattr(scheduler_output, "_laprox_compact", None) or {}).items():
            _carry_out(self, req_id, order)
        return result

    return update_states


def _carry_out(runner: Any, req_id: str, order: _compact.Order) -> None:
    pending = STATE.pending.pop(req_id, None)
    state = runner.requests.get(req_id)
    if pending is None or state is None:
        # The scheduler released the blocks after a plan this worker no longer has: that is a
        # bug, and the request's cache is no longer what it reads.
        raise RuntimeError(f"laprox: a compaction order for request {req_id}, which has no "
                           f"pending plan here")
    block_ids = state.block_ids[0]
    context = runner.compilation_config.static_forward_context
    caches = [_cache_views(context[name], context[name].kv_cache) for name in _layer_names(runner)]
    drops = _compact.move(pending, block_ids, order, caches)
    block_ids[:] = list(order.dest) + block_ids[order.sources:]
    row = runner.input_batch.req_id_to_index.get(req_id)
    if row is not None:
        runner.input_batch.block_table.block_tables[0].add_row(block_ids, row)
    STATE.compressed.pop(req_id, None)
    STATE.compacted[req_id] = _compact.Compacted(pending.prompt_len, drops)
    STATE.metrics.compactions += 1
    STATE.metrics.blocks_released += order.released


def _layer_names(runner: Any) -> List[str]:
    context = runner.compilation_config.static_forward_context
    return sorted((name for name in context if _LAYER.search(name)),
                  key=lambda name: int(_LAYER.search(name).group(1)))


def _do_kv_cache_update(original: Any) -> Any:
    """Writes the tokens of compacted requests to their layer's slots (_compact.Shift)."""

    def do_kv_cache_update(self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Any:
        shift = STATE.shift
        if shift is not None:
            slot_mapping = slot_mapping.clone()
            slot_mapping[shift.tokens] = shift.slots[_layer_index(layer)].to(slot_mapping.dtype)
        return original(self, layer, key, value, kv_cache, slot_mapping)

    return do_kv_cache_update


def _shifted(impl: Any, layer: Any, query: torch.Tensor, attn_metadata: Any) -> Any:
    """attn_metadata with this layer's lengths for the compacted rows (and the kernel's work
    split made for them)."""
    import dataclasses

    from vllm import _custom_ops as ops
    from vllm import envs

    shift = STATE.shift
    index = _layer_index(layer)
    seq_lens = attn_metadata.seq_lens.clone()
    seq_lens[:shift.delta.shape[1]] -= shift.delta[index]
    num_reqs = shift.delta.shape[1]
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens, dtype=query.dtype,
        query_start_loc=attn_metadata.query_start_loc, causal=attn_metadata.causal,
        sliding_window_size=impl.sliding_window, isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=attn_metadata.dynamic_causal,
        kv_cache_dtype=impl.kv_cache_dtype)
    return dataclasses.replace(attn_metadata, seq_lens=seq_lens, scheduler_metadata=metadata)


def _forward(original: Any) -> Any:
    def forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shifted = attn_metadata
        if attn_metadata is not None and STATE.shift is not None:
            shifted = _shifted(self, layer, query, attn_metadata)

        def kernel() -> torch.Tensor:
            return original(self, layer, query, key, value, kv_cache, shifted, output,
                            *args, **kwargs)

        if attn_metadata is not None and STATE.step:
            started = time.perf_counter()
            try:
                _capture(layer, query, attn_metadata)
            except Exception as e:  # never the engine's failure: these prefills get no plan
                STATE.warn(f"capturing the window queries failed ({e!r})", len(STATE.step))
                for req_id, _, _ in STATE.step.values():
                    STATE.prefills.pop(req_id, None)
                STATE.step = {}
            STATE.step_seconds["capture"] += time.perf_counter() - started
        if attn_metadata is None or not STATE.decode_rows:
            return kernel()
        # When every row of the step decodes under a plan, _apply writes all of them: the
        # kernel's full attention would only be overwritten.
        all_compressed = (not STATE.step
                          and len(STATE.decode_rows) == len(attn_metadata.seq_lens)
                          and sum(c for _, _, c in STATE.decode_rows.values())
                          == attn_metadata.num_actual_tokens)
        result = output if all_compressed else kernel()
        started = time.perf_counter()
        try:
            _apply(self, layer, query, kv_cache, attn_metadata, output)
        except Exception as e:  # the sequences go on uncompressed, with the kernel's rows
            STATE.warn(f"masked decode attention failed ({e!r})", len(STATE.compressed))
            STATE.compressed.clear()
            STATE.decode_rows = {}
            result = kernel()
        STATE.step_seconds["apply"] += time.perf_counter() - started
        return result

    return forward


def _layer_index(layer: Any) -> int:
    index = getattr(layer, "_laprox_index", None)
    if index is None:
        index = int(_LAYER.search(layer.layer_name).group(1))
        layer._laprox_index = index
    return index


def _capture(layer: Any, query: torch.Tensor, attn_metadata: Any) -> None:
    """Copies the rows of the last w prompt positions of every prefill row of this step."""
    index = _layer_index(layer)
    starts = attn_metadata.query_start_loc
    for i, (req_id, start, count) in STATE.step.items():
        prefill = STATE.prefills[req_id]
        w = prefill.queries.shape[2]
        first = max(start, prefill.prompt_len - w)  # first position to keep
        end = min(start + count, prefill.prompt_len)
        if first < end:
            row = int(starts[i]) + first - start
            rows = query[row:row + end - first].float()  # [rows, H, d]
            slot = first - (prefill.prompt_len - w)
            prefill.queries[index, :, slot:slot + end - first, :] = \
                rows.transpose(0, 1).numpy()
        if index == 0 and end == prefill.prompt_len:
            # The whole row: _paged_layer takes the blocks the prompt covers.
            prefill.block_ids = attn_metadata.block_table[i].numpy().copy()


def _cache_views(layer: Any, kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The keys as [blocks, Hkv, d, block_size] (the "vec" layout) and the values as
    [blocks, Hkv, block_size, d] of one layer's cache."""
    if getattr(layer, "isa", None) != "vec":
        raise ValueError(f"CPU attention kernels \"{getattr(layer, 'isa', None)}\"")
    blocks, heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    halves = kv_cache.view(blocks, heads, 2, block_size * d)
    return (halves[:, :, 0].view(blocks, heads, d, block_size),
            halves[:, :, 1].view(blocks, heads, block_size, d))


def _gather(keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor,
            positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [len(positions), Hkv, d] at a sequence's positions."""
    block_size = keys.shape[3]
    blocks = block_ids[positions // block_size]
    slots = positions % block_size
    return keys[blocks, :, :, slots], values[blocks, :, slots, :]


def _kept_layer(comp: _Compressed, index: int, keys: torch.Tensor, values: torch.Tensor):
    """The kept prompt keys, values [Hkv, c, d] and valid marks [Hkv, c] of layer `index`."""
    cached = comp.layers.get(index)
    if cached is not None:
        return cached
    kept = comp.kept[index]
    heads, count = kept.shape[0], max(int(kept.sum(axis=1).max()), 1)
    d = keys.shape[2]
    k = torch.zeros(heads, count, d, dtype=keys.dtype)
    v = torch.zeros(heads, count, d, dtype=values.dtype)
    valid = torch.zeros(heads, count, dtype=torch.bool)
    block_ids = torch.from_numpy(comp.block_ids.astype(np.int64))
    for h in range(heads):
        positions = torch.from_numpy(np.flatnonzero(kept[h]))
        hk, hv = _gather(keys, values, block_ids, positions)
        k[h, :len(positions)] = hk[:, h]
        v[h, :len(positions)] = hv[:, h]
        valid[h, :len(positions)] = True
    comp.layers[index] = (k, v, valid)
    return comp.layers[index]


def _apply(impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor,
           attn_metadata: Any, output: torch.Tensor) -> None:
    """Recomputes this step's decode rows of compressed sequences with the evicted prompt
    entries left out of the softmax (as laprox.hf does), overwriting the kernel's output."""
    index = _layer_index(layer)
    keys, values = _cache_views(layer, kv_cache)
    starts = attn_metadata.query_start_loc
    heads = query.shape[1]
    for i, (req_id, start, count) in STATE.decode_rows.items():
        comp = STATE.compressed[req_id]
        kept_k, kept_v, valid = _kept_layer(comp, index, keys, values)
        # Tokens after the prompt are always visible, causally among this step's rows.
        new = torch.arange(comp.prompt_len, start + count)
        new_k, new_v = _gather(keys, values, attn_metadata.block_table[i].long(), new)
        k = torch.cat([kept_k, new_k.transpose(0, 1)], dim=1)  # [Hkv, c + m, d]
        v = torch.cat([kept_v, new_v.transpose(0, 1)], dim=1)
        rows = torch.arange(start, start + count)
        mask = torch.cat([valid[:, None, :].expand(-1, count, -1),
                          (new[None, :] <= rows[:, None])[None].expand(k.shape[0], -1, -1)],
                         dim=2)  # [Hkv, count, c + m]
        group = heads // k.shape[0]
        row = int(starts[i])
        q = query[row:row + count].transpose(0, 1).to(k.dtype)  # [H, count, d]
        out = masked_attention(q[None], k[None], v[None],
                               mask.repeat_interleave(group, dim=0)[None], impl.scale)[0]
        target = output[row:row + count]
        target.copy_(out.transpose(0, 1).reshape(target.shape).to(target.dtype))


# How the CPU backend lays out a block's keys, by the ISA of its kernels (Attention.isa):
# key (slot s, dim c) of a head at s * slot + c * dim elements. The "vec" kernels keep each
# head's keys transposed, [d, block_size] (read off the cache against transformers' keys); the
# values are [block_size, d] after them. Other ISAs ("amx" interleaves bf16 pairs) are not a
# strided layout laproxd can read.
_KEY_STRIDES = {"vec": lambda block_size, d: (1, block_size)}


def _paged_layer(layer: Any, region_id: int, block_ids: np.ndarray, n: int):
    """One layer's keys and values as laprox PagedTensors over the shared pool. The CPU
    backend's cache is [blocks, Hkv, block_size, 2d]; cpu_attn.py views a (block, head) as
    2 * block_size rows of d and splits them: the first half holds the keys (in the ISA's
    layout, _KEY_STRIDES), the second the values, row by row."""
    import laprox

    kv_cache = layer.kv_cache
    blocks, heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    s = kv_cache.stride()
    if s[3] != 1 or s[2] != two_d:
        raise ValueError(f"unexpected KV cache strides {tuple(s)} for shape "
                         f"{tuple(kv_cache.shape)}")
    key_strides = _KEY_STRIDES.get(getattr(layer, "isa", None))
    if key_strides is None:
        raise ValueError(f"the CPU attention kernels \"{getattr(layer, 'isa', None)}\" keep keys "
                         f"in a layout laproxd cannot read (supported: {sorted(_KEY_STRIDES)}; "
                         f"a float32 or float16 model uses \"vec\")")
    key_slot, key_dim = key_strides(block_size, d)
    offset = (kv_cache.data_ptr() - STATE.pool_base) // kv_cache.element_size()
    nblocks = -(-n // block_size)
    common = dict(num_kv_heads=heads, head_dim=d, block_stride=s[0], head_stride=s[1],
                  block_size=block_size)
    pool = laprox.RegionTensor(region_id, 0, _wire_dtype(kv_cache.dtype),
                               (STATE.segment.size // kv_cache.element_size(),))
    keys = laprox.PagedKV.tensor(pool, block_ids[:nblocks], n, offset=offset,
                                 slot_stride=key_slot, dim_stride=key_dim, **common)
    values = laprox.PagedKV.tensor(pool, block_ids[:nblocks], n,
                                   offset=offset + block_size * d, slot_stride=d, dim_stride=1,
                                   **common)
    return keys, values


def _execute_model(original: Any) -> Any:
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for stage, seconds in STATE.step_seconds.items():
            if seconds:
                STATE.metrics.observe(stage, seconds)
                STATE.step_seconds[stage] = 0.0
        step, STATE.step = STATE.step, {}
        done = []
        for req_id, start, count in step.values():
            prefill = STATE.prefills.get(req_id)
            if prefill is not None and start + count >= prefill.prompt_len:
                prefill.computed = start + count
                done.append((req_id, STATE.prefills.pop(req_id)))
        if done:
            try:
                _plan(self, done)
            except Exception as e:  # never the engine's failure: no plans this step
                STATE.warn(f"planning failed ({e!r})", len(done))
        return _report_ready(result)

    return execute_model


def _sample_tokens(original: Any) -> Any:
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _report_ready(original(self, *args, **kwargs))

    return sample_tokens


def _report_ready(output: Any) -> Any:
    """Puts the requests ready for compaction on the step's ModelRunnerOutput, which the
    scheduler reads (_compact.install_scheduler_hooks); None (sample_tokens follows) or the
    shared empty output carry nothing."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if STATE.ready and isinstance(output, ModelRunnerOutput) \
            and output is not EMPTY_MODEL_RUNNER_OUTPUT:
        output._laprox_ready, STATE.ready = STATE.ready, {}
    return output


def _plan(runner: Any, done: List[Tuple[str, _Prefill]]) -> None:
    import laprox

    link = STATE.link
    if link is None:
        # Not registered yet, or laproxd is being checked after a timeout (logged there).
        STATE.metrics.failures += len(done)
        STATE.metrics.not_ready += len(done)
        return
    started = time.perf_counter()
    context = runner.compilation_config.static_forward_context
    names = _layer_names(runner)
    sequences = []
    deadline = plan_deadline(sum(prefill.prompt_len for _, prefill in done),
                             STATE.config.deadline)
    try:
        for _, prefill in done:
            keys, values = [], []
            for name in names:
                k, v = _paged_layer(context[name], link.region_id, prefill.block_ids,
                                    prefill.prompt_len)
                keys.append(k)
                values.append(v)
            sequences.append(laprox.SequenceInputs(
                keys, values, list(prefill.queries), budget=STATE.config.budget,
                **STATE.config.plan_policy()))
        plans = link.client.compute_keep_plans(link.model_id, sequences, timeout=deadline)
    except Exception as e:
        code = _code(e)
        if code == "DEADLINE_EXCEEDED":
            # laproxd stopped or overloaded: no step waits on it again until it answers.
            STATE.link = None
            STATE.connector.give_back(link, stale=False)
            STATE.metrics.timeouts += len(done)
            STATE.warn(f"laproxd did not answer within the plan deadline of {deadline:.3g} s "
                       f"(LAPROX_VLLM_DEADLINE_SECONDS); plans resume once it answers", len(done))
        else:
            if code in _RECONNECT_CODES:
                STATE.link = None
                STATE.connector.give_back(link, stale=True)
            STATE.warn(f"ComputeKeepPlans failed ({e})", len(done))
        return
    finally:
        STATE.metrics.observe("call", time.perf_counter() - started)
    for (req_id, prefill), plan in zip(done, plans):
        STATE.plans[req_id] = plan
        STATE.metrics.plans += 1
        masks = plan.to_masks()
        if STATE.config.layer_uniform:
            # Padded to one length per layer in both modes, so that they apply the same sets.
            pending, masks = _compact.note_plan(masks, prefill.prompt_len, prefill.computed)
            if STATE.config.compacts:
                STATE.pending[req_id] = pending
                STATE.ready[req_id] = _compact.ready(pending)
        # Masked until compacted (or for good in mask mode, or when no order comes).
        STATE.compressed[req_id] = _Compressed(prefill.prompt_len, masks, prefill.block_ids)
    while len(STATE.plans) > MAX_PLANS:
        STATE.plans.popitem(last=False)


_INSTALLED = False


def install(config: Config) -> None:
    """Wraps the runner and backend functions once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # The hooks are those of the CPU model runner and attention backend; on another platform
        # they would never run, and the engine would serve uncompressed without a word.
        logger.warning("laprox: laprox.vllm supports vLLM's CPU backend only; this engine runs "
                       "on %s, so the plugin stays off and every sequence keeps its full KV "
                       "cache", type(current_platform).__name__)
        return
    STATE.config = config
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    gpu_model_runner.allocate_kv_cache = _allocate_kv_cache(gpu_model_runner.allocate_kv_cache)
    runner = cpu_model_runner.CPUModelRunner
    runner.load_model = _load_model(runner.load_model)
    base = gpu_model_runner.GPUModelRunner
    base._prepare_inputs = _prepare_inputs(base._prepare_inputs)
    base.execute_model = _execute_model(base.execute_model)
    impl = cpu_attn.CPUAttentionBackendImpl
    impl.forward = _forward(impl.forward)
    if config.compacts:
        base._update_states = _update_states(base._update_states)
        base.sample_tokens = _sample_tokens(base.sample_tokens)
        impl.do_kv_cache_update = _do_kv_cache_update(impl.do_kv_cache_update)
        _compact.install_scheduler_hooks()
