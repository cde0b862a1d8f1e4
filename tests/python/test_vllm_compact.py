"""laprox.vllm's compaction (laprox/vllm/_compact.py) without vLLM: the padding of a LAYER_UNIFORM
plan to one length per layer, the move of kept entries into a request's blocks (the "vec" layout
of vLLM's CPU cache), and the per-layer slots and lengths of a step, each against a brute-force
reading of the same rules. Needs torch (the vLLM venv: tests/integration/vllm/run.sh runs it);
skipped without."""

import unittest

import numpy as np

import support

support.prepare_package()

try:
    import torch
except ImportError:  # Debian's python3 has no torch
    raise unittest.SkipTest("torch not installed")

from laprox.vllm import _compact  # noqa: E402


def random_masks(rng, layers, heads, n, counts):
    """[layers, heads, n] masks with counts[l] kept per head, some heads one fewer."""
    masks = np.zeros((layers, heads, n), bool)
    for l in range(layers):
        for h in range(heads):
            c = counts[l] - (1 if h > 0 and rng.random() < 0.5 else 0)
            masks[l, h, rng.choice(n, size=c, replace=False)] = True
    return masks


class NotePlanTest(unittest.TestCase):
    def test_pads_each_head_to_its_layers_longest_with_its_latest_evicted_entries(self):
        rng = np.random.default_rng(1)
        masks = random_masks(rng, 4, 3, 50, [5, 9, 1, 20])
        pending, padded = _compact.note_plan(masks, 50, 53)
        for l in range(4):
            longest = masks[l].sum(axis=1).max()
            self.assertEqual(pending.kept[l].shape, (3, longest))
            for h in range(3):
                added = np.flatnonzero(padded[l, h] & ~masks[l, h])
                missing = longest - masks[l, h].sum()
                self.assertEqual(len(added), missing)
                # The most recent evicted entries: every evicted one left is older.
                left = np.flatnonzero(~padded[l, h])
                if len(added) and len(left):
                    self.assertLess(left.max(), added.min())
                self.assertTrue(np.array_equal(pending.kept[l][h], np.flatnonzero(padded[l, h])))
        self.assertTrue((padded | ~masks).all())  # nothing the plan keeps is dropped
        self.assertEqual(_compact.ready(pending),
                         _compact.Ready(50, max(k.shape[1] for k in pending.kept), 53))

    def test_a_uniform_plan_is_unchanged(self):
        masks = np.zeros((2, 2, 10), bool)
        masks[:, :, [1, 4, 9]] = True
        _, padded = _compact.note_plan(masks, 10, 10)
        self.assertTrue(np.array_equal(padded, masks))


def vec_cache(rng, blocks, heads, block_size, d):
    """One layer's cache as vLLM's CPU backend holds it, [blocks, Hkv, bs, 2d], and its key
    [blocks, Hkv, d, bs] and value [blocks, Hkv, bs, d] views (laprox.vllm._decode._cache_views)."""
    cache = torch.from_numpy(rng.standard_normal((blocks, heads, block_size, 2 * d))
                             .astype(np.float32))
    halves = cache.view(blocks, heads, 2, block_size * d)
    return cache, (halves[:, :, 0].view(blocks, heads, d, block_size),
                   halves[:, :, 1].view(blocks, heads, block_size, d))


