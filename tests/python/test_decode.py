"""Decode re-plans (issue 37; tests/reference/SEMANTICS.md, "Decode re-plans") against the real
laproxd and the float64 oracle (laprox_ref.decode_keep_plan).

A decode re-plan sends the cache an engine holds after earlier plans: per layer n_l entries per
KV head (layers differ), each entry's token position, and the queries of the most recent tokens.
These tests check that the plan equals the oracle's for every allocation and plan shape, that a
cache holding every position gives the prefill plan, and that each malformed cache is refused
with INVALID_ARGUMENT naming the field and values.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Decode
"""

import unittest

import numpy as np

import support

support.prepare_package()

import grpc  # noqa: E402

import laprox  # noqa: E402
from laprox import _proto, _staging  # noqa: E402

SERVER = None  # the module's laproxd, started by setUpModule
setUpModule, tearDownModule = support.module_laproxd(globals())

G = support.GEOMETRY
L, H, HKV, D = G["L"], G["H"], G["Hkv"], G["d"]
WQ = 16
BUDGET = 64
TOKENS = 1000  # tokens of the sequence so far: the window is positions [TOKENS - WQ, TOKENS)


def decode_case(lengths, seed=7, sinks=0):
    """Random inputs of a decode re-plan: per layer keys/values [Hkv, n_l, d], queries
    [H, WQ, d] and positions [Hkv, n_l] (the first `sinks` positions 0 .. sinks - 1, then
    random distinct earlier tokens, then the window's TOKENS - WQ .. TOKENS - 1)."""
    rng = np.random.default_rng(seed)
    case = dict(keys=[], values=[], queries=[], positions=[], lengths=list(lengths))
    for n_l in lengths:
        case["keys"].append(rng.standard_normal((HKV, n_l, D)).astype(np.float32))
        case["values"].append((rng.standard_normal((HKV, n_l, D)) *
                               rng.uniform(0.2, 3.0, (HKV, n_l, 1))).astype(np.float32))
        case["queries"].append(rng.standard_normal((H, WQ, D)).astype(np.float32))
        rows = []
        for _ in range(HKV):
            middle = rng.choice(np.arange(sinks, TOKENS - WQ), n_l - WQ - sinks, replace=False)
            rows.append(np.concatenate([np.arange(sinks), np.sort(middle),
                                        np.arange(TOKENS - WQ, TOKENS)]))
        case["positions"].append(np.stack(rows).astype(np.int64))
    return case


def oracle(case, o_proj, policy):
    geometry = dict(G, scale=1.0 / np.sqrt(D))
    layers = [dict(keys=np.asarray(case["keys"][l], np.float64),
                   values=np.asarray(case["values"][l], np.float64),
                   queries=np.asarray(case["queries"][l], np.float64),
                   o_proj=np.asarray(o_proj[l], np.float64)) for l in range(L)]
    return support.laprox_ref.decode_keep_plan(geometry, policy, layers, case["positions"])


