"""Paged KV caches read in place and batches of sequences, against the real laproxd and real
shared memory: Client.shared_array, laprox.PagedKV, Client.compute_keep_plans.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Paged
        (ctest -R python_client runs every test_*.py). One laproxd serves the module.
How:    the seeded case (support.make_case, n = 300 with blocks of 16: a partial last block) is
        written into an engine's pool in shared memory, its logical blocks at shuffled physical
        ids, every other element NaN (spare blocks and the unused slots of the last block), so
        that a read outside the table changes the plan or is refused. The paged plan must equal
        exactly the plan of the dense [Hkv, n, d] tensors gathered back from the pool with
        numpy (laproxd reads the same numbers, so no tolerance is needed).
Extend: a new layout is a (scatter, gather, preset) triple in LAYOUTS.
"""

import gc
import os
import unittest

import numpy as np

import support

support.prepare_package()

import grpc  # noqa: E402

import laprox  # noqa: E402
from laprox import _proto  # noqa: E402
from laprox import client as client_module  # noqa: E402

SERVER = None  # the module's laproxd, started by setUpModule
setUpModule, tearDownModule = support.module_laproxd(globals())


G = support.GEOMETRY
L, Hkv, D = G["L"], G["Hkv"], G["d"]
BLOCK = 16
N = 300            # 18 full blocks and one of 12 tokens
SPARE = 6          # physical blocks no table names
OPTIONS = dict(window=16, budget=64)


def geometry():
    return laprox.ModelGeometry(num_layers=G["L"], num_heads=G["H"], num_kv_heads=G["Hkv"],
                                head_dim=G["d"], hidden_size=G["D"])


