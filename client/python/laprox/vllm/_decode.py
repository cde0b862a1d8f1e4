"""The attention side of laprox.vllm: capturing a prefill's last window queries, the masked
decode of sequences under a plan (laprox._attention.masked_attention over the kept entries
gathered from vLLM's paged blocks), and the strided views through which laproxd reads a layer's
blocks in place."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from .._attention import masked_attention
from ._state import STATE, _Compressed, _wire_dtype


def _layer_index(layer: Any) -> Optional[int]:
    """The layer's index among the planned layers (STATE.layer_names), None for a layer of
    another KV cache group (a sliding-window one), left to vLLM."""
    return STATE.planned.get(layer.layer_name)


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

