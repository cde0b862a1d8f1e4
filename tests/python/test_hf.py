"""Tests of laprox.hf, the Hugging Face transformers integration, on a tiny random Llama.

Run:    /usr/bin/python3 tests/python/run_tests.py -k hf   (skipped without torch/transformers;
        bench/quality's venv has them: build/quality-venv/bin/python tests/python/run_tests.py
        --installed -k hf). HfIntegrationTest needs no laproxd: a fake client returns fixed
        keep-plans, so what is tested is the transformers side — masking equals physical
        eviction, a budget >= n changes nothing, compaction equals masking, generate() works,
        state is restored. StoppedLaproxdTest runs the real laproxd (--laproxd) and stops it
        with SIGSTOP: generate() returns within the plan deadline with the full cache.
        DecodeReplanTest runs the real laproxd too: Compressor(decode_buffer=N) holds the cache
        at budget + N through generate(), its re-plans are the oracle's plans of what they
        sent, with the last tokens' queries, and the cache holds the planned entries; every
        step of a generate() gives the logits of the full cache masked to the entries the
        compressor says it held (HeldEntriesReference, an attention function of its own), on
        the tiny model and, in RealModelDecodeReplanTest, on SmolLM2-135M-Instruct
        (build/vllm-model, which tests/integration/vllm/setup.sh writes; skipped without it).
        CI runs this file in the vLLM venv (tests/integration/vllm/run.sh, step 3a).
Extend: add a test method; self.model is a fresh random LlamaForCausalLM (L=2, H=4, Hkv=2).
"""

import contextlib
import os
import time
import unittest
import warnings

import numpy as np

import support

support.prepare_package()

try:
    import torch
    import transformers  # noqa: F401
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:  # Debian's python3 has neither: nothing to test here
    raise unittest.SkipTest("torch/transformers not installed")

import laprox  # noqa: E402
import laprox.hf as lhf  # noqa: E402
from laprox.client import PLAN_DEADLINE_S, plan_deadline  # noqa: E402
from laprox.errors import LaproxError  # noqa: E402

L, H, HKV, D_HEAD, HIDDEN = 2, 4, 2, 16, 64


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=HKV, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


class FakePlan:
    """What Compressor reads from a KeepPlan: counts, kept(l, g), to_masks()."""

    def __init__(self, masks):
        self.masks = masks
        self.counts = masks.sum(-1).astype(np.int32)

    def kept(self, layer, head):
        # Read-only, as a real KeepPlan's views of the response are.
        kept = np.flatnonzero(self.masks[layer, head]).astype(np.int32)
        kept.flags.writeable = False
        return kept

    def to_masks(self):
        return self.masks


class FakeClient:
    """Keeps a seeded random subset per (layer, head) plus the last `window` positions."""

    def __init__(self, keep=None, window=4, equal_counts=False, seed=7):
        self.keep, self.window, self.equal_counts = keep, window, equal_counts
        self.rng = np.random.default_rng(seed)
        self.calls = []

    def register_model(self, name, geometry, o_proj, prepare_cross_grams=False):
        self.geometry = geometry
        self.o_proj = o_proj
        return 11

    def compute_keep_plan(self, model_id, keys, values, window_queries=None, **kw):
        self.calls.append((model_id, keys, values, window_queries, kw))
        n = keys[0].shape[1]
        masks = np.zeros((len(keys), keys[0].shape[0], n), dtype=bool)
        for l in range(masks.shape[0]):
            for g in range(masks.shape[1]):
                if self.keep is None or self.keep >= n:
                    masks[l, g] = True
                    continue
                extra = self.keep - self.window
                if not self.equal_counts:
                    extra += int(self.rng.integers(-2, 3))
                chosen = self.rng.choice(n - self.window, size=extra, replace=False)
                masks[l, g, chosen] = True
                masks[l, g, n - self.window:] = True
        return FakePlan(masks)


