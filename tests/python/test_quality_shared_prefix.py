"""The quality harness's teacher-forced attention (bench/quality/evaluate.py: Prefix,
teacher_forced) on tiny random models, against references computed another way.

Run:    build/quality-venv/bin/python tests/python/run_tests.py -p test_quality_shared_prefix.py
        (skipped without torch/transformers; no laproxd needed).

evaluate.teacher_forced feeds a continuation after a prefix held once for every batch row, each
row with its own keep masks [L_planned, Hkv, n] over the planned (full-attention) layers;
sliding-window layers (Gemma 3) see the last W positions, as the model's own mask. Checked: the
keep-everything row equals the model's own log-probs of the continuation (a plain forward of
the whole sequence with transformers' masks), and a masked row equals a reference that runs the
whole sequence with an attention that, for each query row after the prefix, physically gathers
the kept prefix entries of the full layers (and the window of a sliding layer) and attends
over them alone. The continuation is longer than the window, so the window also cuts the fed
tokens. A Llama (every layer planned) runs the same checks.
Extend: add a model builder to MODELS.
"""

import importlib.util
import os
import sys
import unittest

import numpy as np

try:
    import torch
    from transformers import (AttentionInterface, Gemma3ForCausalLM,  # noqa: F401
                              LlamaConfig, LlamaForCausalLM)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # Debian's python3 has neither: nothing to test here
    raise unittest.SkipTest("torch/transformers (with Gemma 3) not installed")

import support

support.prepare_package()

import laprox.hf as lhf  # noqa: E402
import test_hf_gemma3  # noqa: E402  (its tiny Gemma 3)

_QUALITY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                        "quality")
sys.path.insert(0, _QUALITY)
_spec = importlib.util.spec_from_file_location("quality_evaluate",
                                               os.path.join(_QUALITY, "evaluate.py"))
E = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = E  # dataclasses look their module up
_spec.loader.exec_module(E)

N, EXTRA, WINDOW, VOCAB = 40, 13, 8, 97
TOL = 1e-5  # fp32, a few layers: the orders of summation differ
REFERENCE = "laprox_test_reference"


def tiny_gemma3():
    """test_hf_gemma3's model (6 layers, full attention at 2 and 5, sliding window 8, H = 4,
    d = 32, softmax scale 24 ** -0.5) with Hkv = 2: two query heads per KV head, so that the
    grouping matters."""
    return test_hf_gemma3.tiny_gemma3(kv_heads=2)


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


MODELS = {"gemma3": tiny_gemma3, "llama": tiny_llama}


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    """Row by row over the whole sequence ([1, H, N, d]): the visible keys gathered physically
    (causal; the last W positions in a sliding layer; after the prefix, in a masked layer, the
    kept prefix entries and every fed token), then a softmax over them alone."""
    keep, n = module._reference_keep, module._reference_n  # [Hkv, n] or None
    window = getattr(module, "sliding_window", None)
    _, heads, total, d = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(1, heads, total, d)
    for h in range(heads):
        kv = h // group
        for r in range(total):
            cols = [c for c in range(r + 1) if window is None or c > r - window]
            if keep is not None and r >= n:
                cols = [c for c in cols if c >= n or keep[kv, c]]
            index = torch.tensor(cols)
            k, v = key[0, kv, index], value[0, kv, index]
            p = torch.softmax((query[0, h, r] @ k.T) * module.scaling, -1)
            out[0, h, r] = p @ v
    return out.transpose(1, 2).contiguous(), None


def reference_log_probs(model, ids, n, masks):
    """Log-probs of positions n .. N-2's next tokens with keep masks [L_planned, Hkv, n]
    applied by physical gathering (_reference_attention)."""
    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    modules = lhf.attention_modules(model)
    planned = lhf.planned_layers(model)
    for l, module in enumerate(modules):
        module._reference_keep = masks[planned.index(l)] if l in planned else None
        module._reference_n = n
    previous = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE)
    try:
        with torch.no_grad():
            logits = model(ids.unsqueeze(0)).logits[0]
    finally:
        model.set_attn_implementation(previous)
        for module in modules:
            del module._reference_keep, module._reference_n
    return torch.log_softmax(logits[n:-1].float(), -1)


class SharedPrefixTest(unittest.TestCase):
    def setUp(self):
        self.saved_wq = E.WQ
        E.WQ = 8

    def tearDown(self):
        E.WQ = self.saved_wq

    def run_model(self, name):
        model = MODELS[name]()
        torch.manual_seed(5)
        ids = torch.randint(3, VOCAB, (N + EXTRA,))
        prefix = E.Prefix(model, ids, N)
        planned = lhf.planned_layers(model)
        hkv = model.config.num_key_value_heads
        rng = np.random.default_rng(11)
        masks = rng.random((len(planned), hkv, N)) < 0.4
        masks[..., :2] = True                  # a sink, as plans keep
        masks[0, 0, 5:30] = False              # a long evicted run in one head only
        lp = E.teacher_forced(model, prefix, ids[N:-1], [None, masks])
        with torch.no_grad():
            own = torch.log_softmax(model(ids.unsqueeze(0)).logits[0, N:-1].float(), -1)
        return model, ids, prefix, planned, masks, lp, own

    def check(self, name):
        model, ids, prefix, planned, masks, lp, own = self.run_model(name)
        self.assertEqual([k.shape[0] for k in prefix.np_keys], [model.config.num_key_value_heads]
                         * len(planned))
        self.assertEqual(len(prefix.np_keys), len(planned))
        gap = float((lp[0] - own).abs().max())
        self.assertLess(gap, TOL, f"{name}: keep-everything row vs the model's own forward")
        E.check_full_row(prefix, lp[0], name)
        # the reference's window semantics are the model's: all-keep reference == own forward
        everything = np.ones_like(masks)
        gap = float((reference_log_probs(model, ids, N, everything) - own).abs().max())
        self.assertLess(gap, TOL, f"{name}: the reference with nothing evicted")
        ref = reference_log_probs(model, ids, N, masks)
        gap = float((lp[1] - ref).abs().max())
        self.assertLess(gap, TOL, f"{name}: masked row vs physical eviction")
        self.assertGreater(float((lp[1] - own).abs().max()), 1e-3,
                           f"{name}: the masks changed nothing (the test would prove nothing)")

    def test_gemma3_sliding_and_full_layers(self):
        self.check("gemma3")

    def test_gemma3_prefix_holds_the_window_of_sliding_layers(self):
        model, _, prefix, planned, _, _, _ = self.run_model("gemma3")
        self.assertEqual(planned, [2, 5])
        for l, keys in enumerate(prefix.keys):
            expected = N if l in planned else WINDOW - 1
            self.assertEqual(keys.shape[2], expected, l)
            self.assertEqual(prefix.key_start[l], N - expected, l)

    def test_llama_every_layer_planned(self):
        self.check("llama")


if __name__ == "__main__":
    unittest.main()
