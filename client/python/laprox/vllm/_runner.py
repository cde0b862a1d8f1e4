"""The hooks of laprox.vllm in vLLM 0.32's model runner and CPU attention backend.

What the KV connector API (laprox.vllm.connector) does not cover is wrapped here, each hook
calling the original and adding only what the plugin needs (DESIGN.md section 11 says why no
seam covers it):
  GPUModelRunner._prepare_inputs                      notes which batch rows are prefill and
      which decode under a plan or compacted (their per-layer slots and lengths);
  GPUModelRunner._update_states                       takes the requests' generations from the
      scheduler's Channel and drops what is held of an earlier one (the fence,
      _compact.current), and carries out compaction orders;
  CPUAttentionBackendImpl.forward                     captures the last w prompt queries, and
      recomputes the decode rows of compressed sequences with the evicted entries masked, or
      runs compacted layers with their own lengths;
  CPUAttentionBackendImpl.do_kv_cache_update          (compact mode) writes compacted requests'
      tokens to their layer's slots.
The plan calls run after each step's forward (after_forward, from the connector's
wait_for_save).
A failure of laproxd (down, restarted, stopped, refusing a request) never stops the engine: the
sequence goes on with its full cache, the failure is counted and logged at most once per
LOG_INTERVAL seconds, and the registrations are made again when laproxd answers.

No step waits on laproxd longer than a plan's deadline (Config.deadline, scaled by
laprox.client.plan_deadline), nor on the disk: connecting, registering the KV pool and the model
(whose o_proj weights are read from the checkpoint's files) happen on a thread of the plugin's
own (_Connector); while they are not done, sequences go uncompressed (counted: not_ready).

This file holds the hooks; _state the configuration and what the hooks share, _connect the
connector thread, _decode the capture, the masked decode and the paged views, _compact the
compaction, _metrics the counters.
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ..client import plan_deadline
from . import _compact
from ._connect import _RECONNECT_CODES, _code
# _apply is looked up here at every step (tests/integration/vllm/bad_paths.py replaces it).
from ._decode import _apply, _cache_views, _capture, _layer_index, _paged_layer
from . import KV_TRANSFER_CONFIG
from ._state import _LAYER, MAX_PLANS, STATE, Config, _Compressed, _Prefill, logger  # noqa: F401


def _compacted_group(kv_cache_config: Any) -> Tuple[int, List[str]]:
    """The KV cache group the plugin plans and compacts, and its layers' names in model order:
    the one group of full-attention layers. A hybrid model's other groups (sliding-window
    layers, whose blocks vLLM frees as the window moves on) are left as vLLM keeps them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    full = [g for g, group in enumerate(groups) if type(group.kv_cache_spec) is FullAttentionSpec]
    if any(groups[g].kv_cache_spec.sliding_window is not None for g in full):
        # vLLM's hybrid KV cache manager is off (--disable-hybrid-kv-cache-manager, or a KV
        # connector without hybrid support): sliding-window layers share the full layers'
        # blocks, and their kernel reads positions, not the compacted slots.
        raise ValueError("sliding-window layers are held as full-attention ones: the hybrid KV "
                         "cache manager is off")
    if len(full) != 1:
        raise ValueError(f"{len(full)} groups of full-attention layers "
                         f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}); "
                         f"laprox.vllm compacts one")
    names = sorted(groups[full[0]].layer_names,
                   key=lambda name: int(_LAYER.search(name).group(1)))
    return full[0], names


def _plan_group(vllm_config: Any, kv_cache_config: Any) -> None:
    """The layers the plugin plans, once the KV caches are made (connector.register_kv_caches):
    the full-attention group's (STATE.group, layer_names, layer_ids, planned, context), and
    the geometry registered with laproxd (theirs: the attention layers' own head counts and
    softmax scale). Raises ValueError for a model the plugin does not compress."""
    import laprox

    STATE.group, names = _compacted_group(kv_cache_config)
    context = vllm_config.compilation_config.static_forward_context
    impl = context[names[0]].impl
    STATE.geometry = laprox.ModelGeometry(
        num_layers=len(names), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, hidden_size=vllm_config.model_config.get_hidden_size(),
        softmax_scale=float(impl.scale))
    STATE.context = context
    STATE.layer_names = names
    STATE.layer_ids = [int(_LAYER.search(name).group(1)) for name in names]
    STATE.planned = {name: i for i, name in enumerate(names)}


