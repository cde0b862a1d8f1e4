"""The methods the quality evaluation compares, and the dev grid the defaults are chosen on.

A method is (name, options): options are laprox Policy fields sent to laproxd, or
{"kvpress": NAME} for kvpress's own press. Every method runs at the same observation window
w = WINDOW unless its name says otherwise; the SnapKV family's published window 64 is one
reference row (kvpress SnapKV w=64)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

WINDOW = 32
Method = Tuple[str, Dict[str, Any]]

# The default the rest of the table is compared with: the server's defaults with nothing set.
DEFAULT = "LaProx"

MAIN: List[Method] = [
    (DEFAULT, {}),
    ("LaProx paper", {"preset": "paper"}),
    # the paper's allocation ablation
    ("LaProx global-raw", {"allocation": "global_raw"}),
    ("LaProx per-layer", {"allocation": "per_layer"}),
    ("LaProx uniform", {"allocation": "uniform"}),
    # the indicator ablation (A*|v| on the language-model part only, see LM_ONLY)
    ("LaProx A", {"indicator": "attention"}),
    # the exact per-KV-entry norm at the default pooling
    ("LaProx exact", {"gqa_value": "exact_block"}),
    # baselines, laproxd's implementations (kvpress semantics), at w = 32, published pooling
    ("StreamingLLM", {"kind": "streaming_llm"}),
    ("SnapKV", {"kind": "snapkv", "window": WINDOW}),
    ("AdaKV", {"kind": "adakv", "window": WINDOW}),
    ("CriticalKV", {"kind": "criticalkv", "window": WINDOW}),
    ("CAKE", {"kind": "cake", "window": WINDOW}),
    # the published SnapKV, kvpress's own code at its default window 64
    ("kvpress SnapKV w=64", {"kvpress": "SnapKV"}),
]

# Methods of the language-model part only (each method costs a keep-plan per budget and
# prompt, ~0.2 s on 2 cores, so the retrieval part runs the ones its questions need).
LM_ONLY: List[Method] = [
    ("LaProx A*|v|", {"indicator": "attention_x_value"}),
    # the unpooled scores of the objective check: the paper's indicator vs attention only
    ("LaProx exact nopool", {"gqa_value": "exact_block", "pooling": "none"}),
    ("LaProx A nopool", {"indicator": "attention", "pooling": "none"}),
]

# The baselines of the summary tables, in order.
GRID_POOLS = [7, 31, 63]
GRID_GQA = ["mean_head_norm", "summed_projection", "mean_head_product", "exact_block"]


def grid_methods(pools: List[int] = GRID_POOLS, windows: Tuple[int, ...] = (32, 64)
                 ) -> List[Method]:
    """gqa_value x (no pooling, or avg pooling of each kernel on each target) x window, and
    SnapKV / AdaKV at the same poolings."""
    out: List[Method] = []
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
