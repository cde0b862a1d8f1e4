#!/usr/bin/env python3
"""Plan parity: the keep-plan laproxd computes from vLLM's paged KV cache (read in place through
the laprox.vllm plugin) against the plan of the same tokens through the Hugging Face
integration (laprox.hf.Compressor), same model, same policy.

    parity.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct
              [--prompts 8] [--budget 128] [--min-agreement 0.99]

Both engines run in float32 on the CPU. Prompts are a needle question (a code in ~1.5K tokens
of filler, through the chat template) and 1-3K tokens of seeded English-like text.
For every prompt and (layer, KV head) the kept position sets are compared; the score is the
fraction of kept entries both plans keep. Exact equality is not expected everywhere: the two
engines compute K, V and the queries with different kernels (fp32 rounding), which can swap
candidates whose scores tie to ~1e-6. Exits 1 when a prompt's agreement is below
--min-agreement or the plugin made no plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from laproxd_support import Laproxd, use_laproxd

WORDS = ("the of and to in is was for that with as on by at from his her which an be this "
         "are or had not but were they their one all there been has have more when who will "
         "river city north winter market letter garden music island council bridge harbour "
         "engine summer doctor village station forest mountain kingdom painter library").split()


def prompt_text(rng: np.random.Generator, words: int) -> str:
    sentences = []
    while words > 0:
        length = int(rng.integers(8, 20))
        sentence = " ".join(rng.choice(WORDS, size=min(length, words)))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        words -= length
    return " ".join(sentences)


def draw_prompts(tokenizer, rng: np.random.Generator, count: int) -> list:
    """Token ids of a needle in ~1.5K tokens of filler, asked for through the chat template
    (a base model without one, such as Gemma 3 270M: as text followed by "Answer:"), first,
    then `count` seeded texts of 1-3K tokens."""
    text = prompt_text(rng, 700) + " The secret code of the harbour is 4821. " + \
        prompt_text(rng, 700) + " What is the secret code of the harbour?"
    if tokenizer.chat_template:
        needle = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
    else:
        needle = tokenizer(text + " Answer: the secret code of the harbour is")
    if isinstance(needle, dict) or hasattr(needle, "input_ids"):
        needle = needle["input_ids"]
    prompts = [[int(x) for x in needle]]
    for i in range(count):
        target_tokens = 1000 + (2000 * i) // max(count - 1, 1)
        ids = tokenizer(prompt_text(rng, target_tokens))["input_ids"][:target_tokens]
        prompts.append([int(x) for x in ids])
    return prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=8, help="1-3K token prompts, besides the "
                    "needle prompt")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--continuation", type=int, default=32, help="greedy tokens under the plan")
    ap.add_argument("--decode-prompts", type=int, default=4)
    ap.add_argument("--logprob-tolerance", type=float, default=1e-3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="vLLM's step budget; small values chunk the prefill (0: vLLM's)")
    args = ap.parse_args()

    use_laproxd(args.laproxd)
    server = Laproxd()
    try:
        target = server.target
        # The masked path: the Hugging Face integration applies the same RAGGED plans
        # (compaction.py checks the compacting path against this one).
        os.environ.update(LAPROX_VLLM_TARGET=target, LAPROX_VLLM_BUDGET=str(args.budget),
                          LAPROX_VLLM_MODE="mask",
                          VLLM_ENABLE_V1_MULTIPROCESSING="0",
                          VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        return compare(args, target)
    finally:
        server.stop()


def compare(args: argparse.Namespace, target: str) -> int:
    import torch
    import transformers
    from vllm import LLM, SamplingParams

    import laprox
    import laprox.hf
    import laprox.vllm

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rng = np.random.default_rng(args.seed)
    prompts = draw_prompts(tokenizer, rng, args.prompts)

    laprox.vllm.register()  # also when the entry point is not installed (PYTHONPATH)
    started = time.perf_counter()
    extra = {}
    if args.max_num_batched_tokens:  # small: long prompts are prefilled in several chunks
        extra = dict(enable_chunked_prefill=True,
                     max_num_batched_tokens=args.max_num_batched_tokens)
    # No prefix caching: the decoding pass prefills the prompts again, and a cache hit inside
    # the query window would leave a sequence without a plan (laprox/vllm/DESIGN.md, section 0).
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=4096,
              seed=0, enable_prefix_caching=False, kv_transfer_config=laprox.vllm.kv_transfer_config(), **extra)
    print(f"vLLM loaded in {time.perf_counter() - started:.1f} s")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, temperature=0.0))
    vllm_plans = laprox.vllm.plans()
    print(f"plugin: {laprox.vllm.metrics()}")
    if len(vllm_plans) != len(prompts):
        print(f"FAIL: the plugin made {len(vllm_plans)} plans for {len(prompts)} prompts")
        return 1

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    worst = 1.0
    with laprox.Client(target) as client:
        press = laprox.hf.Compressor(model, client, budget=args.budget)
        for prompt, output in zip(prompts, outputs):
            # vLLM's engine may suffix the request id it reports.
            matches = [plan for key, plan in vllm_plans.items()
                       if key == output.request_id or key.startswith(output.request_id + "-")]
            if len(matches) != 1:
                print(f"FAIL: request {output.request_id}: plans {sorted(vllm_plans)}")
                return 1
            plan_vllm = matches[0]
            with press, torch.no_grad():
                model(torch.tensor([prompt]), use_cache=True)
            plan_hf = press.plan
            both = kept = 0
            for layer in range(plan_hf.num_layers):
                for head in range(plan_hf.num_kv_heads):
                    a = set(plan_hf.kept(layer, head).tolist())
                    b = set(plan_vllm.kept(layer, head).tolist())
                    both += len(a & b)
                    kept += len(a)
            agreement = both / kept
            worst = min(worst, agreement)
            print(f"n = {len(prompt)}: {both} of {kept} kept entries in both plans "
                  f"({agreement:.5f}); vLLM plan n = {plan_vllm.n}")
    print(f"worst agreement {worst:.5f} (required {args.min_agreement})")
    ok = worst >= args.min_agreement

    # Decoding under the plan: greedy continuations and their log-probs in both engines.
    steps = args.continuation
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:args.decode_prompts]],
                           SamplingParams(max_tokens=steps, temperature=0.0, logprobs=1))
    metrics = laprox.vllm.metrics()
    if metrics.plans != len(prompts) + len(outputs) or metrics.not_captured:
        print(f"FAIL: the decoding pass ran without plans: {metrics}")
        return 1
    worst_logprob = 0.0
    with laprox.Client(target) as client:
        press = laprox.hf.Compressor(model, client, budget=args.budget)
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            vllm_tokens = list(completion.token_ids)
            vllm_logprobs = [step[token].logprob
                             for step, token in zip(completion.logprobs, vllm_tokens)]
            with press, torch.no_grad():
                generated = model.generate(torch.tensor([prompt]), max_new_tokens=steps,
                                           do_sample=False, output_logits=True,
                                           return_dict_in_generate=True)
            hf_tokens = generated.sequences[0, len(prompt):].tolist()
            hf_logprobs = [float(torch.log_softmax(logits[0].double(), -1)[token])
                           for logits, token in zip(generated.logits, hf_tokens)]
            same = next((j for j, (a, b) in enumerate(zip(vllm_tokens, hf_tokens)) if a != b),
                        min(len(vllm_tokens), len(hf_tokens)))
            diff = max(abs(a - b) for a, b in zip(vllm_logprobs[:same], hf_logprobs[:same]))
            worst_logprob = max(worst_logprob, diff)
            print(f"n = {len(prompt)}: {same} of {steps} greedy tokens equal; largest "
                  f"|log-prob difference| over them {diff:.2e}")
            if prompt is prompts[0]:
                print(f"  needle: vLLM {tokenizer.decode(vllm_tokens)!r}\n"
                      f"          HF   {tokenizer.decode(hf_tokens)!r}")
            ok = ok and same == steps and diff <= args.logprob_tolerance
    print(f"decode: largest |log-prob difference| {worst_logprob:.2e} "
          f"(tolerance {args.logprob_tolerance})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
