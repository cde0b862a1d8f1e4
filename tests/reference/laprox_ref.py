#!/usr/bin/python3
"""Float64 numpy oracle of the LaProx keep plan (policy LAPROX) and of the kvpress baselines.

What it is
    An independent, deliberately plain implementation of the LaProx KV-cache eviction
    algorithm: per-(layer, KV head, token) scores, per-layer normalisation, one model-wide
    budget, and the resulting keep masks.  The C++ backends (CPU and CUDA) are tested against
    it: their kept sets must equal this oracle's up to swaps among near-ties.

Where it comes from
    Written only from docs/design.md §2 (the design document) and tests/reference/SEMANTICS.md (which
    is binding where the design leaves a point open), never from the C++ code.  Everything is
    computed in float64.  It is written for obvious correctness, not speed, but is vectorised
    with numpy.  On purpose it does NOT use the Gram-matrix shortcut of docs/design.md §2, step 5
    (v M_h v^T with M_h = W_O^h W_O^h^T): the value factors are computed from the explicit
    n x D products v_i W_O^h, so that it shares no arithmetic trick with the C++ code.
    For EXACT_BLOCK the Frobenius norm of sum_h a_h (outer) b_h is evaluated as
    sqrt(sum_{h,h'} (a_h . a_h') (b_h . b_h')) with the explicit b_h = v_i W_O^h (a pure
    algebraic identity; the self-tests check it against the literal we x D matrix).

Baselines (policy["kind"] != "LAPROX")
    STREAMING_LLM, SNAPKV, PYRAMIDKV, ADAKV, CRITICALKV, CRITICAL_ADAKV, CAKE, written from
    docs/design.md §3 and the baseline issue text; the exact rules (budgets, sentinels, ties,
    edge cases) are in SEMANTICS.md, "Baseline policies".  Entry point: keep_plan (it dispatches
    to baseline_plan).

    Policy dict (missing keys take these defaults):
        kind               "LAPROX" | "STREAMING_LLM" | "SNAPKV" | "PYRAMIDKV" | "ADAKV" |
                           "CRITICALKV" | "CRITICAL_ADAKV" | "CAKE"            (default LAPROX)
        tokens_per_head | compression_ratio   exactly one (as for LAPROX)
        window, pool_kernel, pooling   LAPROX 32/31/AVG_PEAK; STREAMING_LLM 32/7/AVG (unused);
                           SNAPKV, PYRAMIDKV, ADAKV, CRITICALKV, CRITICAL_ADAKV 64/5/AVG;
                           CAKE 32/5/AVG (pooling MAX/NONE/AVG_PEAK also accepted)
        sinks              LAPROX 0; STREAMING_LLM 4; ignored by the other baselines
        numeric_mode       "EXACT" | "KVPRESS_COMPAT" (default EXACT; ignored by LAPROX)
        pyramid_beta 20.0, alpha_safeguard 0.2, epsilon 1e-4, first_stage_ratio 0.5,
        cake_tau1 1.6, cake_tau2 0.6, cake_gamma 200.0
        allocation, indicator, gqa_value, pool_target, min_per_head, head_uniform_layers:
                           accepted, checked for valid values, ignored by baselines.
        plan_shape, block_size   see "Plan shapes" below.
    Layer dicts may carry "keys_dtype": "f32" | "f16" | "bf16" (None/absent = "f32"): the dtype
    the keys were stored in.  load_case() sets it from the keys' tensor reference, so case.json
    needs nothing new besides the policy fields above, e.g.
        {"geometry": {"L":2,"H":4,"Hkv":2,"d":16,"D":32,"scale":0.25}, "n": 300,
         "policy": {"kind": "SNAPKV", "compression_ratio": 0.5, "numeric_mode": "KVPRESS_COMPAT"},
         "layers": [{"keys": {"file":"keys_0.npy","dtype":"bf16","slice_last":null,"permute":null},
                     "values": {...}, "o_proj": {...}, "queries": {...},
                     "attention": null, "lse": null}, ...]}
    STREAMING_LLM needs no tensors at all (queries/attention may be null; given ones are still
    checked).  SNAPKV, PYRAMIDKV, ADAKV, CAKE need queries+keys (optionally lse) or attention;
    CRITICALKV and CRITICAL_ADAKV also need values and o_proj.  Baselines check policy.window
    <= wq like LAPROX (not STREAMING_LLM).

    Numerics.  EXACT: float64 throughout, no rounding anywhere.  KVPRESS_COMPAT reproduces
    kvpress 0.5.5's casts to the model dtype T = the layer's keys_dtype (bf16 or f16; f32 or
    absent: no rounding at all) with r(x) = round_to_dtype(x, T) (nearest, ties to even,
    directly from float64 values; overflow -> +-inf); every operation between two roundings is
    float64 (standing in for kvpress's fp32).  The list, binding and numbered as in SEMANTICS.md
    ("KVPRESS_COMPAT arithmetic"), for SNAPKV, PYRAMIDKV, ADAKV, CRITICALKV, CRITICAL_ADAKV:
      from queries (compat_window_attention; an lse is checked but not used):
        (1) r(q . k)  (2) r(logit / sqrt(d)) -- scale 1/sqrt(d), not geometry.scale --
        (3) causal mask, softmax over all n keys, r(p);
      given "attention" is used as given (1-3 skipped), then (snapkv_scores)
        (4) r(row sum / we)  (5) r(AVG sum / k)  (6) r(group sum / G)  (7) r(M + 1);
      CriticalKV value factor (compat_value_l1_factor): r(v_i W_O^h) elementwise,
        u_h = r(sum_D |.|), u = r(sum_h u_h / G); stage 2 r(r(s + epsilon) * u).
    Budgets with a compression ratio (not CAKE): n_kept = max(1, int(n * (1 - cr))), the
    CRITICALKV stage 1 max(1, int((1 - cr) * n * first_stage_ratio)), the PYRAMIDKV fallback
    max(1, round(n * (1 - cr))).  CAKE is unaffected by all of this: KVPRESS_COMPAT rounds only
    its softmax output (window_attention with the geometry scale, then r), used by its eviction
    score; its H_l and V_l use the unrounded probabilities; its n_kept is int(...).  The
    "dtype max" that AdaKV's safeguard and CriticalKV's stage 1 write is float32 max in EXACT
    and max(T) in KVPRESS_COMPAT (f32 max when T is f32); in both modes those tokens are also
    forced by an explicit mask, so they win whatever that value is.

    Output fields of baselines (same keys as LAPROX):
        kept [L,Hkv,n] bool, counts [L,Hkv] int64   as for LAPROX.
        scores [L,Hkv,n] float64   the ranking score the policy selects by, with its sentinels:
            STREAMING_LLM  kvpress's 1.0 (kept region) / 0.0 (evicted region).
            SNAPKV, PYRAMIDKV  SnapKV score, window = layer max of prefix scores + 1.
            ADAKV          SnapKV score with each head's top n_safe set to dtype max.
            CRITICALKV     (snap + epsilon) * u (KVPRESS_COMPAT: r(r(snap + eps) * u)),
                           stage-1 picks = dtype max.
            CRITICAL_ADAKV (snap' + epsilon) * u with snap' = SnapKV after the safeguard
                           (safeguarded tokens = dtype max, so their value may exceed float32
                           range; KVPRESS_COMPAT: r(r(snap' + eps) * u), +inf once above
                           max(T)), each head's stage-1 picks = dtype max.
            CAKE           pooled group eviction score on the prefix, +inf on the window.
        raw [L,Hkv,n] float64   prefix score before sentinels/safeguard/stages (SnapKV score for
            the five SnapKV-based kinds, the CAKE eviction score for CAKE) on [0, n - we), NaN on
            the window; all NaN for STREAMING_LLM.
        layer_sums [L] float64   CAKE: the layer preference P_l (the largest finite double when it
            overflowed); other baselines: 0.0.
        selected [L,Hkv,n] bool   CAKE: kept prefix tokens (kept minus window); others: = kept.
        quota int   n_kept, the per-head budget (int((1.0 - cr) * n), at least 1 in
            KVPRESS_COMPAT except for CAKE, or tokens_per_head; clamped to n).
        total_selected int   selected.sum().

Plan shapes (SEMANTICS.md, "Plan shapes"; every kind)
    Policy fields:
        plan_shape   None (= "RAGGED") | "RAGGED" | "LAYER_UNIFORM" | "BLOCKS_SHARED" |
                     "BLOCKS_PER_LAYER".  LAYER_UNIFORM is LAPROX's head_uniform_layers recount
                     (head_uniform_layers=True with RAGGED means LAYER_UNIFORM, with a block
                     shape it is invalid for LAPROX; the baselines ignore it); for the baselines
                     LAYER_UNIFORM changes nothing and is invalid for ADAKV and CRITICAL_ADAKV.
                     Block shapes only for LAPROX, STREAMING_LLM, SNAPKV, ADAKV.
        block_size   None or 0 (not set) | an integer in [1, 65536], only with a block shape.
                     Not set, a block shape takes the block size of layers[0]'s keys table
                     (invalid without one); every table the layers name must have it.
    Layer dicts may carry "keys_table" / "values_table" = {"block_size": bs, "ids": int array}:
    the block table the (paged) tensor was read through; load_case() sets them.  In case.json a
    paged tensor reference is
        {"file": "pool_0.npy", "dtype": "bf16", "shape": [Hkv, n, d],
         "paged": {"table": 0, "offset": o, "block_stride": ., "slot_stride": ., "head_stride": .,
                   "dim_stride": .}}
    with the tables in case.json "block_tables": [{"block_size": 16, "ids": [5, 2, ...]}, ...]:
    element (h, r, c) is pool.flat[o + ids[r // bs] * block_stride + (r % bs) * slot_stride +
    h * head_stride + c * dim_stride] (gather_paged), so the scores see the same logical
    [Hkv, n, d] tensor as for a contiguous one.

    A block shape keeps whole logical blocks of bs positions (nb = ceil(n / bs), the last one
    may be partial), the same in every KV head and in every layer (BLOCKS_SHARED: one unit) or
    per layer (BLOCKS_PER_LAYER: L units).  Blocks holding a forced position (LAPROX sinks and
    window; SNAPKV/ADAKV the window; STREAMING_LLM its sinks) are kept whole; with B tokens per
    head (LAPROX's budget, the baselines' n_kept) B >= n keeps everything, else a unit keeps
    Kb = B // bs blocks, forced ones included, i.e. qb = clamp(Kb - forced, 0, candidate) more
    by block score (select_blocks), ties to the lower (layer, block).  Block scores are float64
    sums over the unit's layers, KV heads and the block's positions of: LAPROX's competing score
    (p / S_l, uniform 1/(Hkv*m) in a layer whose S_l is 0 or not finite; GLOBAL_RAW: raw p in
    every layer); SNAPKV/ADAKV the SnapKV prefix score (rounded in KVPRESS_COMPAT; ADAKV's plan
    equals SNAPKV's); STREAMING_LLM ranks by block index.  BLOCKS_PER_LAYER is one model-wide
    competition of L * qb (layer, block) pairs for LAPROX GLOBAL_NORMALIZED / GLOBAL_RAW, each
    layer its own qb otherwise.  min_per_head is ignored.
    Extra output fields of a block shape:
        block_size int, num_blocks int   bs and nb.
        block_kept [U, nb] bool    kept logical blocks per unit.
        block_scores [U, nb] float64   +inf for forced blocks; STREAMING_LLM 1 kept, 0 evicted.
        new_block_table, freed_block_ids   lists of U int64 arrays, only when every unit's
            keys are paged (unit u: layers[u]'s keys table; BLOCKS_SHARED layers[0]'s): the
            table's ids at the kept blocks, and at the others, in logical order.  (The CLI's
            ref_out.npz stores each concatenated, with a "..._offsets" array.)
    kept / counts follow the blocks; scores stay the RAGGED ranking score (LAPROX s; SNAPKV and
    ADAKV the SnapKV score with its window sentinel, no safeguard; STREAMING_LLM 1/0);
    layer_sums as for RAGGED; LAPROX: quota the ragged q, total_selected (and selected) the
    kept candidate positions [se, n - we); baselines: selected = kept as before.

How to run
    As a library:   from laprox_ref import keep_plan
    As a CLI:       /usr/bin/python3 tests/reference/laprox_ref.py CASE_DIR [CASE_DIR ...]
                    reads CASE_DIR/case.json (+ the .npy files it names), writes
                    CASE_DIR/ref_out.npz with the keys returned by keep_plan.
    Self-tests:     /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'

Only numpy and the standard library are needed.
"""

