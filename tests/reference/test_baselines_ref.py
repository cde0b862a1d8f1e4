"""Self-tests of the baseline policies of the float64 oracle (laprox_ref.py).

Run from the repository root:
    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'

Needs only numpy and the standard library.  Small cases are worked out by hand (arithmetic in
the comments); random cases are checked against a second, loop-based formulation (`bf_plan`)
that uses Python lists and sorted() with explicit tie keys.
"""

import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import laprox_ref as ref  # noqa: E402


def geo(L=1, H=1, Hkv=1, d=1, D=1, scale=1.0):
    return {"L": L, "H": H, "Hkv": Hkv, "d": d, "D": D, "scale": scale}


def kept_sets(plan):
    L, Hkv, _ = plan["kept"].shape
    return [[ref.kept_positions(plan, l, g) for g in range(Hkv)] for l in range(L)]


def att_layer(attention, values=None, o_proj=None, keys_dtype=None):
    """A layer given by its window attention [H, wq, n]; values [Hkv, n] (d = 1) or None."""
    v = None
    if values is not None:
        v = np.asarray(values, dtype=np.float64)
        if v.ndim == 2:
            v = v[:, :, None]
    return {"attention": np.asarray(attention, dtype=np.float64), "values": v,
            "o_proj": None if o_proj is None else np.asarray(o_proj, dtype=np.float64),
            "keys_dtype": keys_dtype}


def random_layers(rng, L, H, Hkv, d, D, n, wq, logit_scale=3.0):
    return [{"keys": rng.standard_normal((Hkv, n, d)),
             "values": rng.standard_normal((Hkv, n, d)),
             "o_proj": rng.standard_normal((D, H * d)),
             "queries": logit_scale * rng.standard_normal((H, wq, d))} for _ in range(L)]


# --------------------------------------------------------------------------------------------
# Second formulation: loops and sorted() with explicit keys.
# --------------------------------------------------------------------------------------------

def loop_attention(q, k, scale, n, we):
    """Per-row causal softmax with Python floats. q [wq, d] (last we rows), k [n, d]."""
    wq = q.shape[0]
    A = [[0.0] * n for _ in range(we)]
    for t in range(we):
        pos = n - we + t
        z = [scale * sum(float(a) * float(b) for a, b in zip(q[wq - we + t], k[j]))
             for j in range(pos + 1)]
        mx = max(z)
        e = [math.exp(x - mx) for x in z]
        tot = sum(e)
        for j in range(pos + 1):
            A[t][j] = e[j] / tot
    return A


def R(x, dtype):
    """One value rounded to dtype (KVPRESS_COMPAT's r); dtype None: unchanged."""
    return x if dtype is None else float(ref.round_to_dtype(np.array(float(x)), dtype))


def loop_attention_compat(q, k, n, we, dtype):
    """kvpress's SnapKV window attention with Python floats: z = r(r(q . k) / sqrt(d)),
    causal softmax, r(p).  q [wq, d] (last we rows), k [n, d]."""
    wq, d = q.shape
    A = [[0.0] * n for _ in range(we)]
    for t in range(we):
        pos = n - we + t
        z = [R(R(sum(float(a) * float(b) for a, b in zip(q[wq - we + t], k[j])), dtype) /
               math.sqrt(d), dtype) for j in range(pos + 1)]
        mx = max(z)
        e = [math.exp(x - mx) for x in z]
        tot = sum(e)
        for j in range(pos + 1):
            A[t][j] = R(e[j] / tot, dtype)
    return A


def bf_pool(x, k):
    half = k // 2
    return [sum(x[j] for j in range(i - half, i + half + 1) if 0 <= j < len(x)) / k
            for i in range(len(x))]


def bf_top(score, k, forced=()):
    forced = set(forced)
    order = sorted(range(len(score)), key=lambda i: (i not in forced, -score[i], i))
    return set(order[:max(0, k)])


def bf_top_layer(score, k, forced=()):
    forced = set(forced)
    items = [(g, i) for g in range(len(score)) for i in range(len(score[g]))]
    order = sorted(items, key=lambda gi: (gi not in forced, -score[gi[0]][gi[1]], gi[0], gi[1]))
    return set(order[:max(0, k)])


