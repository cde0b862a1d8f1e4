#!/usr/bin/env python3
"""kvpress 0.5.5's DecodingPress(SnapKVPress) rotates its window queries at the wrong positions.

During a decoding compression, DecodingPress hands SnapKVPress the hidden states of the last
`compression_interval` tokens but the forward's own position embeddings, which cover only the
token of that forward; SnapKVPress.compute_window_attention takes `cos[:, -window:]` of them (one
row) and broadcasts it, so all `window` queries are rotated as if they sat at the current
position. (During the prefill the embeddings cover every row and nothing is wrong.)

This script shows it and measures what it changes on SmolLM2-135M-Instruct: a held-out document
(GPL-1, not in tasks.SOURCES) prefilled with --prompt tokens and compressed to B by SnapKV, then
teacher-forced along the document's next --steps tokens, one per forward, under
DecodingPress(SnapKVPress, compression_interval=N, target_size=B) as bench/quality/decode.py
configures it. At every decoding compression of every layer it scores the cache twice — as
kvpress does, and with each window query rotated at its own position (the rotary embedding of
the model at positions p - len + 1 .. p of the buffered states) — and reports how many of the
B kept entries per KV head differ. --mode chooses which scores the run keeps ("kvpress", the
default, or "fixed"); the KL of each against the full cache over the forced tokens is printed.

    OMP_NUM_THREADS=1 build/kvpress-venv/bin/python bench/quality/snapkv_decoding_rope.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "build", "vllm-model",
                                                    "SmolLM2-135M-Instruct"))
    ap.add_argument("--source", default="file:/usr/share/common-licenses/GPL-1")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--buffer", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    args = ap.parse_args()

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from kvpress import DecodingPress, PrefillDecodingPress, SnapKVPress
    import tasks as T

    assert args.source not in {s for _, s in T.SOURCES}, "not a held-out source"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    ids = tok(T.read_text(args.source), return_tensors="pt",
              add_special_tokens=False).input_ids[:, :args.prompt + args.steps]
    assert ids.shape[1] == args.prompt + args.steps, f"{args.source}: {ids.shape[1]} tokens"
    rotary = model.model.rotary_emb
    B, N, W = args.budget, args.buffer, args.window

    def own_positions(hidden_states, kwargs):
        """The rotary embeddings of the buffered rows at their own positions."""
        p = int(kwargs["cache_position"][-1])
        rows = hidden_states.shape[1]
        return rotary(hidden_states, torch.arange(p - rows + 1, p + 1)[None])

    records = []  # (layer, buffered rows, cos rows kvpress used, kept entries that differ)

    @dataclasses.dataclass
    class Comparing(SnapKVPress):
        keep: str = "kvpress"

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            as_is = super().score(module, hidden_states, keys, values, attentions, kwargs)
            cos = kwargs["position_embeddings"][0]
            if cos.shape[1] >= hidden_states.shape[1]:
                return as_is  # the prefill: every row has its own embedding already
            fixed = super().score(module, hidden_states, keys, values, attentions,
                                  dict(kwargs, position_embeddings=own_positions(
                                      hidden_states, kwargs)))
            n_kept = int(keys.shape[2] * (1 - self.compression_ratio))
            a = as_is.topk(n_kept, dim=-1).indices[0]
            b = fixed.topk(n_kept, dim=-1).indices[0]
            differ = [n_kept - np.intersect1d(a[g].numpy(), b[g].numpy()).size
                      for g in range(a.shape[0])]
            records.append((module.layer_idx, hidden_states.shape[1], cos.shape[1],
                            n_kept, differ))
            return fixed if self.keep == "fixed" else as_is

    def run(mode):
        ratio = DecodingPress(base_press=SnapKVPress(), compression_interval=N,
                              target_size=B)._find_target_compression_ratio(args.prompt, B)
        press = PrefillDecodingPress(
            prefilling_press=SnapKVPress(compression_ratio=ratio, window_size=W),
            decoding_press=DecodingPress(base_press=Comparing(window_size=W, keep=mode),
                                         compression_interval=N, target_size=B,
                                         hidden_states_buffer_size=256))
        return forced(press)

    def forced(press):
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad(), (press(model) if press else _null()):
            out = model(ids[:, :args.prompt], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].double())
            for t in range(args.prompt, args.prompt + args.steps - 1):
                out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[t]]), cache_position=torch.tensor([t]))
                logits.append(out.logits[0, -1].double())
        return torch.log_softmax(torch.stack(logits), -1)

    t0 = time.time()
    full = forced(None)
    kl = {}
    for mode in ("kvpress", "fixed"):
        del records[:]
        lp = run(mode)
        kl[mode] = (full.exp() * (full - lp)).sum(-1).clamp_min(0).numpy()
        if mode == "kvpress":
            shown = records[:]
    print(f"{os.path.basename(os.path.normpath(args.model))}, {args.source}: prompt "
          f"{args.prompt}, {args.steps} forced tokens, B {B}, N {N}, window {W}; "
          f"{time.time() - t0:.0f} s")
    layers = sorted({r[0] for r in shown})
    print(f"decoding compressions: {len(shown) // len(layers)} per layer; buffered rows "
          f"{sorted({r[1] for r in shown})}, cos rows kvpress rotates them with "
          f"{sorted({r[2] for r in shown})}")
    differ = np.array([d for r in shown for d in r[4]], dtype=float)
    n_kept = shown[0][3]
    print(f"kept entries per KV head that differ (kvpress vs own positions), of {n_kept}: "
          f"mean {differ.mean():.1f} ({100 * differ.mean() / n_kept:.1f}%), "
          f"median {np.median(differ):.0f}, max {differ.max():.0f}")
    per_layer = [np.mean([d for r in shown if r[0] == l for d in r[4]]) for l in layers]
    print("mean per layer: " + " ".join(f"{x:.0f}" for x in per_layer))
    for mode, x in kl.items():
        print(f"KL(full || dp snapkv, {mode} rotation) over the forced tokens: mean "
              f"{x.mean():.4f}, tokens {args.prompt}-{args.prompt + args.steps - 1}")
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
