#!/usr/bin/env python3
"""The PyTorch reference the CUDA benchmark compares with (issue "CUDA backend", item 6).

LaProx scores the way a PyTorch implementation in the style of kvpress's CriticalKV press
computes them on the GPU: per layer, the window attention from Q.K^T (causal inside the window,
fp32 softmax), the group mean, the L2 norm of each column over the window rows, avg pool 7 —
and the value factor by forming V.W_O^h for every query head (an n x D product per head, then its
row norms), which laprox replaces with the d x d Gram factor. Then the per-layer normalisation
and one model-wide top-K. Same geometry and inputs as bench/kernels_cuda_benchmark.cc
(Llama-3.1-8B: L32 H32 Hkv8 d128 D4096, bf16, random), timed with CUDA events, median of
--iters calls after one warm-up.

    python3 bench/cuda_reference.py --n=4096,32768,131072 --windows=32,64 --json=FILE
"""
import argparse
import json
import statistics
import sys

L, H, HKV, D_HEAD, HIDDEN, WQ = 32, 32, 8, 128, 4096, 64


def scores(torch, keys, values, queries, o_proj, w, budget):
    """keys/values [L][Hkv, n, d], queries [L][H, WQ, d], o_proj [L][D, H*d]; returns kept mask."""
    F = torch.nn.functional
    n = keys[0].shape[1]
    G = H // HKV
    m = n - w
    per_layer = []
    for l in range(L):
        k = keys[l].float()
        q = queries[l][:, WQ - w:, :].float() / D_HEAD ** 0.5
        logits = torch.einsum("gjd,ghtd->ghtj", k, q.view(HKV, G, w, D_HEAD))
        causal = torch.arange(n, device=k.device)[None, :] > (n - w + torch.arange(
            w, device=k.device))[:, None]
        logits = logits.masked_fill(causal, float("-inf"))
        attn = torch.softmax(logits, dim=-1)[..., :m]          # [Hkv, G, w, m]
        c = attn.mean(dim=1).pow(2).sum(dim=1).sqrt()           # [Hkv, m]
        c = F.avg_pool1d(c[:, None, :], 7, 1, 3, count_include_pad=True)[:, 0, :]
        r = torch.zeros(HKV, m, device=k.device)
        v = values[l][:, :m, :]
        for h in range(H):                                      # V W_O^h per head: n x D
            w_o = o_proj[l][:, h * D_HEAD:(h + 1) * D_HEAD]      # [D, d]
            r[h // G] += (v[h // G] @ w_o.T).float().norm(dim=-1) / G
        p = c * r
        per_layer.append(p / p.sum())
    s = torch.stack(per_layer).flatten()
    k_sel = min(L * HKV * max(budget - w, 0), s.numel())
    return torch.topk(s, k_sel).indices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="4096,32768,131072")
    ap.add_argument("--windows", default="32,64")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("cuda_reference: skipped: no torch")
        return 0
    if not torch.cuda.is_available():
        print("cuda_reference: skipped: no CUDA device")
        return 0
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    o_proj = [torch.randn(HIDDEN, H * D_HEAD, device=dev, generator=gen).mul_(0.02)
              .to(torch.bfloat16) for _ in range(L)]
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        def fresh():
            return ([torch.randn(HKV, n, D_HEAD, device=dev, generator=gen).to(torch.bfloat16)
                     for _ in range(L)] for _ in range(2))
        queries = [torch.randn(H, WQ, D_HEAD, device=dev, generator=gen).to(torch.bfloat16)
                   for _ in range(L)]
        for w in [int(x) for x in args.windows.split(",")]:
            times = []
            for i in range(args.iters + 1):
                keys, values = fresh()
                torch.cuda.synchronize()
                start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                with torch.no_grad():
                    scores(torch, keys, values, queries, o_proj, w, 1024)
                stop.record()
                torch.cuda.synchronize()
                if i > 0:
                    times.append(start.elapsed_time(stop))
                del keys, values
            med = statistics.median(times)
            rows.append({"n": n, "w": w, "median_ms": med, "min_ms": min(times),
                         "max_ms": max(times)})
            print(f"n={n:<7} w={w:<3} torch reference  median {med:10.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "iters": args.iters, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