def bf_plan(geometry, policy, layers, n):
    """By loops: kept sets [L][Hkv] (sorted lists), CAKE's P_l, and the prefix scores
    [L][Hkv][n - we] (SnapKV or CAKE eviction score).  AVG pooling only.  KVPRESS_COMPAT
    (from the spec in SEMANTICS.md): every rounding point by R, max(1, ...) budgets."""
    L, H, Hkv, d = geometry["L"], geometry["H"], geometry["Hkv"], geometry["d"]
    G = H // Hkv
    kind = policy["kind"]
    w = policy["window"]
    k = policy["pool_kernel"]
    we = min(w, n)
    nx = n - we
    compat = policy.get("numeric_mode") == "KVPRESS_COMPAT"
    compat_cr = compat and kind != "CAKE" and policy.get("tokens_per_head") is None
    if policy.get("tokens_per_head") is not None:
        n_kept = min(policy["tokens_per_head"], n)
        c1 = int(n_kept * policy.get("first_stage_ratio", 0.5))
        q_float = float(n_kept)
    else:
        cr = policy["compression_ratio"]
        n_kept = int((1.0 - cr) * n)
        c1 = int((1.0 - cr) * n * policy.get("first_stage_ratio", 0.5))
        q_float = n * (1.0 - cr)
        if compat_cr:
            n_kept = max(1, n_kept)
            c1 = max(1, c1) if kind == "CRITICALKV" else c1
    alpha = policy.get("alpha_safeguard", 0.2)
    eps = policy.get("epsilon", 1e-4)
    n_safe = int(n_kept * alpha)
    out, P = [], []
    cake_pre, snap_pre = [], []
    for l, layer in enumerate(layers):
        dt = (layer.get("keys_dtype") or "f32") if compat else None
        BIG = ref.DTYPE_MAX[dt] if compat else ref.F32_MAX
        if compat and kind != "CAKE":
            A = [loop_attention_compat(layer["queries"][h], layer["keys"][h // G], n, we, dt)
                 for h in range(H)]
        else:
            A = [loop_attention(layer["queries"][h], layer["keys"][h // G], geometry["scale"],
                                n, we) for h in range(H)]
        A_exact = A
        if compat and kind == "CAKE":                       # CAKE: the softmax output only
            A = [ref.round_to_dtype(np.array(a), dt).tolist() for a in A]
        if kind == "CAKE":
            ent, var = 0.0, 0.0
            pre_h = []
            for h in range(H):
                ev = []
                for j in range(nx):
                    col = [A_exact[h][t][j] for t in range(we)]
                    ent -= sum(a * math.log(a + 1e-10) for a in col)
                    var += statistics.variance(col)
                    colr = [A[h][t][j] for t in range(we)]
                    ev.append(statistics.fmean(colr) +
                              policy.get("cake_gamma", 200.0) * statistics.variance(colr))
                pre_h.append(bf_pool(ev, k))
            P.append(max(ent, 0.0) ** (1 / policy.get("cake_tau1", 1.6)) *
                     var ** (1 / policy.get("cake_tau2", 0.6)))
            cake_pre.append([[sum(pre_h[g * G + j][i] for j in range(G)) / G for i in range(nx)]
                             for g in range(Hkv)])
            continue
        pooled = [[R(x, dt) for x in bf_pool([R(sum(A[h][t][i] for t in range(we)) / we, dt)
                                               for i in range(nx)], k)] for h in range(H)]
        s = [[R(sum(pooled[g * G + j][i] for j in range(G)) / G, dt) for i in range(nx)]
             for g in range(Hkv)]
        snap_pre.append(s)
        M = max((x for row in s for x in row), default=0.0)
        s = [row + [R(M + 1.0, dt)] * we for row in s]
        u = None
        if kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            u = [[0.0] * n for _ in range(Hkv)]
            for g in range(Hkv):
                for i in range(n):
                    tot = 0.0
                    for j in range(G):
                        h = g * G + j
                        vo = [sum(float(layer["o_proj"][D_, h * d + c]) *
                                  float(layer["values"][g, i, c]) for c in range(d))
                              for D_ in range(layer["o_proj"].shape[0])]
                        tot += R(sum(abs(R(x, dt)) for x in vo), dt)
                    u[g][i] = R(tot / G, dt)
        heads = []
        if kind == "SNAPKV":
            heads = [bf_top(s[g], n_kept) for g in range(Hkv)]
        elif kind == "PYRAMIDKV":
            cnt = ref.pyramid_layer_counts(n, q_float, w, policy.get("pyramid_beta", 20.0), L,
                                           1 if compat_cr else 0)[l]
            heads = [bf_top(s[g], cnt) for g in range(Hkv)]
        elif kind == "ADAKV":
            safe = {(g, i) for g in range(Hkv) for i in bf_top(s[g], n_safe)}
            chosen = bf_top_layer(s, Hkv * n_kept, forced=safe)
            heads = [{i for (gg, i) in chosen if gg == g} for g in range(Hkv)]
        elif kind == "CRITICALKV":
            for g in range(Hkv):
                first = bf_top(s[g], c1)
                s2 = [R(R(s[g][i] + eps, dt) * u[g][i], dt) for i in range(n)]
                heads.append(bf_top(s2, n_kept, forced=first))
        else:  # CRITICAL_ADAKV
            safe = {(g, i) for g in range(Hkv) for i in bf_top(s[g], n_safe)}
            s1 = [[BIG if (g, i) in safe else s[g][i] for i in range(n)] for g in range(Hkv)]
            chosen = bf_top_layer(s1, Hkv * n_kept, forced=safe)
            for g in range(Hkv):
                budget = sum(1 for (gg, _) in chosen if gg == g)
                first = bf_top(s1[g], int(budget * policy.get("first_stage_ratio", 0.5)))
                s2 = [R(R(s1[g][i] + eps, dt) * u[g][i], dt) for i in range(n)]
                heads.append(bf_top(s2, budget, forced=first))
        if n_kept >= n:
            heads = [set(range(n))] * Hkv
        out.append([sorted(x) for x in heads])
    if kind == "CAKE":
        if n <= n_kept + w:
            return [[list(range(n))] * Hkv for _ in range(L)], P, cake_pre
        budgets = ref.cake_layer_budgets(P, max(0, (n_kept - w) * L), n - w)
        out = [[sorted(bf_top(cake_pre[l][g], budgets[l]) | set(range(nx, n)))
                for g in range(Hkv)] for l in range(L)]
        return out, P, cake_pre
    return out, P, snap_pre


# --------------------------------------------------------------------------------------------

class Budgets(unittest.TestCase):

    def test_truncation_cr09_n1000(self):
        self.assertEqual(int((1.0 - 0.9) * 1000), 99)       # 0.09999999999999998 * 1000
        p = ref.keep_plan(geo(L=2, Hkv=1), {"kind": "STREAMING_LLM", "compression_ratio": 0.9},
                          [{}, {}], 1000)
        self.assertEqual(p["counts"].tolist(), [[99], [99]])
        self.assertEqual(p["quota"], 99)
        self.assertEqual(kept_sets(p)[0][0], list(range(4)) + list(range(905, 1000)))
        att = np.random.default_rng(0).random((1, 64, 1000))
        for kind in ("SNAPKV", "ADAKV"):
            p = ref.keep_plan(geo(), {"kind": kind, "compression_ratio": 0.9},
                              [att_layer(att)], 1000)
            self.assertEqual(p["counts"].tolist(), [[99]], kind)

    def test_defaults_per_kind(self):
        for kind, (w, k, sinks, pooling) in (
                ("LAPROX", (32, 31, 0, "AVG_PEAK")), ("STREAMING_LLM", (32, 7, 4, "AVG")),
                ("SNAPKV", (64, 5, 0, "AVG")), ("PYRAMIDKV", (64, 5, 0, "AVG")),
                ("ADAKV", (64, 5, 0, "AVG")), ("CRITICALKV", (64, 5, 0, "AVG")),
                ("CRITICAL_ADAKV", (64, 5, 0, "AVG")), ("CAKE", (32, 5, 0, "AVG"))):
            p = ref.validate_policy({"kind": kind, "tokens_per_head": 1})
            self.assertEqual((p["window"], p["pool_kernel"], p["sinks"], p["pooling"]),
                             (w, k, sinks, pooling), kind)
            self.assertEqual((p["numeric_mode"], p["pyramid_beta"], p["alpha_safeguard"],
                              p["epsilon"], p["first_stage_ratio"], p["cake_tau1"],
                              p["cake_tau2"], p["cake_gamma"]),
                             ("EXACT", 20.0, 0.2, 1e-4, 0.5, 1.6, 0.6, 200.0))
            if kind != "LAPROX":  # an unset gqa_value never becomes LAPROX's default
                self.assertEqual(p["gqa_value"], "MEAN_HEAD_NORM", kind)
        self.assertEqual(ref.validate_policy({"tokens_per_head": 1})["kind"], "LAPROX")


class StreamingLLM(unittest.TestCase):

    def run_(self, B, sinks=None, n=10, L=2, Hkv=2):
        P = {"kind": "STREAMING_LLM", "tokens_per_head": B}
        if sinks is not None:
            P["sinks"] = sinks
        return ref.keep_plan(geo(L=L, H=Hkv, Hkv=Hkv), P, [{}] * L, n)

    def test_hand(self):
        cases = {6: [0, 1, 2, 3, 8, 9], 5: [0, 1, 2, 3, 9], 4: [0, 1, 2, 3], 2: [0, 1],
                 0: [], 10: list(range(10)), 12: list(range(10))}
        for B, want in cases.items():
            p = self.run_(B)
            self.assertEqual(kept_sets(p), [[want, want], [want, want]], B)
        self.assertEqual(kept_sets(self.run_(3, sinks=0))[0][0], [7, 8, 9])
        self.assertEqual(kept_sets(self.run_(3, sinks=20))[0][0], [0, 1, 2])

    def test_scores(self):
        p = self.run_(6)
        np.testing.assert_array_equal(p["scores"][1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 1, 1])
        self.assertTrue(np.all(np.isnan(p["raw"])))
        self.assertEqual(p["total_selected"], 2 * 2 * 6)

    def test_given_tensors_are_checked(self):
        layer = {"queries": np.ones((1, 2, 1)), "keys": np.ones((1, 10, 1))}
        p = ref.keep_plan(geo(), {"kind": "STREAMING_LLM", "tokens_per_head": 6, "window": 64},
                          [layer], 10)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 8, 9]]])
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), {"kind": "STREAMING_LLM", "tokens_per_head": 6},
                          [{"queries": np.ones((1, 2, 1))}], 10)       # keys missing


class SnapKV(unittest.TestCase):
    """H=2, Hkv=1, window 2 given as attention, n=6, prefix [0, 4).

    Head 0 rows [.1 .2 .3 .4] and [.3 .2 .1 0] -> row mean [.2 .2 .2 .2]; head 1 rows
    [0 .4 0 .2] and [.2 0 .2 .2] -> [.1 .2 .1 .2].  No pooling: group mean [.15 .2 .15 .2],
    window = .2 + 1.  AVG k=3 (zero padded, / 3): head 0 [.4 .6 .6 .4]/3, head 1 [.3 .4 .5 .3]/3,
    group mean [.35 .5 .55 .35]/3.
    """

    att = [[[.1, .2, .3, .4, 0, 0], [.3, .2, .1, 0, .2, .2]],
           [[0, .4, 0, .2, 0, 0], [.2, 0, .2, .2, .2, .2]]]

    def plan(self, B, pooling="NONE", kind="SNAPKV"):
        return ref.keep_plan(geo(H=2), {"kind": kind, "window": 2, "pooling": pooling,
                                        "pool_kernel": 3, "tokens_per_head": B},
                             [att_layer(self.att)], 6)

    def test_no_pooling(self):
        p = self.plan(4)
        np.testing.assert_allclose(p["scores"][0, 0], [.15, .2, .15, .2, 1.2, 1.2], rtol=1e-14)
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.15, .2, .15, .2], rtol=1e-14)
        self.assertTrue(np.all(np.isnan(p["raw"][0, 0, 4:])))
        self.assertEqual(kept_sets(p), [[[1, 3, 4, 5]]])
        self.assertEqual(kept_sets(self.plan(3)), [[[1, 4, 5]]])
        self.assertEqual(kept_sets(self.plan(1)), [[[4]]])        # sentinel tie: earliest
        self.assertEqual(kept_sets(self.plan(5)), [[[0, 1, 3, 4, 5]]])   # .15 tie: 0 before 2
        self.assertEqual(kept_sets(self.plan(0)), [[[]]])
        self.assertEqual(kept_sets(self.plan(6)), [[list(range(6))]])

    def test_avg_pooling(self):
        p = self.plan(3, pooling="AVG")
        np.testing.assert_allclose(p["raw"][0, 0, :4], np.array([.35, .5, .55, .35]) / 3,
                                   rtol=1e-14)
        self.assertAlmostEqual(p["scores"][0, 0, 4], .55 / 3 + 1, places=14)
        self.assertEqual(kept_sets(p), [[[2, 4, 5]]])
        self.assertEqual(kept_sets(self.plan(4, pooling="AVG")), [[[1, 2, 4, 5]]])
        self.assertEqual(kept_sets(self.plan(5, pooling="AVG")), [[[0, 1, 2, 4, 5]]])

    def test_sentinel_is_layer_max_over_heads(self):
        # Hkv=2 (G=1): head 0 prefix max .4, head 1 max .9 -> both windows get 1.9.
        att = [[[.1, .4, .3, 0]], [[.9, .2, .1, .5]]]
        p = ref.keep_plan(geo(H=2, Hkv=2), {"kind": "SNAPKV", "window": 1, "pooling": "NONE",
                                            "tokens_per_head": 2}, [att_layer(att)], 4)
        np.testing.assert_allclose(p["scores"][0, :, 3], [1.9, 1.9])
        self.assertEqual(kept_sets(p), [[[1, 3], [0, 3]]])

    def test_n_at_most_window(self):
        # n=5 <= w=64: every position is a window position with the sentinel 1.0 (no prefix).
        att = np.random.default_rng(3).random((1, 64, 5))
        p = ref.keep_plan(geo(), {"kind": "SNAPKV", "tokens_per_head": 3}, [att_layer(att)], 5)
        self.assertEqual(kept_sets(p), [[[0, 1, 2]]])
        np.testing.assert_array_equal(p["scores"][0, 0], [1.0] * 5)
        self.assertTrue(np.all(np.isnan(p["raw"])))

    def test_window_gt_rows_is_rejected(self):
        with self.assertRaises(ValueError):                   # default window 64 > wq = 2
            ref.keep_plan(geo(H=2), {"kind": "SNAPKV", "tokens_per_head": 3},
                          [att_layer(self.att)], 6)


