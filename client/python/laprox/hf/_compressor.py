"""laprox.hf.Compressor: compresses the cache of every prefill with a laproxd keep-plan (masked
or compacted), and with decode_buffer re-plans the cache through a long generation (the package
documentation, points 2-6)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np
import torch

from .. import types as t
from ..client import PLAN_DEADLINE_S, plan_deadline
from ..errors import LaproxError, invalid_argument
from ._cache import _fed_positions, _set_cache_layer_kv, cache_layer_kv
from ._masking import DEFAULT_WINDOW_ROWS, _attach_state, _attention_implementation, _State
from ._model import (_host, _server_reads_device, attention_modules, geometry, planned_layers,
                     register_model)

logger = logging.getLogger("laprox.hf")


class Compressor:
    """Compresses the KV cache of every prefill with a laproxd keep-plan while attached.

    Args:
        model: a transformers causal LM (Llama architecture, Gemma 3; see the module
            documentation for sliding-window layers).
        client: a laprox.Client.
        budget: tokens per KV head (int) or compression ratio (float); see laprox.Budget.
        policy: a laprox.Policy, a kind name ("laprox", "snapkv", ...) or a mapping; policy
            options may also be given as keywords (allocation="per_layer", window=32, ...).
        model_id: an id from register_model(); None: registered here (o_proj sent once).
        prepare_cross_grams: register with the cross-Grams (gqa_value="exact_block").
        window_rows: post-RoPE query rows captured per layer (>= the policy's window).
        compact: shrink the cache physically (see the module documentation, point 4).
        deadline: seconds a prefill waits for its plans, for a prompt of up to
            PLAN_DEADLINE_TOKENS tokens in all (laprox.client.plan_deadline: as much again per
            that many more); past it the prefill keeps its full cache (point 5).
        decode_buffer: N > 0 keeps the cache within budget + N entries per head through the
            generation by re-planning (point 6): batch 1, kind LAPROX, an int budget, plan
            shape LAYER_UNIFORM (set when not given), compaction. 0: plan once, after the
            prefill.

    Use as a context manager (or attach()/detach()); the model's attention implementation is
    "laprox" while attached and restored afterwards. `layers` are the planned model layers
    (planned_layers(): the full-attention layers). `plan` holds the last prefill's KeepPlan (a
    list, one per batch sequence, when the batch has more than one), whose layer i is model
    layer layers[i]; `masks` its keep masks per model layer ([B, Hkv, n], None for a layer not
    planned); both are None when laproxd missed the deadline. `timeouts` counts the sequences
    that kept their full cache for that reason (and, with decode_buffer, the re-plans that kept
    the cache as it was). With decode_buffer: `positions[i]` holds planned layer i's (model layer
    layers[i]) token positions [Hkv, n_i] of the entries it holds, `replans` the re-plans made,
    `cache_lengths` one (mean over planned layers, longest planned layer) of the entries per head
    after every forward since the prefill.
    """

    def __init__(self, model: Any, client: Any, budget: Union[int, float, t.Budget] = 128,
                 policy: Any = None, *, model_id: Optional[int] = None,
                 prepare_cross_grams: bool = False, window_rows: int = DEFAULT_WINDOW_ROWS,
                 compact: bool = False, deadline: float = PLAN_DEADLINE_S,
                 decode_buffer: int = 0, **policy_options: Any):
        if not deadline > 0:
            raise invalid_argument(f"deadline: {deadline} s; it must be > 0")
        self.model = model
        self.client = client
        self.budget = budget
        self.policy = t.Policy.of(policy, **policy_options)
        self.decode_buffer = int(decode_buffer)
        if self.decode_buffer < 0:
            raise invalid_argument(f"decode_buffer: {decode_buffer}; it must be >= 0")
        if self.decode_buffer > 0:
            self._check_decode_options()
            compact = True
        self.compact = compact
        self.deadline = float(deadline)
        self.timeouts = 0
        self.geometry = geometry(model)
        self.layers = planned_layers(model)
        self._device_ok = _server_reads_device(client)
        self.window_rows = max(int(window_rows), int(self.policy.window or 0))
        self.model_id = model_id if model_id is not None else register_model(
            client, model, prepare_cross_grams=prepare_cross_grams)
        self.plan: Any = None
        self.masks: Optional[List[torch.Tensor]] = None
        self.compacted = False
        # Decode re-plans (decode_buffer > 0): the token positions of the entries each layer
        # holds, the next token's position, and what happened since the prefill.
        self.positions: Optional[List[np.ndarray]] = None
        self.replans = 0
        self.cache_lengths: List[Tuple[float, int]] = []
        self._next_position = 0
        self._retry_at = 0
        g = self.geometry
        self._state = _State(len(attention_modules(model)), g.num_kv_heads, g.num_heads,
                             planned=self.layers)
        self._modules: List[Any] = []
        self._hook = None
        self._impl: Optional[contextlib.ExitStack] = None

    # --- lifetime -----------------------------------------------------------------------------

    def attach(self) -> "Compressor":
        if self._impl is not None:
            return self
        self._state.capture_rows = self.window_rows
        self._modules = _attach_state(self.model, self._state)
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        self._hook = decoder.register_forward_hook(self._after_forward, with_kwargs=True)
        self._impl = contextlib.ExitStack()
        self._impl.enter_context(_attention_implementation(self.model))
        return self

    def detach(self) -> None:
        if self._impl is None:
            return
        self._impl.close()
        self._impl = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for module in self._modules:
            module.__dict__.pop("_laprox_state", None)
        self._modules = []
        self._state.captured.clear()
        self._state.set_masks(None)

    def __enter__(self) -> "Compressor":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # --- compression ----------------------------------------------------------------------------

    def _after_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        captured = self._state.captured
        if not captured:
            if self.positions is not None:
                cache = getattr(output, "past_key_values", None) or \
                    kwargs.get("past_key_values")
                if cache is not None:
                    self._after_decode_forward(cache, kwargs)
            return output
        self._state.captured = {}
        if set(captured) != set(self.layers):
            return output  # not a prefill of every planned layer (e.g. a partial model call)
        cache = getattr(output, "past_key_values", None) or kwargs.get("past_key_values")
        if cache is None:
            return output  # use_cache=False: nothing to compress
        queries = [captured[l] for l in self.layers]
        self.compress(cache, queries)
        return output

    def compress(self, cache: Any, window_queries: Sequence[torch.Tensor]) -> Any:
        """Asks laproxd for the keep-plan of the prefilled `cache` (every planned layer holding
        the n prompt tokens) with the post-RoPE `window_queries` [B, H, wq, d] of each planned
        layer (window_queries[i]: model layer self.layers[i]), installs the masks (or compacts
        the cache) and returns the plan(s), whose layer i is model layer self.layers[i]; None,
        the cache left whole, when laproxd does not answer within plan_deadline(B * n,
        deadline). Layers that are not planned (sliding windows) are left as they are."""
        L = self.geometry.num_layers
        if len(window_queries) != L:
            raise invalid_argument(f"window_queries: {len(window_queries)} layers, the model "
                                   f"has {L} planned layers {self.layers}")
        kv = [cache_layer_kv(cache, l) for l in self.layers]
        batch, _, n, _ = kv[0][0].shape
        self.positions = None
        self._state.recent_rows, self._state.recent = 0, {}
        if self.decode_buffer > 0 and batch != 1:
            raise invalid_argument(f"decode_buffer: re-plans follow one sequence; the batch has "
                                   f"{batch}")
        plans, masks = [], [torch.zeros(batch, self.geometry.num_kv_heads, n, dtype=torch.bool)
                            for _ in range(L)]  # plan order; self.masks is per model layer
        deadline = plan_deadline(batch * n, self.deadline)
        until = time.monotonic() + deadline
        for b in range(batch):
            try:
                plan = self.client.compute_keep_plan(
                    self.model_id, [_host(k[b], self._device_ok) for k, _ in kv],
                    [_host(v[b], self._device_ok) for _, v in kv],
                    window_queries=[_host(q[b], self._device_ok) for q in window_queries],
                    policy=self.policy, budget=self.budget,
                    timeout=max(until - time.monotonic(), 0.0))
            except LaproxError as e:
                if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                return self._keep_full_cache(batch, deadline)
            plans.append(plan)
            m = torch.from_numpy(plan.to_masks())
            for l in range(L):
                masks[l][b] = m[l]
        self.plan = plans[0] if batch == 1 else plans
        self.masks = self._per_model_layer(masks)
        per_layer = [{int(c) for p in plans for c in p.counts[l]} for l in range(L)]
        # Compact: each layer to its largest per-head count; shorter heads are padded with a
        # repeated position that the masks hide (at most one slot with head_uniform_layers).
        self.compacted = bool(self.compact)
        if not self.compacted:
            self._state.set_masks(self.masks)
            return self.plan
        if self.decode_buffer > 0:
            # Positions 0 .. n - 1, then the decode steps' tokens; the window's queries seed
            # the recent rows the first re-plan reads.
            self._compact_to(cache, plans[0],
                             [np.tile(np.arange(n), (self.geometry.num_kv_heads, 1))] * L)
            self._next_position, self._retry_at = n, 0
            self.replans, self.cache_lengths = 0, []
            self._state.recent_rows = self.window
            self._state.recent = {l: q[:, :, -self.window:].detach().clone()
                                  for l, q in zip(self.layers, window_queries)}
            widths = [p.shape[1] for p in self.positions]
            self.cache_lengths.append((float(np.mean(widths)), int(max(widths))))
            return self.plan
        compact_masks = []
        for l in range(L):
            keys, values = kv[l]
            width = max(per_layer[l])
            idx = torch.zeros(batch, self.geometry.num_kv_heads, width, dtype=torch.long)
            keep = torch.zeros(batch, self.geometry.num_kv_heads, width, dtype=torch.bool)
            for b, p in enumerate(plans):
                for g in range(self.geometry.num_kv_heads):
                    # A writable int64 copy: the plan's views are read-only, and a tensor made
                    # from one warns ("The given NumPy array is not writable").
                    pos = torch.from_numpy(np.array(p.kept(l, g), dtype=np.int64))
                    idx[b, g, :pos.numel()] = pos
                    idx[b, g, pos.numel():] = pos[-1] if pos.numel() else 0
                    keep[b, g, :pos.numel()] = True
            gather = idx.to(keys.device).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            _set_cache_layer_kv(cache, self.layers[l], keys.gather(2, gather).contiguous(),
                                values.gather(2, gather).contiguous())
            compact_masks.append(keep)
        # Always through the masking path: layers now differ in length, so the model's own
        # mask (built for layer 0) is replaced by one of the right length (_masked). Decoding
        # needs no mask in a layer without padded slots, and a prebuilt one in the others.
        self._state.set_masks(self._per_model_layer(compact_masks), compacted=True)
        return self.plan

    def _per_model_layer(self, planned: Sequence[Any]) -> List[Any]:
        """Per model layer: planned[i] at self.layers[i], None (nothing masked) elsewhere."""
        out: List[Any] = [None] * self._state.num_layers
        for l, value in zip(self.layers, planned):
            out[l] = value
        return out

    # --- decode re-plans -------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """The observation window the plans use (the policy's, else LAPROX's default 32)."""
        return int(self.policy.window or 32)

    def _check_decode_options(self) -> None:
        if t.Budget.of(self.budget).tokens_per_head is None:
            raise invalid_argument(f"decode_buffer: the budget must be tokens per head (an int), "
                                   f"not {self.budget!r}")
        if self.policy.kind is not None and \
                t.PolicyKind.parse(self.policy.kind) != t.PolicyKind.LAPROX:
            raise invalid_argument(f"decode_buffer: re-plans take policy kind LAPROX, not "
                                   f"{self.policy.kind}")
        shape = self.policy.plan_shape
        if shape is None:
            self.policy = self.policy.replace(plan_shape=t.PlanShape.LAYER_UNIFORM)
        elif t.PlanShape.parse(shape) != t.PlanShape.LAYER_UNIFORM:
            raise invalid_argument(f"decode_buffer: the cache is compacted to one length per "
                                   f"layer, which takes plan_shape LAYER_UNIFORM, not {shape}")

    def _compact_to(self, cache: Any, plan: Any, positions: Sequence[np.ndarray]) -> None:
        """Compacts a batch-1 `cache` to `plan` (LAYER_UNIFORM: the heads of a layer keep
        counts that differ by at most one): each head keeps its planned entries, the heads one
        short also their most recent evicted entry, a real one, so every head of a layer holds
        the same count, in position order, and no mask is needed. `positions` are the token
        positions of the entries the cache holds now, per planned layer (positions[i]: model
        layer self.layers[i]); self.positions become the kept ones."""
        kept_positions, widths = [], []
        for l, rows in enumerate(positions):
            keys, values = cache_layer_kv(cache, self.layers[l])
            entries = plan.layer_entries(l)  # [Hkv, width], short heads padded
            idx = torch.from_numpy(entries).to(keys.device)
            gather = idx[None, :, :, None].expand(1, -1, -1, keys.shape[-1])
            _set_cache_layer_kv(cache, self.layers[l], keys.gather(2, gather).contiguous(),
                                values.gather(2, gather).contiguous())
            kept_positions.append(np.take_along_axis(rows, entries, axis=1))
            widths.append(entries.shape[1])
        self.positions = kept_positions
        # Layers differ in length: calls of several query rows need masks of each layer's
        # length (_masked); decoding needs none (nothing in them is evicted).
        Hkv = self.geometry.num_kv_heads
        self._state.set_masks(self._per_model_layer(
            [torch.ones(1, Hkv, w, dtype=torch.bool) for w in widths]), compacted=True)

    def _after_decode_forward(self, cache: Any, kwargs: Dict[str, Any]) -> None:
        """After a forward that appended tokens: their positions, then a re-plan when the
        mean over layers of the entries per head reached budget + decode_buffer. The tokens
        must continue the positions held: a forward that gave them others (e.g. a second
        generate() on the compacted cache, which takes its positions from the cache's length
        and feeds again the tokens it thinks are missing) is refused, not tracked wrongly."""
        Hkv = self.geometry.num_kv_heads
        lengths = [int(cache_layer_kv(cache, l)[0].shape[2]) for l in self.layers]
        added = lengths[0] - self.positions[0].shape[1]
        if any(n - p.shape[1] != added for n, p in zip(lengths, self.positions)) or added < 0:
            followed = [p.shape[1] for p in self.positions]
            raise invalid_argument(f"decode_buffer: the cache holds {lengths} entries per "
                                   f"layer, {followed} before this call: was it cropped or "
                                   "replaced?")
        if added > 0:
            new = np.arange(self._next_position, self._next_position + added)
            fed = _fed_positions(kwargs, lengths[0] - added, added)
            if not np.array_equal(fed, new):
                raise invalid_argument(
                    f"decode_buffer: this forward gave its {added} token(s) positions "
                    f"{fed[0]}..{fed[-1]}, but the cache ends at position "
                    f"{self._next_position - 1} (it holds {lengths[0] - added} entries per head "
                    f"in layer {self.layers[0]}): new tokens must continue it. A generate() "
                    "continuing a compacted cache takes positions from the cache's length; start "
                    "from the prompt, or call the model with position_ids")
            self.positions = [np.concatenate([p, np.tile(new, (Hkv, 1))], axis=1)
                              for p in self.positions]
            self._next_position += added
        budget = t.Budget.of(self.budget).tokens_per_head
        if np.mean(lengths) >= budget + self.decode_buffer and \
                self._next_position >= self._retry_at:
            self._replan(cache)
        widths = [p.shape[1] for p in self.positions]
        self.cache_lengths.append((float(np.mean(widths)), int(max(widths))))

    def _replan(self, cache: Any) -> None:
        """Sends the cache as it is to laproxd (a decode re-plan) and compacts it to the plan;
        past the deadline the cache stays as it is, and the next try is decode_buffer / 4 tokens
        later."""
        kv = [cache_layer_kv(cache, l) for l in self.layers]
        queries = [self._state.recent[l][0, :, -self.window:] for l in self.layers]
        deadline = plan_deadline(max(p.shape[1] for p in self.positions), self.deadline)
        try:
            plan = self.client.compute_keep_plan(
                self.model_id, [_host(k[0], self._device_ok) for k, _ in kv],
                [_host(v[0], self._device_ok) for _, v in kv],
                window_queries=[_host(q, self._device_ok) for q in queries],
                cache_positions=self.positions, policy=self.policy, budget=self.budget,
                timeout=deadline)
        except LaproxError as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self.timeouts += 1
            self._retry_at = self._next_position + max(1, self.decode_buffer // 4)
            logger.warning("laprox: a decode re-plan missed its deadline of %.3g s; the cache "
                           "keeps its %d entries per head until a retry %d tokens later",
                           deadline, max(p.shape[1] for p in self.positions),
                           self._retry_at - self._next_position)
            return
        self._compact_to(cache, plan, self.positions)
        self.plan = plan
        self.replans += 1

    def _keep_full_cache(self, batch: int, deadline: float) -> None:
        """After a missed deadline: this prefill's sequences decode with their full cache."""
        self.plan, self.masks, self.compacted = None, None, False
        self._state.set_masks(None)
        self.timeouts += batch
        logger.warning("laprox: laproxd did not answer within the plan deadline of %.3g s; "
                       "%d sequence(s) keep their full KV cache (timeouts so far: %d)",
                       deadline, batch, self.timeouts)
