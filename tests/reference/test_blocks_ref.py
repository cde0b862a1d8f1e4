"""Self-tests of the plan shapes of the float64 oracle (laprox_ref.py; SEMANTICS.md, "Plan
shapes"): LAYER_UNIFORM, BLOCKS_SHARED and BLOCKS_PER_LAYER, block sizes from block tables,
paged tensor references.

Run from the repository root:
    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'

Needs only numpy and the standard library.  The small cases are worked out by hand: window
attention is given (one row, w = 1), values are 1 and W_O = I with d = 1, pooling NONE and
MEAN_HEAD_NORM, so the raw score p of a candidate is its attention entry; the rows are made of
dyadic fractions so that every sum below is exact.  Expected blocks and positions are written
literally, with the arithmetic in the comments.
"""

import json
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
    p = {"window": 1, "pooling": "NONE", "gqa_value": "MEAN_HEAD_NORM"}
    p.update(kw)
    return p


def att_layer(rows):
    """A layer given by its window attention: rows [H, n] (one window row per head), values 1,
    W_O = I (d = 1, D = H): p of head g at i = rows[g][i]."""
    a = np.asarray(rows, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    H, n = a.shape
    return {"attention": a[:, None, :], "values": np.ones((H, n, 1)), "o_proj": np.eye(H),
            "keys": None, "queries": None, "lse": None}


def kept_sets(plan):
    L, Hkv, _ = plan["kept"].shape
    return [[ref.kept_positions(plan, l, g) for g in range(Hkv)] for l in range(L)]


def blocks(plan):
    return [np.flatnonzero(row).tolist() for row in plan["block_kept"]]


# Two layers, n = 10, blocks of 4: [0, 4) [4, 8) [8, 10) (partial).  The window is position 9,
# so block 2 is forced; blocks 0 and 1 are the candidate blocks.
#   layer 0: p = 4 x 3/32 | 4 x 1/32 | 1/2 (pos 8), S_0 = 1: s block sums .375, .125
#   layer 1: p = 4 x 1/8  | 4 x 7/64 | 1/16,        S_1 = 1: s block sums .5, .4375
ROW0 = [3 / 32] * 4 + [1 / 32] * 4 + [0.5, 0.25]
ROW1 = [1 / 8] * 4 + [7 / 64] * 4 + [1 / 16, 0.25]


class HandWorkedBlocks(unittest.TestCase):

    def plan(self, layers=None, **kw):
        kw.setdefault("tokens_per_head", 8)
        kw.setdefault("block_size", 4)
        return ref.keep_plan(geo(L=2), pol(**kw), layers or [att_layer(ROW0), att_layer(ROW1)],
                             10)

    def test_shared(self):
        # One unit: block 0 = .375 + .5 = .875, block 1 = .125 + .4375 = .5625.  B = 8:
        # Kb = 2, 1 forced, qb = 1: block 0.
        for alloc in ref.ALLOCATIONS[:1] + ref.ALLOCATIONS[2:]:
            p = self.plan(plan_shape="BLOCKS_SHARED", allocation=alloc)
            self.assertEqual((p["block_size"], p["num_blocks"]), (4, 3))
            self.assertEqual(blocks(p), [[0, 2]], alloc)
            np.testing.assert_array_equal(p["block_scores"], [[0.875, 0.5625, np.inf]])
            self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 8, 9]]] * 2)
            # The ragged token quota q = B - 1; selected = the kept candidates [0, 9).
            self.assertEqual((p["quota"], p["total_selected"]), (7, 10))
            self.assertNotIn("new_block_table", p)

    def test_per_layer_model_wide(self):
        # GLOBAL_NORMALIZED: the best L * qb = 2 (layer, block) pairs of .375 (0,0), .125 (0,1),
        # .5 (1,0), .4375 (1,1): both of layer 1; layer 0 keeps only its forced block.
        p = self.plan(plan_shape="BLOCKS_PER_LAYER")
        self.assertEqual(blocks(p), [[2], [0, 1, 2]])
        np.testing.assert_array_equal(p["block_scores"], [[0.375, 0.125, np.inf],
                                                          [0.5, 0.4375, np.inf]])
        self.assertEqual(kept_sets(p), [[[8, 9]], [list(range(10))]])
        self.assertEqual(p["total_selected"], 1 + 9)

    def test_per_layer_each_layer(self):
        # PER_LAYER and UNIFORM: each layer its own best qb = 1: block 0 in both.
        for alloc in ("PER_LAYER", "UNIFORM"):
            p = self.plan(plan_shape="BLOCKS_PER_LAYER", allocation=alloc)
            self.assertEqual(blocks(p), [[0, 2], [0, 2]], alloc)

    def test_global_raw(self):
        # Layer 0's attention doubled: raw block sums .75, .25 (layer 0), .5, .4375 (layer 1).
        # Model-wide: .75 (0,0), .5 (1,0); shared: 1.25 vs .6875, block 0.  GLOBAL_NORMALIZED
        # would give the same plan as test_per_layer_model_wide (normalisation undoes the 2).
        layers = [att_layer(np.array(ROW0) * 2), att_layer(ROW1)]
        p = self.plan(layers, plan_shape="BLOCKS_PER_LAYER", allocation="GLOBAL_RAW")
        self.assertEqual(blocks(p), [[0, 2], [0, 2]])
        np.testing.assert_array_equal(p["block_scores"][:, :2], [[0.75, 0.25], [0.5, 0.4375]])
        p = self.plan(layers, plan_shape="BLOCKS_SHARED", allocation="GLOBAL_RAW")
        np.testing.assert_array_equal(p["block_scores"], [[1.25, 0.6875, np.inf]])
        p = self.plan(layers, plan_shape="BLOCKS_PER_LAYER")
        self.assertEqual(blocks(p), [[2], [0, 1, 2]])

    def test_global_raw_tie_goes_to_the_lower_layer(self):
        # Layer 0 raw x4: 1.5, .5; layer 1 .5, .4375.  B = 12 >= n would keep all, so B = 9
        # (Kb = 2, qb = 1, 2 pairs): 1.5 (0,0), then .5 (0,1) and .5 (1,0) tie: layer 0 wins.
        layers = [att_layer(np.array(ROW0) * 4), att_layer(ROW1)]
        p = self.plan(layers, plan_shape="BLOCKS_PER_LAYER", allocation="GLOBAL_RAW",
                      tokens_per_head=9)
        self.assertEqual(blocks(p), [[0, 1, 2], [2]])

    def test_partial_block_counts_as_whole(self):
        # Kb = floor(B / 4): B = 9 still keeps 2 blocks, 6 positions (the forced partial block
        # is a whole one), B = 4 and 7 only the forced block, B = 0 too; B >= n = 10 keeps every
        # block.
        for B, want in ((0, [2]), (4, [2]), (7, [2]), (8, [0, 2]), (9, [0, 2]),
                        (10, [0, 1, 2]), (12, [0, 1, 2]), (2**31 - 1, [0, 1, 2])):
            p = self.plan(plan_shape="BLOCKS_SHARED", tokens_per_head=B)
            self.assertEqual(blocks(p), [want], f"B={B}")
        # A compression ratio gives B = int((1 - cr) * n) the same way.
        p = self.plan(plan_shape="BLOCKS_SHARED", tokens_per_head=None, compression_ratio=0.1)
        self.assertEqual(blocks(p), [[0, 2]])                  # B = 9
        p = self.plan(plan_shape="BLOCKS_SHARED", tokens_per_head=None, compression_ratio=0.0)
        self.assertEqual(blocks(p), [[0, 1, 2]])               # B = 10 = n

    def test_scores_and_sums_stay_ragged(self):
        ragged = self.plan(tokens_per_head=8, block_size=None)
        for shape in ref.BLOCK_SHAPES:
            p = self.plan(plan_shape=shape)
            np.testing.assert_array_equal(p["scores"], ragged["scores"])
            np.testing.assert_array_equal(p["layer_sums"], ragged["layer_sums"])
            self.assertEqual(p["quota"], ragged["quota"])

    def test_min_per_head_is_ignored(self):
        for shape in ref.BLOCK_SHAPES:
            a = self.plan(plan_shape=shape)
            b = self.plan(plan_shape=shape, min_per_head=5)
            np.testing.assert_array_equal(a["block_kept"], b["block_kept"])