class PyramidKV(unittest.TestCase):

    def test_counts_branches(self):
        c = ref.pyramid_layer_counts
        # no clamp: min = 2000/20 = 100, max = 4000 - 100 = 3900 < 4000 - 64; step 1900
        self.assertEqual(c(4000, 2000.0, 64, 20.0, 3), [3900, 2000, 100])
        # clamp: min 110, max 4290 >= 3936 -> max 3936, min 4400 - 3936 = 464
        self.assertEqual(c(4000, 2200.0, 64, 20.0, 3), [3936, 2200, 464])
        # clamp, then min 7900 - 3936 = 3964 > max: fallback round(q)
        self.assertEqual(c(4000, 3950.0, 64, 20.0, 3), [3950] * 3)
        # fallback: no clamp (max 1950 < 3936) and min = 50 < w
        self.assertEqual(c(4000, 1000.0, 64, 20.0, 3), [1000] * 3)
        # min = 25 < w, but the clamp comes first: max 975 -> 936, min 1000 - 936 = 64 = w
        self.assertEqual(c(1000, 500.0, 64, 20.0, 3), [936, 500, 64])
        # round half to even: min 100.5, max 3919.5 -> 3920, 2010, 100
        self.assertEqual(c(4000, 2010.0, 64, 20.0, 3), [3920, 2010, 100])
        # fallback rounding: q = 1006 * .25 = 251.5 -> 252 (even); 250.5 -> 250
        self.assertEqual(c(1006, 1006 * (1.0 - 0.75), 64, 20.0, 2), [252, 252])
        self.assertEqual(c(1002, 1002 * (1.0 - 0.75), 64, 20.0, 2), [250, 250])
        # L = 1: round(q) even where the pyramid branch would apply
        self.assertEqual(c(4000, 2000.0, 64, 20.0, 1), [2000])
        # q = 0 (n_kept 0) and n <= w fall back
        self.assertEqual(c(100, 0.0, 64, 20.0, 2), [0, 0])
        self.assertEqual(c(10, 5.0, 64, 20.0, 2), [5, 5])

    def test_end_to_end(self):
        # n=20, w=2, beta=2, B=8: cap 10, min 4, max 12 -> layers keep 12, 8, 4.
        rng = np.random.default_rng(4)
        g = geo(L=3, H=2, Hkv=2, d=3, D=2, scale=0.5)
        layers = random_layers(rng, 3, 2, 2, 3, 2, 20, 4)
        P = {"kind": "PYRAMIDKV", "window": 2, "pool_kernel": 3, "pyramid_beta": 2.0,
             "tokens_per_head": 8}
        p = ref.keep_plan(g, P, layers, 20)
        self.assertEqual(p["counts"].tolist(), [[12, 12], [8, 8], [4, 4]])
        self.assertTrue(np.all(p["kept"][:, :, 18:]))                  # window kept
        snap = ref.keep_plan(g, dict(P, kind="SNAPKV"), layers, 20)
        np.testing.assert_array_equal(p["scores"], snap["scores"])
        self.assertEqual(p["quota"], 8)

    def test_fallback_uses_round_not_int(self):
        att = np.random.default_rng(5).random((1, 64, 1006))
        p = ref.keep_plan(geo(L=2), {"kind": "PYRAMIDKV", "compression_ratio": 0.75},
                          [att_layer(att)] * 2, 1006)
        self.assertEqual(p["counts"].tolist(), [[252], [252]])
        s = ref.keep_plan(geo(L=2), {"kind": "SNAPKV", "compression_ratio": 0.75},
                          [att_layer(att)] * 2, 1006)
        self.assertEqual(s["counts"].tolist(), [[251], [251]])


class AdaKV(unittest.TestCase):
    """n=40, w=1, Hkv=H=2, B=15: n_kept 15, n_safe = int(15 * .2) = 3, 30 layer slots.

    Head 0 prefix scores 1 + .01 i (strong), head 1 .001 (i + 1) (weak), no pooling.
    Safeguard: each head's window (39) and prefix 38, 37.  The other 24 slots go to head 0's
    prefix 36 .. 13.  Head 0 keeps 13..39 (27), head 1 keeps 37, 38, 39 (3).
    Without the safeguard (alpha 0): 2 windows + head 0's 38..11 -> 29 and 1.
    """

    def setUp(self):
        i = np.arange(40)
        self.att = np.stack([(1 + .01 * i)[None], (.001 * (i + 1))[None]])   # [2, 1, 40]

    def plan(self, **kw):
        P = {"kind": "ADAKV", "window": 1, "pooling": "NONE", "tokens_per_head": 15}
        P.update(kw)
        return ref.keep_plan(geo(H=2, Hkv=2), P, [att_layer(self.att, keys_dtype="bf16")], 40)

    def test_safeguard(self):
        p = self.plan()
        self.assertEqual(kept_sets(p), [[list(range(13, 40)), [37, 38, 39]]])
        self.assertEqual(p["counts"].tolist(), [[27, 3]])
        self.assertEqual(p["scores"][0, 1, 38], ref.F32_MAX)
        self.assertAlmostEqual(p["scores"][0, 1, 36], .037, places=15)
        p = self.plan(alpha_safeguard=0.0)
        self.assertEqual(kept_sets(p), [[list(range(11, 40)), [39]]])

    def test_compat_dtype_max(self):
        p = self.plan(numeric_mode="KVPRESS_COMPAT")
        self.assertEqual(p["scores"][0, 1, 38], ref.BF16_MAX)
        self.assertEqual(kept_sets(p), [[list(range(13, 40)), [37, 38, 39]]])

    def test_ties_across_heads(self):
        # equal scores everywhere: windows first, then head 0's prefix 0..3 (head, position).
        att = np.full((2, 1, 6), .5)
        p = ref.keep_plan(geo(H=2, Hkv=2), {"kind": "ADAKV", "window": 1, "pooling": "NONE",
                                            "alpha_safeguard": 0.0, "tokens_per_head": 3},
                          [att_layer(att)], 6)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 5], [5]]])


