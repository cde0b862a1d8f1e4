#!/usr/bin/env python3
"""The joint evaluation that decides the default (issue 44): retrieval *and* continuation, at both
plan shapes the product applies, against SnapKV, AdaKV and CriticalKV at their published pooling
and at the default's. The endpoint and the decision rule are declared in ENDPOINT.md (committed
before the first run); this script measures and applies them.

    build/quality-venv/bin/python bench/quality/joint.py --laproxd=build/service/laproxd \\
        --json=bench/quality/joint.json             # runs, then writes JOINT.md
    build/quality-venv/bin/python bench/quality/joint.py --report --json=bench/quality/joint.json

Parts (paired: every method sees the same prefill of the same prompt or document):
- retrieval: the full run's retrieval prompts (evaluate.MODES["full"]: 120 prompts, seed 2026,
  n = 2K and 4K) at B = 64, 128, 256: exact match (greedy over the answer) and the gold answer's
  log-probability, teacher-forced over the compressed cache;
- continuation: 36 documents, spans of decode.HELD_OUT's sources in turn (none of them read by
  the retrieval prompts, the dev grid or diagnose.py; LGPL-3 is too short for n = 2048 + 128 and
  is left out, so the 11 others give 3 or 4 spans each), n = 2048 and 128 continuation tokens,
  at B = 128, 256, 512: mean next-token KL(full || method) over the 127 scored positions.
Every method keeps w = 32. `--prompts` / `--documents` take the first of each (a smaller run is
marked as such in the report). `--bos` prepends the tokenizer's <bos> to every prompt and
document (the prefix is then n + 1 tokens): Gemma 3 is trained with it (its GGUF sets
add_bos_token) and solves more prompts with it; SmolLM2's runs go without (the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
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

RETRIEVAL_BUDGETS = [64, 128, 256]
CONTINUATION_BUDGETS = [128, 256, 512]
DOCUMENTS = 36
CONT = 128
MARGIN = 0.01   # non-inferiority margin on mean KL (nats), ENDPOINT.md


def run(args) -> Dict[str, Any]:
    import torch
    import evaluate as E
    import tasks as T
    import decode
    tok, model, client, model_id, lhf = E.connect(args, args.model_name)
    torch.manual_seed(0)
    info = client.info()
    E.WQ = M.WINDOW
    full = E.MODES["full"]
    corpus = T.Corpus(tok, max(full["lengths"]))
    prompts = T.make_prompts(tok, corpus, full["plan"], full["lengths"], full["seed"])
    if args.prompts is not None:
        prompts = [prompts[i] for i in E.interleaved(prompts)[:args.prompts]]
    held_out = T.Corpus(tok, 2048 + CONT, decode.HELD_OUT)
    docs = T.make_documents(held_out, args.documents, [2048], CONT, full["seed"])
    if args.bos:
        bos = torch.tensor([tok.bos_token_id])
        prompts = [dataclasses.replace(p, context=torch.cat([bos, p.context]), n=p.n + 1,
                                       gold_spans=[(a + 1, b + 1) for a, b in p.gold_spans])
                   for p in prompts]
        docs = [dataclasses.replace(d, ids=torch.cat([bos, d.ids]), n=d.n + 1) for d in docs]
    ctx = types.SimpleNamespace(model=model, batch=args.batch)   # what forward_all reads
    methods = M.JOINT + (M.JOINT_PEAK_BASELINES if args.peak_baselines else [])
    out: Dict[str, Any] = {
        "meta": {"model": args.model_name, "geometry": str(lhf.geometry(model)),
                 "machine": f"{platform.machine()}, {E.cpu_name()}, {os.cpu_count()} cores, "
                            f"torch threads {args.threads}",
                 "versions": E.versions(info),
                 "date": datetime.datetime.now(datetime.timezone.utc)
                 .strftime("%Y-%m-%d %H:%M UTC"),
                 "retrieval_budgets": RETRIEVAL_BUDGETS,
                 "continuation_budgets": CONTINUATION_BUDGETS,
                 "methods": [name for name, _ in methods], "cont": CONT,
                 "prompts_total": sum(full["plan"].values()), "complete": False,
                 **({"bos": True} if args.bos else {})},
        "prompts": [], "documents": []}
    t_start = time.time()

    def save() -> None:
        out["meta"]["elapsed_s"] = time.time() - t_start
        with open(args.json, "w") as f:
            json.dump(out, f, separators=(",", ":"))

    for i, d in enumerate(docs):
        prefix = E.Prefix(model, d.ids, d.n)
        ref = prefix.full_cont
        masks = E.keep_masks(client, model_id, prefix, methods, CONTINUATION_BUDGETS)
        kl = {}
        for key, lp in E.forward_all(ctx, prefix, d.ids[d.n:-1], masks).items():
            kl[key] = float((ref.exp() * (ref - lp)).sum(-1).mean())
        out["documents"].append({"source": d.source, "n": d.n, "kl": {
            name: [kl[(name, b)] for b in CONTINUATION_BUDGETS] for name, _ in methods}})
        E.log(f"doc {i + 1}/{len(docs)} {d.source}: {time.time() - t_start:.0f} s")
        save()
    for i, p in enumerate(prompts):
        prefix = E.Prefix(model, torch.cat([p.context, p.tail]), p.context.shape[0])
        answer = p.answer
        index = torch.arange(answer.shape[0])

        def score(lp):
            return bool((lp.argmax(-1) == answer).all()), float(lp[index, answer].sum())

        full_em, full_lp = score(prefix.full_cont)
        masks = E.keep_masks(client, model_id, prefix, methods, RETRIEVAL_BUDGETS)
        em, lp = {}, {}
        for key, logp in E.forward_all(ctx, prefix, p.tail[:-1], masks).items():
            em[key], lp[key] = score(logp)
        out["prompts"].append({
            "task": p.task, "source": p.source, "n": p.n, "full_em": full_em,
            "full_lp": full_lp,
            "em": {name: [em[(name, b)] for b in RETRIEVAL_BUDGETS] for name, _ in methods},
            "lp": {name: [lp[(name, b)] for b in RETRIEVAL_BUDGETS] for name, _ in methods}})
        if i % 10 == 9:
            E.log(f"prompt {i + 1}/{len(prompts)}: {time.time() - t_start:.0f} s")
            save()
    out["meta"]["complete"] = True
    save()
    client.close()
    return out


# --------------------------------------------------------------------------------------------
# The endpoint (ENDPOINT.md)
# --------------------------------------------------------------------------------------------

def evaluate_endpoint(data: Dict[str, Any]) -> Dict[str, Any]:
    """Every comparison of ENDPOINT.md, with Holm over each candidate's family."""
    import stats
    rb, cb = data["meta"]["retrieval_budgets"], data["meta"]["continuation_budgets"]
    prompts, docs = data["prompts"], data["documents"]
    solved = [p for p in prompts if p["full_em"]]
    res: Dict[str, Any] = {}
    for cand in M.JOINT_CANDIDATES:
        family: Dict[str, float] = {}
        rows: List[Dict[str, Any]] = []
        for base in M.JOINT_BASELINES:
            for j, b in enumerate(rb):
                if not prompts:
                    break
                x = np.array([p["lp"][cand][j] for p in prompts])
                y = np.array([p["lp"][base][j] for p in prompts])
                d, lo, hi, p = stats.paired_bootstrap(x, y)
                key = f"lp {base} B={b}"
                family[key] = p
                rows.append({"key": key, "part": "retrieval lp", "base": base, "B": b, "d": d,
                             "lo": lo, "hi": hi, "p": p, "pass": lo > 0})
                ea = [p_["em"][cand][j] for p_ in solved]
                eb = [p_["em"][base][j] for p_ in solved]
                wa, wb, pe = stats.mcnemar_exact(ea, eb)
                key = f"em {base} B={b}"
                family[key] = pe
                rows.append({"key": key, "part": "retrieval em", "base": base, "B": b,
                             "a": sum(ea), "b": sum(eb), "n": len(solved), "wa": wa, "wb": wb,
                             "p": pe, "pass": sum(ea) >= sum(eb)})
        for j, b in enumerate(cb):
            if not docs:
                break
            means = {base: np.mean([d_["kl"][base][j] for d_ in docs])
                     for base in M.JOINT_BASELINES}
            best = min(means, key=means.get)
            for base in M.JOINT_BASELINES:
                x = np.array([d_["kl"][cand][j] for d_ in docs])
                y = np.array([d_["kl"][base][j] for d_ in docs])
                d, lo, hi, p = stats.paired_bootstrap(x, y)
                # the exact sign test: the binomial test of the documents either way
                wins, losses, sign_p = stats.mcnemar_exact(x < y, x > y)
                key = f"kl {base} B={b}"
                family[key] = p
                rows.append({"key": key, "part": "continuation kl", "base": base, "B": b,
                             "mean": float(x.mean()), "base_mean": float(y.mean()), "d": d,
                             "lo": lo, "hi": hi, "p": p, "wins": wins, "losses": losses,
                             "sign_p": sign_p, "best": base == best,
                             "pass": hi <= MARGIN})
        holm = stats.holm(family) if family else {}
        for r in rows:
            r["holm"] = holm.get(r["key"], float("nan"))
        res[cand] = rows
    return res