class DecodeTestCase(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.o_proj = support.make_case()["o_proj"]
        with laprox.Client(SERVER.target) as client:
            g = laprox.ModelGeometry(num_layers=L, num_heads=H, num_kv_heads=HKV, head_dim=D,
                                     hidden_size=G["D"])
            cls.model = client.register_model("py-decode", g, cls.o_proj)

    def setUp(self):
        self.client = laprox.Client(SERVER.target, timeout=30)
        self.addCleanup(self.client.close)

    def replan(self, case, **kwargs):
        kwargs.setdefault("budget", BUDGET)
        kwargs.setdefault("window", WQ)
        return self.client.compute_keep_plan(
            self.model, case["keys"], case["values"], window_queries=case["queries"],
            cache_positions=case["positions"], **kwargs)

    def assertMatchesOracle(self, plan, case, ref):
        masks = plan.to_masks()
        self.assertEqual(masks.shape, ref["kept"].shape)
        self.assertEqual(support.kept_differences(masks, ref), [])
        np.testing.assert_array_equal(plan.counts, masks.sum(axis=2))
        self.assertEqual(plan.quota, ref["quota"])
        self.assertEqual(plan.selected_total, ref["total_selected"])
        for l in range(L):
            self.assertFalse(masks[l, :, case["lengths"][l]:].any(), "kept past the layer")
            for g in range(HKV):
                # Token positions in the response, entry indices from kept_entries().
                entries = plan.kept_entries(l, g)
                np.testing.assert_array_equal(np.flatnonzero(masks[l, g]), entries)
                np.testing.assert_array_equal(plan.kept(l, g), case["positions"][l][g][entries])


class DecodeMatchesOracleTest(DecodeTestCase):

    LENGTHS = (200, 137, 90)

    def check(self, server_policy, oracle_policy, lengths=LENGTHS, sinks=0, budget=BUDGET):
        case = decode_case(lengths, sinks=sinks)
        plan = self.replan(case, budget=budget, **server_policy)
        ref = oracle(case, self.o_proj, dict(window=WQ, tokens_per_head=budget, **oracle_policy))
        self.assertMatchesOracle(plan, case, ref)
        return plan, ref

    def test_default_policy(self):
        plan, ref = self.check({}, {})
        # The budget holds on average: window + L * Hkv * q selected, over L * Hkv heads.
        self.assertEqual(plan.counts.sum(), L * HKV * BUDGET)
        # Layers do not keep the same counts: the allocation is model-wide.
        self.assertGreater(len({int(c) for c in plan.counts.sum(axis=1)}), 1)

    def test_allocations(self):
        for allocation in ("per_layer", "uniform", "global_raw"):
            with self.subTest(allocation=allocation):
                self.check(dict(allocation=allocation), dict(allocation=allocation.upper()))

    def test_sinks_reservations_cap_and_layer_uniform(self):
        self.check(dict(sinks=4), dict(sinks=4), sinks=4)
        self.check(dict(min_per_head=10), dict(min_per_head=10))
        self.check(dict(max_layer_share=1.25), dict(max_layer_share=1.25))
        plan, _ = self.check(dict(plan_shape="layer_uniform"), dict(plan_shape="LAYER_UNIFORM"))
        for l in range(L):
            self.assertLessEqual(np.ptp(plan.counts[l]), 1)

    def test_pooling_and_value_modes(self):
        self.check(dict(pooling="max", pool_kernel=5), dict(pooling="MAX", pool_kernel=5))
        self.check(dict(gqa_value="mean_head_norm"), dict(gqa_value="MEAN_HEAD_NORM"))
        self.check(dict(pooling="none"), dict(pooling="NONE"))

    def test_layers_with_fewer_candidates_than_the_quota_keep_them_all(self):
        # q = 64 - 16 = 48 per head; layer 2 holds 30 - 16 = 14 candidates per head, which a
        # head's own quota (UNIFORM) takes all of.
        plan, _ = self.check(dict(allocation="uniform"), dict(allocation="UNIFORM"),
                             lengths=(120, 200, 30))
        np.testing.assert_array_equal(plan.counts[2], [30] * HKV)
        self.assertEqual(plan.selected_total, HKV * (48 + 48 + 14))
        # The model-wide competition: 44 + 34 + 24 candidates per head, fewer than K = 288.
        plan, _ = self.check({}, {}, lengths=(60, 50, 40))
        np.testing.assert_array_equal(plan.counts, [[60] * HKV, [50] * HKV, [40] * HKV])
        self.assertEqual(plan.selected_total, HKV * (44 + 34 + 24))

    def test_a_cache_holding_every_position_gives_the_prefill_plan(self):
        n = 150
        case = decode_case((n,) * L)
        case["positions"] = [np.tile(np.arange(n), (HKV, 1)) for _ in range(L)]
        for policy in ({}, dict(allocation="per_layer"), dict(plan_shape="layer_uniform")):
            with self.subTest(policy=policy):
                replan = self.replan(case, **policy)
                prefill = self.client.compute_keep_plan(
                    self.model, case["keys"], case["values"], window_queries=case["queries"],
                    budget=BUDGET, window=WQ, **policy)
                np.testing.assert_array_equal(replan.positions, prefill.positions)
                np.testing.assert_array_equal(replan.counts, prefill.counts)

    def test_a_batch_plans_each_sequence_as_alone(self):
        a, b = decode_case((100, 60, 80), seed=1), decode_case((40, 90, 70), seed=2)
        sequences = [dict(keys=c["keys"], values=c["values"], window_queries=c["queries"],
                          cache_positions=c["positions"], budget=BUDGET, window=WQ)
                     for c in (a, b)]
        plans = self.client.compute_keep_plans(self.model, sequences)
        for plan, case in zip(plans, (a, b)):
            alone = self.replan(case)
            np.testing.assert_array_equal(plan.positions, alone.positions)

    def test_paged_layers_read_through_one_table_each_equal_the_dense_plan(self):
        # An engine's paged cache (vLLM FlashAttention layout, shared memory): one sequence's
        # table of 7 blocks of 16; layer l reads its first ceil(n_l / 16) ids.
        case = decode_case((100, 70, 45))
        rng = np.random.default_rng(3)
        table = rng.permutation(12)[:7].astype(np.int32)
        keys, values = [], []
        for l, n_l in enumerate(case["lengths"]):
            pool = self.client.shared_array((2, 12, 16, HKV, D), "float32")
            self.addCleanup(pool.close)
            pool.array[...] = np.nan  # a slot read by mistake poisons the plan
            i = np.arange(n_l)
            pool.array[0][table[i // 16], i % 16] = case["keys"][l].transpose(1, 0, 2)
            pool.array[1][table[i // 16], i % 16] = case["values"][l].transpose(1, 0, 2)
            k, v = laprox.PagedKV.vllm_flash_attn(pool, table, n_l)
            keys.append(k)
            values.append(v)
        paged = self.replan(dict(case, keys=keys, values=values))
        dense = self.replan(case)
        np.testing.assert_array_equal(paged.positions, dense.positions)
        np.testing.assert_array_equal(paged.counts, dense.counts)

    def test_the_comparison_detects_a_wrong_plan(self):
        # The oracle with another allocation than the server's must disagree: the comparison
        # above can fail.
        case = decode_case(self.LENGTHS)
        plan = self.replan(case)
        ref = oracle(case, self.o_proj, dict(window=WQ, tokens_per_head=BUDGET,
                                             allocation="PER_LAYER"))
        self.assertNotEqual(support.kept_differences(plan.to_masks(), ref), [])


class DecodeBadInputTest(DecodeTestCase):
    """Each malformed cache: INVALID_ARGUMENT naming the field and values."""

    def assertRefused(self, case, *needles, code=grpc.StatusCode.INVALID_ARGUMENT, **kwargs):
        with self.assertRaises(laprox.LaproxError) as caught:
            self.replan(case, **kwargs)
        self.assertEqual(caught.exception.code, code, caught.exception.message)
        for needle in needles:
            self.assertIn(needle, caught.exception.message)

    def test_repeated_and_out_of_order_positions(self):
        case = decode_case((100, 80, 60))
        case["positions"][1][0][5] = case["positions"][1][0][4]
        self.assertRefused(case, "cache.layers[1].positions, KV head 0, entries 4 and 5",
                           "repeat a token")
        case = decode_case((100, 80, 60))
        row = case["positions"][2][1]
        row[7], row[8] = row[8], row[7]
        self.assertRefused(case, "cache.layers[2].positions, KV head 1, entries 7 and 8",
                           f"positions {row[7]} and {row[8]} are out of order")
        case = decode_case((100, 80, 60))
        case["positions"][0][0][0] = -3
        self.assertRefused(case, "cache.layers[0].positions, KV head 0, entry 0: position -3")

    def test_a_window_longer_than_the_cache(self):
        case = decode_case((100, 80, WQ))
        case["keys"][2] = case["keys"][2][:, :WQ - 4]
        case["values"][2] = case["values"][2][:, :WQ - 4]
        case["positions"][2] = case["positions"][2][:, 4:]
        self.assertRefused(case, "the window is longer than the cache", f"{WQ} window rows",
                           f"holds {WQ - 4} entries")

    def test_window_tokens_must_be_the_same_most_recent_ones(self):
        case = decode_case((100, 80, 60))
        case["positions"][1][1][-WQ:] += np.arange(WQ)  # not consecutive
        self.assertRefused(case, "cache.layers[1].positions, KV head 1: the last 16 entries",
                           "not 16 consecutive")
        case = decode_case((100, 80, 60))
        case["positions"][2][:, -WQ:] += 5  # consecutive, but later than layer 0's
        self.assertRefused(case, "cache.layers[2].positions, KV head 0",
                           f"start at position {TOKENS - WQ + 5}",
                           "every head holds the same most recent tokens")

    def test_policies_a_decode_replan_does_not_take(self):
        case = decode_case((100, 80, 60))
        self.assertRefused(case, "takes policy.kind = LAPROX, not SNAPKV", kind="snapkv")
        self.assertRefused(case, "RAGGED or LAYER_UNIFORM, not BLOCKS_SHARED",
                           plan_shape="blocks_shared", block_size=16)
        self.assertRefused(case, "budget.tokens_per_head", budget=0.5)

    def raw(self, case, edit):
        """The request as the client builds it, edited by `edit(request)`, then sent."""
        request = _proto.pb.ComputeKeepMaskRequest()
        staging = _staging._Staging()
        _staging._fill_keep_plan_request(
            request, self.model, laprox.SequenceInputs(
                case["keys"], case["values"], case["queries"], budget=BUDGET, window=WQ,
                cache_positions=case["positions"]), staging)
        edit(request)
        return self.client._stage_and_call(staging, self.client._stub.ComputeKeepMask, request,
                                          None)

    def assertRawRefused(self, edit, *needles):
        with self.assertRaises(laprox.LaproxError) as caught:
            self.raw(decode_case((100, 80, 60)), edit)
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT,
                         caught.exception.message)
        for needle in needles:
            self.assertIn(needle, caught.exception.message)

    def test_counts_that_do_not_match(self):
        self.assertRawRefused(lambda r: r.cache.layers[1].positions.pop(),
                              "cache.layers[1].positions has 159 values, expected 2 KV heads "
                              "x 80 entries = 160")
        self.assertRawRefused(lambda r: r.cache.layers.pop(), "cache.layers has 2 layers, "
                              "the model has 3")
        self.assertRawRefused(lambda r: setattr(r, "n", 120),
                              "n = 120 must be the longest layer's entries, 100")
        self.assertRawRefused(lambda r: setattr(r.cache.layers[2], "entries", 0),
                              "cache.layers[2].entries = 0 is outside [1, n = 100]")
        # A cache with no layers is a decode re-plan all the same (a fuzz finding: it was
        # planned as a prefill, then its positions were read past the empty list).
        self.assertRawRefused(lambda r: r.cache.ClearField("layers"),
                              "cache.layers is empty; a decode re-plan gives one per model layer")

    def test_window_attention_is_refused(self):
        def to_attention(request):
            att = np.full((H, WQ, 100), 1.0 / 100, np.float32)
            request.layers[0].window_attention.CopyFrom(_proto.pb.TensorRef(
                inline_bytes=att.tobytes(), dtype=_proto.pb.DTYPE_F32, shape=list(att.shape)))
        self.assertRawRefused(to_attention, "layers[0].window_attention is given; a decode "
                              "re-plan takes window_queries only")


if __name__ == "__main__":
    unittest.main()
