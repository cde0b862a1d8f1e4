"""Tests of laprox.hf on a tiny random Gemma 3 (sliding-window and full-attention layers).

Run:    build/quality-venv/bin/python tests/python/run_tests.py --laproxd PATH -p test_hf_gemma3.py
        (skipped without torch/transformers). CI runs it beside test_hf.py in the vLLM venv
        (tests/integration/vllm/run.sh, step 3a).

Gemma 3 alternates sliding-window layers, whose cache never holds more than the window, with
full-attention layers, which hold the whole prompt. laprox.hf plans only the latter: the budget
is counted over them, the plan's layer i is model layer planned_layers(model)[i], and the
sliding layers are never masked or compacted. What is tested: the planned layers and what
register_model() and the Compressor send (a fake client); with the real laproxd, that the
prefill plan is the float64 oracle's plan of the full layers (tests/reference/laprox_ref.py)
and leaves the sliding layers as a plain prefill leaves them; that masking equals physical
eviction; and that Compressor(decode_buffer=N) holds the full layers at budget + N while the
sliding layers keep their window, every re-plan the oracle's and every generated step's logits
those of the full cache masked to the entries held (test_hf.HeldEntriesReference).
Extend: add a test method; tiny_gemma3() is a fresh random Gemma3ForCausalLM (6 layers, full
attention at layers 2 and 5, sliding window 8, H=4, Hkv=1, d=32).
"""

import contextlib
import unittest

import numpy as np

import support

support.prepare_package()

try:
    import torch
    from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig
except ImportError:  # Debian's python3 has neither: nothing to test here
    raise unittest.SkipTest("torch/transformers (with Gemma 3) not installed")

import laprox  # noqa: E402
import laprox.hf as lhf  # noqa: E402

import test_hf  # noqa: E402  (its fake and recording clients, HeldEntriesReference)

H, HKV, D_HEAD, HIDDEN, WINDOW, N_PROMPT = 4, 1, 32, 64, 8, 40
DEADLINE = 30.0  # s per plan: a loaded CI machine must not turn a plan into a timeout
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + \
    ["sliding_attention"] * 2 + ["full_attention"]
FULL = [2, 5]
SLIDING = [0, 1, 3, 4]
SCALAR = 24  # query_pre_attn_scalar: the softmax scale 24 ** -0.5, not 1/sqrt(32)