def decide(res: Dict[str, Any]) -> Dict[str, Any]:
    """The decision rule of ENDPOINT.md, per plan shape: the candidate that passes every
    criterion; else the one passing the most (ties: the lower mean KL at the smallest
    continuation budget); the criteria are the gold log-prob lead and the exact-match
    non-inferiority against every baseline at every retrieval budget, and KL non-inferiority
    (+MARGIN) against the best baseline at every continuation budget."""
    out = {}
    for shape, names in M.JOINT_SHAPES.items():
        scored = []
        for cand in names:
            rows = res.get(cand, [])
            crit = [r for r in rows if r["part"] != "continuation kl"] + \
                [r for r in rows if r["part"] == "continuation kl" and r["best"]]
            passed = sum(r["pass"] for r in crit)
            kl0 = next((r["mean"] for r in rows if r["part"] == "continuation kl"), 1e9)
            scored.append((-passed, kl0, cand, passed, len(crit)))
        scored.sort()
        out[shape] = [{"candidate": c, "passed": p, "of": n} for _, _, c, p, n in scored]
    return out


def report(path: str, out: str) -> None:
    with open(path) as f:
        data = json.load(f)
    meta, prompts, docs = data["meta"], data["prompts"], data["documents"]
    res = evaluate_endpoint(data)
    decision = decide(res)
    solved = sum(p["full_em"] for p in prompts)
    lines = [f"# Joint evaluation: {meta['model']} (issue 44)", "",
             "Generated by `bench/quality/joint.py` from `" + os.path.basename(path) +
             "`; the endpoint and the rule are declared in `ENDPOINT.md`; do not edit by hand.",
             "",
             f"- Date: {meta['date']}; {meta.get('elapsed_s', 0) / 60:.1f} min"
             f"{'' if meta.get('complete') else ' (INCOMPLETE: the run was stopped early)'}",
             f"- Machine: {meta['machine']}", f"- Versions: {meta['versions']}",
             f"- Model: {meta['model']}, {meta['geometry']}",
             f"- Retrieval: {len(prompts)} of the full run's {meta['prompts_total']} prompts "
             f"({solved} solved by the full cache), B = "
             f"{', '.join(map(str, meta['retrieval_budgets']))}",
             f"- Continuation: {len(docs)} held-out documents (n = 2048, {meta['cont']} "
             f"tokens), B = {', '.join(map(str, meta['continuation_budgets']))}",
             *(["- Every prompt and document starts with <bos> (`--bos`; the prefix is n + 1 "
                "tokens)"] if meta.get("bos") else []), "",
             "## Means", "",
             "Gold log-prob (nats, every prompt), exact match (of the prompts the full cache "
             "solves) and continuation KL (nats), mean per method and budget.", ""]
    rb, cb = meta["retrieval_budgets"], meta["continuation_budgets"]
    lines += ["| method | " + " | ".join(f"lp B={b}" for b in rb) + " | " +
              " | ".join(f"EM B={b}" for b in rb) + " | " +
              " | ".join(f"KL B={b}" for b in cb) + " |",
              "|---|" + "---|" * (2 * len(rb) + len(cb))]
    for name in meta["methods"]:
        lp = [np.mean([p["lp"][name][j] for p in prompts]) if prompts else float("nan")
              for j in range(len(rb))]
        em = [sum(p["em"][name][j] for p in prompts if p["full_em"]) for j in range(len(rb))]
        kl = [np.mean([d["kl"][name][j] for d in docs]) if docs else float("nan")
              for j in range(len(cb))]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in lp) + " | " +
                     " | ".join(f"{v}/{solved}" for v in em) + " | " +
                     " | ".join(f"{v:.3f}" for v in kl) + " |")
    lines += ["", "## The endpoint, per candidate", "",
              "Retrieval: gold log-prob candidate − baseline (paired bootstrap 95% interval; "
              "passes when the interval excludes 0 above) and exact match (candidate vs "
              "baseline over the solved prompts, exact McNemar; passes when the candidate "
              "solves at least as many). Continuation: KL candidate − baseline (paired "
              f"bootstrap; passes when the upper bound is ≤ +{MARGIN}), documents where the "
              "candidate is lower / higher and the exact sign test; ★ marks the baseline with "
              "the lowest mean KL at that budget, the one the rule compares with. Holm: over "
              "every comparison of the candidate.", ""]
    for cand, rows in res.items():
        lines += [f"### {cand}", "", "| comparison | B | result | p | Holm p | passes |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            if r["part"] == "retrieval lp":
                text = f"{r['d']:+.2f} [{r['lo']:+.2f}, {r['hi']:+.2f}]"
            elif r["part"] == "retrieval em":
                text = f"{r['a']}/{r['n']} vs {r['b']}/{r['n']} (+{r['wa']} −{r['wb']})"
            else:
                text = (f"{r['mean']:.3f} vs {r['base_mean']:.3f}: {r['d']:+.3f} "
                        f"[{r['lo']:+.3f}, {r['hi']:+.3f}], {r['wins']}/{r['losses']} "
                        f"(sign p {r['sign_p']:.2g})")
            star = " ★" if r.get("best") else ""
            lines.append(f"| {r['part']} vs {r['base']}{star} | {r['B']} | {text} | "
                         f"{r['p']:.2g} | {r['holm']:.2g} | {'yes' if r['pass'] else 'NO'} |")
        lines.append("")
    lines += ["## Decision (ENDPOINT.md's rule)", ""]
    if len(prompts) < meta["prompts_total"] or len(docs) < DOCUMENTS:
        lines.append("Not applied: the rule is declared for the whole run, this is a subset.")
        decision = {}
    for shape, ranked in decision.items():
        lines.append(f"- {shape}: " + "; ".join(
            f"{r['candidate']} passes {r['passed']}/{r['of']}" for r in ranked) +
            f" → **{ranked[0]['candidate']}**")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    import evaluate as E
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    E.add_harness_args(ap)
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--bos", action="store_true",
                    help="prepend <bos> to every prompt and document (Gemma 3)")
    ap.add_argument("--documents", type=int, default=DOCUMENTS)
    ap.add_argument("--json", default=os.path.join(HERE, "joint.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "JOINT.md"))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--peak-baselines", action="store_true",
                    help="also the baselines pooled with AVG_PEAK over 31 (methods."
                    "JOINT_PEAK_BASELINES: means only, outside the endpoint)")
    args = ap.parse_args()
    if not args.report:
        import decode
        with decode.laproxd_target(args.target, args.laproxd) as args.target:
            run(args)
    report(args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