class CriticalKV(unittest.TestCase):
    """H=Hkv=1, d=D=1, o_proj [[2]] so u = 2|v|; n=12, window 4 (positions 8..11), no pooling.

    Prefix means [.1 .05 .2 .05 .05 .05 .05 .3] -> sentinel 1.3.  v = 1 on the prefix except
    v2 = 50; window v = [1, 1, 0, 0].  B=4: stage 1 = int(4 * .5) = 2 < w: the window's earliest
    two (8, 9).  Stage 2 by (s + 1e-4) u: pos 2 .2001 * 100, pos 7 .3001 * 2, pos 0 .1001 * 2,
    windows 10, 11: 1.3001 * 0 -> kept 2, 7, 8, 9: window tokens 10 and 11 lose.
    """

    def setUp(self):
        row = np.array([.1, .05, .2, .05, .05, .05, .05, .3, .9, .9, .9, .9])
        self.att = np.tile(row, (1, 4, 1))
        self.values = [[1, 1, 50, 1, 1, 1, 1, 1, 1, 1, 0, 0]]

    def plan(self, **kw):
        P = {"kind": "CRITICALKV", "window": 4, "pooling": "NONE", "tokens_per_head": 4}
        P.update(kw)
        return ref.keep_plan(geo(), P, [att_layer(self.att, self.values, [[2.0]])], 12)

    def test_window_can_lose(self):
        p = self.plan()
        self.assertEqual(kept_sets(p), [[[2, 7, 8, 9]]])
        np.testing.assert_allclose(p["scores"][0, 0, [0, 2, 7, 10]],
                                   [.1001 * 2, .2001 * 100, .3001 * 2, 0.0], rtol=1e-14)
        self.assertEqual(p["scores"][0, 0, 8], ref.F32_MAX)

    def test_stage1_covers_window(self):
        self.assertEqual(kept_sets(self.plan(first_stage_ratio=1.0)), [[[8, 9, 10, 11]]])
        # B=8: stage 1 = 4 = w; then 2, 7, 0 and the .1002 tie at 1, 3, 4, 5, 6 -> 1
        self.assertEqual(kept_sets(self.plan(tokens_per_head=8)),
                         [[[0, 1, 2, 7, 8, 9, 10, 11]]])

    def test_needs_values(self):
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), {"kind": "CRITICALKV", "window": 4, "tokens_per_head": 4},
                          [att_layer(self.att)], 12)

    def test_value_factor_l1(self):
        rng = np.random.default_rng(6)
        v, o = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 12))
        u = ref.value_l1_factor(v, o, 2, 2, 3)
        for g in range(2):
            for i in range(5):
                want = np.mean([np.abs(o[:, h * 3:(h + 1) * 3] @ v[g, i]).sum()
                                for h in (2 * g, 2 * g + 1)])
                self.assertAlmostEqual(u[g, i], want, places=12)

    def test_critical_adakv_hkv1_equals_criticalkv(self):
        rng = np.random.default_rng(7)
        g = geo(L=2, H=3, Hkv=1, d=2, D=4, scale=0.6)
        layers = random_layers(rng, 2, 3, 1, 2, 4, 30, 6)
        for B in (3, 7, 12, 29):
            P = {"window": 5, "pool_kernel": 3, "tokens_per_head": B}
            a = ref.keep_plan(g, dict(P, kind="CRITICALKV"), layers, 30)
            b = ref.keep_plan(g, dict(P, kind="CRITICAL_ADAKV"), layers, 30)
            np.testing.assert_array_equal(a["kept"], b["kept"], err_msg=str(B))

    def test_critical_adakv_budgets(self):
        rng = np.random.default_rng(8)
        g = geo(L=1, H=4, Hkv=4, d=2, D=3, scale=1.0)
        layers = random_layers(rng, 1, 4, 4, 2, 3, 40, 4, logit_scale=4.0)
        for B in (5, 10, 20):
            P = {"window": 4, "pool_kernel": 3, "tokens_per_head": B}
            ada = ref.keep_plan(g, dict(P, kind="ADAKV"), layers, 40)
            cad = ref.keep_plan(g, dict(P, kind="CRITICAL_ADAKV"), layers, 40)
            # same per-head budgets (the ADAKV counts), possibly different tokens
            np.testing.assert_array_equal(cad["counts"], ada["counts"])
            self.assertEqual(int(cad["counts"].sum()), 4 * B)
            self.assertTrue(np.all(cad["counts"] >= int(B * 0.2)))


class Cake(unittest.TestCase):

    def test_budget_hand_cases(self):
        b = ref.cake_layer_budgets
        self.assertEqual(b([1, 1, 2], 10, 100), [3, 2, 5])     # 2, 2, 5 + deficit 1 to layer 0
        self.assertEqual(b([1, 1, 8], 30, 12), [9, 9, 12])     # 24 -> 12, +6 +6
        self.assertEqual(b([1, 3, 6], 30, 10), [10, 10, 10])   # 3 9 18 -> 7 13 10 -> 10 10 10
        self.assertEqual(b([1, 1, 1, 7], 20, 10), [4, 3, 3, 10])   # excess 4: 1 each + 1 to 0
        # excess 1 (5 -> 4) spread first -> 3 2 4, then deficit 1 separately -> 4 2 4
        self.assertEqual(b([1, 1, 2.5], 10, 4), [4, 2, 4])
        self.assertEqual(b([0, 0, 0], 7, 10), [3, 2, 2])       # sum(P) = 0: uniform
        self.assertEqual(b([1, 2], 0, 10), [0, 0])
        self.assertEqual(b([5.0], 7, 10), [7])                 # L = 1

    def test_budget_sums_random(self):
        rng = np.random.default_rng(9)
        for _ in range(300):
            L = int(rng.integers(1, 8))
            cap = int(rng.integers(1, 50))
            T = int(rng.integers(0, L * cap + 1))
            P = (rng.random(L) ** 4).tolist()
            B = ref.cake_layer_budgets(P, T, cap)
            self.assertEqual(sum(B), T)
            self.assertTrue(all(0 <= x <= cap for x in B), (P, T, cap, B))

    def test_end_to_end(self):
        rng = np.random.default_rng(10)
        L, H, Hkv, n, w = 4, 4, 2, 40, 6
        g = geo(L=L, H=H, Hkv=Hkv, d=3, D=2, scale=0.7)
        layers = random_layers(rng, L, H, Hkv, 3, 2, n, 8)
        P = {"kind": "CAKE", "window": w, "pool_kernel": 3, "tokens_per_head": 16}
        p = ref.keep_plan(g, P, layers, n)
        T = (16 - w) * L
        self.assertEqual(int(p["selected"].sum()), Hkv * T)
        self.assertEqual(p["total_selected"], Hkv * T)
        self.assertEqual(int(p["counts"][:, 0].sum()), T + L * w)
        np.testing.assert_array_equal(p["counts"][:, 0], p["counts"][:, 1])
        self.assertTrue(np.all(p["kept"][:, :, n - w:]))
        self.assertTrue(np.all(p["scores"][:, :, n - w:] == np.inf))
        self.assertTrue(np.all(p["layer_sums"] > 0))
        budgets = ref.cake_layer_budgets(p["layer_sums"], T, n - w)
        self.assertEqual((p["counts"][:, 0] - w).tolist(), budgets)

    def test_no_compression_and_small_budget(self):
        rng = np.random.default_rng(11)
        g = geo(L=2, H=2, Hkv=1, d=2, D=2)
        layers = random_layers(rng, 2, 2, 1, 2, 2, 20, 6)
        P = {"kind": "CAKE", "window": 6, "pool_kernel": 3}
        for B in (14, 15, 40):                                 # n <= B + w
            self.assertTrue(np.all(ref.keep_plan(g, dict(P, tokens_per_head=B), layers,
                                                 20)["kept"]))
        for B in (0, 3, 6):                                    # n_kept <= w: window only
            p = ref.keep_plan(g, dict(P, tokens_per_head=B), layers, 20)
            self.assertEqual(kept_sets(p), [[list(range(14, 20))]] * 2)
        p = ref.keep_plan(g, dict(P, tokens_per_head=13), layers, 20)   # T = 14 = 2 * (20 - 6) - 14
        self.assertEqual(int(p["counts"].sum()), 13 * 2)

    def test_window_one_variance_zero(self):
        att = np.random.default_rng(12).random((2, 1, 10))
        p = ref.keep_plan(geo(L=2), {"kind": "CAKE", "window": 1, "pooling": "NONE",
                                     "tokens_per_head": 4}, [att_layer(att[:1]),
                                                             att_layer(att[1:])], 10)
        np.testing.assert_array_equal(p["layer_sums"], [0.0, 0.0])   # V = 0
        self.assertEqual(p["counts"].tolist(), [[4], [4]])          # uniform split of T = 6
        np.testing.assert_allclose(p["raw"][0, 0, :9], att[0, 0, :9], rtol=1e-15)