class BlockEdges(unittest.TestCase):

    def test_fewer_blocks_than_forced(self):
        # n = 16, blocks of 4, sinks 5 ([0, 5): blocks 0 and 1), window 1 (block 3): 3 forced
        # blocks.  B = 8: Kb = 2 < 3, qb = 0: block 2 goes, the forced ones stay whole, so the
        # candidates 5, 6, 7 (block 1) and 12, 13, 14 (block 3) are kept.
        row = np.arange(1, 17) / 136.0
        p = ref.keep_plan(geo(), pol(tokens_per_head=8, sinks=5, plan_shape="BLOCKS_SHARED",
                                     block_size=4), [att_layer(row)], 16)
        self.assertEqual(blocks(p), [[0, 1, 3]])
        self.assertEqual(kept_sets(p), [[list(range(8)) + [12, 13, 14, 15]]])
        self.assertEqual((p["quota"], p["total_selected"]), (2, 6))
        self.assertTrue(np.isinf(p["block_scores"][0, [0, 1, 3]]).all())
        # Block 2's score is the sum of s over 8..11: (9 + 10 + 11 + 12) / sum(6..15) = 42 / 105
        self.assertAlmostEqual(p["block_scores"][0, 2], 42 / 105, places=15)

    def test_ties_go_to_the_lower_layer_then_block(self):
        # Uniform attention in two layers, blocks of 2 over n = 10: blocks 0..3 are candidates,
        # block 4 (8, 9) forced; every candidate block scores 2/9.  B = 6: qb = 2.
        row = [0.1] * 10
        layers = [att_layer(row), att_layer(row)]
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=6, plan_shape="BLOCKS_PER_LAYER",
                                        block_size=2), layers, 10)
        self.assertEqual(blocks(p), [[0, 1, 2, 3, 4], [4]])      # 4 pairs, all of layer 0
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=6, plan_shape="BLOCKS_PER_LAYER",
                                        block_size=2, allocation="PER_LAYER"), layers, 10)
        self.assertEqual(blocks(p), [[0, 1, 4], [0, 1, 4]])
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=6, plan_shape="BLOCKS_SHARED",
                                        block_size=2), layers, 10)
        self.assertEqual(blocks(p), [[0, 1, 4]])

    def test_block_scores_sum_over_kv_heads(self):
        # L = 1, Hkv = 2, n = 8, blocks of 2, window 7 (block 3 forced).
        # head 0 p = .4 .4 | .05 .05 | 0 0 | .1; head 1 p = 0 0 | .3 .3 | .2 .2 | 0; S = 2.
        # Blocks: (.8 + 0) / 2 = .4, (.1 + .6) / 2 = .35, (0 + .4) / 2 = .2.  B = 4: qb = 1.
        rows = [[.4, .4, .05, .05, 0, 0, .1, .5], [0, 0, .3, .3, .2, .2, 0, .5]]
        p = ref.keep_plan(geo(H=2, Hkv=2, D=2), pol(tokens_per_head=4,
                                                    plan_shape="BLOCKS_SHARED", block_size=2),
                          [att_layer(rows)], 8)
        np.testing.assert_allclose(p["block_scores"][0, :3], [.4, .35, .2], rtol=1e-15)
        self.assertEqual(kept_sets(p), [[[0, 1, 6, 7], [0, 1, 6, 7]]])

    def test_uniform_layer(self):
        # Layer 1 all zero: S_1 = 0, so its s is 1 / (Hkv * m) = 1/9 per candidate and each of
        # its candidate blocks scores 4/9 (GLOBAL_NORMALIZED); the pairs .375 (0,0), .125 (0,1),
        # .444 (1,0), .444 (1,1) give L * qb = 2 to layer 1.  GLOBAL_RAW: raw p = 0 there.
        layers = [att_layer(ROW0), att_layer([0.0] * 10)]
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=8, plan_shape="BLOCKS_PER_LAYER",
                                        block_size=4), layers, 10)
        np.testing.assert_allclose(p["block_scores"][1, :2], [4 / 9, 4 / 9], rtol=1e-15)
        self.assertEqual(blocks(p), [[2], [0, 1, 2]])

    def test_uniform_layer_order(self):
        layers = [att_layer(ROW0), att_layer([0.0] * 10)]
        p = ref.keep_plan(geo(L=2), pol(tokens_per_head=8, plan_shape="BLOCKS_PER_LAYER",
                                        block_size=4, allocation="GLOBAL_RAW"), layers, 10)
        np.testing.assert_array_equal(p["block_scores"][1, :2], [0.0, 0.0])
        self.assertEqual(blocks(p), [[0, 1, 2], [2]])

    def test_all_forced_and_short_sequences(self):
        # n = 3 <= window 4 (given as 4 rows of 3): everything is forced, any budget.
        att = np.full((1, 4, 3), 1 / 3)
        layer = {"attention": att, "values": np.ones((1, 3, 1)), "o_proj": np.eye(1)}
        for B in (0, 2, 3):
            p = ref.keep_plan(geo(), pol(window=4, tokens_per_head=B, plan_shape="BLOCKS_SHARED",
                                         block_size=2), [layer], 3)
            self.assertEqual(blocks(p), [[0, 1]])
            self.assertTrue(np.isinf(p["block_scores"]).all())
            self.assertEqual(p["total_selected"], 0)


