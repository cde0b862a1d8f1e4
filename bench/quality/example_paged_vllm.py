#!/usr/bin/env python3
"""A block plan for a paged KV cache read in place: a synthetic vLLM-layout pool, no torch.

    build/service/laproxd --socket=/tmp/laproxd.sock --metrics_listen= &
    python3 client/python/generate_stubs.py client/python/laprox/_gen     # or pip install
    PYTHONPATH=client/python python3 bench/quality/example_paged_vllm.py \\
        --target unix:/tmp/laproxd.sock [--n 1000] [--budget 256] [--block-size 16]

What an engine on the CPU would do after a prefill, with random numbers in place of a model:
SmolLM2-135M's geometry (30 layers, 9 query heads, 3 KV heads, head_dim 64, hidden 576) and a
random o_proj are registered; each layer's KV cache is a bf16 pool in vLLM's FlashAttention
layout [2, num_blocks, block_size, Hkv, d] in shared memory (Client.shared_array), the
sequence's logical blocks at shuffled physical ids among blocks other sequences would hold.
laproxd reads the pools in place through the block table (nothing is gathered or copied) and
answers a BLOCKS_SHARED plan: which logical blocks to keep, the new block table (their physical
ids) and the ids the engine may free. The script checks the new table against the original.
Needs numpy, grpcio, protobuf and the laprox package only.
"""

import argparse
import sys
import time

import numpy as np

import laprox

# SmolLM2-135M
GEOMETRY = laprox.ModelGeometry(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                hidden_size=576)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=laprox.DEFAULT_TARGET)
    ap.add_argument("--n", type=int, default=1000, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=256, help="kept tokens per KV head")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--spare-blocks", type=int, default=40,
                    help="pool blocks the sequence does not use (other sequences' blocks)")
    ap.add_argument("--window", type=int, default=32, help="window query rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    g, n, bs = GEOMETRY, args.n, args.block_size
    L, H, Hkv, d, D = g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size
    rng = np.random.default_rng(args.seed)
    used = -(-n // bs)
    num_blocks = used + args.spare_blocks
    block_table = rng.permutation(num_blocks)[:used].astype(np.int32)
    o_proj = (rng.standard_normal((L, D, H * d)) / np.sqrt(D)).astype(np.float32)

    with laprox.Client(args.target) as client:
        model = client.register_model("smollm2-135m-synthetic", g, o_proj)
        # The engine's pools: one per layer, as vLLM allocates them.
        pools = [client.shared_array((2, num_blocks, bs, Hkv, d), "bf16") for _ in range(L)]
        slot = np.arange(n)
        ids, offset = block_table[slot // bs], slot % bs
        for pool in pools:  # the prefill writes each token's keys and values into its slot
            keys = rng.standard_normal((n, Hkv, d)).astype(np.float32)
            values = rng.standard_normal((n, Hkv, d)) * rng.uniform(0.2, 3.0, (n, Hkv, 1))
            pool.array[0][ids, offset] = to_bf16_bits(keys)
            pool.array[1][ids, offset] = to_bf16_bits(values)
        paged = [laprox.PagedKV.vllm_flash_attn(pool, block_table, n) for pool in pools]
        queries = rng.standard_normal((L, H, args.window, d)).astype(np.float32)

        t0 = time.perf_counter()
        plan = client.compute_keep_plan(model, [k for k, _ in paged], [v for _, v in paged],
                                        queries, budget=args.budget, window=args.window,
                                        plan_shape="blocks_shared")
        elapsed = time.perf_counter() - t0
        blocks = plan.blocks
        kept, new_table, freed = blocks.kept(), blocks.new_table(), blocks.freed()
        pool_mib = sum(p.array.nbytes for p in pools) / 2**20

        print(f"model: {L} layers, {H} heads, {Hkv} KV heads, head_dim {d}; pools: {L} x "
              f"[2, {num_blocks}, {bs}, {Hkv}, {d}] bf16 in shared memory ({pool_mib:.1f} MiB, "
              f"read in place)")
        print(f"sequence: n = {n} tokens in {used} blocks of {bs} (last holds "
              f"{n - (used - 1) * bs}); budget {args.budget} tokens per KV head")
        print(f"block table     ({len(block_table)}): {block_table.tolist()}")
        print(f"kept blocks     ({len(kept)}): {kept.tolist()}")
        print(f"new block table ({len(new_table)}): {new_table.tolist()}")
        print(f"freed block ids ({len(freed)}): {freed.tolist()}")
        print(f"kept {int(plan.counts[0, 0])} of {n} tokens per (layer, KV head); "
              f"call {elapsed * 1e3:.1f} ms (server: score {plan.timing.score_seconds * 1e3:.1f}"
              f" ms, select {plan.timing.select_seconds * 1e3:.1f} ms)")

        evicted = np.setdiff1d(np.arange(used), kept)
        checks = {
            "new table = block_table[kept]": np.array_equal(new_table, block_table[kept]),
            "freed = block_table[evicted]": np.array_equal(freed, block_table[evicted]),
            "window block kept": used - 1 in kept,
            "every (layer, head) keeps the kept blocks' positions": all(
                np.array_equal(plan.kept(l, h), np.flatnonzero(np.isin(slot // bs, kept)))
                for l in range(L) for h in range(Hkv)),
        }
        for what, ok in checks.items():
            print(f"check: {what}: {'ok' if ok else 'FAILED'}")
        return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