class NumericMode(unittest.TestCase):

    def test_round_to_dtype_f16_matches_numpy(self):
        rng = np.random.default_rng(13)
        x = np.concatenate([rng.random(20000), rng.random(2000) * 1e-5, rng.random(500) * 1e-7,
                            -rng.random(100) * 70000, [0.0, 1.0, 65504.0, 65519.0, 65520.0]])
        # exact halfway points of f16 (11 significant bits) around 1 and in the subnormals
        x = np.concatenate([x, 1 + (2 * np.arange(50) + 1) * 2.0**-11,
                            (2 * np.arange(50) + 1) * 2.0**-25])
        got = ref.round_to_dtype(x, "f16")
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float64))

    def test_round_to_dtype_bf16(self):
        def bits_rne(x32):
            b = x32.view(np.uint32).astype(np.uint64)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            return b.astype(np.uint32).view(np.float32).astype(np.float64)
        rng = np.random.default_rng(14)
        x32 = np.concatenate([rng.random(20000), rng.random(1000) * 1e-38,
                              rng.standard_normal(1000) * 1e30]).astype(np.float32)
        np.testing.assert_array_equal(ref.round_to_dtype(x32.astype(np.float64), "bf16"),
                                      bits_rne(x32))
        # ties to even at 1 + 2^-8 (down to 1) and 1 + 3 * 2^-8 (up to 1 + 2^-6)
        np.testing.assert_array_equal(ref.round_to_dtype([1 + 2.0**-8, 1 + 3 * 2.0**-8], "bf16"),
                                      [1.0, 1 + 2.0**-6])
        # a float64 just above a bf16 halfway point rounds up (no float32 double rounding)
        self.assertEqual(ref.round_to_dtype([1 + 2.0**-8 + 2.0**-40], "bf16")[0], 1 + 2.0**-7)
        self.assertEqual(ref.round_to_dtype([ref.BF16_MAX * 1.01], "bf16")[0], np.inf)
        x = np.array([.1, .2])
        np.testing.assert_array_equal(ref.round_to_dtype(x, "f32"), x)

    def compat_layer(self, dtype):
        # logits (d=1, q=1) k = [0, 1e-4, -5, 0]: p0 < p1 by 1e-4 relative, both round to the
        # same bf16 / f16 value; the window is position 3.
        return {"keys": np.array([0.0, 1e-4, -5.0, 0.0]).reshape(1, 4, 1),
                "queries": np.ones((1, 1, 1)), "keys_dtype": dtype}

    def test_compat_differs_from_exact(self):
        P = {"kind": "SNAPKV", "window": 1, "pooling": "NONE", "tokens_per_head": 2}
        for dtype in ("bf16", "f16"):
            layer = self.compat_layer(dtype)
            A = ref.window_attention(layer["queries"], layer["keys"], 1.0, 4, 1, 1)
            r = ref.compat_window_attention(layer["queries"], layer["keys"], 4, 1, 1, dtype)
            self.assertLess(A[0, 0, 0], A[0, 0, 1])
            self.assertEqual(r[0, 0, 0], r[0, 0, 1])          # precondition of the test
            exact = ref.keep_plan(geo(), P, [layer], 4)
            compat = ref.keep_plan(geo(), dict(P, numeric_mode="KVPRESS_COMPAT"), [layer], 4)
            self.assertEqual(kept_sets(exact), [[[1, 3]]])
            self.assertEqual(kept_sets(compat), [[[0, 3]]], dtype)   # tie -> lower position
            np.testing.assert_array_equal(compat["raw"][0, 0, :3], r[0, 0, :3])
        layer = self.compat_layer("f32")                           # f32: no rounding
        compat = ref.keep_plan(geo(), dict(P, numeric_mode="KVPRESS_COMPAT"), [layer], 4)
        self.assertEqual(kept_sets(compat), [[[1, 3]]])
        layer = self.compat_layer(None)                            # absent: f32
        compat = ref.keep_plan(geo(), dict(P, numeric_mode="KVPRESS_COMPAT"), [layer], 4)
        self.assertEqual(kept_sets(compat), [[[1, 3]]])

    def test_given_attention_not_rounded(self):
        # Window 2 (positions 2, 3), no pooling.  Column 0 = [1/8, 1/8] -> mean 1/8; column 1 =
        # [1/4 + 2^-10, 2^-10] -> mean 1/8 + 2^-10 (a bf16 value): position 1 wins.  Were the
        # given entries rounded first, 1/4 + 2^-10 (a bf16 midpoint) would become 1/4, the mean
        # 1/8 + 2^-11 (a midpoint) would round to 1/8: a tie, won by position 0.
        att = [[[1 / 8, 1 / 4 + 2.0**-10, 0, 0], [1 / 8, 2.0**-10, 0, 0]]]
        P = {"kind": "SNAPKV", "window": 2, "pooling": "NONE", "tokens_per_head": 3,
             "numeric_mode": "KVPRESS_COMPAT"}
        p = ref.keep_plan(geo(), P, [att_layer(att, keys_dtype="bf16")], 4)
        self.assertEqual(kept_sets(p), [[[1, 2, 3]]])
        np.testing.assert_array_equal(p["raw"][0, 0, :2], [1 / 8, 1 / 8 + 2.0**-10])

    def test_laprox_ignores_numeric_mode(self):
        rng = np.random.default_rng(15)
        g = geo(L=1, H=2, Hkv=1, d=2, D=3)
        layer = dict(random_layers(rng, 1, 2, 1, 2, 3, 12, 3)[0], keys_dtype="bf16")
        a = ref.keep_plan(g, {"window": 3, "tokens_per_head": 6}, [layer], 12)
        b = ref.keep_plan(g, {"window": 3, "tokens_per_head": 6, "kind": "LAPROX",
                              "numeric_mode": "KVPRESS_COMPAT"}, [layer], 12)
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