class BaselineBlocks(unittest.TestCase):

    def test_streaming_llm_keeps_the_latest_blocks(self):
        # n = 10, blocks of 4, sinks 1 (block 0 forced): B = 9, Kb = 2, qb = 1: the latest
        # block, 2 (the partial one), not block 1.
        p = ref.keep_plan(geo(L=2), {"kind": "STREAMING_LLM", "sinks": 1, "tokens_per_head": 9,
                                     "plan_shape": "BLOCKS_SHARED", "block_size": 4},
                          [{}, {}], 10)
        self.assertEqual(blocks(p), [[0, 2]])
        np.testing.assert_array_equal(p["block_scores"], [[1.0, 0.0, 1.0]])
        self.assertEqual(kept_sets(p), [[[0, 1, 2, 3, 8, 9]]] * 2)
        ragged = ref.keep_plan(geo(L=2), {"kind": "STREAMING_LLM", "sinks": 1,
                                          "tokens_per_head": 9}, [{}, {}], 10)
        np.testing.assert_array_equal(p["scores"], ragged["scores"])      # its 1/0 score
        # No sinks, blocks of 3: [0,3) [3,6) [6,9) [9]; B = 6: the two latest, 2 and 3.
        p = ref.keep_plan(geo(L=2), {"kind": "STREAMING_LLM", "sinks": 0, "tokens_per_head": 6,
                                     "plan_shape": "BLOCKS_PER_LAYER", "block_size": 3},
                          [{}, {}], 10)
        self.assertEqual(blocks(p), [[2, 3], [2, 3]])
        np.testing.assert_array_equal(p["block_scores"], [[0, 0, 1, 1]] * 2)
        # Sinks over two blocks with B below them: the forced blocks stay, nothing else.
        p = ref.keep_plan(geo(), {"kind": "STREAMING_LLM", "sinks": 5, "tokens_per_head": 4,
                                  "plan_shape": "BLOCKS_SHARED", "block_size": 4}, [{}], 10)
        self.assertEqual(blocks(p), [[0, 1]])

    def snap_layers(self, seed=3, L=2, H=4, Hkv=2, d=4, n=40, wq=8):
        rng = np.random.default_rng(seed)
        return [{"keys": rng.standard_normal((Hkv, n, d)),
                 "queries": 3.0 * rng.standard_normal((H, wq, d)),
                 "keys_dtype": "bf16"} for _ in range(L)]

    def test_adakv_equals_snapkv(self):
        layers = self.snap_layers()
        g = geo(L=2, H=4, Hkv=2, d=4, D=8)
        for shape in ref.BLOCK_SHAPES:
            for mode in ("EXACT", "KVPRESS_COMPAT"):
                for bs in (1, 3, 8):
                    base = {"window": 8, "compression_ratio": 0.6, "numeric_mode": mode,
                            "plan_shape": shape, "block_size": bs}
                    snap = ref.keep_plan(g, dict(base, kind="SNAPKV"), layers, 40)
                    ada = ref.keep_plan(g, dict(base, kind="ADAKV"), layers, 40)
                    for key in ("kept", "block_kept", "block_scores", "scores"):
                        np.testing.assert_array_equal(ada[key], snap[key], err_msg=key)
        # Ragged ADAKV differs (its safeguard shows in the scores).
        ragged = ref.keep_plan(g, {"kind": "ADAKV", "window": 8, "compression_ratio": 0.6},
                               layers, 40)
        self.assertGreater(np.nanmax(ragged["scores"]), np.nanmax(snap["scores"]))

    def test_snapkv_block_scores_are_prefix_score_sums(self):
        layers = self.snap_layers(seed=5)
        g = geo(L=2, H=4, Hkv=2, d=4, D=8)
        for mode in ("EXACT", "KVPRESS_COMPAT"):
            base = {"kind": "SNAPKV", "window": 8, "tokens_per_head": 20, "numeric_mode": mode}
            ragged = ref.keep_plan(g, base, layers, 40)
            raw = ragged["raw"][:, :, :32]                   # prefix [0, 32): blocks 0..3 of 8
            p = ref.keep_plan(g, dict(base, plan_shape="BLOCKS_PER_LAYER", block_size=8),
                              layers, 40)
            np.testing.assert_allclose(p["block_scores"][:, :4],
                                       raw.reshape(2, 2, 4, 8).sum(axis=(1, 3)), rtol=1e-14)
            self.assertTrue(np.isinf(p["block_scores"][:, 4]).all())
            # B = 20: Kb = 2, the window block forced, qb = 1 per layer.
            for l in range(2):
                best = int(np.argmax(p["block_scores"][l, :4]))
                self.assertEqual(np.flatnonzero(p["block_kept"][l]).tolist(), [best, 4])
            np.testing.assert_array_equal(p["scores"], ragged["scores"])
            if mode == "KVPRESS_COMPAT":                     # rounded scores summed
                np.testing.assert_array_equal(raw, ref.round_to_dtype(raw, "bf16"))


