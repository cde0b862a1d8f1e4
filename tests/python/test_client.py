"""Tests of the laprox Python client against the real laproxd binary and the float64 oracle.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd [-k NAME]
        (ctest -R python_client does the same). One laproxd serves the whole module, on a
        temporary Unix socket with metrics off. Inputs are seeded (support.SEED); kept sets
        must equal the oracle's up to swaps among near-ties.
Extend: add a test method; use self.client (a fresh Client per test) and support.make_case().
"""

import gc
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import unittest

import numpy as np

import support

support.prepare_package()

import grpc  # noqa: E402

import laprox  # noqa: E402
from laprox import _proto  # noqa: E402

SERVER = None  # the module's laproxd, started by setUpModule
setUpModule, tearDownModule = support.module_laproxd(globals())


LAPROX_POLICY = dict(window=16)  # the case has 16 window rows; the rest are the defaults
BUDGET = 64


def geometry():
    g = support.GEOMETRY
    return laprox.ModelGeometry(num_layers=g["L"], num_heads=g["H"], num_kv_heads=g["Hkv"],
                                head_dim=g["d"], hidden_size=g["D"])


class ClientTestCase(unittest.TestCase):
    """A fresh Client per test and one registered model per class."""

    @classmethod
    def setUpClass(cls):
        cls.case = support.make_case()
        with laprox.Client(SERVER.target) as client:
            cls.model = client.register_model("py-test", geometry(), cls.case["o_proj"])

    def setUp(self):
        self.client = laprox.Client(SERVER.target, timeout=30)
        self.prefix = f"laprox-py-{os.getpid()}-"

    def tearDown(self):
        self.client.close()
        self.assertEqual(support.shm_names(self.prefix), [], "staging regions left behind")

    def plan(self, client=None, case=None, **kwargs):
        case = case or self.case
        kwargs.setdefault("budget", BUDGET)
        if "policy" not in kwargs:
            for key, value in LAPROX_POLICY.items():
                kwargs.setdefault(key, value)
        return (client or self.client).compute_keep_plan(
            self.model, kwargs.pop("keys", case["keys"]), kwargs.pop("values", case["values"]),
            kwargs.pop("window_queries", case["queries"]), **kwargs)

    def assertMatchesOracle(self, plan, ref, tie_rtol=1e-5):
        masks = plan.to_masks()
        self.assertEqual(masks.shape, ref["kept"].shape)
        problems = support.kept_differences(masks, ref, tie_rtol)
        self.assertEqual(problems, [], f"seed {support.SEED}")
        np.testing.assert_array_equal(plan.counts, masks.sum(axis=2))

    def our_regions(self):
        """Regions the server holds that this process created."""
        with laprox.Client(SERVER.target) as observer:
            return [r for r in observer.list_regions() if r.name.startswith(self.prefix)]


