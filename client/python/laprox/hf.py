"""Hugging Face transformers integration: compress the KV cache after prefill with laproxd.

    import laprox, laprox.hf

    client = laprox.Client("unix:/run/laprox/laproxd.sock")
    press = laprox.hf.Compressor(model, client, budget=128)  # registers o_proj once
    with press:                                                # attention "laprox" inside
        out = model.generate(input_ids, max_new_tokens=64)
    press.plan                                                 # the last KeepPlan(s)

Works with models whose decoder layers have a `self_attn` with `q_proj`/`o_proj` and a
`layer_idx`: the Llama architecture (Llama, Mistral, Qwen2/3, SmolLM) and Gemma 3 (q/k norms,
sliding-window layers); tested with transformers 5.2.0 (it needs `AttentionInterface`,
`AttentionMaskInterface` and `PreTrainedModel.set_attn_implementation`); CI runs the tests with
5.19. No model code is copied. Attention logit soft-capping (Gemma 2) is not modelled: laproxd's
window attention would differ from the model's.

Sliding-window layers (Gemma 3: five of window 512 per full-attention layer; config.layer_types
"sliding_attention") never hold more than their window, so they draw nothing from the budget
and laprox leaves them alone: no plan, no mask, no compaction. Only the layers that hold the
whole prompt are planned, `planned_layers(model)` (config.layer_types "full_attention", else the
attention modules without a `sliding_window`; every layer of a Llama): register_model()
registers the model made of them (geometry().num_layers is their count, their o_proj in order),
the budget B tokens per KV head is counted over them, and a plan's layer i — in
`Compressor.plan`, `Compressor.positions` and laproxd's answers — is model layer
planned_layers(model)[i]. `Compressor.masks` and `masked()` take one entry per model layer, None
where nothing is masked (every sliding layer). transformers' DynamicCache(config=...) keeps the
last window - 1 tokens of a sliding layer; laprox reads and writes only the planned layers'
cache.

The integration is one attention function registered as "laprox" through
`transformers.AttentionInterface` (plus the sdpa mask builder under the same name in
`AttentionMaskInterface`); the model's attention modules call it with post-RoPE queries and the
keys/values returned by the cache, so:

1. Prefill of a new sequence (query length = key length > 1): the last `window_rows` queries of
   every planned layer are kept, as the attention function receives them (after the model's
   q_norm, if any, and RoPE), then torch's SDPA runs as usual (the prefill itself is exact).
2. A forward hook on the decoder (`model.model`) runs after the prefill: it sends each planned
   layer's cache keys/values and the captured window queries to laproxd (numpy over shared
   memory; CUDA tensors by IPC when laproxd runs the CUDA backend, else copied to the host) and
   turns the plan into keep masks [B, Hkv, n].
3. Every later attention call (decoding, or a teacher-forced continuation) adds -inf to the
   logits of evicted (layer, KV head, position) — for each of the G query heads of the KV head —
   before SDPA's softmax, so the softmax is renormalised over the kept keys exactly as if the
   cache held only them. Tokens appended after the prefill are always visible. A decoding step
   (one query row, no padding) reuses a per-layer mask built once, and a layer with nothing
   evicted (e.g. a compacted layer whose heads kept equal counts) gets no mask at all; on the
   CPU the masked SDPA runs over the KV heads as they are (enable_gqa) rather than on keys and
   values repeated to every query head.
4. With `compact=True` the cache is physically shrunk instead: each layer to its largest
   per-head kept count, shorter heads padded with a masked duplicate. That saves memory when the
   plan keeps one length per layer (policy option plan_shape="layer_uniform", or its older,
   deprecated spelling head_uniform_layers=True: at most one padded slot;
   plan_shape="blocks_shared" or "blocks_per_layer" with a block_size: none, every head keeps
   the same blocks; or STREAMING_LLM/SNAPKV/PYRAMIDKV/CRITICALKV). Layers then differ in length; positions
   and RoPE of new tokens stay those of the full sequence because generate() advances
   cache_position itself rather than reading the cache length. transformers builds the causal
   mask of a multi-token call from those positions, which no longer index a compacted layer:
   there the causal part comes from the layer's layout (the new tokens are its last entries).

5. laproxd gets a deadline for the plans of each prefill (Compressor's `deadline`, 2 s by
   default, scaled by laprox.client.plan_deadline with the batch's tokens): if it does not
   answer in time (stopped, overloaded), generate() goes on with the full cache of that
   prefill, counted in `timeouts` and logged; the next prefill asks again.

6. With `decode_buffer=N` the cache stays within `budget + N` entries per head through a long
   generation (batch 1): the prefill's plan is LAYER_UNIFORM and compacts the cache, the heads
   of a layer one short padded with their most recent evicted entry (a real entry, attended as
   it is, so no mask is needed and positions stay distinct); every later forward appends its
   tokens and records their post-RoPE queries; when the mean over planned layers of a head's
   entries reaches `budget + N`, the planned layers' cache as it is (every entry's token
   position tracked in `positions`, one array per planned layer) goes to laproxd as a decode
   re-plan (laprox.proto DecodeCache) with the last `window` tokens' queries, and is compacted
   to the plan again; sliding layers keep their window throughout. `cache_lengths` records the
   mean and the longest planned layer's entries per head after every forward, `replans` the
   re-plans. A re-plan past its deadline keeps the cache as it is (counted in `timeouts`) and
   is tried again N / 4 tokens later. New tokens must continue the positions held: a second
   generate() on the compacted cache (which takes its positions from the cache's length and
   feeds again the tokens it thinks are missing) raises INVALID_ARGUMENT instead of tracking
   them at wrong positions; continue with model(..., position_ids=...) or start from the prompt.

Batches are compressed sequence by sequence (one keep-plan each); left padding is not supported
(every sequence of the batch must have n real tokens). Chunked prefill is not supported: the
prefill must be one forward call.

`masked(model, masks)` applies arbitrary keep masks (e.g. from another library) the same way;
`capture_window_queries(model, rows)` only records the prefill's window queries.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import grpc

from . import types as t
from ._attention import SDPA_GQA, masked_attention
from .client import PLAN_DEADLINE_S, plan_deadline
from .errors import LaproxError, invalid_argument

logger = logging.getLogger("laprox.hf")

ATTENTION_NAME = "laprox"
DEFAULT_WINDOW_ROWS = 64  # query rows captured: the largest default window of any policy kind

_installed = False


def install() -> None:
    """Registers the "laprox" attention function and mask builder with transformers
    (idempotent). Called by Compressor and masked()."""
    global _installed
    if _installed:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _installed = True


def attention_modules(model: Any) -> List[Any]:
    """The self-attention modules of the decoder layers, in layer order."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and hasattr(module, "o_proj") and hasattr(module, "q_proj"):
            found[int(idx)] = module
    if not found:
        raise invalid_argument(f"{type(model).__name__}: no attention modules with q_proj, "
                               "o_proj and layer_idx (not a Llama-architecture model?)")
    return [found[i] for i in sorted(found)]


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", model)
    return getattr(config, "get_text_config", lambda: config)()


