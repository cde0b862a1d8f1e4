"""The methods the quality evaluation compares, and the dev grid the defaults are chosen on.

A method is (name, options): options are laprox Policy fields sent to laproxd, or
{"kvpress": NAME} for kvpress's own press. Every method runs at the same observation window
w = WINDOW unless its name says otherwise; the SnapKV family's published window 64 is one
reference row (kvpress SnapKV w=64)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

WINDOW = 32
Method = Tuple[str, Dict[str, Any]]

# Each method costs a keep-plan (~0.1 s at n = 2K; CriticalKV ~0.45 s) and a teacher-forced
# forward of the answer (~0.1 s) per budget and prompt on 2 cores; the ablations run at the
# primary budget and the largest only ("budgets" is not a Policy field: evaluate.py takes it
# out).
ABLATION_BUDGETS = [128, 1024]

# The default the rest of the table is compared with, written out in full so that a run does not
# depend on the server's built-in defaults: group value MEAN_HEAD_PRODUCT and the width 31 chosen
# on the dev grid (GRID.md), AVG_PEAK pooling of the per-token score (SCORE, that mode's
# placement when pool_target is not set) chosen by the joint endpoint (ENDPOINT.md, JOINT.md),
# w = 32, global normalised allocation.
DEFAULT = "LaProx"
DEFAULT_OPTIONS: Dict[str, Any] = {"gqa_value": "mean_head_product", "pool_target": "score",
                                   "pooling": "avg_peak", "pool_kernel": 31, "window": WINDOW}
# The default before the grid (MEAN_HEAD_NORM, avg 7 of the attention factor).
V1_OPTIONS: Dict[str, Any] = {"gqa_value": "mean_head_norm", "pool_target": "attention",
                              "pooling": "avg", "pool_kernel": 7, "window": WINDOW}


def variant_of(base: Dict[str, Any], **changes: Any) -> Dict[str, Any]:
    """`base` with `changes` (a value of None removes the option)."""
    out = dict(base, **changes)
    return {k: v for k, v in out.items() if v is not None}


def variant(**changes: Any) -> Dict[str, Any]:
    """The default with `changes` (a value of None removes the option)."""
    return variant_of(DEFAULT_OPTIONS, **changes)


# The default before issue 44 (AVG pooling over 31 of the score, which averaged the attention
# sink away: DIAGNOSIS.md).
PRE44_OPTIONS: Dict[str, Any] = {"gqa_value": "mean_head_product", "pool_target": "score",
                                 "pooling": "avg", "pool_kernel": 31, "window": WINDOW}

MAIN: List[Method] = [
    (DEFAULT, DEFAULT_OPTIONS),
    ("LaProx avg31", PRE44_OPTIONS),
    ("LaProx v1 default", V1_OPTIONS),
    ("LaProx paper", {"preset": "paper"}),
    # the paper's allocation ablation, at the primary budget and the largest (ABLATION_BUDGETS)
    ("LaProx global-raw", {**variant(allocation="global_raw"), "budgets": ABLATION_BUDGETS}),
    ("LaProx per-layer", {**variant(allocation="per_layer"), "budgets": ABLATION_BUDGETS}),
    ("LaProx uniform", {**variant(allocation="uniform"), "budgets": ABLATION_BUDGETS}),
    # the indicator ablation (A*|v| on the language-model part only, see LM_ONLY); these
    # indicators take only MEAN_HEAD_NORM
    ("LaProx A", {**variant(indicator="attention", gqa_value=None),
                  "budgets": ABLATION_BUDGETS}),
    # the exact per-KV-entry norm with the default's pooling
    ("LaProx exact", {**variant(gqa_value="exact_block"), "budgets": ABLATION_BUDGETS}),
    # baselines, laproxd's implementations (kvpress semantics), at w = 32, published pooling
    ("StreamingLLM", {"kind": "streaming_llm"}),
    ("SnapKV", {"kind": "snapkv", "window": WINDOW}),
    ("AdaKV", {"kind": "adakv", "window": WINDOW}),
    ("CriticalKV", {"kind": "criticalkv", "window": WINDOW}),
    # the same baselines at the default's pooling width
    ("SnapKV pool=31", {"kind": "snapkv", "window": WINDOW, "pool_kernel": 31}),
    ("AdaKV pool=31", {"kind": "adakv", "window": WINDOW, "pool_kernel": 31}),
    # the published SnapKV, kvpress's own code at its default window 64
    ("kvpress SnapKV w=64", {"kvpress": "SnapKV"}),
]

# The engine-compatible shape (SEMANTICS.md "Plan shapes"): a BLOCKS_SHARED twin at block size
# BLOCK_SIZE of each method an engine with a paged cache could run (LaProx, SnapKV, AdaKV,
# StreamingLLM; CriticalKV and kvpress's own press have no block shape). The twin is the
# method's options plus the two plan fields, so it keeps the same window w = 32: whole blocks of
# 16 positions are kept or evicted in every layer and KV head alike, floor(B / 16) blocks per
# head with the blocks holding the window (or the sinks) among them, which can be fewer tokens
# than B. With a block shape AdaKV's per-head budgets have nothing to act on: its twin's plan is
# SnapKV's (BLOCKS.md says whether it was on every item).
BLOCK_SIZE = 16
BLOCK_SUFFIX = f"·blocks{BLOCK_SIZE}"
BLOCK_TWINS_OF = [DEFAULT, "LaProx paper", "SnapKV", "AdaKV", "SnapKV pool=31", "AdaKV pool=31",
                  "StreamingLLM"]


def block_twin(method: Method) -> Method:
    name, options = method
    return (name + BLOCK_SUFFIX, {**options, "plan_shape": "blocks_shared",
                                  "block_size": BLOCK_SIZE})


def is_block_shaped(options: Dict[str, Any]) -> bool:
    return options.get("plan_shape", "ragged") in ("blocks_shared", "blocks_per_layer")


BLOCKS: List[Method] = [block_twin(m) for name in BLOCK_TWINS_OF for m in MAIN if m[0] == name]
# {block twin: its RAGGED method}, in BLOCK_TWINS_OF's order
BLOCK_PAIRS: Dict[str, str] = {name + BLOCK_SUFFIX: name for name in BLOCK_TWINS_OF}
MAIN += BLOCKS

# The layer-share cap (policy max_layer_share) at the shape the vLLM plugin applies,
# LAYER_UNIFORM, each beside the default RAGGED plan (run.sh --layer-cap; LAYERCAP.md). The
# default's options plus plan_shape, so the same window w = 32; no cap, then caps of s times
# the average layer's share.
LAYER_CAPS = [None, 3.0, 2.0, 1.5, 1.25]
LAYER_UNIFORM_NAME = "LaProx·layer_uniform"


def cap_method(share: Any) -> Method:
    options = {**DEFAULT_OPTIONS, "plan_shape": "layer_uniform"}
    if share is None:
        return (LAYER_UNIFORM_NAME, options)
    return (f"{LAYER_UNIFORM_NAME} cap={share:g}", {**options, "max_layer_share": share})


LAYERCAP: List[Method] = [cap_method(s) for s in LAYER_CAPS]
# {capped (or uncapped) LAYER_UNIFORM method: its RAGGED method}
LAYERCAP_PAIRS: Dict[str, str] = {name: DEFAULT for name, _ in LAYERCAP}

# Methods of the language-model part only (each costs a keep-plan per budget and prompt, and
# the teacher-forced forward of a 31-token continuation, ~0.1 s and ~0.22 s on 2 cores).
LM_ONLY: List[Method] = [
    ("LaProx A*|v|", {**variant(indicator="attention_x_value", gqa_value=None),
                      "budgets": ABLATION_BUDGETS}),
    # the unpooled scores of the objective check: the paper's indicator vs attention only
    ("LaProx exact nopool", {"gqa_value": "exact_block", "pooling": "none"}),
    ("LaProx A nopool", {"indicator": "attention", "pooling": "none"}),
]
# Methods measured on the layer-local metrics only (no teacher-forced forward, no KL).
OBJECTIVE_ONLY = {"LaProx exact nopool", "LaProx A nopool"}

# The baselines of the summary tables, in order.
GRID_POOLS = [7, 31, 63]
GRID_GQA = ["mean_head_norm", "summed_projection", "mean_head_product", "exact_block"]


def grid_methods(pools: List[int] = GRID_POOLS, windows: Tuple[int, ...] = (32, 64)
                 ) -> List[Method]:
    """gqa_value x (no pooling, or avg pooling of each kernel on each target) x window, and
    SnapKV / AdaKV at the same poolings."""
    out: List[Method] = [(DEFAULT, V1_OPTIONS)]   # the grid's reference: the default before it
    for w in windows:
        for gqa in GRID_GQA:
            out.append((f"{gqa} none w={w}", {"gqa_value": gqa, "pooling": "none", "window": w}))
            for target in ("attention", "score"):
                for k in pools:
                    out.append((f"{gqa} {target} avg{k} w={w}",
                                {"gqa_value": gqa, "pool_target": target, "pooling": "avg",
                                 "pool_kernel": k, "window": w}))
    for kind in ("snapkv", "adakv"):
        out.append((f"{kind} none w=32", {"kind": kind, "window": 32, "pooling": "none"}))
        for k in [5] + pools:
            out.append((f"{kind} avg{k} w=32", {"kind": kind, "window": 32, "pooling": "avg",
                                                "pool_kernel": k}))
    return out

# The joint evaluation (joint.py, ENDPOINT.md): the candidate defaults, each at both plan shapes
# the product applies (RAGGED for laprox.hf, LAYER_UNIFORM with max_layer_share 1.25 for the vLLM
# plugin), against SnapKV, AdaKV and CriticalKV at their published pooling (avg 5) and at the
# current default's (avg 31), all at w = WINDOW.
JOINT_SHAPE_SUFFIX = "·layer_uniform cap=1.25"
JOINT_RAGGED: List[Method] = [
    ("LaProx", PRE44_OPTIONS),                                  # the default before issue 44
    ("LaProx avg_peak", {**PRE44_OPTIONS, "pooling": "avg_peak"}),   # DIAGNOSIS.md's fix
    ("LaProx sinks=1", {**PRE44_OPTIONS, "sinks": 1}),          # the same cause, an old option
]


def _layer_uniform(method: Method) -> Method:
    name, options = method
    return (name + JOINT_SHAPE_SUFFIX, {**options, "plan_shape": "layer_uniform",
                                        "max_layer_share": 1.25})


JOINT_CANDIDATES: List[str] = [name for name, _ in JOINT_RAGGED] + \
    [_layer_uniform(m)[0] for m in JOINT_RAGGED]
JOINT_SHAPES: Dict[str, List[str]] = {
    "RAGGED (laprox.hf)": [name for name, _ in JOINT_RAGGED],
    "LAYER_UNIFORM, max_layer_share 1.25 (the vLLM plugin)":
        [_layer_uniform(m)[0] for m in JOINT_RAGGED]}
JOINT_BASELINE_METHODS: List[Method] = [
    (f"{name}{'' if k == 5 else f' pool={k}'}", {"kind": kind, "window": WINDOW, "pool_kernel": k})
    for k in (5, 31) for name, kind in (("SnapKV", "snapkv"), ("AdaKV", "adakv"),
                                        ("CriticalKV", "criticalkv"))]
JOINT_BASELINES: List[str] = [name for name, _ in JOINT_BASELINE_METHODS]
JOINT: List[Method] = JOINT_RAGGED + [_layer_uniform(m) for m in JOINT_RAGGED] + \
    JOINT_BASELINE_METHODS

# Outside the endpoint: the baselines with the default's pooling itself (AVG_PEAK over 31), to
# see how much of the default's lead is its pooling rather than its score (joint.py
# --peak-baselines; reported in the means table only, no criterion reads them).
JOINT_PEAK_BASELINES: List[Method] = [
    (f"{name} avg_peak31", {"kind": kind, "window": WINDOW, "pool_kernel": 31,
                            "pooling": "avg_peak"})
    for name, kind in (("SnapKV", "snapkv"), ("AdaKV", "adakv"), ("CriticalKV", "criticalkv"))]