class KvpressCompat(unittest.TestCase):
    """KVPRESS_COMPAT's rounding points (SEMANTICS.md, "KVPRESS_COMPAT arithmetic"), one test
    each: every case is built so that dropping that one rounding changes the result.  bf16
    has 8 significant bits: the grid is 2^-7 on [1, 2), 2^-8 on [1/2, 1), 2^-9 on [1/4, 1/2)."""

    C = {"numeric_mode": "KVPRESS_COMPAT"}

    def snap(self, g, layer, n, B, w=1, pooling="NONE", kind="SNAPKV", mode="KVPRESS_COMPAT",
             **kw):
        P = dict({"kind": kind, "window": w, "pooling": pooling, "pool_kernel": 3,
                  "tokens_per_head": B, "numeric_mode": mode}, **kw)
        return ref.keep_plan(g, P, [layer], n)

    # SnapKV steps 1-3 (from queries)

    def q_layer(self, keys, queries=((1.0, 1.0),), dtype="bf16"):
        return {"queries": np.array(queries, dtype=np.float64)[None],
                "keys": np.array(keys, dtype=np.float64)[None], "keys_dtype": dtype}

    def test_logits_rounded(self):
        # (1) d = 2, q = [1, 1]: q.k = 4.0546875 (key 0) and 4.0625 (key 1); r(4.0546875) =
        # 4.0625 (grid 2^-5 on [4, 8)), so both scaled logits are r(4.0625 / sqrt 2) = 2.875:
        # a tie, position 0 wins.  Unrounded, 4.0546875 / sqrt 2 = 2.8671 -> 2.859375 < 2.875.
        g = geo(d=2, scale=1 / math.sqrt(2))
        layer = self.q_layer([[4.0625, -2.0**-7], [4.0625, 0.0], [0.0, 0.0]])
        p = self.snap(g, layer, 3, 2)
        self.assertEqual(kept_sets(p), [[[0, 2]]])
        self.assertEqual(p["raw"][0, 0, 0], p["raw"][0, 0, 1])
        self.assertEqual(kept_sets(self.snap(g, layer, 3, 2, mode="EXACT")), [[[1, 2]]])

    def test_scaled_logits_rounded(self):
        # (2) logits 6 and 6.03125 (adjacent bf16 values) / sqrt 2 = 4.2426 and 4.2647 both
        # round to 4.25: a tie, position 0 wins.  Unrounded they differ by 0.022, so p1 > p0
        # by 2 % (several bf16 steps).
        g = geo(d=2, scale=1 / math.sqrt(2))
        layer = self.q_layer([[6.0, 0.0], [6.03125, 0.0], [0.0, 0.0]])
        p = self.snap(g, layer, 3, 2)
        self.assertEqual(kept_sets(p), [[[0, 2]]])
        self.assertEqual(kept_sets(self.snap(g, layer, 3, 2, mode="EXACT")), [[[1, 2]]])

    def test_scale_is_inv_sqrt_head_dim_and_lse_unused(self):
        # f32: nothing is rounded, but the scale is 1/sqrt(d) = 1/2 whatever the geometry says
        # (here 1), and a given lse is checked but not used (the softmax is computed).
        rng = np.random.default_rng(50)
        layer = {"queries": rng.standard_normal((2, 3, 4)), "keys": rng.standard_normal((1, 9, 4)),
                 "lse": rng.standard_normal((2, 3)), "keys_dtype": "f32"}
        no_lse = dict(layer, lse=None)
        want = self.snap(geo(H=2, d=4, scale=0.5), no_lse, 9, 4, w=3, mode="EXACT")
        other = self.snap(geo(H=2, d=4, scale=1.0), no_lse, 9, 4, w=3, mode="EXACT")
        for lay in (layer, no_lse):
            got = self.snap(geo(H=2, d=4, scale=1.0), lay, 9, 4, w=3)
            np.testing.assert_array_equal(got["scores"], want["scores"])
            self.assertFalse(np.array_equal(got["raw"][0, 0, :6], other["raw"][0, 0, :6]))

    def test_softmax_rounded(self):
        # (3) d = 1, keys [1, .75, .5, .5], window 2 with q = -.75 (row 0, keys 0..2) and .75
        # (row 1).  Rounded probabilities in units of 2^-9: row 0 [140, 169], row 1 [160, 132];
        # column sums 300 and 301, means 150 and 150.5 (a midpoint -> 150) * 2^-9: a tie,
        # position 0 wins.  Unrounded the means are 149.83 -> 150 and 150.59 -> 151.
        layer = self.q_layer([[1.0], [0.75], [0.5], [0.5]], queries=((-0.75,), (0.75,)))
        p = self.snap(geo(), layer, 4, 3, w=2)
        self.assertEqual(kept_sets(p), [[[0, 2, 3]]])
        np.testing.assert_array_equal(p["raw"][0, 0, :2], [150 * 2.0**-9] * 2)
        self.assertEqual(kept_sets(self.snap(geo(), layer, 4, 3, w=2, mode="EXACT")),
                         [[[1, 2, 3]]])

    # SnapKV steps 4-7 (given attention: steps 1-3 skipped)

    def test_row_mean_rounded(self):
        # (4) window 2, AVG 3.  Column means m = [(1 + 7 * 2^-8) / 2, 2^-6, 2^-9]; m0 =
        # 131.5 * 2^-8 ties to 132 * 2^-8.  Pool / 3 in units of 2^-10: position 0
        # (m0 + m1) -> 181.33 -> 181, position 1 (m0 + m1 + m2) = 182: position 1 wins.  With
        # m0 unrounded: 180.67 -> 181 and 181.33 -> 181, a tie won by position 0.
        att = [[[1.0, 2.0**-5, 0, 0, 0], [7 * 2.0**-8, 0, 2.0**-8, 0, 0]]]
        p = self.snap(geo(), att_layer(att, keys_dtype="bf16"), 5, 3, w=2, pooling="AVG")
        self.assertEqual(kept_sets(p), [[[1, 3, 4]]])
        np.testing.assert_array_equal(p["raw"][0, 0, :2], [181 * 2.0**-10, 182 * 2.0**-10])

    def test_pool_rounded(self):
        # (5) H = 2 (one group), window 1, AVG 3.  Head 0 [0, .0390625, 0]: every pool is
        # .0390625 / 3 -> 213 * 2^-14.  Head 1 [.5, .125, 2^-10]: pools .625 / 3 = 213.33 ->
        # 213 and .6259765625 / 3 = 213.67 -> 214 (* 2^-10).  Group means (* 2^-11): 226.31 ->
        # 226 and 227.31 -> 227: position 1 wins.  Unrounded pools: 226.67 -> 227 and 227.0:
        # a tie won by position 0.
        att = [[[0, .0390625, 0, .15625]], [[.5, .125, 2.0**-10, .875]]]
        p = self.snap(geo(H=2), att_layer(att, keys_dtype="bf16"), 4, 2, pooling="AVG")
        self.assertEqual(kept_sets(p), [[[1, 3]]])
        np.testing.assert_array_equal(p["raw"][0, 0, :2], [226 * 2.0**-11, 227 * 2.0**-11])

    def test_group_mean_rounded(self):
        # (6) H = 2 (one group), window 1, no pooling: position 0 heads [1/2, 1/2] -> 1/2;
        # position 1 heads [1, e] with e = 2^-8 (bf16) or 2^-11 (f16) -> 1/2 + e/2, a midpoint
        # that ties to 1/2: a tie, position 0 wins.  f32 (no rounding): position 1 wins.
        for dtype, e, want in (("bf16", 2.0**-8, [0, 2]), ("f16", 2.0**-11, [0, 2]),
                               ("f32", 2.0**-8, [1, 2])):
            att = [[[.5, 1.0, 0]], [[.5, e, 0]]]
            p = self.snap(geo(H=2), att_layer(att, keys_dtype=dtype), 3, 2)
            self.assertEqual(kept_sets(p), [[want]], dtype)
            self.assertEqual(p["raw"][0, 0, 1], .5 if dtype != "f32" else .5 + e / 2, dtype)

    def test_sentinel_rounded(self):
        # (7) prefix max M = 77 * 2^-8 = .30078125; M + 1 = 166.5 * 2^-7 ties to 166 * 2^-7.
        att = [[[77 * 2.0**-8, .1, 0, 0]] * 2]
        for kind in ("SNAPKV", "PYRAMIDKV"):
            p = self.snap(geo(), att_layer(att, keys_dtype="bf16"), 4, 3, w=2, kind=kind)
            np.testing.assert_array_equal(p["scores"][0, 0, 2:], [166 * 2.0**-7] * 2)
        p = self.snap(geo(), att_layer(att, keys_dtype="bf16"), 4, 3, w=2, mode="EXACT")
        np.testing.assert_array_equal(p["scores"][0, 0, 2:], [1 + 77 * 2.0**-8] * 2)

    # CriticalKV value factor and stage-2 score (given attention, window 1, no pooling, n = 3,
    # one token kept, stage 1 empty, so position 0's score is (s + eps) * u).

    def critical(self, att, values, o_proj, kind="CRITICALKV", H=1, d=1, D=1, **kw):
        P = dict({"kind": kind, "window": 1, "pooling": "NONE", "tokens_per_head": 1,
                  "alpha_safeguard": 0.0, "numeric_mode": "KVPRESS_COMPAT"}, **kw)
        layer = {"attention": np.array(att, dtype=np.float64),
                 "values": np.array(values, dtype=np.float64),
                 "o_proj": np.array(o_proj, dtype=np.float64), "keys_dtype": "bf16"}
        return ref.keep_plan(geo(H=H, d=d, D=D), P, [layer], 3)

    def test_value_products_rounded(self):
        # P = v W_O: d = D = 2, v0 = [1, 1], W_O rows [1, 2^-8], [2^-8, 0] -> P = [1 + 2^-8,
        # 2^-8] -> r(P) = [1, 2^-8] (1 + 2^-8 ties to 1); u = r(1 + 2^-8) = 1; s = 1 (eps is
        # lost in r(1 + eps)): score 1.  Unrounded P: u = r(1 + 2^-7) = 1 + 2^-7.
        for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            p = self.critical([[[1.0, 0, 0]]], [[[1, 1], [0, 0], [0, 0]]],
                              [[1, 2.0**-8], [2.0**-8, 0]], kind=kind, d=2, D=2)
            self.assertEqual(p["scores"][0, 0, 0], 1.0, kind)
            self.assertEqual(kept_sets(p), [[[0]]])

    def test_head_norms_rounded(self):
        # u_h = r(sum |P|): H = 2 (one group), d = 1, D = 2, v0 = 1.  Head 0 P = [1, 2^-8] ->
        # u_0 = r(1 + 2^-8) = 1; head 1 P = [2^-8, 0] -> 2^-8; u = r((1 + 2^-8) / 2) = 1/2
        # (a midpoint); s = 1: score 1/2.  Unrounded u_0: u = r(1/2 + 2^-8) = 1/2 + 2^-8.
        for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            p = self.critical([[[1.0, 0, 0]]] * 2, [[[1], [0], [0]]],
                              [[1, 2.0**-8], [2.0**-8, 0]], kind=kind, H=2, D=2)
            self.assertEqual(p["scores"][0, 0, 0], .5, kind)

    def test_group_value_mean_rounded(self):
        # u = r(sum_h u_h / G): heads' u_h = 1 and 2^-8 -> u = r(1/2 + 2^-9) = 1/2;
        # s = 1 + 2^-7: score r((1 + 2^-7) / 2) = 1/2 + 2^-8.  Unrounded u: (1 + 2^-7)(1/2 +
        # 2^-9) = 1/2 + 2^-8 + 2^-9 + 2^-16, just above a midpoint -> 1/2 + 2^-7.
        for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            p = self.critical([[[1 + 2.0**-7, 0, 0]]] * 2, [[[1], [0], [0]]], [[1, 2.0**-8]],
                              kind=kind, H=2)
            self.assertEqual(p["scores"][0, 0, 0], .5 + 2.0**-8, kind)

    def test_stage2_sum_rounded(self):
        # r(s + eps): s = 3/4 (grid 2^-8), so r(3/4 + 1e-4) = 3/4; u = 1 + 3 * 2^-7;
        # s * u = 196.5 * 2^-8 ties to 196 * 2^-8.  Unrounded s + eps: 196.53 -> 197.
        for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            p = self.critical([[[.75, 0, 0]]], [[[1 + 3 * 2.0**-7], [0], [0]]], [[1.0]],
                              kind=kind)
            self.assertEqual(p["scores"][0, 0, 0], 196 * 2.0**-8, kind)
            p = self.critical([[[.75, 0, 0]]], [[[1 + 3 * 2.0**-7], [0], [0]]], [[1.0]],
                              kind=kind, numeric_mode="EXACT")
            self.assertAlmostEqual(p["scores"][0, 0, 0], (.75 + 1e-4) * (1 + 3 * 2.0**-7),
                                   places=15)

    def test_stage2_product_rounded(self):
        # r(r(s + eps) * u): the case above; unrounded the score would be 196.5 * 2^-8.  A
        # window token with u = 0 scores 0.
        for kind in ("CRITICALKV", "CRITICAL_ADAKV"):
            p = self.critical([[[.75, 0, 0]]], [[[1 + 3 * 2.0**-7], [0], [0]]], [[1.0]],
                              kind=kind)
            self.assertNotEqual(p["scores"][0, 0, 0], 196.5 * 2.0**-8)
            self.assertEqual(p["scores"][0, 0, 2], 0.0)
            self.assertEqual(kept_sets(p), [[[0]]])

    def test_safeguard_overflows_to_inf(self):
        # CRITICAL_ADAKV: safeguarded tokens (alpha 1, so every kept one) score bf16 max;
        # with stage 1 empty, r(r(max + eps) * u) = +inf for u = 2 (window, position 2) and
        # u = 1.5 (position 0); position 1 (u = 1) stays at max.
        p = self.critical([[[.5, .25, 0]]], [[[1.5], [1], [2]]], [[1.0]], kind="CRITICAL_ADAKV",
                          alpha_safeguard=1.0, first_stage_ratio=0.0, tokens_per_head=2)
        self.assertEqual(kept_sets(p), [[[0, 2]]])
        self.assertEqual(p["scores"][0, 0].tolist(), [np.inf, .25, np.inf])

    # max(1, ...) budgets

    def test_n_kept_at_least_one(self):
        # n = 5, cr = .9: int(.5) = 0.  KVPRESS_COMPAT keeps max(1, 0) = 1 (quota 1) for every
        # kind but CAKE; EXACT keeps nothing.  A token budget of 0 stays 0.
        rng = np.random.default_rng(51)
        g = geo(L=1, H=2, Hkv=1, d=2, D=3, scale=0.7)
        layers = random_layers(rng, 1, 2, 1, 2, 3, 5, 2)
        layers[0]["keys_dtype"] = "bf16"
        for kind in ref.BASELINE_KINDS:
            P = {"kind": kind, "window": 2, "pool_kernel": 3, "compression_ratio": 0.9}
            exact = ref.keep_plan(g, P, layers, 5)
            compat = ref.keep_plan(g, dict(P, **self.C), layers, 5)
            if kind == "CAKE":                         # unchanged: window only, quota 0
                self.assertEqual(compat["quota"], 0)
                self.assertEqual(kept_sets(compat), [[[3, 4]]])
                continue
            self.assertEqual((exact["quota"], int(exact["counts"].sum())), (0, 0), kind)
            self.assertEqual((compat["quota"], int(compat["counts"].sum())), (1, 1), kind)
            if kind != "STREAMING_LLM":
                self.assertEqual(kept_sets(compat), [[[3]]], kind)   # earliest sentinel
            P = {"kind": kind, "window": 2, "pool_kernel": 3, "tokens_per_head": 0}
            self.assertEqual(int(ref.keep_plan(g, dict(P, **self.C), layers, 5)["counts"].sum()),
                             0, kind)
        self.assertEqual(ref.keep_plan(g, {"kind": "STREAMING_LLM", "compression_ratio": 0.9,
                                           **self.C}, [{}], 5)["kept"][0, 0].tolist(),
                         [True, False, False, False, False])          # sink 0

    def test_stage1_at_least_one(self):
        # CRITICALKV, n = 10, cr = .85: n_kept = int(1.5) = 1, stage 1 = int(.75) = 0 ->
        # max(1, 0) = 1 in KVPRESS_COMPAT: the earliest window token (8) is forced.  The window
        # values are 0 (u = 0), so with no stage 1 (EXACT) the prefix token 0 wins stage 2.
        att = np.tile(np.array([.3, .1, .1, .1, .1, .1, .1, .1, 0, 0]), (1, 2, 1))
        values = [[1] * 8 + [0, 0]]
        P = {"kind": "CRITICALKV", "window": 2, "pooling": "NONE", "compression_ratio": 0.85}
        layer = att_layer(att, values, [[1.0]], keys_dtype="bf16")
        self.assertEqual(kept_sets(ref.keep_plan(geo(), dict(P, **self.C), [layer], 10)),
                         [[[8]]])
        self.assertEqual(kept_sets(ref.keep_plan(geo(), P, [layer], 10)), [[[0]]])
        # a token budget is not raised: tokens_per_head 1 -> stage 1 int(.5) = 0
        P = {"kind": "CRITICALKV", "window": 2, "pooling": "NONE", "tokens_per_head": 1}
        self.assertEqual(kept_sets(ref.keep_plan(geo(), dict(P, **self.C), [layer], 10)),
                         [[[0]]])

    def test_pyramid_fallback_at_least_one(self):
        # n = 5, cr = .9: q = .5, round(q) = 0 -> max(1, 0) = 1 in KVPRESS_COMPAT.
        self.assertEqual(ref.pyramid_layer_counts(5, 5 * (1 - 0.9), 2, 20.0, 2), [0, 0])
        self.assertEqual(ref.pyramid_layer_counts(5, 5 * (1 - 0.9), 2, 20.0, 2, 1), [1, 1])
        att = np.random.default_rng(52).random((1, 2, 5))
        P = {"kind": "PYRAMIDKV", "window": 2, "pooling": "NONE", "compression_ratio": 0.9}
        layers = [att_layer(att, keys_dtype="bf16")] * 2
        self.assertEqual(ref.keep_plan(geo(L=2), dict(P, **self.C), layers, 5)["counts"].tolist(),
                         [[1], [1]])
        self.assertEqual(ref.keep_plan(geo(L=2), P, layers, 5)["counts"].tolist(), [[0], [0]])