import json
import math
import os
import sys

import numpy as np

ALLOCATIONS = ("GLOBAL_NORMALIZED", "GLOBAL_RAW", "PER_LAYER", "UNIFORM")
INDICATORS = ("ATTENTION_X_PROJECTED_VALUE", "ATTENTION_X_VALUE", "ATTENTION")
GQA_VALUES = ("MEAN_HEAD_NORM", "SUMMED_PROJECTION", "MEAN_HEAD_PRODUCT", "EXACT_BLOCK")
POOLINGS = ("AVG", "MAX", "NONE", "AVG_PEAK")
POOL_TARGETS = ("ATTENTION", "SCORE")

# Defaults for policy fields a caller leaves out: docs/design.md §2, except gqa_value and
# pool_kernel, chosen on bench/quality's dev grid, and pooling, chosen by bench/quality's joint
# endpoint (SEMANTICS.md, "Defaults").
POLICY_DEFAULTS = {
    "allocation": "GLOBAL_NORMALIZED",
    "indicator": "ATTENTION_X_PROJECTED_VALUE",
    "gqa_value": None,               # None: by the indicator (effective_gqa_value)
    "window": 32,
    "pooling": "AVG_PEAK",
    "pool_kernel": 31,
    "pool_target": None,             # None: the mode's placement (effective_pool_target)
    "sinks": 0,
    "min_per_head": 0,
    "head_uniform_layers": False,
    "max_layer_share": None,         # None: no per-layer cap (SEMANTICS.md, "Selection")
    "plan_shape": None,              # None: RAGGED (LAPROX's head_uniform_layers: LAYER_UNIFORM)
    "block_size": None,              # None or 0: not set (a block shape then reads the table's)
    "tokens_per_head": None,
    "compression_ratio": None,
}

MAX_TOKENS_PER_HEAD = 2**31 - 1

# Plan shapes (SEMANTICS.md, "Plan shapes").
PLAN_SHAPES = ("RAGGED", "LAYER_UNIFORM", "BLOCKS_SHARED", "BLOCKS_PER_LAYER")
BLOCK_SHAPES = ("BLOCKS_SHARED", "BLOCKS_PER_LAYER")
BLOCK_KINDS = ("LAPROX", "STREAMING_LLM", "SNAPKV", "ADAKV")      # kinds a block shape accepts
NO_LAYER_UNIFORM_KINDS = ("ADAKV", "CRITICAL_ADAKV")             # kinds LAYER_UNIFORM refuses
MAX_BLOCK_SIZE = 1 << 16

# Policy kinds: LAPROX (docs/design.md §2) and the kvpress baselines (§3, "Baseline policies" in
# SEMANTICS.md).
KINDS = ("LAPROX", "STREAMING_LLM", "SNAPKV", "PYRAMIDKV", "ADAKV", "CRITICALKV",
         "CRITICAL_ADAKV", "CAKE")
BASELINE_KINDS = KINDS[1:]
NUMERIC_MODES = ("EXACT", "KVPRESS_COMPAT")
KEY_DTYPES = ("f32", "f16", "bf16")

# Fields added for the baselines (every kind accepts them; LAPROX ignores them).
BASELINE_FIELD_DEFAULTS = {
    "kind": "LAPROX",
    "numeric_mode": "EXACT",
    "pyramid_beta": 20.0,
    "alpha_safeguard": 0.2,
    "epsilon": 1e-4,
    "first_stage_ratio": 0.5,
    "cake_tau1": 1.6,
    "cake_tau2": 0.6,
    "cake_gamma": 200.0,
}

# Per-kind defaults that replace POLICY_DEFAULTS for fields the caller leaves out.
_SNAP_DEFAULTS = {"window": 64, "pool_kernel": 5, "pooling": "AVG"}
KIND_DEFAULTS = {
    "LAPROX": {},
    "STREAMING_LLM": {"sinks": 4, "pool_kernel": 7, "pooling": "AVG"},
    "SNAPKV": _SNAP_DEFAULTS,
    "PYRAMIDKV": _SNAP_DEFAULTS,
    "ADAKV": _SNAP_DEFAULTS,
    "CRITICALKV": _SNAP_DEFAULTS,
    "CRITICAL_ADAKV": _SNAP_DEFAULTS,
    "CAKE": {"window": 32, "pool_kernel": 5, "pooling": "AVG"},
}


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def validate_geometry(geometry):
    """Checks the model geometry; returns (L, H, Hkv, d, D, scale, G)."""
    try:
        L, H, Hkv, d, D = (geometry[k] for k in ("L", "H", "Hkv", "d", "D"))
        scale = geometry["scale"]
    except KeyError as e:
        raise ValueError(f"geometry: missing field {e}") from None
    for name, v in (("L", L), ("H", H), ("Hkv", Hkv), ("d", d), ("D", D)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"geometry.{name} must be a positive integer, got {v!r}")
    if H % Hkv != 0:
        raise ValueError(f"geometry: H={H} is not a multiple of Hkv={Hkv}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"geometry.scale must be finite, got {scale!r}")
    return int(L), int(H), int(Hkv), int(d), int(D), scale, int(H // Hkv)


def _is_real(x):
    return (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)) and math.isfinite(float(x)))


def validate_policy(policy):
    """Checks a policy dict; returns a complete copy (defaults filled in).

    Defaults: POLICY_DEFAULTS, then BASELINE_FIELD_DEFAULTS, then KIND_DEFAULTS[kind], then
    what the caller gave; a gqa_value that is None is then resolved (effective_gqa_value).
    Fields a kind ignores are still checked for well-formedness, except that the
    indicator/gqa_value combination rule applies to LAPROX only.
    """
    unknown = set(policy) - set(POLICY_DEFAULTS) - set(BASELINE_FIELD_DEFAULTS)
    if unknown:
        raise ValueError(f"policy: unknown fields {sorted(unknown)}")
    kind = policy.get("kind", "LAPROX")
    if kind not in KINDS:
        raise ValueError(f"policy.kind = {kind!r} is not one of {KINDS}")
    p = dict(POLICY_DEFAULTS)
    p.update(BASELINE_FIELD_DEFAULTS)
    p.update(KIND_DEFAULTS[kind])
    p.update(policy)
    p["gqa_value"] = effective_gqa_value(p)
    for name, allowed in (("allocation", ALLOCATIONS), ("indicator", INDICATORS),
                          ("gqa_value", GQA_VALUES), ("pooling", POOLINGS),
                          ("numeric_mode", NUMERIC_MODES)):
        if p[name] not in allowed:
            raise ValueError(f"policy.{name} = {p[name]!r} is not one of {allowed}")
    if p["pool_target"] is not None and p["pool_target"] not in POOL_TARGETS:
        raise ValueError(f"policy.pool_target = {p['pool_target']!r} is not None or one of "
                         f"{POOL_TARGETS}")
    for name, ok, what in (
            ("pyramid_beta", lambda x: x >= 1.0, ">= 1"),
            ("alpha_safeguard", lambda x: 0.0 <= x <= 1.0, "in [0, 1]"),
            ("epsilon", lambda x: x >= 0.0, ">= 0"),
            ("first_stage_ratio", lambda x: 0.0 <= x <= 1.0, "in [0, 1]"),
            ("cake_tau1", lambda x: x > 0.0, "> 0"),
            ("cake_tau2", lambda x: x > 0.0, "> 0"),
            ("cake_gamma", lambda x: x >= 0.0, ">= 0")):
        if not _is_real(p[name]) or not ok(float(p[name])):
            raise ValueError(f"policy.{name} must be a finite number {what}, got {p[name]!r}")
        p[name] = float(p[name])
    if kind == "LAPROX" and p["indicator"] != "ATTENTION_X_PROJECTED_VALUE" and \
            p["gqa_value"] != "MEAN_HEAD_NORM":
        raise ValueError(f"policy: indicator {p['indicator']} accepts only gqa_value "
                         f"MEAN_HEAD_NORM, got {p['gqa_value']}")
    if not _is_int(p["window"]) or p["window"] < 1:
        raise ValueError(f"policy.window must be an integer >= 1, got {p['window']!r}")
    if p["pooling"] != "NONE":
        k = p["pool_kernel"]
        if not _is_int(k) or k < 1 or k % 2 == 0:
            raise ValueError(f"policy.pool_kernel must be an odd integer >= 1, got {k!r}")
    for name in ("sinks", "min_per_head"):
        if not _is_int(p[name]) or p[name] < 0:
            raise ValueError(f"policy.{name} must be an integer >= 0, got {p[name]!r}")
    if not isinstance(p["head_uniform_layers"], (bool, np.bool_)):
        raise ValueError("policy.head_uniform_layers must be a bool")
    p["plan_shape"], p["block_size"] = _validate_plan_shape(p)
    s = p["max_layer_share"]
    if s is not None:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.integer,
                                                                 np.floating)):
            raise ValueError(f"policy.max_layer_share must be a number, got {s!r}")
        if not (math.isfinite(float(s)) and float(s) >= 1.0):
            raise ValueError(f"policy.max_layer_share = {s!r} must be finite and >= 1")
        if kind != "LAPROX":
            raise ValueError(f"policy.max_layer_share is a LAPROX option, not for kind {kind}")
        if p["plan_shape"] in BLOCK_SHAPES:
            raise ValueError(f"policy.max_layer_share is invalid with plan_shape "
                             f"{p['plan_shape']}")
        p["max_layer_share"] = float(s)
    tph, cr = p["tokens_per_head"], p["compression_ratio"]
    if (tph is None) == (cr is None):
        raise ValueError("policy: exactly one of tokens_per_head and compression_ratio "
                         "must be given")
    if tph is not None:
        if not _is_int(tph) or not 0 <= tph <= MAX_TOKENS_PER_HEAD:
            raise ValueError(f"policy.tokens_per_head must be an integer in "
                             f"[0, 2^31-1], got {tph!r}")
    else:
        if isinstance(cr, (bool, np.bool_)) or not isinstance(cr, (int, float, np.floating,
                                                                    np.integer)):
            raise ValueError(f"policy.compression_ratio must be a number, got {cr!r}")
        if not (math.isfinite(float(cr)) and 0.0 <= float(cr) < 1.0):
            raise ValueError(f"policy.compression_ratio must be in [0, 1), got {cr!r}")
    return p


