#!/usr/bin/env python3
"""Why the default loses continuation KL at small budgets (issue 44): the measurements behind
bench/quality/DIAGNOSIS.md, on SmolLM2-135M-Instruct (CPU), on development documents only.

    build/quality-venv/bin/python bench/quality/diagnose.py --laproxd=build/service/laproxd \\
        --gguf=build/quality-model/SmolLM2-135M-Instruct.Q4_1.gguf --documents=8 \\
        --json=bench/quality/diagnosis.json        # then --report writes DIAGNOSIS_TABLES.md

Documents: spans of n = 2048 tokens and a 128-token continuation drawn with the dev grid's seed
(7) from tasks.SOURCES, the sources the retrieval prompts use; none of them is a held-out
document of decode.py or of the joint evaluation. Every method keeps window w = 32.

Per document, method and budget B (tokens per KV head, window included):
- kl: mean next-token KL(full || method) over the 127 teacher-forced continuation positions
  (evaluate.teacher_forced: every evicted key at -inf, softmax renormalised over the kept ones);
- mass: per (layer, KV head), the share of the continuation queries' attention (full softmax,
  mean over the G query heads and the 128 rows) that falls on evicted entries;
- sink: per (layer, KV head), whether position 0 is kept; sink_mass: the continuation's
  attention share on position 0 (the same for every method);
- selected: per (layer, KV head), kept entries outside the window (how many heads get nothing);
- swap (B = 128 and 256): the default's masks with layer l replaced by SnapKV's, for every l:
  KL(full || that), so the default's KL minus it is how much of the gap layer l carries;
- headswap (B = 128): the same for one (layer, KV head) at a time, in the 4 layers whose swap
  moves the KL most.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from typing import Any, Dict, List, Tuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import methods as M  # noqa: E402

W = M.WINDOW
BUDGETS = [128, 256, 512]
SWAP_BUDGETS = [128, 256]
DEV_SEED = 7


def laprox(**changes: Any) -> Dict[str, Any]:
    """The default this diagnosis studies (the one before issue 44, plain AVG over 31) with
    `changes` (None removes an option)."""
    return M.variant_of(M.PRE44_OPTIONS, **changes)


METHODS: List[M.Method] = [
    ("default", M.PRE44_OPTIONS),
    ("default sinks=4", laprox(sinks=4)),
    ("default sinks=1", laprox(sinks=1)),
    ("default pool=none", laprox(pooling="none", pool_kernel=None)),
    ("default pool=7", laprox(pool_kernel=7)),
    ("default pool=15", laprox(pool_kernel=15)),
    ("default sinks=1 pool=15", laprox(sinks=1, pool_kernel=15)),
    ("default attention-only", laprox(indicator="attention", gqa_value=None)),
    ("default per-layer", laprox(allocation="per_layer")),
    ("default layer_uniform cap=1.25", laprox(plan_shape="layer_uniform", max_layer_share=1.25)),
    ("default layer_uniform", laprox(plan_shape="layer_uniform")),
    ("default sinks=1 layer_uniform cap=1.25", laprox(sinks=1, plan_shape="layer_uniform",
                                                      max_layer_share=1.25)),
    ("default sinks=4 layer_uniform cap=1.25", laprox(sinks=4, plan_shape="layer_uniform",
                                                      max_layer_share=1.25)),
    ("SnapKV", {"kind": "snapkv", "window": W}),
    ("AdaKV", {"kind": "adakv", "window": W}),
    ("CriticalKV", {"kind": "criticalkv", "window": W}),
    ("StreamingLLM", {"kind": "streaming_llm"}),
    ("SnapKV pool=31", {"kind": "snapkv", "window": W, "pool_kernel": 31}),
]


def continuation_attention(prefix, E) -> List[np.ndarray]:
    """Per layer, the continuation queries' attention on the prefix [Hkv, n], summed over the G
    query heads and the rows and divided by G * rows (full softmax over prefix + continuation)."""
    import torch
    layers = E.LayerOutputs(prefix, prefix.extra_queries, prefix.n).layers
    out = []
    for e, _, _, g, rows, s in layers:
        p = (e / s)[:, :, :prefix.n]                            # [Hkv, G*R, n]
        out.append((p.sum(1) / (g * rows)).double().numpy())
        del p
    del layers
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def run(args) -> Dict[str, Any]:
    import torch
    import evaluate as E
    import tasks as T
    tok, model, client, model_id, _ = E.connect(args, "SmolLM2-135M-Instruct",
                                                prepare_cross_grams=True)
    E.WQ = W
    corpus = T.Corpus(tok, 2048 + 128)
    docs = T.make_documents(corpus, args.documents, [2048], 128, DEV_SEED)
    ctx = types.SimpleNamespace(model=model, batch=args.batch)   # what forward_all reads
    out: Dict[str, Any] = {"budgets": BUDGETS, "methods": [m for m, _ in METHODS],
                           "documents": []}
    for d in docs:
        t0 = time.time()
        prefix = E.Prefix(model, d.ids, d.n)
        full = prefix.full_cont
        masks = E.keep_masks(client, model_id, prefix, METHODS, BUDGETS)
        att = continuation_attention(prefix, E)                 # per layer [Hkv, n]
        att = np.stack(att)                                     # [L, Hkv, n]
        L = att.shape[0]

        def kl_of(sets: Dict[Any, np.ndarray]) -> Dict[Any, float]:
            res = {}
            for key, lp in E.forward_all(ctx, prefix, d.ids[d.n:-1], sets).items():
                res[key] = float((full.exp() * (full - lp)).sum(-1).mean())
            return res

        kl = kl_of(masks)
        doc: Dict[str, Any] = {"source": d.source, "n": d.n,
                               "sink_mass": att[:, :, 0].tolist(),
                               "first4_mass": att[:, :, :4].sum(-1).tolist(),
                               "methods": {}}
        for (name, b), m in masks.items():
            counts = m.sum(-1)
            doc["methods"].setdefault(name, {})[str(b)] = {
                "kl": kl[(name, b)],
                "mass": (att * ~m).sum(-1).tolist(),             # [L, Hkv]
                "sink": m[:, :, 0].tolist(),
                "selected": (counts - W).tolist(),
            }
        swaps: Dict[str, Any] = {}
        for b in SWAP_BUDGETS:
            base, snap = masks[("default", b)], masks[("SnapKV", b)]
            sets = {}
            for l in range(L):
                m = base.copy()
                m[l] = snap[l]
                sets[("layer", l)] = m
            layer_kl = kl_of(sets)
            swaps[str(b)] = {"layer": [layer_kl[("layer", l)] for l in range(L)]}
            if b == 128:
                gain = np.array([kl[("default", b)] - layer_kl[("layer", l)] for l in range(L)])
                top = [int(l) for l in np.argsort(-gain)[:4]]
                sets = {}
                for l in top:
                    for g in range(base.shape[1]):
                        m = base.copy()
                        m[l, g] = snap[l, g]
                        sets[(l, g)] = m
                head_kl = kl_of(sets)
                swaps[str(b)]["heads"] = [[l, g, v] for (l, g), v in head_kl.items()]
        doc["swap"] = swaps
        out["documents"].append(doc)
        print(f"{d.source}: {time.time() - t0:.0f} s; default B=128 KL "
              f"{kl[('default', 128)]:.3f}, SnapKV {kl[('SnapKV', 128)]:.3f}", flush=True)
    client.close()
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def report(path: str, out: str) -> None:
    import stats
    with open(path) as f:
        data = json.load(f)
    docs, budgets, names = data["documents"], data["budgets"], data["methods"]
    lines = [f"# Diagnosis tables (generated by bench/quality/diagnose.py --report from "
             f"{os.path.basename(path)})", "",
             f"{len(docs)} development documents (n = 2048, 127 scored continuation tokens, "
             f"dev seed {DEV_SEED}): " + ", ".join(d["source"] for d in docs) + ".", ""]

    def per_doc(name: str, b: int, key: str) -> np.ndarray:
        return np.array([d["methods"][name][str(b)][key] for d in docs])

    lines += ["## KL(full || method) and where the evicted attention goes", "",
              "Mean over documents; Δ = method − default with a paired 95% bootstrap interval "
              "and how many documents the method beats the default on. `mass`: the "
              "continuation's attention share on evicted entries (mean over layers and "
              "heads); `pos0`: share of (layer, KV head) keeping position 0; `0 sel`: share "
              "of (layer, KV head) with no entry outside the window.", "",
              "| method | B | KL | Δ vs default [95%] | better on | mass | pos0 | 0 sel |",
              "|---|---|---|---|---|---|---|---|"]
    for b in budgets:
        base = per_doc("default", b, "kl")
        for name in names:
            kl = per_doc(name, b, "kl")
            _, lo, hi, _ = stats.paired_bootstrap(kl, base)
            mass = float(np.mean([np.mean(x) for x in per_doc(name, b, "mass")]))
            pos0 = float(np.mean([np.mean(x) for x in per_doc(name, b, "sink")]))
            zero = float(np.mean([np.mean(np.array(x) <= 0)
                                  for x in per_doc(name, b, "selected")]))
            lines.append(f"| {name} | {b} | {kl.mean():.3f} | {(kl - base).mean():+.3f} "
                         f"[{lo:+.3f}, {hi:+.3f}] | {int((kl < base).sum())}/{len(docs)} | "
                         f"{mass:.3f} | {pos0:.2f} | {zero:.2f} |")
    # per-layer
    L = len(docs[0]["sink_mass"])
    lines += ["", "## Per layer at B = 128: attention on position 0, mass lost, and the gap "
              "each layer carries", "",
              "`pos0 att`: the continuation's attention share on position 0 (mean over heads "
              "and documents); `kept pos0`: share of heads keeping it (default / SnapKV); "
              "`mass lost`: default / SnapKV; `swap gain`: default KL minus the KL with that "
              "layer's masks taken from SnapKV (> 0: SnapKV's choice in this layer is better), "
              "mean over documents at B = 128 and 256.", "",
              "| layer | pos0 att | kept pos0 | mass lost B=128 | swap gain B=128 | swap gain "
              "B=256 |", "|---|---|---|---|---|---|"]
    sink_att = np.array([d["sink_mass"] for d in docs]).mean((0, 2))
    kd = np.array(per_doc("default", 128, "sink"), float).mean((0, 2))
    ks = np.array(per_doc("SnapKV", 128, "sink"), float).mean((0, 2))
    md = np.array(per_doc("default", 128, "mass")).mean((0, 2))
    ms = np.array(per_doc("SnapKV", 128, "mass")).mean((0, 2))
    gains = {}
    for b in SWAP_BUDGETS:
        base = per_doc("default", b, "kl")
        sw = np.array([d["swap"][str(b)]["layer"] for d in docs])      # [D, L]
        gains[b] = (base[:, None] - sw).mean(0)
    for l in range(L):
        lines.append(f"| {l} | {sink_att[l]:.3f} | {kd[l]:.2f} / {ks[l]:.2f} | {md[l]:.3f} / "
                     f"{ms[l]:.3f} | {gains[128][l]:+.4f} | {gains[256][l]:+.4f} |")
    total = {b: float(per_doc("default", b, "kl").mean() - per_doc("SnapKV", b, "kl").mean())
             for b in SWAP_BUDGETS}
    lines += ["", "Sum of the per-layer swap gains against the whole gap (default − SnapKV): " +
              "; ".join(f"B = {b}: {gains[b].sum():+.3f} against {total[b]:+.3f}"
                        for b in SWAP_BUDGETS), ""]
    # correlation of mass lost with KL over (doc, method) at each budget
    lines += ["## Mass lost against KL", "",
              "Spearman correlation over (document, method) pairs of the mean mass lost with "
              "the KL, and of the mass lost on position 0 alone (attention share of position 0 "
              "where it is evicted) with the KL.", "", "| B | mass ~ KL | pos0 mass lost ~ KL |",
              "|---|---|---|"]
    for b in budgets:
        xs, ys, zs = [], [], []
        for d in docs:
            s0 = np.array(d["sink_mass"])
            for name in names:
                r = d["methods"][name][str(b)]
                xs.append(np.mean(r["mass"]))
                ys.append(r["kl"])
                zs.append(float((s0 * ~np.array(r["sink"], bool)).mean()))
        lines.append(f"| {b} | {spearman(xs, ys):+.2f} | {spearman(zs, ys):+.2f} |")
    heads = [h for d in docs for h in d["swap"]["128"].get("heads", [])]
    if heads:
        lines += ["", f"Single-head swaps at B = 128 (the 4 layers of largest swap gain per "
                  f"document): {len(heads)} swaps; the largest gains:", ""]
        base = {d["source"]: d["methods"]["default"]["128"]["kl"] for d in docs}
        rows = []
        for d in docs:
            for l, g, v in d["swap"]["128"].get("heads", []):
                rows.append((base[d["source"]] - v, d["source"], l, g))
        rows.sort(reverse=True)
        lines += ["| document | layer | KV head | gain |", "|---|---|---|---|"]
        lines += [f"| {s} | {l} | {g} | {gain:+.4f} |" for gain, s, l, g in rows[:12]]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def spearman(x, y) -> float:
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    return float(np.corrcoef(rx, ry)[0, 1])


def main() -> int:
    import evaluate as E
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    E.add_harness_args(ap)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--json", default=os.path.join(HERE, "diagnosis.json"))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "DIAGNOSIS_TABLES.md"))
    args = ap.parse_args()
    if args.report:
        report(args.json, args.out)
        return 0
    import decode
    with decode.laproxd_target(args.target, args.laproxd) as args.target:
        started = time.time()
        result = run(args)
        result["seconds"] = time.time() - started
    with open(args.json, "w") as f:
        json.dump(result, f)
    report(args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
