"""Compaction: a sequence decoding under a plan gives its evicted entries' blocks back to vLLM.

The plan of a sequence (LAYER_UNIFORM: every KV head of layer l keeps C_l prompt entries) is
applied by moving, in every layer, the kept entries of each head to the front of the sequence's
own blocks, slots 0 .. C_l - 1 in position order, followed by the entries after the prompt; the
blocks past the longest layer's length go back to vLLM's pool. From then on position p >= P
(P: the prompt length) of layer l lives in slot p - drop_l, drop_l = P - C_l, while RoPE keeps
counting positions as before; each layer's attention reads seq_len - drop_l slots. DESIGN.md
section 6 gives the reasoning; these are the moving parts, in the order they act:

  worker, step t (the last prefill step)   the plan arrives (_runner._plan); the heads of a
      layer that keep one entry fewer than its longest head are padded with their most recent
      evicted prompt entry (note_plan), the request is reported as ready in the step's KV
      connector output (connector.Reports, Ready: prompt length, longest layer, cache length),
      and decodes masked until compacted;
  scheduler, update_from_output(t)         decide(): the blocks the compacted request keeps
      (its private blocks, ref_cnt 1, the last ones first, so that a shared or reusable prefix
      stays in the prefix cache; fresh blocks when too few are private), their prefix-cache
      hashes evicted, the request's block list cut to them; from now on its allocations count
      drop = P - C_max fewer tokens; the other blocks wait, held, until the move is done;
  scheduler, schedule(t + 1)                the order travels to the worker in the step's
      KV connector metadata (connector.Channel);
  worker, _update_states(t + 1)             apply(): the entries move (before any block of
      this step is written), the worker's block list and block-table row become the kept
      blocks plus those appended this step;
  scheduler, update_from_output(t + 1)      the held blocks return to the pool (or at once when
      the request ends or is preempted first);
  worker, every later step                  shift(): per layer, the slots the step's tokens of
      compacted requests are written to, and the seq_lens the kernel reads (_runner).
Scheduler and worker may run in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or two (the
"mp" executor); vLLM pickles the connector's metadata between them.

With LAPROX_VLLM_TRIGGER=pressure the scheduler decides later (relieve(), when the pool runs
short); with LAPROX_VLLM_PRESSURE_BUDGETS each sequence is also planned at budgets above the
floor, reported as one longest layer per budget (Ready.larger), and the order names the level
the scheduler chose (Order.level; choose()).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger("laprox.vllm")

# Never cache blocks of a compacted request again: its slots no longer hold the positions their
# hashes would name.
_NEVER = 1 << 62


@dataclass(frozen=True)
class Ready:
    """Worker -> scheduler: a planned request whose entries can be compacted."""
    prompt_len: int   # P: positions the plan covers
    longest: int      # C_max: the longest layer's kept prompt entries per head
    computed: int     # N: positions in the cache when planned (>= P after a preemption)
    replan: bool = False  # a decode re-plan of a compacted request (P = N: it covers them all)
    larger: Tuple[int, ...] = ()  # C_max of the plans at LAPROX_VLLM_PRESSURE_BUDGETS
    # The fence (current()): the request's generation the plan was computed for, and the
    # compactions carried out on its cache (in that generation) when the plan read it.
    generation: int = 0
    layout: int = 0

    def longest_at(self, level: int) -> int:
        """C_max of the plan at `level` (0: the budget, i: the i-th larger budget)."""
        return self.longest if level == 0 else self.larger[level - 1]


@dataclass(frozen=True)
class Order:
    """Scheduler -> worker: compact a request into `dest`."""
    sources: int         # blocks of the request's list the kept entries are read from
    dest: Tuple[int, ...]  # the block ids they go to, in slot order
    released: int        # blocks given back to the pool
    computed: int        # positions in the cache when it is carried out (>= Pending.computed
                         # when the compaction was deferred: LAPROX_VLLM_TRIGGER=pressure)
    level: int = 0       # the plan it applies: 0 the budget's, i the i-th larger budget's
    generation: int = 0  # the request's generation it was decided for (Ready.generation)


@dataclass
class Pending:
    """Worker: a plan waiting for its order. kept[l] [Hkv, C_l] are the slots each head of
    layer l keeps (its prompt positions before the first compaction, the entries of a decode
    re-plan), ascending and padded to the layer's longest head; positions[l] their token
    positions (None: kept, the slots are the positions). budget: the budget planned for;
    larger: the same sequence's plans at larger budgets (LAPROX_VLLM_PRESSURE_BUDGETS),
    ascending."""
    prompt_len: int
    computed: int
    kept: List[np.ndarray]
    positions: Optional[List[np.ndarray]] = None
    budget: int = 0
    larger: List["Pending"] = field(default_factory=list)
    generation: int = 0  # the request's generation the plan was computed for
    layout: int = 0      # compactions carried out on the cache the plan read

    def at(self, level: int) -> "Pending":
        return self if level == 0 else self.larger[level - 1]

    @property
    def longest(self) -> int:
        return max(k.shape[1] for k in self.kept)


@dataclass
class Compacted:
    """Worker: a compacted request. drops [L] = P - C_l; positions[l] [Hkv, C_l] the token
    positions of the entries each head of layer l kept, in slots 0 .. C_l - 1 (the tokens from
    P on follow them). With decode re-plans (Config.decode_buffer): the post-RoPE queries of the
    last w decode tokens, [L, H, w, d] oldest first, `filled` of them recorded; the positions
    computed after the last step seen; the position before which no re-plan is tried; whether
    one waits for its order; the budget it was compacted to, which its re-plans keep."""
    prompt_len: int
    drops: np.ndarray
    positions: List[np.ndarray] = field(default_factory=list)
    queries: Optional[np.ndarray] = None
    filled: int = 0
    computed: int = 0  # positions in the cache after the last step seen
    retry_at: int = 0
    replanning: bool = False
    budget: int = 0
    generation: int = 0  # the request's generation
    layout: int = 0      # compactions carried out on its cache in that generation (>= 1)

    def cache_positions(self, computed: int) -> List[np.ndarray]:
        """Every layer's token positions of the entries it holds with `computed` positions."""
        after = np.arange(self.prompt_len, computed, dtype=np.int64)
        return [np.concatenate([p, np.broadcast_to(after, (p.shape[0], after.size))], axis=1)
                for p in self.positions]

    def remember(self, layer: int, rows: torch.Tensor) -> None:
        """Keeps the last w of this layer's decode query rows ([count, H, d])."""
        w = self.queries.shape[2]
        new = rows.float().transpose(0, 1).numpy()[:, -w:]  # [H, <= w, d]
        kept = self.queries[layer]
        kept[:, :w - new.shape[1]] = kept[:, new.shape[1]:].copy()
        kept[:, w - new.shape[1]:] = new