class ProtoMirrorTest(unittest.TestCase):
    """The Python types cover the proto exactly (catches a proto that grew)."""

    def test_enums_match_the_proto(self):
        pb = _proto.pb
        for enum_type, prefix in laprox.types._PREFIXES.items():
            descriptor = pb.DESCRIPTOR.enum_types_by_name[enum_type.__name__]
            wire = {v.name[len(prefix):]: v.number for v in descriptor.values if v.number != 0}
            self.assertEqual({m.name: m.value for m in enum_type}, wire, enum_type.__name__)

    def test_policy_has_every_proto_field(self):
        fields = set(_proto.pb.Policy.DESCRIPTOR.fields_by_name)
        self.assertEqual(set(laprox.types.POLICY_FIELDS), fields)

    def test_enum_names_parse(self):
        self.assertIs(laprox.PolicyKind.parse("snapkv"), laprox.PolicyKind.SNAPKV)
        self.assertIs(laprox.PolicyKind.parse("POLICY_KIND_CRITICAL_ADAKV"),
                      laprox.PolicyKind.CRITICAL_ADAKV)
        self.assertIs(laprox.Allocation.parse("per-layer"), laprox.Allocation.PER_LAYER)
        self.assertIs(laprox.Pooling.parse(2), laprox.Pooling.MAX)
        self.assertIs(laprox.PoolTarget.parse("score"), laprox.PoolTarget.SCORE)
        self.assertIs(laprox.PolicyPreset.parse("POLICY_PRESET_PAPER"), laprox.PolicyPreset.PAPER)
        with self.assertRaises(laprox.LaproxError) as e:
            laprox.PolicyKind.parse("h2o")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_policy_round_trips_through_the_proto(self):
        policy = laprox.Policy(kind="cake", window=8, pooling="max", head_uniform_layers=True,
                               cake_gamma=3.5, extra={"min_per_head": 2})
        message = _proto.pb.Policy()
        with self.assertWarnsRegex(DeprecationWarning, "plan_shape='layer_uniform'"):
            _proto.policy_to_proto(policy, message)  # still sent: laproxd honours it
        back = _proto.policy_from_proto(message)
        self.assertEqual(back.kind, laprox.PolicyKind.CAKE)
        self.assertEqual((back.window, back.pooling, back.cake_gamma, back.min_per_head),
                         (8, laprox.Pooling.MAX, 3.5, 2))
        self.assertIsNone(back.pool_kernel)
        self.assertTrue(back.head_uniform_layers)
        message = _proto.pb.Policy()
        _proto.policy_to_proto(laprox.Policy(pool_target="attention", preset="paper"), message)
        self.assertEqual((message.pool_target, message.preset),
                         (_proto.pb.POOL_TARGET_ATTENTION, _proto.pb.POLICY_PRESET_PAPER))
        back = _proto.policy_from_proto(message)
        self.assertEqual((back.pool_target, back.preset),
                         (laprox.PoolTarget.ATTENTION, laprox.PolicyPreset.PAPER))


class InfoTest(ClientTestCase):

    def test_info_describes_the_cpu_server(self):
        info = self.client.info()
        self.assertRegex(info.version, r"^\d+\.\d+\.\d+")
        self.assertEqual(info.backend, "cpu")
        self.assertIn(laprox.PolicyKind.LAPROX, info.supported_policies)
        self.assertEqual(set(info.supported_dtypes),
                         {laprox.DType.F32, laprox.DType.F16, laprox.DType.BF16})
        self.assertIn(laprox.RegionKind.SHM, info.supported_region_kinds)
        self.assertGreater(info.limits.max_tokens, 0)
        self.assertGreater(info.limits.max_window, 0)
        self.assertEqual(info.limits.max_request_bytes, 256 << 20)  # laproxd's default
        self.assertEqual(info.limits.max_response_bytes, (1 << 31) - 1)
        self.assertEqual(info.limits.max_request_work, 1 << 42)  # the CPU backend's default
        self.assertEqual(info.limits.heavy_request_work, 1 << 34)
        self.assertTrue(self.client.health())
        self.assertTrue(self.client.health("laprox.v1.Laprox"))  # a model is registered


