#!/usr/bin/env python3
"""What the laprox.vllm plugin costs a vLLM request on the CPU: prefill + plan time per request
and decode speed, with and without the plugin, on the same machine in one run.

    build/vllm-venv/bin/python bench/vllm_overhead.py --laproxd build/service/laproxd \\
        --model build/vllm-model/SmolLM2-135M-Instruct [--sizes 1024,2048,4096] [--repeats 5]

(tests/integration/vllm/setup.sh builds the venv and the model.) Each configuration runs in its
own process (the plugin is installed per process), alternating off / on per round. A request is
one prompt of n random token ids: the prefill time is LLM.generate with max_tokens=1 (prefill,
the first token and, with the plugin, the keep-plan call that ends the prefill step); the decode
time is (generate with 1 + D tokens) - (generate with 1 token), per token. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams

    import laprox.vllm

    laprox.vllm.register()
    # No prefix caching: the second generate of a prompt must prefill it again.
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=8192,
              seed=0, enable_prefix_caching=False,
              kv_transfer_config=laprox.vllm.kv_transfer_config())
    results = {}
    for n in [int(x) for x in args.sizes.split(",")]:
        prefill, decode = [], []
        for r in range(args.repeats + 1):  # the first round warms up
            prompt = {"prompt_token_ids": [(7 * j + 13 * r) % 40000 + 100 for j in range(n)]}
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
            one = time.perf_counter() - started
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1 + args.decode_tokens,
                                                  temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
            many = time.perf_counter() - started
            if r > 0:
                prefill.append(one)
                decode.append((many - one) / args.decode_tokens)
        results[n] = {"prefill": prefill, "decode": decode}
    metrics = laprox.vllm.metrics()
    print("RESULT " + json.dumps({"results": results, "plans": metrics.plans,
                                  "failures": metrics.failures,
                                  "call_seconds": metrics.call_seconds,
                                  "capture_seconds": metrics.capture_seconds,
                                  "apply_seconds": metrics.apply_seconds}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "integration", "vllm"))
    from laproxd_support import Laproxd, use_laproxd

    use_laproxd(args.laproxd)
    server = Laproxd()
    base = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                LAPROX_VLLM_BUDGET=str(args.budget))
    command = [sys.executable, __file__, "--child", "--laproxd", args.laproxd, "--model",
               args.model, "--sizes", args.sizes, "--repeats", str(args.repeats),
               "--decode-tokens", str(args.decode_tokens)]
    runs = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                env = dict(base)
                if mode == "on":
                    env["LAPROX_VLLM_TARGET"] = server.target
                else:
                    env.pop("LAPROX_VLLM_TARGET", None)
                out = subprocess.run(command, env=env, capture_output=True, text=True,
                                     timeout=3600)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")),
                            None)
                if line is None:
                    print(out.stdout[-2000:], out.stderr[-2000:])
                    return 1
                runs[mode].append(json.loads(line[len("RESULT "):]))
    finally:
        server.stop()

    print(f"{args.rounds} rounds x {args.repeats} requests per size, budget {args.budget} "
          f"tokens per KV head, {args.decode_tokens} decode tokens; medians in ms")
    print("| n | prefill off | prefill on | on - off | decode/token off | decode/token on | "
          "decode on/off |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes.split(","):
        def median(mode: str, key: str) -> float:
            return 1000 * statistics.median(
                x for run in runs[mode] for x in run["results"][n][key])
        p_off, p_on = median("off", "prefill"), median("on", "prefill")
        d_off, d_on = median("off", "decode"), median("on", "decode")
        print(f"| {n} | {p_off:.1f} | {p_on:.1f} | {p_on - p_off:+.1f} | {d_off:.2f} | "
              f"{d_on:.2f} | {d_on / d_off:.2f} |")
    on = runs["on"]
    plans = sum(r["plans"] for r in on)
    print(f"plugin: {plans} plans, {sum(r['failures'] for r in on)} failures; per plan "
          f"{1000 * sum(r['call_seconds'] for r in on) / max(plans, 1):.1f} ms in the "
          f"laproxd call, {1000 * sum(r['capture_seconds'] for r in on) / max(plans, 1):.2f} "
          f"ms capturing queries; "
          f"{1000 * sum(r['apply_seconds'] for r in on):.0f} ms applying plans in decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