def _validate_plan_shape(p):
    """SEMANTICS.md, "Plan shapes": returns (effective plan_shape, block_size or None).

    plan_shape None is RAGGED; LAPROX's head_uniform_layers turns RAGGED into LAYER_UNIFORM and
    is invalid with a block shape (the baselines ignore it).  Block shapes only for
    BLOCK_KINDS; LAYER_UNIFORM not for ADAKV and CRITICAL_ADAKV.  block_size None or 0 is not
    set; set, it must be an integer in [1, 65536] and the shape a block shape.  Whether a block
    shape without block_size gets one from a block table is checked by keep_plan.
    """
    kind = p["kind"]
    shape = "RAGGED" if p["plan_shape"] is None else p["plan_shape"]
    if shape not in PLAN_SHAPES:
        raise ValueError(f"policy.plan_shape = {shape!r} is not None or one of {PLAN_SHAPES}")
    bs = p["block_size"]
    if bs is not None:
        if not _is_int(bs):
            raise ValueError(f"policy.block_size must be an integer, got {bs!r}")
        bs = int(bs)
        if bs == 0:
            bs = None
        elif not 1 <= bs <= MAX_BLOCK_SIZE:
            raise ValueError(f"policy.block_size = {bs} is outside [1, {MAX_BLOCK_SIZE}]")
    if bs is not None and shape not in BLOCK_SHAPES:
        raise ValueError(f"policy.block_size = {bs} is set but plan_shape {shape} is not a "
                         f"block shape")
    if shape in BLOCK_SHAPES and kind not in BLOCK_KINDS:
        raise ValueError(f"policy.plan_shape {shape} is invalid for kind {kind} (block shapes: "
                         f"{BLOCK_KINDS})")
    if shape == "LAYER_UNIFORM" and kind in NO_LAYER_UNIFORM_KINDS:
        raise ValueError(f"policy.plan_shape LAYER_UNIFORM is invalid for kind {kind}")
    if kind == "LAPROX" and p["head_uniform_layers"]:
        if shape in BLOCK_SHAPES:
            raise ValueError(f"policy.head_uniform_layers is invalid with plan_shape {shape}")
        shape = "LAYER_UNIFORM"
    return shape, bs


def budget_tokens(policy, n):
    """B: kept tokens per KV head including forced ones (SEMANTICS.md, Budget)."""
    if policy["tokens_per_head"] is not None:
        return int(policy["tokens_per_head"])
    # IEEE double arithmetic, truncated (kvpress semantics): int((1.0 - cr) * n).
    return int((1.0 - float(policy["compression_ratio"])) * float(n))


# ----------------------------------------------------------------------------------------------
# Scores
# ----------------------------------------------------------------------------------------------

def window_attention(queries, keys, scale, n, we, G, lse=None):
    """A^h for the effective window: [H, we, n], float64.

    queries [H, wq, d] (the last we rows are used), keys [Hkv, n, d], lse [H, wq] or None.
    Row t is the query at position n - we + t and sees keys j <= n - we + t (causal); masked
    keys get probability 0.  Softmax with max subtraction, or min(1, exp(logit - lse)) with an
    lse (SEMANTICS.md: an lse below a logit does not give a probability above 1).
    """
    H, wq, _ = queries.shape
    q = queries[:, wq - we:, :]                                  # [H, we, d]
    k = np.repeat(keys, G, axis=0)                               # [H, n, d]; head h -> h // G
    logits = scale * (q @ k.transpose(0, 2, 1))                  # [H, we, n]: q_t . k_j
    pos = n - we + np.arange(we)                                 # position of each window row
    allowed = np.arange(n)[None, :] <= pos[:, None]              # [we, n]
    logits = np.where(allowed[None], logits, -np.inf)
    if lse is None:
        m = logits.max(axis=-1, keepdims=True)                   # finite: key 0 always allowed
        e = np.exp(logits - m)
        return e / e.sum(axis=-1, keepdims=True)
    # exp(-inf) = 0 when masked; capped at 1
    return np.exp(np.minimum(logits - lse[:, wq - we:, None], 0.0))


MAGNITUDE_LIMIT = 2.0 ** 120


def _amax(t):
    return float(np.max(np.abs(t))) if t is not None and t.size else 0.0


def check_magnitudes(l, gt, pol, we, q, keys, values, o_proj, logit_scale):
    """SEMANTICS.md, "Finite inputs too large to score": raises ValueError when a bound on the
    fp32 intermediates of layer l exceeds 2^120.  q: window queries when the attention is
    computed from them (else None); logit_scale: the scale the logits use; values / o_proj: None
    when not given.  Maxima are taken per KV head (queries: over the group's heads, every row).
    """
    L, H, Hkv, d, D, scale, G = gt
    w = _amax(o_proj)
    if D * G * G * w * w > MAGNITUDE_LIMIT:
        raise ValueError(f"o_proj[{l}]: the factors may overflow fp32 (max |o_proj| {w})")
    kind, indicator = pol["kind"], pol["indicator"]
    for g in range(Hkv):
        if q is not None and we > 0:
            mq, mk = _amax(q[g * G:(g + 1) * G]), _amax(keys[g])
            if d * mq * max(1.0, mk) * max(1.0, logit_scale) > MAGNITUDE_LIMIT:
                raise ValueError(f"layers[{l}].keys: logits of KV head {g} may overflow fp32")
        if values is None:
            continue
        mv = _amax(values[g])
        if kind == "LAPROX" and indicator != "ATTENTION":
            V = d * mv * mv if indicator == "ATTENTION_X_VALUE" else \
                d * d * mv * mv * D * G * G * w * w
            bound = G * G * 1.03 * max(we, 1) * V
        elif kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            bound = D * d * mv * w
        else:
            continue
        if bound > MAGNITUDE_LIMIT:
            raise ValueError(f"layers[{l}].values: scores of KV head {g} may overflow fp32")


def pool1d(x, pooling, k):
    """Pool along the last axis (SEMANTICS.md): zero padding, AVG always divides by k,
    MAX takes the max over the in-range neighbourhood |j - i| <= k // 2, AVG_PEAK is AVG but
    never below the position's own value, max(x_i, AVG(x)_i)."""
    x = np.asarray(x, dtype=np.float64)
    if pooling == "NONE" or x.shape[-1] == 0:
        return x.copy()
    half = k // 2
    pad = [(0, 0)] * (x.ndim - 1) + [(half, half)]
    if pooling in ("AVG", "AVG_PEAK"):
        padded = np.pad(x, pad, constant_values=0.0)
        windows = np.lib.stride_tricks.sliding_window_view(padded, k, axis=-1)
        avg = windows.sum(axis=-1) / k
        return avg if pooling == "AVG" else np.maximum(x, avg)
    if pooling == "MAX":
        padded = np.pad(x, pad, constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, k, axis=-1)
        return windows.max(axis=-1)
    raise ValueError(f"unknown pooling {pooling!r}")


def effective_gqa_value(policy):
    """The gqa_value applied (SEMANTICS.md, "Defaults"): the policy's, or when it is None
    MEAN_HEAD_PRODUCT for LAPROX with ATTENTION_X_PROJECTED_VALUE and MEAN_HEAD_NORM otherwise
    (the only one the other indicators accept; the baselines ignore it)."""
    if policy["gqa_value"] is not None:
        return policy["gqa_value"]
    projected = policy.get("kind", "LAPROX") == "LAPROX" and \
        policy["indicator"] == "ATTENTION_X_PROJECTED_VALUE"
    return "MEAN_HEAD_PRODUCT" if projected else "MEAN_HEAD_NORM"


def effective_pool_target(policy):
    """Where pooling applies (SEMANTICS.md, "Scores"): the policy's pool_target, or when it is
    None SCORE for ATTENTION_X_PROJECTED_VALUE with MEAN_HEAD_PRODUCT or EXACT_BLOCK and
    ATTENTION otherwise."""
    if policy["pool_target"] is not None:
        return policy["pool_target"]
    per_head = policy["indicator"] == "ATTENTION_X_PROJECTED_VALUE" and \
        policy["gqa_value"] in ("MEAN_HEAD_PRODUCT", "EXACT_BLOCK")
    return "SCORE" if per_head else "ATTENTION"