def tiny_gemma3(kv_heads=HKV):
    """The tiny random Gemma 3 of these tests (and of test_quality_shared_prefix.py, with two KV
    heads): LAYER_TYPES, window WINDOW, q/k norm weights spread so that they matter."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=128,
                              num_hidden_layers=len(LAYER_TYPES), num_attention_heads=H,
                              num_key_value_heads=kv_heads, head_dim=D_HEAD,
                              sliding_window=WINDOW, layer_types=list(LAYER_TYPES),
                              query_pre_attn_scalar=SCALAR, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(config).eval()
    # Random init leaves q/k norm weights at their default; spread them so the norms matter.
    with torch.no_grad():
        for module in lhf.attention_modules(model):
            module.q_norm.weight.normal_(0.0, 0.5)
            module.k_norm.weight.normal_(0.0, 0.5)
    return model


def kv(cache, layer):
    keys, values = lhf.cache_layer_kv(cache, layer)
    return keys.clone(), values.clone()


class Gemma3Test(unittest.TestCase):
    """What the model is and what laprox.hf makes of it, with a fake client (no laproxd)."""

    def setUp(self):
        self.model = tiny_gemma3()
        torch.manual_seed(3)
        self.ids = torch.randint(3, 97, (1, N_PROMPT))

    def prefill(self, press=None):
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), (press or contextlib.nullcontext()):
            self.model(self.ids, past_key_values=cache, use_cache=True)
        return cache

    def test_planned_layers_are_the_full_attention_layers(self):
        self.assertEqual(lhf.planned_layers(self.model), FULL)
        g = lhf.geometry(self.model)
        self.assertEqual((g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size),
                         (len(FULL), H, HKV, D_HEAD, HIDDEN))
        self.assertAlmostEqual(g.softmax_scale, SCALAR ** -0.5, places=12)
        # The cache's own view agrees: the sliding layers are transformers' sliding layers.
        cache = self.prefill()
        self.assertEqual([l for l, layer in enumerate(cache.layers)
                          if not getattr(layer, "is_sliding", False)], FULL)
        self.assertEqual([lhf.cache_layer_kv(cache, l)[0].shape[2] for l in SLIDING],
                         [WINDOW - 1] * len(SLIDING))

    def test_planned_layers_without_layer_types_come_from_the_modules(self):
        # A config without layer_types: the modules' sliding_window says which are sliding.
        config = self.model.config
        kinds = config.layer_types
        try:
            config.layer_types = None
            self.assertEqual(lhf.planned_layers(self.model), FULL)
        finally:
            config.layer_types = kinds

    def test_register_model_registers_the_full_layers_only(self):
        client = test_hf.FakeClient()
        self.assertEqual(lhf.register_model(client, self.model), 11)
        self.assertEqual(client.geometry, lhf.geometry(self.model))
        modules = lhf.attention_modules(self.model)
        self.assertEqual(len(client.o_proj), len(FULL))
        for sent, l in zip(client.o_proj, FULL):
            np.testing.assert_array_equal(sent, modules[l].o_proj.weight.detach().numpy())

    def test_compressor_sends_the_full_layers_and_leaves_the_sliding_ones(self):
        client = test_hf.FakeClient(keep=12)
        with lhf.capture_window_queries(self.model, rows=64) as queries, torch.no_grad():
            plain = self.prefill()
        press = lhf.Compressor(self.model, client, budget=12, compact=True)
        cache = self.prefill(press)
        self.assertEqual(len(client.calls), 1)
        _, keys, values, sent_queries, _ = client.calls[0]
        self.assertEqual(len(keys), len(FULL))
        for i, l in enumerate(FULL):
            np.testing.assert_array_equal(keys[i], kv(plain, l)[0][0].numpy())
            np.testing.assert_array_equal(values[i], kv(plain, l)[1][0].numpy())
            np.testing.assert_array_equal(sent_queries[i], queries[l][0].numpy())
        self.assertEqual([m is None for m in press.masks],
                         [l not in FULL for l in range(len(LAYER_TYPES))])
        for l in SLIDING:  # never compacted: what a plain prefill leaves
            for mine, theirs in zip(kv(cache, l), kv(plain, l)):
                self.assertTrue(torch.equal(mine, theirs), f"layer {l}")
        for i, l in enumerate(FULL):  # compacted to the plan (one KV head: no padding)
            kept = torch.from_numpy(np.array(press.plan.kept(i, 0), dtype=np.int64))
            self.assertTrue(torch.equal(kv(cache, l)[0][0, 0], kv(plain, l)[0][0, 0, kept]))

    def test_window_queries_are_post_norm_post_rope(self):
        # Layer 2's queries from its own input: q_proj, q_norm, then RoPE (the full layers'
        # rotary embedding), which is what the attention function receives.
        from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb
        module = lhf.attention_modules(self.model)[2]
        seen = {}

        def grab(mod, args, kwargs):
            seen["hidden"] = args[0] if args else kwargs["hidden_states"]
            seen["rope"] = kwargs["position_embeddings"]
        hook = module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with lhf.capture_window_queries(self.model, rows=5) as captured, torch.no_grad():
                self.model(self.ids)
        finally:
            hook.remove()
        with torch.no_grad():
            q = module.q_proj(seen["hidden"]).view(1, N_PROMPT, H, D_HEAD).transpose(1, 2)
            q = module.q_norm(q)
            q, _ = apply_rotary_pos_emb(q, q, *seen["rope"])
        torch.testing.assert_close(captured[2], q[:, :, -5:], rtol=1e-5, atol=1e-6)


class Gemma3LaproxdTest(test_hf.WithLaproxd):
    """Prefill plans against the real laproxd and the oracle."""

    B, W = 16, 4

    def setUp(self):
        self.model = tiny_gemma3()
        torch.manual_seed(3)
        self.ids = torch.randint(3, 97, (1, N_PROMPT))
        torch.manual_seed(4)
        self.cont = torch.randint(3, 97, (1, 6))
        self.client = laprox.Client(self.server.target, timeout=30)
        self.addCleanup(self.client.close)

    def prefill(self, press=None):
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), (press or contextlib.nullcontext()):
            self.model(self.ids, past_key_values=cache, use_cache=True)
        return cache

    def continuation(self, cache, masks=None, one_by_one=False):
        """Logits [1, 6, vocab] of the teacher-forced continuation, in one forward or (as the
        reference on a physically shrunk cache needs) one token per forward: transformers
        builds the full layers' causal mask from cache positions, which index the cache only
        while it holds every token, so a multi-token call on a shrunk cache would let the new
        tokens see each other; laprox.hf's masks do not rely on it."""
        n = self.ids.shape[1]
        positions = torch.arange(n, n + self.cont.shape[1])
        chunks = [slice(i, i + 1) for i in range(len(positions))] if one_by_one \
            else [slice(0, len(positions))]
        logits = []
        with torch.no_grad(), (lhf.masked(self.model, masks) if masks is not None
                               else contextlib.nullcontext()):
            for chunk in chunks:
                logits.append(self.model(self.cont[:, chunk], past_key_values=cache,
                                         use_cache=True, position_ids=positions[None, chunk],
                                         cache_position=positions[chunk]).logits)
        return torch.cat(logits, dim=1)

    def oracle(self, cache, queries):
        """laprox_ref's plan of the full layers of a plain prefill."""
        modules = lhf.attention_modules(self.model)
        geometry = dict(L=len(FULL), H=H, Hkv=HKV, d=D_HEAD, D=HIDDEN, scale=SCALAR ** -0.5)
        layers = [dict(keys=kv(cache, l)[0][0].double().numpy(),
                       values=kv(cache, l)[1][0].double().numpy(),
                       queries=queries[l][0].double().numpy(),
                       o_proj=modules[l].o_proj.weight.detach().double().numpy()) for l in FULL]
        return support.laprox_ref.keep_plan(geometry, dict(window=self.W,
                                                           tokens_per_head=self.B),
                                            layers, N_PROMPT)

    def test_prefill_plan_is_the_oracles_on_the_full_layers(self):
        with lhf.capture_window_queries(self.model, rows=64) as queries, torch.no_grad():
            plain = self.prefill()
        ref = self.oracle(plain, queries)
        press = lhf.Compressor(self.model, self.client, budget=self.B, window=self.W,
                               deadline=DEADLINE)
        cache = self.prefill(press)
        masks = press.plan.to_masks()
        self.assertEqual(masks.shape, (len(FULL), HKV, N_PROMPT))
        self.assertEqual(support.kept_differences(masks, ref), [])
        # B tokens per KV head on average over the full layers only.
        self.assertEqual(int(masks.sum()), len(FULL) * HKV * self.B)
        for i, l in enumerate(FULL):
            self.assertTrue(torch.equal(press.masks[l], torch.from_numpy(masks[i])[None]))
        for l in range(len(LAYER_TYPES)):  # masked, not compacted: every layer as it was
            if l in SLIDING:
                self.assertIsNone(press.masks[l])
            for mine, theirs in zip(kv(cache, l), kv(plain, l)):
                self.assertTrue(torch.equal(mine, theirs), f"layer {l}")

    def test_masking_equals_physical_eviction(self):
        # One KV head, and the same count in every full layer (allocation PER_LAYER): the plan
        # can be applied physically with the model's own masks (which transformers builds for
        # one length of the full layers), the sliding layers left whole.
        options = dict(window=self.W, allocation="per_layer", deadline=DEADLINE)
        press = lhf.Compressor(self.model, self.client, budget=self.B, **options)
        self.prefill(press)
        self.assertEqual(press.plan.counts.tolist(), [[self.B]] * len(FULL))
        masked = self.continuation(self.prefill(), press.masks)
        cache = self.prefill()
        for i, l in enumerate(FULL):
            keys, values = lhf.cache_layer_kv(cache, l)
            kept = torch.from_numpy(np.array(press.plan.kept(i, 0), dtype=np.int64))
            lhf._set_cache_layer_kv(cache, l, keys[:, :, kept], values[:, :, kept])
        evicted = self.continuation(cache, one_by_one=True)
        torch.testing.assert_close(masked, evicted, rtol=1e-4, atol=1e-5)
        self.assertGreater((masked - self.continuation(self.prefill())).abs().max().item(),
                           1e-3)  # the plan evicted something that mattered
        # compact=True is that same physical eviction, done by the Compressor; its continuation
        # in one forward takes the causal mask of the compacted layers from their layout.
        with lhf.Compressor(self.model, self.client, budget=self.B, compact=True,
                            **options) as compacted:
            cache = self.prefill()
            self.assertTrue(compacted.compacted)
            self.assertEqual([lhf.cache_layer_kv(cache, l)[0].shape[2] for l in FULL],
                             [self.B] * len(FULL))
            torch.testing.assert_close(self.continuation(cache), evicted, rtol=1e-4,
                                       atol=1e-5)