def _prepare_inputs(original: Any) -> Any:
    def prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = original(self, scheduler_output, num_scheduled_tokens)
        STATE.step = {}
        STATE.decode_rows = {}
        STATE.shift, STATE.shift_rows = None, []
        if STATE.geometry is None or STATE.segment is None:
            if not STATE.connector_configured and not STATE.unconfigured_warned:
                STATE.unconfigured_warned = True
                logger.warning("laprox: LAPROX_VLLM_TARGET is set but the engine has no laprox "
                               "KV connector, so the plugin stays off and every sequence keeps "
                               "its full KV cache; start it with --kv-transfer-config '%s' (or "
                               "LLM(..., kv_transfer_config=laprox.vllm.KV_TRANSFER_CONFIG))",
                               json.dumps(KV_TRANSFER_CONFIG))
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
                (g.num_layers, g.num_heads, w, g.head_dim), np.float32),
                generation=STATE.generations.get(req_id, 0))
        STATE.step[i] = (req_id, start, int(num_scheduled_tokens[i]))
        STATE.metrics.prefill_steps += 1


def _shift(batch: Any, num_scheduled_tokens: np.ndarray) -> Optional[_compact.Shift]:
    """This step's slots and lengths of the compacted requests' rows (_compact.shift)."""
    STATE.shift_rows = []
    if not STATE.compacted:
        return None
    rows = []
    starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)])
    for i, req_id in enumerate(batch.req_ids):
        compacted = STATE.compacted.get(req_id)
        if compacted is not None and num_scheduled_tokens[i] > 0:
            rows.append((i, int(batch.num_computed_tokens_cpu[i]), int(num_scheduled_tokens[i]),
                         compacted.drops))
            STATE.shift_rows.append((req_id, int(starts[i]), int(num_scheduled_tokens[i]),
                                     int(batch.num_computed_tokens_cpu[i])))
    table = batch.block_table.block_tables[STATE.group]
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
        for req_id in ended:
            STATE.generations.pop(req_id, None)
        STATE.runner = self
        # The scheduler's Channel of this step (connector.handle_preemptions took it). The
        # fence: a request scheduled from its first position (new, a reused id, resumed after a
        # preemption) begins a generation, and nothing of an earlier one applies to it.
        channel, STATE.channel = STATE.channel, None
        begun = channel.generations if channel is not None else {}
        STATE.generations.update(begun)
        for req_id in ended | set(begun):
            _forget(req_id)
        orders = channel.orders if channel is not None else {}
        for req_id, order in orders.items():
            _carry_out(self, req_id, order)
        # A re-plan's order comes on the step after its plan or never (the scheduler declined
        # it: the request moved on, or its previous blocks are still held): try again later.
        for req_id, compacted in STATE.compacted.items():
            if compacted.replanning and req_id not in orders and req_id not in STATE.ready:
                STATE.pending.pop(req_id, None)
                compacted.replanning = False
                compacted.retry_at = _retry_position(compacted)
        return result

    return update_states


def _forget(req_id: str) -> None:
    """Drops what the worker holds for `req_id` that is not of its current generation (all of
    it when it has none: ended or preempted); a plan or a capture of another generation is
    counted (fenced)."""
    generation = STATE.generations.get(req_id)
    dropped = False
    for table in (STATE.prefills, STATE.compressed, STATE.pending, STATE.ready,
                  STATE.compacted):
        held = table.get(req_id)
        if held is not None and held.generation != generation:
            del table[req_id]
            dropped = True
    STATE.metrics.fenced += dropped and generation is not None