def planned_layers(model: Any) -> List[int]:
    """The model layers laprox plans, in order: those whose cache holds the whole prompt.

    A sliding-window layer never holds more than its window, so it draws nothing from the
    budget and is neither planned, masked nor compacted: plan layer i (and geometry()'s layer
    i, and register_model()'s o_proj i) is model layer planned_layers(model)[i]. The layer
    kinds come from config.layer_types ("full_attention" is planned; "sliding_attention",
    "chunked_attention" and any other kind are not), else from each attention module's
    `sliding_window` attribute (None or absent: planned). Llama-architecture models without
    sliding layers get every layer, [0, 1, ..., L - 1]. INVALID_ARGUMENT when no layer is a
    full-attention layer."""
    modules = attention_modules(model)
    kinds = getattr(_text_config(model), "layer_types", None)
    if kinds is not None and len(kinds) >= len(modules):
        layers = [int(m.layer_idx) for m in modules if kinds[int(m.layer_idx)] == "full_attention"]
    else:
        layers = [int(m.layer_idx) for m in modules
                  if getattr(m, "sliding_window", None) is None]
    if not layers:
        raise invalid_argument(f"{type(model).__name__}: no full-attention layer (layer kinds "
                               f"{kinds}): every layer holds a sliding window, nothing to plan")
    return layers


def geometry(model: Any) -> t.ModelGeometry:
    """The geometry laproxd plans with: L = the planned layers (planned_layers(): the
    full-attention layers), H, Hkv, d, D from the config; the softmax scale from the attention
    modules (their `scaling`, e.g. Gemma 3's query_pre_attn_scalar ** -0.5; 0, the default,
    when it is 1/sqrt(d))."""
    g = t.ModelGeometry.from_hf_config(_text_config(model))
    layers = planned_layers(model)
    scale = 0.0
    try:
        module_scale = float(attention_modules(model)[layers[0]].scaling)
        if not math.isclose(module_scale, g.head_dim ** -0.5, rel_tol=1e-6):
            scale = module_scale
    except (AttributeError, TypeError, ValueError):
        pass
    return t.ModelGeometry(len(layers), g.num_heads, g.num_kv_heads, g.head_dim,
                           g.hidden_size, scale)