class Gemma3DecodeReplanTest(test_hf.WithLaproxd):
    """Compressor(decode_buffer=N) on Gemma 3: the full layers stay within budget + N entries
    per head, the sliding layers at their window, re-plans are the oracle's plans of the full
    layers, and generate()'s logits are those of the full cache masked to the entries held."""

    B, N, W = 16, 8, 4

    def setUp(self):
        self.model = tiny_gemma3()
        torch.manual_seed(3)
        self.ids = torch.randint(3, 97, (1, N_PROMPT))
        self.client = laprox.Client(self.server.target, timeout=30)
        self.addCleanup(self.client.close)

    def press(self, client=None):
        return lhf.Compressor(self.model, client or self.client, budget=self.B, window=self.W,
                              decode_buffer=self.N, deadline=DEADLINE)

    def test_teacher_forced_steps_hold_full_layers_at_budget_plus_buffer(self):
        steps = 40
        recording = test_hf.RecordingClient(self.client)
        press = self.press(recording)
        torch.manual_seed(1)
        tokens = torch.randint(3, 97, (1, steps))
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), press:
            self.model(self.ids, past_key_values=cache, use_cache=True)
            for i in range(steps):
                position = torch.tensor([N_PROMPT + i])
                self.model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True,
                           position_ids=position[None], cache_position=position)
                full = [lhf.cache_layer_kv(cache, l)[0].shape[2] for l in FULL]
                sliding = [lhf.cache_layer_kv(cache, l)[0].shape[2] for l in SLIDING]
                # The bound is on the mean over the full layers (LAPROX allocates layers
                # unequally); the compressor tracks exactly what they hold.
                self.assertLessEqual(np.mean(full), self.B + self.N, f"step {i}")
                self.assertEqual(full, [p.shape[1] for p in press.positions])
                self.assertEqual(press.cache_lengths[-1], (np.mean(full), max(full)))
                self.assertEqual(sliding, [WINDOW - 1] * len(SLIDING), f"step {i}")
                self.assertEqual(len(press.positions), len(FULL))
        self.assertGreaterEqual(press.replans, 3)
        self.assertEqual(len(recording.replans), press.replans)
        modules = lhf.attention_modules(self.model)
        geometry = dict(L=len(FULL), H=H, Hkv=HKV, d=D_HEAD, D=HIDDEN, scale=SCALAR ** -0.5)
        for r in recording.replans:
            self.assertEqual(len(r["keys"]), len(FULL))
            layers = [dict(keys=r["keys"][i], values=r["values"][i], queries=r["queries"][i],
                           o_proj=modules[l].o_proj.weight.detach().double().numpy())
                      for i, l in enumerate(FULL)]
            ref = support.laprox_ref.decode_keep_plan(
                geometry, dict(window=self.W, tokens_per_head=self.B,
                               plan_shape="LAYER_UNIFORM"), layers, r["positions"])
            self.assertEqual(support.kept_differences(r["plan"].to_masks(), ref), [])

    def test_generate_equals_the_full_cache_masked_to_the_entries_held(self):
        diff = test_hf.check_generate_against_held_reference(self, self.model, self.press(),
                                                             self.ids, 48, atol=1e-5)
        self.assertEqual(len(diff), 48)


if __name__ == "__main__":
    unittest.main()