class OracleTest(ClientTestCase):

    def test_laprox_plan_matches_oracle(self):
        plan = self.plan(outputs=("positions", "scores"))
        ref = support.oracle(self.case, dict(LAPROX_POLICY, tokens_per_head=BUDGET))
        self.assertMatchesOracle(plan, ref)
        self.assertEqual((plan.quota, plan.selected_total), (ref["quota"], ref["total_selected"]))
        cand = ~np.isnan(ref["scores"])
        np.testing.assert_allclose(plan.scores[cand], ref["scores"][cand], rtol=1e-4, atol=1e-9)
        self.assertTrue(np.all(np.isinf(plan.scores[~cand])))
        np.testing.assert_allclose(plan.layer_sums, ref["layer_sums"], rtol=1e-4)
        self.assertEqual(plan.effective_policy.kind, laprox.PolicyKind.LAPROX)
        self.assertEqual(plan.effective_policy.window, 16)
        self.assertGreater(plan.timing.total_seconds, 0)

    def test_per_layer_lists_equal_stacked_arrays(self):
        c = self.case
        stacked = self.plan()
        listed = self.plan(keys=list(c["keys"]), values=list(c["values"]),
                           window_queries=list(c["queries"]))
        np.testing.assert_array_equal(stacked.positions, listed.positions)

    def test_compression_ratio_and_policy_options(self):
        policy = laprox.Policy(window=16, allocation="per_layer", pooling="max", pool_kernel=5,
                               sinks=4)
        plan = self.plan(policy=policy, budget=0.75)
        ref = support.oracle(self.case, dict(LAPROX_POLICY, allocation="PER_LAYER",
                                             pooling="MAX", pool_kernel=5, sinks=4,
                                             compression_ratio=0.75))
        self.assertMatchesOracle(plan, ref)
        self.assertEqual(plan.tokens_per_head, int(0.25 * self.case["n"]))
        self.assertEqual(plan.sinks, 4)

    def test_snapkv_baseline_by_name_matches_oracle(self):
        plan = self.plan(kind="snapkv")
        ref = support.oracle(self.case, dict(kind="SNAPKV", window=16,
                                             tokens_per_head=BUDGET))
        self.assertMatchesOracle(plan, ref)
        self.assertEqual(plan.effective_policy.kind, laprox.PolicyKind.SNAPKV)
        self.assertEqual(plan.effective_policy.pool_kernel, 5)  # SnapKV's default

    def test_pool_target_matches_oracle(self):
        for target in ("ATTENTION", "SCORE"):
            plan = self.plan(pool_target=target.lower(), gqa_value="mean_head_product")
            ref = support.oracle(self.case, dict(LAPROX_POLICY, pool_target=target,
                                                 gqa_value="MEAN_HEAD_PRODUCT",
                                                 tokens_per_head=BUDGET))
            self.assertMatchesOracle(plan, ref)
            self.assertEqual(plan.effective_policy.pool_target, laprox.PoolTarget[target])
        # Not set: the mode's placement, which the response names.
        self.assertEqual(self.plan().effective_policy.pool_target, laprox.PoolTarget.SCORE)
        self.assertEqual(self.plan(gqa_value="mean_head_norm").effective_policy.pool_target,
                         laprox.PoolTarget.ATTENTION)

    def test_unset_options_are_the_defaults_and_the_response_names_them(self):
        applied = self.plan().effective_policy
        self.assertEqual((applied.gqa_value, applied.pooling, applied.pool_kernel,
                          applied.pool_target),
                         (laprox.GqaValue.MEAN_HEAD_PRODUCT, laprox.Pooling.AVG_PEAK, 31,
                          laprox.PoolTarget.SCORE))
        # Indicator ATTENTION takes only MEAN_HEAD_NORM: an unset gqa_value is that one.
        plan = self.plan(indicator="attention")
        ref = support.oracle(self.case, dict(LAPROX_POLICY, indicator="ATTENTION",
                                             tokens_per_head=BUDGET))
        self.assertMatchesOracle(plan, ref)
        self.assertEqual(plan.effective_policy.gqa_value, laprox.GqaValue.MEAN_HEAD_NORM)
        with self.assertRaises(laprox.LaproxError) as e:
            self.plan(indicator="attention", gqa_value="exact_block")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("EXACT_BLOCK", e.exception.message)

    def test_paper_preset_fills_unset_fields(self):
        # The case has 16 window rows: the explicit window wins over the preset's 32.
        plan = self.plan(policy=laprox.Policy(preset="paper", window=16))
        ref = support.oracle(self.case, dict(window=16, gqa_value="SUMMED_PROJECTION",
                                             pooling="NONE", tokens_per_head=BUDGET))
        self.assertMatchesOracle(plan, ref)
        applied = plan.effective_policy
        self.assertEqual((applied.gqa_value, applied.pooling, applied.window, applied.preset),
                         (laprox.GqaValue.SUMMED_PROJECTION, laprox.Pooling.NONE, 16, None))
        with self.assertRaises(laprox.LaproxError) as e:
            self.plan(policy=laprox.Policy(preset="paper", kind="snapkv", window=16))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("preset", e.exception.message)
        self.assertIn("kind", e.exception.message)

    def test_window_attention_input_matches_oracle(self):
        g, c = support.GEOMETRY, self.case
        attention = np.stack([
            laprox_ref_attention(c["queries"][l], c["keys"][l], c["n"], g)
            for l in range(g["L"])]).astype(np.float32)
        plan = self.client.compute_keep_plan(self.model, c["keys"], c["values"],
                                             window_attention=attention, budget=BUDGET,
                                             **LAPROX_POLICY)
        self.assertMatchesOracle(plan, support.oracle(self.case, dict(LAPROX_POLICY,
                                                                      tokens_per_head=BUDGET)))

    def test_strided_inputs_match_contiguous(self):
        c = self.case
        # Engine layout [n, Hkv, d] seen as [Hkv, n, d]: non-contiguous views.
        keys_nhd = np.ascontiguousarray(c["keys"].transpose(0, 2, 1, 3))
        values_nhd = np.ascontiguousarray(c["values"].transpose(0, 2, 1, 3))
        keys = keys_nhd.transpose(0, 2, 1, 3)
        values = values_nhd.transpose(0, 2, 1, 3)
        queries = np.asfortranarray(c["queries"])
        self.assertFalse(keys.flags.c_contiguous or queries.flags.c_contiguous)
        plan = self.plan(keys=keys, values=values, window_queries=queries)
        np.testing.assert_array_equal(plan.positions, self.plan().positions)
        self.assertMatchesOracle(plan, support.oracle(c, dict(LAPROX_POLICY,
                                                              tokens_per_head=BUDGET)))

    def test_float16_inputs_match_oracle_on_rounded_values(self):
        c = self.case
        k16, v16, q16 = (c[x].astype(np.float16) for x in ("keys", "values", "queries"))
        plan = self.plan(keys=k16, values=v16, window_queries=q16)
        ref = support.oracle(c, dict(LAPROX_POLICY, tokens_per_head=BUDGET), keys=k16,
                             values=v16, queries=q16)
        self.assertMatchesOracle(plan, ref)

    def test_bfloat16_bits_match_oracle_on_rounded_values(self):
        c = self.case
        kb, vb = support.to_bf16_bits(c["keys"]), support.to_bf16_bits(c["values"])
        plan = self.plan(keys=kb, values=vb, dtype="bf16")
        ref = support.oracle(c, dict(LAPROX_POLICY, tokens_per_head=BUDGET),
                             keys=support.from_bf16_bits(kb), values=support.from_bf16_bits(vb))
        self.assertMatchesOracle(plan, ref)
        with self.assertRaises(laprox.LaproxError) as e:
            self.plan(keys=kb, values=vb)  # uint16 without dtype="bf16"
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_float64_inputs_are_sent_as_float32(self):
        c = self.case
        plan = self.plan(keys=c["keys"].astype(np.float64), values=c["values"].astype(np.float64))
        np.testing.assert_array_equal(plan.positions, self.plan().positions)

    def test_inline_tensors_give_the_same_plan_without_a_region(self):
        with laprox.Client(SERVER.target, inline_max_bytes=64 << 20) as inline:
            plan = self.plan(client=inline)
            self.assertIsNone(inline.staging_region)
            self.assertEqual(self.our_regions(), [])
        np.testing.assert_array_equal(plan.positions, self.plan().positions)


