#!/usr/bin/env python3
"""Candidate fixes tried in Python before any goes into laproxd (issue 44, DIAGNOSIS.md): the
scores laproxd returns for two policies, combined here, and one model-wide top-K over them.

    build/quality-venv/bin/python bench/quality/prototype.py --laproxd=build/service/laproxd \\
        --documents=6 --prompts=12 --json=bench/quality/prototype.json

Development data only (the dev grid's seed 7): documents as diagnose.py's, retrieval prompts of
the dev grid (GRID.md: multi-key, 2K). Variants, each at w = 32:
- `pooled`: the default before issue 44 (plain AVG over 31 of the per-token score);
- `pooled+sink1`: the default with sinks = 1 (laproxd's own plan);
- `max(raw,pooled)`: s_i = max(s_raw_i, s_pool_i) with s_raw the default's score without
  pooling and s_pool the default's, each normalised per layer as laproxd does (its scores
  output), then the model-wide top-K;
- `max(raw,pooled)+sink1`: the same with position 0 forced;
- `max(p_raw,p_pool)/sum`: the maximum of the unnormalised scores p (s times the layer sums
  laproxd returns), normalised per layer afterwards by the sum of that maximum (what laproxd's
  pooling AVG_PEAK computes);
- `… rows`: a LAYER_UNIFORM plan of those scores chosen by rows (select_rows), beside laproxd's
  LAYER_UNIFORM plan of the default (`pooled layer_uniform`, with and without max_layer_share
  1.25), which recounts the ragged plan's per-layer totals evenly over the heads.
Baselines SnapKV and AdaKV (avg 5) for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from typing import Any, Dict, List

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import methods as M  # noqa: E402

W = M.WINDOW


def laprox(**changes: Any) -> Dict[str, Any]:
    """The default before issue 44 (plain AVG over 31, what "pooled" names) with `changes`
    (None removes an option)."""
    return M.variant_of(M.PRE44_OPTIONS, **changes)
BUDGETS = [64, 128, 256, 512]
SERVER = [("pooled", M.PRE44_OPTIONS),
          ("pooled+sink1", laprox(sinks=1)),
          ("pooled layer_uniform cap=1.25", laprox(plan_shape="layer_uniform",
                                                      max_layer_share=1.25)),
          ("pooled layer_uniform", laprox(plan_shape="layer_uniform")),
          ("avg_peak (laproxd)", laprox(pooling="avg_peak")),
          ("avg_peak layer_uniform cap=1.25", laprox(pooling="avg_peak",
                                                        plan_shape="layer_uniform",
                                                        max_layer_share=1.25)),
          ("SnapKV", {"kind": "snapkv", "window": W}),
          ("AdaKV", {"kind": "adakv", "window": W})]
VARIANTS = ["pooled", "pooled+sink1", "max(raw,pooled)", "max(raw,pooled)+sink1",
            "max(p_raw,p_pool)/sum", "pooled layer_uniform", "pooled layer_uniform cap=1.25",
            "pooled rows", "max(p_raw,p_pool)/sum rows", "avg_peak (laproxd)",
            "avg_peak layer_uniform cap=1.25", "SnapKV", "AdaKV"]


def select(scores: np.ndarray, budget: int, sinks: int) -> np.ndarray:
    """Keep masks [L, Hkv, n]: window and sinks forced, the best L * Hkv * (B - w - sinks)
    candidates of `scores` [L, Hkv, n] (finite entries) over the whole model."""
    L, hkv, n = scores.shape
    keep = np.zeros(scores.shape, bool)
    keep[..., n - W:] = True
    keep[..., :sinks] = True
    s = scores.copy()
    s[keep] = -np.inf
    k = max(0, L * hkv * (budget - W - sinks))
    flat = s.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:k]
    keep.reshape(-1)[order] = True
    return keep


def select_rows(scores: np.ndarray, budget: int, sinks: int) -> np.ndarray:
    """A LAYER_UNIFORM plan chosen by rows: each head's candidates sorted by score, row k of
    layer l worth the sum over its heads of their k-th best score, the best L * (B - w - sinks)
    rows of the whole model kept (each row one entry in every head of its layer). This is the
    plan that maximises the kept score when every head of a layer keeps the same count."""
    L, hkv, n = scores.shape
    keep = np.zeros(scores.shape, bool)
    keep[..., n - W:] = True
    keep[..., :sinks] = True
    s = np.where(keep, -np.inf, scores)
    order = np.argsort(-s, axis=-1, kind="stable")                 # [L, Hkv, n]
    ranked = np.take_along_axis(s, order, -1)
    m = n - W - sinks
    rows = ranked[..., :m].sum(1)                                   # [L, m]
    k = max(0, L * (budget - W - sinks))
    flat = rows.reshape(-1)
    best = np.argsort(-flat, kind="stable")[:k]
    per_layer = np.bincount(best // m, minlength=L)
    for l in range(L):
        for g in range(hkv):
            keep[l, g, order[l, g, :per_layer[l]]] = True
    return keep


def plan_scores(client, model_id, prefix, options):
    """(s [L, Hkv, n] normalised per layer, the layer sums [L] they were normalised by)."""
    plan = client.compute_keep_plan(model_id, prefix.np_keys, prefix.np_values,
                                    window_queries=prefix.np_queries, budget=64,
                                    policy=options, outputs=["positions", "scores"])
    return np.asarray(plan.scores, np.float64), np.asarray(plan.layer_sums, np.float64)


def variant_masks(client, model_id, prefix) -> Dict[Any, np.ndarray]:
    import evaluate as E
    out = E.keep_masks(client, model_id, prefix, SERVER, BUDGETS)
    raw, raw_sums = plan_scores(client, model_id, prefix,
                                laprox(pooling="none", pool_kernel=None))
    pooled, pooled_sums = plan_scores(client, model_id, prefix, M.PRE44_OPTIONS)
    both = np.maximum(raw, pooled)
    # the same maximum of the unnormalised scores, normalised afterwards by its own layer sums
    p = np.maximum(raw * raw_sums[:, None, None], pooled * pooled_sums[:, None, None])
    finite = np.where(np.isfinite(p), p, 0.0)
    p_norm = p / finite.sum((1, 2), keepdims=True)
    for b in BUDGETS:
        out[("max(raw,pooled)", b)] = select(both, b, 0)
        out[("max(raw,pooled)+sink1", b)] = select(both, b, 1)
        out[("max(p_raw,p_pool)/sum", b)] = select(p_norm, b, 0)
        out[("max(p_raw,p_pool)/sum rows", b)] = select_rows(p_norm, b, 0)
        out[("pooled rows", b)] = select_rows(pooled, b, 0)
    return out


def run(args) -> Dict[str, Any]:
    import torch
    import evaluate as E
    import tasks as T
    tok, model, client, model_id, _ = E.connect(args, "SmolLM2-135M-Instruct")
    E.WQ = W
    grid = E.MODES["grid"]
    corpus = T.Corpus(tok, 2048 + 128)
    docs = T.make_documents(corpus, args.documents, [2048], 128, grid["seed"])
    prompts = T.make_prompts(tok, corpus, {"multi_key": args.prompts}, [2048], grid["seed"])
    ctx = types.SimpleNamespace(model=model, batch=args.batch)   # what forward_all reads
    out: Dict[str, Any] = {"budgets": BUDGETS, "variants": VARIANTS, "documents": [],
                           "prompts": []}
    for d in docs:
        t0 = time.time()
        prefix = E.Prefix(model, d.ids, d.n)
        ref = prefix.full_cont
        masks = variant_masks(client, model_id, prefix)
        kl = {}
        for key, lp in E.forward_all(ctx, prefix, d.ids[d.n:-1], masks).items():
            kl[key] = float((ref.exp() * (ref - lp)).sum(-1).mean())
        out["documents"].append({v: [kl[(v, b)] for b in BUDGETS] for v in VARIANTS})
        print(f"doc {d.source}: {time.time() - t0:.0f} s", flush=True)
    for p in prompts:
        prefix = E.Prefix(model, torch.cat([p.context, p.tail]), p.context.shape[0])
        answer = p.answer
        index = torch.arange(answer.shape[0])
        masks = variant_masks(client, model_id, prefix)
        res = {}
        for key, lp in E.forward_all(ctx, prefix, p.tail[:-1], masks).items():
            res[key] = (bool((lp.argmax(-1) == answer).all()), float(lp[index, answer].sum()))
        out["prompts"].append({"full_em": bool((prefix.full_cont.argmax(-1) == answer).all()),
                               **{v: [res[(v, b)] for b in BUDGETS] for v in VARIANTS}})
        print(f"prompt {len(out['prompts'])}", flush=True)
    client.close()
    return out


def report(data: Dict[str, Any]) -> str:
    lines = [f"{len(data['documents'])} documents, {len(data['prompts'])} multi-key prompts "
             f"({sum(p['full_em'] for p in data['prompts'])} solved by the full cache)", "",
             "| variant | " + " | ".join(f"KL B={b}" for b in data["budgets"]) + " | " +
             " | ".join(f"lp B={b}" for b in data["budgets"]) + " | " +
             " | ".join(f"EM B={b}" for b in data["budgets"]) + " |",
             "|---|" + "---|" * (3 * len(data["budgets"]))]
    for v in data["variants"]:
        kl = np.mean([d[v] for d in data["documents"]], 0)
        lp = np.mean([[x[1] for x in p[v]] for p in data["prompts"]], 0)
        em = np.array([[x[0] for x in p[v]] for p in data["prompts"] if p["full_em"]],
                      int).reshape(-1, len(data["budgets"])).sum(0)
        lines.append(f"| {v} | " + " | ".join(f"{x:.3f}" for x in kl) + " | " +
                     " | ".join(f"{x:.2f}" for x in lp) + " | " +
                     " | ".join(str(int(x)) for x in em) + " |")
    return "\n".join(lines)


def main() -> int:
    import evaluate as E
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    E.add_harness_args(ap)
    ap.add_argument("--documents", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--json", default=os.path.join(HERE, "prototype.json"))
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    if not args.report:
        import decode
        with decode.laproxd_target(args.target, args.laproxd) as args.target:
            data = run(args)
        with open(args.json, "w") as f:
            json.dump(data, f)
    with open(args.json) as f:
        print(report(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