def layer_raw_scores(A, values, o_proj, policy, geometry_t, nx, scratch=None):
    """p over the pooled domain [0, nx) (sinks included, window excluded): [Hkv, nx].

    A [H, we, n] window attention; values [Hkv, n, d]; o_proj [D, H*d];
    scratch: optional float64 buffer [G, nx, D].
    """
    L, H, Hkv, d, D, scale, G = geometry_t
    if scratch is None and policy["indicator"] == "ATTENTION_X_PROJECTED_VALUE":
        scratch = np.empty((G, nx, D))
    we = A.shape[1]
    Ax = A[:, :, :nx].reshape(Hkv, G, we, nx)        # heads of KV group g: h = g*G .. g*G+G-1
    indicator, gqa, pooling, k = (policy["indicator"], policy["gqa_value"], policy["pooling"],
                                  policy["pool_kernel"])
    pool_attention = effective_pool_target(policy) == "ATTENTION"

    def proj(g):
        """Explicit v_i W_O^h for the heads of group g: [G, nx, D] (written into `scratch`,
        reused across groups and layers only to avoid page-faulting a fresh n x D buffer)."""
        V = values[g, :nx, :]                                        # [nx, d]
        for j in range(G):
            h = g * G + j
            W = o_proj[:, h * d:(h + 1) * d].T                       # W_O^h: [d, D]
            np.matmul(V, W, out=scratch[j])
        return scratch

    def row_norm(X):
        """L2 norm along the last axis."""
        return np.sqrt(np.einsum("...D,...D->...", X, X))

    if gqa in ("MEAN_HEAD_NORM", "SUMMED_PROJECTION") or indicator != \
            "ATTENTION_X_PROJECTED_VALUE":
        Abar = Ax.mean(axis=1)                                       # [Hkv, we, nx]
        c = np.sqrt((Abar ** 2).sum(axis=1))                         # [Hkv, nx]
        if indicator == "ATTENTION":
            r = np.ones((Hkv, nx))
        elif indicator == "ATTENTION_X_VALUE":
            r = row_norm(values[:, :nx, :])
        else:
            r = np.empty((Hkv, nx))
            for g in range(Hkv):
                if gqa == "MEAN_HEAD_NORM":
                    r[g] = row_norm(proj(g)).mean(axis=0)
                else:  # SUMMED_PROJECTION: ||v_i (sum_h W_O^h)||
                    Wsum = sum(o_proj[:, h * d:(h + 1) * d].T for h in range(g * G, (g + 1) * G))
                    r[g] = row_norm(values[g, :nx, :] @ Wsum)
        if pool_attention:                                           # pool(c) * r
            return pool1d(c, pooling, k) * r
        return pool1d(c * r, pooling, k)                             # pool(c * r)

    x = np.empty((Hkv, nx))
    for g in range(Hkv):
        P = proj(g)                                                  # [G, nx, D]
        c_h = np.sqrt((Ax[g] ** 2).sum(axis=1))                      # [G, nx]: ||A^h[:, i]||
        pooled = pool1d(c_h, pooling, k) if pool_attention else c_h
        if gqa == "MEAN_HEAD_PRODUCT":
            x[g] = (pooled * row_norm(P)).mean(axis=0)
        else:  # EXACT_BLOCK: || sum_h A^h[:, i] (outer) P_h[i] ||_F, no 1/G
            # ||sum_h a_h (outer) b_h||_F^2 = sum_{h,h'} (a_h . a_h') (b_h . b_h'); with the
            # ATTENTION target a_h . a_h' = rho c_h c_h' with c_h pooled and rho kept.
            sq = np.zeros(nx)
            for a in range(G):
                for b in range(G):
                    a_dot = (Ax[g, a] * Ax[g, b]).sum(axis=0)        # [nx]: A^a[:, i] . A^b[:, i]
                    p_dot = np.einsum("nD,nD->n", P[a], P[b])        # [nx]: P_a[i] . P_b[i]
                    if pool_attention:
                        norms = c_h[a] * c_h[b]
                        rho = np.ones(nx) if a == b else np.divide(
                            a_dot, norms, out=np.zeros(nx), where=norms > 0)
                        a_dot = rho * pooled[a] * pooled[b]
                    sq += a_dot * p_dot
            x[g] = np.sqrt(np.maximum(0.0, sq))
    return x if pool_attention else pool1d(x, pooling, k)


def _fsum(a):
    try:
        return math.fsum(np.asarray(a, dtype=np.float64).ravel().tolist())
    except OverflowError:
        return math.inf


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------

def select_best(s, eligible, k):
    """Mask of the k best entries of s among `eligible` (both [L, Hkv, n]).

    Strict total order: score descending, then layer, KV head, position ascending.
    """
    out = np.zeros(eligible.shape, dtype=bool)
    if k <= 0:
        return out
    l, g, i = np.nonzero(eligible)
    order = np.lexsort((i, g, l, -s[l, g, i]))      # last key is the primary key
    chosen = order[:k]
    out[l[chosen], g[chosen], i[chosen]] = True
    return out


def select_capped(s, eligible, k, taken, cap):
    """SEMANTICS.md "Selection", max_layer_share: walks the eligible candidates in the
    selection order and takes each unless its layer already holds `cap` (counting `taken[l]`
    selected before), until k are taken or none is left.  A literal walk, no shortcut."""
    out = np.zeros(eligible.shape, dtype=bool)
    if k <= 0:
        return out
    held = np.array(taken, dtype=np.int64).copy()
    l, g, i = np.nonzero(eligible)
    order = np.lexsort((i, g, l, -s[l, g, i]))
    for j in order:
        if k == 0:
            break
        if held[l[j]] >= cap:
            continue
        out[l[j], g[j], i[j]] = True
        held[l[j]] += 1
        k -= 1
    return out


def _reserve_per_head(s, eligible, r):
    """Each (layer, head) reserves its own best r eligible candidates."""
    L, Hkv, _ = s.shape
    out = np.zeros(eligible.shape, dtype=bool)
    if r <= 0:
        return out
    for l in range(L):
        for g in range(Hkv):
            head = np.zeros_like(eligible)
            head[l, g] = eligible[l, g]
            out |= select_best(s, head, r)
    return out


# ----------------------------------------------------------------------------------------------
# Block plans (SEMANTICS.md, "Plan shapes")
# ----------------------------------------------------------------------------------------------

def _layer_table(layer, name):
    """The block table {"block_size", "ids"} that layer's `name` ("keys" or "values") was read
    through, or None when that tensor is not paged."""
    return layer.get(f"{name}_table") if isinstance(layer, dict) else None