def _carry_out(runner: Any, req_id: str, order: _compact.Order) -> None:
    pending = STATE.pending.pop(req_id, None)
    state = runner.requests.get(req_id)
    if (pending is None or state is None or order.level > len(pending.larger)
            or pending.generation != order.generation):
        # The scheduler released the blocks after a plan this worker no longer has (or has for
        # another generation of the request): that is a bug, and the request's cache is no
        # longer what it reads.
        raise RuntimeError(f"laprox: a compaction order for request {req_id} (generation "
                           f"{order.generation}), which has no pending plan (at level "
                           f"{order.level}) of that generation here")
    layout = pending.layout + 1
    pending = pending.at(order.level)
    block_ids = state.block_ids[STATE.group]
    context = STATE.context
    caches = [_cache_views(context[name], context[name].kv_cache) for name in STATE.layer_names]
    drops = _compact.move(pending, block_ids, order, caches)
    block_ids[:] = list(order.dest) + block_ids[order.sources:]
    row = runner.input_batch.req_id_to_index.get(req_id)
    if row is not None:
        runner.input_batch.block_table.block_tables[STATE.group].add_row(block_ids, row)
    STATE.compressed.pop(req_id, None)
    before = STATE.compacted.get(req_id)
    compacted = _compact.Compacted(
        pending.prompt_len, drops,
        pending.positions if pending.positions is not None else pending.kept,
        budget=pending.budget or STATE.config.budget, generation=order.generation,
        layout=layout)
    heads = STATE.geometry.num_kv_heads
    if before is not None:  # a re-plan: the decode queries recorded so far stay
        compacted.queries, compacted.filled = before.queries, before.filled
        STATE.metrics.evicted_entries += heads * int(drops.sum() - before.drops.sum())
    else:
        STATE.metrics.compactions += 1
        STATE.metrics.above_floor += order.level > 0
        STATE.metrics.evicted_entries += heads * int(drops.sum())
        STATE.metrics.kept_entries += heads * int((pending.prompt_len - drops).sum())
    STATE.compacted[req_id] = compacted
    STATE.metrics.blocks_released += order.released


def _do_kv_cache_update(original: Any) -> Any:
    """Writes the tokens of compacted requests to their layer's slots (_compact.Shift)."""

    def do_kv_cache_update(self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Any:
        shift = STATE.shift
        index = _layer_index(layer) if shift is not None else None
        if index is not None:
            slot_mapping = slot_mapping.clone()
            slot_mapping[shift.tokens] = shift.slots[index].to(slot_mapping.dtype)
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
        if _layer_index(layer) is None:  # a layer laprox does not plan (sliding-window)
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                            *args, **kwargs)
        shifted = attn_metadata
        if attn_metadata is not None and STATE.shift is not None:
            shifted = _shifted(self, layer, query, attn_metadata)

        def kernel() -> torch.Tensor:
            return original(self, layer, query, key, value, kv_cache, shifted, output,
                            *args, **kwargs)

        if attn_metadata is not None and STATE.shift_rows and STATE.config.decode_buffer:
            try:
                _remember_queries(layer, query)
            except Exception as e:  # never the engine's failure: these requests re-plan later
                STATE.warn(f"recording decode queries failed ({e!r})", 0)
                for req_id, _, _, _ in STATE.shift_rows:
                    STATE.compacted[req_id].filled = 0
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



def after_forward() -> None:
    """After a step's forward (connector.wait_for_save): its stage times observed, one
    ComputeKeepPlans call for every sequence whose prefill completed in it, and the decode
    re-plans that are due; the requests ready for compaction go to the scheduler right after
    (connector.build_connector_worker_meta)."""
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
            _plan(done)
        except Exception as e:  # never the engine's failure: no plans this step
            STATE.warn(f"planning failed ({e!r})", len(done))
    if STATE.config.decode_buffer and STATE.shift_rows:
        try:
            _replan(STATE.runner)
        except Exception as e:  # never the engine's failure: the caches stay as they are
            STATE.warn(f"re-planning failed ({e!r})", 0)


def _ready_link(sequences: int) -> Any:
    """The link to laproxd, or None after counting `sequences` sequences that go without a plan
    (not registered yet, or laproxd being checked after a timeout: logged there)."""
    link = STATE.link
    if link is None:
        STATE.metrics.failures += sequences
        STATE.metrics.not_ready += sequences
    return link


