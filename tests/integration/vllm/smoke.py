"""vLLM (CPU, offline) against transformers on the converted SmolLM2 (run by `setup.sh --check`).

    build/vllm-venv/bin/python tests/integration/vllm/smoke.py MODEL_DIR [--dtype=float32]

1. Tokenizers: for every prompt, vLLM's `LLM.get_tokenizer().encode(p)` must equal transformers'
   `AutoTokenizer.from_pretrained(MODEL_DIR).encode(p)`, and the prompt token ids vLLM reports
   for a text prompt must be those ids too.
2. Generation: vLLM greedy-generates MAX_TOKENS tokens for 3 prompts (`enforce_eager=True`,
   `VLLM_CPU_KVCACHE_SPACE=1`, in-process engine) and transformers does the same in fp32 (an
   argmax loop over the model's own KV cache, so EOS does not stop it; vLLM gets
   `ignore_eos=True`). The token ids must be equal; a divergence is accepted only at a near-tie,
   where transformers' top-1 and top-2 logits differ by less than TIE_TOLERANCE (different
   kernels sum in different orders).
3. Text: vLLM's output text must equal transformers' `decode` of the same ids, and neither may
   contain byte-level markers (Ġ, Ċ: a tokenizer without a ByteLevel decoder).
Prints the load time and one line per prompt; exit status 0 when all three hold, 1 otherwise.
--dtype=bfloat16 is for looking only: bf16 rounding moves logits by more than TIE_TOLERANCE (seen:
prompt 3 diverges at token 9, where transformers' fp32 top-2 gap is 0.085).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_TOKENS = 16
TIE_TOLERANCE = 0.01  # logits; an fp32 near-tie where summation order may pick either token
PROMPTS = [
    "The capital of France is",
    "In 2024, the 3 largest cities of Japan were",
    "<|im_start|>user\nWhat is a KV cache? Answer in one sentence.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
# Tokenizer-only prompts: digits, leading/trailing/multiple spaces, newlines, non-ASCII.
EXTRA_TOKENIZER_PROMPTS = [" leading space", "a  b   c\n\n\td", "naïve café – 東京 🚀",
                           "x = 12345.678"]
BYTE_LEVEL_MARKERS = ("Ġ", "Ċ", "ĉ")


def log(*args) -> None:
    print(*args, flush=True)


def hf_greedy(model, ids: list[int], steps: int):
    """`steps` argmax tokens after `ids`, and the top-1 minus top-2 logit gap at each step."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    out, gaps = [], []
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1].float()
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            x = top.indices[:1].view(1, 1)
    return out, gaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ok = True
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=2048,
              max_num_seqs=4, seed=0)
    log(f"== vLLM load ({args.dtype}): {time.perf_counter() - start:.1f} s")
    v_tok = llm.get_tokenizer()

    log("== tokenizers: vLLM encode == transformers encode")
    for p in PROMPTS + EXTRA_TOKENIZER_PROMPTS:
        a, b = v_tok.encode(p), hf_tok.encode(p)
        same = a == b
        ok &= same
        log(f"   {'ok  ' if same else 'DIFF'} {p!r}: {len(b)} ids" + ("" if same else
            f"\n        vLLM {a}\n        HF   {b}"))

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    from_text = llm.generate(PROMPTS, params, use_tqdm=False)
    from_ids = llm.generate([TokensPrompt(prompt_token_ids=hf_tok.encode(p)) for p in PROMPTS],
                            params, use_tqdm=False)
    log(f"== vLLM generate (2 x {len(PROMPTS)} prompts x {MAX_TOKENS} tokens): "
        f"{time.perf_counter() - start:.1f} s")

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    log(f"== greedy ids: vLLM ({args.dtype}) vs transformers (fp32), {MAX_TOKENS} tokens")
    for p, vt, vi in zip(PROMPTS, from_text, from_ids):
        ids = hf_tok.encode(p)
        if list(vt.prompt_token_ids) != ids:
            ok = False
            log(f"   DIFF prompt ids of a text prompt {p!r}: {list(vt.prompt_token_ids)} != {ids}")
        ref, gaps = hf_greedy(model, ids, MAX_TOKENS)
        got = list(vi.outputs[0].token_ids)
        if got != list(vt.outputs[0].token_ids):
            ok = False
            log(f"   DIFF vLLM text prompt vs token prompt: {list(vt.outputs[0].token_ids)}")
        if got == ref:
            verdict = f"equal ({MAX_TOKENS}/{MAX_TOKENS})"
        else:
            i = next(k for k, (x, y) in enumerate(zip(got, ref)) if x != y)
            tie = gaps[i] < TIE_TOLERANCE
            ok &= tie
            verdict = (f"{'near-tie' if tie else 'DIVERGE'} at token {i}: vLLM {got[i]} "
                       f"HF {ref[i]} (HF top-2 gap {gaps[i]:.4g})")
        text, hf_text = vi.outputs[0].text, hf_tok.decode(got)
        markers = [m for m in BYTE_LEVEL_MARKERS if m in text or m in hf_text]
        if text != hf_text or markers:
            ok = False
            verdict += f"; TEXT vLLM {text!r} HF {hf_text!r}"
        log(f"   {p[-40:]!r}: {verdict}\n      ids  {got}\n      text {text!r}")
    log("== smoke: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
