#!/usr/bin/env python3
"""Which rounding explains a SnapKV disagreement? (run inside build/kvpress-venv)

  diagnose.py --out=build/kvpress-crosscheck --n=3000 --cr=0.8 --cli=... --target=unix:...

Recomputes SnapKV scores from a dump written by crosscheck.py under several rounding models,
selects each head's top int((1-cr)*n) with laprox's order (score descending, position ascending;
window forced), and counts per model how many (layer, head) kept sets equal kvpress's recorded set
and laprox's plan:
  kvpress          kvpress's ops in the model dtype: q.k matmul and /sqrt(d) rounded, fp32 softmax
                   rounded, row mean, avg pool and group mean each rounded (snapkv_press.py)
  probs_only       fp32 logits, fp32 softmax rounded to the model dtype, fp32 mean/pool/group mean
  logits+probs     as probs_only, plus q.k and /sqrt(d) rounded to the model dtype
  fp32             nothing rounded
"""

import argparse
import json
import math
import os
import subprocess

import torch
import torch.nn.functional as F
from safetensors import safe_open


def scores(q, k, w, kernel, mode):
    """q [H, w, d], k [Hkv, n, d] in the dump dtype -> [Hkv, n - w] float64 scores."""
    H, _, d = q.shape
    hkv, n, _ = k.shape
    G = H // hkv
    dt = q.dtype
    kk = k.repeat_interleave(G, dim=0)
    if mode == "kvpress":
        logits = torch.matmul(q, kk.transpose(1, 2)) / math.sqrt(d)
    elif mode == "logits+probs":
        logits = (torch.matmul(q.float(), kk.float().transpose(1, 2)).to(dt) / math.sqrt(d)).to(dt)
    else:
        logits = torch.matmul(q.float(), kk.float().transpose(1, 2)) / math.sqrt(d)
    mask = torch.triu(torch.full_like(logits, float("-inf")), diagonal=n - w + 1)
    p = F.softmax(logits.float() + mask.float(), dim=-1)
    if mode != "fp32":
        p = p.to(dt)
    if mode != "kvpress":
        p = p.float()
    p = p[..., : n - w]
    s = p.mean(dim=-2)
    s = F.avg_pool1d(s.unsqueeze(0), kernel_size=kernel, padding=kernel // 2, stride=1)[0]
    s = s.view(hkv, G, n - w).mean(1)
    return s.double()


def laprox_order_keep(s, n, w, n_kept):
    """Top n_kept per head, window forced, ties -> lower position; ascending positions; and the
    score of the last selected candidate per head (the threshold)."""
    out, thresholds = [], []
    for h in range(s.shape[0]):
        sel = max(0, n_kept - w)
        order = sorted(range(n - w), key=lambda i: (-s[h, i].item(), i))[:sel]
        kept = sorted(order) + list(range(n - w, n)) if n_kept >= w else None
        out.append(kept)
        thresholds.append(s[h, order[-1]].item() if order else None)
    return out, thresholds


def equal_up_to_ties(a, b, s, thr):
    """a == b except for positions whose score equals the threshold exactly."""
    return all(s[p].item() == thr for p in set(a) ^ set(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--cr", type=float, required=True)
    ap.add_argument("--cli")
    ap.add_argument("--target")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=5)
    args = ap.parse_args()
    dump = os.path.join(args.out, f"dump_n{args.n}.safetensors")
    with open(os.path.join(args.out, f"kvpress_n{args.n}_snapkv_{args.cr}.json")) as f:
        kv = json.load(f)["kept"]
    plan = None
    if args.cli:
        r = subprocess.run([args.cli, "plan", dump, f"--target={args.target}", "--json",
                            "--policy=snapkv", "--numeric_mode=kvpress_compat",
                            f"--compression_ratio={args.cr!r}"], capture_output=True, text=True,
                           check=True)
        plan = json.loads(r.stdout)["kept"]
    n, w = args.n, args.window
    n_kept = max(1, int(n * (1 - args.cr)))
    with safe_open(dump, "pt") as f:
        L = len({k.split(".")[1] for k in f.keys()})
        layers = [(f.get_tensor(f"layers.{l}.window_queries"), f.get_tensor(f"layers.{l}.keys"))
                  for l in range(L)]
    for mode in ("kvpress", "probs_only", "logits+probs", "fp32"):
        eq_kv = tie_kv = eq_lp = tie_lp = total = 0
        for l, (q, k) in enumerate(layers):
            s = scores(q, k, w, args.kernel, mode)
            keep, thr = laprox_order_keep(s, n, w, n_kept)
            for h, kept in enumerate(keep):
                total += 1
                eq_kv += kept == kv[l][h]
                tie_kv += equal_up_to_ties(kept, kv[l][h], s[h], thr[h])
                if plan is not None:
                    eq_lp += kept == plan[l][h]
                    tie_lp += equal_up_to_ties(kept, plan[l][h], s[h], thr[h])
        print(f"{mode:13s}: kvpress's set in {eq_kv}/{total} heads ({tie_kv} up to exact ties), "
              f"laprox's in {eq_lp}/{total} ({tie_lp} up to exact ties)")


if __name__ == "__main__":
    main()
