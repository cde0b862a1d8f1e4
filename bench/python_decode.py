"""How long the Python client takes to turn a keep-plan response into a laprox.KeepPlan: from
the serialized bytes gRPC hands it to numpy arrays, without laproxd (the same bytes every time).

Cases: 131,072 kept positions (SmolLM2-135M's 30 layers x 3 KV heads, n = 128K, ~1,456 kept per
head); the same with the scores of every token at n = 4096 ([30, 3, 4096] float32); and a
ComputeKeepPlans batch of 8 plans of 16,384 positions each. Prints the median and the best of
--rounds decodes per case, in ms.

Works on the client before and after positions and scores became `bytes` fields (issue 47):
it finds the decode function the installed client has.

    PYTHONPATH=client/python python3 bench/python_decode.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from laprox import types as t
from laprox._proto import pb

L, HKV = 30, 3


def _set_array(message, field: str, array: np.ndarray) -> None:
    """Sets a positions or scores field, a `bytes` field or (before) a packed repeated one."""
    if message.DESCRIPTOR.fields_by_name[field].type == message.DESCRIPTOR.fields_by_name[
            "bitmask"].type:
        setattr(message, field, array.tobytes())
    else:
        getattr(message, field).extend(array.tolist())


def response(n: int, total_positions: int, scores: bool) -> pb.ComputeKeepMaskResponse:
    rng = np.random.default_rng(0)
    r = pb.ComputeKeepMaskResponse(num_layers=L, num_kv_heads=HKV, n=n)
    per_head = np.full(L * HKV, total_positions // (L * HKV), dtype=np.int64)
    per_head[: total_positions - int(per_head.sum())] += 1
    r.counts.extend(per_head.tolist())
    r.offsets.extend(np.concatenate([[0], np.cumsum(per_head)]).tolist())
    positions = np.concatenate(
        [np.sort(rng.choice(n, size=int(c), replace=False)) for c in per_head]).astype("<i4")
    _set_array(r, "positions", positions)
    if scores:
        _set_array(r, "scores", rng.random(L * HKV * n, dtype=np.float32).astype("<f4"))
    r.layer_sums.extend([1.0] * L)
    return r


def decoder():
    """(name, decode one plan from bytes, decode a batch from bytes) of the installed client."""
    try:
        from laprox import _plans  # after: the generated parser, bytes fields

        def one(raw, outputs):
            return _plans.plan_from_proto(pb.ComputeKeepMaskResponse.FromString(raw), outputs)

        def batch(raw, outputs):
            return [_plans.plan_from_proto(p, outputs)
                    for p in pb.ComputeKeepPlansResponse.FromString(raw).plans]
        return "bytes fields (_plans)", one, batch
    except ImportError:
        from laprox import _wire  # before: packed fields read by a hand-written scanner

        def one(raw, outputs):
            return _wire._decode_plan(raw, outputs)

        def batch(raw, outputs):
            return [_wire._decode_plan(p, outputs) for p in _wire.plans_of(raw)]
        return "packed fields (_wire)", one, batch


def timed(fn, rounds: int):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        plan = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    from google.protobuf.internal import api_implementation
    name, one, batch = decoder()
    print(f"client: {name}; protobuf implementation: {api_implementation.Type()}")
    positions_only = t.Outputs(positions=True)
    with_scores = t.Outputs(positions=True, scores=True)
    cases = []
    r = response(131072, 131072, scores=False)
    cases.append(("131,072 positions", r.SerializeToString(), one, positions_only, 131072))
    r = response(4096, 131072 // 32, scores=True)
    cases.append(("positions + scores [30, 3, 4096]", r.SerializeToString(), one, with_scores,
                  r.counts and sum(r.counts)))
    b = pb.ComputeKeepPlansResponse()
    for _ in range(8):
        b.plans.add().CopyFrom(response(16384, 16384, scores=False))
    cases.append(("batch of 8 x 16,384 positions", b.SerializeToString(), batch, positions_only,
                  8 * 16384))
    print(f"{'case':36s} {'bytes':>10s} {'median ms':>10s} {'best ms':>8s}")
    for label, raw, fn, outputs, count in cases:
        median, best, plan = timed(lambda: fn(raw, outputs), args.rounds)
        plans = plan if isinstance(plan, list) else [plan]
        got = sum(int(p.positions.size) for p in plans)
        assert got == count, (label, got, count)
        print(f"{label:36s} {len(raw):10d} {median:10.3f} {best:8.3f}")


if __name__ == "__main__":
    main()
