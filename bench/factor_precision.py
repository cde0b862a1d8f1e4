#!/usr/bin/env python3
"""How ill-conditioned real o_proj heads are, and what that does to the value factor in fp32.

    build/quality-venv/bin/python bench/factor_precision.py [build/quality-model/hf/model.safetensors]

Reads every layer's o_proj.weight [D, H*d] of a Llama-architecture checkpoint (by default the
fp32 copy of the Q4_1-dequantised SmolLM2-135M-Instruct that bench/quality/run.sh makes) and, per
query head h with W = o_proj[:, h*d:(h+1)*d] (D x d):

- kappa: W's condition number (largest over smallest singular value; inf when rank-deficient);
- for a value row v along W's weakest right singular vector (the worst case, ||W v|| =
  sigma_min ||v||) and for 64 random normal rows, the error of ||W v|| computed in fp32 two ways,
  relative to the scale ||v|| ||W||_F of the head's value factors:
    triangular: ||v T||, T the lower Cholesky factor of W^T W computed in fp64 and rounded to
                fp32, the product and the sum of squares in fp32 (what kernels/cpu/triangular.cc
                does, here with numpy's float32 arithmetic);
    Gram:       sqrt(v . (v M)) with M = W^T W rounded to fp32 (the backend before issue 16);
  the reference is ||W v|| in fp64 from the same fp32 inputs.

Prints a summary over all heads and the worst heads. This emulates the two computations in
numpy; tests/kernels/triangular_test.cc checks the C++ kernel itself on a synthetic head with
condition number 1e6.
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def cholesky_lower(gram):
    """Lower factor with the backend's rule for semidefinite Grams (kernels/cpu/triangular.cc):
    a pivot at most d * 2^-52 * max diag zeroes its column."""
    d = gram.shape[0]
    low = np.zeros_like(gram)
    tol = d * 2.0 ** -52 * np.max(np.diag(gram))
    for j in range(d):
        pivot = gram[j, j] - low[j, :j] @ low[j, :j]
        if pivot <= tol:
            continue
        low[j, j] = np.sqrt(pivot)
        low[j + 1:, j] = (gram[j + 1:, j] - low[j + 1:, :j] @ low[j, :j]) / low[j, j]
    return low


def errors(w32, rows32):
    """Errors of the two fp32 forms for value rows `rows32` [k, d], relative to ||v|| ||W||_F."""
    w64 = w32.astype(np.float64)
    exact = np.linalg.norm(rows32.astype(np.float64) @ w64.T, axis=1)
    scale = np.linalg.norm(rows32.astype(np.float64), axis=1) * np.linalg.norm(w64)
    t32 = cholesky_lower(w64.T @ w64).astype(np.float32)
    tri = np.sqrt(np.sum(np.square(rows32 @ t32, dtype=np.float32), axis=1, dtype=np.float32))
    m32 = (w64.T @ w64).astype(np.float32)
    q = np.sum(rows32 * (rows32 @ m32), axis=1, dtype=np.float32)
    gram = np.sqrt(np.maximum(q, 0.0))
    return np.abs(tri - exact) / scale, np.abs(gram - exact) / scale, exact / scale


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "build/quality-model/hf/model.safetensors"
    tensors = load_file(path)
    with open(os.path.join(os.path.dirname(path), "config.json")) as f:
        config = json.load(f)
    names = sorted((k for k in tensors if k.endswith("self_attn.o_proj.weight")),
                   key=lambda k: int(k.split(".layers.")[1].split(".")[0]))
    rng = np.random.default_rng(16)
    results = []
    for name in names:
        layer = int(name.split(".layers.")[1].split(".")[0])
        o = tensors[name].astype(np.float32)
        d = config.get("head_dim") or o.shape[1] // config["num_attention_heads"]
        heads = o.shape[1] // d
        for h in range(heads):
            w = o[:, h * d:(h + 1) * d]
            s = np.linalg.svd(w.astype(np.float64), compute_uv=False)
            kappa = s[0] / s[-1] if s[-1] > 0 else float("inf")
            _, _, vt = np.linalg.svd(w.astype(np.float64))
            weak = vt[-1].astype(np.float32)[None, :]
            random = rng.standard_normal((64, d)).astype(np.float32)
            tri_w, gram_w, rel_w = errors(w, weak)
            tri_r, gram_r, _ = errors(w, random)
            results.append((layer, h, kappa, tri_w[0], gram_w[0], rel_w[0], tri_r.max(),
                            gram_r.max()))
    arr = np.array([r[2:] for r in results])
    print(f"{path}: {len(names)} layers, {len(results)} heads of d = {d}")
    print(f"condition number: median {np.median(arr[:, 0]):.3g}, max {arr[:, 0].max():.3g}")
    print("error of ||W v|| relative to ||v|| ||W||_F (max over heads):")
    print(f"  weakest direction: triangular {arr[:, 1].max():.3g}, Gram form {arr[:, 2].max():.3g}"
          f" (||W v|| itself is {arr[:, 3].min():.3g} to {arr[:, 3].max():.3g} of that scale)")
    print(f"  64 random rows:    triangular {arr[:, 4].max():.3g}, Gram form {arr[:, 5].max():.3g}")
    print("the 5 worst-conditioned heads (kappa; weak-direction error, triangular / Gram):")
    for r in sorted(results, key=lambda r: -r[2])[:5]:
        print(f"  layer {r[0]:2d} head {r[1]}: kappa {r[2]:.3g}, {r[3]:.3g} / {r[4]:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
