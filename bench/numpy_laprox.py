#!/usr/bin/python3
"""numpy timing of the LaProx keep-plan on the inputs kernels_cpu_benchmark wrote.

What it measures. For every case directory that `kernels_cpu_benchmark` wrote under
LAPROX_BENCH_DUMP (keys, values, window queries and o_proj as raw fp32, plus the C++ plan's kept
bitmask), it times the same scoring and selection in plain numpy, written the straightforward way
a researcher would (docs/design.md §2's policy, which the benchmark sets explicitly:
GLOBAL_NORMALIZED, ATTENTION_X_PROJECTED_VALUE, MEAN_HEAD_NORM, w = 32, avg pool 7, B tokens
per head):

  naive  softmax of the window logits with a causal mask, group mean, column L2 norm,
         avg_pool1d(k=7, zero padded, /7), value factor ||v W_O^h|| by forming the n x D
         product V @ W_O^h per query head (kvpress style), per-layer normalisation, one global
         top-K with np.argpartition.
  gram   the same, but ||v W_O^h||^2 = v M_h v^T with M_h = W_O^h W_O^h^T (d x d), precomputed
         once per model outside the timing (as the C++ PrepareModel is).

Timing covers everything from the in-memory inputs to the kept mask. The gram variant gets one
untimed warm-up call, then `--gram-reps` timed calls (the best reported, like the C++ side); the naive variant runs
`--naive-reps` timed calls without warm-up (one Llama call takes about a minute). If one naive
call would exceed `--naive-budget-s`, it times only the first layers, scales the layer time to
all L layers, adds the gram variant's selection time, and says so in the output.

As a sanity check (printed, not asserted) it reports the fraction of the C++ kept set that each
numpy variant also keeps; fp32 rounding differences swap a few near-tied tokens at the threshold.

numpy runs on whatever BLAS it is linked with (Debian: OpenBLAS, one thread per core); the
thread count and OPENBLAS_* environment are printed and recorded.

Usage:
  numpy_laprox.py --inputs DIR [--cases NAME,...] [--json OUT] [--cpp-json CPP.json]
With --cpp-json (the --benchmark_out JSON of kernels_cpu_benchmark) it also prints the combined
markdown table. bench/run_cpu_bench.sh runs both in one go.
"""

import argparse
import ctypes
import json
import os
import pathlib
import re
import sys
import time

import numpy as np


# ------------------------------------------------------------------------------------------------
# Inputs