class LayerUniform(unittest.TestCase):

    def test_laprox_layer_uniform_is_head_uniform_layers(self):
        att0 = [[.4, .3, .2, .1, 0.0], [.4, .3, .2, .1, 0.0]]
        att1 = [[.6, .25, .12, .03, 0.0], [0.0] * 5]
        layers = [att_layer(att0), att_layer(att1)]
        g = geo(L=2, H=2, Hkv=2, D=2)
        old = ref.keep_plan(g, pol(tokens_per_head=3, head_uniform_layers=True), layers, 5)
        for hu in (False, True):
            new = ref.keep_plan(g, pol(tokens_per_head=3, plan_shape="LAYER_UNIFORM",
                                       head_uniform_layers=hu), layers, 5)
            np.testing.assert_array_equal(new["kept"], old["kept"])
        # test_laprox_ref.Allocation.test_head_uniform_layers: T0 = 5 -> 3 + 2, T1 = 3 -> 2 + 1.
        self.assertEqual(kept_sets(old), [[[0, 1, 2, 4], [0, 1, 4]], [[0, 1, 4], [0, 4]]])
        ragged = ref.keep_plan(g, pol(tokens_per_head=3, plan_shape="RAGGED"), layers, 5)
        self.assertFalse(np.array_equal(ragged["kept"], old["kept"]))
        hu_ragged = ref.keep_plan(g, pol(tokens_per_head=3, plan_shape="RAGGED",
                                         head_uniform_layers=True), layers, 5)
        np.testing.assert_array_equal(hu_ragged["kept"], old["kept"])

    def test_baselines_unchanged(self):
        rng = np.random.default_rng(11)
        L, H, Hkv, d, D, n = 2, 4, 2, 4, 8, 50
        layers = [{"keys": rng.standard_normal((Hkv, n, d)),
                   "values": rng.standard_normal((Hkv, n, d)),
                   "o_proj": rng.standard_normal((D, H * d)),
                   "queries": 3.0 * rng.standard_normal((H, 8, d))} for _ in range(L)]
        g = geo(L=L, H=H, Hkv=Hkv, d=d, D=D)
        for kind in ("STREAMING_LLM", "SNAPKV", "PYRAMIDKV", "CRITICALKV", "CAKE"):
            base = {"kind": kind, "window": 8, "compression_ratio": 0.5}
            a = ref.keep_plan(g, base, layers, n)
            b = ref.keep_plan(g, dict(base, plan_shape="LAYER_UNIFORM"), layers, n)
            for key in ("kept", "scores"):
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{kind} {key}")
        # The baselines ignore head_uniform_layers, with every shape they accept.
        for kind, shape in (("ADAKV", "RAGGED"), ("SNAPKV", "BLOCKS_SHARED")):
            base = {"kind": kind, "window": 8, "compression_ratio": 0.5, "plan_shape": shape}
            if shape != "RAGGED":
                base["block_size"] = 4
            a = ref.keep_plan(g, base, layers, n)
            b = ref.keep_plan(g, dict(base, head_uniform_layers=True), layers, n)
            np.testing.assert_array_equal(a["kept"], b["kept"])