class EdgeCases(unittest.TestCase):

    def setUp(self):
        rng = np.random.default_rng(16)
        self.g = geo(L=2, H=4, Hkv=2, d=2, D=3, scale=0.8)
        self.layers = random_layers(rng, 2, 4, 2, 2, 3, 16, 5)

    def plan(self, kind, B, n=16, **kw):
        P = {"kind": kind, "window": 4, "pool_kernel": 3, "tokens_per_head": B}
        P.update(kw)
        return ref.keep_plan(self.g, P, self.layers, n)

    def test_n_kept_zero(self):
        for kind in ("STREAMING_LLM", "SNAPKV", "PYRAMIDKV", "ADAKV", "CRITICALKV",
                     "CRITICAL_ADAKV"):
            p = self.plan(kind, 0)
            self.assertEqual(int(p["counts"].sum()), 0, kind)
        p = self.plan("CAKE", 0)
        self.assertEqual(p["counts"].tolist(), [[4, 4], [4, 4]])

    def test_n_kept_at_least_n(self):
        for kind in ref.BASELINE_KINDS:
            for B in (16, 17, 2**31 - 1):
                p = self.plan(kind, B)
                self.assertTrue(np.all(p["kept"]), (kind, B))
                self.assertEqual(p["quota"], 16)
            p = ref.keep_plan(self.g, {"kind": kind, "window": 4, "pool_kernel": 3,
                                       "compression_ratio": 0.0}, self.layers, 16)
            self.assertTrue(np.all(p["kept"]), kind)

    def test_window_larger_than_n(self):
        # n=3 < w=4 (we = 3, no prefix): the earliest n_kept positions win the sentinel tie;
        # CAKE keeps everything (n <= n_kept + w).
        layers = [dict(l, keys=l["keys"][:, :3], values=l["values"][:, :3]) for l in self.layers]
        for kind in ("SNAPKV", "PYRAMIDKV", "ADAKV", "CRITICALKV", "CRITICAL_ADAKV"):
            p = ref.keep_plan(self.g, {"kind": kind, "window": 4, "pool_kernel": 3,
                                       "tokens_per_head": 2, "alpha_safeguard": 0.5},
                              layers, 3)
            if kind in ("SNAPKV", "PYRAMIDKV"):
                self.assertEqual(kept_sets(p), [[[0, 1], [0, 1]]] * 2, kind)
            elif kind == "ADAKV":
                # n_safe 1: position 0 of each head; the other 2 slots by (head, position)
                self.assertEqual(kept_sets(p), [[[0, 1, 2], [0]]] * 2, kind)
            self.assertEqual(int(p["counts"].sum()), 2 * 2 * 2, kind)
        p = ref.keep_plan(self.g, {"kind": "CAKE", "window": 4, "pool_kernel": 3,
                                   "tokens_per_head": 1}, layers, 3)
        self.assertTrue(np.all(p["kept"]))

    def test_equal_scores(self):
        att = np.full((2, 2, 8), .25)
        g = geo(L=1, H=2, Hkv=1, d=1, D=1)
        for kind in ("SNAPKV", "PYRAMIDKV", "ADAKV"):
            p = ref.keep_plan(g, {"kind": kind, "window": 2, "pooling": "NONE",
                                  "tokens_per_head": 5}, [att_layer(att)], 8)
            self.assertEqual(kept_sets(p), [[[0, 1, 2, 6, 7]]], kind)
        p = ref.keep_plan(g, {"kind": "CRITICALKV", "window": 2, "pooling": "NONE",
                              "tokens_per_head": 5},
                          [att_layer(att, [[1] * 8], [[1.0, 1.0]])], 8)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 6, 7]]])