# --- the worker ---------------------------------------------------------------------------------

def note_plan(masks: np.ndarray, prompt_len: int, computed: int,
              budget: int = 0) -> Tuple[Pending, np.ndarray]:
    """The compaction of a LAYER_UNIFORM plan `masks` [L, Hkv, P]: the heads of a layer with one
    entry fewer than its longest head keep their most recent evicted prompt entry too (the
    kernel reads one length per layer). Returns the pending compaction and the padded masks
    (which the masked decode applies until the order arrives)."""
    masks = masks.copy()
    kept = []
    for layer in masks:
        counts = layer.sum(axis=1)
        longest = int(counts.max())
        for h in np.flatnonzero(counts < longest):
            evicted = np.flatnonzero(~layer[h])
            layer[h, evicted[len(evicted) - (longest - counts[h]):]] = True
        kept.append(np.stack([np.flatnonzero(row) for row in layer]).astype(np.int64))
    return Pending(prompt_len, computed, kept, budget=budget), masks


def note_replan(plan: Any, positions: List[np.ndarray], computed: int,
                budget: int = 0) -> Pending:
    """The compaction of a decode re-plan `plan` (LAYER_UNIFORM) of a cache whose layers hold
    the token positions `positions`: each layer's kept entries, padded as note_plan pads
    (KeepPlan.layer_entries), and their positions; it covers every entry (P = N)."""
    kept = [plan.layer_entries(l) for l in range(len(positions))]
    return Pending(computed, computed, kept,
                   [np.take_along_axis(p, k, axis=1) for p, k in zip(positions, kept)], budget)


def ready(pending: Pending, replan: bool = False) -> Ready:
    return Ready(pending.prompt_len, pending.longest, pending.computed, replan,
                 tuple(p.longest for p in pending.larger), pending.generation, pending.layout)


