"""Self-tests of the float64 LaProx oracle (laprox_ref.py).

Run from the repository root:
    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'

Needs only numpy and the standard library.  The small cases are worked out by hand; their
expected kept positions are written literally, with the arithmetic in the comments.
"""

import contextlib
import io
import json
import math
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import laprox_ref as ref  # noqa: E402


def geo(L=1, H=1, Hkv=1, d=1, D=1, scale=1.0):
    return {"L": L, "H": H, "Hkv": Hkv, "d": d, "D": D, "scale": scale}


def pol(**kw):
    p = {"allocation": "GLOBAL_NORMALIZED", "indicator": "ATTENTION_X_PROJECTED_VALUE",
         "gqa_value": "MEAN_HEAD_NORM", "window": 1, "pooling": "NONE", "pool_kernel": 7,
         "sinks": 0, "min_per_head": 0, "head_uniform_layers": False,
         "tokens_per_head": None, "compression_ratio": None}
    p.update(kw)
    if p["tokens_per_head"] is None and p["compression_ratio"] is None:
        raise AssertionError("test bug: no budget")
    return p


def att_layer(attention, values, o_proj):
    """A layer given by its window attention [H, wq, n]; values as [Hkv, n] (d = 1) or
    [Hkv, n, d]."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 2:
        v = v[:, :, None]
    return {"keys": None, "values": v, "o_proj": np.asarray(o_proj, dtype=np.float64),
            "queries": None, "attention": np.asarray(attention, dtype=np.float64), "lse": None}


def kept_sets(plan):
    L, Hkv, _ = plan["kept"].shape
    return [[ref.kept_positions(plan, l, g) for g in range(Hkv)] for l in range(L)]


def random_layers(rng, L, H, Hkv, d, D, n, wq, with_lse=False):
    layers = []
    for _ in range(L):
        layers.append({"keys": rng.standard_normal((Hkv, n, d)),
                       "values": rng.standard_normal((Hkv, n, d)),
                       "o_proj": rng.standard_normal((D, H * d)),
                       "queries": rng.standard_normal((H, wq, d)),
                       "attention": None, "lse": None})
    return layers


# --------------------------------------------------------------------------------------------
# A loop-based re-statement of the score formulas, used for cross-checks on random inputs.
# --------------------------------------------------------------------------------------------

def loop_attention(q, k, scale, n, we):
    """Explicit per-row causal softmax. q [wq, d] (last we rows used), k [n, d]."""
    wq = q.shape[0]
    A = np.zeros((we, n))
    for t in range(we):
        pos = n - we + t
        logits = [scale * float(np.dot(q[wq - we + t], k[j])) for j in range(pos + 1)]
        mx = max(logits)
        e = [math.exp(z - mx) for z in logits]
        tot = sum(e)
        for j in range(pos + 1):
            A[t, j] = e[j] / tot
    return A


def loop_raw(geometry, policy, layer, n):
    """p for candidates, [Hkv, m], with loops and np.outer; pooling must be NONE."""
    H, Hkv, d = geometry["H"], geometry["Hkv"], geometry["d"]
    G = H // Hkv
    we = min(policy["window"], n)
    se = min(policy["sinks"], n - we)
    A = [loop_attention(layer["queries"][h], layer["keys"][h // G], geometry["scale"], n, we)
         for h in range(H)]
    W = [layer["o_proj"][:, h * d:(h + 1) * d].T for h in range(H)]
    out = np.zeros((Hkv, n - we - se))
    for g in range(Hkv):
        heads = range(g * G, (g + 1) * G)
        for i in range(se, n - we):
            v = layer["values"][g, i]
            Abar_col = sum(A[h][:, i] for h in heads) / G
            c = math.sqrt(sum(a * a for a in Abar_col))
            ind, gv = policy["indicator"], policy["gqa_value"]
            if ind == "ATTENTION":
                x = c
            elif ind == "ATTENTION_X_VALUE":
                x = c * np.linalg.norm(v)
            elif gv == "MEAN_HEAD_NORM":
                x = c * sum(np.linalg.norm(v @ W[h]) for h in heads) / G
            elif gv == "SUMMED_PROJECTION":
                x = c * np.linalg.norm(v @ sum(W[h] for h in heads))
            elif gv == "MEAN_HEAD_PRODUCT":
                x = sum(np.linalg.norm(A[h][:, i]) * np.linalg.norm(v @ W[h])
                        for h in heads) / G
            else:  # EXACT_BLOCK: the literal we x D matrix
                M = sum(np.outer(A[h][:, i], v @ W[h]) for h in heads)
                x = np.linalg.norm(M, "fro")
            out[g, i - se] = x
    return out


class HandWorkedSingleHead(unittest.TestCase):
    """L=1, H=Hkv=1, d=D=1, queries path.

    keys k_j = ln a_j with a = [1, 2, 3, 4, 10], query 1, scale 1: the window row (position 4)
    sees all keys, so A = a / 20 = [.05, .10, .15, .20, .50].  W_O = [[2]], values
    [5, 1, 1, 1, 1]: r = 2|v| = [10, 2, 2, 2].  p = c * r = [.5, .2, .3, .4] on candidates 0..3.
    """

    def setUp(self):
        self.layer = {"keys": np.log([1.0, 2.0, 3.0, 4.0, 10.0]).reshape(1, 5, 1),
                      "values": np.array([5.0, 1, 1, 1, 1]).reshape(1, 5, 1),
                      "o_proj": np.array([[2.0]]),
                      "queries": np.array([[[1.0]]])}

    def plan(self, **kw):
        return ref.keep_plan(geo(), pol(**kw), [self.layer], 5)

    def test_no_pooling(self):
        p = self.plan(tokens_per_head=2)              # f = 1, q = 1: best is 0 (.5)
        self.assertEqual(kept_sets(p), [[[0, 4]]])
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.5, .2, .3, .4], rtol=1e-13)
        self.assertTrue(np.isnan(p["raw"][0, 0, 4]) and np.isnan(p["scores"][0, 0, 4]))
        self.assertAlmostEqual(p["layer_sums"][0], 1.4, places=13)
        np.testing.assert_allclose(p["scores"][0, 0, :4], np.array([.5, .2, .3, .4]) / 1.4,
                                   rtol=1e-13)
        self.assertEqual((p["quota"], p["total_selected"]), (1, 1))
        self.assertEqual(p["counts"].tolist(), [[2]])
        self.assertEqual(np.flatnonzero(p["selected"][0, 0]).tolist(), [0])
        p = self.plan(tokens_per_head=3)              # q = 2: 0 (.5), 3 (.4)
        self.assertEqual(kept_sets(p), [[[0, 3, 4]]])

    def test_avg_pooling(self):
        # c over [0, 4): [.05, .10, .15, .20]; avg k=3 with zero padding, / 3:
        # [.15/3, .30/3, .45/3, .35/3] = [.05, .10, .15, .11667]; * r = [.5, .2, .3, .2333]
        p = self.plan(tokens_per_head=3, pooling="AVG", pool_kernel=3)
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.5, .2, .3, .7 / 3], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 2, 4]]])

    def test_max_pooling(self):
        # max k=3: [.10, .15, .20, .20] * r = [1.0, .3, .4, .4]; the tie 2/3 goes to 2.
        p = self.plan(tokens_per_head=3, pooling="MAX", pool_kernel=3)
        np.testing.assert_allclose(p["raw"][0, 0, :4], [1.0, .3, .4, .4], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 2, 4]]])
        p = self.plan(tokens_per_head=4, pooling="MAX", pool_kernel=3)
        self.assertEqual(kept_sets(p), [[[0, 2, 3, 4]]])

    def test_avg_peak_pooling(self):
        # SCORE target, p = c * r = [.5, .2, .3, .4]: avg k=3 gives [.7/3, 1/3, .3, .7/3];
        # AVG_PEAK takes the larger of each and its own p: [.5, 1/3, .3, .4], so the isolated
        # peak at 0 (which AVG ranks last, test_pool_target) is kept with 3: q = 2 keeps 0, 3.
        p = self.plan(tokens_per_head=3, pooling="AVG_PEAK", pool_kernel=3, pool_target="SCORE")
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.5, 1 / 3, .3, .4], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 3, 4]]])
        # ATTENTION target: max(c, avg(c)) = [.05, .10, .15, .20] vs avg [.05, .10, .15,
        # .11667] -> [.05, .10, .15, .20]; * r = [.5, .2, .3, .4]: keeps 0 and 3.
        p = self.plan(tokens_per_head=3, pooling="AVG_PEAK", pool_kernel=3,
                      pool_target="ATTENTION")
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.5, .2, .3, .4], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 3, 4]]])

    def test_indicators(self):
        # ATTENTION_X_VALUE: c * |v| = [.25, .1, .15, .2]; ATTENTION: c.
        p = self.plan(tokens_per_head=3, indicator="ATTENTION_X_VALUE")
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.25, .1, .15, .2], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 3, 4]]])
        p = self.plan(tokens_per_head=3, indicator="ATTENTION")
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.05, .1, .15, .2], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[2, 3, 4]]])

    def test_pool_target(self):
        # SCORE pools p = c * r = [.5, .2, .3, .4]: avg k=3 gives [.7/3, 1/3, .9/3, .7/3], so
        # q = 2 keeps 1 and 2 where ATTENTION (pool(c) * r, test_avg_pooling) keeps 0 and 2;
        # max k=3 gives [.5, .5, .4, .4] (0 and 1) where ATTENTION gives [1, .3, .4, .4].  At
        # G = 1 every gqa_value is the same score.
        for gv in ref.GQA_VALUES:
            for pooling, target, raw, kept in (
                    ("AVG", "SCORE", [.7 / 3, 1 / 3, .3, .7 / 3], [1, 2, 4]),
                    ("AVG", "ATTENTION", [.5, .2, .3, .7 / 3], [0, 2, 4]),
                    ("MAX", "SCORE", [.5, .5, .4, .4], [0, 1, 4]),
                    ("MAX", "ATTENTION", [1.0, .3, .4, .4], [0, 2, 4])):
                p = self.plan(tokens_per_head=3, pooling=pooling, pool_kernel=3, gqa_value=gv,
                              pool_target=target)
                np.testing.assert_allclose(p["raw"][0, 0, :4], raw, rtol=1e-13,
                                           err_msg=f"{gv} {pooling} {target}")
                self.assertEqual(kept_sets(p), [[kept]], f"{gv} {pooling} {target}")

    def test_n_at_most_budget_keeps_everything(self):
        for B in (5, 6, 100, 2**31 - 1):
            p = self.plan(tokens_per_head=B)
            self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 4]]])
            self.assertEqual(p["quota"], 4)
            self.assertEqual(p["selected"][0, 0].tolist(), [True] * 4 + [False])

    def test_budget_below_forced(self):
        p = self.plan(tokens_per_head=0)              # only the window is kept
        self.assertEqual(kept_sets(p), [[[4]]])
        self.assertEqual((p["quota"], p["total_selected"]), (0, 0))


class CausalMask(unittest.TestCase):
    """n=4, w=2, d=1, scale 1, keys [2, 0, 0, 10], queries [1, -1], values 1, W_O = [[1]].

    Row 0 (position 2) must not see key 3: logits [2, 0, 0] -> A0 = [.787, .106, .106, 0].
    Row 1 (position 3): logits [-2, 0, 0, -10] -> A1 ~ [.0634, .468, .468, 2e-5].
    c0 = ||(.787, .0634)|| ~ .79 > c1 = ||(.106, .468)|| ~ .48, so q=1 keeps 0.
    Without the mask row 0 would put ~all its mass on key 3 and position 1 would win.
    """

    def setUp(self):
        self.layer = {"keys": np.array([2.0, 0.0, 0.0, 10.0]).reshape(1, 4, 1),
                      "values": np.ones((1, 4, 1)), "o_proj": np.array([[1.0]]),
                      "queries": np.array([1.0, -1.0]).reshape(1, 2, 1)}

    def test_kept(self):
        p = ref.keep_plan(geo(), pol(window=2, tokens_per_head=3), [self.layer], 4)
        self.assertEqual(kept_sets(p), [[[0, 2, 3]]])

    def test_attention_rows(self):
        A = ref.window_attention(self.layer["queries"], self.layer["keys"], 1.0, 4, 2, 1)
        self.assertEqual(A[0, 0, 3], 0.0)
        e = np.exp([2.0, 0.0, 0.0])
        np.testing.assert_allclose(A[0, 0, :3], e / e.sum(), rtol=1e-14)
        e = np.exp([-2.0, 0.0, 0.0, -10.0])
        np.testing.assert_allclose(A[0, 1], e / e.sum(), rtol=1e-14)

    def test_against_loop_softmax(self):
        rng = np.random.default_rng(1)
        q, k = rng.standard_normal((3, 5, 4)), rng.standard_normal((1, 9, 4))
        A = ref.window_attention(q, k, 0.5, 9, 4, 3)
        for h in range(3):
            np.testing.assert_allclose(A[h], loop_attention(q[h], k[0], 0.5, 9, 4), rtol=1e-12)
        # row t (position 5 + t) sees keys j <= 5 + t: columns 6 + c with c >= t are masked
        self.assertTrue(np.all(np.triu(A[:, :, 6:]) == 0.0))
        self.assertTrue(np.all(A[:, np.arange(1, 4), np.arange(6, 9)] > 0.0))


class WindowLseAndGivenAttention(unittest.TestCase):

    def test_lse(self):
        rng = np.random.default_rng(2)
        g = geo(H=2, Hkv=1, d=3, D=4, scale=0.7)
        layer = random_layers(rng, 1, 2, 1, 3, 4, 10, 4)[0]
        n, w = 10, 3
        # exact lse of the last w rows over the allowed keys
        lse = np.zeros((2, 4))
        for h in range(2):
            for t in range(3):
                pos = n - w + t
                z = 0.7 * layer["keys"][0, :pos + 1] @ layer["queries"][h, 1 + t]
                lse[h, 1 + t] = z.max() + np.log(np.exp(z - z.max()).sum())
        lse[:, 0] = 123.0                              # a row outside the window: unused
        P = pol(window=w, tokens_per_head=5, indicator="ATTENTION")
        base = ref.keep_plan(g, P, [layer], n)
        with_lse = ref.keep_plan(g, P, [dict(layer, lse=lse)], n)
        np.testing.assert_allclose(with_lse["raw"], base["raw"], rtol=1e-12)
        shifted = ref.keep_plan(g, P, [dict(layer, lse=lse + np.log(2.0))], n)
        np.testing.assert_allclose(shifted["raw"], base["raw"] / 2, rtol=1e-12)
        np.testing.assert_allclose(shifted["scores"], base["scores"], rtol=1e-12)

    def test_given_attention_uses_last_rows(self):
        # wq=3, w=2: row 0 (huge on position 1) is not used.  Rows 1, 2 favour position 0.
        att = np.array([[[0.0, 50.0, 0.0, 0.0, 0.0],
                         [0.6, 0.1, 0.1, 0.1, 0.1],
                         [0.5, 0.2, 0.1, 0.1, 0.1]]])
        p = ref.keep_plan(geo(), pol(window=2, tokens_per_head=3),
                          [att_layer(att, [[1, 1, 1, 1, 1]], [[1.0]])], 5)
        self.assertEqual(kept_sets(p), [[[0, 3, 4]]])
        np.testing.assert_allclose(p["raw"][0, 0, :3],
                                   [math.hypot(.6, .5), math.hypot(.1, .2), math.hypot(.1, .1)],
                                   rtol=1e-14)


class Gqa(unittest.TestCase):
    """H=2, Hkv=1 (G=2), d=1, D=2, o_proj [[3, 0], [4, 1]]: W_O^0 = [3, 4] (norm 5),
    W_O^1 = [0, 1] (norm 1), sum = [3, 5] (norm sqrt 34).  w=1, n=5, values 1.
    A^0 = [.4, .1, .1, .1 | .3], A^1 = [0, .5, .1, .1 | .3]; Abar = [.2, .3, .1, .1].
    """
    O = [[3.0, 0.0], [4.0, 1.0]]
    ATT = [[[.4, .1, .1, .1, .3]], [[0.0, .5, .1, .1, .3]]]

    def plan(self, B, gv):
        return ref.keep_plan(geo(H=2, D=2), pol(tokens_per_head=B, gqa_value=gv),
                             [att_layer(self.ATT, [[1, 1, 1, 1, 1]], self.O)], 5)

    def test_mean_head_norm(self):
        p = self.plan(2, "MEAN_HEAD_NORM")            # c * (5+1)/2 = [.6, .9, .3, .3]
        np.testing.assert_allclose(p["raw"][0, 0, :4], [.6, .9, .3, .3], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[1, 4]]])

    def test_summed_projection(self):
        p = self.plan(2, "SUMMED_PROJECTION")         # c * sqrt(34)
        np.testing.assert_allclose(p["raw"][0, 0, :4],
                                   np.array([.2, .3, .1, .1]) * math.sqrt(34), rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[1, 4]]])

    def test_mean_head_product(self):
        p = self.plan(2, "MEAN_HEAD_PRODUCT")         # (5 A0 + 1 A1) / 2 = [1, .5, .3, .3]
        np.testing.assert_allclose(p["raw"][0, 0, :4], [1.0, .5, .3, .3], rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 4]]])

    def test_exact_block(self):
        # ||[3 A0, 4 A0 + A1]||: [||(1.2, 1.6)||, ||(.3, .9)||, ||(.3, .5)||, ||(.3, .5)||]
        p = self.plan(3, "EXACT_BLOCK")
        np.testing.assert_allclose(p["raw"][0, 0, :4],
                                   [2.0, math.sqrt(.9), math.sqrt(.34), math.sqrt(.34)],
                                   rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 1, 4]]])

    def test_pool_target_per_head(self):
        """Values [1, 2, 1, 1 | 1], AVG k=3.  c^0 = [.4, .1, .1, .1], c^1 = [0, .5, .1, .1] pool
        to P^0 = [.5, .6, .3, .2] / 3, P^1 = [.5, .6, .7, .2] / 3; r^0 = 5|v|, r^1 = |v|."""
        layer = att_layer(self.ATT, [[1, 2, 1, 1, 1]], self.O)
        run = lambda gv, target: ref.keep_plan(  # noqa: E731
            geo(H=2, D=2), pol(tokens_per_head=3, gqa_value=gv, pooling="AVG", pool_kernel=3,
                               pool_target=target), [layer], 5)["raw"][0, 0, :4]
        # MEAN_HEAD_PRODUCT, ATTENTION: (5 |v| P^0 + |v| P^1) / 2; SCORE: pool of
        # (5 |v| c^0 + |v| c^1) / 2 = [1, 1, .3, .3].
        np.testing.assert_allclose(run("MEAN_HEAD_PRODUCT", "ATTENTION"),
                                   [.5, 1.2, 2.2 / 6, .2], rtol=1e-13)
        np.testing.assert_allclose(run("MEAN_HEAD_PRODUCT", "SCORE"),
                                   [2 / 3, 2.3 / 3, 1.6 / 3, .2], rtol=1e-13)
        # EXACT_BLOCK, ATTENTION: v^2 (25 P0^2 + P1^2 + 2 rho 4 P0 P1) with rho = 0 at token 0
        # (c^1 = 0 there, while P^1 > 0 keeps its own term) and 1 elsewhere (one window row).
        np.testing.assert_allclose(
            run("EXACT_BLOCK", "ATTENTION"),
            [math.sqrt(26) / 6, math.sqrt(4 * 1.36), math.sqrt(.25 + .49 / 9 + .56 / 3),
             math.sqrt(34 * .04 / 9)], rtol=1e-13)
        # SCORE: pool of ||[3 A0, 4 A0 + A1]|| |v| = [2, 2 sqrt(.9), sqrt(.34), sqrt(.34)].
        x = [2.0, 2 * math.sqrt(.9), math.sqrt(.34), math.sqrt(.34)]
        np.testing.assert_allclose(
            run("EXACT_BLOCK", "SCORE"),
            [(x[0] + x[1]) / 3, sum(x[:3]) / 3, sum(x[1:]) / 3, (x[2] + x[3]) / 3], rtol=1e-13)
        # Not set: SCORE for both (the historic placement).
        for gv in ("MEAN_HEAD_PRODUCT", "EXACT_BLOCK"):
            np.testing.assert_array_equal(run(gv, None), run(gv, "SCORE"))

    def test_group_mapping(self):
        """H=4, Hkv=2: heads 0,1 -> KV head 0, heads 2,3 -> KV head 1 (h // G, not h % Hkv).
        KV 0 sees [.5, .1, .1], KV 1 sees [.1, .5, .2]; UNIFORM, q=1.  With h % Hkv both
        groups would average to [.3, .3, .15] and keep position 0."""
        a0, a1 = [.5, .1, .1, .3], [.1, .5, .2, .2]
        att = [[a0], [a0], [a1], [a1]]
        p = ref.keep_plan(geo(H=4, Hkv=2, D=4),
                          pol(tokens_per_head=2, allocation="UNIFORM"),
                          [att_layer(att, np.ones((2, 4)), np.eye(4))], 4)
        self.assertEqual(kept_sets(p), [[[0, 3], [1, 3]]])


class Sinks(unittest.TestCase):
    """n=6, w=1, sinks=1, values 1, W_O=[[1]]; c = [.9 | .05, .3, .05, .1 | .2]."""
    ATT = [[[.9, .05, .3, .05, .1, .2]]]

    def plan(self, **kw):
        return ref.keep_plan(geo(), pol(sinks=1, **kw),
                             [att_layer(self.ATT, [[1] * 6], [[1.0]])], 6)

    def test_no_pooling(self):
        p = self.plan(tokens_per_head=3)              # f = 2, q = 1: best candidate is 2
        self.assertEqual(kept_sets(p), [[[0, 2, 5]]])
        self.assertTrue(np.isnan(p["scores"][0, 0, 0]) and np.isnan(p["scores"][0, 0, 5]))
        self.assertTrue(np.isnan(p["raw"][0, 0, 0]))
        self.assertAlmostEqual(p["layer_sums"][0], .5, places=14)  # the sink is not summed
        self.assertFalse(p["selected"][0, 0, 0])
        self.assertEqual(self.plan(tokens_per_head=4)["counts"].tolist(), [[4]])

    def test_sink_takes_part_in_pooling(self):
        # avg k=3 over [0, 5) with the sink: pos1 = (.9+.05+.3)/3 = .4167, pos2 = .4/3,
        # pos3 = .45/3, pos4 = .15/3 -> 1.  (Without the sink pos1 would be .35/3 and 3 win.)
        p = self.plan(tokens_per_head=3, pooling="AVG", pool_kernel=3)
        np.testing.assert_allclose(p["raw"][0, 0, 1:5], np.array([1.25, .4, .45, .15]) / 3,
                                   rtol=1e-13)
        self.assertEqual(kept_sets(p), [[[0, 1, 5]]])

    def test_sinks_clamped(self):
        # n=3, w=1, sinks=5: se = min(5, 2) = 2, no candidates, everything kept.
        p = ref.keep_plan(geo(), pol(sinks=5, tokens_per_head=1),
                          [att_layer([[[.2, .3, .5]]], [[1, 1, 1]], [[1.0]])], 3)
        self.assertEqual(kept_sets(p), [[[0, 1, 2]]])
        self.assertEqual((p["quota"], p["total_selected"]), (0, 0))
        self.assertTrue(np.all(np.isnan(p["scores"])))


class Allocation(unittest.TestCase):
    """Two layers, H=Hkv=2, d=1, n=5, w=1, values 1, W_O = I, q=2 (B=3), K=8.

    Layer 0, both heads: p = [.4, .3, .2, .1], S0 = 2 -> s = [.2, .15, .1, .05].
    Layer 1: head 0 p = [.6, .25, .12, .03], head 1 p = 0; S1 = 1 -> s = p.
    Global order: .6 (1,0,0), .25 (1,0,1), .2 (0,0,0), .2 (0,1,0), .15 (0,0,1), .15 (0,1,1),
    .12 (1,0,2), .1 (0,0,2) | .1 (0,1,2) ...
    """

    def layers(self):
        l0 = [[[.4, .3, .2, .1, 0.0]], [[.4, .3, .2, .1, 0.0]]]
        l1 = [[[.6, .25, .12, .03, 0.0]], [[0.0] * 5]]
        return [att_layer(l0, np.ones((2, 5)), np.eye(2)),
                att_layer(l1, np.ones((2, 5)), np.eye(2))]

    def plan(self, **kw):
        return ref.keep_plan(geo(L=2, H=2, Hkv=2, D=2), pol(tokens_per_head=3, **kw),
                             self.layers(), 5)

    def test_global_normalized(self):
        p = self.plan()
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 4], [0, 1, 4]], [[0, 1, 2, 4], [4]]])
        self.assertEqual(p["total_selected"], 8)
        self.assertEqual(int(p["selected"].sum()), 8)
        np.testing.assert_allclose(p["layer_sums"], [2.0, 1.0], rtol=1e-14)

    def test_head_uniform_layers(self):
        # T0 = 5 -> head 0 gets 3, head 1 gets 2; T1 = 3 -> head 0 gets 2, head 1 gets 1
        # (layer 1 head 1 is all zero: the tie goes to position 0).
        p = self.plan(head_uniform_layers=True)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 4], [0, 1, 4]], [[0, 1, 4], [0, 4]]])

    def test_per_layer(self):
        # layer 0: 4 slots -> .2 .2 .15 .15; layer 1: 4 slots -> .6 .25 .12 .03 (head 0).
        p = self.plan(allocation="PER_LAYER")
        self.assertEqual(kept_sets(p), [[[0, 1, 4], [0, 1, 4]], [[0, 1, 2, 3, 4], [4]]])

    def test_uniform(self):
        p = self.plan(allocation="UNIFORM", min_per_head=1)
        self.assertEqual(kept_sets(p), [[[0, 1, 4], [0, 1, 4]], [[0, 1, 4], [0, 1, 4]]])

    def test_global_raw(self):
        # s = p: .6 (1,0,0), .4 (0,0,0), .4 (0,1,0), .3, .3, .25 (1,0,1), .2 (0,0,2), .2 (0,1,2)
        p = self.plan(allocation="GLOBAL_RAW")
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 4], [0, 1, 2, 4]], [[0, 1, 4], [4]]])
        np.testing.assert_array_equal(p["scores"][~np.isnan(p["scores"])],
                                      p["raw"][~np.isnan(p["raw"])])

    def test_min_per_head(self):
        """L=1, H=Hkv=2: head 0 p = [.4, .3, .2, .1], head 1 p = [.01, .02, .03, .04]."""
        att = [[[.4, .3, .2, .1, 0.0]], [[.01, .02, .03, .04, 0.0]]]
        layers = [att_layer(att, np.ones((2, 5)), np.eye(2))]

        def plan(mph):
            return ref.keep_plan(geo(H=2, Hkv=2, D=2),
                                 pol(tokens_per_head=3, min_per_head=mph), layers, 5)
        # no floor: all 4 slots go to head 0
        self.assertEqual(kept_sets(plan(0)), [[[0, 1, 2, 3, 4], [4]]])
        # floor 1: head 0 reserves 0, head 1 reserves 3; the 2 others go to head 0 (1, 2)
        self.assertEqual(kept_sets(plan(1)), [[[0, 1, 2, 4], [3, 4]]])
        # floor 5 > q = 2: r = 2, every head keeps its own best 2
        self.assertEqual(kept_sets(plan(5)), [[[0, 1, 4], [2, 3, 4]]])

    def test_min_per_head_per_layer(self):
        p = self.plan(allocation="PER_LAYER", min_per_head=1)
        # layer 1: head 0 reserves 0, head 1 reserves 0 (zeros, lowest position),
        # then 2 more of layer 1: .25, .12 (head 0).
        self.assertEqual(kept_sets(p)[1], [[0, 1, 2, 4], [0, 4]])


class MaxLayerShare(unittest.TestCase):
    """max_layer_share (SEMANTICS.md, "Selection") on Allocation's two layers: q = 2, Hkv = 2,
    K = 8, the average layer's share Hkv * q = 4.  Uncapped (GLOBAL_NORMALIZED) layer 0 takes 5
    (.2 .2 .15 .15 .1) and layer 1 three (.6 .25 .12)."""

    layers = Allocation.layers

    def plan(self, **kw):
        return ref.keep_plan(geo(L=2, H=2, Hkv=2, D=2), pol(tokens_per_head=3, **kw),
                             self.layers(), 5)

    def test_unset_and_loose_caps_change_nothing(self):
        base = self.plan()
        for share in (None, 1.25 * 1.0001, 1.5, 2.0, 1e300):  # caps 5, 6, 8, 8 (<= K)
            p = self.plan(max_layer_share=share)
            np.testing.assert_array_equal(p["kept"], base["kept"])

    def test_cap_moves_the_leftover_to_the_next_best_layer(self):
        # s = 1: cap 4.  Walk (layer in brackets): .6 [1] .25 [1] .2 [0] .2 [0] .15 [0] .15 [0]
        # (layer 0 full) .12 [1], .1 .1 .05 .05 of layer 0 skipped, .03 [1]: K = 8 reached.
        # Layer 1 = head 0's .6 .25 .12 .03: the slots layer 0 could not use went to layer 1.
        p = self.plan(max_layer_share=1.0)
        self.assertEqual(kept_sets(p), [[[0, 1, 4], [0, 1, 4]], [[0, 1, 2, 3, 4], [4]]])
        self.assertEqual(p["selected"].sum(axis=(1, 2)).tolist(), [4, 4])
        # s = 1 with GLOBAL_NORMALIZED is the PER_LAYER plan.
        np.testing.assert_array_equal(p["kept"], self.plan(allocation="PER_LAYER")["kept"])

    def test_with_min_per_head_and_layer_uniform(self):
        # min_per_head 1: reservations (0,0,0) (0,1,0) (1,0,0) (1,1,0), then with cap 4 layer 0
        # takes .15 .15 and is full, layer 1 takes .25 .12: [[0,1],[0,1]] / [[0,1,2],[0]].
        p = self.plan(max_layer_share=1.0, min_per_head=1)
        self.assertEqual(kept_sets(p), [[[0, 1, 4], [0, 1, 4]], [[0, 1, 2, 4], [0, 4]]])
        # A reservation of q per head fills every layer to exactly its cap at s = 1: UNIFORM.
        p = self.plan(max_layer_share=1.0, min_per_head=2)
        np.testing.assert_array_equal(p["kept"], self.plan(allocation="UNIFORM")["kept"])
        # LAYER_UNIFORM spreads the capped totals (4, 4) evenly: 2 per head.
        p = self.plan(max_layer_share=1.0, plan_shape="LAYER_UNIFORM")
        self.assertEqual(kept_sets(p), [[[0, 1, 4], [0, 1, 4]], [[0, 1, 4], [0, 1, 4]]])

    def test_ignored_by_per_layer_and_uniform(self):
        for alloc in ("PER_LAYER", "UNIFORM"):
            np.testing.assert_array_equal(self.plan(allocation=alloc, max_layer_share=1.0)["kept"],
                                          self.plan(allocation=alloc)["kept"])

    def test_global_raw(self):
        # s = p: uncapped layer 0 takes 6 (.4 .4 .3 .3 .2 .2) and layer 1 two (.6 .25); cap 5
        # (s = 1.25): layer 0 stops at .2 (0,0,2), layer 1 takes .12 next.
        p = self.plan(allocation="GLOBAL_RAW", max_layer_share=1.25)
        self.assertEqual(p["selected"].sum(axis=(1, 2)).tolist(), [5, 3])
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 4], [0, 1, 4]], [[0, 1, 2, 4], [4]]])

    def test_invalid_values(self):
        for bad in (float("nan"), float("inf"), -float("inf"), 0.5, 0.0, -1.0, True, "2"):
            with self.assertRaisesRegex(ValueError, "max_layer_share"):
                self.plan(max_layer_share=bad)
        with self.assertRaisesRegex(ValueError, "max_layer_share"):
            self.plan(max_layer_share=2.0, plan_shape="BLOCKS_SHARED", block_size=2)
        with self.assertRaisesRegex(ValueError, "max_layer_share"):
            ref.validate_policy({"kind": "SNAPKV", "max_layer_share": 2.0,
                                 "tokens_per_head": 3})
        self.assertEqual(ref.validate_policy(pol(tokens_per_head=3,
                                                 max_layer_share=1))["max_layer_share"], 1.0)


class TiesAndEdges(unittest.TestCase):

    def test_ties_lowest_layer_head_position(self):
        # L=2, H=Hkv=2, uniform attention, values 1: all scores equal; q=1, K=4.
        n = 6
        att = np.full((2, 2, n), 1.0 / n)
        layers = [att_layer(att, np.ones((2, n)), np.eye(2)) for _ in range(2)]
        p = ref.keep_plan(geo(L=2, H=2, Hkv=2, D=2), pol(window=2, tokens_per_head=3),
                          layers, n)
        self.assertEqual(len(set(p["scores"][~np.isnan(p["scores"])].tolist())), 1)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 4, 5], [4, 5]], [[4, 5], [4, 5]]])

    def test_select_best_order(self):
        s = np.full((2, 2, 3), np.nan)
        s[:, :, :] = [[[1, 2, 2], [2, 0, 1]], [[2, 2, 3], [1, 1, 1]]]
        elig = np.ones_like(s, dtype=bool)
        elig[1, 0, 2] = False                         # the 3 is not eligible
        got = ref.select_best(s, elig, 4)
        # 2s in order: (0,0,1), (0,0,2), (0,1,0), (1,0,0), (1,0,1)
        self.assertEqual(sorted(zip(*np.nonzero(got))),
                         [(0, 0, 1), (0, 0, 2), (0, 1, 0), (1, 0, 0)])

    def test_n_at_most_window(self):
        rng = np.random.default_rng(3)
        layers = random_layers(rng, 2, 2, 1, 3, 4, 3, 4)
        p = ref.keep_plan(geo(L=2, H=2, Hkv=1, d=3, D=4), pol(window=4, tokens_per_head=1),
                          layers, 3)
        self.assertTrue(p["kept"].all())
        self.assertEqual(p["counts"].tolist(), [[3], [3]])
        self.assertTrue(np.all(np.isnan(p["scores"])) and np.all(np.isnan(p["raw"])))
        self.assertEqual(p["layer_sums"].tolist(), [0.0, 0.0])
        self.assertEqual((p["quota"], p["total_selected"]), (0, 0))

    def test_all_zero_layer_is_uniform(self):
        # Layer 0: s = [.4, .3, .2, .1]; layer 1 has zero values: S1 = 0 -> s = 1/(1*4) = .25.
        # q = 2, K = 4: .4 (0,0,0), .3 (0,0,1), .25 (1,0,0), .25 (1,0,1).
        att = [[[.4, .3, .2, .1, 0.0]]]
        layers = [att_layer(att, [[1] * 5], [[1.0]]), att_layer(att, [[0] * 5], [[1.0]])]
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=3, allocation="GLOBAL_NORMALIZED"),
                          layers, 5)
        self.assertEqual(kept_sets(p), [[[0, 1, 4]], [[0, 1, 4]]])
        self.assertEqual(p["layer_sums"][1], 0.0)
        self.assertEqual(p["scores"][1, 0, :4].tolist(), [.25] * 4)
        self.assertEqual(p["raw"][1, 0, :4].tolist(), [0.0] * 4)

    def test_all_zero_layer_competes_with_zero_under_global_raw(self):
        # GLOBAL_RAW skips the normalisation and its uniform rule: layer 1's s = p = 0, so the
        # 4 selected slots all go to layer 0 (p > 0 there), and layer 1 keeps its window only.
        att = [[[.4, .3, .2, .1, 0.0]]]
        layers = [att_layer(att, [[1] * 5], [[1.0]]), att_layer(att, [[0] * 5], [[1.0]])]
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=3, allocation="GLOBAL_RAW"), layers, 5)
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 4]], [[4]]])
        self.assertEqual(p["scores"][1, 0, :4].tolist(), [0.0] * 4)

    def test_compression_ratio(self):
        P = pol(compression_ratio=0.9, window=32)
        self.assertEqual(ref.budget_tokens(ref.validate_policy(P), 1000), 99)
        self.assertEqual(ref.budget_tokens(ref.validate_policy(pol(compression_ratio=0.5)),
                                           7), 3)
        rng = np.random.default_rng(4)
        layers = random_layers(rng, 1, 2, 1, 4, 8, 1000, 32)
        p = ref.keep_plan(geo(H=2, d=4, D=8, scale=0.5), P, layers, 1000)
        self.assertEqual(p["quota"], 67)
        self.assertEqual(p["counts"].tolist(), [[99]])

    def test_selection_is_top_k(self):
        rng = np.random.default_rng(5)
        layers = random_layers(rng, 3, 4, 2, 4, 6, 40, 6)
        p = ref.keep_plan(geo(L=3, H=4, Hkv=2, d=4, D=6, scale=0.5),
                          pol(window=5, sinks=2, pooling="AVG", pool_kernel=5,
                              tokens_per_head=15), layers, 40)
        self.assertEqual(p["quota"], 8)
        self.assertEqual(int(p["selected"].sum()), 3 * 2 * 8)
        self.assertEqual(int(p["counts"].sum()), 3 * 2 * (8 + 7))
        s = p["scores"]
        self.assertGreater(np.nanmin(s[p["selected"]]),
                           np.nanmax(np.where(p["selected"], np.nan, s)))
        np.testing.assert_allclose([np.nansum(s[l]) for l in range(3)], 1.0, rtol=1e-12)


class Pooling(unittest.TestCase):

    def test_against_explicit_loop(self):
        rng = np.random.default_rng(6)
        for length in (0, 1, 2, 3, 6, 13):
            for k in (1, 3, 5, 7, 9):
                x = rng.random((2, length))
                avg = ref.pool1d(x, "AVG", k)
                mx = ref.pool1d(x, "MAX", k)
                for row in range(2):
                    for i in range(length):
                        nb = [x[row, j] for j in range(i - k // 2, i + k // 2 + 1)
                              if 0 <= j < length]
                        self.assertAlmostEqual(avg[row, i], sum(nb) / k, places=14)
                        self.assertEqual(mx[row, i], max(nb))
                np.testing.assert_array_equal(ref.pool1d(x, "NONE", k), x)


class ScoreFormulas(unittest.TestCase):
    """Random inputs against the loop/np.outer re-statement (pooling NONE)."""

    def test_all_modes_against_loops(self):
        rng = np.random.default_rng(7)
        g = geo(L=1, H=6, Hkv=2, d=3, D=5, scale=0.6)
        layer = random_layers(rng, 1, 6, 2, 3, 5, 12, 4)[0]
        modes = [("ATTENTION_X_PROJECTED_VALUE", gv) for gv in ref.GQA_VALUES]
        modes += [("ATTENTION_X_VALUE", "MEAN_HEAD_NORM"), ("ATTENTION", "MEAN_HEAD_NORM")]
        for ind, gv in modes:
            P = pol(indicator=ind, gqa_value=gv, window=3, sinks=1, tokens_per_head=6)
            p = ref.keep_plan(g, P, [layer], 12)
            np.testing.assert_allclose(p["raw"][0, :, 1:9], loop_raw(g, P, layer, 12),
                                       rtol=1e-11, err_msg=f"{ind} {gv}")

    def test_g1_identities(self):
        rng = np.random.default_rng(8)
        g = geo(L=2, H=3, Hkv=3, d=4, D=7, scale=0.5)
        layers = random_layers(rng, 2, 3, 3, 4, 7, 30, 5)
        P = dict(window=5, pooling="AVG", pool_kernel=3, tokens_per_head=12)
        run = lambda gv: ref.keep_plan(g, pol(gqa_value=gv, **P), layers, 30)  # noqa: E731
        # G=1: EXACT_BLOCK x_i = ||A[:, i]|| * ||v_i W_O|| = MEAN_HEAD_PRODUCT x_i
        eb, mhp = run("EXACT_BLOCK"), run("MEAN_HEAD_PRODUCT")
        np.testing.assert_allclose(eb["raw"], mhp["raw"], rtol=1e-12)
        np.testing.assert_array_equal(eb["kept"], mhp["kept"])
        # G=1: SUMMED_PROJECTION = MEAN_HEAD_NORM
        sp, mhn = run("SUMMED_PROJECTION"), run("MEAN_HEAD_NORM")
        np.testing.assert_allclose(sp["raw"], mhn["raw"], rtol=1e-12)
        np.testing.assert_array_equal(sp["kept"], mhn["kept"])
        # G=1 without pooling: EXACT_BLOCK = MEAN_HEAD_NORM (pool(c) * r differs from
        # pool(c * r) otherwise)
        P["pooling"] = "NONE"
        np.testing.assert_allclose(run("EXACT_BLOCK")["raw"], run("MEAN_HEAD_NORM")["raw"],
                                   rtol=1e-12)


class PoolTarget(unittest.TestCase):
    """pool_target on random inputs (G = 3; G = 1 for the identities)."""

    def setUp(self):
        rng = np.random.default_rng(9)
        self.g = geo(L=2, H=6, Hkv=2, d=3, D=5, scale=0.6)
        self.layers = random_layers(rng, 2, 6, 2, 3, 5, 40, 5)
        self.g1 = geo(L=2, H=3, Hkv=3, d=4, D=7, scale=0.5)
        self.layers1 = random_layers(rng, 2, 3, 3, 4, 7, 30, 5)

    def raw(self, g, layers, n, **kw):
        P = pol(window=5, sinks=2, tokens_per_head=12, **kw)
        return ref.keep_plan(g, P, layers, n)["raw"]

    MODES = [("ATTENTION_X_PROJECTED_VALUE", gv) for gv in ref.GQA_VALUES] + \
        [("ATTENTION_X_VALUE", "MEAN_HEAD_NORM"), ("ATTENTION", "MEAN_HEAD_NORM")]

    def test_no_effect_without_pooling_or_values(self):
        for ind, gv in self.MODES:
            a, s = (self.raw(self.g, self.layers, 40, indicator=ind, gqa_value=gv,
                             pooling="NONE", pool_target=t) for t in ref.POOL_TARGETS)
            np.testing.assert_allclose(a, s, rtol=1e-12, err_msg=f"{ind} {gv}")
        for pooling in ("AVG", "MAX"):
            a, s = (self.raw(self.g, self.layers, 40, indicator="ATTENTION", pooling=pooling,
                             pool_kernel=5, pool_target=t) for t in ref.POOL_TARGETS)
            np.testing.assert_array_equal(a, s)

    def test_targets_differ_when_pooling(self):
        for ind, gv in self.MODES[:-1]:
            for pooling in ("AVG", "MAX"):
                a, s = (self.raw(self.g, self.layers, 40, indicator=ind, gqa_value=gv,
                                 pooling=pooling, pool_kernel=5, pool_target=t)
                        for t in ref.POOL_TARGETS)
                cand = ~np.isnan(a)
                self.assertGreater(np.abs(a[cand] - s[cand]).max(), 1e-3 * np.abs(a[cand]).max(),
                                   f"{ind} {gv} {pooling}")

    def test_unset_is_the_historic_placement(self):
        for ind, gv in self.MODES:
            target = "SCORE" if gv in ("MEAN_HEAD_PRODUCT", "EXACT_BLOCK") else "ATTENTION"
            kw = dict(indicator=ind, gqa_value=gv, pooling="AVG", pool_kernel=5)
            np.testing.assert_array_equal(self.raw(self.g, self.layers, 40, **kw),
                                          self.raw(self.g, self.layers, 40, pool_target=target,
                                                   **kw))

    def test_g1_identities(self):
        # G = 1: MEAN_HEAD_PRODUCT and EXACT_BLOCK equal MEAN_HEAD_NORM with the same target
        # (EXACT_BLOCK with ATTENTION: sqrt(pool(c)^2 v M v^T) = pool(c) * r).
        for pooling in ("AVG", "MAX"):
            for target in ref.POOL_TARGETS:
                run = lambda gv: self.raw(self.g1, self.layers1, 30, gqa_value=gv,  # noqa: E731
                                          pooling=pooling, pool_kernel=3, pool_target=target)
                mhn = run("MEAN_HEAD_NORM")
                for gv in ("SUMMED_PROJECTION", "MEAN_HEAD_PRODUCT", "EXACT_BLOCK"):
                    np.testing.assert_allclose(run(gv), mhn, rtol=1e-12,
                                               err_msg=f"{gv} {pooling} {target}")

    def test_exact_block_attention_against_loops(self):
        """The ATTENTION formula with explicit loops: per token the Gram entries of the heads'
        attention columns and of v W_O^h, the correlations, and the pooled norms."""
        g, layer, n = self.g, self.layers[0], 40
        H, Hkv, d = g["H"], g["Hkv"], g["d"]
        G, we, se = H // Hkv, 5, 2
        nx = n - we
        A = [loop_attention(layer["queries"][h], layer["keys"][h // G], g["scale"], n, we)
             for h in range(H)]
        W = [layer["o_proj"][:, h * d:(h + 1) * d].T for h in range(H)]
        got = self.raw(g, self.layers, n, gqa_value="EXACT_BLOCK", pooling="AVG", pool_kernel=5,
                       pool_target="ATTENTION")[0]
        for kv in range(Hkv):
            heads = list(range(kv * G, (kv + 1) * G))
            c = np.array([[np.linalg.norm(A[h][:, i]) for i in range(nx)] for h in heads])
            P = ref.pool1d(c, "AVG", 5)
            for i in range(se, nx):
                v = layer["values"][kv, i]
                total = 0.0
                for a, ha in enumerate(heads):
                    for b, hb in enumerate(heads):
                        rho = 1.0 if a == b else float(A[ha][:, i] @ A[hb][:, i]) / (c[a, i] *
                                                                                   c[b, i])
                        total += rho * P[a, i] * P[b, i] * float((v @ W[ha]) @ (v @ W[hb]))
                self.assertAlmostEqual(got[kv, i] / math.sqrt(total), 1.0, places=11)


class Defaults(unittest.TestCase):
    """SEMANTICS.md, "Defaults": what a policy that leaves a field out gets."""

    def test_laprox_defaults(self):
        p = ref.validate_policy({"tokens_per_head": 1})
        self.assertEqual((p["indicator"], p["gqa_value"], p["pooling"], p["pool_kernel"],
                          p["window"], p["sinks"], p["allocation"]),
                         ("ATTENTION_X_PROJECTED_VALUE", "MEAN_HEAD_PRODUCT", "AVG_PEAK", 31, 32,
                          0, "GLOBAL_NORMALIZED"))
        self.assertEqual(ref.effective_pool_target(p), "SCORE")

    def test_unset_gqa_value_follows_the_indicator(self):
        for indicator, gqa in (("ATTENTION_X_PROJECTED_VALUE", "MEAN_HEAD_PRODUCT"),
                               ("ATTENTION_X_VALUE", "MEAN_HEAD_NORM"),
                               ("ATTENTION", "MEAN_HEAD_NORM")):
            for given in ({}, {"gqa_value": None}):
                p = ref.validate_policy(dict(given, indicator=indicator, tokens_per_head=1))
                self.assertEqual(p["gqa_value"], gqa, indicator)
        # Set explicitly, it is used as given: with ATTENTION only MEAN_HEAD_NORM is valid.
        p = ref.validate_policy({"indicator": "ATTENTION_X_PROJECTED_VALUE",
                                 "gqa_value": "MEAN_HEAD_NORM", "tokens_per_head": 1})
        self.assertEqual(p["gqa_value"], "MEAN_HEAD_NORM")
        with self.assertRaisesRegex(ValueError, "ATTENTION.*EXACT_BLOCK"):
            ref.validate_policy({"indicator": "ATTENTION", "gqa_value": "EXACT_BLOCK",
                                 "tokens_per_head": 1})

    def test_baselines_keep_avg_pooling(self):
        for kind in ref.BASELINE_KINDS:
            p = ref.validate_policy({"kind": kind, "tokens_per_head": 1})
            self.assertEqual(p["pooling"], "AVG", kind)

    def test_default_plan_is_mean_head_product_avg_peak_pooled_over_31(self):
        rng = np.random.default_rng(5)
        g = geo(L=1, H=4, Hkv=2, d=4, D=8)
        n = 120
        layers = random_layers(rng, 1, 4, 2, 4, 8, n, 32)
        default = ref.keep_plan(g, {"tokens_per_head": 60}, layers, n)
        spelled = ref.keep_plan(g, pol(window=32, gqa_value="MEAN_HEAD_PRODUCT",
                                       pooling="AVG_PEAK", pool_kernel=31, pool_target="SCORE",
                                       tokens_per_head=60),
                                layers, n)
        np.testing.assert_array_equal(default["kept"], spelled["kept"])
        np.testing.assert_array_equal(default["scores"], spelled["scores"])
        # the defaults before: MEAN_HEAD_NORM and avg 7 (the first), AVG 31 (the dev grid's)
        for older in (pol(window=32, pooling="AVG", pool_kernel=7, gqa_value="MEAN_HEAD_NORM",
                          tokens_per_head=60),
                      pol(window=32, pooling="AVG", pool_kernel=31, gqa_value="MEAN_HEAD_PRODUCT",
                          pool_target="SCORE", tokens_per_head=60)):
            before = ref.keep_plan(g, older, layers, n)
            self.assertFalse(np.allclose(default["scores"], before["scores"], equal_nan=True))


class Validation(unittest.TestCase):

    def setUp(self):
        self.layer = att_layer([[[.4, .3, .2, .1, 0.0]]], [[1] * 5], [[1.0]])

    def bad(self, geometry=None, layers=None, n=5, **kw):
        kw.setdefault("tokens_per_head", 3)
        with self.assertRaises(ValueError):
            ref.keep_plan(geometry or geo(), pol(**kw), layers or [self.layer], n)

    def test_policy(self):
        self.bad(indicator="ATTENTION", gqa_value="EXACT_BLOCK")
        self.bad(indicator="ATTENTION_X_VALUE", gqa_value="SUMMED_PROJECTION")
        self.bad(window=2)                            # > wq = 1
        self.bad(window=0)
        self.bad(pooling="AVG", pool_kernel=4)
        self.bad(pooling="MAX", pool_kernel=0)
        self.bad(allocation="NOPE")
        self.bad(pool_target="NOPE")
        self.bad(pool_target="score")
        self.bad(sinks=-1)
        self.bad(min_per_head=-1)
        self.bad(tokens_per_head=-1)
        self.bad(tokens_per_head=2**31)
        self.bad(tokens_per_head=3, compression_ratio=0.5)
        self.bad(tokens_per_head=None, compression_ratio=1.0)
        self.bad(tokens_per_head=None, compression_ratio=-0.1)
        self.bad(tokens_per_head=None, compression_ratio=float("nan"))
        no_budget = pol(tokens_per_head=3)
        no_budget["tokens_per_head"] = None
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), no_budget, [self.layer], 5)
        with self.assertRaises(ValueError):
            ref.keep_plan(geo(), dict(pol(tokens_per_head=3), bogus=1), [self.layer], 5)

    def test_inputs(self):
        self.bad(geometry=geo(H=3, Hkv=2))
        self.bad(n=6)                                 # attention has 5 columns
        nan_layer = dict(self.layer, values=np.array([1, np.nan, 1, 1, 1.0]).reshape(1, 5, 1))
        self.bad(layers=[nan_layer])
        self.bad(layers=[dict(self.layer, queries=np.ones((1, 1, 1)),
                              keys=np.ones((1, 5, 1)))])   # both queries and attention
        self.bad(layers=[dict(self.layer, o_proj=None)])
        self.bad(layers=[self.layer, self.layer])     # L = 1
        # ATTENTION needs neither values nor o_proj
        ok = dict(self.layer, values=None, o_proj=None)
        p = ref.keep_plan(geo(), pol(indicator="ATTENTION", tokens_per_head=3), [ok], 5)
        self.assertEqual(kept_sets(p), [[[0, 1, 4]]])


class TooLargeToScore(unittest.TestCase):
    """SEMANTICS.md, "Finite inputs too large to score": the bounds reject what could overflow
    fp32 in the C++ backends, and nothing below them (inputs scaled by powers of two give the
    same plan); an LSE below the logits caps probabilities at 1."""

    def setUp(self):
        rng = np.random.default_rng(21)
        self.g = geo(L=2, H=4, Hkv=2, d=4, D=8, scale=0.5)
        self.layers = random_layers(rng, 2, 4, 2, 4, 8, 30, 4)
        self.P = pol(window=4, tokens_per_head=12, pooling="AVG", pool_kernel=3)

    def plan(self, layers, **kw):
        return ref.keep_plan(self.g, dict(self.P, **kw), layers, 30)

    def with_layer(self, l, **tensors):
        layers = [dict(layer) for layer in self.layers]
        layers[l].update(tensors)
        return layers

    def test_logits_that_may_overflow_are_rejected(self):
        huge = np.full((2, 30, 4), 3e38)
        layers = self.with_layer(1, keys=huge, queries=np.full((4, 4, 4), 3e38))
        for kind in ("LAPROX", "SNAPKV", "CAKE"):
            with self.assertRaisesRegex(ValueError, r"layers\[1\]\.keys"):
                self.plan(layers, kind=kind)
        base = self.plan(self.layers, kind="STREAMING_LLM")      # computes nothing from keys
        self.assertEqual(kept_sets(self.plan(layers, kind="STREAMING_LLM")), kept_sets(base))

    def test_scaled_keys_with_small_logits_are_accepted(self):
        layers = [dict(layer, keys=layer["keys"] * 2.0 ** 60, queries=layer["queries"] * 2.0 ** -60)
                  for layer in self.layers]
        np.testing.assert_allclose(self.plan(layers)["scores"], self.plan(self.layers)["scores"],
                                   rtol=1e-12)

    def test_values_and_o_proj_that_may_overflow_are_rejected(self):
        values = self.layers[0]["values"].copy()
        values[1, 5, 2] = 1e20
        with self.assertRaisesRegex(ValueError, r"layers\[0\]\.values"):
            self.plan(self.with_layer(0, values=values))
        self.plan(self.with_layer(0, values=values), kind="CRITICALKV")   # L1: linear, fine
        self.plan(self.with_layer(0, values=values), indicator="ATTENTION")
        values[1, 5, 2] = 1e35
        with self.assertRaisesRegex(ValueError, r"layers\[0\]\.values"):
            self.plan(self.with_layer(0, values=values), kind="CRITICALKV")
        o_proj = self.layers[1]["o_proj"].copy()
        o_proj[3, 3] = 1e20
        for kind in ("LAPROX", "STREAMING_LLM", "SNAPKV"):
            with self.assertRaisesRegex(ValueError, r"o_proj\[1\]"):
                self.plan(self.with_layer(1, o_proj=o_proj), kind=kind)

    def test_scaled_values_and_o_proj_give_the_same_plan(self):
        base = self.plan(self.layers)
        for name, factor in (("values", 2.0 ** 40), ("o_proj", 2.0 ** 40)):
            layers = [dict(layer, **{name: layer[name] * factor}) for layer in self.layers]
            np.testing.assert_allclose(self.plan(layers)["scores"], base["scores"], rtol=1e-12)

    def test_lse_below_the_logits_caps_probabilities_at_one(self):
        layers = [dict(layer, lse=np.full((4, 4), -1e30)) for layer in self.layers]
        p = self.plan(layers, indicator="ATTENTION", pooling="NONE")
        # Every probability is 1: Abar = 1 in each of the 4 rows, c = sqrt(4) for every token.
        np.testing.assert_allclose(p["raw"][:, :, :26], 2.0, rtol=1e-15)

    def test_zero_factors_win_over_overflow(self):
        self.assertEqual(ref.cake_preference(0.0, 5.0, 1e-3, 0.6), 0.0)
        self.assertEqual(ref.cake_preference(1e6, 0.0, 1e-3, 0.6), 0.0)       # inf * 0
        self.assertEqual(ref.cake_preference(1e6, 2.0, 1e-3, 0.6), math.inf)
        self.assertEqual(ref.cake_log_preference(0.0, 5.0, 1e-3, 0.6), -math.inf)
        self.assertAlmostEqual(ref.cake_log_preference(1e6, 2.0, 1e-3, 0.6),
                               math.log(1e6) * 1e3 + math.log(2.0) / 0.6, places=6)

    def test_cake_budgets_follow_log_preferences_past_overflow(self):
        b = ref.cake_layer_budgets
        # P_0 overflowed: layer 0 takes the budget up to its cap, the rest spills over.
        self.assertEqual(b([math.inf, 1.0], 10, 100, [900.0, 0.0]), [10, 0])
        self.assertEqual(b([math.inf, 1.0], 10, 6, [900.0, 0.0]), [6, 4])
        # Both overflowed, log P differing by log 3: shares 3/4 and 1/4 (7.5, 2.5 -> 7, 2, then the
        # deficit to the lowest layer).
        self.assertEqual(b([math.inf, math.inf], 10, 100, [800.0 + math.log(3), 800.0]), [8, 2])
        # Every P_l underflowed to 0; log P decides. All -inf (or no log_P): equal shares.
        self.assertEqual(b([0.0, 0.0], 10, 100, [-900.0, -900.0 + math.log(3)]), [3, 7])
        self.assertEqual(b([0.0, 0.0], 8, 100, [-math.inf, -math.inf]), [4, 4])
        self.assertEqual(b([math.inf, 1.0], 8, 100), [4, 4])
        s2 = ref.stage_two(np.array([0.0, 1.0, 2.0]), 0.0, np.array([np.inf, 0.0, 3.0]),
                           lambda x: x)
        np.testing.assert_array_equal(s2, [0.0, 0.0, 6.0])


class Cli(unittest.TestCase):

    def test_case_dir_roundtrip(self):
        rng = np.random.default_rng(9)
        L, H, Hkv, d, D, n, wq = 2, 4, 2, 4, 8, 20, 4
        g = geo(L=L, H=H, Hkv=Hkv, d=d, D=D, scale=0.5)
        P = pol(window=3, pooling="AVG", pool_kernel=3, sinks=1, compression_ratio=0.4)
        with tempfile.TemporaryDirectory() as tmp:
            layers_json, layers = [], []
            for l in range(L):
                keys_nhd = rng.standard_normal((n, Hkv, d)).astype(np.float32)   # permuted
                vals = rng.standard_normal((Hkv, n, d)).astype(np.float32)
                bf = (vals.view(np.uint32) >> 16).astype(np.uint16)              # bf16 bits
                o = rng.standard_normal((D, H * d)).astype(np.float16)
                qpad = rng.standard_normal((H, wq, d + 2)).astype(np.float32)   # sliced
                np.save(os.path.join(tmp, f"keys_{l}.npy"), keys_nhd)
                np.save(os.path.join(tmp, f"values_{l}.npy"), bf)
                np.save(os.path.join(tmp, f"o_{l}.npy"), o)
                np.save(os.path.join(tmp, f"q_{l}.npy"), qpad)

                def t(f, dt, sl=None, perm=None):
                    return {"file": f, "dtype": dt, "slice_last": sl, "permute": perm}
                layers_json.append({"keys": t(f"keys_{l}.npy", "f32", None, [1, 0, 2]),
                                    "values": t(f"values_{l}.npy", "bf16"),
                                    "o_proj": t(f"o_{l}.npy", "f16"),
                                    "queries": t(f"q_{l}.npy", "f32", d), "attention": None,
                                    "lse": None})
                layers.append({"keys": keys_nhd.transpose(1, 0, 2).astype(np.float64),
                               "values": (bf.astype(np.uint32) << 16).view(np.float32)
                               .astype(np.float64),
                               "o_proj": o.astype(np.float64),
                               "queries": qpad[..., :d].astype(np.float64)})
            with open(os.path.join(tmp, "case.json"), "w") as fh:
                json.dump({"geometry": g, "n": n, "policy": P, "layers": layers_json}, fh)
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(ref.main([tmp]), 0)
            got = np.load(os.path.join(tmp, "ref_out.npz"))
            want = ref.keep_plan(g, P, layers, n)
            self.assertEqual(sorted(got.files), sorted(want))
            for key in want:
                np.testing.assert_array_equal(got[key], np.asarray(want[key]), err_msg=key)
            self.assertEqual(got["quota"].shape, ())
            self.assertEqual(int(got["quota"]), 12 - 4)          # B = int(.6*20) = 12, f = 4
            self.assertEqual(got["kept"].dtype, np.bool_)
            self.assertEqual(got["counts"].dtype, np.int64)
            self.assertEqual(int(got["counts"].sum()), L * Hkv * 12)   # global allocation


if __name__ == "__main__":
    unittest.main()
