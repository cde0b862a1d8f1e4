"""laprox.hf: reading and writing one layer of a transformers cache, and the token positions a
forward fed."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch


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