def _call_failed(link: Any, error: Exception, sequences: int) -> str:
    """After a failed plan call of `sequences` sequences: past the deadline (laproxd stopped or
    overloaded) no step waits on laproxd again until it answers; a code that means laproxd lost
    the registrations makes them again. Returns the status code's name."""
    code = _code(error)
    if code == "DEADLINE_EXCEEDED":
        STATE.link = None
        STATE.connector.give_back(link, stale=False)
        STATE.metrics.timeouts += sequences
    elif code in _RECONNECT_CODES:
        STATE.link = None
        STATE.connector.give_back(link, stale=True)
    return code


def _plan(done: List[Tuple[str, _Prefill]]) -> None:
    import laprox

    link = _ready_link(len(done))
    if link is None:
        return
    started = time.perf_counter()
    context = STATE.context
    names = STATE.layer_names
    # One plan per sequence at the budget, and with LAPROX_VLLM_PRESSURE_BUDGETS one at each
    # larger budget that evicts something from its prompt.
    budgets = [[b for i, b in enumerate(STATE.config.budgets) if i == 0 or b < prefill.prompt_len]
               for _, prefill in done]
    sequences = []
    deadline = plan_deadline(sum(prefill.prompt_len * len(b) for (_, prefill), b
                                 in zip(done, budgets)), STATE.config.deadline)
    try:
        for (_, prefill), sequence_budgets in zip(done, budgets):
            keys, values = [], []
            for name in names:
                k, v = _paged_layer(context[name], link.region_id, prefill.block_ids,
                                    prefill.prompt_len)
                keys.append(k)
                values.append(v)
            for budget in sequence_budgets:
                sequences.append(laprox.SequenceInputs(
                    keys, values, list(prefill.queries), budget=budget,
                    **STATE.config.plan_policy()))
        plans = iter(link.client.compute_keep_plans(link.model_id, sequences,
                                                    timeout=deadline))
    except Exception as e:
        if _call_failed(link, e, len(done)) == "DEADLINE_EXCEEDED":
            STATE.warn(f"laproxd did not answer within the plan deadline of {deadline:.3g} s "
                       f"(LAPROX_VLLM_DEADLINE_SECONDS); plans resume once it answers", len(done))
        else:
            STATE.warn(f"ComputeKeepPlans failed ({e})", len(done))
        return
    finally:
        STATE.metrics.observe("call", time.perf_counter() - started)
    for (req_id, prefill), sequence_budgets in zip(done, budgets):
        plan = next(plans)
        larger = [next(plans) for _ in sequence_budgets[1:]]
        STATE.plans[req_id] = plan
        STATE.metrics.plans += 1
        masks = plan.to_masks()
        if STATE.config.layer_uniform:
            # Padded to one length per layer in both modes, so that they apply the same sets.
            pending, masks = _compact.note_plan(masks, prefill.prompt_len, prefill.computed,
                                                sequence_budgets[0])
            pending.generation = prefill.generation
            pending.larger = [_compact.note_plan(p.to_masks(), prefill.prompt_len,
                                                 prefill.computed, b)[0]
                              for p, b in zip(larger, sequence_budgets[1:])]
            if STATE.config.compacts:
                STATE.pending[req_id] = pending
                STATE.ready[req_id] = _compact.ready(pending)
        # Masked until compacted (or for good in mask mode, or when no order comes); with the
        # pressure trigger it decodes with its full cache until compacted.
        if not STATE.config.deferred:
            STATE.compressed[req_id] = _Compressed(prefill.prompt_len, masks, prefill.block_ids,
                                                   generation=prefill.generation)
    while len(STATE.plans) > MAX_PLANS:
        STATE.plans.popitem(last=False)