def register_model(client: Any, model: Any, name: Optional[str] = None,
                   prepare_cross_grams: bool = False) -> int:
    """Registers with laproxd the model made of the planned layers (planned_layers(): the
    full-attention layers), their geometry and o_proj.weight in order; returns the model id.
    CPU weights go as fp32 numpy (bf16/fp16 as they are); CUDA weights by IPC."""
    device_ok = _server_reads_device(client)
    modules = attention_modules(model)
    weights = [_host(modules[l].o_proj.weight.detach(), device_ok)
               for l in planned_layers(model)]
    if name is None:
        name = t.model_name(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return client.register_model(name, geometry(model), weights,
                                 prepare_cross_grams=prepare_cross_grams)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

class _State:
    """What the attention function reads on each module (attribute `_laprox_state`)."""

    def __init__(self, num_layers: int, num_kv_heads: int, num_heads: int,
                 planned: Optional[Sequence[int]] = None):
        self.num_layers = num_layers          # every layer of the model, indexed by layer_idx
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # The layers whose queries are captured and remembered (None: all); masks may cover
        # any layer (None where nothing is masked, e.g. a sliding-window layer).
        self.planned = None if planned is None else frozenset(planned)
        self.capture_rows = 0                 # > 0: keep that many query rows of a prefill
        self.captured: Dict[int, torch.Tensor] = {}
        self.prefix_bias: Optional[List[Optional[torch.Tensor]]] = None  # [B, H, 1, n] per layer
        # Per layer: whether any prefix position is evicted. A layer with nothing evicted (every
        # layer of an all-kept mask, or a compacted layer whose heads kept equal counts) needs
        # no mask when one query row attends to the whole cache (decoding).
        self.evicts: List[bool] = []
        self.compacted = False  # see set_masks
        # Per layer: the decode mask [B, H, 1, capacity] (prefix bias, then zeros for appended
        # tokens) in the queries' dtype and device, built once and sliced at every step.
        self._decode_bias: Dict[int, torch.Tensor] = {}
        # > 0 (decode re-plans): every forward after a prefill keeps the last that many query
        # rows of each layer in `recent` ([B, H, <= rows, d], post-RoPE).
        self.recent_rows = 0
        self.recent: Dict[int, torch.Tensor] = {}

    def set_masks(self, masks: Optional[Sequence[Any]], compacted: bool = False) -> None:
        """masks[l] for every model layer l: bool [B, Hkv, n] or [Hkv, n] (True = keep), or
        None (nothing masked in that layer); masks None clears them all. compacted: the masked
        layers hold the entries of a compacted cache, so a cache index is no token position and
        the model's causal mask (built from token positions) does not apply to them."""
        self._decode_bias = {}
        self.compacted = compacted and masks is not None
        if masks is None:
            self.prefix_bias = None
            self.evicts = []
            return
        if len(masks) != self.num_layers:
            raise invalid_argument(f"masks: {len(masks)} layers, the model has "
                                   f"{self.num_layers}")
        biases, evicts = [], []
        for l, m in enumerate(masks):
            if m is None:
                biases.append(None)
                evicts.append(False)
                continue
            m = torch.as_tensor(m, dtype=torch.bool)
            if m.dim() == 2:
                m = m.unsqueeze(0)
            if m.dim() != 3 or m.shape[1] != self.num_kv_heads:
                raise invalid_argument(f"masks[{l}]: expected [B, {self.num_kv_heads}, n], got "
                                       f"{tuple(m.shape)}")
            bias = torch.zeros(m.shape, dtype=torch.float32)
            bias.masked_fill_(~m, float("-inf"))
            biases.append(bias.repeat_interleave(self.group, dim=1).unsqueeze(2))
            evicts.append(not bool(m.all()))
        self.prefix_bias = biases
        self.evicts = evicts

    def remember(self, layer: int, query: torch.Tensor) -> None:
        """Keeps the last `recent_rows` query rows of `layer` ([B, H, q, d], post-RoPE)."""
        rows = query.detach()
        previous = self.recent.get(layer)
        if previous is not None:
            rows = torch.cat([previous, rows], dim=2)
        self.recent[layer] = rows[:, :, -self.recent_rows:].clone()

    def decode_bias(self, layer: int, query: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The additive mask [B, H, 1, kv_len] of one query row over `kv_len` keys: the layer's
        prefix bias, 0 for the tokens appended since. A view of a buffer built on the first
        call and rebuilt only when kv_len outgrows it (capacity doubles), so decoding step by
        step allocates nothing."""
        b = query.shape[0]
        prefix = self.prefix_bias[layer]
        n = prefix.shape[-1]
        if n > kv_len:
            raise invalid_argument(f"keep masks cover {n} positions but the cache holds "
                                   f"{kv_len}: was the cache cropped or compacted after the "
                                   "masks were set?")
        buf = self._decode_bias.get(layer)
        if buf is None or buf.shape[-1] < kv_len or buf.dtype != query.dtype or \
                buf.device != query.device:
            capacity = max(kv_len, n + 256, 2 * buf.shape[-1] if buf is not None else 0)
            buf = torch.zeros(prefix.shape[0], prefix.shape[1], 1, capacity,
                              dtype=query.dtype, device=query.device)
            buf[..., :n] = prefix
            self._decode_bias[layer] = buf
        if buf.shape[0] != b:
            if buf.shape[0] != 1:
                raise invalid_argument(f"keep masks are for batch {buf.shape[0]}, the call "
                                       f"has {b}")
            return buf[..., :kv_len].expand(b, -1, -1, -1)
        return buf[..., :kv_len]


def _sdpa_masked_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, dropout: float, scaling: Optional[float]):
    """masked_attention in the layout transformers' attention functions return ([B, q, H, d],
    no weights). transformers' own SDPA path repeats keys and values to every query head
    whenever a mask is given (a copy of the layer's cache per call); masked_attention does not."""
    out = masked_attention(query, key, value, mask, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
               scaling: Optional[float] = None, **kwargs: Any):
    """SDPA attention that captures prefill window queries and masks evicted keys."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    state: Optional[_State] = getattr(module, "_laprox_state", None)
    if state is not None:
        q_len, kv_len = query.shape[2], key.shape[2]
        layer = module.layer_idx
        prefill = q_len == kv_len and q_len > 1
        planned = state.planned is None or layer in state.planned
        if prefill:
            # A new sequence's prefill: it runs on the full cache; earlier masks are void.
            if state.capture_rows > 0 and planned:
                state.captured[layer] = query[:, :, -state.capture_rows:].detach().clone()
        elif state.recent_rows > 0 and planned:
            state.remember(layer, query)
        if not prefill and state.prefix_bias is not None and state.prefix_bias[layer] is not None:
            if q_len == 1 and attention_mask is None:
                # Decoding (the model's mask was skipped: no padding, one query row). A layer
                # with nothing evicted runs exactly like the full cache; the others take their
                # prebuilt bias, sliced to this step's length.
                if not state.evicts[layer]:
                    if state.prefix_bias[layer].shape[-1] > kv_len:
                        state.decode_bias(layer, query, kv_len)  # raises: the cache is short
                elif SDPA_GQA and query.device.type == "cpu":
                    return _sdpa_masked_gqa(query, key, value,
                                            state.decode_bias(layer, query, kv_len),
                                            dropout, scaling)
                else:
                    attention_mask = state.decode_bias(layer, query, kv_len)
            else:
                # A compacted layer's causal mask follows from its layout (the new tokens are
                # the last q_len entries), not from the model's, which indexes keys by position.
                attention_mask = _masked(None if state.compacted else attention_mask,
                                         state.prefix_bias[layer], query, kv_len)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _masked(attention_mask: Optional[torch.Tensor], prefix_bias: torch.Tensor,
            query: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The float mask [B, H, q, kv] = the model's mask (causal) + -inf at evicted keys."""
    b, _, q_len, _ = query.shape
    n = prefix_bias.shape[-1]
    if n > kv_len:
        raise invalid_argument(f"keep masks cover {n} positions but the cache holds {kv_len}: "
                               "was the cache cropped or compacted after the masks were set?")
    bias = prefix_bias.to(device=query.device, dtype=query.dtype)
    if bias.shape[0] != b:
        if bias.shape[0] != 1:
            raise invalid_argument(f"keep masks are for batch {bias.shape[0]}, the call has {b}")
        bias = bias.expand(b, -1, -1, -1)
    if kv_len > n:
        bias = torch.cat([bias, bias.new_zeros(b, bias.shape[1], 1, kv_len - n)], dim=-1)
    if attention_mask is not None and attention_mask.shape[-1] < kv_len:
        attention_mask = None  # built for a layer of another length (compacted cache)
    if attention_mask is None:
        if q_len > 1:  # causal: query row t sees keys j <= kv_len - q_len + t
            rows = torch.arange(q_len, device=query.device).unsqueeze(1)
            cols = torch.arange(kv_len, device=query.device).unsqueeze(0)
            causal = torch.zeros(q_len, kv_len, dtype=query.dtype, device=query.device)
            causal.masked_fill_(cols > rows + (kv_len - q_len), float("-inf"))
            return bias + causal
        return bias
    if attention_mask.dtype == torch.bool:
        base = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        base.masked_fill_(~attention_mask, float("-inf"))
    else:
        base = attention_mask.to(query.dtype)
    return base[..., -kv_len:] + bias


def _attach_state(model: Any, state: _State) -> List[Any]:
    modules = attention_modules(model)
    for module in modules:
        module._laprox_state = state
    return modules


@contextlib.contextmanager
def _attention_implementation(model: Any) -> Iterator[None]:
    install()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def masked(model: Any, masks: Sequence[Any]) -> Iterator[None]:
    """Within the block, attention ignores the evicted prefix positions of `masks` (one entry per
    model layer: bool [B, Hkv, n] or [Hkv, n], True = keep, or None for a layer left whole,
    e.g. a sliding-window layer; Compressor.masks has this form) for every call whose keys
    extend the prefix (decoding steps, teacher-forced continuations over a cache holding the n
    prefix tokens)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    g = t.ModelGeometry.from_hf_config(config)
    state = _State(g.num_layers, g.num_kv_heads, g.num_heads)
    state.set_masks(masks)
    modules = _attach_state(model, state)
    try:
        with _attention_implementation(model):
            yield
    finally:
        for module in modules:
            module.__dict__.pop("_laprox_state", None)


@contextlib.contextmanager
def capture_window_queries(model: Any, rows: int = DEFAULT_WINDOW_ROWS
                           ) -> Iterator[Dict[int, torch.Tensor]]:
    """Within the block, every prefill (a forward whose query length equals its key length)
    stores each layer's last `rows` post-RoPE queries, [B, H, rows, d], in the yielded dict
    under the layer index (a later prefill overwrites them)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    g = t.ModelGeometry.from_hf_config(config)
    state = _State(g.num_layers, g.num_kv_heads, g.num_heads)
    state.capture_rows = int(rows)
    modules = _attach_state(model, state)
    try:
        with _attention_implementation(model):
            yield state.captured
    finally:
        for module in modules:
            module.__dict__.pop("_laprox_state", None)


def cache_layer_kv(cache: Any, layer: int):
    """(keys, values) [B, Hkv, n, d] of one layer of a transformers Cache (4.x and 5.x)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _set_cache_layer_kv(cache: Any, layer: int, keys: torch.Tensor,
                        values: torch.Tensor) -> None:
    if hasattr(cache, "layers"):
        cache.layers[layer].keys, cache.layers[layer].values = keys, values
    else:
        cache.key_cache[layer], cache.value_cache[layer] = keys, values


def _fed_positions(kwargs: Dict[str, Any], cached: int, added: int) -> np.ndarray:
    """The token positions (RoPE) a batch-1 decoder forward gave its last `added` tokens:
    position_ids, else cache_position (transformers 5.2 passes both, 5.19 only position_ids),
    else those the model derives from the cache's length, `cached` entries in layer 0."""
    for key in ("position_ids", "cache_position"):
        value = kwargs.get(key)
        if value is not None:
            return np.asarray(torch.as_tensor(value).detach().cpu()).reshape(-1)[-added:]
    return np.arange(cached, cached + added)


def _server_reads_device(client: Any) -> bool:
    """Whether laproxd can read CUDA tensors (its CUDA backend); a CPU server gets host copies."""
    try:
        return client.info().backend == "cuda"
    except Exception:  # a client without info() (tests) or an old server: stay on the host
        return False


def _host(x: torch.Tensor, device_ok: bool = False) -> Any:
    """What the client sends: numpy for CPU tensors (fp32/fp16; bf16 widened); CUDA tensors as
    they are when the server reads device memory, else copied to the host."""
    if x.device.type != "cpu":
        if device_ok:
            return x.contiguous()
        x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()


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