class HfIntegrationTest(unittest.TestCase):

    def setUp(self):
        self.model = tiny_llama()
        self.ids = torch.randint(3, 97, (1, 40))
        self.cont = torch.randint(3, 97, (1, 6))

    def prefill(self):
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(self.ids, past_key_values=cache, use_cache=True)
        return cache

    def continuation(self, cache, masks=None):
        n = self.ids.shape[1]
        pos = torch.arange(n, n + self.cont.shape[1]).unsqueeze(0)
        with torch.no_grad():
            if masks is None:
                return self.model(self.cont, past_key_values=cache, position_ids=pos).logits
            with lhf.masked(self.model, masks):
                return self.model(self.cont, past_key_values=cache, position_ids=pos).logits

    def test_geometry_from_config(self):
        g = lhf.geometry(self.model)
        self.assertEqual((g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size),
                         (L, H, HKV, D_HEAD, HIDDEN))
        self.assertEqual(g.softmax_scale, 0.0)  # the default 1/sqrt(d)

    def test_masking_equals_physical_eviction(self):
        # Equal counts per head, so the kept keys can be gathered into a real smaller cache.
        plan = FakeClient(keep=12, equal_counts=True).compute_keep_plan(
            0, [np.zeros((HKV, 40, D_HEAD))] * L, None)
        masked_logits = self.continuation(self.prefill(), [torch.from_numpy(m)
                                                           for m in plan.masks])
        cache = self.prefill()
        for l in range(L):
            keys, values = lhf.cache_layer_kv(cache, l)
            idx = torch.stack([torch.from_numpy(np.array(plan.kept(l, g))).long() for g in range(HKV)])
            idx = idx[None, :, :, None].expand(1, -1, -1, D_HEAD)
            lhf._set_cache_layer_kv(cache, l, keys.gather(2, idx), values.gather(2, idx))
        evicted_logits = self.continuation(cache)
        torch.testing.assert_close(masked_logits, evicted_logits, rtol=1e-4, atol=1e-5)
        full_logits = self.continuation(self.prefill())
        self.assertGreater((masked_logits - full_logits).abs().max().item(), 1e-3)

    def test_all_kept_changes_nothing_and_restores_attention(self):
        full = self.continuation(self.prefill())
        masks = [torch.ones(HKV, 40, dtype=torch.bool)] * L
        kept = self.continuation(self.prefill(), masks)
        torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-6)
        self.assertEqual(self.model.config._attn_implementation, "sdpa")
        self.assertFalse(any(hasattr(m, "_laprox_state") for m in lhf.attention_modules(
            self.model)))

    def test_generate_with_budget_above_n_is_unchanged(self):
        with torch.no_grad():
            ref = self.model.generate(self.ids, max_new_tokens=8, do_sample=False)
        client = FakeClient(keep=None)
        press = lhf.Compressor(self.model, client, budget=1000)
        with torch.no_grad(), press:
            out = press.model.generate(self.ids, max_new_tokens=8, do_sample=False)
        self.assertTrue(torch.equal(out, ref))
        self.assertEqual(len(client.calls), 1)  # one plan per prefill, none while decoding
        model_id, keys, values, queries, kw = client.calls[0]
        self.assertEqual(model_id, 11)
        self.assertEqual(keys[0].shape, (HKV, 40, D_HEAD))
        self.assertEqual(queries[0].shape, (H, 40, D_HEAD))  # n < 64 rows: all n queries
        self.assertEqual(client.o_proj[0].shape, (HIDDEN, H * D_HEAD))

    def test_compacted_cache_generates_like_masked(self):
        outs = []
        for compact in (False, True):
            press = lhf.Compressor(self.model, FakeClient(keep=16), budget=16, compact=compact)
            with torch.no_grad(), press:
                outs.append(self.model.generate(self.ids, max_new_tokens=8, do_sample=False))
            self.assertEqual(press.compacted, compact)
        self.assertTrue(torch.equal(outs[0], outs[1]))

    def test_compacting_warns_nothing(self):
        # The plan's read-only views used to reach torch.as_tensor, which warned on every plan.
        # PyTorch gives that warning once per process; set_warn_always makes every one count.
        press = lhf.Compressor(self.model, FakeClient(keep=16), budget=16, compact=True)
        always = torch.is_warn_always_enabled()
        torch.set_warn_always(True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with torch.no_grad(), press:
                    self.model(self.ids, use_cache=True)
        finally:
            torch.set_warn_always(always)
        self.assertTrue(press.compacted)

    def decode_steps(self, cache, steps, masks=None):
        """Greedy decoding one token per forward (the path generate() takes after the prefill);
        the logits of every step, [steps, vocab]."""
        n = self.ids.shape[1]
        token, logits = self.cont[:, :1], []
        with torch.no_grad(), (lhf.masked(self.model, masks) if masks is not None
                               else contextlib.nullcontext()):
            for i in range(steps):
                out = self.model(token, past_key_values=cache,
                                 position_ids=torch.tensor([[n + i]]),
                                 cache_position=torch.tensor([n + i]))
                logits.append(out.logits[0, -1])
                token = out.logits[:, -1:].argmax(-1)
        return torch.stack(logits)

    def test_masked_decode_steps_equal_physical_eviction(self):
        # One query row per call: the prebuilt decode bias (and, on the CPU, SDPA over the KV
        # heads with enable_gqa) must still equal a cache that holds only the kept keys.
        plan = FakeClient(keep=12, equal_counts=True).compute_keep_plan(
            0, [np.zeros((HKV, 40, D_HEAD))] * L, None)
        masks = [torch.from_numpy(m) for m in plan.masks]
        masked = self.decode_steps(self.prefill(), 6, masks)
        cache = self.prefill()
        for l in range(L):
            keys, values = lhf.cache_layer_kv(cache, l)
            idx = torch.stack([torch.from_numpy(np.array(plan.kept(l, g))).long()
                               for g in range(HKV)])[None, :, :, None].expand(1, -1, -1, D_HEAD)
            lhf._set_cache_layer_kv(cache, l, keys.gather(2, idx), values.gather(2, idx))
        torch.testing.assert_close(masked, self.decode_steps(cache, 6), rtol=1e-4, atol=1e-5)
        self.assertGreater((masked - self.decode_steps(self.prefill(), 6)).abs().max().item(),
                           1e-3)

    def test_decode_bias_is_built_once_and_grows(self):
        state = lhf._State(1, HKV, H)
        keep = torch.ones(HKV, 5, dtype=torch.bool)
        keep[1, 2] = False
        state.set_masks([keep])
        q = torch.zeros(1, H, 1, D_HEAD)
        first = state.decode_bias(0, q, 6)
        self.assertEqual(tuple(first.shape), (1, H, 1, 6))
        expected = torch.zeros(1, H, 1, 6)
        expected[0, 2:4, 0, 2] = float("-inf")  # KV head 1 = query heads 2, 3
        self.assertTrue(torch.equal(first, expected))
        again = state.decode_bias(0, q, 7)  # the next step: a view of the same buffer
        self.assertEqual(again.data_ptr(), first.data_ptr())
        self.assertTrue(torch.equal(again[..., :6], expected))
        self.assertEqual(again[..., 6].abs().sum().item(), 0.0)
        grown = state.decode_bias(0, q, 600)  # past the capacity: rebuilt, same contents
        self.assertTrue(torch.equal(grown[..., :6], expected))
        self.assertEqual(grown[..., 6:].abs().sum().item(), 0.0)
        with self.assertRaises(LaproxError):
            state.decode_bias(0, q, 4)  # the cache is shorter than the masks

    def attention_calls(self, press, steps=8):
        """Runs generate() with `press`; per decode step (one query row) and layer, the mask
        that reached SDPA, and the number of _masked() calls (mask rebuilt for that call)."""
        from transformers.integrations import sdpa_attention
        masking = lhf._masking  # the module whose attention function calls them
        seen, rebuilt = [], [0]
        sdpa, masked_fn = sdpa_attention.sdpa_attention_forward, masking._masked
        gqa = getattr(masking, "_sdpa_masked_gqa", None)

        def spy_sdpa(module, query, key, value, attention_mask, **kw):
            if query.shape[2] == 1:
                seen.append(attention_mask)
            return sdpa(module, query, key, value, attention_mask, **kw)

        def spy_gqa(query, key, value, mask, *args):
            seen.append(mask)
            return gqa(query, key, value, mask, *args)

        def spy_masked(*args, **kw):
            rebuilt[0] += 1
            return masked_fn(*args, **kw)

        sdpa_attention.sdpa_attention_forward = spy_sdpa
        masking._sdpa_masked_gqa, masking._masked = spy_gqa, spy_masked
        try:
            with torch.no_grad(), press:
                out = self.model.generate(self.ids, max_new_tokens=steps, do_sample=False)
        finally:
            sdpa_attention.sdpa_attention_forward = sdpa
            masking._masked = masked_fn
            if gqa is None:
                del masking._sdpa_masked_gqa
            else:
                masking._sdpa_masked_gqa = gqa
        self.assertEqual(len(seen), (steps - 1) * L)
        return out, seen, rebuilt[0]

    def test_compacted_decode_needs_no_masks_with_equal_counts(self):
        # Every head of a layer kept the same count: the compacted cache is exact as it is, so
        # decoding runs without any mask (SDPA's unmasked GQA path, like the full cache).
        press = lhf.Compressor(self.model, FakeClient(keep=16, equal_counts=True), budget=16,
                               compact=True)
        out, seen, rebuilt = self.attention_calls(press)
        self.assertTrue(press.compacted)
        self.assertEqual(rebuilt, 0)
        self.assertTrue(all(m is None for m in seen))
        with torch.no_grad(), lhf.Compressor(self.model, FakeClient(keep=16, equal_counts=True),
                                             budget=16) as masked_press:
            ref = masked_press.model.generate(self.ids, max_new_tokens=8, do_sample=False)
        self.assertTrue(torch.equal(out, ref))

    def test_compacted_decode_reuses_masks_of_padded_layers(self):
        # Unequal counts: padded layers need a mask, built once per layer and sliced at every
        # step (the same storage), never rebuilt by _masked per step.
        press = lhf.Compressor(self.model, FakeClient(keep=16), budget=16, compact=True)
        _, seen, rebuilt = self.attention_calls(press)
        self.assertEqual(rebuilt, 0)
        per_layer = [seen[l::L] for l in range(L)]
        padded = [l for l in range(L) if len(set(press.plan.counts[l].tolist())) > 1]
        self.assertTrue(padded)  # the fake plan pads at least one layer
        for l in range(L):
            if l not in padded:
                self.assertTrue(all(m is None for m in per_layer[l]))
        for l in padded:
            self.assertEqual(len({m.data_ptr() for m in per_layer[l]}), 1)
            self.assertEqual([m.shape[-1] for m in per_layer[l]],
                             [per_layer[l][0].shape[-1] + i for i in range(7)])

    def test_window_queries_are_post_rope(self):
        with lhf.capture_window_queries(self.model, rows=5) as captured, torch.no_grad():
            self.model(self.ids)
        module = lhf.attention_modules(self.model)[0]
        hidden = self.model.model.embed_tokens(self.ids)
        hidden = self.model.model.layers[0].input_layernorm(hidden)
        q = module.q_proj(hidden).view(1, 40, H, D_HEAD).transpose(1, 2)
        pos = torch.arange(40).unsqueeze(0)
        cos, sin = self.model.model.rotary_emb(hidden, pos)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        q_rot, _ = apply_rotary_pos_emb(q, q, cos, sin)
        torch.testing.assert_close(captured[0], q_rot[:, :, -5:].detach(), rtol=1e-5,
                                   atol=1e-6)


class WithLaproxd(unittest.TestCase):
    """A test class served by one real laproxd (self.server)."""

    @classmethod
    def setUpClass(cls):
        cls.server = support.Laproxd()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()


class StoppedLaproxdTest(WithLaproxd):
    """Compressor against the real laproxd, stopped with SIGSTOP during generate(): the plan
    call runs into its deadline (the Compressor's default, plan_deadline(n) = 2.002 s here, not
    the client's 60 s), generate() returns with the tokens of the full cache, the timeout is
    counted, and once laproxd runs again (SIGCONT) the next prefill is compressed."""

    SLACK_S = 1.0  # scheduling on a busy 2-vCPU machine

    def setUp(self):
        self.model = tiny_llama()
        self.ids = torch.randint(3, 97, (1, 40))
        with torch.no_grad():
            self.full = self.model.generate(self.ids, max_new_tokens=8, do_sample=False)
        self.bound = plan_deadline(self.ids.numel(), PLAN_DEADLINE_S) + self.SLACK_S

    def client(self):
        client = laprox.Client(self.server.target)  # the default 60 s per call
        self.addCleanup(client.close)
        return client

    def generate(self):
        started = time.monotonic()
        with torch.no_grad():
            out = self.model.generate(self.ids, max_new_tokens=8, do_sample=False)
        return out, time.monotonic() - started

    def test_generate_keeps_the_full_cache_within_the_deadline_while_laproxd_is_stopped(self):
        press = lhf.Compressor(self.model, self.client(), budget=16)
        with press:
            _, normal = self.generate()
            self.assertIsNotNone(press.plan)
            self.assertLess(press.plan.counts.max(), 40)  # laproxd answering: compressed
            with self.server.paused(), self.assertLogs("laprox.hf", "WARNING") as logged:
                out, stopped = self.generate()
            self.assertIn("did not answer within the plan deadline", logged.output[0])
            self.assertLess(stopped, self.bound + normal,
                            f"generate() took {stopped:.2f} s with laproxd stopped, {normal:.2f} "
                            f"s with it running; plan deadline + slack {self.bound:.2f} s")
            self.assertTrue(torch.equal(out, self.full))  # the full cache's tokens
            self.assertIsNone(press.plan)
            self.assertIsNone(press.masks)
            self.assertEqual(press.timeouts, 1)
            self.generate()  # laproxd runs again: the next prefill is compressed
            self.assertIsNotNone(press.plan)
            self.assertEqual(press.timeouts, 1)

    def test_the_first_call_stages_its_inputs_within_the_deadline(self):
        # A new client has no staging region yet: registering it is part of the stopped call.
        model_id = lhf.register_model(self.client(), self.model)
        press = lhf.Compressor(self.model, self.client(), budget=16, model_id=model_id)
        _, normal = self.generate()  # without the press: what the machine's load adds
        with press:
            with self.server.paused(), self.assertLogs("laprox.hf", "WARNING"):
                out, stopped = self.generate()
            self.assertLess(stopped, self.bound + normal,
                            f"generate() took {stopped:.2f} s with laproxd stopped, {normal:.2f} "
                            f"s without the press; plan deadline + slack {self.bound:.2f} s")
            self.assertTrue(torch.equal(out, self.full))
            self.assertEqual(press.timeouts, 1)
            self.generate()
            self.assertIsNotNone(press.plan)


class RecordingClient:
    """The real laprox.Client, recording the arguments and plan of every decode re-plan."""

    def __init__(self, client):
        self.client, self.replans = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def compute_keep_plan(self, model_id, keys, values, **kwargs):
        plan = self.client.compute_keep_plan(model_id, keys, values, **kwargs)
        if kwargs.get("cache_positions") is not None:
            self.replans.append(dict(keys=[np.array(k) for k in keys],
                                     values=[np.array(v) for v in values],
                                     queries=[np.array(q) for q in kwargs["window_queries"]],
                                     positions=[np.array(p) for p in kwargs["cache_positions"]],
                                     plan=plan))
        return plan


HELD_ATTENTION = "laprox_test_held"


def held_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   **kwargs):
    """The reference of HeldEntriesReference: float64 attention of one forward over the whole
    sequence (query length = key length = T) in which query row p of KV head g sees only the
    keys module._held[g, p] allows. Written here, sharing nothing with laprox.hf's attention."""
    allowed = module._held  # bool [Hkv, T, T]
    group = query.shape[1] // key.shape[1]
    q = query[0].double()
    k = key[0].double().repeat_interleave(group, 0)
    v = value[0].double().repeat_interleave(group, 0)
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed.repeat_interleave(group, 0), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


