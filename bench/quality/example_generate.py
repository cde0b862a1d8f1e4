#!/usr/bin/env python3
"""Generate text with a laprox-compressed KV cache: SmolLM2-135M-Instruct on the CPU.

    # laproxd running on /tmp/laproxd.sock (build/service/laproxd --metrics_listen=)
    # and a Python with torch, transformers, gguf and the laprox package (bench/quality/run.sh
    # makes build/quality-venv and extracts the model into build/quality-model/):
    build/quality-venv/bin/python bench/quality/example_generate.py [--budget 128] [--compact]

Prefills a long prompt (a licence text and a question), lets laproxd choose which keys each
(layer, KV head) keeps, and generates with `model.generate()` over the compressed cache; the
same prompt with the full cache is printed for comparison.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see evaluate.py

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import laprox
import laprox.hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF = os.path.join(ROOT, "build", "quality-model", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="unix:/tmp/laproxd.sock")
    ap.add_argument("--gguf", default=GGUF)
    ap.add_argument("--budget", type=int, default=128, help="kept tokens per KV head")
    ap.add_argument("--policy", default="laprox", help="laprox, snapkv, adakv, ...")
    ap.add_argument("--compact", action="store_true",
                    help="one length per layer (plan_shape layer_uniform) and shrink the cache")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(2)

    folder, name = os.path.split(os.path.abspath(args.gguf))
    converted = os.path.join(folder, "hf")  # evaluate.py's fp32 copy of the GGUF, if present
    if os.path.isfile(os.path.join(converted, "model.safetensors")):
        tok = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    else:  # dequantizing the GGUF takes about a minute
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()

    with open("/usr/share/common-licenses/GPL-3") as f:
        document = " ".join(f.read().split()[:1100])
    messages = [{"role": "user", "content": document +
                 "\n\nIn one sentence: what must you do when you convey a modified version?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    n = ids.shape[1]
    # Both runs decode exactly max_new_tokens (an EOS does not stop one earlier), so their times
    # compare; each includes the prefill (and, compressed, the plan). bench/decode_benchmark.py
    # times the decode steps alone.
    gen = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
               do_sample=False,
               attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id)

    with torch.no_grad():
        t0 = time.time()
        full = model.generate(ids, **gen)
        t_full = time.time() - t0

    client = laprox.Client(args.target)
    options = dict(plan_shape="layer_uniform") if args.compact else {}
    press = laprox.hf.Compressor(model, client, budget=args.budget, policy=args.policy,
                                 compact=args.compact, **options)
    with torch.no_grad(), press:
        t0 = time.time()
        out = model.generate(ids, **gen)
        t_press = time.time() - t0

    plan = press.plan
    per_layer = plan.counts.sum(axis=1)
    print(f"prompt: {n} tokens; budget {args.budget} per KV head, policy {args.policy}: "
          f"kept {int(plan.counts.sum())} of {n * plan.counts.size} KV entries "
          f"({plan.counts.sum() / (n * plan.counts.size):.1%}); "
          f"{'cache compacted' if press.compacted else 'evicted keys masked'}")
    print(f"kept per layer (all KV heads): {per_layer.tolist()}")
    print(f"\nfull cache ({t_full:.1f} s):\n  {tok.decode(full[0, n:], skip_special_tokens=True)}")
    print(f"\ncompressed ({t_press:.1f} s):\n  {tok.decode(out[0, n:], skip_special_tokens=True)}")
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
