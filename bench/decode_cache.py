#!/usr/bin/env python3
"""KV-cache size through a long generation (issue 37): the full cache, one plan after the
prefill, and re-planning at budget + buffer (laprox.hf.Compressor(decode_buffer=N)).

    # the runs (a venv with torch and transformers: the vLLM one) and their numbers:
    OMP_NUM_THREADS=2 build/vllm-venv/bin/python bench/decode_cache.py \\
        --laproxd=build/service/laproxd --json=bench/decode_cache.json
    # the plot (any Python with matplotlib, e.g. a venv with matplotlib==3.11.2):
    build/plot-venv/bin/python bench/decode_cache.py --plot=bench/decode_cache.png \\
        --from-json=bench/decode_cache.json

SmolLM2-135M-Instruct (build/vllm-model/SmolLM2-135M-Instruct) is prompted with the first
--prompt tokens of the licence texts in /usr/share/common-licenses and generates --new tokens
greedily (min_new_tokens = max_new_tokens, so the length is fixed) three times: with the full
cache; with Compressor(budget=B, compact=True, plan_shape="layer_uniform") (plan once, after the
prefill); with Compressor(budget=B, decode_buffer=N). A forward hook on the decoder, registered
after the compressor's, reads the cache after every forward: the mean over layers of the
entries per KV head, and the longest layer's. The JSON holds both series per run, the wall time
of each run and, for re-planning, the number of re-plans.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def licence_text() -> str:
    return "\n".join(open(p, errors="ignore").read()
                     for p in sorted(glob.glob("/usr/share/common-licenses/*"))
                     if os.path.isfile(p))


def run(args) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    import support  # this checkout's client with fresh stubs
    support.prepare_package()
    import laprox
    import laprox.hf as lhf

    tmp = tempfile.mkdtemp(prefix="laprox-cache-")
    sock = os.path.join(tmp, "laproxd.sock")
    server = subprocess.Popen([args.laproxd, "--socket=" + sock, "--metrics_listen=",
                               "--backend=cpu", "--threads=2"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(sock):
            time.sleep(0.05)
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
        model.eval()
        ids = tok(licence_text(), return_tensors="pt").input_ids[:, :args.prompt]
        client = laprox.Client("unix:" + sock, timeout=60)
        model_id = lhf.register_model(client, model)
        L = model.config.num_hidden_layers
        runs = {}
        for name in ("full cache", "plan after the prefill", "re-plan at budget + buffer"):
            press = None
            if name == "plan after the prefill":
                press = lhf.Compressor(model, client, budget=args.budget, model_id=model_id,
                                       compact=True, plan_shape="layer_uniform")
            elif name.startswith("re-plan"):
                press = lhf.Compressor(model, client, budget=args.budget, model_id=model_id,
                                       decode_buffer=args.buffer)
            if press is not None:
                press.attach()
            means, longest = [], []

            def record(module, inputs, output):
                cache = output.past_key_values
                lengths = [lhf.cache_layer_kv(cache, l)[0].shape[2] for l in range(L)]
                means.append(float(np.mean(lengths)))
                longest.append(int(max(lengths)))
            hook = model.get_decoder().register_forward_hook(record)
            started = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                               do_sample=False)
            seconds = time.perf_counter() - started
            hook.remove()
            runs[name] = dict(mean=means, longest=longest, seconds=seconds,
                              replans=getattr(press, "replans", 0),
                              timeouts=getattr(press, "timeouts", 0))
            if press is not None:
                press.detach()
            print(f"{name}: {seconds:.1f} s, mean entries per head at the end {means[-1]:.1f}, "
                  f"largest mean {max(means):.1f}, longest layer {max(longest)}, "
                  f"re-plans {runs[name]['replans']}", flush=True)
        client.close()
    finally:
        server.terminate()
        server.wait()
    return dict(model=os.path.basename(os.path.normpath(args.model)), prompt=int(ids.shape[1]),
                new=args.new, budget=args.budget, buffer=args.buffer, runs=runs,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"full cache": "tab:gray", "plan after the prefill": "tab:orange",
              "re-plan at budget + buffer": "tab:blue"}
    for name, run_ in data["runs"].items():
        # Entry i: after forward i (0: the prefill); the x axis counts generated tokens.
        x = list(range(len(run_["mean"])))
        ax.plot(x, run_["mean"], color=styles[name], label=f"{name}: mean over layers")
        if name != "full cache":
            ax.plot(x, run_["longest"], color=styles[name], linestyle=":", linewidth=1,
                    label=f"{name}: longest layer")
    b, n = data["budget"], data["buffer"]
    ax.axhline(b + n, color="tab:blue", linestyle="--", linewidth=0.8,
               label=f"budget + buffer = {b} + {n}")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV entries per head")
    ax.set_title(f"{data['model']}: prompt {data['prompt']} tokens, budget {b}, buffer {n}")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", default=os.path.join(HERE, "..", "build", "service", "laproxd"))
    ap.add_argument("--model", default=os.path.join(HERE, "..", "build", "vllm-model",
                                                    "SmolLM2-135M-Instruct"))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
    else:
        data = run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f)
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
