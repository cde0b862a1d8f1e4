#!/usr/bin/env python3
"""Decode re-plans in a real vLLM engine (laprox.vllm, LAPROX_VLLM_DECODE_BUFFER, issue 37): a
long generation keeps each sequence's blocks within budget + buffer, against the same engine
planning once after the prefill.

    replan.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct
              [--budget 128] [--buffer 64] [--tokens 512]

Each engine runs in a process of its own (the plugin reads its settings once per process), on
two prompts of 1,000 and 3,000 tokens (parity.py's seeded texts), greedy, exactly
--tokens generated tokens each, LAPROX_VLLM_MODE=compact with its default plan options
(LAYER_UNIFORM, max_layer_share 1.25, AVG pooling and one sink). After every engine step the scheduler's block list of
each running request is read. Checks:
  - with LAPROX_VLLM_DECODE_BUFFER=N, once a request is compacted it never holds more blocks
    than ceil(T / block_size), T = ceil(1.25 * (B - w)) + w + 1 + N + 1 (the longest layer
    max_layer_share allows after a plan, a padded slot, the buffer, the token of the step),
    while planned once it grows past that; re-plans happened (laprox_vllm_replans_total >= 2
    per request) and failed none; the pool's free blocks are back at their count once the
    requests end;
  - the greedy tokens of both engines are equal until the first re-plan (the same prefill plan
    and the same compaction); after it they may differ (another cache);
  - laprox.hf.Compressor(decode_buffer=N) generating from the same prompts (transformers' cache,
    its own re-plans and compaction) agrees with the re-planning engine at least as far as the
    engine planning once does (seen: 512 of 512 tokens on both prompts, against 512 and 347).
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

from laproxd_support import Laproxd, use_laproxd
from laprox.vllm._state import COMPACT_LAPROX_SCORING, COMPACT_POLICY
from parity import draw_prompts

POLICY = {**COMPACT_POLICY, **COMPACT_LAPROX_SCORING}  # the compacting plugin's defaults
WINDOW = 32


def child(args: argparse.Namespace, out_path: str) -> int:
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    import laprox.vllm

    laprox.vllm.register()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = draw_prompts(tokenizer, np.random.default_rng(args.seed), 2)[1:]
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=4096,
              seed=0, enable_prefix_caching=False, kv_transfer_config=laprox.vllm.kv_transfer_config())
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = core.scheduler.kv_cache_manager.block_pool
    held: dict = {}
    update = Scheduler.update_from_output

    def watching(self, scheduler_output, model_runner_output):
        result = update(self, scheduler_output, model_runner_output)
        for req_id, blocks in manager.req_to_blocks.items():
            request = self.requests.get(req_id)
            if request is not None:
                held.setdefault(req_id, []).append(
                    [int(request.num_computed_tokens), len(blocks)])
        return result

    Scheduler.update_from_output = watching
    free_before = pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, ignore_eos=True,
                            temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    metrics = laprox.vllm.metrics()
    result = dict(
        prompt_lens=[len(p) for p in prompts], block_size=manager.block_size,
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        # The scheduler's ids are the outputs' with a suffix ("0-<hash>").
        held=[next(v for k, v in held.items() if k.split("-")[0] == o.request_id)
              for o in outputs], free_before=free_before,
        free_after=pool.get_num_free_blocks(),
        metrics={name: getattr(metrics, name) for name in
                 ("plans", "failures", "compactions", "blocks_released", "replans")})
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def hf_tokens(args: argparse.Namespace, target: str, prompts: list) -> list:
    """The same generations through laprox.hf.Compressor(decode_buffer=N) (another engine,
    another implementation of the re-plans: transformers' cache compacted in place)."""
    import torch
    import transformers

    import laprox
    import laprox.hf

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    with laprox.Client(target) as client:
        press = laprox.hf.Compressor(model, client, budget=args.budget,
                                     decode_buffer=args.buffer, window=WINDOW, deadline=60,
                                     **POLICY)
        for prompt in prompts:
            with torch.no_grad(), press:
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens,
                                     min_new_tokens=args.tokens, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


def run_child(args: argparse.Namespace, target: str, buffer: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, LAPROX_VLLM_TARGET=target, LAPROX_VLLM_BUDGET=str(args.budget),
               LAPROX_VLLM_MODE="compact", LAPROX_VLLM_DECODE_BUFFER=str(buffer),
               LAPROX_VLLM_WINDOW=str(WINDOW), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               LAPROX_VLLM_POLICY=json.dumps(POLICY),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    command = [sys.executable, __file__, "--child", "--out", out, "--model", args.model,
               "--budget", str(args.budget), "--tokens", str(args.tokens),
               "--seed", str(args.seed)]
    print(f"== LAPROX_VLLM_DECODE_BUFFER={buffer}", flush=True)
    subprocess.run(command, env=env, check=True)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        return child(args, args.out)
    use_laproxd(args.laproxd)
    server = Laproxd()
    try:
        replan = run_child(args, server.target, args.buffer)
        once = run_child(args, server.target, 0)
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        prompts = draw_prompts(tokenizer, np.random.default_rng(args.seed), 2)[1:]
        print("== the same generations through laprox.hf (decode_buffer)", flush=True)
        hf = hf_tokens(args, server.target, prompts)
    finally:
        server.stop()
    ok = True
    bs = replan["block_size"]
    bound_tokens = math.ceil(1.25 * (args.budget - WINDOW)) + WINDOW + 1 + args.buffer + 1
    bound = -(-bound_tokens // bs)
    m = replan["metrics"]
    good = m["replans"] >= 2 * len(replan["tokens"]) and m["failures"] == 0 \
        and replan["free_after"] == replan["free_before"]
    print(f"   re-planning: {m}; free blocks {replan['free_before']} before, "
          f"{replan['free_after']} after{'' if good else ' <- FAIL'}")
    ok = ok and good
    for i, (steps, steps_once, prompt_len) in enumerate(zip(replan["held"], once["held"],
                                                           replan["prompt_lens"])):
        after = [blocks for computed, blocks in steps if computed > prompt_len + 1]
        after_once = [blocks for computed, blocks in steps_once if computed > prompt_len + 1]
        good = max(after) <= bound < max(after_once)
        print(f"   request {i} ({prompt_len} prompt tokens): blocks held while decoding "
              f"{min(after)}-{max(after)} re-planning, {min(after_once)}-{max(after_once)} "
              f"planned once; bound {bound} ({bound_tokens} entries, block size {bs})"
              f"{'' if good else ' <- FAIL'}")
        ok = ok and good
    def agreeing(a: list, b: list) -> int:
        return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    for i, (a, b, c) in enumerate(zip(replan["tokens"], once["tokens"], hf)):
        # The first re-plan comes when the mean entries per head reach B + N, not before N
        # generated tokens: until then both engines decode the same compacted cache.
        same_once, same_hf = agreeing(a, b), agreeing(a, c)
        good = same_once >= args.buffer
        print(f"   request {i}: {same_once} of {len(a)} greedy tokens equal to the engine "
              f"planning once (re-plans start after {args.buffer} or more)"
              f"{'' if good else ' <- FAIL'}")
        ok = ok and good
        # laprox.hf's re-plans of the same sequence (its own cache, its own compaction) must
        # agree at least as far as not re-planning does: the re-plans are the same ones.
        good = same_hf >= same_once
        print(f"   request {i}: {same_hf} of {len(a)} greedy tokens equal to laprox.hf's "
              f"re-planning generation{'' if good else ' <- FAIL'}")
        ok = ok and good
    print("replan: all checks passed" if ok else "replan: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