class AgainstLoops(unittest.TestCase):
    """Random cases: the oracle's kept sets equal the loop formulation's."""

    def check(self, kind, G, Hkv, budgets, seed, n=30, L=2, w=5, k=3, extra=None,
              dtype="bf16"):
        rng = np.random.default_rng(seed)
        H, d, D = G * Hkv, 3, 5
        g = geo(L=L, H=H, Hkv=Hkv, d=d, D=D, scale=0.6)      # not 1/sqrt(d)
        layers = random_layers(rng, L, H, Hkv, d, D, n, w + 2)
        for layer in layers:
            layer["keys_dtype"] = dtype
        for B in budgets:
            P = {"kind": kind, "window": w, "pool_kernel": k}
            P.update(extra or {})
            if isinstance(B, float):
                P["compression_ratio"] = B
            else:
                P["tokens_per_head"] = B
            plan = ref.keep_plan(g, P, layers, n)
            want, Pl, pre = bf_plan(g, dict(ref.validate_policy(P)), layers, n)
            self.assertEqual(kept_sets(plan), want, (kind, G, Hkv, B, extra))
            np.testing.assert_allclose(plan["raw"][:, :, :n - w], np.array(pre), rtol=1e-11,
                                       atol=1e-300)
            if kind == "CAKE":
                np.testing.assert_allclose(plan["layer_sums"], Pl, rtol=1e-9)

    def test_all(self):
        budgets = (0, 1, 3, 7, 12, 18, 29, 30, 0.5, 0.77)
        for kind in ("SNAPKV", "ADAKV", "CRITICALKV", "CRITICAL_ADAKV"):
            for seed, (G, Hkv) in enumerate(((1, 3), (2, 2), (4, 1))):
                self.check(kind, G, Hkv, budgets, seed)
        self.check("PYRAMIDKV", 2, 2, (8, 12, 14, 20, 0.6), 20, L=3, w=2,
                   extra={"pyramid_beta": 2.0})
        self.check("PYRAMIDKV", 1, 2, budgets, 21)
        self.check("ADAKV", 2, 3, (4, 10), 22, extra={"alpha_safeguard": 0.9})
        self.check("CRITICAL_ADAKV", 2, 3, (4, 10, 20), 23,
                   extra={"alpha_safeguard": 0.9, "first_stage_ratio": 0.1})
        self.check("CRITICALKV", 2, 2, (6, 0.6), 24, extra={"first_stage_ratio": 0.9})
        for seed, (G, Hkv) in enumerate(((1, 2), (2, 2), (3, 1))):
            self.check("CAKE", G, Hkv, (0, 6, 9, 13, 20, 24, 0.5), 30 + seed, L=3)
        self.check("CAKE", 2, 2, (9, 13), 40, L=3, extra={"cake_gamma": 0.0, "cake_tau1": 1.0})
        self.check("CAKE", 2, 2, (9, 13), 42, L=3, extra={"numeric_mode": "KVPRESS_COMPAT"})

    def test_kvpress_compat(self):
        C = {"numeric_mode": "KVPRESS_COMPAT"}
        budgets = (0, 1, 3, 7, 12, 29, 0.5, 0.77, 0.98)          # cr .98: int(.6) = 0 -> 1
        for seed, kind in enumerate(("SNAPKV", "ADAKV", "CRITICALKV", "CRITICAL_ADAKV")):
            for dtype, (G, Hkv) in (("bf16", (2, 2)), ("f16", (4, 1)), ("f32", (1, 3))):
                self.check(kind, G, Hkv, budgets, 60 + seed, extra=C, dtype=dtype)
        self.check("PYRAMIDKV", 2, 2, (8, 12, 14, 20, 0.6, 0.98), 64, L=3, w=2,
                   extra=dict(C, pyramid_beta=2.0))
        self.check("CRITICALKV", 2, 2, (6, 0.6, 0.9, 0.95), 65,
                   extra=dict(C, first_stage_ratio=0.9))
        self.check("CRITICAL_ADAKV", 2, 3, (4, 10, 20), 66,
                   extra=dict(C, alpha_safeguard=0.9, first_stage_ratio=0.1))
        self.check("CAKE", 2, 2, (9, 13, 0.98), 67, L=3, extra=C, dtype="f16")


class Validation(unittest.TestCase):

    def test_policy(self):
        layer = att_layer(np.ones((1, 2, 6)) / 6, [[1] * 6], [[1.0]])
        for bad in ({"kind": "H2O"}, {"numeric_mode": "FAST"}, {"pyramid_beta": 0.5},
                    {"alpha_safeguard": 1.5}, {"epsilon": float("nan")}, {"epsilon": -1.0},
                    {"first_stage_ratio": -0.1}, {"cake_tau1": 0.0}, {"cake_tau2": -1.0},
                    {"cake_gamma": -1.0}, {"cake_gamma": True}, {"window": 3},
                    {"pool_kernel": 4}, {"bogus": 1}):
            P = {"kind": "CRITICAL_ADAKV", "window": 2, "tokens_per_head": 3}
            P.update(bad)
            with self.assertRaises(ValueError, msg=str(bad)):
                ref.keep_plan(geo(), P, [layer], 6)
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), {"kind": "SNAPKV", "window": 2, "tokens_per_head": 3},
                          [dict(layer, keys_dtype="f64")], 6)
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), {"kind": "SNAPKV", "window": 2, "tokens_per_head": 3},
                          [{"values": np.ones((1, 6, 1))}], 6)        # no window tensors
        # baselines ignore the LAPROX-only combination rule, and pool_target (still checked)
        ref.keep_plan(geo(), {"kind": "SNAPKV", "window": 2, "tokens_per_head": 3,
                              "indicator": "ATTENTION", "gqa_value": "EXACT_BLOCK"}, [layer], 6)
        P = {"kind": "SNAPKV", "window": 2, "tokens_per_head": 3}
        plain = ref.keep_plan(geo(), P, [layer], 6)
        score = ref.keep_plan(geo(), dict(P, pool_target="SCORE"), [layer], 6)
        np.testing.assert_array_equal(plain["scores"], score["scores"])
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), dict(P, pool_target="BOTH"), [layer], 6)


class Cli(unittest.TestCase):

    def test_case_dirs_with_kind(self):
        rng = np.random.default_rng(17)
        L, H, Hkv, d, D, n, wq = 2, 4, 2, 4, 8, 50, 10
        g = geo(L=L, H=H, Hkv=Hkv, d=d, D=D, scale=0.5)
        with tempfile.TemporaryDirectory() as tmp:
            layers_json = []
            for l in range(L):
                keys = rng.standard_normal((Hkv, n, d)).astype(np.float32)
                bf = (keys.view(np.uint32) >> 16).astype(np.uint16)            # bf16 bits
                np.save(os.path.join(tmp, f"k{l}.npy"), bf)
                np.save(os.path.join(tmp, f"v{l}.npy"),
                        rng.standard_normal((Hkv, n, d)).astype(np.float16))
                np.save(os.path.join(tmp, f"o{l}.npy"),
                        rng.standard_normal((D, H * d)).astype(np.float32))
                np.save(os.path.join(tmp, f"q{l}.npy"),
                        (3 * rng.standard_normal((H, wq, d))).astype(np.float32))

                def t(f, dt):
                    return {"file": f, "dtype": dt, "slice_last": None, "permute": None}
                layers_json.append({"keys": t(f"k{l}.npy", "bf16"), "values": t(f"v{l}.npy",
                                                                                  "f16"),
                                    "o_proj": t(f"o{l}.npy", "f32"),
                                    "queries": t(f"q{l}.npy", "f32"), "attention": None,
                                    "lse": None})
            for kind in ref.BASELINE_KINDS:
                for mode in ("EXACT", "KVPRESS_COMPAT"):
                    case_dir = os.path.join(tmp, f"{kind}-{mode}")
                    os.mkdir(case_dir)
                    for f in os.listdir(tmp):
                        if f.endswith(".npy"):
                            os.link(os.path.join(tmp, f), os.path.join(case_dir, f))
                    P = {"kind": kind, "window": 8, "compression_ratio": 0.6,
                         "numeric_mode": mode}
                    with open(os.path.join(case_dir, "case.json"), "w") as fh:
                        json.dump({"geometry": g, "n": n, "policy": P,
                                   "layers": layers_json}, fh)
                    with contextlib.redirect_stdout(io.StringIO()):
                        self.assertEqual(ref.main([case_dir]), 0)
                    got = np.load(os.path.join(case_dir, "ref_out.npz"))
                    geometry, policy, layers, nn = ref.load_case(case_dir)
                    self.assertEqual([x["keys_dtype"] for x in layers], ["bf16", "bf16"])
                    want = ref.keep_plan(geometry, policy, layers, nn)
                    self.assertEqual(sorted(got.files), sorted(want))
                    for key in want:
                        np.testing.assert_array_equal(got[key], np.asarray(want[key]),
                                                      err_msg=f"{kind} {mode} {key}")
                    self.assertEqual(int(got["quota"]), 20)        # int(0.4 * 50)
            # STREAMING_LLM without any tensor
            case_dir = os.path.join(tmp, "streaming-bare")
            os.mkdir(case_dir)
            with open(os.path.join(case_dir, "case.json"), "w") as fh:
                json.dump({"geometry": g, "n": n,
                           "policy": {"kind": "STREAMING_LLM", "tokens_per_head": 10},
                           "layers": [{"keys": None, "values": None, "o_proj": None,
                                       "queries": None, "attention": None, "lse": None}] * L},
                          fh)
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(ref.main([case_dir]), 0)
            got = np.load(os.path.join(case_dir, "ref_out.npz"))
            self.assertEqual(np.flatnonzero(got["kept"][1, 1]).tolist(),
                             [0, 1, 2, 3] + list(range(44, 50)))


if __name__ == "__main__":
    unittest.main()
