#!/usr/bin/env python3
"""Where AVG_PEAK spends the budget, on the retrieval prompts of the joint run (issue 44): why
it keeps SmolLM2's retrieval lead and loses Gemma 3's at B <= 128 (JOINT.md, JOINT_GEMMA3.md).

For each multi-key and single-needle prompt the full cache solves (evaluate.MODES["full"], the
joint run's prompts and order; --bos for Gemma 3, as joint.py), the RAGGED plans of the three
candidates of ENDPOINT.md (plain AVG over 31, AVG_PEAK over 31, AVG over 31 with one sink) at
B = 64 and 128 are asked of laproxd, and of each mask set [planned layers, Hkv, n] outside the
last w positions:
  - gold: the share of the gold facts' tokens kept (mean over planned layers and KV heads), and
    the share of (layer, head) that keep every gold token (evaluate.span_stats);
  - run: the mean length of the kept runs;
  - isolated: the share of kept tokens with neither neighbour kept (single peaks);
  - first 4: the share of the (layer, head, position 0 .. 3) entries kept.
No forward pass beyond the prefill: nothing is teacher-forced here.

    build/quality-venv/bin/python bench/quality/peaks.py --threads=1 --prompts=16 \\
        --json=bench/quality/peaks_smollm2.json
    build/quality-venv/bin/python bench/quality/peaks.py --threads=1 --prompts=16 --bos \\
        --gguf=build/quality-model-gemma3/gemma-3-270m-q4_k_m.gguf \\
        --json=bench/quality/peaks_gemma3.json

It prints the table DIAGNOSIS.md ("Gemma 3: where AVG_PEAK spends the budget") shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import methods as M  # noqa: E402

BUDGETS = [64, 128]
TASKS = ("multi_key", "single_needle")


def mask_stats(mask: np.ndarray, spans, window: int) -> Dict[str, float]:
    import evaluate as E
    gold, all_gold, run = E.span_stats(mask, spans, window)
    body = mask[..., :mask.shape[-1] - window]
    left = np.zeros_like(body)
    left[..., 1:] = body[..., :-1]
    right = np.zeros_like(body)
    right[..., :-1] = body[..., 1:]
    isolated = body & ~left & ~right
    return {"gold": gold, "all_gold": all_gold, "run": run,
            "isolated": float(isolated.sum() / max(1, body.sum())),
            "first4": float(mask[..., :4].mean())}


def main() -> int:
    import torch
    import evaluate as E
    import tasks as T
    from decode import laproxd_target
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    E.add_harness_args(ap)
    ap.add_argument("--bos", action="store_true")
    ap.add_argument("--prompts", type=int, default=40, help="solved prompts to read at most")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with laproxd_target(args.target, args.laproxd) as args.target:
        tok, model, client, model_id, _ = E.connect(args, "peaks")
        E.WQ = M.WINDOW
        full = E.MODES["full"]
        corpus = T.Corpus(tok, max(full["lengths"]))
        prompts = [p for p in T.make_prompts(tok, corpus, full["plan"], full["lengths"],
                                             full["seed"]) if p.task in TASKS]
        if args.bos:
            bos = torch.tensor([tok.bos_token_id])
            prompts = [dataclasses.replace(p, context=torch.cat([bos, p.context]), n=p.n + 1,
                                           gold_spans=[(a + 1, b + 1) for a, b in p.gold_spans])
                       for p in prompts]
        rows: List[Dict[str, Any]] = []
        for p in prompts:
            if len(rows) == args.prompts:
                break
            prefix = E.Prefix(model, torch.cat([p.context, p.tail]), p.context.shape[0])
            answer = p.answer
            if not bool((prefix.full_cont.argmax(-1) == answer).all()):
                continue   # the full cache does not solve it
            masks = E.keep_masks(client, model_id, prefix, M.JOINT_RAGGED, BUDGETS)
            rows.append({"task": p.task, "n": p.n, "stats": {
                f"{name} B={b}": mask_stats(masks[(name, b)], p.gold_spans, M.WINDOW)
                for name, _ in M.JOINT_RAGGED for b in BUDGETS}})
            E.log(f"{len(rows)} solved prompts read")
        client.close()
    keys = list(rows[0]["stats"]) if rows else []
    print(f"{os.path.basename(args.gguf)}: {len(rows)} solved prompts ({', '.join(TASKS)})\n")
    print("| candidate, budget | gold tokens kept | (layer, head) keeping all gold | mean kept run "
          "| isolated kept tokens | positions 0-3 kept |")
    print("|---|---|---|---|---|---|")
    for key in keys:
        mean = {s: float(np.mean([r["stats"][key][s] for r in rows]))
                for s in ("gold", "all_gold", "run", "isolated", "first4")}
        print(f"| {key} | {mean['gold']:.2f} | {mean['all_gold']:.2f} | {mean['run']:.1f} "
              f"| {mean['isolated']:.2f} | {mean['first4']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