class MoveTest(unittest.TestCase):
    def test_kept_entries_and_those_after_the_prompt_land_in_slot_order(self):
        rng = np.random.default_rng(2)
        layers, heads, bs, d, pool = 3, 2, 4, 8, 20
        prompt, computed = 21, 24  # three positions after the prompt (a recomputed request)
        block_ids = [int(b) for b in rng.permutation(np.arange(1, pool))[:7]]  # 28 slots
        masks = random_masks(rng, layers, heads, prompt, [6, 3, 9])
        pending, _ = _compact.note_plan(masks, prompt, computed)
        caches = [vec_cache(rng, pool, heads, bs, d) for _ in range(layers)]
        before = [(k.clone(), v.clone()) for _, (k, v) in caches]
        # The kept blocks: the last two of the request's own (overlapping the sources) and a
        # fresh one; a block appended in the same step stays after them.
        fresh = 0
        order = _compact.Order(sources=7, dest=(block_ids[5], block_ids[6], fresh), released=5,
                               computed=computed)
        self.check_move(pending, block_ids, order, prompt, computed, caches, before)

    def test_a_deferred_compaction_keeps_the_entries_computed_since_the_plan(self):
        # LAPROX_VLLM_TRIGGER=pressure: planned with 21 positions, compacted with 26.
        rng = np.random.default_rng(3)
        layers, heads, bs, d, pool = 2, 2, 4, 8, 20
        prompt, computed = 21, 26
        block_ids = [int(b) for b in rng.permutation(np.arange(1, pool))[:7]]
        pending, _ = _compact.note_plan(random_masks(rng, layers, heads, prompt, [6, 9]),
                                        prompt, prompt)
        caches = [vec_cache(rng, pool, heads, bs, d) for _ in range(layers)]
        before = [(k.clone(), v.clone()) for _, (k, v) in caches]
        order = _compact.Order(sources=7, dest=(block_ids[4], block_ids[5], block_ids[6], 0),
                               released=4, computed=computed)
        self.check_move(pending, block_ids, order, prompt, computed, caches, before)

    def test_an_order_for_another_plan_moves_nothing(self):
        # LAPROX_VLLM_PRESSURE_BUDGETS: the order names the plan (level) its blocks were sized
        # for; blocks for another plan's length are a bug, refused before anything moves.
        rng = np.random.default_rng(4)
        layers, heads, bs, d, pool = 2, 2, 4, 8, 20
        prompt = 21
        block_ids = [int(b) for b in rng.permutation(np.arange(1, pool))[:6]]
        floor, _ = _compact.note_plan(random_masks(rng, layers, heads, prompt, [6, 5]), prompt,
                                      prompt, 6)
        larger, _ = _compact.note_plan(random_masks(rng, layers, heads, prompt, [13, 11]),
                                       prompt, prompt, 12)
        floor.larger = [larger]
        self.assertEqual(_compact.ready(floor).larger, (13,))
        caches = [vec_cache(rng, pool, heads, bs, d) for _ in range(layers)]
        before = [(k.clone(), v.clone()) for _, (k, v) in caches]
        order = _compact.Order(sources=6, dest=tuple(block_ids[2:6]), released=2,
                               computed=prompt, level=1)  # 4 blocks: 13 entries
        with self.assertRaisesRegex(RuntimeError, "order of 4 blocks for a plan that needs 2"):
            _compact.move(floor, block_ids, order, [views for _, views in caches])
        for l in range(layers):
            self.assertTrue(torch.equal(caches[l][1][0], before[l][0]))
        self.check_move(floor.at(1), block_ids, order, prompt, prompt, caches, before)

    def check_move(self, pending, block_ids, order, prompt, computed, caches, before):
        """The move of `order`: every kept entry and every one after the prompt up to
        order.computed in slot order in dest, nothing written elsewhere."""
        layers, heads, bs = len(caches), pending.kept[0].shape[0], caches[0][1][0].shape[3]
        pool = caches[0][0].shape[0]
        drops = _compact.move(pending, block_ids + [17], order, [views for _, views in caches])
        for l in range(layers):
            keys, values = caches[l][1]
            old_k, old_v = before[l]
            kept = pending.kept[l]
            self.assertEqual(drops[l], prompt - kept.shape[1])
            for h in range(heads):
                positions = list(kept[h]) + list(range(prompt, computed))
                for j, p in enumerate(positions):
                    src_block, src_slot = block_ids[p // bs], p % bs
                    dst_block, dst_slot = order.dest[j // bs], j % bs
                    self.assertTrue(torch.equal(keys[dst_block, h, :, dst_slot],
                                                old_k[src_block, h, :, src_slot]), (l, h, j))
                    self.assertTrue(torch.equal(values[dst_block, h, dst_slot],
                                                old_v[src_block, h, src_slot]), (l, h, j))
        # Blocks outside dest are not written.
        for l in range(layers):
            untouched = [b for b in range(pool) if b not in order.dest]
            self.assertTrue(torch.equal(caches[l][1][0][untouched], before[l][0][untouched]))


class ReplanTest(unittest.TestCase):
    """A decode re-plan of a compacted request: what it sends (every layer's token positions)
    and how its plan is compacted (entries, not positions, are the move's sources)."""

    def compacted(self):
        # Layer 0 kept prompt positions [1, 5, 7] / [2, 5, 8], layer 1 [0, 3] / [3, 6]; prompt
        # of 10, computed 14: tokens 10 .. 13 follow in every layer.
        return _compact.Compacted(10, np.array([7, 8]),
                                  [np.array([[1, 5, 7], [2, 5, 8]]), np.array([[0, 3], [3, 6]])])

    def test_cache_positions_are_the_kept_ones_then_the_generated_ones(self):
        positions = self.compacted().cache_positions(14)
        np.testing.assert_array_equal(positions[0], [[1, 5, 7, 10, 11, 12, 13],
                                                     [2, 5, 8, 10, 11, 12, 13]])
        np.testing.assert_array_equal(positions[1], [[0, 3, 10, 11, 12, 13],
                                                     [3, 6, 10, 11, 12, 13]])

    def test_a_replan_moves_entries_and_keeps_their_positions(self):
        class Plan:  # what note_replan reads: KeepPlan.layer_entries
            def layer_entries(self, layer):
                return [np.array([[0, 3, 5, 6], [1, 3, 5, 6]]), np.array([[1, 4, 5]] * 2)][layer]

        compacted = self.compacted()
        pending = _compact.note_replan(Plan(), compacted.cache_positions(14), 14)
        self.assertEqual((pending.prompt_len, pending.computed), (14, 14))
        np.testing.assert_array_equal(pending.positions[0], [[1, 10, 12, 13], [5, 10, 12, 13]])
        np.testing.assert_array_equal(pending.positions[1], [[3, 12, 13], [6, 12, 13]])
        self.assertEqual(_compact.ready(pending, replan=True), _compact.Ready(14, 4, 14, True))
        # The move reads the entries' slots (not their positions) and writes slots 0 ...
        rng = np.random.default_rng(5)
        caches = [vec_cache(rng, 6, 2, 4, 8) for _ in range(2)]
        before = [(k.clone(), v.clone()) for _, (k, v) in caches]
        block_ids = [3, 1]  # 8 slots: layer 0 holds 7 entries, layer 1 holds 6
        order = _compact.Order(sources=2, dest=(1,), released=1, computed=14)
        drops = _compact.move(pending, block_ids, order, [views for _, views in caches])
        np.testing.assert_array_equal(drops, [10, 11])  # 14 - 4, 14 - 3
        for l in range(2):
            keys, values = caches[l][1]
            for h in range(2):
                for j, entry in enumerate(pending.kept[l][h]):
                    src = block_ids[entry // 4], entry % 4
                    self.assertTrue(torch.equal(keys[1, h, :, j], before[l][0][src[0], h, :,
                                                                               src[1]]))
                    self.assertTrue(torch.equal(values[1, h, j], before[l][1][src[0], h,
                                                                              src[1]]))

    def test_the_last_queries_are_kept_oldest_first(self):
        compacted = self.compacted()
        compacted.queries = np.zeros((2, 1, 3, 2), np.float32)
        for step in range(5):
            compacted.remember(1, torch.full((1, 1, 2), float(step)))
        np.testing.assert_array_equal(compacted.queries[1, 0, :, 0], [2, 3, 4])
        compacted.remember(1, torch.arange(8.).view(4, 1, 2))  # 4 rows at once: the last 3
        np.testing.assert_array_equal(compacted.queries[1, 0, :, 0], [2, 4, 6])
        self.assertFalse(compacted.queries[0].any())


class ShiftTest(unittest.TestCase):
    def test_slots_and_lengths_per_layer(self):
        rng = np.random.default_rng(3)
        layers, bs, num_reqs = 4, 8, 3
        table = rng.integers(1, 100, size=(num_reqs, 16)).astype(np.int32)
        drops = [np.array([30, 12, 0, 41]), np.array([5, 5, 9, 1])]
        rows = [(0, 60, 1, drops[0]), (2, 47, 3, drops[1])]  # row 1 is not compacted
        starts = np.array([0, 1, 6, 9])                        # row 1 has 5 tokens
        shift = _compact.shift(rows, starts, table, bs, layers, num_reqs)
        self.assertEqual(shift.tokens.tolist(), [0, 6, 7, 8])
        for l in range(layers):
            expected = []
            for i, start, count, drop in rows:
                for t in range(count):
                    j = start + t - drop[l]
                    expected.append(int(table[i][j // bs]) * bs + j % bs)
            self.assertEqual(shift.slots[l].tolist(), expected)
            self.assertEqual(shift.delta[l].tolist(), [drops[0][l], 0, drops[1][l]])
        self.assertIsNone(_compact.shift([], starts, table, bs, layers, num_reqs))


if __name__ == "__main__":
    unittest.main()


class PlanPolicyTest(unittest.TestCase):
    """The options the plugin sends (Config.plan_policy): compaction's LAYER_UNIFORM shape and
    cap for every kind; for LAPROX also the scoring the joint endpoint chose for that shape
    (AVG pooling, one sink: bench/quality/JOINT.md); what LAPROX_VLLM_POLICY sets wins, null
    unsets; masking sends only what the user set (laproxd's RAGGED default, AVG_PEAK)."""

    def policy(self, mode="compact", **options):
        from laprox.vllm._state import Config
        return Config(target="unix:/nowhere", policy=options, mode=mode).plan_policy()

    def test_compacting_laprox_gets_the_shape_the_cap_and_the_scoring(self):
        want = {"plan_shape": "layer_uniform", "max_layer_share": 1.25, "pooling": "avg",
                "sinks": 1}
        self.assertEqual(self.policy(), want)
        self.assertEqual(self.policy(kind="laprox"), dict(want, kind="laprox"))

    def test_the_users_options_win_and_null_unsets(self):
        self.assertEqual(self.policy(pooling="avg_peak", sinks=None, window=16),
                         {"plan_shape": "layer_uniform", "max_layer_share": 1.25,
                          "pooling": "avg_peak", "window": 16})

    def test_other_kinds_keep_their_own_scoring(self):
        self.assertEqual(self.policy(kind="streaming_llm"),
                         {"plan_shape": "layer_uniform", "max_layer_share": 1.25,
                          "kind": "streaming_llm"})

    def test_masking_sends_only_what_was_set(self):
        self.assertEqual(self.policy(mode="mask"), {})
        self.assertEqual(self.policy(mode="mask", window=16), {"window": 16})


class FewestTest(unittest.TestCase):
    """LAPROX_VLLM_TRIGGER=pressure compacts the fewest deferred requests whose released blocks
    cover the pool's shortfall: against every subset."""

    def test_the_fewest_requests_that_cover_the_shortfall(self):
        import itertools
        rng = np.random.default_rng(7)
        for _ in range(300):
            gains = {f"r{i}": int(g) for i, g in enumerate(rng.integers(-1, 9, rng.integers(0, 7)))}
            short = int(rng.integers(-2, 30))
            chosen = _compact.fewest(gains, short)
            self.assertEqual(len(set(chosen)), len(chosen))
            useful = [r for r in gains if gains[r] > 0]
            covering = [len(c) for k in range(len(useful) + 1)
                        for c in itertools.combinations(useful, k)
                        if sum(gains[r] for r in c) >= short]
            if short <= 0:
                self.assertEqual(chosen, [])
            elif covering:
                self.assertEqual(len(chosen), min(covering), (gains, short, chosen))
                self.assertGreaterEqual(sum(gains[r] for r in chosen), short)
            else:  # nothing covers it: every request that frees a block
                self.assertEqual(sorted(chosen), sorted(useful))


def config_from_env(**env):
    """The plugin's Config read from `env` alone (and a target)."""
    from unittest import mock
    from laprox.vllm._state import Config
    with mock.patch.dict("os.environ", dict(LAPROX_VLLM_TARGET="unix:/nowhere", **env),
                        clear=True):
        return Config.from_env()


class TriggerConfigTest(unittest.TestCase):
    """LAPROX_VLLM_TRIGGER: always (the default) or pressure, which needs compact mode."""

    def config(self, **env):
        return config_from_env(**env)

    def test_always_is_the_default_and_defers_nothing(self):
        self.assertEqual(self.config().trigger, "always")
        self.assertFalse(self.config().deferred)

    def test_pressure_defers_in_compact_mode_only(self):
        self.assertTrue(self.config(LAPROX_VLLM_TRIGGER="pressure").deferred)
        with self.assertLogs("laprox.vllm", "WARNING"):
            masked = self.config(LAPROX_VLLM_TRIGGER="pressure", LAPROX_VLLM_MODE="mask")
        self.assertEqual(masked.trigger, "always")
        self.assertFalse(masked.deferred)

    def test_another_value_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "LAPROX_VLLM_TRIGGER.*'sometimes'"):
            self.config(LAPROX_VLLM_TRIGGER="sometimes")

    def test_a_long_prompt_threshold_needs_pressure(self):
        self.assertEqual(self.config(LAPROX_VLLM_TRIGGER="pressure",
                                     LAPROX_VLLM_LONG_PROMPT="4096").long_prompt, 4096)
        self.assertEqual(self.config().long_prompt, 0)
        with self.assertLogs("laprox.vllm", "WARNING"):
            self.assertEqual(self.config(LAPROX_VLLM_LONG_PROMPT="4096").long_prompt, 0)
        with self.assertRaisesRegex(ValueError, "LAPROX_VLLM_LONG_PROMPT must be >= 0"):
            self.config(LAPROX_VLLM_TRIGGER="pressure", LAPROX_VLLM_LONG_PROMPT="-1")


class ChooseTest(unittest.TestCase):
    """LAPROX_VLLM_PRESSURE_BUDGETS: the fewest requests, each at the largest budget that still
    covers the shortfall (choose)."""

    def test_fewest_requests_and_none_could_go_higher(self):
        rng = np.random.default_rng(11)
        raised = 0
        for _ in range(500):
            gains = {}
            for i in range(int(rng.integers(0, 6))):
                floor = int(rng.integers(-1, 12))
                # larger budgets release fewer blocks (non-increasing; maybe none)
                larger = np.sort(rng.integers(-2, floor + 1, int(rng.integers(0, 3))))[::-1]
                gains[f"r{i}"] = [floor] + [int(g) for g in larger]
            short = int(rng.integers(-2, 30))
            levels = _compact.choose(gains, short)
            floor = _compact.fewest({r: g[0] for r, g in gains.items()}, short)
            self.assertEqual(list(levels), floor)  # the same requests, in the same order
            released = sum(gains[r][l] for r, l in levels.items())
            self.assertLessEqual(released, sum(gains[r][0] for r in floor))
            if sum(gains[r][0] for r in floor) < short:  # nothing covers it: all at the floor
                self.assertTrue(all(l == 0 for l in levels.values()), (gains, short, levels))
                continue
            self.assertGreaterEqual(released, short, (gains, short, levels))
            raised += sum(l > 0 for l in levels.values())
            for r, l in levels.items():
                self.assertGreater(gains[r][l], 0)
                for higher in range(l + 1, len(gains[r])):  # going higher would uncover it
                    if gains[r][higher] > 0:
                        self.assertLess(released - gains[r][l] + gains[r][higher], short,
                                        (gains, short, levels, r))
            if len(levels) == 1:  # one request: the least release that covers, exactly
                (r,) = levels
                self.assertEqual(released, min(g for g in gains[r] if g >= short and g > 0))
        self.assertGreater(raised, 50)  # the cases raise levels often enough to mean something


class PressureBudgetsConfigTest(unittest.TestCase):
    """LAPROX_VLLM_PRESSURE_BUDGETS: budgets above the floor, for the pressure trigger."""

    def config(self, **env):
        return config_from_env(**env)

    def test_sorted_above_the_floor(self):
        config = self.config(LAPROX_VLLM_TRIGGER="pressure", LAPROX_VLLM_BUDGET="256",
                             LAPROX_VLLM_PRESSURE_BUDGETS="1024,512")
        self.assertEqual(config.budgets, (256, 512, 1024))
        self.assertEqual(self.config().budgets, (128,))

    def test_refused_at_or_below_the_floor_and_ignored_without_pressure(self):
        with self.assertRaisesRegex(ValueError, "above LAPROX_VLLM_BUDGET.*'128,512'"):
            self.config(LAPROX_VLLM_TRIGGER="pressure", LAPROX_VLLM_PRESSURE_BUDGETS="128,512")
        with self.assertRaisesRegex(ValueError, "LAPROX_VLLM_PRESSURE_BUDGETS.*'big'"):
            self.config(LAPROX_VLLM_TRIGGER="pressure", LAPROX_VLLM_PRESSURE_BUDGETS="big")
        with self.assertLogs("laprox.vllm", "WARNING"):
            self.assertEqual(self.config(LAPROX_VLLM_PRESSURE_BUDGETS="512").budgets, (128,))


class SchedulerFixture(unittest.TestCase):
    """The plugin's scheduler side on vLLM's own FullAttentionManager and BlockPool (a pool of 32
    blocks of 16 slots) and a scheduler of running requests."""

    def setUp(self):
        from types import SimpleNamespace

        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.request import RequestStatus

        from laprox.vllm import _state

        self.addCleanup(setattr, _compact, "SCHED", _compact.SCHED)
        _compact.SCHED = _compact._SchedulerSide()
        self.addCleanup(setattr, _state.STATE, "metrics", _state.STATE.metrics)
        _state.STATE.metrics = _state._metrics.Metrics()
        self.metrics = _state.STATE.metrics
        self.pool = BlockPool(32, enable_caching=False, hash_block_size=16)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32,
                                 dtype=torch.float32)
        self.manager = FullAttentionManager(spec, block_pool=self.pool, enable_caching=False,
                                            kv_cache_group_id=0, scheduler_block_size=16)
        self.requests = {}
        self.scheduler = SimpleNamespace(requests=self.requests, kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[self.manager])))
        self.running = RequestStatus.RUNNING

    def start(self, req_id, computed):
        """A running request of `computed` positions (all in its blocks) in a new generation."""
        from types import SimpleNamespace

        self.requests[req_id] = SimpleNamespace(status=self.running,
                                                num_computed_tokens=computed)
        self.manager.req_to_blocks[req_id] = self.pool.get_new_blocks(-(-computed // 16))
        return _compact.SCHED.begin(req_id)

    def carried_out(self, req_id):
        """The worker moved the entries: the order is sent and its held blocks come back."""
        _compact.SCHED.pending.pop(req_id)
        _compact._release(req_id)


class FenceTest(SchedulerFixture):
    """The fence (_compact.current): a plan is applied only to the generation of its request it
    was computed for, and only to the cache it read; otherwise it is dropped and counted (the
    worker side through the plugin's _update_states hook)."""

    def test_a_plan_of_the_current_generation_is_compacted(self):
        generation = self.start("A", 160)  # 10 blocks; a plan keeping 40 needs 3
        self.assertEqual(_compact.decide(self.scheduler, "A",
                                         _compact.Ready(160, 40, 160, generation=generation)), 7)
        self.assertEqual(_compact.SCHED.pending["A"].generation, generation)

    def test_a_plan_of_an_earlier_generation_is_dropped(self):
        # Preempted (or aborted and its id reused) and scheduled again from its first
        # position: a new generation, equal to the old one in every other respect.
        old = self.start("A", 160)
        stale = _compact.Ready(160, 40, 160, generation=old)
        _compact.SCHED.forget("A")
        self.assertFalse(_compact.current("A", stale))  # ended: nothing applies
        self.manager.req_to_blocks.pop("A")
        self.start("A", 160)
        self.assertFalse(_compact.current("A", stale))
        self.assertEqual(_compact.decide(self.scheduler, "A", stale), 0)
        self.assertEqual(len(self.manager.req_to_blocks["A"]), 10)
        self.assertNotIn("A", _compact.SCHED.pending)

    def test_a_replan_that_read_the_cache_before_a_compaction_is_dropped(self):
        generation = self.start("A", 160)
        self.assertGreater(_compact.decide(self.scheduler, "A", _compact.Ready(
            160, 80, 160, generation=generation)), 0)
        self.carried_out("A")  # layout 1: 5 blocks
        replan = _compact.Ready(160, 30, 160, replan=True, generation=generation, layout=1)
        raced = _compact.Ready(160, 20, 160, replan=True, generation=generation, layout=1)
        self.assertGreater(_compact.decide(self.scheduler, "A", replan), 0)
        self.carried_out("A")  # layout 2: the cache `raced` read is gone
        self.assertFalse(_compact.current("A", raced))
        self.assertEqual(_compact.decide(self.scheduler, "A", raced), 0)
        self.assertEqual(_compact.SCHED.layouts["A"], 2)

    def test_a_deferred_plan_of_an_earlier_generation_is_dropped_and_counted(self):
        old = self.start("A", 160)
        _compact.SCHED.deferred["A"] = _compact.Ready(160, 40, 160, generation=old)
        _compact.SCHED.begin("A")  # no _compact.ended() in between: the fence alone
        self.scheduler.running, self.scheduler.waiting = [], []
        self.scheduler.max_num_running_reqs = 8
        _compact.relieve(self.scheduler)
        self.assertNotIn("A", _compact.SCHED.deferred)
        self.assertEqual(self.metrics.fenced, 1)

    def test_the_worker_drops_what_it_holds_of_an_earlier_generation(self):
        from types import SimpleNamespace

        from laprox.vllm import _runner
        from laprox.vllm._state import STATE, _Prefill

        for table in ("prefills", "pending", "ready", "compacted", "generations"):
            self.addCleanup(setattr, STATE, table, getattr(STATE, table))
            setattr(STATE, table, {})
        queries = np.zeros((1, 1, 4, 8), np.float32)
        STATE.generations.update(A=3, B=4)
        STATE.prefills.update(A=_Prefill(100, queries, generation=3),
                              B=_Prefill(100, queries, generation=4))
        STATE.pending["C"] = _compact.Pending(10, 10, [np.zeros((1, 2), np.int64)],
                                              generation=5)
        from laprox.vllm.connector import Channel

        update = _runner._update_states(lambda runner, output: None)
        self.addCleanup(setattr, STATE, "runner", STATE.runner)

        def step(generations, finished=()):
            STATE.channel = Channel(generations=generations)  # connector.handle_preemptions
            update(None, SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set()))

        # A's id is reused by a request of another prompt: its capture so far is another's.
        step({"A": 9}, finished=["A"])
        self.assertNotIn("A", STATE.prefills)
        self.assertIn("B", STATE.prefills)  # its own generation: kept
        self.assertEqual(self.metrics.fenced, 1)
        step({}, finished=["C"])  # ended: dropped, not counted
        self.assertNotIn("C", STATE.pending)
        self.assertEqual(self.metrics.fenced, 1)


class ConnectorTest(SchedulerFixture):
    """laprox.vllm.connector's scheduler side: what a
    preemption, a finish and the worker's reports do to the plugin's state (its methods on the
    scheduler's side read no state of the instance; the instance is made without vLLM's
    configuration)."""

    def setUp(self):
        super().setUp()
        from laprox.vllm import _state
        from laprox.vllm.connector import LaproxConnector

        self.addCleanup(setattr, _state.STATE, "config", _state.STATE.config)
        _state.STATE.config = _state.Config(target="unix:/nonexistent")
        self.connector = LaproxConnector.__new__(LaproxConnector)

    def output(self, new=(), preempted=()):
        from types import SimpleNamespace

        return SimpleNamespace(
            preempted_req_ids=set(preempted),
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))

    def test_a_preemption_drops_the_order_and_gives_the_held_blocks_back(self):
        free = self.pool.get_num_free_blocks()
        generation = self.start("A", 160)
        _compact.decide(self.scheduler, "A", _compact.Ready(160, 40, 160, generation=generation))
        self.assertEqual(self.pool.get_num_free_blocks(), free - 10)  # 3 kept, 7 held
        channel = self.connector.build_connector_meta(self.output(new=["B"], preempted=["A"]))
        self.assertEqual(channel.orders, {})
        self.assertEqual(set(channel.generations), {"B"})
        self.assertNotIn("A", _compact.SCHED.drops)
        self.assertNotIn("A", _compact.SCHED.generations)
        self.assertEqual(self.pool.get_num_free_blocks(), free - 3)  # the request's own 3 left

    def test_an_order_and_the_generations_travel_once(self):
        generation = self.start("A", 160)
        _compact.decide(self.scheduler, "A", _compact.Ready(160, 40, 160, generation=generation))
        channel = self.connector.build_connector_meta(self.output())
        self.assertEqual(set(channel.orders), {"A"})
        self.assertEqual(channel.generations, {"A": generation})
        again = self.connector.build_connector_meta(self.output())
        self.assertEqual((again.orders, again.generations), ({}, {}))

    def test_a_deferred_request_that_finishes_is_spared(self):
        from types import SimpleNamespace

        generation = self.start("A", 160)
        _compact.SCHED.deferred["A"] = _compact.Ready(160, 40, 160, generation=generation)
        self.assertEqual(self.connector.request_finished_all_groups(
            SimpleNamespace(request_id="A"), ([], [])), (False, None))
        self.assertNotIn("A", _compact.SCHED.deferred)
        self.assertEqual(self.metrics.spared, 1)

    def test_the_workers_reports_reach_the_scheduler(self):
        from types import SimpleNamespace

        from laprox.vllm._state import STATE

        self.addCleanup(setattr, STATE, "ready", STATE.ready)
        self.addCleanup(setattr, _compact.SCHED, "arrived", {})
        found = _compact.Ready(160, 40, 160, generation=3)
        STATE.ready = {"A": found}
        reports = self.connector.build_connector_worker_meta()
        self.assertEqual(STATE.ready, {})
        self.assertIsNone(self.connector.build_connector_worker_meta())  # nothing new
        self.connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports))
        self.assertEqual(_compact.SCHED.arrived, {"A": found})


