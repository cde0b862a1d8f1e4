"""Attention with evicted entries left out: the one computation laprox.hf and laprox.vllm run
when a sequence decodes over a cache that a keep-plan masks rather than shrinks.

What stays engine-specific is how each finds the keys and values and builds the mask:
laprox.hf keeps transformers' whole cache and an additive bias per layer (-inf at evicted
positions, built once per plan); laprox.vllm gathers the kept entries from vLLM's paged blocks
and a boolean mask of the valid ones. Both hand the result here.
"""

from __future__ import annotations

from typing import Optional

import torch


def _sdpa_supports_gqa() -> bool:
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 5)


# torch >= 2.5: scaled_dot_product_attention reads the KV heads as they are (enable_gqa).
SDPA_GQA = _sdpa_supports_gqa()


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, scale: Optional[float],
                     dropout: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over the KV heads as they are, for grouped-query
    attention: query [B, H, q, d], key and value [B, Hkv, kv, d] (H a multiple of Hkv), mask
    broadcastable to [B, H, q, kv], boolean (True = attend) or additive (-inf = evicted), with
    query head h reading KV head h // (H / Hkv). Returns [B, H, q, d].

    With torch >= 2.5 the keys and values are not copied to every query head (enable_gqa);
    before, they are repeated (a copy of what is attended)."""
    group = query.shape[1] // key.shape[1]
    if group > 1 and not SDPA_GQA:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    extra = {"enable_gqa": True} if group > 1 and SDPA_GQA else {}
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, **extra)