def shuffled_table(n, block_size, spare, seed):
    """A sequence's physical block ids: a random permutation of part of a pool of
    ceil(n / block_size) + spare blocks (block 0 included somewhere); and the pool's size."""
    used = -(-n // block_size)
    num_blocks = used + spare
    table = np.random.default_rng(seed).permutation(num_blocks)[:used].astype(np.int32)
    return table, num_blocks


def rows_of(table, n, block_size):
    """(physical block, slot) of every logical position."""
    i = np.arange(n)
    return table[i // block_size], i % block_size


# Each layout: pool shape (per layer), scatter dense [Hkv, n, d] keys/values into a pool,
# gather them back, and the preset that describes one layer.
def _fa_shape(num_blocks, block_size):
    return (2, num_blocks, block_size, Hkv, D)


def _fa_scatter(pool, keys, values, table, block_size):
    ids, slot = rows_of(table, keys.shape[1], block_size)
    pool[0][ids, slot] = keys.transpose(1, 0, 2)
    pool[1][ids, slot] = values.transpose(1, 0, 2)


def _fa_gather(pool, table, n, block_size):
    ids, slot = rows_of(table, n, block_size)
    return pool[0][ids, slot].transpose(1, 0, 2), pool[1][ids, slot].transpose(1, 0, 2)


def _hm_shape(num_blocks, block_size):
    return (2, num_blocks, Hkv, block_size, D)


def _hm_scatter(pool, keys, values, table, block_size):
    ids, slot = rows_of(table, keys.shape[1], block_size)
    pool[0][ids, :, slot] = keys.transpose(1, 0, 2)   # advanced indices first: [n, Hkv, d]
    pool[1][ids, :, slot] = values.transpose(1, 0, 2)


def _hm_gather(pool, table, n, block_size):
    ids, slot = rows_of(table, n, block_size)
    return pool[0][ids, :, slot].transpose(1, 0, 2), pool[1][ids, :, slot].transpose(1, 0, 2)


LAYOUTS = {
    "vllm_flash_attn": (_fa_shape, _fa_scatter, _fa_gather, laprox.PagedKV.vllm_flash_attn),
    "vllm_head_major": (_hm_shape, _hm_scatter, _hm_gather, laprox.PagedKV.vllm_head_major),
}


def fill_value(dtype):
    """NaN in the pool's element type."""
    return support.to_bf16_bits(np.float32(np.nan)) if dtype == "bf16" else np.nan


def as_pool_values(x, dtype):
    return support.to_bf16_bits(x) if dtype == "bf16" else x.astype(np.float32)


class PagedTestCase(unittest.TestCase):
    """A fresh Client per test, one registered model per class, no region left behind."""

    @classmethod
    def setUpClass(cls):
        cls.case = support.make_case(n=N)
        with laprox.Client(SERVER.target) as client:
            cls.model = client.register_model("py-paged", geometry(), cls.case["o_proj"])

    def setUp(self):
        self.client = laprox.Client(SERVER.target, timeout=30)
        self.prefix = f"laprox-py-{os.getpid()}-"

    def tearDown(self):
        self.client.close()
        self.assertEqual(support.shm_names(self.prefix), [], "shared memory left behind")
        with laprox.Client(SERVER.target) as observer:
            self.assertEqual([r.name for r in observer.list_regions()
                              if r.name.startswith(self.prefix)], [], "regions left behind")

    def plan(self, keys, values, dtype=None, **kwargs):
        options = dict(OPTIONS, **kwargs)
        return self.client.compute_keep_plan(self.model, keys, values, self.case["queries"],
                                             dtype=dtype, **options)

    def paged_pools(self, layout, dtype, table, num_blocks, n=N):
        """One pool per layer in shared memory holding the case's first n tokens; the layers'
        (keys, values) PagedTensors and the dense tensors gathered back from the pools."""
        shape_of, scatter, gather, preset = LAYOUTS[layout]
        keys, values, dense_k, dense_v = [], [], [], []
        for l in range(L):
            pool = self.client.shared_array(shape_of(num_blocks, BLOCK), dtype)
            pool.array[...] = fill_value(dtype)
            scatter(pool.array, as_pool_values(self.case["keys"][l][:, :n], dtype),
                    as_pool_values(self.case["values"][l][:, :n], dtype), table, BLOCK)
            k, v = preset(pool, table, n)
            keys.append(k)
            values.append(v)
            gk, gv = gather(pool.array, table, n, BLOCK)
            dense_k.append(gk)
            dense_v.append(gv)
        return keys, values, np.stack(dense_k), np.stack(dense_v)

    def assertSamePlan(self, paged, dense):
        self.assertEqual(paged.n, dense.n)
        np.testing.assert_array_equal(paged.counts, dense.counts)
        np.testing.assert_array_equal(paged.positions, dense.positions)
        self.assertEqual((paged.quota, paged.selected_total), (dense.quota, dense.selected_total))


class PagedPlanTest(PagedTestCase):

    def test_vllm_layouts_give_the_plan_of_the_gathered_tensors(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=1)
        for layout in LAYOUTS:
            for dtype in ("f32", "bf16"):
                with self.subTest(layout=layout, dtype=dtype):
                    keys, values, dense_k, dense_v = self.paged_pools(layout, dtype, table,
                                                                      num_blocks)
                    expected = as_pool_values(self.case["keys"], dtype)
                    np.testing.assert_array_equal(dense_k, expected)  # the test's own gather
                    bf16 = "bf16" if dtype == "bf16" else None
                    self.assertSamePlan(self.plan(keys, values),
                                        self.plan(dense_k, dense_v, dtype=bf16))

    def test_sglang_token_pool_gives_the_plan_of_the_gathered_tensors(self):
        slots = N + 50
        slot_indices = np.random.default_rng(2).permutation(slots)[:N]  # int64, as torch gives
        for dtype in ("f32", "bf16"):
            with self.subTest(dtype=dtype):
                keys, values, dense_k, dense_v = [], [], [], []
                for l in range(L):
                    k_buffer = self.client.shared_array((slots, Hkv, D), dtype)
                    v_buffer = self.client.shared_array((slots, Hkv, D), dtype)
                    k_buffer.array[...] = fill_value(dtype)
                    v_buffer.array[...] = fill_value(dtype)
                    k_buffer.array[slot_indices] = as_pool_values(
                        self.case["keys"][l].transpose(1, 0, 2), dtype)
                    v_buffer.array[slot_indices] = as_pool_values(
                        self.case["values"][l].transpose(1, 0, 2), dtype)
                    k, v = laprox.PagedKV.sglang_token_pool(k_buffer, v_buffer, slot_indices)
                    self.assertEqual((k.table.block_size, k.shape), (1, (Hkv, N, D)))
                    keys.append(k)
                    values.append(v)
                    dense_k.append(k_buffer.array[slot_indices].transpose(1, 0, 2))
                    dense_v.append(v_buffer.array[slot_indices].transpose(1, 0, 2))
                bf16 = "bf16" if dtype == "bf16" else None
                self.assertSamePlan(self.plan(keys, values),
                                    self.plan(np.stack(dense_k), np.stack(dense_v), dtype=bf16))

    def test_one_pool_for_every_layer_read_through_region_tensor_views(self):
        # All layers in one shared array, stored head-major ([L, 2, nb, Hkv, bs, d], vLLM's HND
        # physical order) and given in FlashAttention's logical shape through a transposed view:
        # the preset follows the strides.
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=3)
        shared = self.client.shared_array((L, 2, num_blocks, Hkv, BLOCK, D), "f32")
        shared.array[...] = np.nan
        keys, values = [], []
        for l in range(L):
            _hm_scatter(shared.array[l], self.case["keys"][l], self.case["values"][l], table,
                        BLOCK)
            view = shared.array[l].transpose(0, 1, 3, 2, 4)  # [2, nb, bs, Hkv, d]
            ref = shared.region_tensor(view)
            self.assertEqual(ref.byte_offset, l * shared.array[l].nbytes)
            k, v = laprox.PagedKV.vllm_flash_attn(ref, table, N)
            self.assertEqual((k.slot_stride, k.head_stride), (D, BLOCK * D))
            keys.append(k)
            values.append(v)
        self.assertSamePlan(self.plan(keys, values),
                            self.plan(self.case["keys"], self.case["values"]))

    def test_general_layout_equals_the_preset(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=4)
        keys, values, _, _ = self.paged_pools("vllm_flash_attn", "f32", table, num_blocks)
        general_k, general_v = [], []
        for k in keys:
            pool = k.pool
            layout = dict(num_kv_heads=Hkv, head_dim=D, block_stride=BLOCK * Hkv * D,
                          slot_stride=Hkv * D, head_stride=D, dim_stride=1, block_size=BLOCK)
            general_k.append(laprox.PagedKV.tensor(pool, table, N, **layout))
            general_v.append(laprox.PagedKV.tensor(pool, table, N,
                                                   offset=num_blocks * BLOCK * Hkv * D,
                                                   **layout))
        self.assertSamePlan(self.plan(general_k, general_v), self.plan(keys, values))

    def test_blocks_shared_gives_the_new_table_and_the_freed_ids(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=5)
        # vLLM pads each row of its block table: the ids past ceil(n / block_size) are unused.
        padded = np.concatenate([table, np.zeros(4, np.int32)])
        keys, values, dense_k, dense_v = self.paged_pools("vllm_flash_attn", "f32", padded,
                                                          num_blocks)
        self.assertEqual(len(keys[0].table), len(table))
        plan = self.plan(keys, values, plan_shape="blocks_shared")
        blocks = plan.blocks
        kept = blocks.kept()
        self.assertEqual((blocks.units, blocks.block_size, blocks.num_blocks),
                         (1, BLOCK, len(table)))
        self.assertEqual(len(kept), OPTIONS["budget"] // BLOCK)
        np.testing.assert_array_equal(blocks.new_table(), table[kept])
        evicted = np.setdiff1d(np.arange(len(table)), kept)
        np.testing.assert_array_equal(blocks.freed(), table[evicted])
        self.assertIn(len(table) - 1, kept)  # the window's blocks are always kept
        positions = np.concatenate([np.arange(b * BLOCK, min((b + 1) * BLOCK, N))
                                    for b in kept])
        for layer in range(L):
            for head in range(Hkv):
                np.testing.assert_array_equal(plan.kept(layer, head), positions)
        # The same blocks as from the dense tensors (which have no physical ids).
        dense = self.plan(dense_k, dense_v, plan_shape="blocks_shared", block_size=BLOCK)
        np.testing.assert_array_equal(dense.blocks.kept(), kept)
        self.assertIsNone(dense.blocks.new_block_table)

    def test_one_block_table_is_sent_for_every_layer(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=6)
        keys, values, _, _ = self.paged_pools("vllm_flash_attn", "bf16", table, num_blocks)
        request = _proto.pb.ComputeKeepMaskRequest()
        staging = client_module._Staging()
        client_module._fill_keep_plan_request(
            request, self.model, laprox.SequenceInputs(keys, values, self.case["queries"],
                                                       budget=64), staging)
        self.assertEqual(len(request.block_tables), 1)
        self.assertEqual(list(request.block_tables[0].block_ids), table.tolist())
        self.assertEqual(request.block_tables[0].block_size, BLOCK)
        for l, layer in enumerate(request.layers):
            pool = keys[l].pool
            for name, offset in (("keys", 0), ("values", num_blocks * BLOCK * Hkv * D * 2)):
                ref = getattr(layer, name)
                self.assertEqual(ref.WhichOneof("source"), "region")
                self.assertEqual((ref.region.region_id, ref.region.byte_offset),
                                 (pool.region_id, offset))
                self.assertEqual(list(ref.shape), [Hkv, N, D])
                self.assertEqual(list(ref.strides), [])
                self.assertEqual(ref.dtype, _proto.pb.DTYPE_BF16)
                self.assertEqual((ref.paged.block_table, ref.paged.block_stride,
                                  ref.paged.slot_stride, ref.paged.head_stride,
                                  ref.paged.dim_stride),
                                 (0, BLOCK * Hkv * D, Hkv * D, D, 1))
            self.assertFalse(layer.window_queries.HasField("paged"))  # queries stay dense
        # A second, different table gets an index of its own.
        other = laprox.PagedKV.vllm_flash_attn(keys[0].pool, table[::-1].copy(), N)
        request = _proto.pb.ComputeKeepMaskRequest()
        client_module._fill_keep_plan_request(
            request, self.model, laprox.SequenceInputs(
                [other[0]] + keys[1:], [other[1]] + values[1:], self.case["queries"],
                budget=64), client_module._Staging())
        self.assertEqual(len(request.block_tables), 2)
        self.assertEqual([layer.keys.paged.block_table for layer in request.layers], [0, 1, 1])


class SharedArrayTest(PagedTestCase):

    def test_registered_once_with_its_size_and_released_by_close(self):
        shared = self.client.shared_array((4, 8), "f32")
        self.assertEqual(shared.array.shape, (4, 8))
        self.assertEqual(shared.array.dtype, np.float32)
        self.assertEqual(shared.byte_offset, 0)
        self.assertTrue(shared.name.startswith(self.prefix))
        with laprox.Client(SERVER.target) as observer:
            region, = [r for r in observer.list_regions() if r.name == shared.name]
        self.assertEqual((region.region_id, region.byte_size, region.writable),
                         (shared.region_id, 4 * 8 * 4, False))
        self.assertEqual(support.shm_names(self.prefix), [shared.name])
        shared.close()
        shared.close()  # idempotent
        self.assertTrue(shared.closed)
        self.assertFalse(os.path.exists("/dev/shm/" + shared.name))
        with self.assertRaises(laprox.LaproxError) as e:
            shared.array
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_bf16_is_uint16_bits_and_writable_is_registered(self):
        with self.client.shared_array(10, "bf16", writable=True) as shared:
            self.assertEqual((shared.array.dtype, shared.dtype), (np.uint16, laprox.DType.BF16))
            with laprox.Client(SERVER.target) as observer:
                self.assertTrue([r for r in observer.list_regions()
                                 if r.name == shared.name][0].writable)
            name = shared.name
        self.assertFalse(os.path.exists("/dev/shm/" + name))
        for bad in ("float64", np.int32, "q8"):
            with self.assertRaises(laprox.LaproxError) as e:
                self.client.shared_array((2, 2), bad)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(laprox.LaproxError):
            self.client.shared_array((0, 2), "f32")

    def test_client_close_and_garbage_collection_release_them(self):
        client = laprox.Client(SERVER.target)
        kept = client.shared_array((16,), "f16")
        dropped = client.shared_array((16,), "f16")
        dropped_name = dropped.name
        del dropped
        gc.collect()
        self.assertFalse(os.path.exists("/dev/shm/" + dropped_name))
        client.close()
        self.assertTrue(kept.closed)
        self.assertFalse(os.path.exists("/dev/shm/" + kept.name))

    def test_region_tensor_views_are_read_in_place_as_dense_tensors(self):
        shared = self.client.shared_array((2, L, Hkv, N, D), "f32")
        shared.array[0] = self.case["keys"]
        shared.array[1] = self.case["values"]
        keys = [shared.region_tensor(shared.array[0, l]) for l in range(L)]
        values = [shared.region_tensor(shared.array[1, l]) for l in range(L)]
        self.assertEqual(values[1].byte_offset, (L + 1) * Hkv * N * D * 4)
        self.assertSamePlan(self.plan(keys, values),
                            self.plan(self.case["keys"], self.case["values"]))
        staging = client_module._Staging()  # only the queries are copied
        client_module._fill_keep_plan_request(
            _proto.pb.ComputeKeepMaskRequest(), self.model,
            laprox.SequenceInputs(keys, values, self.case["queries"]), staging)
        self.assertEqual(len(staging.arrays), L)
        with self.assertRaises(laprox.LaproxError) as e:
            shared.region_tensor(np.zeros((2, 2), np.float32))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("does not lie inside", e.exception.message)


class RefusalTest(PagedTestCase):

    def assertRefused(self, code, words, fn, *args, **kwargs):
        with self.assertRaises(laprox.LaproxError) as e:
            fn(*args, **kwargs)
        self.assertEqual(e.exception.code, code, e.exception.message)
        for word in words:
            self.assertIn(word, e.exception.message)
        return e.exception

    def test_a_numpy_pool_is_refused(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=7)
        pool = np.zeros((2, num_blocks, BLOCK, Hkv, D), np.float32)
        self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           ("kv_cache", "numpy array", "in place", "shared_array", "CUDA"),
                           laprox.PagedKV.vllm_flash_attn, pool, table, N)
        self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT, ("k_buffer", "shared_array"),
                           laprox.PagedKV.sglang_token_pool, pool[0, 0], pool[1, 0], [0, 1])

    def test_a_cpu_torch_pool_is_refused(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed")
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=7)
        pool = torch.zeros((2, num_blocks, BLOCK, Hkv, D))
        self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           ("CPU torch tensor", "in place", "shared_array", "GPU"),
                           laprox.PagedKV.vllm_flash_attn, pool, table, N)

    def test_a_table_too_short_for_n_is_refused(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=8)
        with self.client.shared_array((2, num_blocks, BLOCK, Hkv, D), "f32") as pool:
            self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               ("block_table", f"{len(table) - 1} ids", f"n = {N}"),
                               laprox.PagedKV.vllm_flash_attn, pool, table[:-1], N)
            self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT, ("n >= 1",),
                               laprox.PagedKV.vllm_flash_attn, pool, table, 0)
            bad = table.copy()
            bad[3] = num_blocks
            self.assertRefused(grpc.StatusCode.OUT_OF_RANGE,
                               (f"block_table[3] = {num_blocks}", f"{num_blocks} blocks"),
                               laprox.PagedKV.vllm_flash_attn, pool, bad, N)
            bad[3] = -1
            self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT, ("block_table[3] = -1",),
                               laprox.PagedKV.vllm_flash_attn, pool, bad, N)
            self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT, ("block_size 8", "16"),
                               laprox.PagedKV.vllm_flash_attn, pool,
                               laprox.BlockTable(table, 8), N)

    def test_a_rank_4_cache_is_refused(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=9)
        with self.client.shared_array((num_blocks, BLOCK, Hkv, D), "f32") as pool:
            for preset, layout in ((laprox.PagedKV.vllm_flash_attn, "block_size, Hkv, d"),
                                   (laprox.PagedKV.vllm_head_major, "Hkv, block_size, d")):
                self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                   ("kv_cache", layout, "rank 5", str([num_blocks, BLOCK, Hkv, D])),
                                   preset, pool, table, N)
        with self.client.shared_array((3, num_blocks, BLOCK, Hkv, D), "f32") as pool:
            self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT, ("(keys, values)",),
                               laprox.PagedKV.vllm_flash_attn, pool, table, N)

    def test_paged_tensors_only_as_keys_and_values_of_an_open_pool(self):
        table, num_blocks = shuffled_table(N, BLOCK, SPARE, seed=10)
        keys, values, _, _ = self.paged_pools("vllm_flash_attn", "f32", table, num_blocks)
        self.assertRefused(grpc.StatusCode.INVALID_ARGUMENT,
                           ("window_queries[0]", "only keys and values may be paged"),
                           self.client.compute_keep_plan, self.model, keys, values, keys,
                           budget=64)
        keys[0].pool.close()
        self.assertRefused(grpc.StatusCode.FAILED_PRECONDITION, ("keys[0]", "closed"),
                           self.plan, keys, values)


