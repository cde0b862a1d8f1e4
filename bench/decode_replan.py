#!/usr/bin/env python3
"""What one decode re-plan costs against one decode step (issue 37), on a real model.

    build/vllm-venv/bin/python bench/decode_replan.py --laproxd=build/service/laproxd \\
        [--model=build/vllm-model/SmolLM2-135M-Instruct] [--caches=384,768,1536] [--rounds=15]
    # or against a running laproxd: --target=unix:/path/to.sock

For every cache length c (entries per KV head; a re-plan at budget B + buffer N happens when the
cache holds c = B + N) the script prefills a prompt of c tokens cut from the licence texts in
/usr/share/common-licenses, then, interleaved round by round on the same cache:

- decode step: one forward of one token over the c-entry cache (HF transformers, SDPA, the
  model's dtype, torch threads as set by OMP_NUM_THREADS), the step that re-planning adds to;
- re-plan: laprox.Client.compute_keep_plan with cache_positions (every layer's c entries, the
  window's 32 queries), budget c - N with N = c / 3 (B = 2N), client wall time: host copies into
  the client's shared memory, the gRPC call, laproxd's scoring and selection; and laproxd's own
  total (Timing.total_seconds) and score stage;
- the same call with indicator "attention" (no value side): its score stage is the part a
  per-sequence session could not save, since every attention column depends on the new window.

A re-plan runs once per N decode steps, so its cost per generated token is re-plan / N; the
table gives both. Medians over --rounds rounds with the lowest and highest round. Prints a
markdown table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# This checkout's client with freshly compiled stubs (as the Python tests use it), whatever
# version the venv has installed.
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import support  # noqa: E402

support.prepare_package()

import laprox  # noqa: E402
import laprox.hf  # noqa: E402

WINDOW = 32


def licence_text() -> str:
    return "\n".join(open(p, errors="ignore").read()
                     for p in sorted(glob.glob("/usr/share/common-licenses/*"))
                     if os.path.isfile(p))


def start_laproxd(path: str):
    tmp = tempfile.mkdtemp(prefix="laprox-replan-")
    sock = os.path.join(tmp, "laproxd.sock")
    log = open(os.path.join(tmp, "log"), "w")
    proc = subprocess.Popen([path, "--socket=" + sock, "--metrics_listen=", "--backend=cpu",
                             "--threads=2"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("laproxd did not start: " + open(log.name).read())
        time.sleep(0.05)
    return proc, "unix:" + sock


def spread(xs):
    return statistics.median(xs), min(xs), max(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", default=None)
    ap.add_argument("--target", default=None)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "build", "vllm-model",
                                                    "SmolLM2-135M-Instruct"))
    ap.add_argument("--caches", default="384,768,1536")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    proc = None
    target = args.target
    if target is None:
        proc, target = start_laproxd(args.laproxd or os.path.join(HERE, "..", "build", "service",
                                                                  "laproxd"))
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
        model.eval()
        ids = tok(licence_text(), return_tensors="pt").input_ids
        client = laprox.Client(target, timeout=60)
        model_id = laprox.hf.register_model(client, model)
        g = laprox.hf.geometry(model)
        rows = []
        for c in [int(x) for x in args.caches.split(",")]:
            buffer = c // 3
            budget = c - buffer
            prompt = ids[:, :c]
            with torch.no_grad(), laprox.hf.capture_window_queries(model, WINDOW) as captured:
                cache = DynamicCache()
                out = model(prompt, past_key_values=cache, use_cache=True)
                queries = [captured[l][0].float().numpy() for l in range(g.num_layers)]
            keys = [laprox.hf.cache_layer_kv(cache, l)[0][0].float().numpy()
                    for l in range(g.num_layers)]
            values = [laprox.hf.cache_layer_kv(cache, l)[1][0].float().numpy()
                      for l in range(g.num_layers)]
            positions = [np.tile(np.arange(c, dtype=np.int32), (g.num_kv_heads, 1))
                         for _ in range(g.num_layers)]
            nxt = out.logits[:, -1:].argmax(-1)
            step_s, call_s, server_s, score_s, attention_s = [], [], [], [], []
            for _ in range(args.rounds):
                # One decode step over the c-entry cache, then the cache cut back to c so that
                # every round measures the same step.
                with torch.no_grad():
                    t0 = time.perf_counter()
                    model(nxt, past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([c]))
                    step_s.append(time.perf_counter() - t0)
                cache.crop(c)
                t0 = time.perf_counter()
                plan = client.compute_keep_plan(model_id, keys, values, window_queries=queries,
                                                cache_positions=positions, budget=budget,
                                                window=WINDOW)
                call_s.append(time.perf_counter() - t0)
                server_s.append(plan.timing.total_seconds)
                score_s.append(plan.timing.score_seconds)
                # The same call without the value side (indicator ATTENTION): all that a
                # per-sequence session caching each entry's ||v W_O|| could save at most.
                bare = client.compute_keep_plan(model_id, keys, values, window_queries=queries,
                                                cache_positions=positions, budget=budget,
                                                window=WINDOW, indicator="attention")
                attention_s.append(bare.timing.score_seconds)
            step, call = spread(step_s), spread(call_s)
            kv_bytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values))
            rows.append(dict(cache=c, budget=budget, buffer=buffer, kv_bytes=kv_bytes,
                             step_s=step, call_s=call, server_s=spread(server_s),
                             score_s=spread(score_s), attention_s=spread(attention_s),
                             per_token_ratio=call[0] / buffer / step[0],
                             call_over_step=call[0] / step[0]))
            print(f"c={c}: step {step[0] * 1e3:.2f} ms, re-plan {call[0] * 1e3:.2f} ms "
                  f"(server {rows[-1]['server_s'][0] * 1e3:.2f} ms)", flush=True)
        client.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()

    print(f"\nModel {os.path.basename(os.path.normpath(args.model))} ({g.num_layers} layers, "
          f"{g.num_heads} heads, {g.num_kv_heads} KV heads, d {g.head_dim}), "
          f"{platform.processor() or platform.machine()}, torch threads "
          f"{torch.get_num_threads()}, laproxd --threads=2, {args.rounds} rounds, window "
          f"{WINDOW}. Median (lowest–highest round).\n")
    print("| cache c = B + N | B / N | K+V sent | decode step | re-plan (client) | laproxd total "
          "| of which scoring | scoring, attention side only | re-plan / step "
          "| re-plan / N / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def ms(t):
        return f"{t[0] * 1e3:.2f} ({t[1] * 1e3:.2f}–{t[2] * 1e3:.2f}) ms"
    for r in rows:
        print(f"| {r['cache']} | {r['budget']} / {r['buffer']} | {r['kv_bytes'] / 2**20:.1f} MiB "
              f"| {ms(r['step_s'])} | {ms(r['call_s'])} | {ms(r['server_s'])} "
              f"| {ms(r['score_s'])} | {ms(r['attention_s'])} | {r['call_over_step']:.2f} "
              f"| {r['per_token_ratio']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