def move(pending: Pending, block_ids: List[int], order: Order,
         caches: List[Tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
    """Moves every layer's kept entries (and those after the prompt, up to order.computed) to
    slots 0.. of order.dest, reading them through the request's old blocks. caches[l] are layer
    l's keys [blocks, Hkv, d, bs] and values [blocks, Hkv, bs, d] (the "vec" layout). Returns
    drops. Raises when the order's blocks are not what this plan needs (the scheduler decided
    for another plan: a bug), before anything moved."""
    block_size = caches[0][0].shape[3]
    need = _blocks_for(pending.longest, order.computed, pending.prompt_len, block_size)
    if need != len(order.dest):
        raise RuntimeError(f"laprox: a compaction order of {len(order.dest)} blocks for a plan "
                           f"that needs {need} (level {order.level})")
    sources = torch.tensor(block_ids[:order.sources], dtype=torch.int64)
    dest = torch.tensor(order.dest, dtype=torch.int64)
    after = np.arange(pending.prompt_len, order.computed, dtype=np.int64)
    drops = np.empty(len(caches), np.int64)
    for l, (keys, values) in enumerate(caches):
        kept = pending.kept[l]
        heads, block_size = kept.shape[0], keys.shape[3]
        positions = torch.from_numpy(np.concatenate(
            [kept, np.broadcast_to(after, (heads, len(after)))], axis=1))  # [Hkv, S]
        h = torch.arange(heads)[:, None]
        src_blocks, src_slots = sources[positions // block_size], positions % block_size
        k = keys[src_blocks, h, :, src_slots]   # [Hkv, S, d] (gathered before any write)
        v = values[src_blocks, h, src_slots, :]
        j = torch.arange(positions.shape[1])
        dst_blocks, dst_slots = dest[j // block_size][None, :], (j % block_size)[None, :]
        keys[dst_blocks, h, :, dst_slots] = k
        values[dst_blocks, h, dst_slots, :] = v
        drops[l] = pending.prompt_len - kept.shape[1]
    return drops


@dataclass
class Shift:
    """One step's rows of compacted requests: tokens (indices into the step's tokens) are
    written to slots[l] in layer l, and request row i's kernel reads seq_lens[i] - delta[l, i]
    slots."""
    tokens: torch.Tensor   # [m] int64
    slots: torch.Tensor    # [L, m] int64
    delta: torch.Tensor    # [L, num_reqs] int32


def shift(rows: List[Tuple[int, int, int, np.ndarray]], token_starts: np.ndarray,
          block_table: np.ndarray, block_size: int, num_layers: int,
          num_reqs: int) -> Optional[Shift]:
    """rows: (batch row, first position, count, drops) of this step's compacted requests;
    token_starts[i]: the step's first token index of row i; block_table: the worker's rows."""
    if not rows:
        return None
    delta = np.zeros((num_layers, num_reqs), np.int32)
    tokens, slots = [], []
    for i, start, count, drops in rows:
        delta[:, i] = drops
        j = np.arange(start, start + count)[None, :] - drops[:, None]  # [L, count]
        slots.append(block_table[i][j // block_size].astype(np.int64) * block_size
                     + j % block_size)
        tokens.append(np.arange(token_starts[i], token_starts[i] + count))
    return Shift(torch.from_numpy(np.concatenate(tokens)),
                 torch.from_numpy(np.concatenate(slots, axis=1)), torch.from_numpy(delta))


# --- the scheduler ------------------------------------------------------------------------------

class _SchedulerSide:
    def __init__(self) -> None:
        self.drops: Dict[str, int] = {}       # request -> tokens its allocations leave out
        self.pending: Dict[str, Order] = {}   # decided, not yet sent
        self.held: Dict[str, List[Any]] = {}  # released blocks waiting for the worker's move
        # LAPROX_VLLM_TRIGGER=pressure: planned requests whose compaction waits until the pool
        # runs short (relieve), by request.
        self.deferred: Dict[str, Ready] = {}
        # The fence (current()): each request's generation, a number given each time it is
        # scheduled from its first position (new, a reused id, resumed after a preemption),
        # and the compactions decided for it in that generation.
        self.generations: Dict[str, int] = {}
        self.layouts: Dict[str, int] = {}
        self.last_generation = 0
        # Generations given since the last schedule() output, sent on the next one.
        self.announced: Dict[str, int] = {}
        # Ready reports of the step being updated (connector.update_connector_output), and the
        # pool the held blocks go back to.
        self.arrived: Dict[str, Ready] = {}
        self.block_pool: Any = None

    def begin(self, req_id: str) -> int:
        """A new generation of `req_id` (scheduled from its first position)."""
        self.last_generation += 1
        self.generations[req_id] = self.last_generation
        self.layouts.pop(req_id, None)
        self.announced[req_id] = self.last_generation
        return self.last_generation

    def forget(self, req_id: str) -> None:
        """`req_id` ended or was preempted: no plan of its generation applies any more."""
        self.generations.pop(req_id, None)
        self.layouts.pop(req_id, None)
        self.announced.pop(req_id, None)


SCHED = _SchedulerSide()


def _manager(scheduler: Any) -> Any:
    """The manager of the scheduler's one full-attention KV cache group (the group the worker
    plans: _runner._compacted_group), or None (none, or several: not compacted). A hybrid
    model's other groups (sliding-window ones) are left as vLLM keeps them."""
    managers = [m for m in scheduler.kv_cache_manager.coordinator.single_type_managers
                if _compacted(m)]
    return managers[0] if len(managers) == 1 else None


def _compacted(manager: Any) -> bool:
    """Whether `manager` is of the kind compaction applies to: full attention, no window."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    return (type(manager) is FullAttentionManager
            and getattr(manager.kv_cache_spec, "sliding_window", None) is None)


def current(req_id: str, found: Ready) -> bool:
    """The fence: whether the plan `found` was computed for the request's current generation
    (not for one that was aborted, preempted and recomputed, or whose id is now another
    request's) and on its cache as it is (no compaction decided since the plan read it: a
    re-plan racing a compaction). A plan that is not current is dropped (counted: fenced)."""
    generation = SCHED.generations.get(req_id)
    return (generation is not None and found.generation == generation
            and found.layout == SCHED.layouts.get(req_id, 0))


def _compactable(scheduler: Any, manager: Any, req_id: str, found: Ready,
                 deferred: bool) -> Optional[Any]:
    """The request `req_id` when its plan `found` can be compacted now, else None."""
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(req_id)
    # A first compaction is of a request not compacted yet; a re-plan of one compacted before,
    # whose previous order has been carried out (its blocks are no longer held). Unless it was
    # deferred, it is decided on the step the plan was made for.
    if (manager is None or request is None or not current(req_id, found)
            or request.status != RequestStatus.RUNNING
            or req_id not in manager.req_to_blocks or (req_id in SCHED.drops) != found.replan
            or req_id in SCHED.pending or req_id in SCHED.held
            or request.num_computed_tokens < found.computed
            or (not deferred and request.num_computed_tokens != found.computed)):
        return None
    return request


def _blocks_for(longest: int, computed: int, prompt_len: int, block_size: int) -> int:
    """Blocks a request holds once compacted: its longest layer's kept prompt entries and the
    entries computed after the prompt."""
    return -(-(longest + computed - prompt_len) // block_size)


def _blocks_needed(found: Ready, computed: int, block_size: int, level: int = 0) -> int:
    """Blocks a request planned as `found` holds once compacted at `level` with `computed`
    positions."""
    return _blocks_for(found.longest_at(level), computed, found.prompt_len, block_size)


def decide(scheduler: Any, req_id: str, found: Ready, deferred: bool = False,
           level: int = 0) -> int:
    """The blocks `req_id` keeps once compacted (module docstring), or nothing when it ended,
    was preempted, or compaction frees no block. `deferred`: the plan was made on an earlier
    step (LAPROX_VLLM_TRIGGER=pressure); the entries computed since are kept as well. `level`:
    the plan applied (Ready.longest_at). Returns the blocks released."""
    manager = _manager(scheduler)
    request = _compactable(scheduler, manager, req_id, found, deferred)
    if request is None:
        return 0
    blocks = manager.req_to_blocks[req_id]
    computed = request.num_computed_tokens
    need = _blocks_needed(found, computed, manager.block_size, level)
    if need > len(blocks):
        return 0
    private = [b for b in blocks if b.ref_cnt == 1 and not b.is_null]
    dest = private[len(private) - need:] if len(private) >= need else private
    if len(dest) < need:
        pool = manager.block_pool
        if pool.get_num_free_blocks() < need - len(dest):
            logger.warning("laprox: no free block to compact request %s into; it decodes with "
                           "its full blocks (masked, unless it was deferred)", req_id)
            return 0
        dest = dest + pool.get_new_blocks(need - len(dest))
    kept_ids = {id(b) for b in dest}
    released = [b for b in blocks if id(b) not in kept_ids]
    # Rewritten in place: their hashes would name positions they no longer hold.
    manager.block_pool.evict_blocks({b.block_id for b in dest if b.block_hash is not None})
    SCHED.block_pool = manager.block_pool
    SCHED.pending[req_id] = Order(len(blocks), tuple(b.block_id for b in dest), len(released),
                                  computed, level, found.generation)
    SCHED.layouts[req_id] = found.layout + 1
    SCHED.held[req_id] = released
    SCHED.drops[req_id] = found.prompt_len - found.longest_at(level)
    blocks[:] = dest
    manager.num_cached_block[req_id] = _NEVER
    return len(released)


def shortfall(scheduler: Any, manager: Any) -> int:
    """Blocks the engine's requests need two steps from now beyond those the pool will have
    (> 0: the pool is short). A compaction decided now frees its blocks after the next step
    (the worker moves the entries first), so it can only serve the step after: every running
    request's blocks for the tokens it holds and the next two it computes (a prefill: its whole
    prompt), and, when the scheduler may admit another request, the whole prompt of the first
    one waiting (prefix-cache hits not counted), against the free blocks and those held for
    compactions under way."""
    block_size = manager.block_size
    need = 0
    for request in scheduler.running:
        held = len(manager.req_to_blocks.get(request.request_id, ()))
        tokens = request.num_tokens + 1 - SCHED.drops.get(request.request_id, 0)
        need += max(0, -(-tokens // block_size) - held)
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_running_reqs:
        need += -(-next(iter(scheduler.waiting)).num_tokens // block_size)
    coming = sum(len(blocks) for blocks in SCHED.held.values())
    return need - manager.block_pool.get_num_free_blocks() - coming


def fewest(gains: Dict[str, int], short: int) -> List[str]:
    """The fewest requests whose released blocks (gains) cover `short`, largest gain first
    (the k largest gains are the largest sum any k requests give); all of them when even that
    falls short, none when nothing is short."""
    chosen: List[str] = []
    for req_id in sorted(gains, key=lambda r: (-gains[r], r)):
        if short <= 0:
            break
        if gains[req_id] > 0:
            chosen.append(req_id)
            short -= gains[req_id]
    return chosen


def choose(gains: Dict[str, List[int]], short: int) -> Dict[str, int]:
    """The level each compacted request is compacted at: gains[r][i] are the blocks request r
    releases at level i (0: the budget, the most; then larger budgets, fewer). The requests are
    fewest()'s at level 0; then, in fewest()'s order, each is raised to the largest budget
    that still leaves the shortfall covered: each compacted request keeps as much as its
    budgets allow while the moment's need is met (DESIGN.md section 8 says what that trades)."""
    chosen = fewest({r: g[0] for r, g in gains.items()}, short)
    surplus = sum(gains[r][0] for r in chosen) - short
    levels = {}
    for req_id in chosen:
        levels[req_id] = 0
        for level in range(len(gains[req_id]) - 1, 0, -1):
            cut = gains[req_id][0] - gains[req_id][level]
            if gains[req_id][level] > 0 and cut <= surplus:
                levels[req_id] = level
                surplus -= cut
                break
    return levels


def relieve(scheduler: Any) -> int:
    """LAPROX_VLLM_TRIGGER=pressure: compacts the fewest deferred requests that cover the
    pool's shortfall, each at the largest budget that covers it (choose(); evicted entries
    cannot come back, so nothing is compacted while the pool has room). Returns the requests
    compacted."""
    from ._state import STATE

    for req_id in [r for r, found in SCHED.deferred.items() if not current(r, found)]:
        del SCHED.deferred[req_id]  # its request is in another generation now (the fence)
        STATE.metrics.fenced += 1
    manager = _manager(scheduler)
    if manager is None or not SCHED.deferred:
        return 0
    short = shortfall(scheduler, manager)
    if short <= 0:
        return 0
    gains = {}
    for req_id, found in SCHED.deferred.items():
        request = _compactable(scheduler, manager, req_id, found, deferred=True)
        if request is not None:
            held = len(manager.req_to_blocks[req_id])
            gains[req_id] = [held - _blocks_needed(found, request.num_computed_tokens,
                                                   manager.block_size, level)
                             for level in range(1 + len(found.larger))]
    compacted = 0
    for req_id, level in choose(gains, short).items():
        # One that cannot be compacted now (no free block to compact into) stays deferred.
        if decide(scheduler, req_id, SCHED.deferred[req_id], deferred=True, level=level):
            del SCHED.deferred[req_id]
            compacted += 1
    return compacted


def _decide_safely(scheduler: Any, req_id: str, found: Ready, deferred: bool = False) -> int:
    """decide(), with a failure logged (the request decodes as it is) instead of raised."""
    try:
        return decide(scheduler, req_id, found, deferred)
    except Exception as e:  # noqa: BLE001 - never the engine's failure
        logger.warning("laprox: compacting %s failed (%r); it decodes %s", req_id, e,
                       "with its full cache" if deferred else "masked")
        return 0


def _release(req_id: str) -> None:
    held = SCHED.held.pop(req_id, None)
    if held:
        SCHED.block_pool.free_blocks(reversed(held))


def ended(req_id: str) -> None:
    """A request finished, was aborted or was preempted (connector.request_finished,
    build_connector_meta): nothing of its compaction outlives it, and no plan of its generation
    is applied any more (the fence); a deferred plan it never used is counted spared."""
    from ._state import STATE

    SCHED.forget(req_id)
    SCHED.drops.pop(req_id, None)
    SCHED.pending.pop(req_id, None)
    SCHED.arrived.pop(req_id, None)
    if SCHED.deferred.pop(req_id, None) is not None:
        STATE.metrics.spared += 1
    _release(req_id)


def install_scheduler_hooks() -> None:
    """Wraps what the KV connector API does not cover on the scheduler's side (compact mode):
    Scheduler.update_from_output (deciding needs the scheduler's requests and queues, which a
    connector is not given) and the full-attention manager's block accounting."""
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.sched.scheduler import Scheduler

    base = stm.SingleTypeKVCacheManager
    update = Scheduler.update_from_output
    count, allocate = base.get_num_blocks_to_allocate, base.allocate_new_blocks

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        from ._state import STATE

        channel = scheduler_output.kv_connector_metadata
        for req_id in getattr(channel, "orders", ()):
            _release(req_id)  # the worker moved their entries
        # The worker's Ready reports arrive during update() (connector.update_connector_output).
        result = update(self, scheduler_output, model_runner_output)
        arrived, SCHED.arrived = SCHED.arrived, {}
        new = []
        for req_id, found in arrived.items():
            if not current(req_id, found):
                STATE.metrics.fenced += 1  # for an earlier generation or cache: dropped
                continue
            if STATE.config.deferred and not found.replan:
                # A prompt of LAPROX_VLLM_LONG_PROMPT tokens or more is compacted at once (it
                # decoded unmasked until now); one that cannot be waits with the others.
                if 0 < STATE.config.long_prompt <= found.prompt_len and _decide_safely(
                        self, req_id, found, deferred=True):
                    STATE.metrics.long_prompt += 1
                    continue
                SCHED.deferred[req_id] = found
                new.append(req_id)
                continue
            _decide_safely(self, req_id, found)
        if SCHED.deferred:
            try:
                relieve(self)
            except Exception as e:  # noqa: BLE001 - never the engine's failure
                logger.warning("laprox: compacting under pressure failed (%r); the deferred "
                               "requests keep their full cache", e)
                SCHED.deferred.clear()
            STATE.metrics.deferred += sum(req_id in SCHED.deferred for req_id in new)
        return result

    # A compacted request's drop shortens its compacted group's allocations only (a hybrid
    # model's sliding-window groups hold every position as before).
    def get_num_blocks_to_allocate(self: Any, request_id: str, num_tokens: int,
                                   *args: Any, **kwargs: Any) -> int:
        drop = SCHED.drops.get(request_id, 0) if _compacted(self) else 0
        return count(self, request_id, num_tokens - drop, *args, **kwargs)

    def allocate_new_blocks(self: Any, request_id: str, num_tokens: int,
                            num_tokens_main_model: int, *args: Any, **kwargs: Any) -> Any:
        drop = SCHED.drops.get(request_id, 0) if _compacted(self) else 0
        return allocate(self, request_id, num_tokens - drop, num_tokens_main_model - drop,
                        *args, **kwargs)

    Scheduler.update_from_output = update_from_output
    base.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    base.allocate_new_blocks = allocate_new_blocks
