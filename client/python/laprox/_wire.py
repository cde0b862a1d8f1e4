"""Reading laproxd's keep-plan responses: the parsed message, and its large packed fields
(positions, scores) straight from the serialized bytes as numpy views, without a per-element
conversion. The field numbers read from the bytes are named here once;
tests/python/test_client.py pins each to the generated descriptor."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from . import types as t
from ._proto import pb, policy_from_proto

# Top-level fields read from the serialized bytes (the rest is read from the parsed message).
PLANS_FIELD = 1      # ComputeKeepPlansResponse.plans (ComputeKeepMaskResponse each)
POSITIONS_FIELD = 6  # ComputeKeepMaskResponse.positions: packed sfixed32
SCORES_FIELD = 8     # ComputeKeepMaskResponse.scores: packed float


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _packed_chunks(data: bytes, fields: Tuple[int, ...]) -> Dict[int, List[memoryview]]:
    """The length-delimited records of the given top-level fields of a serialized message."""
    view = memoryview(data)
    chunks: Dict[int, List[memoryview]] = {}
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            if number in fields:
                chunks.setdefault(number, []).append(view[pos:pos + length])
            pos += length
        else:
            raise ValueError(f"wire type {wire_type}")
    return chunks


def _repeated(chunks: Dict[int, List[memoryview]], number: int, container: Any,
              dtype: str) -> np.ndarray:
    """A packed repeated fixed-width field as a numpy array: a view of the response bytes
    (no per-element conversion), or converted from the parsed message if it is not packed."""
    parts = chunks.get(number, [])
    if parts:
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        array = np.frombuffer(raw, dtype=dtype)
        if array.size == len(container):
            return array
    return np.array(container, dtype=dtype)



def plans_of(raw: Union[bytes, memoryview]) -> List[memoryview]:
    """The serialized plans of a ComputeKeepPlansResponse, in order."""
    return _packed_chunks(raw, (PLANS_FIELD,)).get(PLANS_FIELD, [])


def _decode_plan(raw: Union[bytes, memoryview], outputs: t.Outputs,
                 cache_positions: Optional[List[np.ndarray]] = None) -> t.KeepPlan:
    """A KeepPlan from the serialized ComputeKeepMaskResponse (with the `outputs` requested;
    for a batch, a view of one plan inside the ComputeKeepPlansResponse bytes; a decode
    re-plan's with the cache positions sent). Positions and scores are read straight from the
    packed bytes (sfixed32 / float), not element by element."""
    r = pb.ComputeKeepMaskResponse.FromString(raw)
    L, Hkv, n = r.num_layers, r.num_kv_heads, r.n
    chunks = _packed_chunks(raw, (POSITIONS_FIELD, SCORES_FIELD))
    positions = (_repeated(chunks, POSITIONS_FIELD, r.positions, "<i4") if outputs.positions
                 else None)
    scores = _repeated(chunks, SCORES_FIELD, r.scores, "<f4") if outputs.scores else None
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