class Validation(unittest.TestCase):

    def bad(self, layers=None, **kw):
        kw.setdefault("tokens_per_head", 8)
        with self.assertRaises(ValueError) as cm:
            ref.keep_plan(geo(L=2), pol(**kw), layers or [att_layer(ROW0), att_layer(ROW1)], 10)
        return str(cm.exception)

    def test_policy(self):
        self.bad(plan_shape="BLOCKS")
        self.bad(plan_shape="blocks_shared", block_size=4)
        self.bad(plan_shape="BLOCKS_SHARED")                    # no block size, no table
        self.bad(plan_shape="BLOCKS_PER_LAYER", block_size=0)   # 0 is "not set"
        self.bad(plan_shape="BLOCKS_SHARED", block_size=65537)
        self.bad(plan_shape="BLOCKS_SHARED", block_size=-1)
        self.bad(plan_shape="BLOCKS_SHARED", block_size=2.0)
        self.bad(plan_shape="BLOCKS_SHARED", block_size=True)
        self.bad(block_size=4)                                  # RAGGED
        self.bad(plan_shape="RAGGED", block_size=4)
        self.bad(plan_shape="LAYER_UNIFORM", block_size=4)
        msg = self.bad(plan_shape="BLOCKS_SHARED", block_size=4, head_uniform_layers=True)
        self.assertIn("head_uniform_layers", msg)
        self.bad(plan_shape="BLOCKS_PER_LAYER", block_size=4, head_uniform_layers=True)
        ok = ref.keep_plan(geo(L=2), pol(tokens_per_head=8, plan_shape="BLOCKS_SHARED",
                                         block_size=65536),
                           [att_layer(ROW0), att_layer(ROW1)], 10)
        self.assertEqual((ok["num_blocks"], blocks(ok)), (1, [[0]]))
        ok = ref.keep_plan(geo(L=2), pol(tokens_per_head=8, block_size=0),
                           [att_layer(ROW0), att_layer(ROW1)], 10)
        self.assertNotIn("block_kept", ok)

    def test_kinds(self):
        g = geo()
        layer = {"attention": np.full((1, 1, 10), 0.1), "values": np.ones((1, 10, 1)),
                 "o_proj": np.eye(1)}
        for kind in ref.BASELINE_KINDS:
            for shape in ref.PLAN_SHAPES:
                p = {"kind": kind, "window": 1, "tokens_per_head": 5, "plan_shape": shape}
                if shape in ref.BLOCK_SHAPES:
                    p["block_size"] = 2
                valid = (kind in ("STREAMING_LLM", "SNAPKV", "ADAKV") if shape in
                         ref.BLOCK_SHAPES else
                         not (shape == "LAYER_UNIFORM" and kind in ("ADAKV", "CRITICAL_ADAKV")))
                if valid:
                    ref.keep_plan(g, p, [layer], 10)
                else:
                    with self.assertRaises(ValueError, msg=f"{kind} {shape}"):
                        ref.keep_plan(g, p, [layer], 10)


