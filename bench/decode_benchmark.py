#!/usr/bin/env python3
"""Decode speed and KV-cache memory: full cache vs a laprox-compacted cache, end to end through
the Hugging Face integration (laprox.hf.Compressor, compact=True, plan_shape="layer_uniform").

    # bench/quality/run.sh's venv and model (build/quality-venv, build/quality-model/) and a
    # laproxd binary (started here on a private Unix socket, CPU backend, no metrics port):
    OMP_NUM_THREADS=2 build/quality-venv/bin/python bench/decode_benchmark.py \\
        --laproxd=build/service/laproxd [--lengths=4096,8192,16384] [--budget=256] \\
        [--new-tokens=64] [--plot=bench/decode_memory.png]
    # or against a running laproxd: --target=unix:/path/to.sock
    # where the decode time goes (cProfile of the decode steps, full and compressed; no table):
    ... bench/decode_benchmark.py --laproxd=... --profile=1400 --new-tokens=40
    # decode steps only, interleaved on one prefill: full cache, compacted with another
    # version of laprox.hf's attention function (OLD/laprox/hf/_masking.py, or the single
    # module OLD/laprox/hf.py of before 2026-12-06), compacted with the installed one:
    ... bench/decode_benchmark.py --laproxd=... --ab=16384 --baseline-hf=OLD/_masking.py \\
        --new-tokens=33 --ab-rounds=5

For every prompt length n (a prompt of exactly n tokens cut from the licence texts in
/usr/share/common-licenses, repeated; quality is not measured here) the full-cache generate() and
the compressed one run back to back (the order alternates from one n to the next, so neither
always runs on the warmer machine), each greedy with the same number of new tokens. Per run:

- prefill: from generate() to the first token, minus the plan time for the compressed run;
- plan: the Compressor's work after the prefill forward, split into the laproxd call
  (compute_keep_plan: host copies, shared memory, scoring) and the rest (keep masks, gathering
  the kept keys/values into the compacted cache, the attention masks);
- decode tokens/s: (new tokens - 1) / (time of the last token - time of the first token), and
  1 / the median time between two tokens (robust to other processes on a shared machine);
- KV bytes: the sum of the cache tensors' bytes at the end of generate() (the cache is largest
  then); for the compressed run also its prefill peak, the full n-token cache that exists
  before compaction (the integration compresses after the prefill, so it does not lower the
  prefill's peak).

Prints a markdown table (and, with --json, writes the numbers) and plots KV bytes and decode
tokens/s against n to --plot.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import glob
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/quality/evaluate.py
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import laprox  # noqa: E402
import laprox.hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "build", "quality-model")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(model_dir: str):
    """The fp32 safetensors copy that bench/quality/evaluate.py makes of the GGUF (hf/), made
    here the same way when missing."""
    hf_logging.disable_progress_bar()
    converted = os.path.join(model_dir, "hf")
    if not os.path.isfile(os.path.join(converted, "model.safetensors")):
        sys.path.insert(0, os.path.join(ROOT, "bench", "quality"))
        import evaluate  # noqa: E402  (converts and caches; prints what it does)
        return evaluate.load_model(os.path.join(model_dir, GGUF_NAME))
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return tok, model.eval()


def prompt_tokens(tok: Any, n_max: int) -> torch.Tensor:
    """[n_max] token ids: the licence texts, tokenized once and repeated."""
    texts = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                texts.append(f.read())
    ids = tok("\n\n".join(texts), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    reps = -(-n_max // ids.numel())
    return ids.repeat(reps)[:n_max]


class Clock(StoppingCriteria):
    """Records the time each new token is appended (generate() calls it once per token)."""

    def __init__(self, profile: Optional[cProfile.Profile] = None) -> None:
        self.times: List[float] = []
        self.profile = profile  # enabled from the first token on: the decode steps only

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any):
        self.times.append(time.perf_counter())
        if self.profile is not None and len(self.times) == 1:
            self.profile.enable()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def kv_bytes(cache: Any, num_layers: int) -> int:
    total = 0
    for l in range(num_layers):
        k, v = laprox.hf.cache_layer_kv(cache, l)
        total += k.numel() * k.element_size() + v.numel() * v.element_size()
    return total


class TimedClient:
    """Forwards to a laprox.Client, timing compute_keep_plan."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.call_s = 0.0

    def compute_keep_plan(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        try:
            return self._client.compute_keep_plan(*args, **kwargs)
        finally:
            self.call_s += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def run_once(model: Any, ids: torch.Tensor, new_tokens: int, press: Optional[Any],
             timed: Optional[TimedClient], profile: Optional[cProfile.Profile] = None
             ) -> Dict[str, Any]:
    L = model.config.num_hidden_layers
    clock = Clock(profile)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               attention_mask=torch.ones_like(ids), pad_token_id=0,
               stopping_criteria=[clock], return_dict_in_generate=True)
    stats: Dict[str, float] = {"compress_s": 0.0, "prefill_kv": 0}
    if press is not None:
        compress = press.compress

        def timed_compress(cache: Any, queries: Any) -> Any:
            stats["prefill_kv"] = kv_bytes(cache, L)
            t0 = time.perf_counter()
            try:
                return compress(cache, queries)
            finally:
                stats["compress_s"] += time.perf_counter() - t0
        press.compress = timed_compress
        timed.call_s = 0.0
    gc.collect()
    try:
        with torch.no_grad(), (press if press is not None else _nothing()):
            t0 = time.perf_counter()
            out = model.generate(ids, **gen)
            if profile is not None:
                profile.disable()
    finally:
        if press is not None:
            del press.compress  # back to the class's method
    times = clock.times
    assert len(times) == new_tokens, (len(times), new_tokens)
    first = times[0] - t0
    decode_s = times[-1] - times[0]
    steps = sorted(b - a for a, b in zip(times, times[1:]))
    res = {
        "first_token_s": first,
        "prefill_s": first - stats["compress_s"],
        "plan_s": stats["compress_s"],
        "plan_call_s": timed.call_s if press is not None else 0.0,
        "compaction_s": stats["compress_s"] - (timed.call_s if press is not None else 0.0),
        "decode_s": decode_s,
        "decode_tok_s": (new_tokens - 1) / decode_s,
        # 1 / the median step: what a step costs when nothing else runs on the machine's cores
        # meanwhile (the mean above also counts the steps that another process slowed down).
        "decode_tok_s_median": 1.0 / steps[len(steps) // 2],
        "step_s": [b - a for a, b in zip(times, times[1:])],
        "kv_bytes": kv_bytes(out.past_key_values, L),
        "prefill_kv_bytes": stats["prefill_kv"] if press is not None
        else kv_bytes(out.past_key_values, L),
        "tokens": out.sequences[0, ids.shape[1]:].tolist(),
    }
    if press is not None:
        res["kept"] = int(press.plan.counts.sum())
        # Layers whose KV heads kept different counts: their compacted cache has padded slots,
        # so decoding there still needs a mask.
        res["padded_layers"] = int(sum(len(set(c.tolist())) > 1 for c in press.plan.counts))
        res["compacted"] = bool(press.compacted)
    del out
    gc.collect()
    return res


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def start_laproxd(binary: str):
    folder = tempfile.mkdtemp(prefix="laprox-decode.")
    socket = os.path.join(folder, "laproxd.sock")
    log = open(os.path.join(folder, "laproxd.log"), "w")
    proc = subprocess.Popen([binary, f"--socket={socket}", "--metrics_listen=",
                             "--backend=cpu", "--threads=2"], stdout=log, stderr=log)
    for _ in range(100):
        if os.path.exists(socket):
            return proc, f"unix:{socket}", folder
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    with open(os.path.join(folder, "laproxd.log")) as f:
        raise SystemExit(f"laproxd did not start:\n{f.read()}")


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def table(rows: List[Dict[str, Any]], budget: int, new_tokens: int) -> str:
    lines = [
        "| n | cache | KV MiB (decode) | KV MiB (prefill peak) | prefill s | plan s (laproxd "
        f"call + compaction) | decode tok/s, mean of {new_tokens - 1} steps | speed-up | "
        "decode tok/s, median step | speed-up (median) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f, c = r["full"], r["compressed"]
        lines.append(f"| {r['n']} | full | {mib(f['kv_bytes'])} | {mib(f['prefill_kv_bytes'])} | "
                     f"{f['prefill_s']:.1f} | – | {f['decode_tok_s']:.2f} | 1.00x | "
                     f"{f['decode_tok_s_median']:.2f} | 1.00x |")
        lines.append(f"| {r['n']} | laprox B={budget}, compact | {mib(c['kv_bytes'])} | "
                     f"{mib(c['prefill_kv_bytes'])} | {c['prefill_s']:.1f} | "
                     f"{c['plan_s']:.2f} ({c['plan_call_s']:.2f} + {c['compaction_s']:.2f}) | "
                     f"{c['decode_tok_s']:.2f} | {c['decode_tok_s'] / f['decode_tok_s']:.2f}x | "
                     f"{c['decode_tok_s_median']:.2f} | "
                     f"{c['decode_tok_s_median'] / f['decode_tok_s_median']:.2f}x |")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], budget: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [r["n"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (("full", "full cache", "o-"),
                              ("compressed", f"laprox B={budget}, compact", "s-")):
        ax1.plot(ns, [r[key]["kv_bytes"] / 2**20 for r in rows], style, label=label)
        ax2.plot(ns, [r[key]["decode_tok_s_median"] for r in rows], style,
                 label=f"{label} (median step)")
        ax2.plot(ns, [r[key]["decode_tok_s"] for r in rows], style[0] + ":", alpha=0.5,
                 color=ax2.lines[-1].get_color(), label=f"{label} (mean)")
    ax1.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([f"{n // 1024}K" for n in ns])
        ax.set_xlabel("prompt tokens n")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("KV cache during decode (MiB, log)")
    ax2.set_ylabel("decode tokens/s")
    ax1.set_title("KV-cache bytes")
    ax2.set_title("decode speed (greedy, CPU, 2 threads)")
    fig.suptitle("SmolLM2-135M-Instruct, transformers generate(), laprox.hf compact=True")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def decode_ab(model: Any, client: Any, model_id: int, ids: torch.Tensor, budget: int,
              policy: str, baseline_hf: str, steps: int, rounds: int) -> None:
    """Decode steps only, interleaved on one prefill: the full cache, the compacted cache
    decoded by the `laprox` attention function of `baseline_hf` (another version of
    laprox/hf/_masking.py, or of the single module hf.py it was before), and the
    compacted cache decoded by the installed laprox.hf. Each round
    decodes `steps` greedy tokens from a fresh copy of each cache; prints the median step."""
    import copy
    import importlib.util
    from transformers import AttentionInterface, DynamicCache
    # Named inside the package its relative imports expect.
    name = "laprox._hf_baseline" if os.path.basename(baseline_hf) == "hf.py" \
        else "laprox.hf._masking_baseline"
    spec = importlib.util.spec_from_file_location(name, baseline_hf)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    n = ids.shape[1]
    press = laprox.hf.Compressor(model, client, budget=budget, policy=policy,
                                 model_id=model_id, compact=True, plan_shape="layer_uniform")
    full = DynamicCache(config=model.config)
    with laprox.hf.capture_window_queries(model, press.window_rows) as captured, \
            torch.no_grad():
        out = model(ids, past_key_values=full, use_cache=True, logits_to_keep=1)
    queries = [captured[l] for l in range(model.config.num_hidden_layers)]
    first = out.logits[:, -1:].argmax(-1)
    compact = copy.deepcopy(full)
    press.attach()  # the keep masks live on the attention modules while attached
    with torch.no_grad():
        press.compress(compact, queries)

    def decode(cache: Any, impl: str) -> List[float]:
        cache = copy.deepcopy(cache)
        model.set_attn_implementation(impl)
        token, times = first, []
        with torch.no_grad():
            for i in range(steps):
                t0 = time.perf_counter()
                o = model(token, past_key_values=cache, cache_position=torch.tensor([n + i]),
                          position_ids=torch.tensor([[n + i]]), logits_to_keep=1)
                token = o.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t0)
        return times

    variants = {"full cache (sdpa)": ("sdpa", None),
                "compacted, baseline": (laprox.hf.ATTENTION_NAME, baseline._attention),
                "compacted, this laprox.hf": (laprox.hf.ATTENTION_NAME, laprox.hf._attention)}
    samples: Dict[str, List[float]] = {k: [] for k in variants}
    try:
        for _ in range(rounds):
            for name, (impl, fn) in variants.items():
                if fn is not None:
                    AttentionInterface.register(laprox.hf.ATTENTION_NAME, fn)
                samples[name] += decode(full if fn is None else compact, impl)[1:]
    finally:
        AttentionInterface.register(laprox.hf.ATTENTION_NAME, laprox.hf._attention)
        press.detach()
    padded = int(sum(len(set(c.tolist())) > 1 for c in press.plan.counts))
    print(f"n={n}, budget {budget}, {rounds} rounds x {steps - 1} timed steps each, "
          f"{padded} of {len(press.plan.counts)} compacted layers padded:")
    print("| variant | median step ms | tok/s (median) | mean step ms |")
    print("|---|---:|---:|---:|")
    for name, xs in samples.items():
        xs = sorted(xs)
        med = xs[len(xs) // 2]
        print(f"| {name} | {med * 1e3:.1f} | {1 / med:.2f} | {sum(xs) / len(xs) * 1e3:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="a running laproxd (unix:PATH); else --laproxd")
    ap.add_argument("--laproxd", help="laproxd binary to start on a private socket")
    ap.add_argument("--model-dir", default=MODEL_DIR)
    ap.add_argument("--lengths", default="4096,8192,16384")
    ap.add_argument("--budget", type=int, default=256, help="kept tokens per KV head")
    ap.add_argument("--policy", default="laprox")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "decode_memory.png"))
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--profile", type=int, metavar="N",
                    help="only profile the decode steps of one full and one compressed "
                    "generate() at prompt length N (cProfile, sorted by own time)")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--ab", type=int, metavar="N",
                    help="only compare decode steps at prompt length N: full cache, compacted "
                    "with --baseline-hf's attention function, compacted with this laprox.hf")
    ap.add_argument("--baseline-hf", help="another version of laprox/hf/_masking.py (or of "
                    "hf.py, the single module it was before) for --ab")
    ap.add_argument("--ab-rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.target and not args.laproxd:
        ap.error("give --target or --laproxd")

    checkout_hf = os.path.join(ROOT, "client", "python", "laprox", "hf")
    installed_hf = os.path.dirname(laprox.hf.__file__)
    for name in sorted(f for f in os.listdir(checkout_hf) if f.endswith(".py")):
        with open(os.path.join(installed_hf, name), "rb") as a, \
                open(os.path.join(checkout_hf, name), "rb") as b:
            if a.read() != b.read():  # the venv's copy is installed, not imported from the tree
                print(f"warning: {installed_hf}/{name} differs from {checkout_hf}/{name}: "
                      "pip install --no-deps client/python into this venv first",
                      file=sys.stderr)
    proc = folder = None
    if args.laproxd:
        proc, args.target, folder = start_laproxd(args.laproxd)
    try:
        tok, model = load_model(args.model_dir)
        lengths = [args.profile or args.ab] if (args.profile or args.ab) else \
            [int(x) for x in args.lengths.split(",")]
        all_ids = prompt_tokens(tok, max(lengths))
        client = TimedClient(laprox.Client(args.target, timeout=600))
        model_id = laprox.hf.register_model(client, model)

        def compressor():
            return laprox.hf.Compressor(model, client, budget=args.budget, policy=args.policy,
                                        model_id=model_id, compact=True,
                                        plan_shape="layer_uniform")

        # Warm-up (thread pools, allocator, laproxd's first request) at a short length.
        warm = all_ids[:512].unsqueeze(0)
        run_once(model, warm, 4, None, None)
        run_once(model, warm, 4, compressor(), client)

        if args.ab:
            decode_ab(model, client, model_id, all_ids[:args.ab].unsqueeze(0), args.budget,
                      args.policy, args.baseline_hf, args.new_tokens, args.ab_rounds)
            return 0
        if args.profile:
            ids = all_ids[:args.profile].unsqueeze(0)
            for kind in ("full", "compressed"):
                prof = cProfile.Profile()
                r = run_once(model, ids, args.new_tokens,
                             compressor() if kind == "compressed" else None, client,
                             profile=prof)
                print(f"== {kind}, n={args.profile}: first token {r['first_token_s']:.2f} s "
                      f"(plan {r['plan_s']:.2f} s: laproxd call {r['plan_call_s']:.2f} s), "
                      f"decode {r['decode_tok_s']:.2f} tok/s over {args.new_tokens - 1} steps "
                      "(profiled: slower than unprofiled); decode steps only:")
                stats = pstats.Stats(prof).strip_dirs()
                stats.sort_stats("tottime").print_stats(args.profile_rows)
            return 0

        rows = []
        for i, n in enumerate(lengths):
            ids = all_ids[:n].unsqueeze(0)
            order = ("full", "compressed") if i % 2 == 0 else ("compressed", "full")
            row: Dict[str, Any] = {"n": n, "order": list(order)}
            for kind in order:
                t0 = time.time()
                row[kind] = run_once(model, ids, args.new_tokens,
                                     compressor() if kind == "compressed" else None, client)
                print(f"n={n} {kind}: {time.time() - t0:.1f} s wall, decode "
                      f"{row[kind]['decode_tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
            same = sum(a == b for a, b in zip(row["full"]["tokens"], row["compressed"]["tokens"]))
            row["same_tokens"] = same
            rows.append(row)
        print(table(rows, args.budget, args.new_tokens))
        print(f"\ngreedy tokens equal to the full cache's, position by position: "
              + ", ".join(f"n={r['n']}: {r['same_tokens']}/{args.new_tokens}" for r in rows))
        print(f"kept KV entries (all layers and KV heads): "
              + ", ".join(f"n={r['n']}: {r['compressed']['kept']} of "
                          f"{r['n'] * model.config.num_hidden_layers * model.config.num_key_value_heads}"
                          for r in rows))
        print("compacted layers with padded slots (decoded with a mask): "
              + ", ".join(f"n={r['n']}: {r['compressed']['padded_layers']} of "
                          f"{model.config.num_hidden_layers}" for r in rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        if args.plot:
            plot(rows, args.budget, args.plot)
            print(f"plot: {args.plot}")
        client.close()
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
            import shutil
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
