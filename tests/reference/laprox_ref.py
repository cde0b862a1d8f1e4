#!/usr/bin/python3
"""Float64 numpy oracle of the LaProx keep plan (policy LAPROX).

What it is
    An independent, deliberately plain implementation of the LaProx KV-cache eviction
    algorithm: per-(layer, KV head, token) scores, per-layer normalisation, one model-wide
    budget, and the resulting keep masks.  The C++ backends (CPU and CUDA) are tested against
    it: their kept sets must equal this oracle's up to swaps among near-ties.

Where it comes from
    Written only from DESIGN.md section 2 (the shared design document) and tests/reference/SEMANTICS.md (which
    is binding where DESIGN.md leaves a point open), never from the C++ code.  Everything is
    computed in float64.  It is written for obvious correctness, not speed, but is vectorised
    with numpy.  On purpose it does NOT use the Gram-matrix shortcut of DESIGN.md step 5
    (v M_h v^T with M_h = W_O^h W_O^h^T): the value factors are computed from the explicit
    n x D products v_i W_O^h, so that it shares no arithmetic trick with the C++ code.
    For EXACT_BLOCK the Frobenius norm of sum_h a_h (outer) b_h is evaluated as
    sqrt(sum_{h,h'} (a_h . a_h') (b_h . b_h')) with the explicit b_h = v_i W_O^h (a pure
    algebraic identity; the self-tests check it against the literal we x D matrix).

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
POOLINGS = ("AVG", "MAX", "NONE")

# Defaults from DESIGN.md section 2 for policy fields a caller leaves out.
POLICY_DEFAULTS = {
    "allocation": "GLOBAL_NORMALIZED",
    "indicator": "ATTENTION_X_PROJECTED_VALUE",
    "gqa_value": "MEAN_HEAD_NORM",
    "window": 32,
    "pooling": "AVG",
    "pool_kernel": 7,
    "sinks": 0,
    "min_per_head": 0,
    "head_uniform_layers": False,
    "tokens_per_head": None,
    "compression_ratio": None,
}

MAX_TOKENS_PER_HEAD = 2**31 - 1


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


def validate_policy(policy):
    """Checks a policy dict; returns a complete copy (defaults filled in)."""
    unknown = set(policy) - set(POLICY_DEFAULTS)
    if unknown:
        raise ValueError(f"policy: unknown fields {sorted(unknown)}")
    p = dict(POLICY_DEFAULTS)
    p.update(policy)
    for name, allowed in (("allocation", ALLOCATIONS), ("indicator", INDICATORS),
                          ("gqa_value", GQA_VALUES), ("pooling", POOLINGS)):
        if p[name] not in allowed:
            raise ValueError(f"policy.{name} = {p[name]!r} is not one of {allowed}")
    if p["indicator"] != "ATTENTION_X_PROJECTED_VALUE" and p["gqa_value"] != "MEAN_HEAD_NORM":
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
    keys get probability 0.  Softmax with max subtraction, or exp(logit - lse) with an lse.
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
    return np.exp(logits - lse[:, wq - we:, None])               # exp(-inf) = 0 when masked


def pool1d(x, pooling, k):
    """Pool along the last axis (SEMANTICS.md): zero padding, AVG always divides by k,
    MAX takes the max over the in-range neighbourhood |j - i| <= k // 2."""
    x = np.asarray(x, dtype=np.float64)
    if pooling == "NONE" or x.shape[-1] == 0:
        return x.copy()
    half = k // 2
    pad = [(0, 0)] * (x.ndim - 1) + [(half, half)]
    if pooling == "AVG":
        padded = np.pad(x, pad, constant_values=0.0)
        windows = np.lib.stride_tricks.sliding_window_view(padded, k, axis=-1)
        return windows.sum(axis=-1) / k
    if pooling == "MAX":
        padded = np.pad(x, pad, constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, k, axis=-1)
        return windows.max(axis=-1)
    raise ValueError(f"unknown pooling {pooling!r}")


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
        pc = pool1d(c, pooling, k)
        if indicator == "ATTENTION":
            return pc
        if indicator == "ATTENTION_X_VALUE":
            return pc * row_norm(values[:, :nx, :])
        r = np.empty((Hkv, nx))
        for g in range(Hkv):
            if gqa == "MEAN_HEAD_NORM":
                r[g] = row_norm(proj(g)).mean(axis=0)
            else:  # SUMMED_PROJECTION: ||v_i (sum_h W_O^h)||
                Wsum = sum(o_proj[:, h * d:(h + 1) * d].T for h in range(g * G, (g + 1) * G))
                r[g] = row_norm(values[g, :nx, :] @ Wsum)
        return pc * r

    x = np.empty((Hkv, nx))
    for g in range(Hkv):
        P = proj(g)                                                  # [G, nx, D]
        if gqa == "MEAN_HEAD_PRODUCT":
            a_norm = np.sqrt((Ax[g] ** 2).sum(axis=1))               # [G, nx]: ||A^h[:, i]||
            x[g] = (a_norm * row_norm(P)).mean(axis=0)
        else:  # EXACT_BLOCK: || sum_h A^h[:, i] (outer) P_h[i] ||_F, no 1/G
            # ||sum_h a_h (outer) b_h||_F^2 = sum_{h,h'} (a_h . a_h') (b_h . b_h')
            sq = np.zeros(nx)
            for a in range(G):
                for b in range(G):
                    a_dot = (Ax[g, a] * Ax[g, b]).sum(axis=0)        # [nx]: A^a[:, i] . A^b[:, i]
                    p_dot = np.einsum("nD,nD->n", P[a], P[b])        # [nx]: P_a[i] . P_b[i]
                    sq += a_dot * p_dot
            x[g] = np.sqrt(np.maximum(0.0, sq))
    return pool1d(x, pooling, k)


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