def flash_pool(keys, values, ids, bs, physical):
    """vLLM FlashAttention's [2, physical, bs, Hkv, d] pool, NaN where nothing was written."""
    Hkv, n, d = keys.shape
    pool = np.full((2, physical, bs, Hkv, d), np.nan)
    for i in range(n):
        pool[0, ids[i // bs], i % bs] = keys[:, i, :]
        pool[1, ids[i // bs], i % bs] = values[:, i, :]
    block = bs * Hkv * d
    layout = {"block_stride": block, "slot_stride": Hkv * d, "head_stride": d, "dim_stride": 1}
    return pool, dict(layout, offset=0), dict(layout, offset=physical * block)


def hnd_pool(keys, values, ids, bs, physical):
    """The interleaved [physical, 2, Hkv, bs, d] pool."""
    Hkv, n, d = keys.shape
    pool = np.full((physical, 2, Hkv, bs, d), np.nan)
    for i in range(n):
        pool[ids[i // bs], 0, :, i % bs] = keys[:, i, :]
        pool[ids[i // bs], 1, :, i % bs] = values[:, i, :]
    layout = {"block_stride": 2 * Hkv * bs * d, "slot_stride": d, "head_stride": bs * d,
              "dim_stride": 1}
    return pool, dict(layout, offset=0), dict(layout, offset=Hkv * bs * d)


class Paged(unittest.TestCase):

    def test_gather_both_layouts(self):
        rng = np.random.default_rng(1)
        Hkv, n, d = 2, 23, 3
        keys, values = rng.standard_normal((Hkv, n, d)), rng.standard_normal((Hkv, n, d))
        for bs in (1, 5, 32):
            nb = -(-n // bs)
            ids = rng.permutation(nb + 3)[:nb]
            table = {"block_size": bs, "ids": ids}
            for build in (flash_pool, hnd_pool):
                pool, kl, vl = build(keys, values, ids, bs, nb + 3)
                np.testing.assert_array_equal(ref.gather_paged(pool, table, kl, (Hkv, n, d)),
                                              keys)
                np.testing.assert_array_equal(ref.gather_paged(pool, table, vl, (Hkv, n, d)),
                                              values)

    def write_case(self, tmp, tables, policy, n=23, L=2, H=4, Hkv=2, d=3, D=6, wq=4, seed=2):
        """A case directory whose layer l reads keys and values from its own pool (flash
        layout) through tables[min(l, len(tables) - 1)]; returns the dense layers."""
        rng = np.random.default_rng(seed)
        doc_layers, dense = [], []
        for l in range(L):
            keys, values = rng.standard_normal((Hkv, n, d)), rng.standard_normal((Hkv, n, d))
            q, o = rng.standard_normal((H, wq, d)), rng.standard_normal((D, H * d))
            t = tables[min(l, len(tables) - 1)]
            pool, kl, vl = flash_pool(keys, values, t["ids"], t["block_size"],
                                      len(t["ids"]) + 2)
            np.save(os.path.join(tmp, f"pool_{l}.npy"), pool.astype(np.float32))
            np.save(os.path.join(tmp, f"q_{l}.npy"), q.astype(np.float32))
            np.save(os.path.join(tmp, f"o_{l}.npy"), o.astype(np.float32))
            idx = min(l, len(tables) - 1)
            paged = lambda lay: {"file": f"pool_{l}.npy", "dtype": "f32",  # noqa: E731
                                 "shape": [Hkv, n, d], "paged": dict(lay, table=idx)}
            plain = lambda f: {"file": f, "dtype": "f32", "slice_last": None,  # noqa: E731
                               "permute": None}
            doc_layers.append({"keys": paged(kl), "values": paged(vl),
                               "queries": plain(f"q_{l}.npy"), "o_proj": plain(f"o_{l}.npy"),
                               "attention": None, "lse": None})
            dense.append({"keys": keys.astype(np.float32).astype(np.float64),
                          "values": values.astype(np.float32).astype(np.float64),
                          "queries": q.astype(np.float32).astype(np.float64),
                          "o_proj": o.astype(np.float32).astype(np.float64)})
        doc = {"geometry": geo(L=L, H=H, Hkv=Hkv, d=d, D=D, scale=0.5), "n": n,
               "policy": policy, "layers": doc_layers,
               "block_tables": [{"block_size": t["block_size"], "ids": [int(x) for x in t["ids"]]}
                                for t in tables]}
        with open(os.path.join(tmp, "case.json"), "w") as fh:
            json.dump(doc, fh)
        return dense

    def test_block_size_and_tables_from_the_keys(self):
        # n = 23 in blocks of 5: 5 blocks, the last holds 3 positions.  One table per layer.
        tables = [{"block_size": 5, "ids": np.array([4, 0, 6, 2, 1])},
                  {"block_size": 5, "ids": np.array([3, 5, 0, 1, 2])}]
        policy = {"window": 4, "tokens_per_head": 12, "plan_shape": "BLOCKS_PER_LAYER",
                  "allocation": "PER_LAYER"}
        with tempfile.TemporaryDirectory() as tmp:
            dense = self.write_case(tmp, tables, policy)
            g, p, layers, n = ref.load_case(tmp)
        for l in range(2):
            np.testing.assert_array_equal(layers[l]["keys"], dense[l]["keys"])
            np.testing.assert_array_equal(layers[l]["values"], dense[l]["values"])
        plan = ref.keep_plan(g, p, layers, n)
        want = ref.keep_plan(g, dict(p, block_size=5), dense, n)
        self.assertEqual(plan["block_size"], 5)
        np.testing.assert_array_equal(plan["block_kept"], want["block_kept"])
        np.testing.assert_array_equal(plan["kept"], want["kept"])
        self.assertNotIn("new_block_table", want)             # contiguous: no table to report
        # B = 12: Kb = 2, the window [19, 23) is in block 3 and 4: qb = 0.  Use B = 17.
        plan = ref.keep_plan(g, dict(p, tokens_per_head=17), layers, n)
        for u in range(2):
            kept = plan["block_kept"][u]
            self.assertEqual(int(kept.sum()), 3)
            self.assertTrue(kept[3] and kept[4])
            np.testing.assert_array_equal(plan["new_block_table"][u], tables[u]["ids"][kept])
            np.testing.assert_array_equal(plan["freed_block_ids"][u], tables[u]["ids"][~kept])
        # BLOCKS_SHARED reads layers[0]'s table only.
        plan = ref.keep_plan(g, dict(p, tokens_per_head=17, plan_shape="BLOCKS_SHARED"), layers,
                             n)
        self.assertEqual(len(plan["new_block_table"]), 1)
        np.testing.assert_array_equal(plan["new_block_table"][0],
                                      tables[0]["ids"][plan["block_kept"][0]])

    def test_tables_must_agree_with_the_block_size(self):
        tables = [{"block_size": 5, "ids": np.array([4, 0, 6, 2, 1])},
                  {"block_size": 8, "ids": np.array([2, 0, 1])}]
        with tempfile.TemporaryDirectory() as tmp:
            self.write_case(tmp, tables, {})
            g, _, layers, n = ref.load_case(tmp)
        base = {"window": 4, "tokens_per_head": 12}
        ref.keep_plan(g, base, layers, n)                      # RAGGED: any tables
        for shape in ref.BLOCK_SHAPES:
            for bs in (None, 5, 8):
                with self.assertRaises(ValueError):
                    ref.keep_plan(g, dict(base, plan_shape=shape, block_size=bs), layers, n)

    def test_cli_writes_the_tables(self):
        tables = [{"block_size": 8, "ids": np.array([2, 0, 1])}]   # shared by both layers
        policy = {"window": 4, "tokens_per_head": 16, "plan_shape": "BLOCKS_PER_LAYER"}
        with tempfile.TemporaryDirectory() as tmp:
            self.write_case(tmp, tables, policy)
            plan = ref.run_case(tmp)
            got = np.load(os.path.join(tmp, "ref_out.npz"))
            np.testing.assert_array_equal(got["new_block_table"],
                                          np.concatenate(plan["new_block_table"]))
            np.testing.assert_array_equal(got["freed_block_ids_offsets"],
                                          np.cumsum([0] + [len(x) for x in
                                                           plan["freed_block_ids"]]))
            np.testing.assert_array_equal(got["block_kept"], plan["block_kept"])

    def test_a_wrong_read_is_refused(self):
        # A table that points a logical block at a NaN spare block makes the keys NaN.
        tables = [{"block_size": 8, "ids": np.array([2, 0, 1])}]
        with tempfile.TemporaryDirectory() as tmp:
            self.write_case(tmp, tables, {})
            with open(os.path.join(tmp, "case.json")) as fh:
                doc = json.load(fh)
            doc["block_tables"][0]["ids"] = [2, 0, 4]               # 4 is a spare block
            with open(os.path.join(tmp, "case.json"), "w") as fh:
                json.dump(doc, fh)
            g, _, layers, n = ref.load_case(tmp)
        with self.assertRaises(ValueError):
            ref.keep_plan(g, {"window": 4, "tokens_per_head": 12}, layers, n)


if __name__ == "__main__":
    unittest.main()
