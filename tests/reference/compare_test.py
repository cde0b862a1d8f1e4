#!/usr/bin/python3
"""Compares the C++ CPU backend with the float64 oracle on a grid of random cases.

How it works
    For every case of the grid this script draws random tensors (seeded; the seed is printed),
    rounds them to the case's dtype, writes them as .npy files in the layout the case asks for
    (contiguous, [n, Hkv, d] order, padded rows, transposed, or keys and values in a paged pool
    read through block tables), and writes case.json. It then runs the C++ backend over all
    case directories in one process (`laprox_case_runner`), runs the oracle
    (laprox_ref.keep_plan) on the same stored values in float64, and compares:

    - both reject the same invalid cases (the C++ side with INVALID_ARGUMENT);
    - quota and total selected are equal; counts equal the kept masks; the bitmask equals the
      kept positions;
    - competing scores agree to a relative 2e-4 of the layer's largest score;
    - kept sets are equal up to swaps among near-ties: every position kept by one side only is
      paired with one kept by the other side only, in the same competition (model, layer or
      head, depending on the allocation), whose oracle scores differ by less than 1e-5 relative.

Run it
    ctest -R reference_compare         (from the build tree), or
    /usr/bin/python3 tests/reference/compare_test.py --runner build/tests/reference/laprox_case_runner
    Options: --seed N, --only SUBSTRING (case names), --keep DIR (keep the case directories),
    --plant-bug raw|reserve|pool|pool_target|defaults|blocks|block_competition|table|layer_cap|
                peak
    (sends C++ a wrong policy: GLOBAL_RAW while the oracle normalises, min_per_head 10 while
    the oracle has 0, for baselines pool_kernel 1 while the oracle pools over 5 or 7, the other
    pool_target where a case sets one, the old LAPROX defaults MEAN_HEAD_NORM and pool_kernel 7
    where a case leaves gqa_value out, BLOCKS_PER_LAYER where the oracle has BLOCKS_SHARED and
    the reverse, PER_LAYER competition where the oracle's BLOCKS_PER_LAYER plan competes
    model-wide with GLOBAL_NORMALIZED (the same scores: only the kept blocks change), every
    block table's ids rotated by one (C++ reads the pool's blocks in another order), or
    (layer_cap) max_layer_share left out where a case sets it (C++ plans uncapped); the script
    then succeeds only if cases fail, which proves the score, kept-set, kept-block and paged
    comparisons can fail).

    Baseline policies (cases named "bl-...", built by build_baseline_grid()) are compared the
    same way with their own rules (compare_baseline): scores are the ranking scores with
    sentinels (fp32 on the C++ side, so oracle values beyond fp32 range must be +inf there),
    compared to a relative 2e-4 of the layer's largest finite score (2e-3 when KVPRESS_COMPAT
    rounds 16-bit attention: C++ rounds from fp32, the oracle from float64); the competition
    scope is the head (the layer for ADAKV and CRITICAL_ADAKV, whose head budgets come from a
    layer-wide top-k); near-ties are 1e-5 relative (2e-3 with 16-bit rounding), on the ranking
    score or on the oracle's raw prefix score (a near-tie in a first stage moves a token to the
    other stage); CAKE's layer preferences (layer_sums) agree to 1e-3 relative.

    Plan shapes (cases named "shape-...", build_shape_grid(); SEMANTICS.md, "Plan shapes"):
    LAYER_UNIFORM is compared like head_uniform_layers (per-head competitions). A block shape
    (BLOCKS_SHARED, BLOCKS_PER_LAYER) is compared by compare_blocks(): block_size, num_blocks
    and units equal; kept blocks ascending; every (layer, head) of C++ keeps exactly the
    positions of its unit's kept blocks; block scores +inf at the same (forced) blocks and the
    others within a relative 2e-4 of the unit's largest finite block score (8e-3 when
    KVPRESS_COMPAT rounds 16-bit attention: one token rounded the other way moves its block by
    up to 2^-8 of its score; STREAMING_LLM: exactly 1 kept / 0 evicted); kept blocks equal up
    to swaps among near-ties (oracle block scores within 1e-5 relative, 2e-3 with 16-bit
    rounding) inside one competition (the model for BLOCKS_SHARED and for LAPROX's
    BLOCKS_PER_LAYER with GLOBAL_NORMALIZED / GLOBAL_RAW, else the layer), forced blocks
    exactly; with paged keys, each unit's new block table and freed ids equal the oracle's
    where the kept blocks agree, and otherwise the unit's table at C++'s kept (and evicted)
    blocks. These replace the token-level kept-set comparison; the per-token scores, quota and
    total selected are compared as for RAGGED.

    Paged inputs (cases named "paged-...", build_paged_grid()): keys and values lie in a pool
    file ("flash": vLLM FlashAttention's [2, blocks, bs, Hkv, d]; "hnd": [blocks, 2, Hkv, bs,
    d]) at shuffled physical block ids of block tables written to case.json ("block_tables":
    one shared by every layer, or one per layer), with spare blocks and the unused slots of a
    partial last block NaN so that a wrong read cannot pass. The runner reads them through
    kernels::BlockTable and TensorView::Paged; the oracle gathers the logical tensor through
    the same table itself (laprox_ref.gather_paged), and the plans are compared as above.

Extend it
    Add a case to build_grid(): a name and a dict of overrides of BASE_CASE, or to
    build_baseline_grid(): bcase(name, kind, policy overrides, case overrides). Plan shapes go
    to build_shape_grid() (policy plan_shape / block_size), paged inputs to build_paged_grid():
    the case override paged=dict(bs=16, layout="flash"|"hnd", tables="shared"|"per_layer",
    optionally tensors=["keys"] and layers=[1, 2] to page only those).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import laprox_ref  # noqa: E402

NEAR_TIE_RTOL = 1e-5
SCORE_RTOL = 2e-4

BASE_CASE = dict(
    L=2, H=4, Hkv=2, d=16, D=32, n=300, wq=None, dtype="f32", layout="contiguous",
    inputs="queries", logit_scale=2.0,
    policy=dict(allocation="GLOBAL_NORMALIZED", indicator="ATTENTION_X_PROJECTED_VALUE",
                gqa_value="MEAN_HEAD_NORM", window=32, pooling="AVG", pool_kernel=7, sinks=0,
                min_per_head=0, head_uniform_layers=False, tokens_per_head=64,
                compression_ratio=None),
)


def case(name, policy=None, **kw):
    c = json.loads(json.dumps(BASE_CASE))
    c.update(kw)
    c["policy"].update(policy or {})
    c["name"] = name
    return c


def default_case(name, policy=None, **kw):
    """A LAPROX case whose policy has only `policy` and a budget: every other field takes its
    default on both sides (SEMANTICS.md, "Defaults")."""
    c = case(name, **kw)
    c["policy"] = {"tokens_per_head": 64, **(policy or {})}
    return c


def bcase(name, kind, policy=None, **kw):
    """A baseline case: BASE_CASE's tensors, a policy with only `kind`, a budget (cr 0.5 unless
    given) and the overrides, so that every other field takes the kind's default."""
    c = json.loads(json.dumps(BASE_CASE))
    c.update(kw)
    c["policy"] = dict(kind=kind, compression_ratio=0.5)
    c["policy"].update(policy or {})
    if c["policy"].get("tokens_per_head") is not None:
        c["policy"].pop("compression_ratio")
    c["name"] = f"bl-{kind}-{name}"
    return c


def policy_window(policy):
    """The window the policy uses (its kind's default unless given)."""
    kind = policy.get("kind", "LAPROX")
    defaults = dict(laprox_ref.POLICY_DEFAULTS, **laprox_ref.KIND_DEFAULTS[kind])
    return policy.get("window", defaults["window"])