# What install() replaces in vLLM, counted in a fresh interpreter: every function attribute of
# every vLLM class loaded (vllm.*), before and after laprox.vllm._runner.install.
_WRAPPED_PROBE = r"""
import inspect, json, os, sys
os.environ["LAPROX_VLLM_TARGET"] = "unix:/nowhere"
os.environ["LAPROX_VLLM_MODE"] = sys.argv[1]
from vllm.v1.attention.backends import cpu_attn  # noqa: F401
from vllm.v1.core import single_type_kv_cache_manager  # noqa: F401
from vllm.v1.core.sched import scheduler  # noqa: F401
from vllm.v1.worker import gpu_model_runner  # noqa: F401
from laprox.vllm import _runner
from laprox.vllm._state import Config


def functions():
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for cls_name, cls in list(vars(module).items()):
            if inspect.isclass(cls) and cls.__module__ == name:
                for attr, value in list(vars(cls).items()):
                    if callable(value):
                        found[f"{cls_name}.{attr}"] = value
    return found


before = functions()
_runner.install(Config.from_env())
after = functions()
print(json.dumps(sorted(k for k in before if after.get(k) is not before[k])))
"""


class WrappedSymbolsTest(unittest.TestCase):
    """The vLLM functions the plugin still wraps are exactly those the table of
    client/python/laprox/vllm/DESIGN.md section 11 lists, with its modes (`both`, `compact`),
    and its count ("Still wrapped: N symbols (M in mask mode)") and docs/integrations/vllm.md's
    are theirs: install() is run against the real vLLM in a fresh interpreter per mode, and
    every vLLM class's functions compared."""

    @staticmethod
    def table():
        import os
        import re
        path = os.path.join(support.REPO, "client/python/laprox/vllm/DESIGN.md")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        section = text[text.index("**Still wrapped:"):]
        head = re.match(r"\*\*Still wrapped: (\d+) symbols \((\d+) in mask mode\)", section)
        rows = re.findall(r"^\| `([\w.]+)` \| (both|compact) \|", section, re.M)
        return int(head.group(1)), int(head.group(2)), rows

    def wrapped(self, mode):
        import json
        import subprocess
        import sys
        done = subprocess.run([sys.executable, "-c", _WRAPPED_PROBE, mode], capture_output=True,
                              text=True, timeout=600)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        return set(json.loads(done.stdout.strip().splitlines()[-1]))

    def test_the_table_lists_what_install_wraps(self):
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            self.skipTest("vLLM not installed")
        total, mask_mode, rows = self.table()
        self.assertEqual(total, len(rows), "the count is not the table's rows")
        self.assertEqual(mask_mode, sum(mode == "both" for _, mode in rows))
        self.assertEqual(self.wrapped("compact"), {symbol for symbol, _ in rows})
        self.assertEqual(self.wrapped("mask"),
                         {symbol for symbol, mode in rows if mode == "both"})
        words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
        with open(f"{support.REPO}/docs/integrations/vllm.md", encoding="utf-8") as f:
            self.assertIn(f"{words.get(total, total)} vLLM functions are still wrapped", f.read())
