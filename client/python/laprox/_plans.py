"""laproxd's keep-plan responses as laprox.KeepPlan: the parsed message's fields as numpy arrays.
Positions and scores are `bytes` fields of little-endian int32 / float32 (laprox.proto), read
with one numpy.frombuffer each."""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from . import types as t
from ._proto import policy_from_proto


def _array(data: bytes, dtype: str) -> np.ndarray:
    """A bytes field as its 4-byte elements; trailing bytes short of one are ignored (as the C++
    client's v1::PositionsOf does)."""
    return np.frombuffer(data, dtype=dtype, count=len(data) // 4)


def plan_from_proto(r: Any, outputs: t.Outputs,
                    cache_positions: Optional[List[np.ndarray]] = None) -> t.KeepPlan:
    """A KeepPlan from a ComputeKeepMaskResponse (with the `outputs` requested; a decode
    re-plan's with the cache positions sent)."""
    L, Hkv, n = r.num_layers, r.num_kv_heads, r.n
    positions = _array(r.positions, "<i4") if outputs.positions else None
    scores = _array(r.scores, "<f4") if outputs.scores else None
    bitmask = None
    if outputs.bitmask:
        bitmask = np.frombuffer(r.bitmask, dtype=np.uint8).reshape(L, Hkv, (n + 7) // 8)
    timing = r.timing
    return t.KeepPlan(
        num_layers=L, num_kv_heads=Hkv, n=n,
        counts=np.array(r.counts, dtype=np.int32).reshape(L, Hkv),
        offsets=np.array(r.offsets, dtype=np.int64),
        positions=positions,
        bitmask=bitmask,
        scores=None if scores is None else scores.reshape(L, Hkv, n),
        layer_sums=np.array(r.layer_sums, dtype=np.float64),
        window=r.window, sinks=r.sinks, quota=r.quota, selected_total=r.selected_total,
        tokens_per_head=r.tokens_per_head,
        effective_policy=policy_from_proto(r.effective_policy),
        timing=t.Timing(timing.queue_seconds, timing.validate_seconds, timing.score_seconds,
                        timing.select_seconds, timing.respond_seconds, timing.total_seconds),
        blocks=_decode_blocks(r) if r.HasField("blocks") else None,
        cache_positions=cache_positions)


def _decode_blocks(r: Any) -> t.BlockPlan:
    b = r.blocks
    paged = len(b.freed_offsets) > 0
    units = max(len(b.offsets) - 1, 0)
    return t.BlockPlan(
        block_size=b.block_size, num_blocks=b.num_blocks,
        offsets=np.array(b.offsets, dtype=np.int64),
        kept_blocks=np.array(b.kept_blocks, dtype=np.int32),
        block_scores=(np.array(b.block_scores, dtype=np.float64).reshape(units, b.num_blocks)
                      if len(b.block_scores) else None),
        new_block_table=np.array(b.new_block_table, dtype=np.int32) if paged else None,
        freed_block_ids=np.array(b.freed_block_ids, dtype=np.int32) if paged else None,
        freed_offsets=np.array(b.freed_offsets, dtype=np.int64) if paged else None)