class BatchTest(PagedTestCase):

    def sequences(self):
        """Three sequences: dense (n 300, LAPROX), paged (n 200, vLLM layout, SNAPKV) and
        BLOCKS_SHARED over dense keys (n 97, blocks of 8)."""
        c = self.case
        table, num_blocks = shuffled_table(200, BLOCK, SPARE, seed=11)
        keys, values, _, _ = self.paged_pools("vllm_flash_attn", "f32", table, num_blocks,
                                              n=200)
        queries_200 = support.make_case(n=200, seed=12)["queries"]
        return [
            dict(keys=c["keys"], values=c["values"], window_queries=c["queries"], budget=64,
                 window=16),
            laprox.SequenceInputs(keys, values, queries_200, budget=0.5, kind="snapkv",
                                  window=16, outputs=("positions", "scores")),
            dict(keys=c["keys"][:, :, :97], values=c["values"][:, :, :97],
                 window_queries=c["queries"], budget=40, window=16,
                 plan_shape="blocks_shared", block_size=8),
        ]

    def test_batch_plans_equal_the_single_plans(self):
        sequences = self.sequences()
        plans = self.client.compute_keep_plans(self.model, sequences)
        self.assertEqual(len(plans), 3)
        self.assertEqual(self.client.staging_region.registrations, 1)
        for i, (plan, sequence) in enumerate(zip(plans, sequences)):
            sequence = laprox.SequenceInputs.of(sequence)
            single = self.client.compute_keep_plan(
                self.model, sequence.keys, sequence.values, sequence.window_queries,
                policy=sequence.policy, budget=sequence.budget, outputs=sequence.outputs,
                **sequence.policy_options)
            with self.subTest(sequence=i):
                self.assertSamePlan(plan, single)
                np.testing.assert_array_equal(plan.layer_sums, single.layer_sums)
                self.assertEqual(plan.effective_policy, single.effective_policy)
                if plan.scores is not None or single.scores is not None:
                    np.testing.assert_array_equal(plan.scores, single.scores)
        self.assertEqual([p.n for p in plans], [N, 200, 97])
        self.assertEqual(plans[1].scores.shape, (L, Hkv, 200))
        self.assertIsNone(plans[0].blocks)
        self.assertEqual(plans[2].blocks.block_size, 8)
        self.assertEqual(plans[2].blocks.num_blocks, 13)

    def test_a_bad_sequence_fails_the_batch_naming_it(self):
        sequences = self.sequences()
        # laproxd's check.
        sequences[1] = laprox.SequenceInputs(sequences[1].keys, sequences[1].values,
                                             sequences[1].window_queries, budget=1.5, window=16)
        with self.assertRaises(laprox.LaproxError) as e:
            self.client.compute_keep_plans(self.model, sequences)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("sequences[1]", e.exception.message)
        self.assertIn("compression_ratio", e.exception.message)
        # The client's checks, named the same way.
        for bad in (dict(sequences[0], keys=self.case["keys"][0]),       # rank 3 stacked
                    dict(sequences[0], colour="red"),                    # unknown option
                    {"keys": self.case["keys"]}):                        # no values
            with self.subTest(bad=sorted(bad)):
                with self.assertRaises(laprox.LaproxError) as e:
                    self.client.compute_keep_plans(self.model, [sequences[0], bad])
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertTrue(e.exception.message.startswith("sequences[1]: "),
                                e.exception.message)
        # The client is still usable.
        self.assertEqual(len(self.client.compute_keep_plans(self.model, sequences[:1])), 1)

    def test_too_many_or_no_sequences_are_refused_by_laproxd(self):
        limit = self.client.info().limits.max_batch_sequences
        self.assertEqual(limit, 256)  # laproxd's default
        c = self.case
        one = dict(keys=c["keys"][:, :, :32], values=c["values"][:, :, :32],
                   window_queries=c["queries"], budget=16, window=16)
        for sequences in ([], [one] * (limit + 1)):
            with self.assertRaises(laprox.LaproxError) as e:
                self.client.compute_keep_plans(self.model, sequences)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)


if __name__ == "__main__":
    unittest.main()
