#!/usr/bin/env python3
"""How unequal LaProx's per-layer shares are, and what max_layer_share does to them.

A paged engine whose block ids span all layers (vLLM) holds blocks for the longest layer, so a
plan whose longest layer keeps r times the mean layer's tokens costs r times the memory the
budget implies. For each 4K-token retrieval prompt (tasks.make_prompts at one length), this
prefills SmolLM2 once and asks laproxd for the vLLM plugin's plan (the server's default LaProx
options, plan_shape LAYER_UNIFORM; laprox.vllm's Config.plan_policy) at each budget, without a
cap and with each max_layer_share, and records per prompt the longest layer over the mean layer
(kept tokens per layer, window included, and the selected candidates alone). It writes
LAYERSHARE.md and layershare.json (min / median / max over the prompts).

Run like evaluate.py (a laproxd on a socket, the GGUF):

    layershare.py --target unix:/tmp/sock --gguf PATH.gguf [--prompts 16] [--budgets 256,512]
        [--caps 1.25,1.5,2,3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import evaluate as E  # noqa: E402
import methods as M   # noqa: E402
import tasks as T     # noqa: E402

LENGTH = 4096
# The task mix: the primary endpoint's task first; every prompt is LENGTH tokens.
PLAN = {"multi_key": 8, "single_needle": 3, "multi_query": 2, "multi_value": 2,
        "variable_tracking": 1}


def ratios(mask: np.ndarray, window: int) -> Dict[str, float]:
    """Longest layer over the mean layer of a mask set [L, Hkv, n]: kept tokens (window
    included) and selected candidates (window excluded; no sinks in the default policy)."""
    kept = mask.sum(axis=(1, 2)).astype(np.float64)
    selected = mask[..., :mask.shape[-1] - window].sum(axis=(1, 2)).astype(np.float64)
    return {"kept": float(kept.max() / kept.mean()),
            "selected": float(selected.max() / selected.mean()),
            "kept_per_layer": kept.tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--budgets", default="256,512")
    ap.add_argument("--caps", default="1.25,1.5,2,3")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if b]
    caps: List[Optional[float]] = [None] + [float(c) for c in args.caps.split(",") if c]
    torch.set_num_threads(args.threads)
    t0, load = time.time(), os.getloadavg()[0]

    import laprox
    import laprox.hf as lhf
    tok, model = E.load_model(args.gguf)
    client = laprox.Client(args.target, timeout=600)
    info = client.info()
    model_id = lhf.register_model(client, model, name="SmolLM2-135M-Instruct")
    corpus = T.Corpus(tok, LENGTH)
    plan = dict(PLAN)
    scale = args.prompts / sum(plan.values())
    plan = {k: max(1, round(v * scale)) for k, v in plan.items()}
    prompts = T.make_prompts(tok, corpus, plan, [LENGTH], args.seed)[:args.prompts]
    E.log(f"== {len(prompts)} prompts of {LENGTH} tokens, budgets {budgets}, caps {caps}")
    rows: List[Dict[str, Any]] = []
    for i, p in enumerate(prompts):
        prefix = E.Prefix(model, torch.cat([p.context, p.tail]), p.context.shape[0])
        for b in budgets:
            for cap in caps:
                policy: Dict[str, Any] = {"plan_shape": "layer_uniform", "window": M.WINDOW}
                if cap is not None:
                    policy["max_layer_share"] = cap
                kp = client.compute_keep_plan(model_id, prefix.np_keys, prefix.np_values,
                                              window_queries=prefix.np_queries, budget=b,
                                              policy=policy)
                if cap is not None and kp.effective_policy.max_layer_share != cap:
                    raise AssertionError(f"effective_policy does not echo the cap {cap}")
                r = ratios(kp.to_masks(), M.WINDOW)
                rows.append({"prompt": i, "task": p.task, "source": p.source, "n": p.n,
                             "budget": b, "cap": cap, **r})
        E.log(f"  {i + 1}/{len(prompts)} {p.task} {p.source} n={p.n}")
    client.close()

    def spread(values: List[float]) -> str:
        v = np.array(values)
        return f"{v.min():.2f} / {np.median(v):.2f} / {v.max():.2f}"

    command = os.environ.get("LAPROX_LAYERSHARE_COMMAND") or " ".join(
        ["bench/quality/layershare.py"] + [a for a in sys.argv[1:]
                                           if not a.startswith(("--target", "--gguf"))])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Per-layer shares of the vLLM plugin's LaProx plan, with and without max_layer_share",
        "",
        f"Generated by `{command}` (bench/quality/layershare.py); do not edit by hand.",
        "",
        f"- Date: {date}; wall time {(time.time() - t0) / 60:.1f} min",
        f"- Machine: {platform.machine()}, {E.cpu_name()}, {os.cpu_count()} cores, torch "
        f"threads {args.threads}, load average at start {load:.1f}",
        f"- Versions: {E.versions(info)}",
        f"- Model: SmolLM2-135M-Instruct Q4_1 GGUF dequantized to fp32, {lhf.geometry(model)}",
        f"- Prompts: {len(prompts)} retrieval prompts of {LENGTH} tokens (tasks.make_prompts, "
        f"seed {args.seed}: " + ", ".join(f"{t} {sum(p.task == t for p in prompts)}"
                                          for t in plan) + ")",
        "- Policy: the server's LaProx defaults (MEAN_HEAD_PRODUCT, avg pool 31 of the score, "
        f"window {M.WINDOW}, GLOBAL_NORMALIZED) with plan_shape LAYER_UNIFORM, the plan "
        "laprox.vllm sends; `max_layer_share` as in the row (effective_policy checked to echo "
        "it)",
        "",
        "Longest layer over the mean layer, min / median / max over the prompts. `kept`: kept "
        "tokens per layer, window included (what a paged engine holding blocks for the longest "
        "layer pays over the budget); `selected`: the competed candidates alone (window "
        "excluded), the quantity the cap bounds (at most s).",
        "",
        "| cap | " + " | ".join(f"B={b} kept | B={b} selected" for b in budgets) + " |",
        "|---" * (2 * len(budgets) + 1) + "|",
    ]
    for cap in caps:
        cells = []
        for b in budgets:
            sel = [r for r in rows if r["budget"] == b and r["cap"] == cap]
            cells += [spread([r["kept"] for r in sel]), spread([r["selected"] for r in sel])]
        lines.append(f"| {'none' if cap is None else f'{cap:g}'} | " + " | ".join(cells) + " |")
    lines.append("")
    with open(os.path.join(args.out, "LAYERSHARE.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, "layershare.json"), "w") as f:
        json.dump({"date": date, "command": command, "rows": rows}, f, separators=(",", ":"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
