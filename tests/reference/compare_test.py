#!/usr/bin/python3
"""Compares the C++ CPU backend with the float64 oracle on a grid of random cases.

How it works
    For every case of the grid this script draws random tensors (seeded; the seed is printed),
    rounds them to the case's dtype, writes them as .npy files in the layout the case asks for
    (contiguous, [n, Hkv, d] order, padded rows, transposed), and writes case.json. It then runs
    the C++ backend over all case directories in one process (`laprox_case_runner`), runs the
    oracle (laprox_ref.keep_plan) on the same stored values in float64, and compares:

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
    --plant-bug raw|reserve|pool|pool_target|defaults (sends C++ a wrong policy: GLOBAL_RAW
    while the oracle normalises, min_per_head 10 while the oracle has 0, for baselines
    pool_kernel 1 while the oracle pools over 5 or 7, the other pool_target where a case sets
    one, or the old LAPROX defaults MEAN_HEAD_NORM and pool_kernel 7 where a case leaves
    gqa_value out; the script then succeeds only if cases fail, which proves the score and the
    kept-set comparisons can fail).

    Baseline policies (cases named "bl-...", built by build_baseline_grid()) are compared the
    same way with their own rules (compare_baseline): scores are the ranking scores with
    sentinels (fp32 on the C++ side, so oracle values beyond fp32 range must be +inf there),
    compared to a relative 2e-4 of the layer's largest finite score (2e-3 when KVPRESS_COMPAT
    rounds 16-bit attention: C++ rounds from fp32, the oracle from float64); the competition
    scope is the head (the layer for ADAKV and CRITICAL_ADAKV, whose head budgets come from a
    layer-wide top-k); near-ties are 1e-5 relative (2e-3 with 16-bit rounding), on the ranking
    score or on the oracle's raw prefix score (a near-tie in a first stage moves a token to the
    other stage); CAKE's layer preferences (layer_sums) agree to 1e-3 relative.

Extend it
    Add a case to build_grid(): a name and a dict of overrides of BASE_CASE, or to
    build_baseline_grid(): bcase(name, kind, policy overrides, case overrides).
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
    for pooling, k in (("AVG", 1), ("AVG", 3), ("AVG", 31), ("MAX", 7), ("NONE", 7)):
        grid.append(case(f"pool-{pooling}{k}", policy=dict(pooling=pooling, pool_kernel=k)))
    # pool_target with every attention summary and value factor, AVG and MAX pooling (G = 3,
    # sinks in the pooled range), and at G = 1, where EXACT_BLOCK is MEAN_HEAD_NORM.
    modes = [("ATTENTION_X_PROJECTED_VALUE", gqa) for gqa in laprox_ref.GQA_VALUES]
    modes += [("ATTENTION_X_VALUE", "MEAN_HEAD_NORM"), ("ATTENTION", "MEAN_HEAD_NORM")]
    for target in laprox_ref.POOL_TARGETS:
        for pooling in ("AVG", "MAX"):
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
    return grid + build_baseline_grid() + build_tiny_attention_grid()


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


def write_case(case_dir, c, rng, plant_bug):
    L, H, Hkv, d, D, n = c["L"], c["H"], c["Hkv"], c["d"], c["D"], c["n"]
    wq = c["wq"] or max(policy_window(c["policy"]), 1)
    scale = 1.0 / np.sqrt(d)
    layers = []
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
    with open(os.path.join(case_dir, "case.json"), "w") as fh:
        json.dump(doc, fh)
    if plant_bug:
        # The C++ side gets a wrong policy; the oracle reads the original from ref_case.json.
        # "raw" switches normalisation off (scores and kept sets change); "reserve" makes every
        # head reserve 10 candidates (same scores, only the selection changes).
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
        with open(os.path.join(case_dir, "case.json"), "w") as fh:
            json.dump(doc, fh)


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------

def scope_of(policy, l, g):
    """The competition a selected candidate took part in (`policy` with its defaults filled)."""
    if policy["allocation"] == "UNIFORM" or policy["head_uniform_layers"]:
        return (l, g)
    if policy["allocation"] == "PER_LAYER":
        return (l,)
    return ()


def compare(case_dir, c):
    """Returns a list of failure messages (empty when the case passes)."""
    geometry, policy, layers, n = laprox_ref.load_case(case_dir)
    ref_case = os.path.join(case_dir, "ref_case.json")
    if os.path.exists(ref_case):
        with open(ref_case) as fh:
            policy = json.load(fh)["policy"]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runner", required=True)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--only", default="")
    ap.add_argument("--keep", default="")
    ap.add_argument("--plant-bug", choices=("raw", "reserve", "pool", "pool_target", "defaults"),
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