def laprox_ref_attention(queries, keys, n, g):
    """The oracle's causal window attention rows [H, wq, n] for all wq query rows."""
    G = g["H"] // g["Hkv"]
    return support.laprox_ref.window_attention(
        queries.astype(np.float64), keys.astype(np.float64), 1.0 / np.sqrt(g["d"]), n,
        queries.shape[1], G)


class KeepPlanTest(ClientTestCase):

    def test_masks_positions_and_bitmask_agree(self):
        plan = self.plan(outputs=laprox.Outputs(positions=True, bitmask=True))
        masks = plan.to_masks()
        L, Hkv, n = masks.shape
        self.assertEqual((L, Hkv, n), (plan.num_layers, plan.num_kv_heads, self.case["n"]))
        self.assertEqual(plan.bitmask.shape, (L, Hkv, (n + 7) // 8))
        unpacked = np.unpackbits(plan.bitmask, axis=2, bitorder="little")[:, :, :n]
        np.testing.assert_array_equal(unpacked.astype(bool), masks)
        for l in range(L):
            for g in range(Hkv):
                np.testing.assert_array_equal(plan.kept(l, g), np.flatnonzero(masks[l, g]))
        np.testing.assert_array_equal(plan.counts, masks.sum(axis=2))
        self.assertEqual(len(plan.kept_positions()), L)
        # The window is always kept.
        self.assertTrue(masks[:, :, n - plan.window:].all())

    def test_bitmask_only_plan_still_gives_masks(self):
        plan = self.plan(outputs={"positions": False, "bitmask": True})
        self.assertIsNone(plan.positions)
        np.testing.assert_array_equal(plan.to_masks(), self.plan().to_masks())
        np.testing.assert_array_equal(plan.kept(1, 1), self.plan().kept(1, 1))


class StagingRegionTest(ClientTestCase):

    def test_region_is_registered_once_and_reused(self):
        ids = []
        for _ in range(3):
            self.plan()
            ids.append(self.client.staging_region.region_id)
        region = self.client.staging_region
        self.assertEqual(len(set(ids)), 1)
        self.assertEqual(region.registrations, 1)
        ours = self.our_regions()
        self.assertEqual([(r.region_id, r.name) for r in ours], [(region.region_id, region.name)])
        self.assertEqual(support.shm_names(self.prefix), [region.name])

    def test_region_grows_when_a_call_needs_more(self):
        self.plan()
        small = self.client.staging_region
        big = support.make_case(n=small.byte_size // (4 * 16 * 2 * 3) + 64)
        plan = self.plan(case=big)
        grown = self.client.staging_region
        self.assertEqual(plan.n, big["n"])
        self.assertEqual(grown.registrations, 2)
        self.assertGreater(grown.byte_size, small.byte_size)
        self.assertEqual([r.region_id for r in self.our_regions()], [grown.region_id])
        self.assertEqual(support.shm_names(self.prefix), [grown.name])
        self.plan()  # a small call after growing reuses the big region
        self.assertEqual(self.client.staging_region, grown)

    def test_close_unregisters_and_unlinks(self):
        self.plan()
        name = self.client.staging_region.name
        self.client.close()
        self.assertEqual(self.our_regions(), [])
        self.assertFalse(os.path.exists("/dev/shm/" + name))
        self.client.close()  # idempotent
        with self.assertRaises(laprox.LaproxError) as e:
            self.plan()
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_exception_in_with_block_releases_the_region(self):
        with self.assertRaises(ZeroDivisionError):
            with laprox.Client(SERVER.target) as client:
                self.plan(client=client)
                name = client.staging_region.name
                1 / 0
        self.assertFalse(os.path.exists("/dev/shm/" + name))
        self.assertEqual(self.our_regions(), [])

    def test_server_error_keeps_the_region_for_the_next_call(self):
        self.plan()
        region = self.client.staging_region
        with self.assertRaises(laprox.LaproxError):
            self.plan(budget=laprox.Budget(compression_ratio=1.5))
        self.plan()
        self.assertEqual(self.client.staging_region, region)

    def test_garbage_collected_client_releases_the_region(self):
        client = laprox.Client(SERVER.target)
        self.plan(client=client)
        name = client.staging_region.name
        del client
        gc.collect()
        self.assertFalse(os.path.exists("/dev/shm/" + name))
        self.assertEqual(self.our_regions(), [])

    def test_interpreter_exit_releases_the_region(self):
        script = textwrap.dedent(f"""
            import sys
            sys.path[:0] = {[support.HERE, support.prepare_package()]!r}
            import numpy as np, laprox, support
            case = support.make_case()
            client = laprox.Client({SERVER.target!r})
            client.compute_keep_plan({self.model}, case["keys"], case["values"],
                                     case["queries"], budget=64, window=16)
            print(client.staging_region.name)
            # no close(): the exit hook must release it
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertNotIn("leaked", result.stderr)
        name = result.stdout.strip()
        self.assertTrue(name.startswith("laprox-py-"), result.stdout)
        self.assertFalse(os.path.exists("/dev/shm/" + name))
        with laprox.Client(SERVER.target) as observer:
            self.assertNotIn(name, [r.name for r in observer.list_regions()])

    def test_register_model_leaves_no_region(self):
        model = self.client.register_model("py-temp", geometry(), list(self.case["o_proj"]))
        self.assertEqual(self.our_regions(), [])
        self.assertEqual(support.shm_names(self.prefix), [])
        self.assertIsNone(self.client.staging_region)
        self.client.unregister_model(model)


class PlanFieldsTest(unittest.TestCase):

    def test_positions_and_scores_from_the_earlier_schemas_bytes(self):
        # positions and scores are bytes fields of little-endian int32 / float32, on the wire what
        # the earlier schema's packed `repeated sfixed32 positions = 6` and `repeated float
        # scores = 8` were: a response a server of that schema sent, encoded here by hand, decodes
        # to the same arrays (tests/proto/plan_wire_test.cc checks the other direction).
        from laprox import _plans
        positions = np.array([0, 7, -1, 2**31 - 1], dtype="<i4")
        scores = np.array([1.5, -0.0, np.inf, 3e38], dtype="<f4")

        def packed(number, array):
            data = array.tobytes()
            return bytes([number << 3 | 2, len(data)]) + data  # lengths < 128: one varint byte
        raw = (bytes([1 << 3, 1, 2 << 3, 1, 3 << 3, 4]) + bytes([4 << 3 | 2, 1, 4])
               + bytes([5 << 3 | 2, 2, 0, 4]) + packed(6, positions) + packed(8, scores))
        response = _proto.pb.ComputeKeepMaskResponse.FromString(raw)
        plan = _plans.plan_from_proto(response, laprox.Outputs(positions=True, scores=True))
        np.testing.assert_array_equal(plan.positions, positions)
        np.testing.assert_array_equal(plan.scores.reshape(-1), scores)
        # A truncated element is not read (as in the C++ client).
        response.positions = response.positions[:-1]
        plan = _plans.plan_from_proto(response, laprox.Outputs(positions=True))
        np.testing.assert_array_equal(plan.positions, positions[:-1])


class SegmentTest(unittest.TestCase):

    @unittest.skipUnless(os.path.isdir("/dev/shm"), "no /dev/shm")
    def test_pages_are_reserved_when_the_segment_is_made(self):
        # posix_fallocate at creation: a full /dev/shm fails here (RESOURCE_EXHAUSTED), not later
        # as SIGBUS on the first write. tmpfs counts reserved pages in st_blocks.
        from laprox import _shm
        size = 3 << 20
        segment = _shm._Segment(size)
        try:
            st = os.stat(os.path.join("/dev/shm", segment.name))
            self.assertGreaterEqual(st.st_blocks * 512, size)
        finally:
            segment.release()


class RegionLimitTest(unittest.TestCase):
    """A server that takes one region: a second client's staging region is refused."""

    @classmethod
    def setUpClass(cls):
        cls.server = support.Laproxd("--max_regions=1")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_refused_registration_unlinks_the_new_segment(self):
        prefix = f"laprox-py-{os.getpid()}-"
        case = support.make_case()
        with laprox.Client(self.server.target, inline_max_bytes=1 << 30) as inline:
            model = inline.register_model("limit", geometry(), case["o_proj"])
        args = (model, case["keys"], case["values"], case["queries"])
        with laprox.Client(self.server.target) as first, \
                laprox.Client(self.server.target) as second:
            first.compute_keep_plan(*args, budget=BUDGET, window=16)
            with self.assertRaises(laprox.LaproxError) as e:
                second.compute_keep_plan(*args, budget=BUDGET, window=16)
            self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIsNone(second.staging_region)
            self.assertEqual(support.shm_names(prefix), [first.staging_region.name])
        self.assertEqual(support.shm_names(prefix), [])


class ErrorTest(ClientTestCase):

    def assertCode(self, code, fn, *args, **kwargs):
        with self.assertRaises(laprox.LaproxError) as e:
            fn(*args, **kwargs)
        self.assertEqual(e.exception.code, code, e.exception.message)
        self.assertTrue(e.exception.message)
        return e.exception

    def test_unknown_model_is_not_found(self):
        c = self.case
        error = self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.compute_keep_plan,
                                987654, c["keys"], c["values"], c["queries"], budget=BUDGET)
        self.assertIn("987654", error.message)
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.unregister_model, 987654)

    def test_bad_budgets_are_invalid_argument(self):
        for budget in (laprox.Budget(compression_ratio=1.5), -1, None):
            self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.plan, budget=budget)

    def test_bad_policy_and_shapes_are_invalid_argument(self):
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.plan, pool_kernel=4)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.plan,
                        keys=self.case["keys"][:, :1])  # Hkv 1 instead of 2
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.plan,
                        keys=self.case["keys"].astype(np.int32))
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.plan, colour="red")

    def test_local_mistakes_are_value_and_type_errors_server_statuses_are_not(self):
        # Found here, before anything is sent: ValueError / TypeError (and still LaproxError).
        for call, kind in ((lambda: self.plan(keys=self.case["keys"][:, :, :, None]), ValueError),
                           (lambda: self.plan(colour="red"), ValueError),
                           (lambda: laprox.Budget.of("128"), TypeError),
                           (lambda: laprox.ModelGeometry.of([1, 2]), TypeError),
                           (lambda: self.client.compute_keep_plans(self.model, [7]), TypeError)):
            with self.assertRaises(kind) as e:
                call()
            self.assertIsInstance(e.exception, laprox.LaproxError)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        # Answered by laproxd: a LaproxError only.
        with self.assertRaises(laprox.LaproxError) as e:
            self.client.unregister_model(987654)
        self.assertNotIsInstance(e.exception, (ValueError, TypeError))
        # The batch's prefix keeps the class.
        with self.assertRaises(TypeError) as e:
            self.client.compute_keep_plans(self.model, [7])
        self.assertIn("sequences[0]", e.exception.message)

    def test_model_name_makes_any_text_a_name_laproxd_accepts(self):
        # The one clean-up laprox.hf and laprox.vllm name their models with.
        text = "/home/zoë/" + "x" * 300 + "/SmolLM2 135M (instruct)"
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.register_model, text,
                        geometry(), self.case["o_proj"])
        name = laprox.types.model_name(text)
        self.assertEqual(len(name), laprox.types.MODEL_NAME_MAX)
        self.assertTrue(name.endswith("/SmolLM2_135M__instruct_"), name)  # the end is kept
        self.assertEqual(laprox.types.model_name("zoë"), "zo_")  # not str.isalnum's letters
        model = self.client.register_model(name, geometry(), self.case["o_proj"])
        self.client.unregister_model(model)

    def test_unreachable_server_is_unavailable(self):
        with laprox.Client("unix:" + SERVER.dir + "/nothing.sock", timeout=10) as client:
            self.assertCode(grpc.StatusCode.UNAVAILABLE, client.info)

    def test_error_pickles_and_prints_its_code(self):
        error = laprox.LaproxError(grpc.StatusCode.NOT_FOUND, "model 7 not found")
        back = pickle.loads(pickle.dumps(error))
        self.assertEqual((back.code, back.message), (error.code, error.message))
        self.assertEqual(str(back), "NOT_FOUND: model 7 not found")