class HeldEntriesReference:
    """What a generation with Compressor(decode_buffer=N) must compute, from the full cache.

    Attached to a Compressor before generate(), it snapshots the token positions the cache
    holds (press.positions) before every forward. logits(sequence) then runs the whole
    sequence through the model in one forward whose attention (held_attention) lets the token
    at position p see, in layer l and KV head g, exactly the positions the compressor's cache
    held in (l, g) when p was fed, plus p itself; the prompt's rows see their causal prefix (the
    prefill is exact). Equal logits mean the compacted cache held the keys and values of the
    positions it claims, at the right RoPE positions, and nothing else. Layers the compressor
    does not plan (press.layers; a sliding-window layer of Gemma 3) see their causal prefix,
    limited to the module's sliding_window when it has one (key j visible from row p when
    p - j < sliding_window, transformers' sliding mask)."""

    def __init__(self, model, press):
        self.model, self.press, self.snapshots = model, press, []
        decoder = model.get_decoder()
        self._hook = decoder.register_forward_pre_hook(self._snapshot)

    def _snapshot(self, module, args):
        held = self.press.positions
        self.snapshots.append(None if held is None else [p.copy() for p in held])

    def close(self):
        self._hook.remove()

    def logits(self, sequence, prompt):
        """Logits [T, vocab] of `sequence` [1, T] (the prompt of `prompt` tokens, then the
        tokens fed one per forward, as the snapshots saw them)."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        T = sequence.shape[1]
        fed = len(self.snapshots) - 1  # the prefill, then one token per forward
        assert self.snapshots[0] is None and prompt + fed == T, (prompt, fed, T)
        modules = lhf.attention_modules(self.model)
        hkv = lhf.geometry(self.model).num_kv_heads
        planned = getattr(self.press, "layers", list(range(len(modules))))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for layer, module in enumerate(modules):
            window = getattr(module, "sliding_window", None)
            if layer not in planned:
                allowed = causal if window is None else causal.triu(1 - window)
                module._held = allowed.repeat(hkv, 1, 1)
                continue
            l = planned.index(layer)  # the press's positions are per planned layer
            allowed = causal.repeat(hkv, 1, 1)
            allowed[:, prompt:] = False
            for i in range(1, fed + 1):
                p = prompt + i - 1
                held = torch.from_numpy(self.snapshots[i][l].astype(np.int64))
                assert held.shape[0] == hkv and int(held.max()) < p
                allowed[:, p].scatter_(1, held, True)
                allowed[:, p, p] = True
            module._held = allowed
        AttentionInterface.register(HELD_ATTENTION, held_attention)
        AttentionMaskInterface.register(HELD_ATTENTION, sdpa_mask)
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(HELD_ATTENTION)
        try:
            with torch.no_grad():
                return self.model(sequence, use_cache=False).logits[0]
        finally:
            self.model.set_attn_implementation(previous)
            for module in modules:
                del module._held


def check_generate_against_held_reference(test, model, press, ids, new_tokens, atol):
    """generate() with `press` (decode_buffer > 0) for `new_tokens` greedy tokens: the bound
    budget + buffer on the mean entries per head after every forward, two re-plans or more,
    the positions held strictly ascending and ending with the last token fed, and every step's
    logits equal (within `atol`) to HeldEntriesReference's: the full cache masked to the
    entries the compressor says it held. Returns the per-step largest logit difference."""
    n = ids.shape[1]
    bound = press.budget + press.decode_buffer
    reference = HeldEntriesReference(model, press)
    try:
        with torch.no_grad(), press:
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
    finally:
        reference.close()
    test.assertEqual(out.sequences.shape[1], n + new_tokens)
    test.assertEqual(len(press.cache_lengths), new_tokens)
    for step, (mean, longest) in enumerate(press.cache_lengths):
        test.assertLessEqual(mean, bound, f"after forward {step}")
    test.assertGreaterEqual(press.replans, 2)
    test.assertEqual(press.timeouts, 0)
    for l, rows in enumerate(press.positions):
        test.assertTrue((np.diff(rows, axis=1) > 0).all(), f"layer {l}: not strictly ascending")
        # generate() never feeds its last token: the last one fed is at n + new_tokens - 2.
        np.testing.assert_array_equal(rows[:, -1], n + new_tokens - 2)
    expected = reference.logits(out.sequences[:, :-1], n)[n - 1:]
    got = torch.cat(out.logits).to(expected.dtype)
    diff = (got - expected).abs().max(dim=-1).values
    worst = int(diff.argmax())
    test.assertLessEqual(float(diff[worst]), atol,
                         f"step {worst}: logits differ by {float(diff[worst]):.3g} from the "
                         f"full cache masked to the entries held (steps over {atol}: "
                         f"{int((diff > atol).sum())} of {new_tokens})")
    test.assertTrue(torch.equal(out.sequences[0, n:], expected.argmax(-1)))
    return diff


class DecodeReplanTest(WithLaproxd):
    """Compressor(decode_buffer=N) against the real laproxd: the cache stays within budget + N
    entries per head through a long generation, each re-plan is the oracle's plan of the cache
    it was sent, and the cache holds exactly the planned entries at their token positions."""

    B, N, W = 16, 8, 4  # budget, buffer, window (the tiny model's 40-token prompt)

    def setUp(self):
        self.model = tiny_llama()
        self.ids = torch.randint(3, 97, (1, 40))
        self.client = laprox.Client(self.server.target, timeout=30)
        self.addCleanup(self.client.close)

    def press(self, client=None, **kwargs):
        kwargs.setdefault("decode_buffer", self.N)
        return lhf.Compressor(self.model, client or self.client, budget=self.B, window=self.W,
                              **kwargs)

    def test_generate_holds_the_cache_at_budget_plus_buffer(self):
        new_tokens = 64
        press = self.press()
        with torch.no_grad(), press:
            out = self.model.generate(self.ids, max_new_tokens=new_tokens, do_sample=False)
        self.assertEqual(out.shape[1], 40 + new_tokens)
        # One entry after the prefill, then one per decode forward (the last token is not fed).
        self.assertEqual(len(press.cache_lengths), new_tokens)
        for step, (mean, longest) in enumerate(press.cache_lengths):
            self.assertLessEqual(mean, self.B + self.N, f"after forward {step}")
        self.assertGreaterEqual(press.replans, (new_tokens - self.N) // self.N - 1)
        self.assertEqual(press.timeouts, 0)
        for rows in press.positions:
            self.assertTrue((np.diff(rows, axis=1) > 0).all(), "positions not ascending")
            # The last token fed (position 40 + 62) and the window before it are held.
            np.testing.assert_array_equal(rows[:, -self.W:],
                                          np.tile(np.arange(103 - self.W, 103), (HKV, 1)))
        # Planned once, after the prefill, the same cache grows by one entry per token.
        once = self.press(decode_buffer=0, compact=True, plan_shape="layer_uniform")
        with torch.no_grad(), once:
            # min_new_tokens: greedy decoding of the random model may otherwise stop at its
            # end-of-sequence token before the cache has grown by new_tokens
            out = self.model.generate(self.ids, max_new_tokens=new_tokens, do_sample=False,
                                      min_new_tokens=new_tokens, return_dict_in_generate=True)
        self.assertEqual(out.sequences.shape[1], 40 + new_tokens)
        grown = [lhf.cache_layer_kv(out.past_key_values, l)[0].shape[2] for l in range(L)]
        self.assertGreater(np.mean(grown), self.B + new_tokens - 2)

    def test_generate_equals_the_full_cache_masked_to_the_entries_held(self):
        # 64 tokens = 8 buffers: the prefill's plan and 7 re-plans, each compaction checked by
        # the logits of every step after it.
        check_generate_against_held_reference(self, self.model, self.press(), self.ids, 64,
                                              atol=1e-5)

    def test_tokens_at_other_positions_than_the_cache_continues_are_refused(self):
        # A second generate() on the compacted cache takes its positions from the cache's
        # length (far below the tokens' own) and feeds again what it thinks is missing; a
        # forward with explicit position_ids that skip one is refused the same way.
        press = self.press()
        with torch.no_grad(), press:
            out = self.model.generate(self.ids, max_new_tokens=20, do_sample=False,
                                      return_dict_in_generate=True)
            last = int(press.positions[0][0, -1])
            self.assertEqual(last, 40 + 20 - 2)
            more = torch.cat([out.sequences, torch.randint(3, 97, (1, 5))], dim=1)
            with self.assertRaises(ValueError) as caught:
                self.model.generate(more, past_key_values=out.past_key_values,
                                    max_new_tokens=2, do_sample=False)
            self.assertIn(f"but the cache ends at position {last}", str(caught.exception))
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), self.press() as press:
            self.model(self.ids, past_key_values=cache, use_cache=True)
            self.model(self.ids[:, :1], past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[40]]))
            with self.assertRaises(ValueError) as caught:
                self.model(self.ids[:, :1], past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[42]]))
            self.assertIn("positions 42..42, but the cache ends at position 40",
                          str(caught.exception))

    def forced_tokens(self, steps):
        torch.manual_seed(1)
        return torch.randint(3, 97, (1, steps))

    def layer0_queries(self, tokens, positions):
        """Layer 0's post-RoPE queries [H, len(positions), d] of `tokens` (the whole sequence)
        at `positions`, computed from the model's modules: they depend on nothing else."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        pos = torch.as_tensor(positions, dtype=torch.long)[None]
        with torch.no_grad():
            x = self.model.model.layers[0].input_layernorm(
                self.model.model.embed_tokens(tokens[:, pos[0]]))
            q = self.model.model.layers[0].self_attn.q_proj(x).view(1, -1, H, D_HEAD)
            cos, sin = self.model.model.rotary_emb(x, pos)
            q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        return q[0].numpy()

    def teacher_forced(self, press, steps):
        """Prefill, then `steps` one-token forwards of fixed tokens; the cache."""
        tokens = self.forced_tokens(steps)
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), (press or contextlib.nullcontext()):
            self.model(self.ids, past_key_values=cache, use_cache=True)
            for i in range(steps):
                self.model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[40 + i]]),
                           cache_position=torch.tensor([40 + i]))
        return cache

    def test_replans_are_the_oracles_plans_and_the_cache_holds_their_entries(self):
        steps = 40
        recording = RecordingClient(self.client)
        press = self.press(recording)
        cache = self.teacher_forced(press, steps)
        full = self.teacher_forced(None, steps)
        self.assertGreaterEqual(len(recording.replans), 3)
        o_proj = [m.o_proj.weight.detach().double().numpy() for m in lhf.attention_modules(
            self.model)]
        geometry = dict(L=L, H=H, Hkv=HKV, d=D_HEAD, D=HIDDEN, scale=D_HEAD ** -0.5)
        for r in recording.replans:
            layers = [dict(keys=r["keys"][l], values=r["values"][l], queries=r["queries"][l],
                           o_proj=o_proj[l]) for l in range(L)]
            ref = support.laprox_ref.decode_keep_plan(
                geometry, dict(window=self.W, tokens_per_head=self.B,
                               plan_shape="LAYER_UNIFORM"), layers, r["positions"])
            self.assertEqual(support.kept_differences(r["plan"].to_masks(), ref), [])
            # The window's queries are those of the last W tokens.
            sequence = torch.cat([self.ids, self.forced_tokens(steps)], dim=1)
            np.testing.assert_allclose(
                r["queries"][0], self.layer0_queries(sequence, r["positions"][0][0, -self.W:]),
                rtol=1e-4, atol=1e-5)
        # The cache after the last re-plan and the steps since: every layer's entries are the
        # last re-plan's kept ones (heads padded to one length) followed by the later tokens.
        last = recording.replans[-1]
        since = 40 + steps - 1 - int(last["positions"][0][0, -1])
        for l in range(L):
            keys = lhf.cache_layer_kv(cache, l)[0][0].numpy()
            rows = press.positions[l]
            for g in range(HKV):
                kept = last["plan"].kept(l, g)
                held = rows[g, :rows.shape[1] - since]
                self.assertTrue(set(kept.tolist()) <= set(held.tolist()))
                self.assertLessEqual(held.size - kept.size, 1)  # at most one padded entry
                entries = np.searchsorted(last["positions"][l][g], held)
                np.testing.assert_array_equal(last["positions"][l][g][entries], held)
                np.testing.assert_array_equal(keys[g, :held.size], last["keys"][l][g][entries])
            if l == 0:
                # Layer 0's keys depend only on the token and its position: those the cache
                # holds equal the full cache's at the positions it says they have.
                full_keys = lhf.cache_layer_kv(full, 0)[0][0].numpy()
                np.testing.assert_allclose(keys, np.take_along_axis(
                    full_keys, rows[:, :, None].repeat(D_HEAD, axis=2), axis=1),
                    rtol=1e-5, atol=1e-6)

    def test_a_missed_deadline_keeps_the_cache_and_tries_again_later(self):
        press = self.press(deadline=0.3)
        torch.manual_seed(2)
        tokens = torch.randint(3, 97, (1, 30))
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad(), press:
            self.model(self.ids, past_key_values=cache, use_cache=True)

            def step(i):
                self.model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[40 + i]]),
                           cache_position=torch.tensor([40 + i]))
            i = 0
            while press.cache_lengths[-1][0] + 1 < self.B + self.N:
                step(i)
                i += 1
            with self.server.paused(), self.assertLogs("laprox.hf", "WARNING") as logged:
                step(i)  # reaches B + N: the re-plan runs into its deadline
            self.assertIn("missed its deadline", logged.output[0])
            self.assertEqual((press.timeouts, press.replans), (1, 0))
            self.assertGreaterEqual(press.cache_lengths[-1][0], self.B + self.N)
            for j in range(1, self.N // 4 + 1):  # the retry comes N / 4 tokens later
                step(i + j)
            self.assertEqual(press.replans, 1)
            self.assertLessEqual(press.cache_lengths[-1][0], self.B + 1)

    def test_decode_options_are_checked(self):
        for kwargs, needle in ((dict(budget=0.5), "tokens per head"),
                               (dict(kind="snapkv"), "policy kind LAPROX"),
                               (dict(plan_shape="ragged"), "plan_shape LAYER_UNIFORM"),
                               (dict(decode_buffer=-1), ">= 0")):
            kwargs = dict(dict(budget=self.B, decode_buffer=self.N), **kwargs)
            with self.subTest(**kwargs), self.assertRaises(ValueError) as caught:
                lhf.Compressor(self.model, self.client, **kwargs)
            self.assertIn(needle, str(caught.exception))
        press = self.press()
        with torch.no_grad(), press, self.assertRaises(ValueError) as caught:
            self.model(self.ids.repeat(2, 1), use_cache=True)
        self.assertIn("one sequence; the batch has 2", str(caught.exception))


class RealModelDecodeReplanTest(WithLaproxd):
    """Compressor(decode_buffer=N) on a real model, SmolLM2-135M-Instruct (fp32; the checkout
    tests/integration/vllm/setup.sh writes to build/vllm-model, or $LAPROX_TEST_HF_MODEL;
    skipped without it), against the real laproxd: 4 buffers of greedy tokens after a prompt of
    README text, the bound at every step, and every step's logits those of the full cache
    masked to the entries held (HeldEntriesReference)."""

    B, N, W = 64, 32, 16

    @classmethod
    def setUpClass(cls):
        path = os.environ.get("LAPROX_TEST_HF_MODEL", os.path.join(
            support.REPO, "build", "vllm-model", "SmolLM2-135M-Instruct"))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise unittest.SkipTest(f"no model at {path} (tests/integration/vllm/setup.sh)")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        cls.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cls.model.set_attn_implementation("sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path)
        with open(os.path.join(support.REPO, "README.md")) as f:
            text = f.read()
        cls.ids = tokenizer(text, return_tensors="pt").input_ids[:, :300]
        super().setUpClass()

    def test_generate_equals_the_full_cache_masked_to_the_entries_held(self):
        client = laprox.Client(self.server.target, timeout=30)
        self.addCleanup(client.close)
        press = lhf.Compressor(self.model, client, budget=self.B, window=self.W,
                               decode_buffer=self.N)
        diff = check_generate_against_held_reference(self, self.model, press, self.ids,
                                                     4 * self.N, atol=2e-3)
        print(f"\nSmolLM2-135M, B={self.B} N={self.N} w={self.W}: {press.replans} re-plans, "
              f"logits within {float(diff.max()):.2g} of the masked full cache", flush=True)


if __name__ == "__main__":
    unittest.main()