def check_tables(layers, n):
    """Every block table a layer names: block_size in [1, 65536], exactly ceil(n / block_size)
    ids, none negative, none repeated (a table is valid by itself, whatever the plan shape)."""
    for l, layer in enumerate(layers):
        for name in ("keys", "values"):
            t = _layer_table(layer, name)
            if t is None:
                continue
            bs = t["block_size"]
            if not _is_int(bs) or not 1 <= bs <= MAX_BLOCK_SIZE:
                raise ValueError(f"layers[{l}].{name}: block_size = {bs!r} is outside "
                                 f"[1, {MAX_BLOCK_SIZE}]")
            ids = np.asarray(t["ids"], dtype=np.int64).ravel()
            if ids.size != -(-n // int(bs)):
                raise ValueError(f"layers[{l}].{name}: the block table has {ids.size} ids, "
                                 f"{n} rows in blocks of {bs} need {-(-n // int(bs))}")
            if ids.size and (ids.min() < 0 or np.unique(ids).size != ids.size):
                raise ValueError(f"layers[{l}].{name}: block ids must be distinct and >= 0")


def resolve_block_size(pol, layers):
    """bs of a block shape: policy.block_size when set, else the block size of layers[0].keys'
    table; every table any layer names must then have that block size."""
    bs = pol["block_size"]
    if bs is None:
        t0 = _layer_table(layers[0], "keys")
        if t0 is None:
            raise ValueError(f"policy.plan_shape {pol['plan_shape']} needs policy.block_size or "
                             f"paged layers[0].keys")
        bs = int(t0["block_size"])
    for l, layer in enumerate(layers):
        for name in ("keys", "values"):
            t = _layer_table(layer, name)
            if t is not None and int(t["block_size"]) != bs:
                raise ValueError(f"layers[{l}].{name}: block table of block_size "
                                 f"{t['block_size']}, the plan's block size is {bs}")
    return bs


def select_blocks(layer_scores, forced, n, bs, B, shape, model_wide):
    """The kept logical blocks of a block-shaped plan.

    layer_scores: [L, n] float64, per layer the token score summed over the KV heads (only
        candidate positions are read: a candidate block holds no forced position), or the
        string "recency" for STREAMING_LLM (block score = block index, the latest wins).
    forced: [n] bool, the positions the policy always keeps.  B: tokens per head.
    shape: BLOCKS_SHARED (one unit, scores summed over the layers) or BLOCKS_PER_LAYER (one
        unit per layer); model_wide: BLOCKS_PER_LAYER's best L * qb (layer, block) pairs in one
        competition instead of each layer its own qb.
    Returns (kept [U, nb] bool, scores [U, nb] float64 with +inf for forced blocks).

    nb = ceil(n / bs); a block holding a forced position is kept whole.  B >= n keeps every
    block; else a unit keeps Kb = B // bs blocks, forced ones included (a partial block counts
    as a whole one): qb = clamp(Kb - forced blocks, 0, candidate blocks).  Order: score
    descending, then (layer,) block index ascending.
    """
    nb = -(-n // bs)
    block_of = np.arange(n) // bs
    forced_blk = np.zeros(nb, dtype=bool)
    forced_blk[block_of[forced]] = True
    if isinstance(layer_scores, str):                       # "recency"
        L = None
        per_layer = np.arange(nb, dtype=np.float64)[None, :]
    else:
        L = layer_scores.shape[0]
        padded = np.zeros((L, nb * bs))
        padded[:, :n] = np.where(forced[None, :], 0.0, layer_scores)
        per_layer = padded.reshape(L, nb, bs).sum(axis=2)
    if shape == "BLOCKS_SHARED":
        unit = per_layer.sum(axis=0, keepdims=True) if L is not None else per_layer
    else:
        unit = per_layer
    U = unit.shape[0]
    kept = np.tile(forced_blk, (U, 1))
    if B >= n:
        kept[:] = True
    else:
        n_forced = int(forced_blk.sum())
        qb = max(0, min(B // bs - n_forced, nb - n_forced))
        candidates = np.flatnonzero(~forced_blk).tolist()
        units = list(range(U))
        competitions = [units] if model_wide else [[u] for u in units]
        for comp in competitions:
            entries = sorted((-float(unit[u, b]), u, b) for u in comp for b in candidates)
            for _, u, b in entries[:qb * len(comp)]:
                kept[u, b] = True
    scores = np.where(forced_blk[None, :], np.inf, unit)
    return kept, scores


def block_outputs(layers, shape, bs, kept_blocks, L, Hkv, n, recency=False):
    """Token keep mask [L, Hkv, n] of a block plan and its block output fields (module
    docstring): every (layer, head) keeps every position of its unit's kept blocks; the new
    block table and freed ids of unit u from layers[u].keys' table (BLOCKS_SHARED:
    layers[0].keys'), when every unit's keys are paged."""
    U, nb = kept_blocks.shape
    block_of = np.arange(n) // bs
    unit_of = [0] * L if shape == "BLOCKS_SHARED" else list(range(L))
    kept = np.zeros((L, Hkv, n), dtype=bool)
    for l in range(L):
        kept[l] = kept_blocks[unit_of[l], block_of][None, :]
    out = {"block_size": int(bs), "num_blocks": int(nb), "block_kept": kept_blocks.copy()}
    tables = [_layer_table(layers[0 if shape == "BLOCKS_SHARED" else u], "keys")
              for u in range(U)]
    if all(t is not None for t in tables):
        ids = [np.asarray(t["ids"], dtype=np.int64).ravel() for t in tables]
        out["new_block_table"] = [ids[u][kept_blocks[u]] for u in range(U)]
        out["freed_block_ids"] = [ids[u][~kept_blocks[u]] for u in range(U)]
    return kept, out


# ----------------------------------------------------------------------------------------------
# Keep plan
# ----------------------------------------------------------------------------------------------

def _check_tensor(name, t, shape):
    if t is None:
        raise ValueError(f"{name} is required but missing")
    t = np.asarray(t, dtype=np.float64)
    if t.shape != tuple(shape):
        raise ValueError(f"{name}: shape {t.shape} != expected {tuple(shape)}")
    if not np.all(np.isfinite(t)):
        raise ValueError(f"{name}: contains NaN or Inf")
    return t


def _layer_inputs(l, layer, gt, n, w, need_values, need_oproj, need_window=True):
    """Checks the tensors of layers[l]; returns (q, att, lse, keys, values, o_proj, keys_dtype)
    as float64 arrays (or None) and the keys' dtype name.

    Every tensor that is given is checked (shape, NaN/Inf), even if the policy ignores it.
    need_window=False (STREAMING_LLM) makes queries/attention optional and skips the
    window <= wq check.
    """
    L, H, Hkv, d, D, scale, G = gt
    get = lambda key: layer.get(key) if isinstance(layer, dict) else None  # noqa: E731
    q, att, lse = get("queries"), get("attention"), get("lse")
    keys, values, o_proj = get("keys"), get("values"), get("o_proj")
    keys_dtype = get("keys_dtype")
    if keys_dtype is not None and keys_dtype not in KEY_DTYPES:
        raise ValueError(f"layers[{l}].keys_dtype = {keys_dtype!r} is not one of {KEY_DTYPES}")
    if q is not None and att is not None:
        raise ValueError(f"layers[{l}]: exactly one of queries and attention must be given")
    if q is None and att is None and need_window:
        raise ValueError(f"layers[{l}]: exactly one of queries and attention must be given")
    if lse is not None and q is None:
        raise ValueError(f"layers[{l}]: lse given without queries")
    wq = None
    if q is not None:
        q = np.asarray(q, dtype=np.float64)
        if q.ndim != 3:
            raise ValueError(f"layers[{l}].queries: expected [H, wq, d], got {q.shape}")
        wq = q.shape[1]
        q = _check_tensor(f"layers[{l}].queries", q, (H, wq, d))
        keys = _check_tensor(f"layers[{l}].keys", keys, (Hkv, n, d))
        if lse is not None:
            lse = _check_tensor(f"layers[{l}].lse", lse, (H, wq))
    else:
        if att is not None:
            att = np.asarray(att, dtype=np.float64)
            if att.ndim != 3:
                raise ValueError(f"layers[{l}].attention: expected [H, wq, n], got {att.shape}")
            wq = att.shape[1]
            att = _check_tensor(f"layers[{l}].attention", att, (H, wq, n))
        if keys is not None:
            keys = _check_tensor(f"layers[{l}].keys", keys, (Hkv, n, d))
    if values is not None or need_values:
        values = _check_tensor(f"layers[{l}].values", values, (Hkv, n, d))
    if o_proj is not None or need_oproj:
        o_proj = _check_tensor(f"layers[{l}].o_proj", o_proj, (D, H * d))
    if need_window and w > wq:
        raise ValueError(f"layers[{l}]: policy.window={w} > {wq} window rows given")
    return q, att, lse, keys, values, o_proj, keys_dtype


def keep_plan(geometry, policy, layers, n):
    """Computes the LaProx keep plan.

    geometry: {"L","H","Hkv","d","D","scale"}; policy: see POLICY_DEFAULTS (and the module
    docstring for "kind" and the baseline fields); layers: L dicts with "keys" [Hkv,n,d],
    "values" [Hkv,n,d], "o_proj" [D,H*d], and "queries" [H,wq,d] (optionally "lse" [H,wq]) or
    "attention" [H,wq,n], optionally "keys_dtype", "keys_table", "values_table".  Returns a
    dict of numpy arrays: kept, counts, scores, raw, layer_sums, selected, quota,
    total_selected, and for a block plan_shape block_size, num_blocks, block_kept,
    block_scores (and new_block_table, freed_block_ids with paged keys).
    Raises ValueError on invalid input.
    """
    gt = validate_geometry(geometry)
    L, H, Hkv, d, D, scale, G = gt
    pol = validate_policy(policy)
    if not _is_int(n) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    n = int(n)
    if len(layers) != L:
        raise ValueError(f"layers: {len(layers)} given, geometry says L={L}")
    check_tables(layers, n)
    if pol["plan_shape"] in BLOCK_SHAPES:
        pol["block_size"] = resolve_block_size(pol, layers)
    if pol["kind"] != "LAPROX":
        return baseline_plan(gt, pol, layers, n)

    w = pol["window"]
    we = min(w, n)
    se = min(pol["sinks"], n - we)
    nx = n - we                      # pooled domain [0, nx): sinks + candidates
    m = n - we - se                  # candidates [se, nx)
    f = se + we

    need_values = pol["indicator"] != "ATTENTION"
    need_oproj = pol["indicator"] == "ATTENTION_X_PROJECTED_VALUE"

    raw = np.full((L, Hkv, n), np.nan)
    scores = np.full((L, Hkv, n), np.nan)
    layer_sums = np.zeros(L)
    scratch = None
    for l, layer in enumerate(layers):
        q, att, lse, keys, values, o_proj, _ = _layer_inputs(l, layer, gt, n, w, need_values,
                                                             need_oproj)
        wq = (q if q is not None else att).shape[1]
        check_magnitudes(l, gt, pol, we, q, keys, values if need_values else None, o_proj, scale)
        if q is not None:
            A = window_attention(q, keys, scale, n, we, G, lse)
        else:
            A = att[:, wq - we:, :]                                  # used as given

        if m == 0:
            continue                                                 # S_l = 0, no candidates
        if scratch is None and need_oproj:
            scratch = np.empty((G, nx, D))
        p = layer_raw_scores(A, values, o_proj, pol, gt, nx, scratch)[:, se:]  # [Hkv, m]
        S = _fsum(p)
        layer_sums[l] = S
        raw[l, :, se:nx] = p
        if pol["allocation"] == "GLOBAL_RAW":
            s = p                                                    # no normalisation at all
        elif S == 0.0 or not math.isfinite(S):
            s = np.full((Hkv, m), 1.0 / (Hkv * m))
        else:
            s = p / S
        scores[l, :, se:nx] = s

    # Budget.
    B = budget_tokens(pol, n)
    q_head = max(0, min(B - f, m))
    K = L * Hkv * q_head

    candidate = np.zeros((L, Hkv, n), dtype=bool)
    candidate[:, :, se:nx] = True

    if pol["plan_shape"] in BLOCK_SHAPES:
        return _laprox_block_plan(pol, layers, n, B, se, nx, m, raw, scores, layer_sums,
                                  candidate, q_head, Hkv)
    selected = _select(pol, scores, candidate, q_head)

    kept = selected.copy()
    kept[:, :, :se] = True
    kept[:, :, nx:] = True
    return {
        "kept": kept,
        "counts": kept.sum(axis=2).astype(np.int64),
        "scores": scores,
        "raw": raw,
        "layer_sums": layer_sums,
        "selected": selected,
        "quota": int(q_head),
        "total_selected": int(K),
    }


def _select(pol, scores, candidate, q_head):
    """SEMANTICS.md "Selection": the selected candidates [L, Hkv, n] of a token plan shape
    (RAGGED or LAYER_UNIFORM) by the allocation, q_head candidates per head on average."""
    L, Hkv, _ = scores.shape
    K = L * Hkv * q_head
    r = min(pol["min_per_head"], q_head)
    alloc = pol["allocation"]
    if alloc in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"):
        selected = _reserve_per_head(scores, candidate, r)
        if pol["max_layer_share"] is None:
            selected |= select_best(scores, candidate & ~selected, K - L * Hkv * r)
        else:
            cap = min(math.floor(pol["max_layer_share"] * float(Hkv * q_head)), K)
            selected |= select_capped(scores, candidate & ~selected, K - L * Hkv * r,
                                      selected.sum(axis=(1, 2)), cap)
    elif alloc == "PER_LAYER":
        selected = _reserve_per_head(scores, candidate, r)
        for l in range(L):
            in_layer = np.zeros_like(candidate)
            in_layer[l] = candidate[l] & ~selected[l]
            selected |= select_best(scores, in_layer, Hkv * (q_head - r))
    else:  # UNIFORM
        selected = _reserve_per_head(scores, candidate, q_head)

    if pol["plan_shape"] == "LAYER_UNIFORM":
        T = selected.sum(axis=(1, 2))
        selected = np.zeros_like(selected)
        for l in range(L):
            for g in range(Hkv):
                quota = T[l] // Hkv + (1 if g < T[l] % Hkv else 0)
                head = np.zeros_like(candidate)
                head[l, g] = candidate[l, g]
                selected |= select_best(scores, head, int(quota))
    return selected


def decode_keep_plan(geometry, policy, layers, positions):
    """The keep plan of a decode re-plan (SEMANTICS.md, "Decode re-plans").

    layers: L dicts as keep_plan's, but layer l's "keys" and "values" are [Hkv, n_l, d] (the
    entries it holds), "queries" [H, wq, d] those of the last wq entries; positions: L integer
    arrays [Hkv, n_l], the token position of each entry.  Returns a dict: kept [L, Hkv, n]
    over entries (n = max n_l; False past a shorter layer), kept_positions [L][Hkv] (token
    positions), counts, scores, layer_sums, selected, quota, total_selected.
    Raises ValueError on invalid input.
    """
    gt = validate_geometry(geometry)
    L, H, Hkv, d, D, scale, G = gt
    pol = validate_policy(policy)
    if pol["kind"] != "LAPROX":
        raise ValueError(f"a decode re-plan takes kind LAPROX, not {pol['kind']}")
    if pol["plan_shape"] not in ("RAGGED", "LAYER_UNIFORM"):
        raise ValueError(f"a decode re-plan takes plan_shape RAGGED or LAYER_UNIFORM, not "
                         f"{pol['plan_shape']}")
    if pol["tokens_per_head"] is None:
        raise ValueError("a decode re-plan takes a budget in tokens_per_head")
    if len(layers) != L or len(positions) != L:
        raise ValueError(f"{len(layers)} layers and {len(positions)} position arrays given, "
                         f"geometry says L={L}")
    sizes = []
    for l, layer in enumerate(layers):
        if layer.get("attention") is not None or layer.get("lse") is not None:
            raise ValueError(f"layers[{l}]: a decode re-plan takes queries only")
        keys = np.asarray(layer["keys"])
        if keys.ndim != 3:
            raise ValueError(f"layers[{l}].keys: expected [Hkv, n_l, d], got {keys.shape}")
        sizes.append(keys.shape[1])
    n, shortest = max(sizes), min(sizes)
    wq = np.asarray(layers[0]["queries"]).shape[1]
    if wq > shortest:
        raise ValueError(f"the window is longer than the cache: {wq} rows, shortest layer "
                         f"{shortest}")
    window_start = None
    for l, pos in enumerate(positions):
        pos = np.asarray(pos)
        if pos.shape != (Hkv, sizes[l]) or not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"positions[{l}]: expected integers [{Hkv}, {sizes[l]}], got "
                             f"{pos.dtype} {pos.shape}")
        if np.any(pos < 0) or np.any(pos >= 2**31 - 1):
            raise ValueError(f"positions[{l}]: outside [0, 2^31 - 1)")
        if np.any(np.diff(pos, axis=1) <= 0):
            raise ValueError(f"positions[{l}]: not strictly ascending along every head")
        tail = pos[:, sizes[l] - wq:]
        if np.any(tail != tail[0, 0] + np.arange(wq)):
            raise ValueError(f"positions[{l}]: the last {wq} entries are not the same "
                             "consecutive positions in every head")
        if window_start is None:
            window_start = tail[0, 0]
        elif tail[0, 0] != window_start:
            raise ValueError(f"positions[{l}]: the window starts at {tail[0, 0]}, layer 0's "
                             f"at {window_start}")

    w = pol["window"]
    we = min(w, shortest)
    se = min(pol["sinks"], shortest - we)
    f = se + we
    need_values = pol["indicator"] != "ATTENTION"
    need_oproj = pol["indicator"] == "ATTENTION_X_PROJECTED_VALUE"

    scores = np.zeros((L, Hkv, n))
    layer_sums = np.zeros(L)
    candidate = np.zeros((L, Hkv, n), dtype=bool)
    for l, layer in enumerate(layers):
        # Each layer as a prefill of its own n_l entries.
        n_l = sizes[l]
        nx, m = n_l - we, n_l - we - se
        q, _, lse, keys, values, o_proj, _ = _layer_inputs(l, layer, gt, n_l, w, need_values,
                                                           need_oproj)
        check_magnitudes(l, gt, pol, we, q, keys, values if need_values else None, o_proj, scale)
        A = window_attention(q, keys, scale, n_l, we, G, lse)
        candidate[l, :, se:nx] = True
        if m == 0:
            continue
        p = layer_raw_scores(A, values, o_proj, pol, gt, nx)[:, se:]     # [Hkv, m]
        S = _fsum(p)
        layer_sums[l] = S
        if pol["allocation"] == "GLOBAL_RAW":
            s = p
        elif S == 0.0 or not math.isfinite(S):
            s = np.full((Hkv, m), 1.0 / (Hkv * m))
        else:
            s = p / S
        scores[l, :, se:nx] = s

    B = budget_tokens(pol, n)
    q_head = max(0, min(B - f, n - f))
    selected = _select(pol, scores, candidate, q_head)
    kept = selected.copy()
    for l in range(L):
        kept[l, :, :se] = True
        kept[l, :, sizes[l] - we:sizes[l]] = True
    kept_positions = [[np.asarray(positions[l])[g][kept[l, g, :sizes[l]]]
                       for g in range(Hkv)] for l in range(L)]
    return {
        "kept": kept,
        "kept_positions": kept_positions,
        "counts": kept.sum(axis=2).astype(np.int64),
        "scores": scores,
        "layer_sums": layer_sums,
        "selected": selected,
        "quota": int(q_head),
        "total_selected": int(selected.sum()),
    }


def _laprox_block_plan(pol, layers, n, B, se, nx, m, raw, scores, layer_sums, candidate,
                       q_head, Hkv):
    """LAPROX at a block shape: block scores are float64 sums of the competing scores s
    (p / S_l, or 1 / (Hkv * m) in a layer whose S_l is 0 or not finite; GLOBAL_RAW: raw p in
    every layer) over the unit's layers, every KV head and the block's positions.
    BLOCKS_PER_LAYER competes model-wide for GLOBAL_NORMALIZED and GLOBAL_RAW, per layer for
    PER_LAYER and UNIFORM.  min_per_head is ignored.  The per-token scores, layer sums and
    quota stay the ragged plan's; total_selected counts the kept candidate positions."""
    L = raw.shape[0]
    alloc = pol["allocation"]
    token = raw if alloc == "GLOBAL_RAW" else scores
    layer_scores = np.zeros((L, n))
    if m > 0:
        layer_scores[:, se:nx] = token[:, :, se:nx].sum(axis=1)
    forced = np.zeros(n, dtype=bool)
    forced[:se] = True
    forced[nx:] = True
    bs = pol["block_size"]
    kept_blocks, block_scores = select_blocks(
        layer_scores, forced, n, bs, B, pol["plan_shape"],
        alloc in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"))
    kept, out = block_outputs(layers, pol["plan_shape"], bs, kept_blocks, L, Hkv, n)
    selected = kept & candidate
    out.update({
        "kept": kept,
        "counts": kept.sum(axis=2).astype(np.int64),
        "scores": scores,
        "raw": raw,
        "layer_sums": layer_sums,
        "selected": selected,
        "quota": int(q_head),
        "total_selected": int(selected.sum()),
        "block_scores": block_scores,
    })
    return out


# ----------------------------------------------------------------------------------------------
# Baselines (docs/design.md §3; SEMANTICS.md "Baseline policies")
# ----------------------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)            # 3.4028234663852886e38
BF16_MAX = float.fromhex("0x1.fep127")               # (2 - 2^-7) * 2^127 = 3.3895313892515355e38
F16_MAX = 65504.0
# (significant bits incl. the implicit one, exponent of the smallest normal, largest finite)
_DTYPE_FORMAT = {"bf16": (8, -126, BF16_MAX), "f16": (11, -14, F16_MAX)}
DTYPE_MAX = {"f32": F32_MAX, "bf16": BF16_MAX, "f16": F16_MAX}


def round_to_dtype(x, dtype):
    """Rounds float64 values to the nearest `dtype` value (ties to even), returned as float64.

    dtype "f32" returns x unchanged (KVPRESS_COMPAT: f32 means no rounding).  "bf16" and "f16"
    are rounded directly from float64 (no intermediate float32 step), subnormals included;
    magnitudes that round past the largest finite value become +-inf.
    """
    x = np.asarray(x, dtype=np.float64)
    if dtype == "f32":
        return x.copy()
    p, emin, vmax = _DTYPE_FORMAT[dtype]
    _, e = np.frexp(x)                          # |x| in [2^(e-1), 2^e)
    ulp_exp = np.maximum(e, emin + 1) - p       # spacing of dtype values around x
    out = np.ldexp(np.rint(np.ldexp(x, -ulp_exp)), ulp_exp)   # rint: half to even
    return np.where(np.abs(out) > vmax, np.copysign(np.inf, x), out)


def _top_mask(score, k, forced=None):
    """Mask (shape of `score`) of its k best entries: forced first, then score descending,
    then flat C-order index ascending (position for one head; (head, position) for a
    [Hkv, n] layer)."""
    flat = np.asarray(score, dtype=np.float64).ravel()
    f = np.zeros(flat.size, dtype=bool) if forced is None else np.asarray(forced).ravel()
    out = np.zeros(flat.size, dtype=bool)
    k = max(0, min(int(k), flat.size))
    if k:
        order = np.lexsort((np.arange(flat.size), -flat, ~f))   # last key is primary
        out[order[:k]] = True
    return out.reshape(np.shape(score))


def compat_window_attention(queries, keys, n, we, G, dtype):
    """KVPRESS_COMPAT window attention of the SnapKV kinds: [H, we, n], float64 holding values
    of `dtype` (kvpress 0.5.5 snapkv_press.py:62-66, see SEMANTICS.md).

    queries [H, wq, d] (the last we rows are used), keys [Hkv, n, d].  With r = round_to_dtype
    (identity for "f32"):  z = r(r(q_t . k_j) / sqrt(d))  -- the dot product in float64, the
    scale 1/sqrt(d) (not the geometry's scale) --, causal mask, softmax in float64 over all n
    keys, then r again.  No lse: the softmax is always computed.
    """
    H, wq, d = queries.shape
    q = queries[:, wq - we:, :]                                  # [H, we, d]
    k = np.repeat(keys, G, axis=0)                               # [H, n, d]; head h -> h // G
    logits = round_to_dtype(q @ k.transpose(0, 2, 1), dtype)     # (1) r(q . k)
    pos = n - we + np.arange(we)
    allowed = np.arange(n)[None, :] <= pos[:, None]
    if not np.all(np.isfinite(logits[:, allowed])):
        raise ValueError(f"keys: a logit q . k is beyond the range of {dtype} (KVPRESS_COMPAT)")
    logits = round_to_dtype(logits / math.sqrt(d), dtype)        # (2) r(logit / sqrt(d))
    logits = np.where(allowed[None], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    return round_to_dtype(e / e.sum(axis=-1, keepdims=True), dtype)   # (3) r(softmax)


def snapkv_scores(A, Hkv, G, nx, pooling, k, dtype=None):
    """SnapKV score of one layer: [Hkv, n] with the window sentinel, and the prefix part
    [Hkv, nx] before the sentinel.

    A [H, we, n] window attention (rows as used).  Per query head: mean over the we rows of
    A[:, :, :nx], pool1d along [0, nx) (zero padding, AVG always / k), then mean over the G
    heads of the group.  Window positions [nx, n) get max(prefix scores of the layer) + 1
    (1.0 when nx == 0).  dtype (KVPRESS_COMPAT): each of the row mean, the pool, the group mean
    and the sentinel is rounded to it (kvpress 0.5.5 snapkv_press.py:95-103); None (EXACT): no
    rounding.
    """
    r = (lambda x: x) if dtype is None else (lambda x: round_to_dtype(x, dtype))  # noqa: E731
    H, we, n = A.shape
    x = r(A[:, :, :nx].mean(axis=1))                                # (4) sum / we
    x = r(pool1d(x, pooling, k))                                    # (5)
    pre = r(x.reshape(Hkv, G, nx).mean(axis=1))                     # (6) [Hkv, nx]
    full = np.empty((Hkv, n))
    full[:, :nx] = pre
    full[:, nx:] = r((pre.max() if nx > 0 else 0.0) + 1.0)         # (7)
    return full, pre


def value_l1_factor(values, o_proj, Hkv, G, d):
    """CriticalKV value factor u [Hkv, n]: mean over the group's heads h of ||v_i W_O^h||_1,
    with the explicit n x D product values[g] @ o_proj[:, h*d:(h+1)*d].T (no shortcut)."""
    n = values.shape[1]
    u = np.zeros((Hkv, n))
    for g in range(Hkv):
        for j in range(G):
            h = g * G + j
            u[g] += np.abs(values[g] @ o_proj[:, h * d:(h + 1) * d].T).sum(axis=1)
    return u / G


def compat_value_l1_factor(values, o_proj, Hkv, G, d, dtype):
    """KVPRESS_COMPAT CriticalKV value factor (kvpress 0.5.5 criticalkv_press.py:69-76):
    per query head h, P = r(v_i W_O^h) elementwise (the product in float64, then rounded),
    u_h = r(sum_D |P|); u = r(sum_h u_h / G).  r = round_to_dtype(., dtype)."""
    n = values.shape[1]
    u = np.zeros((Hkv, n))
    for g in range(Hkv):
        for j in range(G):
            h = g * G + j
            P = round_to_dtype(values[g] @ o_proj[:, h * d:(h + 1) * d].T, dtype)
            u[g] += round_to_dtype(np.abs(P).sum(axis=1), dtype)
    return round_to_dtype(u / G, dtype)


def pyramid_layer_counts(n, q, w, beta, L, fallback_min=0):
    """PyramidKV kept tokens per layer (window included), kvpress arithmetic in double.

    q = n * (1 - cr) as a float (with a tokens-per-head budget: q = n_kept).  w is the policy
    window (not clamped to n).  cap = w + q; mn = (cap - w) / beta; mx = (cap - w) * 2 - mn;
    if mx >= n - w: mx = n - w, mn = (cap - w) * 2 - mx.  If not n >= mx >= mn >= w, or L == 1,
    every layer keeps max(fallback_min, round(q)) (fallback_min 1 in KVPRESS_COMPAT with a
    compression ratio, kvpress pyramidkv_press.py:79-81; else 0); else layer l keeps
    round(mx - l * (mx - mn) / (L - 1)), evaluated left to right.  round() is half to even;
    results are clamped to [0, n].
    """
    cap = w + q
    mn = (cap - w) / beta
    mx = (cap - w) * 2 - mn
    if mx >= n - w:
        mx = n - w
        mn = (cap - w) * 2 - mx
    if not (n >= mx >= mn >= w) or L == 1:
        counts = [max(fallback_min, round(q))] * L
    else:
        counts = [round(mx - l * (mx - mn) / (L - 1)) for l in range(L)]
    return [max(0, min(int(c), n)) for c in counts]


def _spread(B, r, cap):
    """Adds r >= 0 tokens evenly over the layers with B[l] < cap (r // U each, one more to the
    lowest r % U of them), clamps at cap, and spreads what the clamp cut off again, until
    nothing is left or every layer is at cap."""
    B = list(B)
    while r > 0:
        open_ = [l for l in range(len(B)) if B[l] < cap]
        if not open_:
            break
        each, rem = divmod(r, len(open_))
        for idx, l in enumerate(open_):
            B[l] += each + (1 if idx < rem else 0)
        r = sum(max(0, b - cap) for b in B)
        B = [min(b, cap) for b in B]
    return B


def cake_layer_budgets(P, T, cap, log_P=None):
    """CAKE prefix budget per layer (window not included).

    1. B_l = int(share_l * T) (float64, truncated), share_l = P_l / sum(P) (sum by
       math.fsum).  If sum(P) is 0 or not finite (some P_l overflowed, or all underflowed),
       share_l = exp(log P_l - max log P) / sum_j exp(log P_j - max log P) from log_P (-inf
       for P_l = 0); without log_P, or with every log P_l = -inf, every share is 1 / L.
    2. Clamp at cap (= n - w); the excess is spread evenly over the layers still below cap,
       remainder one each to the lowest such layers; repeated while a spread overflows.
    3. The truncation deficit T - sum(B) is then spread the same way (a second, separate
       pass).  (A negative deficit, only possible through floating-point pathologies, takes
       one token each from the highest layers with B_l > 0.)
    """
    L = len(P)
    P = [float(x) for x in P]
    tot = _fsum(P)
    if tot > 0.0 and math.isfinite(tot):
        share = [P[l] / tot for l in range(L)]
    elif log_P is not None and math.isfinite(max(log_P)):
        top = max(log_P)
        weight = [math.exp(x - top) for x in log_P]
        share = [x / _fsum(weight) for x in weight]
    else:
        share = [1.0 / L] * L
    B = [int(share[l] * T) for l in range(L)]
    excess = sum(max(0, b - cap) for b in B)
    B = _spread([min(b, cap) for b in B], excess, cap)
    B = _spread(B, T - sum(B), cap)
    over = sum(B) - T
    for l in reversed(range(L)):
        take = min(over, B[l])
        B[l] -= take
        over -= take
    return B


def cake_preference(H_l, V_l, tau1, tau2):
    """P_l = H_l^(1/tau1) * V_l^(1/tau2), 0 when either power is 0 (even if the other is +inf
    after overflow: SEMANTICS.md, CAKE)."""
    with np.errstate(over="ignore", under="ignore"):
        h = float(np.power(np.float64(H_l), 1.0 / tau1))
        v = float(np.power(np.float64(V_l), 1.0 / tau2))
    return 0.0 if h == 0.0 or v == 0.0 else h * v


def cake_log_preference(H_l, V_l, tau1, tau2):
    """log P_l = log(H_l) / tau1 + log(V_l) / tau2, -inf when H_l or V_l is 0: the budgets'
    shares when P_l overflows or underflows (cake_layer_budgets)."""
    if H_l <= 0.0 or V_l <= 0.0:
        return -math.inf
    return math.log(H_l) / tau1 + math.log(V_l) / tau2


def stage_two(s, eps, u, rd):
    """CriticalKV's stage-2 score rd(rd(s + eps) * u), 0 where rd(s + eps) or u is 0 (also
    when the other is +inf in KVPRESS_COMPAT: SEMANTICS.md)."""
    x = rd(s + eps)
    with np.errstate(invalid="ignore", over="ignore"):
        return rd(np.where((x == 0) | (u == 0), 0.0, x * u))


def _value_factor(values, o_proj, Hkv, G, d, dtype):
    """value_l1_factor (dtype None: EXACT) or compat_value_l1_factor (KVPRESS_COMPAT)."""
    if dtype is None:
        return value_l1_factor(values, o_proj, Hkv, G, d)
    return compat_value_l1_factor(values, o_proj, Hkv, G, d, dtype)


def baseline_plan(gt, pol, layers, n):
    """Keep plan of a baseline policy (pol["kind"] in BASELINE_KINDS); see SEMANTICS.md,
    "Baseline policies", and the module docstring for the output fields."""
    L, H, Hkv, d, D, scale, G = gt
    kind = pol["kind"]
    w = pol["window"]
    we = min(w, n)
    nx = n - we                                   # prefix [0, nx), window [nx, n)
    compat = pol["numeric_mode"] == "KVPRESS_COMPAT"
    # kvpress compute_n_kept: max(1, int(n * (1 - cr))) (KVPRESS_COMPAT with a ratio; not CAKE)
    compat_cr = compat and kind != "CAKE" and pol["compression_ratio"] is not None
    n_kept = min(budget_tokens(pol, n), n)
    if compat_cr:
        n_kept = max(1, n_kept)
    evict = n_kept < n
    uses_window = kind != "STREAMING_LLM"
    need_vo = kind in ("CRITICALKV", "CRITICAL_ADAKV")
    blocks = pol["plan_shape"] in BLOCK_SHAPES      # STREAMING_LLM, SNAPKV, ADAKV only

    scores = np.full((L, Hkv, n), np.nan)
    raw = np.full((L, Hkv, n), np.nan)
    layer_sums = np.zeros(L)
    log_sums = np.full(L, -np.inf)
    kept = np.zeros((L, Hkv, n), dtype=bool)
    selected = None

    if kind == "STREAMING_LLM":
        for l, layer in enumerate(layers):
            o_proj = _layer_inputs(l, layer, gt, n, w, False, False, need_window=False)[5]
            check_magnitudes(l, gt, pol, 0, None, None, None, o_proj, scale)
        sinks = pol["sinks"]
        s = np.ones(n)
        s[sinks:sinks + (n - n_kept)] = 0.0       # kvpress: ones, zeros on [sinks, sinks+pruned)
        keep = _top_mask(s, n_kept)
        scores[:] = s
        kept[:] = keep
        if blocks:                                # forced: the sinks; the latest blocks win
            forced = np.zeros(n, dtype=bool)
            forced[:min(sinks, n)] = True
            kept_blocks, _ = select_blocks("recency", forced, n, pol["block_size"], n_kept,
                                           pol["plan_shape"], False)
            if pol["plan_shape"] == "BLOCKS_PER_LAYER":
                kept_blocks = np.repeat(kept_blocks, L, axis=0)
            block_scores = kept_blocks.astype(np.float64)       # 1 kept, 0 evicted
    else:
        r_ratio = pol["first_stage_ratio"]
        if pol["tokens_per_head"] is not None:
            q_float = float(n_kept)
            stage1 = int(n_kept * r_ratio)
        else:
            cr = float(pol["compression_ratio"])
            q_float = n * (1.0 - cr)
            stage1 = int((1.0 - cr) * n * r_ratio)
            if compat_cr:
                stage1 = max(1, stage1)                     # criticalkv_press.py:83
            stage1 = min(stage1, n_kept)
        n_safe = int(n_kept * pol["alpha_safeguard"])
        if kind == "PYRAMIDKV":
            counts_l = pyramid_layer_counts(n, q_float, w, pol["pyramid_beta"], L,
                                            1 if compat_cr else 0)
        cake_scores = []
        for l, layer in enumerate(layers):
            q, att, lse, keys, values, o_proj, kdt = _layer_inputs(l, layer, gt, n, w, need_vo,
                                                                   need_vo)
            dt = (kdt or "f32") if compat else None      # KVPRESS_COMPAT rounding dtype
            snap_compat = compat and kind != "CAKE" and q is not None
            check_magnitudes(l, gt, pol, we, q, keys, values, o_proj,
                             1.0 / math.sqrt(d) if snap_compat else scale)
            if att is not None:
                A_exact = A = att[:, att.shape[1] - we:, :]             # used as given
            elif kind == "CAKE":                           # softmax output rounded only
                A_exact = window_attention(q, keys, scale, n, we, G, lse)
                A = round_to_dtype(A_exact, dt) if compat else A_exact
            elif compat:                                   # kvpress's SnapKV steps 1-3
                A = compat_window_attention(q, keys, n, we, G, dt)
            else:
                A = window_attention(q, keys, scale, n, we, G, lse)
            vmax = DTYPE_MAX[dt] if compat else F32_MAX
            rd = (lambda x: round_to_dtype(x, dt)) if compat else (lambda x: x)  # noqa: E731
            eps = pol["epsilon"]
            pooling, k = pol["pooling"], pol["pool_kernel"]

            if kind == "CAKE":
                a = A_exact[:, :, :nx]                                  # H_l, V_l: unrounded
                ent = max(0.0, -_fsum(a * np.log(a + 1e-10)))
                var_rows = a.var(axis=1, ddof=1) if we > 1 else np.zeros((H, nx))
                V = _fsum(var_rows)
                layer_sums[l] = cake_preference(ent, V, pol["cake_tau1"], pol["cake_tau2"])
                log_sums[l] = cake_log_preference(ent, V, pol["cake_tau1"], pol["cake_tau2"])
                x = A[:, :, :nx]                                        # eviction score
                ev = x.mean(axis=1) + pol["cake_gamma"] * (
                    x.var(axis=1, ddof=1) if we > 1 else np.zeros((H, nx)))
                pre = pool1d(ev, pooling, k).reshape(Hkv, G, nx).mean(axis=1)
                raw[l, :, :nx] = pre
                scores[l, :, :nx] = pre
                scores[l, :, nx:] = np.inf
                continue

            s, pre = snapkv_scores(A, Hkv, G, nx, pooling, k, dt)
            raw[l, :, :nx] = pre
            if blocks:                            # SNAPKV, ADAKV: no safeguard, no head budgets
                scores[l] = s
                continue
            if kind in ("SNAPKV", "PYRAMIDKV"):
                cnt = n_kept if kind == "SNAPKV" else counts_l[l]
                scores[l] = s
                for g in range(Hkv):
                    kept[l, g] = _top_mask(s[g], cnt)
            elif kind == "ADAKV":
                safe = np.stack([_top_mask(s[g], n_safe) for g in range(Hkv)])
                s2 = np.where(safe, vmax, s)
                scores[l] = s2
                kept[l] = _top_mask(s2, Hkv * n_kept, forced=safe)
            elif kind == "CRITICALKV":
                u = _value_factor(values, o_proj, Hkv, G, d, dt)
                first = np.stack([_top_mask(s[g], stage1) for g in range(Hkv)])
                s2 = np.where(first, vmax, stage_two(s, eps, u, rd))
                scores[l] = s2
                for g in range(Hkv):
                    kept[l, g] = _top_mask(s2[g], n_kept, forced=first[g])
            else:  # CRITICAL_ADAKV
                u = _value_factor(values, o_proj, Hkv, G, d, dt)
                safe = np.stack([_top_mask(s[g], n_safe) for g in range(Hkv)])
                s1 = np.where(safe, vmax, s)
                budget = _top_mask(s1, Hkv * n_kept, forced=safe).sum(axis=1)
                s2 = stage_two(s1, eps, u, rd)        # COMPAT: vmax * u may round to +inf
                for g in range(Hkv):
                    first = _top_mask(s1[g], int(int(budget[g]) * r_ratio))
                    s2[g] = np.where(first, vmax, s2[g])
                    kept[l, g] = _top_mask(s2[g], int(budget[g]), forced=first)
                scores[l] = s2

        if kind == "CAKE":
            window = np.zeros(n, dtype=bool)
            window[nx:] = True
            if n <= n_kept + w:
                kept[:] = True
            else:                                     # here n > w, so we == w and nx == n - w
                T = max(0, (n_kept - w) * L)
                budgets = cake_layer_budgets(layer_sums, T, n - w, log_sums)
                for l in range(L):
                    for g in range(Hkv):
                        kept[l, g] = _top_mask(scores[l, g], budgets[l] + we)
            selected = kept & ~window
        elif blocks:                              # the window is forced; SnapKV block sums
            forced = np.zeros(n, dtype=bool)
            forced[nx:] = True
            layer_scores = np.zeros((L, n))
            layer_scores[:, :nx] = raw[:, :, :nx].sum(axis=1)
            kept_blocks, block_scores = select_blocks(layer_scores, forced, n,
                                                      pol["block_size"], n_kept,
                                                      pol["plan_shape"], False)
        elif not evict:
            kept[:] = True

    out = {}
    if blocks:
        kept, out = block_outputs(layers, pol["plan_shape"], pol["block_size"], kept_blocks, L,
                                  Hkv, n)
        out["block_scores"] = block_scores
    if selected is None:
        selected = kept.copy()
    return {
        **out,
        "kept": kept,
        "counts": kept.sum(axis=2).astype(np.int64),
        "scores": scores,
        "raw": raw,
        "layer_sums": np.minimum(layer_sums, np.finfo(np.float64).max),
        "selected": selected,
        "quota": int(n_kept),
        "total_selected": int(selected.sum()),
    }


def kept_positions(plan, l, g):
    """Kept positions of (layer l, KV head g), ascending, as a Python list."""
    return np.flatnonzero(plan["kept"][l, g]).tolist()


# ----------------------------------------------------------------------------------------------
# CLI: case directories
# ----------------------------------------------------------------------------------------------

def gather_paged(pool, table, paged, shape):
    """The logical [heads, rows, cols] tensor of a paged reference: element (h, r, c) is
    pool.flat[offset + ids[r // bs] * block_stride + (r % bs) * slot_stride + h * head_stride
    + c * dim_stride] (the pool in C order, whatever its shape)."""
    heads, rows, cols = (int(x) for x in shape)
    bs = int(table["block_size"])
    ids = np.asarray(table["ids"], dtype=np.int64)
    r = np.arange(rows)
    row_at = ids[r // bs] * int(paged["block_stride"]) + (r % bs) * int(paged["slot_stride"])
    at = (int(paged.get("offset", 0)) + row_at[None, :, None]
          + np.arange(heads)[:, None, None] * int(paged["head_stride"])
          + np.arange(cols)[None, None, :] * int(paged["dim_stride"]))
    flat = pool.reshape(-1)
    if at.size and (at.min() < 0 or at.max() >= flat.size):
        raise ValueError("paged tensor: an element lies outside the pool")
    return flat[at]


def load_tensor(case_dir, ref, tables=None):
    """Loads a tensor reference as float64: {"file","dtype","slice_last","permute"}, or a paged
    one {"file","dtype","shape":[heads,rows,cols],"paged":{"table","offset","block_stride",
    "slot_stride","head_stride","dim_stride"}} read through tables[paged["table"]]."""
    if ref is None:
        return None
    stored = np.load(os.path.join(case_dir, ref["file"]), allow_pickle=False)
    dtype = ref["dtype"]
    if dtype == "f32":
        if stored.dtype != np.float32:
            raise ValueError(f"{ref['file']}: dtype f32 but file holds {stored.dtype}")
        arr = stored
    elif dtype == "f16":
        if stored.dtype != np.float16:
            raise ValueError(f"{ref['file']}: dtype f16 but file holds {stored.dtype}")
        arr = stored
    elif dtype == "bf16":
        if stored.dtype != np.uint16:
            raise ValueError(f"{ref['file']}: dtype bf16 but file holds {stored.dtype}")
        arr = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"{ref['file']}: unknown dtype {dtype!r}")
    if ref.get("paged") is not None:
        table = tables[int(ref["paged"]["table"])]
        return np.asarray(gather_paged(arr, table, ref["paged"], ref["shape"]), dtype=np.float64)
    if ref.get("slice_last") is not None:
        arr = arr[..., :int(ref["slice_last"])]
    if ref.get("permute") is not None:
        arr = arr.transpose([int(a) for a in ref["permute"]])
    return np.asarray(arr, dtype=np.float64)


def load_case(case_dir, name="case.json"):
    """Reads case_dir/name (case.json) and its tensors: (geometry, policy, layers, n)."""
    with open(os.path.join(case_dir, name)) as fh:
        case = json.load(fh)
    tables = [{"block_size": t["block_size"], "ids": np.asarray(t["ids"], dtype=np.int64)}
              for t in case.get("block_tables") or []]
    layers = []
    for spec in case["layers"]:
        layer = {name: load_tensor(case_dir, spec.get(name), tables)
                 for name in ("keys", "values", "o_proj", "queries", "attention", "lse")}
        # KVPRESS_COMPAT rounds window attention to the dtype the keys are stored in.
        layer["keys_dtype"] = spec["keys"]["dtype"] if spec.get("keys") else None
        for name in ("keys", "values"):                # the tables paged keys/values use
            paged = (spec.get(name) or {}).get("paged")
            if paged is not None:
                layer[f"{name}_table"] = tables[int(paged["table"])]
        layers.append(layer)
    return case["geometry"], case["policy"], layers, case["n"]


def run_case(case_dir):
    geometry, policy, layers, n = load_case(case_dir)
    plan = keep_plan(geometry, policy, layers, n)
    out = dict(plan)
    out["quota"] = np.array(plan["quota"], dtype=np.int64)
    out["total_selected"] = np.array(plan["total_selected"], dtype=np.int64)
    for key in ("new_block_table", "freed_block_ids"):   # per unit: concatenated + offsets
        if key in plan:
            out[key] = np.concatenate(plan[key]).astype(np.int64)
            out[f"{key}_offsets"] = np.cumsum([0] + [len(x) for x in plan[key]]).astype(np.int64)
    np.savez(os.path.join(case_dir, "ref_out.npz"), **out)
    return plan


def main(argv):
    if not argv:
        print(f"usage: {os.path.basename(sys.argv[0])} CASE_DIR [CASE_DIR ...]", file=sys.stderr)
        return 2
    for case_dir in argv:
        plan = run_case(case_dir)
        print(f"{case_dir}: quota={plan['quota']} total_selected={plan['total_selected']} "
              f"kept={int(plan['counts'].sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
