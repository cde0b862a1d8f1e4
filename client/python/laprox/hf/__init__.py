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

The package's modules, by idea (its public names are all here, as they were when it was the one
module hf.py): _model (the layers planned, their geometry, register_model), _masking (the
attention function and its state, masked, capture_window_queries), _cache (a cache layer's keys
and values, the positions a forward fed), _compressor (Compressor: planning, masking or
compacting, decode re-plans).
"""

from __future__ import annotations

from ._cache import _fed_positions, _set_cache_layer_kv, cache_layer_kv  # noqa: F401
from ._compressor import Compressor  # noqa: F401
from ._masking import (ATTENTION_NAME, DEFAULT_WINDOW_ROWS, _attach_state,  # noqa: F401
                       _attention, _attention_implementation, _masked, _sdpa_masked_gqa,
                       _State, capture_window_queries, install, masked)
from ._model import (_host, _server_reads_device, _text_config,  # noqa: F401
                     attention_modules, geometry, planned_layers, register_model)

__all__ = ["ATTENTION_NAME", "DEFAULT_WINDOW_ROWS", "Compressor", "attention_modules",
           "cache_layer_kv", "capture_window_queries", "geometry", "install", "masked",
           "planned_layers", "register_model"]