def build_grid():
    grid = []
    # Group sizes (MHA and GQA) with every gqa_value.
    for G, (H, Hkv) in ((1, (3, 3)), (3, (6, 2)), (4, (8, 2)), (8, (8, 1))):
        for gqa in laprox_ref.GQA_VALUES:
            grid.append(case(f"G{G}-{gqa}", H=H, Hkv=Hkv, policy=dict(gqa_value=gqa)))
    # Indicators and allocations, each crossed with a few budgets.
    for ind in laprox_ref.INDICATORS:
        for alloc in laprox_ref.ALLOCATIONS:
            for b in (20, 64, 200):
                grid.append(case(f"{ind}-{alloc}-B{b}", H=6, Hkv=2, n=257,
                                 policy=dict(indicator=ind, allocation=alloc,
                                             tokens_per_head=b)))
    # Sequence lengths from 1 to 5000 against windows 1, 8, 32, 64 and sinks 0, 4.
    for n in (1, 2, 7, 33, 100, 1000, 5000):
        for w in (1, 8, 32, 64):
            for sinks in (0, 4):
                if n == 5000 and (w, sinks) not in ((64, 4), (32, 0)):
                    continue
                grid.append(case(f"n{n}-w{w}-s{sinks}", n=n, L=2 if n < 5000 else 3,
                                 H=8 if n == 5000 else 4, wq=w + (3 if n % 2 else 0),
                                 policy=dict(window=w, sinks=sinks,
                                             tokens_per_head=max(1, n // 3))))
    # Budgets: below the window, at it, around n, above n, and compression ratios.
    for b in (0, 5, 32, 36, 150, 299, 300, 301, 10_000):
        grid.append(case(f"budget{b}-s4", policy=dict(tokens_per_head=b, sinks=4)))
    for cr in (0.0, 0.5, 0.9, 0.99):
        grid.append(case(f"cr{cr}", n=1000, policy=dict(tokens_per_head=None,
                                                         compression_ratio=cr)))
    # dtypes and strided layouts, with the three ways of giving the window.
    for dtype in ("f32", "f16", "bf16"):
        for layout in ("contiguous", "nhd", "padded", "dmajor"):
            for inputs in ("queries", "lse", "attention"):
                grid.append(case(f"{dtype}-{layout}-{inputs}", dtype=dtype, layout=layout,
                                 inputs=inputs, H=6, Hkv=2, n=200))
    # Pooling variants.
    for pooling, k in (("AVG", 1), ("AVG", 3), ("AVG", 31), ("MAX", 7), ("NONE", 7),
                       ("AVG_PEAK", 3), ("AVG_PEAK", 31)):
        grid.append(case(f"pool-{pooling}{k}", policy=dict(pooling=pooling, pool_kernel=k)))
    # pool_target with every attention summary and value factor, AVG and MAX pooling (G = 3,
    # sinks in the pooled range), and at G = 1, where EXACT_BLOCK is MEAN_HEAD_NORM.
    modes = [("ATTENTION_X_PROJECTED_VALUE", gqa) for gqa in laprox_ref.GQA_VALUES]
    modes += [("ATTENTION_X_VALUE", "MEAN_HEAD_NORM"), ("ATTENTION", "MEAN_HEAD_NORM")]
    for target in laprox_ref.POOL_TARGETS:
        for pooling in ("AVG", "MAX", "AVG_PEAK"):
            for ind, gqa in modes:
                grid.append(case(f"pooltarget-{target}-{pooling}-{ind}-{gqa}", H=6, Hkv=2, n=257,
                                 policy=dict(indicator=ind, gqa_value=gqa, pooling=pooling,
                                             pool_target=target, sinks=3)))
            for gqa in ("MEAN_HEAD_PRODUCT", "EXACT_BLOCK"):
                grid.append(case(f"pooltarget-{target}-{pooling}-G1-{gqa}", H=3, Hkv=3,
                                 policy=dict(gqa_value=gqa, pooling=pooling, pool_target=target)))
    # min_per_head and head_uniform_layers with every allocation.
    for alloc in laprox_ref.ALLOCATIONS:
        for mph in (0, 3, 100):
            for hu in (False, True):
                grid.append(case(f"mph{mph}-hu{int(hu)}-{alloc}", H=6, Hkv=3, L=3,
                                 policy=dict(allocation=alloc, min_per_head=mph,
                                             head_uniform_layers=hu)))
    # Several key chunks of the CPU backend (1024 keys), the causal limit of the window rows
    # straddling a chunk boundary, with each way of giving the window and each attention summary.
    for n, w in ((1060, 64), (2048, 32), (3000, 8)):
        for inputs in ("queries", "lse", "attention"):
            for gqa in ("MEAN_HEAD_NORM", "MEAN_HEAD_PRODUCT", "EXACT_BLOCK"):
                grid.append(case(f"chunks-n{n}-w{w}-{inputs}-{gqa}", n=n, H=6, Hkv=2,
                                 inputs=inputs, policy=dict(window=w, gqa_value=gqa,
                                                            tokens_per_head=n // 4)))
    # The defaults themselves (gqa_value by the indicator, AVG pool 31 of the placement that
    # gives, window 32, no sinks), with each indicator, MHA and GQA, and with sinks and a budget
    # below the window.
    for ind in (None,) + laprox_ref.INDICATORS:
        for G, (H, Hkv) in ((1, (3, 3)), (3, (6, 2)), (4, (8, 2))):
            policy = dict(indicator=ind) if ind else {}
            grid.append(default_case(f"default-{ind or 'unset'}-G{G}", policy, H=H, Hkv=Hkv,
                                     n=257))
    grid.append(default_case("default-s3-B20", dict(sinks=3, tokens_per_head=20), H=6, Hkv=2,
                             n=1000))
    # Degenerate data: an all-zero value layer (uniform layer), identical keys (ties).
    grid.append(case("zero-values-layer", special="zero_values", policy=dict(sinks=2)))
    grid.append(case("equal-scores", special="equal", policy=dict(pooling="NONE")))
    grid.append(case("llama-like", L=2, H=32, Hkv=8, d=32, D=128, n=600,
                     policy=dict(tokens_per_head=100, sinks=4)))
    # Invalid policies both sides must reject.
    grid.append(case("bad-window-gt-rows", wq=8, policy=dict(window=16), expect_error=True))
    grid.append(case("bad-indicator-gqa", policy=dict(indicator="ATTENTION",
                                                      gqa_value="EXACT_BLOCK"),
                     expect_error=True))
    grid.append(case("bad-even-kernel", policy=dict(pool_kernel=4), expect_error=True))
    return (grid + build_baseline_grid() + build_tiny_attention_grid() + build_shape_grid()
            + build_paged_grid() + build_cap_grid())


def build_cap_grid():
    """max_layer_share (SEMANTICS.md, "Selection"): cases named "cap-...". Layers of very
    different attention peakiness (layer_logit_scales) so that the peaky layers win several
    times their average share without the cap; `cap_binds` says whether the oracle's plan must
    differ from its uncapped plan (True), equal it (False), or either (None); compare() checks
    it, and that no layer selects more than the cap."""
    grid = []
    spread = dict(L=4, H=4, Hkv=2, n=300, layer_logit_scales=[0.3, 1.0, 4.0, 12.0])
    for alloc in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"):
        for share in (1.0, 1.25, 1.5, 2.0, 3.0):
            for mph in (0, 5, 100):
                grid.append(case(f"cap-{alloc}-s{share}-mph{mph}", cap_binds=None, **spread,
                                 policy=dict(allocation=alloc, max_layer_share=share,
                                             min_per_head=mph)))
        for share in (1.25, 2.0):
            grid.append(case(f"cap-{alloc}-s{share}-layer_uniform", cap_binds=None, **spread,
                             policy=dict(allocation=alloc, max_layer_share=share,
                                         plan_shape="LAYER_UNIFORM", min_per_head=3)))
            grid.append(case(f"cap-{alloc}-s{share}-hu", cap_binds=None, **spread,
                             policy=dict(allocation=alloc, max_layer_share=share,
                                         head_uniform_layers=True)))
    # Binding for sure (a cap of 1 at unequal layers), not binding (a cap of L: every layer's
    # total is at most K), the defaults (MEAN_HEAD_PRODUCT, pool 31) at a cap, sinks, MHA, a
    # budget above n (q = m: every candidate kept whatever the cap), a compression ratio.
    grid.append(case("cap-binds-s1", cap_binds=True, **spread,
                     policy=dict(max_layer_share=1.0)))
    grid.append(case("cap-free-sL", cap_binds=False, **spread, policy=dict(max_layer_share=4.0)))
    grid.append(case("cap-free-huge", cap_binds=False, **spread,
                     policy=dict(max_layer_share=1e300)))
    grid.append(default_case("cap-defaults-s1.5", dict(max_layer_share=1.5), cap_binds=None,
                             **spread))
    grid.append(default_case("cap-defaults-s1.25-lu", dict(max_layer_share=1.25,
                                                           plan_shape="LAYER_UNIFORM"),
                             cap_binds=None, **spread))
    grid.append(case("cap-sinks", cap_binds=None, **spread,
                     policy=dict(max_layer_share=1.5, sinks=4, tokens_per_head=100)))
    grid.append(case("cap-mha-L6", cap_binds=None, L=6, H=3, Hkv=3, n=200,
                     layer_logit_scales=[0.2, 0.5, 1.0, 3.0, 8.0, 16.0],
                     policy=dict(max_layer_share=1.3, tokens_per_head=50)))
    grid.append(case("cap-all-kept", cap_binds=False, **spread,
                     policy=dict(max_layer_share=1.0, tokens_per_head=1000)))
    grid.append(case("cap-cr", cap_binds=None, **spread,
                     policy=dict(max_layer_share=1.5, tokens_per_head=None,
                                 compression_ratio=0.75)))
    # Accepted and ignored: PER_LAYER and UNIFORM (plans as without the cap).
    for alloc in ("PER_LAYER", "UNIFORM"):
        grid.append(case(f"cap-ignored-{alloc}", cap_binds=False, **spread,
                         policy=dict(allocation=alloc, max_layer_share=1.5)))
    # Invalid: below 1, negative, a baseline kind, a block shape.
    for share in (0.5, -1.0, 0.0):
        grid.append(case(f"cap-bad-{share}", policy=dict(max_layer_share=share),
                         expect_error=True))
    grid.append(bcase("cap-bad-kind", "SNAPKV", dict(max_layer_share=2.0), expect_error=True))
    grid.append(case("cap-bad-blocks", policy=dict(max_layer_share=2.0,
                                                   plan_shape="BLOCKS_SHARED", block_size=16),
                     expect_error=True))
    return grid


def build_tiny_attention_grid():
    """Window attention far below 1e-19 (issue 20, item 5). The logits of a window row are
    ~15 * z_j with the same z_j in every row and head, so most prefix tokens get attention
    between 1e-38 and 1e-19 in every row, and the budget (85% of the candidates, 95% for "rise")
    puts the selection threshold among them, at attention ~1e-24 to 1e-29, with w <= 8. In fp32
    the squares of such attention flush to 0 (below ~4e-23) or keep a few bits (subnormals), and
    an AVG pool taken as a difference of prefix sums drowns them in the rounding of the large
    values before them, so the tokens tie at 0 and are picked by position; the oracle orders
    them. "random": z_j in random order (pooling NONE); "rise": z_j rising along the positions
    (-2 up to 2, plus noise; MAX pooling), so that the lowest positions, which win ties, have the
    smallest attention; "fall": z_j falling from 2 to -2 (AVG pooling), so that AVG windows lie
    wholly among tiny tokens after large ones. Every
    (w, inputs) pair and every attention summary (MEAN_HEAD_NORM: the group mean, MEAN_HEAD_PRODUCT:
    per head, EXACT_BLOCK: per head pair) appears for each variant."""
    grid = []
    gqas = ("MEAN_HEAD_NORM", "MEAN_HEAD_PRODUCT", "EXACT_BLOCK")
    for tiny, pooling, share in (("random", "NONE", 0.85), ("rise", "MAX", 0.95),
                                 ("fall", "AVG", 0.85)):
        for i, w in enumerate((1, 4, 8)):
            for j, inputs in enumerate(("queries", "lse", "attention")):
                gqa = gqas[(i + j) % 3]
                n = 300
                grid.append(case(f"tiny-{tiny}-{pooling}-w{w}-{inputs}-{gqa}", n=n, H=4, Hkv=2,
                                 inputs=inputs, tiny=tiny, wq=w,
                                 policy=dict(window=w, pooling=pooling, gqa_value=gqa,
                                             tokens_per_head=w + int(share * (n - w)))))
    # The per-head summaries with pool_target ATTENTION pool each head's tiny attention norms.
    for gqa in ("MEAN_HEAD_PRODUCT", "EXACT_BLOCK"):
        for inputs in ("queries", "attention"):
            grid.append(case(f"tiny-fall-AVG-w4-{inputs}-{gqa}-pooltarget-ATTENTION", n=300, H=4,
                             Hkv=2, inputs=inputs, tiny="fall", wq=4,
                             policy=dict(window=4, pooling="AVG", gqa_value=gqa,
                                         pool_target="ATTENTION",
                                         tokens_per_head=4 + int(0.85 * 296))))
    return grid


def build_baseline_grid():
    """Every baseline kind across group sizes, budgets, lengths around the window, dtypes in
    both numeric modes and the ways of giving the window, plus each kind's own branches."""
    grid = []
    small = dict(L=2, d=8, D=24)
    for kind in laprox_ref.BASELINE_KINDS:
        w = policy_window({"kind": kind})
        for G, (H, Hkv) in ((1, (3, 3)), (3, (6, 2)), (4, (8, 2))):
            grid.append(bcase(f"G{G}", kind, H=H, Hkv=Hkv, n=257, **small))
        for cr in (0.0, 0.5, 0.9):
            grid.append(bcase(f"cr{cr}", kind, dict(compression_ratio=cr), n=500, **small))
        for b in (0, 10, 100, 350):
            grid.append(bcase(f"B{b}", kind, dict(tokens_per_head=b), n=300, **small))
        # n around the window: all window (n < w, n = w), one prefix token, long sequences.
        for n in (1, 2, w // 2, w, w + 1, 1000, 3000):
            budget = dict(tokens_per_head=max(1, n // 3)) if n % 2 else {}
            grid.append(bcase(f"n{n}", kind, budget, n=n, H=4, Hkv=2,
                              L=1 if n == 3000 else 2, d=8, D=16))
        for dtype in ("f32", "f16", "bf16"):
            for mode in ("EXACT", "KVPRESS_COMPAT"):
                grid.append(bcase(f"{dtype}-{mode}", kind, dict(numeric_mode=mode), dtype=dtype,
                                  H=6, Hkv=2, n=400, **small))
        for inputs in ("lse", "attention"):
            grid.append(bcase(f"{inputs}-compat", kind, dict(numeric_mode="KVPRESS_COMPAT"),
                              inputs=inputs, dtype="bf16", H=6, Hkv=2, n=300, **small))
        grid.append(bcase("window17-maxpool", kind, dict(window=17, pooling="MAX", pool_kernel=3),
                          n=200, **small))
        grid.append(bcase("bad-window-gt-rows", kind, dict(window=16), wq=8, n=100,
                          expect_error=kind != "STREAMING_LLM", **small))
    # Strided layouts (the L1 norms read values through the same views).
    for kind in ("SNAPKV", "CRITICALKV", "CAKE"):
        for layout in ("nhd", "padded", "dmajor"):
            grid.append(bcase(f"{layout}", kind, dict(numeric_mode="KVPRESS_COMPAT"),
                              layout=layout, dtype="f16", H=6, Hkv=2, n=300, **small))
    # StreamingLLM: sinks beyond the budget, no sinks.
    for sinks, b in ((10, 6), (0, 50), (4, 4)):
        grid.append(bcase(f"sinks{sinks}-B{b}", "STREAMING_LLM",
                          dict(sinks=sinks, tokens_per_head=b), n=100, **small))
    # PyramidKV branches: pyramid (L 4), the max >= n - w clamp, the fallback, one layer.
    for name, n, cr, L in (("pyramid", 3000, 0.55, 4), ("clamp", 1000, 0.5, 3),
                           ("fallback", 1000, 0.9, 3), ("one-layer", 3000, 0.55, 1)):
        grid.append(bcase(name, "PYRAMIDKV", dict(compression_ratio=cr), n=n, L=L, H=4, Hkv=2,
                          d=8, D=16))
    grid.append(bcase("beta2", "PYRAMIDKV", dict(pyramid_beta=2.0, compression_ratio=0.3),
                      n=600, L=3, **{k: v for k, v in small.items() if k != "L"}))
    # CriticalKV: stage 1 smaller than the window (window tokens can lose), stage ratios.
    for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
        grid.append(bcase("stage1-lt-window", kind, dict(tokens_per_head=100), n=300,
                          value_spread=True, **small))
        for r in (0.0, 1.0):
            grid.append(bcase(f"fsr{r}", kind, dict(first_stage_ratio=r, epsilon=0.01), n=300,
                              **small))
    for alpha in (0.0, 1.0):
        grid.append(bcase(f"alpha{alpha}", "ADAKV", dict(alpha_safeguard=alpha), n=300, **small))
    # CAKE: layers with very different attention (a budget capped at n - w), no compression,
    # a one-row window, other exponents.
    grid.append(bcase("capped", "CAKE", dict(tokens_per_head=150), n=200, L=4,
                      layer_logit_scales=[0.05, 0.3, 4.0, 8.0], H=4, Hkv=2, d=8, D=16))
    grid.append(bcase("no-compression", "CAKE", dict(tokens_per_head=170), n=200, **small))
    grid.append(bcase("w1", "CAKE", dict(window=1), n=200, **small))
    grid.append(bcase("tau-gamma", "CAKE", dict(cake_tau1=1.0, cake_tau2=2.0, cake_gamma=0.0),
                      n=300, L=3, **{k: v for k, v in small.items() if k != "L"}))
    # Exponents that overflow P_l (reported as the largest double) or underflow every P_l to
    # 0: the budgets follow log P_l.
    for name, taus in (("tau-overflow", dict(cake_tau1=1e-4)),
                       ("tau-underflow", dict(cake_tau2=1e-3))):
        grid.append(bcase(name, "CAKE", dict(taus, tokens_per_head=60), n=200, L=4,
                          layer_logit_scales=[0.05, 0.3, 4.0, 8.0], H=4, Hkv=2, d=8, D=16))
    # Invalid baseline parameters both sides must reject.
    for field, value in (("pyramid_beta", 0.5), ("alpha_safeguard", 1.5), ("epsilon", -1e-3),
                         ("first_stage_ratio", 2.0), ("cake_tau1", 0.0), ("cake_tau2", -1.0),
                         ("cake_gamma", -5.0)):
        grid.append(bcase(f"bad-{field}", "SNAPKV", {field: value}, n=100, expect_error=True,
                          **small))
    return grid


def shape_bcase(name, kind, policy=None, **kw):
    """A baseline case of the plan-shape grid (named "shape-bl-KIND-...")."""
    c = bcase(name, kind, policy, **kw)
    c["name"] = "shape-" + c["name"]
    return c


def build_shape_grid():
    """Plan shapes (SEMANTICS.md, "Plan shapes"), cases named "shape-...": LAPROX with both
    block shapes across allocations and block sizes (7: partial blocks everywhere), budgets at
    the edges (B >= n, Kb below the forced blocks, 0, compression ratios), sinks over several
    blocks, short sequences, ties, a uniform layer; LAYER_UNIFORM against head_uniform_layers;
    SNAPKV, ADAKV, STREAMING_LLM at both block shapes in both numeric modes; LAYER_UNIFORM for
    the baselines; and the invalid combinations."""
    grid = []
    lap = dict(L=3, H=4, Hkv=2, n=300)
    blocks = ("BLOCKS_SHARED", "BLOCKS_PER_LAYER")
    for shape in blocks:
        s = "SHARED" if shape == "BLOCKS_SHARED" else "PER_LAYER"
        for alloc in laprox_ref.ALLOCATIONS:
            for bs in (1, 7, 16, 32):
                grid.append(case(f"shape-{s}-{alloc}-bs{bs}", **lap,
                                 policy=dict(allocation=alloc, plan_shape=shape, block_size=bs,
                                             sinks=4, tokens_per_head=100)))
        # Budgets with sinks 4 and blocks of 16 (4 forced blocks: 0 and 16..18): 0, Kb = 2 below
        # the forced blocks, one below n, n, far above n.
        for b in (0, 40, 299, 300, 10_000):
            grid.append(case(f"shape-{s}-B{b}", **lap, policy=dict(
                plan_shape=shape, block_size=16, sinks=4, tokens_per_head=b)))
        for cr in (0.5, 0.9):
            grid.append(case(f"shape-{s}-cr{cr}", L=3, H=4, Hkv=2, n=1000, policy=dict(
                plan_shape=shape, block_size=32, tokens_per_head=None, compression_ratio=cr)))
        grid.append(case(f"shape-{s}-sinks40-bs16", **lap, policy=dict(
            plan_shape=shape, block_size=16, sinks=40, tokens_per_head=120)))
        grid.append(case(f"shape-{s}-n320-bs32-full-blocks", L=3, H=4, Hkv=2, n=320, policy=dict(
            plan_shape=shape, block_size=32, tokens_per_head=130, allocation="GLOBAL_RAW")))
        for n in (1, 20, 33):                   # all window, all window, one candidate
            grid.append(case(f"shape-{s}-n{n}", L=2, n=n, policy=dict(
                plan_shape=shape, block_size=4, sinks=2, tokens_per_head=8)))
        grid.append(case(f"shape-{s}-mph5", **lap, policy=dict(
            plan_shape=shape, block_size=7, min_per_head=5)))
        for alloc in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"):    # uniform layer: 1/(Hkv m) or raw 0
            grid.append(case(f"shape-{s}-zero-values-layer-{alloc}", special="zero_values",
                             **lap, policy=dict(plan_shape=shape, block_size=16, sinks=2,
                                                allocation=alloc, tokens_per_head=150)))
        grid.append(case(f"shape-{s}-equal-scores", special="equal", L=2, n=200, policy=dict(
            plan_shape=shape, block_size=8, pooling="NONE", tokens_per_head=100)))
        grid.append(default_case(f"shape-{s}-defaults", dict(plan_shape=shape, block_size=16),
                                 H=6, Hkv=2, n=257))
        grid.append(case(f"shape-{s}-mqa-bs65536", L=2, H=8, Hkv=1, policy=dict(
            plan_shape=shape, block_size=65536)))
    # The ragged plan of the uniform-layer cases (its scores are what the block shapes report).
    grid.append(case("shape-RAGGED-zero-values-layer-GLOBAL_RAW", special="zero_values", **lap,
                     policy=dict(sinks=2, allocation="GLOBAL_RAW", tokens_per_head=150)))
    grid.append(case("shape-SHARED-ATTENTION-bs8", **lap, policy=dict(
        plan_shape="BLOCKS_SHARED", block_size=8, indicator="ATTENTION")))
    grid.append(case("shape-PER_LAYER-ATTENTION_X_VALUE-bs8", **lap, policy=dict(
        plan_shape="BLOCKS_PER_LAYER", block_size=8, indicator="ATTENTION_X_VALUE")))
    grid.append(case("shape-PER_LAYER-EXACT_BLOCK-PER_LAYER-bs8", L=3, H=6, Hkv=2, n=300,
                     policy=dict(plan_shape="BLOCKS_PER_LAYER", block_size=8,
                                 gqa_value="EXACT_BLOCK", allocation="PER_LAYER")))
    # LAYER_UNIFORM is the head_uniform_layers recount, whichever way it is spelled.
    for alloc in laprox_ref.ALLOCATIONS:
        grid.append(case(f"shape-LAYER_UNIFORM-{alloc}", L=3, H=6, Hkv=3, policy=dict(
            allocation=alloc, plan_shape="LAYER_UNIFORM", min_per_head=3)))
    grid.append(case("shape-LAYER_UNIFORM-and-hu", L=3, H=6, Hkv=3, policy=dict(
        plan_shape="LAYER_UNIFORM", head_uniform_layers=True)))
    grid.append(case("shape-RAGGED-and-hu", L=3, H=6, Hkv=3, policy=dict(
        plan_shape="RAGGED", head_uniform_layers=True)))
    # Baselines at block shapes: both numeric modes (16-bit rounding in KVPRESS_COMPAT).
    small = dict(L=3, d=8, D=24, H=6, Hkv=2, n=300)
    for kind in ("SNAPKV", "ADAKV", "STREAMING_LLM"):
        for shape in blocks:
            s = "SHARED" if shape == "BLOCKS_SHARED" else "PER_LAYER"
            for i, (mode, dtype) in enumerate((("EXACT", "f32"), ("KVPRESS_COMPAT", "bf16"))):
                bs = (7, 16)[i]
                grid.append(shape_bcase(f"{s}-{mode}-{dtype}-bs{bs}", kind, dict(
                    numeric_mode=mode, plan_shape=shape, block_size=bs), dtype=dtype, **small))
            for bs in (1, 32):
                grid.append(shape_bcase(f"{s}-bs{bs}", kind, dict(
                    plan_shape=shape, block_size=bs, compression_ratio=0.7), **small))
    grid.append(shape_bcase("SHARED-compat-cr0.99", "ADAKV", dict(
        plan_shape="BLOCKS_SHARED", block_size=4, numeric_mode="KVPRESS_COMPAT",
        compression_ratio=0.99), dtype="f16", **small))
    grid.append(shape_bcase("PER_LAYER-B-ge-n", "SNAPKV", dict(
        plan_shape="BLOCKS_PER_LAYER", block_size=16, tokens_per_head=300), **small))
    grid.append(shape_bcase("SHARED-n20-all-window", "SNAPKV", dict(
        plan_shape="BLOCKS_SHARED", block_size=8, tokens_per_head=10), L=2, d=8, D=24, n=20))
    for sinks, b in ((10, 6), (0, 50), (4, 0)):     # 6: Kb = 1 below the 3 forced blocks
        grid.append(shape_bcase(f"PER_LAYER-sinks{sinks}-B{b}", "STREAMING_LLM", dict(
            plan_shape="BLOCKS_PER_LAYER", block_size=4, sinks=sinks, tokens_per_head=b),
            L=2, d=8, D=24, n=101))
    grid.append(shape_bcase("SHARED-cr0.0", "STREAMING_LLM", dict(
        plan_shape="BLOCKS_SHARED", block_size=16, compression_ratio=0.0), **small))
    # LAYER_UNIFORM changes nothing where the baselines' counts are the same in every head;
    # the baselines ignore head_uniform_layers, also at a block shape.
    for kind in ("STREAMING_LLM", "SNAPKV", "PYRAMIDKV", "CRITICALKV", "CAKE"):
        grid.append(shape_bcase("LAYER_UNIFORM", kind, dict(plan_shape="LAYER_UNIFORM"),
                                **small))
    grid.append(shape_bcase("RAGGED-hu", "ADAKV", dict(head_uniform_layers=True), **small))
    grid.append(shape_bcase("SHARED-hu", "SNAPKV", dict(
        head_uniform_layers=True, plan_shape="BLOCKS_SHARED", block_size=16), **small))
    # Invalid combinations both sides must reject.
    bad = dict(expect_error=True)
    for name, policy in (
            ("hu-SHARED", dict(plan_shape="BLOCKS_SHARED", block_size=16,
                               head_uniform_layers=True)),
            ("hu-PER_LAYER", dict(plan_shape="BLOCKS_PER_LAYER", block_size=16,
                                  head_uniform_layers=True)),
            ("bs-RAGGED", dict(block_size=16)),
            ("bs-explicit-RAGGED", dict(plan_shape="RAGGED", block_size=16)),
            ("bs-LAYER_UNIFORM", dict(plan_shape="LAYER_UNIFORM", block_size=16)),
            ("no-bs-contiguous", dict(plan_shape="BLOCKS_SHARED")),
            ("bs0-contiguous", dict(plan_shape="BLOCKS_PER_LAYER", block_size=0)),
            ("bs65537", dict(plan_shape="BLOCKS_SHARED", block_size=65537)),
            ("bs-negative", dict(plan_shape="BLOCKS_SHARED", block_size=-1))):
        grid.append(case(f"shape-bad-{name}", policy=policy, **bad))
    for kind in ("PYRAMIDKV", "CRITICALKV", "CRITICAL_ADAKV", "CAKE"):
        grid.append(shape_bcase("bad-BLOCKS_SHARED", kind, dict(
            plan_shape="BLOCKS_SHARED", block_size=16), n=100, L=2, d=8, D=24, **bad))
    for kind in ("ADAKV", "CRITICAL_ADAKV"):
        grid.append(shape_bcase("bad-LAYER_UNIFORM", kind, dict(plan_shape="LAYER_UNIFORM"),
                                n=100, L=2, d=8, D=24, **bad))
    grid.append(shape_bcase("bad-bs-RAGGED", "STREAMING_LLM", dict(block_size=8), n=100, L=2,
                            d=8, D=24, **bad))
    return grid


def build_paged_grid():
    """Keys and values in a paged pool read through block tables (cases named "paged-..."):
    block sizes 1, 16, 32 (n = 300: the last block partial), vLLM FlashAttention's
    [2, blocks, bs, Hkv, d] pool and the interleaved [blocks, 2, Hkv, bs, d] one, f32 and bf16,
    one table for every layer (vLLM) or one per layer; the RAGGED plans compare exactly like
    contiguous ones.  Block shapes without policy.block_size take the keys' table's, and give
    the new block tables and freed ids."""
    grid = []
    lap = dict(L=3, H=4, Hkv=2, n=300)
    i = 0
    for bs in (1, 16, 32):
        for layout in ("flash", "hnd"):
            for dtype in ("f32", "bf16"):
                tables = ("shared", "per_layer")[i % 2]
                i += 1
                grid.append(case(f"paged-{layout}-{dtype}-bs{bs}-{tables}", dtype=dtype, **lap,
                                 paged=dict(bs=bs, layout=layout, tables=tables),
                                 policy=dict(sinks=3)))
    grid.append(case("paged-flash-bf16-bs16-n1100-lse", L=2, H=6, Hkv=2, n=1100, dtype="bf16",
                     inputs="lse", paged=dict(bs=16, layout="flash", tables="shared"),
                     policy=dict(tokens_per_head=300)))
    grid.append(case("paged-keys-only-hnd-bs16", **lap,
                     paged=dict(bs=16, layout="hnd", tables="per_layer", tensors=["keys"])))
    grid.append(case("paged-values-only-flash-bs16", **lap,
                     paged=dict(bs=16, layout="flash", tables="shared", tensors=["values"])))
    small = dict(L=2, d=8, D=24, H=6, Hkv=2, n=300)
    for kind, layout, dtype, mode in (("SNAPKV", "flash", "bf16", "KVPRESS_COMPAT"),
                                      ("ADAKV", "hnd", "f32", "EXACT"),
                                      ("CRITICALKV", "flash", "f32", "EXACT"),
                                      ("CAKE", "hnd", "bf16", "EXACT"),
                                      ("STREAMING_LLM", "flash", "f32", "EXACT")):
        c = bcase(f"{layout}-{dtype}", kind, dict(numeric_mode=mode), dtype=dtype,
                  paged=dict(bs=16, layout=layout, tables="per_layer"), **small)
        c["name"] = "paged-" + c["name"]
        grid.append(c)
    # Block shapes: the block size comes from layers[0].keys' table.
    allocs = laprox_ref.ALLOCATIONS
    j = 0
    for shape in ("BLOCKS_SHARED", "BLOCKS_PER_LAYER"):
        s = "SHARED" if shape == "BLOCKS_SHARED" else "PER_LAYER"
        for tables in ("shared", "per_layer"):
            for bs in (16, 32):
                alloc = allocs[j % 4]
                j += 1
                grid.append(case(f"paged-{s}-{alloc}-bs{bs}-{tables}-tables", **lap,
                                 dtype=("f32", "bf16")[j % 2],
                                 paged=dict(bs=bs, layout=("flash", "hnd")[j // 2 % 2],
                                            tables=tables),
                                 policy=dict(plan_shape=shape, allocation=alloc, sinks=4,
                                             tokens_per_head=90)))
    grid.append(case("paged-SHARED-bs1", **lap, paged=dict(bs=1, layout="hnd", tables="shared"),
                     policy=dict(plan_shape="BLOCKS_SHARED", tokens_per_head=60)))
    grid.append(case("paged-PER_LAYER-policy-bs-equal", **lap,
                     paged=dict(bs=16, layout="flash", tables="per_layer"),
                     policy=dict(plan_shape="BLOCKS_PER_LAYER", block_size=16)))
    for kind, shape, tables in (("SNAPKV", "BLOCKS_PER_LAYER", "per_layer"),
                                ("ADAKV", "BLOCKS_SHARED", "shared"),
                                ("STREAMING_LLM", "BLOCKS_PER_LAYER", "shared")):
        c = bcase(f"{shape}-{tables}", kind, dict(plan_shape=shape),
                  paged=dict(bs=16, layout="hnd", tables=tables), **small)
        c["name"] = "paged-" + c["name"]
        grid.append(c)
    # Invalid: a policy block size other than the tables'; a block shape whose block size
    # would come from layers[0].keys, which are not paged.
    grid.append(case("paged-bad-policy-bs-differs", **lap, expect_error=True,
                     paged=dict(bs=16, layout="flash", tables="shared"),
                     policy=dict(plan_shape="BLOCKS_SHARED", block_size=32)))
    grid.append(case("paged-bad-values-only-no-bs", **lap, expect_error=True,
                     paged=dict(bs=16, layout="flash", tables="shared", tensors=["values"]),
                     policy=dict(plan_shape="BLOCKS_SHARED")))
    grid.append(case("paged-bad-layer0-contiguous-no-bs", **lap, expect_error=True,
                     paged=dict(bs=16, layout="flash", tables="per_layer", layers=[1, 2]),
                     policy=dict(plan_shape="BLOCKS_PER_LAYER")))
    return grid


# ----------------------------------------------------------------------------------------------
# Writing cases
# ----------------------------------------------------------------------------------------------

def to_bf16_bits(x):
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def store(case_dir, name, logical, dtype, layout):
    """Writes `logical` (float32) in `dtype` and `layout`; returns the tensor reference."""
    ref = {"file": f"{name}.npy", "dtype": dtype, "slice_last": None, "permute": None}
    arr = logical
    if logical.ndim == 3 and layout == "nhd":
        arr = np.ascontiguousarray(logical.transpose(1, 0, 2))
        ref["permute"] = [1, 0, 2]
    elif logical.ndim == 3 and layout == "dmajor":
        arr = np.ascontiguousarray(logical.transpose(0, 2, 1))
        ref["permute"] = [0, 2, 1]
    elif logical.ndim >= 2 and layout == "padded":
        pad = np.full(logical.shape[:-1] + (3,), 7.0, dtype=np.float32)
        arr = np.concatenate([logical, pad], axis=-1)
        ref["slice_last"] = logical.shape[-1]
    elif logical.ndim == 2 and layout == "dmajor":
        arr = np.ascontiguousarray(logical.T)
        ref["permute"] = [1, 0]
    if dtype == "f32":
        stored = arr.astype(np.float32)
    elif dtype == "f16":
        stored = arr.astype(np.float16)
    else:
        stored = to_bf16_bits(arr)
    np.save(os.path.join(case_dir, ref["file"]), stored)
    return ref


def quantised(x, dtype):
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


PAGED_SPARE_BLOCKS = 3  # pool blocks no table names, NaN like the unused slots of a last block


def paged_tables(c, rng):
    """The block tables of a paged case: one for every layer ("shared", as vLLM) or one per
    layer, each the first ceil(n / bs) of a shuffled [0, ceil(n / bs) + spare)."""
    p = c["paged"]
    nb = -(-c["n"] // p["bs"])
    count = 1 if p["tables"] == "shared" else c["L"]
    return [{"block_size": p["bs"],
             "ids": [int(x) for x in rng.permutation(nb + PAGED_SPARE_BLOCKS)[:nb]]}
            for _ in range(count)]


def stored_bits(arr, dtype):
    if dtype == "f32":
        return arr.astype(np.float32)
    if dtype == "f16":
        return arr.astype(np.float16)
    return to_bf16_bits(arr)


def store_paged(case_dir, name, keys, values, table_index, table, dtype, layout):
    """Writes one layer's keys and values (float32 [Hkv, n, d]) into a pool of `dtype` in
    `layout` ("flash": [2, blocks, bs, Hkv, d]; "hnd": [blocks, 2, Hkv, bs, d]) at the table's
    physical blocks, every other element NaN; returns the paged references (keys, values)."""
    Hkv, n, d = keys.shape
    bs, ids = table["block_size"], np.asarray(table["ids"])
    physical = len(ids) + PAGED_SPARE_BLOCKS
    r = np.arange(n)
    blk, slot = ids[r // bs], r % bs
    if layout == "flash":
        pool = np.full((2, physical, bs, Hkv, d), np.nan, dtype=np.float32)
        pool[0, blk, slot] = keys.transpose(1, 0, 2)
        pool[1, blk, slot] = values.transpose(1, 0, 2)
        strides = dict(block_stride=bs * Hkv * d, slot_stride=Hkv * d, head_stride=d,
                       dim_stride=1)
        values_offset = physical * bs * Hkv * d
    else:
        pool = np.full((physical, 2, Hkv, bs, d), np.nan, dtype=np.float32)
        pool[blk, 0, :, slot] = keys.transpose(1, 0, 2)
        pool[blk, 1, :, slot] = values.transpose(1, 0, 2)
        strides = dict(block_stride=2 * Hkv * bs * d, slot_stride=d, head_stride=bs * d,
                       dim_stride=1)
        values_offset = Hkv * bs * d
    np.save(os.path.join(case_dir, f"{name}.npy"), stored_bits(pool, dtype))

    def ref(offset):
        return {"file": f"{name}.npy", "dtype": dtype, "shape": [Hkv, n, d],
                "paged": dict(strides, table=table_index, offset=offset)}
    return ref(0), ref(values_offset)


def write_case(case_dir, c, rng, plant_bug):
    L, H, Hkv, d, D, n = c["L"], c["H"], c["Hkv"], c["d"], c["D"], c["n"]
    wq = c["wq"] or max(policy_window(c["policy"]), 1)
    scale = 1.0 / np.sqrt(d)
    layers = []
    paged = c.get("paged")
    tables = paged_tables(c, rng) if paged else None
    for layer in range(L):
        keys = rng.standard_normal((Hkv, n, d)).astype(np.float32)
        values = rng.standard_normal((Hkv, n, d)).astype(np.float32)
        if c.get("value_spread"):  # value norms over orders of magnitude: u decides stage 2
            values *= np.exp(2.0 * rng.standard_normal((Hkv, n, 1))).astype(np.float32)
        # Post-RoPE queries of the last wq positions; a larger logit scale makes attention peaky.
        logit_scale = c.get("layer_logit_scales", [c["logit_scale"]] * L)[layer]
        queries = (logit_scale * rng.standard_normal((H, wq, d))).astype(np.float32)
        o_proj = (rng.standard_normal((D, H * d)) / np.sqrt(H * d)).astype(np.float32)
        if c.get("special") == "zero_values" and layer == 0:
            values[:] = 0.0
        if c.get("special") == "equal":
            keys[:] = keys[:, :1, :]
            values[:] = values[:, :1, :]
        if c.get("tiny"):  # build_tiny_attention_grid(): logits ~ 15 * z_j in every row and head
            u = rng.standard_normal(d)
            u /= np.linalg.norm(u)
            if c["tiny"] in ("rise", "fall"):
                z = 4.0 * np.arange(n) / max(n - 1, 1) - 2.0
                z = (z if c["tiny"] == "rise" else -z) + 0.3 * rng.standard_normal((Hkv, n))
            else:
                z = rng.standard_normal((Hkv, n))
            along = np.einsum("hnd,d->hn", keys, u)
            keys = (keys + (z - along)[..., None] * u).astype(np.float32)
            queries = (15.0 * np.sqrt(d) * u + 0.05 * rng.standard_normal((H, wq, d))).astype(
                np.float32)
        dtype, layout = c["dtype"], c["layout"]
        spec = {
            "keys": store(case_dir, f"keys_{layer}", keys, dtype, layout),
            "values": store(case_dir, f"values_{layer}", values, dtype, layout),
            "o_proj": store(case_dir, f"o_proj_{layer}", o_proj, dtype, layout),
            "queries": None, "attention": None, "lse": None,
        }
        if paged and layer in paged.get("layers", range(L)):
            t = 0 if paged["tables"] == "shared" else layer
            refs = store_paged(case_dir, f"pool_{layer}", keys, values, t, tables[t], dtype,
                               paged["layout"])
            for name, r in zip(("keys", "values"), refs):
                if name in paged.get("tensors", ("keys", "values")):
                    spec[name] = r
        if c["inputs"] in ("queries", "lse"):
            spec["queries"] = store(case_dir, f"queries_{layer}", queries, dtype, layout)
        if c["inputs"] in ("lse", "attention"):
            # Exact float64 attention / LSE of the stored (rounded) values.
            q = quantised(queries, dtype).astype(np.float64)
            k = quantised(keys, dtype).astype(np.float64)
            G = H // Hkv
            logits = np.einsum("hwd,hnd->hwn", q, np.repeat(k, G, axis=0)) * scale
            we = min(wq, n)
            for t in range(wq):
                limit = n - wq + t  # causal for the row at position n - wq + t
                logits[:, t, max(limit + 1, 0):] = -np.inf
            mx = logits.max(axis=2, keepdims=True)
            lse = (mx[..., 0] + np.log(np.exp(logits - mx).sum(axis=2)))
            if c["inputs"] == "lse":
                spec["lse"] = store(case_dir, f"lse_{layer}", lse.astype(np.float32), "f32",
                                    "contiguous")
            else:
                attn = np.exp(logits - lse[..., None]).astype(np.float32)
                spec["attention"] = store(case_dir, f"attention_{layer}", attn, "f32",
                                          "contiguous")
                del we
        layers.append(spec)
    policy = dict(c["policy"])
    doc = {"geometry": dict(L=L, H=H, Hkv=Hkv, d=d, D=D, scale=float(scale)), "n": n,
           "policy": policy, "layers": layers}
    if tables:
        doc["block_tables"] = tables
    with open(os.path.join(case_dir, "case.json"), "w") as fh:
        json.dump(doc, fh)
    if plant_bug:
        # The C++ side gets a wrong policy (or block tables); the oracle reads the original
        # from ref_case.json. "raw" switches normalisation off (scores and kept sets change);
        # "reserve" makes every head reserve 10 candidates (same scores, only the selection
        # changes); "blocks" swaps BLOCKS_SHARED and BLOCKS_PER_LAYER; "block_competition"
        # makes BLOCKS_PER_LAYER with GLOBAL_NORMALIZED compete per layer (PER_LAYER: the
        # same scores, only the kept blocks change); "table" rotates every block table's ids
        # (C++ reads the pool's blocks in another order); "peak" pools AVG where the oracle
        # pools AVG_PEAK.
        with open(os.path.join(case_dir, "ref_case.json"), "w") as fh:
            json.dump(doc, fh)
        if plant_bug == "raw" and policy.get("allocation",
                                             "GLOBAL_NORMALIZED") == "GLOBAL_NORMALIZED":
            doc["policy"] = dict(policy, allocation="GLOBAL_RAW")
        if plant_bug == "reserve":
            doc["policy"] = dict(policy, min_per_head=10)
        if plant_bug == "pool" and policy.get("kind", "LAPROX") not in ("LAPROX",
                                                                         "STREAMING_LLM"):
            doc["policy"] = dict(policy, pool_kernel=1)
        if plant_bug == "pool_target" and policy.get("pool_target") is not None:
            swapped = {"ATTENTION": "SCORE", "SCORE": "ATTENTION"}[policy["pool_target"]]
            doc["policy"] = dict(policy, pool_target=swapped)
        if plant_bug == "defaults" and "gqa_value" not in policy:
            doc["policy"] = dict(policy, gqa_value="MEAN_HEAD_NORM", pool_kernel=7)
        swap = {"BLOCKS_SHARED": "BLOCKS_PER_LAYER", "BLOCKS_PER_LAYER": "BLOCKS_SHARED"}
        if plant_bug == "blocks" and policy.get("plan_shape") in swap:
            doc["policy"] = dict(policy, plan_shape=swap[policy["plan_shape"]])
        if plant_bug == "block_competition" and \
                policy.get("plan_shape") == "BLOCKS_PER_LAYER" and \
                policy.get("kind", "LAPROX") == "LAPROX" and \
                policy.get("allocation", "GLOBAL_NORMALIZED") == "GLOBAL_NORMALIZED":
            doc["policy"] = dict(policy, allocation="PER_LAYER")
        if plant_bug == "peak" and policy.get("pooling") == "AVG_PEAK":
            doc["policy"] = dict(policy, pooling="AVG")
        if plant_bug == "layer_cap" and policy.get("max_layer_share") is not None:
            doc["policy"] = {k: v for k, v in policy.items() if k != "max_layer_share"}
        if plant_bug == "table" and tables:
            doc["block_tables"] = [dict(t, ids=t["ids"][1:] + t["ids"][:1]) for t in tables]
        with open(os.path.join(case_dir, "case.json"), "w") as fh:
            json.dump(doc, fh)


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------

def scope_of(policy, l, g):
    """The competition a selected candidate took part in (`policy` with its defaults filled)."""
    if policy["allocation"] == "UNIFORM" or policy["plan_shape"] == "LAYER_UNIFORM":
        return (l, g)
    if policy["allocation"] == "PER_LAYER":
        return (l,)
    return ()


def compare(case_dir, c):
    """Returns a list of failure messages (empty when the case passes)."""
    planted = os.path.exists(os.path.join(case_dir, "ref_case.json"))
    geometry, policy, layers, n = laprox_ref.load_case(
        case_dir, "ref_case.json" if planted else "case.json")
    error_path = os.path.join(case_dir, "cpp_error.json")
    cpp_error = None
    if os.path.exists(error_path):
        with open(error_path) as fh:
            cpp_error = json.load(fh)
    try:
        ref = laprox_ref.keep_plan(geometry, policy, layers, n)
    except ValueError as e:
        if cpp_error is None:
            return [f"oracle rejects ({e}) but C++ accepts"]
        if cpp_error["code"] != "INVALID_ARGUMENT":
            return [f"C++ rejects with {cpp_error['code']}, expected INVALID_ARGUMENT"]
        return []
    if cpp_error is not None:
        return [f"C++ rejects a case the oracle accepts: {cpp_error}"]
    if c.get("expect_error"):
        return ["case was expected to be rejected"]
    if policy.get("kind", "LAPROX") != "LAPROX":
        return compare_baseline(case_dir, c, policy, layers, ref)
    policy = laprox_ref.validate_policy(policy)

    load = lambda name: np.load(os.path.join(case_dir, name))  # noqa: E731
    counts, kept = load("cpp_counts.npy"), load("cpp_kept.npy").astype(bool)
    bitmask, scores = load("cpp_bitmask.npy"), load("cpp_scores.npy")
    with open(os.path.join(case_dir, "cpp_meta.json")) as fh:
        meta = json.load(fh)
    failures = []
    if meta["quota"] != ref["quota"] or meta["total_selected"] != ref["total_selected"]:
        failures.append(f"quota/K C++ {meta['quota']}/{meta['total_selected']} vs oracle "
                        f"{ref['quota']}/{ref['total_selected']}")
    if not np.array_equal(counts, kept.sum(axis=2)):
        failures.append("C++ counts differ from its kept positions")
    unpacked = np.unpackbits(bitmask, axis=2, bitorder="little")[:, :, :n].astype(bool)
    if not np.array_equal(unpacked, kept):
        failures.append("C++ bitmask differs from its kept positions")

    cand = ~np.isnan(ref["scores"])
    if cand.any():
        s_ref, s_cpp = ref["scores"], scores.astype(np.float64)
        for l in range(s_ref.shape[0]):
            m = cand[l]
            if not m.any():
                continue
            top = np.abs(s_ref[l][m]).max()
            err = np.abs(s_cpp[l][m] - s_ref[l][m]).max()
            if err > SCORE_RTOL * max(top, 1e-30):
                failures.append(f"layer {l}: scores differ by {err:.3g} (largest {top:.3g})")
                break
    if not np.all(np.isinf(scores[~cand])):
        failures.append("C++ scores of forced tokens are not +inf")

    if policy["max_layer_share"] is not None:
        failures += check_cap(c, geometry, policy, layers, n, ref)
    if "block_kept" in ref:
        return failures + compare_blocks(case_dir, ref, policy, kept, SCORE_RTOL,
                                         NEAR_TIE_RTOL)
    if os.path.exists(os.path.join(case_dir, "cpp_blocks.json")):
        return failures + ["C++ returns blocks for a plan that is not block-shaped"]
    only_cpp = np.argwhere(kept & ~ref["kept"])
    only_ref = np.argwhere(ref["kept"] & ~kept)
    if len(only_cpp) or len(only_ref):
        by_scope = {}
        for side, idx in ((0, only_cpp), (1, only_ref)):
            for l, g, i in idx:
                if not cand[l, g, i]:
                    failures.append(f"forced token ({l},{g},{i}) differs")
                    continue
                key = scope_of(policy, int(l), int(g))
                by_scope.setdefault(key, ([], []))[side].append(ref["scores"][l, g, i])
        for key, (a, b) in by_scope.items():
            if len(a) != len(b):
                failures.append(f"scope {key}: {len(a)} kept only by C++, {len(b)} only by "
                                f"the oracle")
                continue
            for x, y in zip(sorted(a), sorted(b)):
                gap = abs(x - y) / max(abs(x), abs(y), 1e-300)
                if gap >= NEAR_TIE_RTOL:
                    failures.append(f"scope {key}: kept sets differ beyond near-ties "
                                    f"(scores {x:.9g} vs {y:.9g}, gap {gap:.2g})")
                    break
    return failures


def check_cap(c, geometry, policy, layers, n, ref):
    """The oracle's own plan under max_layer_share: no layer above the cap (unless every
    candidate is kept), K selected, and binding (or not) as the case says."""
    failures = []
    L, Hkv = geometry["L"], geometry["Hkv"]
    q, K = ref["quota"], ref["total_selected"]
    per_layer = ref["selected"].sum(axis=(1, 2))
    if policy["allocation"] in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"):
        cap = min(int(np.floor(policy["max_layer_share"] * float(Hkv * q))), K)
        if per_layer.max(initial=0) > cap:
            failures.append(f"oracle: a layer selects {per_layer.max()} > cap {cap}")
    if per_layer.sum() != K:
        failures.append(f"oracle: {per_layer.sum()} selected, K = {K}")
    binds = c.get("cap_binds")
    if binds is not None:
        uncapped = laprox_ref.keep_plan(geometry, dict(policy, max_layer_share=None), layers, n)
        same = np.array_equal(uncapped["kept"], ref["kept"])
        if binds and same:
            failures.append("the cap was expected to bind, but the plan equals the uncapped one")
        if not binds and not same:
            failures.append("the cap was expected not to bind, but the plan changed")
    return failures


def compare_baseline(case_dir, c, policy, layers, ref):
    """compare() for a baseline policy (module docstring); returns failure messages."""
    load = lambda name: np.load(os.path.join(case_dir, name))  # noqa: E731
    counts, kept = load("cpp_counts.npy"), load("cpp_kept.npy").astype(bool)
    bitmask = load("cpp_bitmask.npy")
    scores = load("cpp_scores.npy").astype(np.float64)
    layer_sums = load("cpp_layer_sums.npy")
    n = kept.shape[2]
    kind = policy["kind"]
    rounded = (policy.get("numeric_mode") == "KVPRESS_COMPAT" and c["dtype"] != "f32"
               and c["inputs"] != "attention")
    score_rtol = 2e-3 if rounded else SCORE_RTOL
    tie_rtol = 2e-3 if rounded else NEAR_TIE_RTOL
    failures = []
    if not np.array_equal(counts, kept.sum(axis=2)):
        failures.append("C++ counts differ from its kept positions")
    unpacked = np.unpackbits(bitmask, axis=2, bitorder="little")[:, :, :n].astype(bool)
    if not np.array_equal(unpacked, kept):
        failures.append("C++ bitmask differs from its kept positions")

    # Scores: the oracle's float64 values as fp32 (overflow -> inf) must match, the infinite and
    # fp32-max (safeguard) values exactly, the others relative to the layer's largest finite.
    with np.errstate(over="ignore"):
        expected = ref["scores"].astype(np.float32).astype(np.float64)
    for l in range(expected.shape[0]):
        e, g = expected[l], scores[l]
        if not np.array_equal(np.isinf(e), np.isinf(g)):
            failures.append(f"layer {l}: infinite scores at different positions")
            break
        finite = np.isfinite(e)
        if finite.any():
            top = np.abs(e[finite]).max()
            err = np.abs(g[finite] - e[finite]).max()
            if err > score_rtol * max(top, 1e-30):
                failures.append(f"layer {l}: scores differ by {err:.3g} (largest {top:.3g})")
                break
    if kind == "CAKE":
        if not np.allclose(layer_sums, ref["layer_sums"], rtol=1e-3, atol=0.0):
            failures.append(f"CAKE layer preferences {layer_sums} vs {ref['layer_sums']}")
    if "block_kept" in ref:
        # Block sums of 16-bit rounded scores: one token rounded the other way by C++ (from
        # fp32) moves its block by up to one rounding step, 2^-8 of that token's score.
        block_rtol = 8e-3 if rounded else SCORE_RTOL
        return failures + compare_blocks(case_dir, ref, laprox_ref.validate_policy(policy),
                                         kept, block_rtol, tie_rtol)
    if os.path.exists(os.path.join(case_dir, "cpp_blocks.json")):
        return failures + ["C++ returns blocks for a plan that is not block-shaped"]

    # Kept sets up to near-ties inside one competition (head; layer for the Ada-KV kinds).
    per_layer = kind in ("ADAKV", "CRITICAL_ADAKV")
    rank, raw = ref["scores"], ref["raw"]

    def near(a, b):
        return abs(a - b) <= tie_rtol * max(abs(a), abs(b), 1e-300)

    by_scope = {}
    for side, idx in ((0, np.argwhere(kept & ~ref["kept"])), (1, np.argwhere(ref["kept"] & ~kept))):
        for l, g, i in idx:
            key = (int(l),) if per_layer else (int(l), int(g))
            by_scope.setdefault(key, ([], []))[side].append((rank[l, g, i], raw[l, g, i]))
    for key, (a, b) in by_scope.items():
        if len(a) != len(b):
            failures.append(f"scope {key}: {len(a)} kept only by C++, {len(b)} only by the oracle")
            continue
        for x, y in zip(sorted(a), sorted(b)):
            if not (near(x[0], y[0]) or (np.isfinite(x[1]) and np.isfinite(y[1])
                                         and near(x[1], y[1]))):
                failures.append(f"scope {key}: kept sets differ beyond near-ties "
                                f"(scores {x[0]:.9g} vs {y[0]:.9g}, raw {x[1]:.9g} vs {y[1]:.9g})")
                break
    return failures


def compare_blocks(case_dir, ref, policy, kept, score_rtol, tie_rtol):
    """The block outputs of a block-shaped plan (module docstring); `policy` has its defaults
    filled, `kept` is C++'s token mask [L, Hkv, n]. Returns failure messages."""
    path = os.path.join(case_dir, "cpp_blocks.json")
    if not os.path.exists(path):
        return ["C++ returns no block plan"]
    with open(path) as fh:
        b = json.load(fh)
    ref_kept = ref["block_kept"]
    U, nb = ref_kept.shape
    got = (b["block_size"], b["num_blocks"], b["units"])
    if got != (ref["block_size"], ref["num_blocks"], U):
        return [f"C++ block_size/num_blocks/units {got} vs oracle "
                f"{(ref['block_size'], ref['num_blocks'], U)}"]
    failures = []
    offsets = b["offsets"]
    cpp_kept = np.zeros((U, nb), dtype=bool)
    for u in range(U):
        ids = b["kept"][offsets[u]:offsets[u + 1]]
        if any(x >= y for x, y in zip(ids, ids[1:])) or any(not 0 <= x < nb for x in ids):
            failures.append(f"unit {u}: C++ kept blocks not ascending in [0, {nb}): {ids}")
            return failures
        cpp_kept[u, ids] = True
    # Every (layer, head) keeps exactly the positions of its unit's kept blocks.
    L, Hkv, n = kept.shape
    unit_of = np.zeros(L, dtype=int) if U == 1 else np.arange(L)
    block_of = np.arange(n) // ref["block_size"]
    expected = cpp_kept[unit_of][:, block_of]                        # [L, n]
    if not np.array_equal(kept, np.broadcast_to(expected[:, None, :], kept.shape)):
        failures.append("C++ kept positions are not the positions of its kept blocks")

    # Block scores: +inf (forced) at the same blocks; the others relative to the unit's
    # largest finite block score (STREAMING_LLM: its 1/0 of the kept blocks).
    kind = policy["kind"]
    score_path = os.path.join(case_dir, "cpp_block_scores.npy")
    if not os.path.exists(score_path):
        failures.append("C++ returns no block scores")
    else:
        cs, rs = np.load(score_path), ref["block_scores"]
        if cs.shape != rs.shape:
            failures.append(f"C++ block scores of shape {cs.shape}, oracle {rs.shape}")
        elif kind == "STREAMING_LLM":
            if not np.array_equal(cs, cpp_kept.astype(np.float64)):
                failures.append("C++ STREAMING_LLM block scores are not 1 kept / 0 evicted")
        elif not np.array_equal(np.isinf(cs), np.isinf(rs)):
            failures.append("C++ block scores are +inf at other blocks than the forced ones")
        else:
            for u in range(U):
                finite = np.isfinite(rs[u])
                if not finite.any():
                    continue
                top = np.abs(rs[u][finite]).max()
                err = np.abs(cs[u][finite] - rs[u][finite]).max()
                if not err <= score_rtol * max(top, 1e-30):
                    failures.append(f"unit {u}: block scores differ by {err:.3g} (largest "
                                    f"{top:.3g})")
                    break

    # Kept blocks up to swaps among near-ties inside one competition: the model for
    # BLOCKS_SHARED and for LAPROX's model-wide BLOCKS_PER_LAYER, else the layer.
    rs = ref["block_scores"]
    model_wide = U == 1 or (kind == "LAPROX" and policy["allocation"] in
                            ("GLOBAL_NORMALIZED", "GLOBAL_RAW"))
    by_scope = {}
    only_cpp, only_ref = np.argwhere(cpp_kept & ~ref_kept), np.argwhere(ref_kept & ~cpp_kept)
    for side, idx in ((0, only_cpp), (1, only_ref)):
        for u, blk in idx:
            if np.isinf(rs[u, blk]):
                failures.append(f"unit {u}: forced block {blk} differs")
                continue
            key = () if model_wide else (int(u),)
            by_scope.setdefault(key, ([], []))[side].append(rs[u, blk])
    for key, (a, c) in by_scope.items():
        if kind == "STREAMING_LLM" or len(a) != len(c):
            failures.append(f"scope {key}: blocks {len(a)} kept only by C++, {len(c)} only by "
                            f"the oracle")
            continue
        for x, y in zip(sorted(a), sorted(c)):
            gap = abs(x - y) / max(abs(x), abs(y), 1e-300)
            if gap >= tie_rtol:
                failures.append(f"scope {key}: kept blocks differ beyond near-ties (block "
                                f"scores {x:.9g} vs {y:.9g}, gap {gap:.2g})")
                break

    # New block tables and freed ids: the unit's table at C++'s kept blocks (equal to the
    # oracle's when the kept blocks agree) and at the others.
    if "new_block_table" not in ref:
        if b["paged"]:
            failures.append("C++ returns block tables for keys that are not paged")
        return failures
    if not b["paged"]:
        return failures + ["C++ returns no block tables for paged keys"]
    freed_offsets = b["freed_offsets"]
    for u in range(U):
        ids = np.zeros(nb, dtype=np.int64)                  # the unit's table, from the oracle
        ids[ref_kept[u]] = ref["new_block_table"][u]
        ids[~ref_kept[u]] = ref["freed_block_ids"][u]
        new = b["new_table"][offsets[u]:offsets[u + 1]]
        freed = b["freed"][freed_offsets[u]:freed_offsets[u + 1]]
        if np.array_equal(cpp_kept[u], ref_kept[u]) and (
                new != ref["new_block_table"][u].tolist() or
                freed != ref["freed_block_ids"][u].tolist()):
            failures.append(f"unit {u}: new table / freed ids {new} / {freed} vs oracle "
                            f"{ref['new_block_table'][u].tolist()} / "
                            f"{ref['freed_block_ids'][u].tolist()}")
        elif new != ids[cpp_kept[u]].tolist() or freed != ids[~cpp_kept[u]].tolist():
            failures.append(f"unit {u}: new table / freed ids are not the table at C++'s kept "
                            f"blocks")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runner", required=True)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--only", default="")
    ap.add_argument("--keep", default="")
    ap.add_argument("--plant-bug", choices=("raw", "reserve", "pool", "pool_target", "defaults",
                                            "blocks", "block_competition", "table",
                                            "layer_cap", "peak"),
                    default=None)
    args = ap.parse_args()

    grid = [c for c in build_grid() if args.only in c["name"]]
    root = args.keep or tempfile.mkdtemp(prefix="laprox-compare-")
    os.makedirs(root, exist_ok=True)
    print(f"seed {args.seed}, {len(grid)} cases, in {root}")
    rng = np.random.default_rng(args.seed)
    dirs = []
    for c in grid:
        case_dir = os.path.join(root, c["name"])
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(case_dir)
        write_case(case_dir, c, rng, args.plant_bug)
        dirs.append(case_dir)
    subprocess.run([args.runner] + dirs, check=True)

    passed, failed = 0, 0
    for c, case_dir in zip(grid, dirs):
        failures = compare(case_dir, c)
        if failures:
            failed += 1
            print(f"FAIL {c['name']}: " + "; ".join(failures[:3]))
        else:
            passed += 1
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.plant_bug:
        # The planted bug must be caught: this mode succeeds only when cases fail.
        print(f"planted bug {args.plant_bug!r}: {failed} of {len(grid)} cases detect it")
        return 0 if failed else 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