def load_case(case_dir):
    meta = json.loads((case_dir / "meta.json").read_text())
    L, H, Hkv, d, D, n, w = (meta[k] for k in ("L", "H", "Hkv", "d", "D", "n", "w"))

    def raw(name, dtype, shape):
        return np.fromfile(case_dir / name, dtype=dtype).reshape(shape)

    inputs = {
        "keys": raw("keys.f32", np.float32, (L, Hkv, n, d)),
        "values": raw("values.f32", np.float32, (L, Hkv, n, d)),
        "queries": raw("queries.f32", np.float32, (L, H, w, d)),
        "o_proj": raw("o_proj.f32", np.float32, (L, D, H * d)),
        "cpp_kept": np.unpackbits(
            raw("kept_bitmask.u8", np.uint8, (L, Hkv, (n + 7) // 8)), axis=-1, bitorder="little"
        )[..., :n].astype(bool),
    }
    return meta, inputs


# ------------------------------------------------------------------------------------------------
# The scoring, written plainly


def window_attention_factor(q, k, meta):
    """c after pooling, (Hkv, n - w): softmax with causal mask, group mean, L2 over rows, pool."""
    H, Hkv, n, w, d = meta["H"], meta["Hkv"], meta["n"], meta["w"], meta["d"]
    G = H // Hkv
    scale = np.float32(1.0 / np.sqrt(d))
    k_rep = np.repeat(k, G, axis=0)  # repeat_kv: (H, n, d)
    logits = np.matmul(q, k_rep.transpose(0, 2, 1)) * scale  # (H, w, n)
    mask = np.zeros((w, n), dtype=np.float32)
    mask[:, n - w :] = np.triu(np.full((w, w), -np.inf, dtype=np.float32), k=1)
    logits += mask
    logits -= logits.max(axis=-1, keepdims=True)
    attn = np.exp(logits)
    attn /= attn.sum(axis=-1, keepdims=True)
    attn_bar = attn.reshape(Hkv, G, w, n).mean(axis=1)  # (Hkv, w, n)
    c = np.linalg.norm(attn_bar[:, :, : n - w], axis=1)  # (Hkv, n - w)
    kernel = np.full(meta["pool_kernel"], 1.0 / meta["pool_kernel"], dtype=np.float32)
    return np.stack([np.convolve(c[g], kernel, mode="same") for g in range(Hkv)])


def value_factor_naive(v, o_proj, meta):
    """mean_h ||v W_O^h||, (Hkv, n), forming the n x D product per query head."""
    H, Hkv, d = meta["H"], meta["Hkv"], meta["d"]
    G = H // Hkv
    r = np.zeros((Hkv, meta["n"]), dtype=np.float32)
    for h in range(H):
        w_o = o_proj[:, h * d : (h + 1) * d].T  # W_O^h, (d, D)
        r[h // G] += np.linalg.norm(v[h // G] @ w_o, axis=-1)
    return r / G


def value_factor_gram(v, grams, meta):
    """mean_h sqrt(v M_h v^T), (Hkv, n)."""
    H, Hkv = meta["H"], meta["Hkv"]
    G = H // Hkv
    r = np.zeros((Hkv, meta["n"]), dtype=np.float32)
    for h in range(H):
        vg = v[h // G]
        r[h // G] += np.sqrt(np.maximum(((vg @ grams[h]) * vg).sum(axis=-1), 0))
    return r / G


def prepare_grams(o_proj, meta):
    """M_h = W_O^h W_O^h^T per layer and head, (L, H, d, d): once per model, untimed."""
    L, H, d = meta["L"], meta["H"], meta["d"]
    grams = np.empty((L, H, d, d), dtype=np.float32)
    for l in range(L):
        for h in range(H):
            w_o = o_proj[l][:, h * d : (h + 1) * d].T  # W_O^h, (d, D)
            grams[l, h] = w_o @ w_o.T
    return grams


def layer_scores(inputs, l, meta, variant, grams):
    n, w = meta["n"], meta["w"]
    c = window_attention_factor(inputs["queries"][l], inputs["keys"][l], meta)
    if variant == "naive":
        r = value_factor_naive(inputs["values"][l], inputs["o_proj"][l], meta)
    else:
        r = value_factor_gram(inputs["values"][l], grams[l], meta)
    p = c * r[:, : n - w]
    total = p.sum(dtype=np.float64)
    if total == 0 or not np.isfinite(total):
        return np.full_like(p, 1.0 / p.size)
    return (p / total).astype(np.float32)


def select(scores, meta):
    """Kept mask (L, Hkv, n): global top-K of the candidates plus the window."""
    L, Hkv, n, w = meta["L"], meta["Hkv"], meta["n"], meta["w"]
    quota = min(max(meta["tokens_per_head"] - w, 0), n - w)
    k = L * Hkv * quota
    flat = scores.reshape(-1)
    kept = np.zeros((L, Hkv, n), dtype=bool)
    if k > 0:
        top = np.argpartition(-flat, k - 1)[:k]
        candidates = np.zeros(flat.size, dtype=bool)
        candidates[top] = True
        kept[:, :, : n - w] = candidates.reshape(L, Hkv, n - w)
    kept[:, :, n - w :] = True
    return kept


def keep_plan(inputs, meta, variant, grams=None, layers=None):
    """Returns the kept mask, or None when only `layers` < L layers were scored."""
    L = meta["L"]
    layers = L if layers is None else layers
    scores = [layer_scores(inputs, l, meta, variant, grams) for l in range(layers)]
    if layers < L:
        return None
    return select(np.stack(scores), meta)


# ------------------------------------------------------------------------------------------------
# Timing


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def agreement(kept, cpp_kept):
    """Fraction of the C++ kept set that numpy also keeps."""
    return float(np.logical_and(kept, cpp_kept).sum() / cpp_kept.sum())


def run_case(case_dir, args):
    meta, inputs = load_case(case_dir)
    L = meta["L"]
    result = {"case": meta["case"], "model": meta["model"], "n": meta["n"]}
    grams = prepare_grams(inputs["o_proj"], meta)

    # Gram variant: warm-up, then the timed calls.
    keep_plan(inputs, meta, "gram", grams)
    times = []
    for _ in range(args.gram_reps):
        seconds, kept = timed(lambda: keep_plan(inputs, meta, "gram", grams))
        times.append(seconds)
    result["gram_ms"] = 1e3 * float(np.min(times))
    result["gram_reps"] = args.gram_reps
    result["gram_agreement"] = agreement(kept, inputs["cpp_kept"])

    # Naive variant: time one layer first to decide whether a full call fits the budget.
    first_s, _ = timed(lambda: keep_plan(inputs, meta, "naive", layers=1))
    if first_s * L <= args.naive_budget_s:
        times = []
        for _ in range(args.naive_reps):
            seconds, kept = timed(lambda: keep_plan(inputs, meta, "naive"))
            times.append(seconds)
        result["naive_ms"] = 1e3 * float(np.min(times))
        result["naive_reps"] = args.naive_reps
        result["naive_agreement"] = agreement(kept, inputs["cpp_kept"])
        result["naive_note"] = ""
    else:
        layers = max(1, min(L, int(args.naive_budget_s / first_s)))
        seconds, _ = timed(lambda: keep_plan(inputs, meta, "naive", layers=layers))
        # The selection the skipped call would have made, timed on the gram variant's scores.
        scores = np.stack([layer_scores(inputs, l, meta, "gram", grams) for l in range(L)])
        select_s, _ = timed(lambda: select(scores, meta))
        result["naive_ms"] = 1e3 * (seconds * L / layers + select_s)
        result["naive_reps"] = 1
        result["naive_agreement"] = None
        result["naive_note"] = (
            f"scaled: {layers} of {L} layers timed, x{L / layers:.2f}, plus selection")
    print(f"  {meta['case']}: gram {result['gram_ms']:.1f} ms, naive {result['naive_ms']:.1f} ms"
          f"{' (' + result['naive_note'] + ')' if result['naive_note'] else ''}; agreement with "
          f"C++ kept set: gram {result['gram_agreement']:.4%}, naive "
          + ("n/a" if result["naive_agreement"] is None else f"{result['naive_agreement']:.4%}"),
          flush=True)
    return result


def blas_info():
    """Which BLAS numpy uses and with how many threads (OpenBLAS queried through ctypes)."""
    np.ones((64, 64), dtype=np.float32) @ np.ones((64, 64), dtype=np.float32)  # load the BLAS
    info = {
        "numpy": np.__version__,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith("OPENBLAS") or k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    maps = pathlib.Path("/proc/self/maps")
    lines = maps.read_text().splitlines() if maps.exists() else []
    libs = sorted({line.split()[-1] for line in lines
                   if "openblas" in line and line.split()[-1].startswith("/")})
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_config.restype = ctypes.c_char_p
            info["blas"] = f"{lib.openblas_get_config().decode()} ({path})"
            info["blas_threads"] = int(lib.openblas_get_num_threads())
            break
        except (OSError, AttributeError):
            continue
    return info


# ------------------------------------------------------------------------------------------------
# The combined table


def cpp_results(path):
    """{case: benchmark entry} from the kernels_cpu_benchmark JSON."""
    data = json.loads(pathlib.Path(path).read_text())
    out = {}
    for bench in data["benchmarks"]:
        match = re.match(r"KeepPlan/([^/]+)/n:(\d+)", bench["name"])
        if match and bench.get("error_occurred") is not True:
            out[f"{match.group(1)}_n{match.group(2)}"] = bench
    return data.get("context", {}), out


def print_table(cpp, numpy_results):
    print("| geometry | n | ours ms | floor ms | ours/floor | least-work floor ms | ours/least "
          "| ours/floor, paired | ours/least, paired "
          "| numpy naive ms | numpy gram ms | vs naive | vs gram "
          "| numpy keeps of our set (naive / gram) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    notes = []
    for res in numpy_results:
        bench = cpp.get(res["case"])
        if bench is None:
            continue
        ours = bench.get("best_ms", bench["real_time"])  # ms; best of the timed calls
        naive = f"{res['naive_ms']:.0f}" + ("*" if res["naive_note"] else "")
        if res["naive_note"]:
            notes.append(f"* {res['case']}: {res['naive_note']}")
        agree_naive = ("n/a" if res["naive_agreement"] is None
                       else f"{100 * res['naive_agreement']:.2f}%")
        least = bench.get("least_ms", float("nan"))
        paired_floor = bench.get("x_floor_paired", float("nan"))
        paired_least = bench.get("x_least_paired", float("nan"))
        print(f"| {res['model']} | {res['n'] // 1024}K | {ours:.0f} | {bench['floor_ms']:.0f} "
              f"| {ours / bench['floor_ms']:.2f}x | {least:.0f} | {ours / least:.2f}x "
              f"| {paired_floor:.2f}x | {paired_least:.2f}x "
              f"| {naive} | {res['gram_ms']:.0f} "
              f"| {res['naive_ms'] / ours:.1f}x | {res['gram_ms'] / ours:.1f}x "
              f"| {agree_naive} / {100 * res['gram_agreement']:.2f}% |")
    for note in notes:
        print(note)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", required=True, type=pathlib.Path,
                        help="the LAPROX_BENCH_DUMP directory of kernels_cpu_benchmark")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--gram-reps", type=int, default=3)
    parser.add_argument("--naive-reps", type=int, default=1)
    parser.add_argument("--naive-budget-s", type=float, default=240.0,
                        help="time only some layers when one naive call would take longer")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--cpp-json", type=pathlib.Path,
                        help="kernels_cpu_benchmark --benchmark_out JSON: print the joint table")
    args = parser.parse_args()

    context, cpp = cpp_results(args.cpp_json) if args.cpp_json else ({}, {})
    names = [c for c in args.cases.split(",") if c]
    if not names:
        # The C++ run order when known (smallest first), else alphabetical.
        names = [c for c in cpp if (args.inputs / c).is_dir()] or sorted(
            p.name for p in args.inputs.iterdir() if (p / "meta.json").exists())
    info = blas_info()
    print(f"numpy {info['numpy']}, BLAS {info.get('blas', 'unknown')}, "
          f"{info.get('blas_threads', '?')} BLAS threads, env {info['env'] or '{}'}", flush=True)

    results = [run_case(args.inputs / name, args) for name in names]
    if args.json:
        args.json.write_text(json.dumps({"numpy": info, "results": results}, indent=2) + "\n")
    if cpp:
        print()
        print(f"Floor rates at the start of the C++ run: sgemm "
              f"{float(context.get('laprox_sgemm_gflops', 'nan')):.1f} GFLOP/s, read "
              f"{float(context.get('laprox_read_gbs', 'nan')):.1f} GB/s (each case's floor uses "
              f"the best rates measured up to that case: its sgemm_GFLOPs and read_GBs counters; "
              f"'paired' is the median over the timed calls of each call against the floor of the "
              f"sgemm rate measured just before it)")
        print()
        print_table(cpp, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
