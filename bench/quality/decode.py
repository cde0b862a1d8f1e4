#!/usr/bin/env python3
"""Quality through long generations (issue 37): LaProx re-planning at budget + buffer against
LaProx planned once after the prefill, StreamingLLM, and kvpress's DecodingPress around SnapKV
and KnormPress, all at the same budget B and buffer N, on SmolLM2-135M-Instruct (CPU).

    # the runs (kvpress's venv: torch, transformers, kvpress; plus grpcio and protobuf), in two
    # processes of one torch thread each, then the report:
    for s in 0 1; do OMP_NUM_THREADS=1 build/kvpress-venv/bin/python bench/quality/decode.py \\
        --laproxd=build/service/laproxd --shard=$s/2 --json=build/decode-$s.json & done; wait
    /usr/bin/python3 bench/quality/decode.py --report build/decode-0.json build/decode-1.json \\
        --out=bench/quality/DECODE.md --merged=bench/quality/decode.json

Two parts, paired (every method sees the same prompts and the same tokens):

- continuation: a held-out document's first --prompt tokens are the prompt; the model with its
  full cache samples --cont tokens (temperature 0.7, top-k 50, seeded per document); every
  method then prefills the prompt and is teacher-forced along that continuation one token per
  forward, so that its cache evolves as in decoding, and each position's next-token
  distribution is compared with the full cache's (the raw logits of the sampling run): KL(full
  || method) and top-1 agreement, averaged per 128-token segment;
- late needle: a held-out span with a sentence "The secret code of the <word> is <6 digits>."
  at a random depth is the prompt; the full cache samples a --passage-token continuation; each
  method prefills the prompt, is teacher-forced along the passage, then reads a question about
  the code and decodes greedily; exact match = the 6 digits appear in the first 10 tokens. The
  full cache is run the same way (its exact match bounds what any method can keep).

Held-out documents: sources that bench/quality/tasks.py (SOURCES) does not read (checked when
the run starts), so no text here is one that the main evaluation, the dev grid or the default
choice saw: GPL-1 and LGPL-3 from /usr/share/common-licenses, binutils' NEWS, and the man pages
of ps, top, systemctl, mount, tmux, gpg, openssl, ssh-keygen and apt-get.

Methods (B per KV head on average, buffer N, window 32):
- laprox replan: laprox.hf.Compressor(budget=B, decode_buffer=N): LAYER_UNIFORM plans, the
  cache compacted after the prefill and re-planned whenever the mean entries per head reach
  B + N (the laproxd default policy otherwise);
- laprox once: the same prefill plan, compacted, never re-planned (the cache grows);
- laprox replan plugin (only when --methods names it): laprox replan with the vLLM plugin's
  LAYER_UNIFORM scoring (laprox.vllm._state.COMPACT_LAPROX_SCORING: AVG pooling, one sink)
  instead of laproxd's default;
- streaming: kvpress PrefillDecodingPress(StreamingLLMPress(4 sinks) to B after the prefill,
  DecodingPress(StreamingLLMPress, compression_interval=N, target_size=B));
- dp snapkv, dp knorm: the same with SnapKVPress (window 32, LaProx's, over the buffered
  hidden states: SnapKV needs more buffered states than its window, so N > 32) and KnormPress. DecodingPress counts decoding forwards per layer and compresses every N of
  them to B entries, so with one token per forward its cache runs between B and B + N, as
  laprox replan's does (the re-plan fires at the same cache size, the compression point may
  differ by a step);
- dp adakv (only when --methods names it): DecodingPress around AdaKVPress(SnapKVPress) (window
  32): head-wise budgets whose total is B per head on average. AdaKVPress masks instead of
  evicting: every entry stays in memory, the masked ones take no part in attention until the
  next compression, which scores them again (an entry masked once may come back). The cache
  sizes reported are the entries attention reads (the length less the masked ones per head).

Gemma 3 (--model its converted folder, --bos: every document starts with <bos>, as joint.py
--bos): every method plans, compresses and is measured on the full-attention layers only
(laprox.hf.planned_layers); kvpress skips the sliding-window layers of
Gemma3ForConditionalGeneration only, so kvpress_full_layers applies that rule to the text model
as well.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SEGMENT = 128
HELD_OUT = [("GPL-1", "file:/usr/share/common-licenses/GPL-1"),
            ("LGPL-3", "file:/usr/share/common-licenses/LGPL-3"),
            ("binutils NEWS", "file:/usr/share/doc/binutils/NEWS.gz"),
            ("man ps", "man:ps"), ("man top", "man:top"), ("man systemctl", "man:systemctl"),
            ("man mount", "man:mount"), ("man tmux", "man:tmux"), ("man gpg", "man:gpg"),
            ("man openssl", "man:openssl"), ("man ssh-keygen", "man:ssh-keygen"),
            ("man apt-get", "man:apt-get")]
METHODS = ["laprox replan", "laprox once", "streaming", "dp snapkv", "dp knorm",
           "laprox replan plugin", "dp adakv"]
# the methods a run measures unless --methods names others (the last two came with issue 44)
DEFAULT_METHODS = METHODS[:5]


# --------------------------------------------------------------------------------------------
# Runs (kvpress's venv)
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def kvpress_full_layers(model, press) -> Iterator[None]:
    """`press(model)`, compressing only the layers that hold the whole prompt. kvpress 0.5.5
    skips Gemma 3's sliding-window layers for Gemma3ForConditionalGeneration only; the text
    model (Gemma3ForCausalLM) would have them compressed to B as well, which laprox.hf never
    does (planned_layers). Its own rule is widened to the text model for the block."""
    from unittest import mock
    from kvpress.presses import base_press
    skipped = base_press.Gemma3ForConditionalGeneration
    if getattr(model.config, "layer_types", None) and "sliding_attention" in \
            model.config.layer_types:
        skipped = (skipped, type(model))
    with mock.patch.object(base_press, "Gemma3ForConditionalGeneration", skipped), press(model):
        yield


def run(args) -> Dict[str, Any]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    import tasks as T
    from kvpress import (AdaKVPress, DecodingPress, KnormPress, PrefillDecodingPress,
                         SnapKVPress, StreamingLLMPress)
    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
    import support  # this checkout's client with fresh stubs
    support.prepare_package()
    import laprox
    import laprox.hf as lhf

    assert not {source for _, source in HELD_OUT} & {source for _, source in T.SOURCES}
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    planned = lhf.planned_layers(model)   # Gemma 3: its full-attention layers
    corpus = T.Corpus(tok, args.prompt + 64, HELD_OUT)
    client = laprox.Client(args.target, timeout=120)
    model_id = lhf.register_model(client, model)
    B, N = args.budget, args.buffer
    shard, shards = (int(x) for x in args.shard.split("/"))

    def ratio_to(n: int) -> float:
        return DecodingPress(base_press=KnormPress(), compression_interval=N,
                             target_size=B)._find_target_compression_ratio(n, B)

    def kvpress_method(name: str, n: int):
        scorer = {"streaming": lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=4),
                  "dp snapkv": lambda cr: SnapKVPress(compression_ratio=cr, window_size=32),
                  "dp knorm": lambda cr: KnormPress(compression_ratio=cr),
                  "dp adakv": lambda cr: AdaKVPress(SnapKVPress(compression_ratio=cr,
                                                                window_size=32))}[name]
        return PrefillDecodingPress(
            prefilling_press=scorer(ratio_to(n)),
            decoding_press=DecodingPress(base_press=scorer(0.0), compression_interval=N,
                                         target_size=B, hidden_states_buffer_size=256))

    def context(name: str, n: int):
        if name == "laprox replan":
            return lhf.Compressor(model, client, budget=B, model_id=model_id, decode_buffer=N,
                                  deadline=30)
        if name == "laprox replan plugin":   # the vLLM plugin's LAYER_UNIFORM scoring
            from laprox.vllm._state import COMPACT_LAPROX_SCORING
            return lhf.Compressor(model, client, budget=B, model_id=model_id, decode_buffer=N,
                                  deadline=30, **COMPACT_LAPROX_SCORING)
        if name == "laprox once":
            return lhf.Compressor(model, client, budget=B, model_id=model_id, compact=True,
                                  plan_shape="layer_uniform", deadline=30)
        return kvpress_full_layers(model, kvpress_method(name, n))

    def forced(name: str, prompt, feed, decode: int = 0):
        """Prefill `prompt` [1, n] under the method, then one token per forward along `feed`
        [1, T]; then `decode` greedy tokens. The logits [1 + T, vocab] (position t predicts
        feed[t]), the greedy tokens, and the mean entries per head after every forward."""
        n = prompt.shape[1]
        cache = DynamicCache(config=model.config)
        logits, sizes, greedy = [], [], []
        with torch.no_grad(), context(name, n):
            out = model(prompt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].double())
            steps = [feed[:, t:t + 1] for t in range(feed.shape[1])]
            pos = n
            for t in range(feed.shape[1] + decode):
                token = steps[t] if t < len(steps) else out.logits[:, -1:].argmax(-1)
                if t >= len(steps):
                    greedy.append(int(token))
                out = model(token, past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[pos]]),
                            cache_position=torch.tensor([pos]))
                pos += 1
                if t < len(steps):
                    logits.append(out.logits[0, -1].double())
                sizes.append(attended(cache))
            if decode:
                greedy.append(int(out.logits[:, -1:].argmax(-1)))
        return torch.stack(logits), greedy[:decode], sizes

    def attended(cache) -> float:
        """Mean entries per KV head that attention reads in the planned layers: the cache's
        length less what AdaKVPress masks (it keeps the masked entries in memory)."""
        sizes = []
        for l in planned:
            n = lhf.cache_layer_kv(cache, l)[0].shape[2]
            masked = getattr(model.model.layers[l].self_attn, "masked_key_indices", None)
            if masked is not None:
                n -= masked[0].numel() / model.config.num_key_value_heads
            sizes.append(n)
        return float(np.mean(sizes))

    def sample(prompt, count: int, seed: int):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=count, min_new_tokens=count,
                                 do_sample=True, temperature=0.7, top_k=50,
                                 output_logits=True, return_dict_in_generate=True)
        return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits)[:, 0].double()

    result: Dict[str, Any] = dict(continuation=[], needle=[],
                                  model=os.path.basename(os.path.normpath(args.model)),
                                  budget=B, buffer=N, prompt=args.prompt, cont=args.cont,
                                  passage=args.passage, torch=torch.__version__,
                                  planned_layers=len(planned), bos=args.bos)

    def save() -> None:  # after every item, so that a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    rng = random.Random("decode/documents")
    spans = [corpus.span(rng, args.prompt, index=i) for i in range(args.documents)]
    if args.bos:   # Gemma 3 is trained with <bos> first (joint.py --bos does the same)
        spans = [(label, torch.cat([torch.tensor([tok.bos_token_id]), ids]))
                 for label, ids in spans]
    for i, (label, ids) in enumerate(spans):
        if i % shards != shard:
            continue
        t0 = time.time()
        prompt = ids[None]
        cont, full_logits = sample(prompt, args.cont, seed=1000 + i)
        # Position t of a method's logits predicts cont[t]; the full cache's logits at t
        # predicted the token sampled there.
        full_lp = torch.log_softmax(full_logits, -1)
        doc = dict(source=label, n=args.prompt, methods={})
        for name in args.methods:
            logits, _, sizes = forced(name, prompt, cont[:, :-1])
            lp = torch.log_softmax(logits, -1)
            kl = (full_lp.exp() * (full_lp - lp)).sum(-1).clamp_min(0).numpy()
            top1 = (logits.argmax(-1) == full_logits.argmax(-1)).numpy()
            segs = range(0, args.cont, SEGMENT)
            doc["methods"][name] = dict(
                kl=[float(kl[s:s + SEGMENT].mean()) for s in segs],
                top1=[float(top1[s:s + SEGMENT].mean()) for s in segs],
                max_entries=max(sizes), mean_entries=float(np.mean(sizes)))
        result["continuation"].append(doc)
        save()
        print(f"[{shard}] document {i} ({label}): {time.time() - t0:.0f} s; " + ", ".join(
            f"{m} KL {np.mean(d['kl']):.3f} top1 {np.mean(d['top1']):.3f}"
            for m, d in doc["methods"].items()), flush=True)

    words = T.WORDS
    for i in range(args.needles):
        if i % shards != shard:
            continue
        t0 = time.time()
        r = random.Random(f"decode/needle/{i}")
        label, hay = corpus.span(r, args.prompt - 40, index=i + 3)
        word, code = r.choice(words), "".join(r.choice("0123456789") for _ in range(6))
        needle = tok(f" The secret code of the {word} is {code}. ", return_tensors="pt",
                     add_special_tokens=False).input_ids[0]
        at = int(r.uniform(0.1, 0.9) * hay.shape[0])
        prompt = torch.cat([hay[:at], needle, hay[at:]])[None]
        if args.bos:
            prompt = torch.cat([torch.tensor([[tok.bos_token_id]]), prompt], dim=1)
        passage, _ = sample(prompt, args.passage, seed=2000 + i)
        question = tok(f"\n\nQuestion: what is the secret code of the {word}? Answer: The "
                       f"secret code of the {word} is", return_tensors="pt",
                       add_special_tokens=False).input_ids
        feed = torch.cat([passage, question], dim=1)
        item = dict(source=label, word=word, code=code, depth=at / hay.shape[0], methods={})
        for name in ["full"] + args.methods:
            if name == "full":
                with torch.no_grad():
                    seq = torch.cat([prompt, feed], dim=1)
                    out = model.generate(seq, max_new_tokens=10, do_sample=False)
                greedy = out[0, seq.shape[1]:].tolist()
                sizes = [float(seq.shape[1] + 10)]
            else:
                _, greedy, sizes = forced(name, prompt, feed, decode=10)
            text = tok.decode(greedy)
            item["methods"][name] = dict(em=code in re.sub(r"\s", "", text), answer=text,
                                         max_entries=max(sizes))
        result["needle"].append(item)
        save()
        print(f"[{shard}] needle {i} ({label}, depth {item['depth']:.2f}): "
              f"{time.time() - t0:.0f} s; " + ", ".join(
                  f"{m} {'ok' if d['em'] else 'miss'}" for m, d in item["methods"].items()),
              flush=True)
    client.close()
    return result


# --------------------------------------------------------------------------------------------
# Report (any Python with numpy)
# --------------------------------------------------------------------------------------------

def report(paths: List[str], out: str, merged_path: str, command: str,
           title: str = "issue 37") -> None:
    import numpy as np
    import stats as S
    parts = [json.load(open(p)) for p in paths]
    data = dict(parts[0], continuation=[d for p in parts for d in p["continuation"]],
                needle=[d for p in parts for d in p["needle"]])
    data["continuation"].sort(key=lambda d: d["source"])
    data["needle"].sort(key=lambda d: (d["source"], d["word"]))
    if merged_path:
        with open(merged_path, "w") as f:
            json.dump(data, f, indent=0)
    docs, needles = data["continuation"], data["needle"]
    B, N = data["budget"], data["buffer"]
    ran = docs[0]["methods"] if docs else needles[0]["methods"] if needles else {}
    methods = [m for m in METHODS if m in ran]   # those the run measured, "laprox replan" first
    segs = len(docs[0]["methods"][methods[0]]["kl"]) if docs else 0
    lines = [
        f"# Quality through long generations ({title})", "",
        f"Generated by `bench/quality/decode.py` (its docstring says how); {command}.",
        f"Model {data['model']} (safetensors, fp32, CPU), torch {data['torch']}; "
        f"{datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}.",
        f"Budget B = {B} entries per KV head, buffer N = {N}, window 32; prompts of "
        f"{data['prompt']} tokens from held-out documents.", "",
        "## Continuation: KL(full || method) and top-1 agreement per 128-token segment", "",
        f"{len(docs)} documents, {data['cont']} sampled tokens each, teacher-forced. Mean over "
        "documents; in brackets the 95% bootstrap interval over documents.", ""]
    header = "| method | " + " | ".join(f"tokens {s * SEGMENT}–{(s + 1) * SEGMENT - 1}"
                                        for s in range(segs)) + " | all | largest cache |"
    for metric, digits in (("kl", 3), ("top1", 3)):
        lines += [f"**{'KL (nats)' if metric == 'kl' else 'top-1 agreement'}**", "", header,
                  "|---" * (segs + 3) + "|"]
        for m in methods:
            cells = []
            for s in range(segs):
                x = [d["methods"][m][metric][s] for d in docs]
                mean, lo, hi = S.mean_interval(x)
                cells.append(f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]")
            x = [float(np.mean(d["methods"][m][metric])) for d in docs]
            mean, lo, hi = S.mean_interval(x)
            size = max(d["methods"][m]["max_entries"] for d in docs)
            lines.append(f"| {m} | " + " | ".join(cells) +
                         f" | {mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}] "
                         f"| {size:.0f} |")
        lines.append("")
    lines += ["**laprox replan against each other method** (paired over documents, each "
              "document's mean over all segments; the difference replan − other with its "
              "bootstrap interval over documents, on how many documents re-planning did "
              "better, and the exact two-sided sign test of that count; negative KL and "
              f"positive top-1 favour re-planning). With {len(docs)} documents the sign "
              f"test's smallest p is {min(1.0, 2.0 / 2 ** len(docs)):.3g}.",
              "", "| other | Δ KL | replan better | sign p | Δ top-1 | replan better | sign p |",
              "|---|---|---|---|---|---|---|"]
    for m in methods[1:]:
        row = []
        for metric in ("kl", "top1"):
            a = np.array([float(np.mean(d["methods"]["laprox replan"][metric])) for d in docs])
            b = np.array([float(np.mean(d["methods"][m][metric])) for d in docs])
            diff, lo, hi, _ = S.paired_bootstrap(a, b)
            better = (a < b) if metric == "kl" else (a > b)
            _, _, p = S.mcnemar_exact(better, (a > b) if metric == "kl" else (a < b))
            row += [f"{diff:+.4f} [{lo:+.4f}, {hi:+.4f}]", f"{int(better.sum())}/{len(a)}",
                    f"{p:.3f}"]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    needle_lines = [
        "", "## Late needle: exact match after a long generated passage", "",
        f"{len(needles)} prompts; the needle in the prompt, then {data['passage']} sampled "
        "tokens, then the question. Wilson 95% intervals; McNemar's exact test against laprox "
        "replan on the discordant prompts.", "",
        "| method | exact match | 95% interval | vs replan: replan wins / other wins | p "
        "| largest cache |", "|---|---|---|---|---|---|"]
    if needles:   # a run with --needles=0 has no such section
        lines += needle_lines
    for m in ["full"] + methods if needles else []:
        em = [it["methods"][m]["em"] for it in needles]
        lo, hi = S.wilson(sum(em), len(em))
        if m in ("full", "laprox replan"):
            versus = "—", "—"
        else:
            wa, wb, p = S.mcnemar_exact([it["methods"]["laprox replan"]["em"] for it in needles],
                                        em)
            versus = f"{wa} / {wb}", f"{p:.3f}"
        size = max((it["methods"][m]["max_entries"] for it in needles), default=float("nan"))
        lines.append(f"| {m} | {sum(em)}/{len(em)} | [{lo:.2f}, {hi:.2f}] | {versus[0]} "
                     f"| {versus[1]} | {size:.0f} |")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def start_laproxd(path: str):
    tmp = tempfile.mkdtemp(prefix="laprox-decode-")
    sock = os.path.join(tmp, "laproxd.sock")
    proc = subprocess.Popen([path, "--socket=" + sock, "--metrics_listen=", "--backend=cpu",
                             "--threads=2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while not os.path.exists(sock):
        if proc.poll() is not None:
            raise RuntimeError("laproxd did not start")
        time.sleep(0.05)
    return proc, "unix:" + sock


@contextlib.contextmanager
def laproxd_target(target: Optional[str], laproxd: Optional[str]) -> Iterator[str]:
    """`target` when given; else a laproxd started from `laproxd` (default: build/'s) on a
    private socket for the block, and its address."""
    if target is not None:
        yield target
        return
    proc, started = start_laproxd(laproxd or os.path.join(HERE, "..", "..", "build", "service",
                                                          "laproxd"))
    try:
        yield started
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", default=None)
    ap.add_argument("--target", default=None)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "build", "vllm-model",
                                                    "SmolLM2-135M-Instruct"))
    ap.add_argument("--documents", type=int, default=6)
    ap.add_argument("--needles", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=1024)
    ap.add_argument("--passage", type=int, default=512)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--bos", action="store_true",
                    help="prepend <bos> to every document (Gemma 3)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="*", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "DECODE.md"))
    ap.add_argument("--merged", default=None)
    ap.add_argument("--command", default="see the docstring for the command")
    ap.add_argument("--title", default="issue 37")
    args = ap.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}")
    if args.report is not None:
        report(args.report, args.out, args.merged, args.command, args.title)
        return 0
    with laproxd_target(args.target, args.laproxd) as args.target:
        started = time.time()
        result = run(args)
        result["seconds"] = time.time() - started
    with open(args.json or f"decode-{args.shard.replace('/', 'of')}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