def _remember_queries(layer: Any, query: torch.Tensor) -> None:
    """Keeps the last w post-RoPE query rows of every compacted request of this step, per
    layer: the window of its next decode re-plan."""
    index = _layer_index(layer)
    g = STATE.geometry
    for req_id, start, count, _ in STATE.shift_rows:
        compacted = STATE.compacted[req_id]
        if compacted.queries is None:
            compacted.queries = np.zeros((g.num_layers, g.num_heads, STATE.config.window,
                                          g.head_dim), np.float32)
        compacted.remember(index, query[start:start + count])
        if index == g.num_layers - 1:
            compacted.filled = min(compacted.filled + count, STATE.config.window)


def _retry_position(compacted: _compact.Compacted) -> int:
    """Where the next re-plan may be tried after one failed or was declined: N / 4 positions
    later, so that a failing laproxd costs a call per N / 4 tokens, not per step."""
    return compacted.computed + max(1, STATE.config.decode_buffer // 4)


def _replan(runner: Any) -> None:
    """Decode re-plans (Config.decode_buffer) of this step's compacted requests whose mean
    entries per head reached budget + N: one ComputeKeepPlans call with each request's cache as
    it holds it (every layer's entries read in place through its blocks, their token positions,
    the last w tokens' queries); each plan is compacted like a prefill's (_compact)."""
    import laprox

    due = []
    for req_id, _, count, position in STATE.shift_rows:
        compacted = STATE.compacted.get(req_id)
        state = runner.requests.get(req_id)
        if compacted is None or state is None:
            continue
        computed = compacted.computed = position + count
        if compacted.replanning or compacted.filled < STATE.config.window:
            continue
        limit = compacted.budget + STATE.config.decode_buffer
        if computed < compacted.retry_at or np.mean(computed - compacted.drops) < limit:
            continue
        due.append((req_id, compacted, computed, np.asarray(state.block_ids[STATE.group])))
    if not due:
        return
    link = _ready_link(len(due))
    if link is None:
        for _, compacted, _, _ in due:
            compacted.retry_at = _retry_position(compacted)
        return
    started = time.perf_counter()
    context = STATE.context
    names = STATE.layer_names
    sequences, positions = [], []
    for _, compacted, computed, block_ids in due:
        cache = compacted.cache_positions(computed)
        keys, values = [], []
        for name, rows in zip(names, cache):
            k, v = _paged_layer(context[name], link.region_id, block_ids, rows.shape[1])
            keys.append(k)
            values.append(v)
        positions.append(cache)
        sequences.append(laprox.SequenceInputs(
            keys, values, list(compacted.queries), budget=compacted.budget,
            cache_positions=cache, **STATE.config.plan_policy()))
    deadline = plan_deadline(sum(int(p[0].shape[1]) for p in positions), STATE.config.deadline)
    try:
        plans = link.client.compute_keep_plans(link.model_id, sequences, timeout=deadline)
    except Exception as e:
        for _, compacted, _, _ in due:
            compacted.retry_at = _retry_position(compacted)
        _call_failed(link, e, len(due))
        STATE.warn(f"a decode re-plan failed ({e}); the caches stay as they are", len(due))
        return
    finally:
        STATE.metrics.observe("call", time.perf_counter() - started)
    for (req_id, compacted, computed, _), cache, plan in zip(due, positions, plans):
        pending = _compact.note_replan(plan, cache, computed, compacted.budget)
        pending.generation, pending.layout = compacted.generation, compacted.layout
        STATE.pending[req_id] = pending
        STATE.ready[req_id] = _compact.ready(pending, replan=True)
        compacted.replanning = True
        STATE.metrics.replans += 1


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
    from vllm.v1.worker import gpu_model_runner

    # What the KV connector API does not cover (laprox.vllm.connector does the rest).
    base = gpu_model_runner.GPUModelRunner
    base._prepare_inputs = _prepare_inputs(base._prepare_inputs)
    # Both modes: the fence (a request's generation begins where the scheduler schedules it
    # from its first position; what the worker holds of an earlier one is dropped).
    base._update_states = _update_states(base._update_states)
    impl = cpu_attn.CPUAttentionBackendImpl
    impl.forward = _forward(impl.forward)
    if config.compacts:
        impl.do_kv_cache_update = _do_kv_cache_update(impl.do_kv_cache_update)
        _compact.install_scheduler_hooks()