class TorchTest(ClientTestCase):
    """Runs only where torch is installed (not in CI): CPU tensors take the numpy path."""

    def setUp(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            self.skipTest("torch is not installed")
        super().setUp()

    def test_cpu_tensors_take_the_numpy_path(self):
        import torch
        c = self.case
        plan = self.plan(keys=torch.from_numpy(c["keys"]), values=torch.from_numpy(c["values"]),
                         window_queries=torch.from_numpy(c["queries"]))
        np.testing.assert_array_equal(plan.positions, self.plan().positions)
        self.assertEqual(self.client.staging_region.registrations, 1)

    def test_cpu_bfloat16_tensors_equal_bf16_bits(self):
        import torch
        c = self.case
        keys = torch.from_numpy(c["keys"]).to(torch.bfloat16)
        bits = keys.view(torch.int16).numpy().view(np.uint16)
        plan = self.plan(keys=keys)
        np.testing.assert_array_equal(plan.positions,
                                      self.plan(keys=bits, dtype="bf16").positions)


class _BusyUnregister(_proto.laprox_pb2_grpc.LaproxServicer):
    """A server whose UnregisterRegion answers `code` for the first `refusals` calls: the busy
    server a full control queue would be, which laproxd cannot be made into on demand."""

    def __init__(self, refusals, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
        self.refusals, self.code, self.calls, self.model_calls = refusals, code, 0, 0

    def UnregisterRegion(self, request, context):
        self.calls += 1
        if self.calls <= self.refusals:
            context.abort(self.code, "busy")
        return _proto.pb.UnregisterRegionResponse()

    def UnregisterModel(self, request, context):
        self.model_calls += 1
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")


class CleanupRetryTest(unittest.TestCase):
    """A Client's channel retries UnregisterRegion's RESOURCE_EXHAUSTED (gRPC's retryPolicy from
    proto/laprox/v1/service_config.json: 5 attempts), over a real gRPC server on a Unix socket;
    other errors and other methods are not retried."""

    def serve(self, servicer):
        """A laprox.Client (its own channel and options) of `servicer` on a fresh socket."""
        import tempfile
        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        _proto.laprox_pb2_grpc.add_LaproxServicer_to_server(servicer, server)
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory, True)
        socket = os.path.join(directory, "busy.sock")
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        self.addCleanup(server.stop, None)
        client = laprox.Client(f"unix:{socket}", timeout=30)
        self.addCleanup(client.close)
        return client

    def test_busy_server_is_retried_until_it_answers(self):
        from laprox import client as client_module
        busy = _BusyUnregister(refusals=3)
        client = self.serve(busy)
        client_module._unregister(client._stub, 30.0, 7)
        self.assertEqual(busy.calls, 4)

    def test_retry_gives_up_after_five_attempts(self):
        from laprox import client as client_module
        busy = _BusyUnregister(refusals=10 ** 6)
        client = self.serve(busy)
        with self.assertRaises(laprox.LaproxError) as raised:
            client_module._unregister(client._stub, 30.0, 7)
        self.assertEqual(raised.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertEqual(busy.calls, 5)  # gRPC's cap, and the policy's maxAttempts

    def test_other_errors_and_methods_are_not_retried(self):
        from laprox import client as client_module
        gone = _BusyUnregister(refusals=1, code=grpc.StatusCode.NOT_FOUND)
        client = self.serve(gone)
        with self.assertRaises(laprox.LaproxError) as raised:
            client_module._unregister(client._stub, 30.0, 7)
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(gone.calls, 1)
        busy = _BusyUnregister(refusals=10 ** 6)
        client = self.serve(busy)
        with self.assertRaises(laprox.LaproxError):
            client.unregister_model(3)  # RESOURCE_EXHAUSTED once: not a retried method
        self.assertEqual(busy.model_calls, 1)


class DefaultTargetTest(unittest.TestCase):
    """The client's default is laproxd's own default socket for the same user."""

    def test_root_and_other_users(self):
        from unittest import mock
        from laprox import client as client_module
        with mock.patch.dict(os.environ, {"XDG_RUNTIME_DIR": "/run/user/1000/"}):
            with mock.patch.object(os, "geteuid", return_value=0):
                self.assertEqual(client_module.default_target(), "unix:/run/laprox/laproxd.sock")
            with mock.patch.object(os, "geteuid", return_value=1000):
                self.assertEqual(client_module.default_target(),
                                 "unix:/run/user/1000/laprox/laproxd.sock")
        with mock.patch.dict(os.environ, {"XDG_RUNTIME_DIR": "relative"}), \
                mock.patch.object(os, "geteuid", return_value=1000):
            self.assertEqual(client_module.default_target(), "unix:/run/laprox/laproxd.sock")


if __name__ == "__main__":
    unittest.main()