def keep_plan(geometry, policy, layers, n):
    """Computes the LaProx keep plan.

    geometry: {"L","H","Hkv","d","D","scale"}; policy: see POLICY_DEFAULTS; layers: L dicts
    with "keys" [Hkv,n,d], "values" [Hkv,n,d], "o_proj" [D,H*d], and "queries" [H,wq,d]
    (optionally "lse" [H,wq]) or "attention" [H,wq,n].  Returns a dict of numpy arrays:
    kept, counts, scores, raw, layer_sums, selected, quota, total_selected.
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
        get = lambda key: layer.get(key) if isinstance(layer, dict) else None  # noqa: E731
        q, att, lse = get("queries"), get("attention"), get("lse")
        keys, values, o_proj = get("keys"), get("values"), get("o_proj")
        if (q is None) == (att is None):
            raise ValueError(f"layers[{l}]: exactly one of queries and attention must be given")
        if lse is not None and q is None:
            raise ValueError(f"layers[{l}]: lse given without queries")
        # Every tensor that is given is checked (shape, NaN/Inf), even if this policy ignores it.
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
        if w > wq:
            raise ValueError(f"layers[{l}]: policy.window={w} > {wq} window rows given")

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
        if S == 0.0 or not math.isfinite(S):
            s = np.full((Hkv, m), 1.0 / (Hkv * m))
        elif pol["allocation"] == "GLOBAL_RAW":
            s = p
        else:
            s = p / S
        scores[l, :, se:nx] = s

    # Budget.
    B = budget_tokens(pol, n)
    q_head = max(0, min(B - f, m))
    K = L * Hkv * q_head
    r = min(pol["min_per_head"], q_head)

    candidate = np.zeros((L, Hkv, n), dtype=bool)
    candidate[:, :, se:nx] = True

    alloc = pol["allocation"]
    if alloc in ("GLOBAL_NORMALIZED", "GLOBAL_RAW"):
        selected = _reserve_per_head(scores, candidate, r)
        selected |= select_best(scores, candidate & ~selected, K - L * Hkv * r)
    elif alloc == "PER_LAYER":
        selected = _reserve_per_head(scores, candidate, r)
        for l in range(L):
            in_layer = np.zeros_like(candidate)
            in_layer[l] = candidate[l] & ~selected[l]
            selected |= select_best(scores, in_layer, Hkv * (q_head - r))
    else:  # UNIFORM
        selected = _reserve_per_head(scores, candidate, q_head)

    if pol["head_uniform_layers"]:
        T = selected.sum(axis=(1, 2))
        selected = np.zeros_like(selected)
        for l in range(L):
            for g in range(Hkv):
                quota = T[l] // Hkv + (1 if g < T[l] % Hkv else 0)
                head = np.zeros_like(candidate)
                head[l, g] = candidate[l, g]
                selected |= select_best(scores, head, int(quota))

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


def kept_positions(plan, l, g):
    """Kept positions of (layer l, KV head g), ascending, as a Python list."""
    return np.flatnonzero(plan["kept"][l, g]).tolist()


# ----------------------------------------------------------------------------------------------
# CLI: case directories
# ----------------------------------------------------------------------------------------------

def load_tensor(case_dir, ref):
    """Loads a tensor reference {"file","dtype","slice_last","permute"} as float64."""
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
    if ref.get("slice_last") is not None:
        arr = arr[..., :int(ref["slice_last"])]
    if ref.get("permute") is not None:
        arr = arr.transpose([int(a) for a in ref["permute"]])
    return np.asarray(arr, dtype=np.float64)


def load_case(case_dir):
    with open(os.path.join(case_dir, "case.json")) as fh:
        case = json.load(fh)
    layers = []
    for spec in case["layers"]:
        layers.append({name: load_tensor(case_dir, spec.get(name))
                       for name in ("keys", "values", "o_proj", "queries", "attention", "lse")})
    return case["geometry"], case["policy"], layers, case["n"]


def run_case(case_dir):
    geometry, policy, layers, n = load_case(case_dir)
    plan = keep_plan(geometry, policy, layers, n)
    out = dict(plan)
    out["quota"] = np.array(plan["quota"], dtype=np.int64)
    out["total_selected"] = np.array(plan["total_selected"], dtype=np.int64)
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
