#!/usr/bin/env python3
"""Quality of laprox keep-plans on a real model (SmolLM2-135M-Instruct) on the CPU.

Run through bench/quality/run.sh, which makes the venv, extracts the GGUF, builds and starts
laproxd. Directly:

    evaluate.py --target unix:/tmp/sock --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf [--quick]

For every document (real Debian-shipped texts, see DOCUMENTS) the prefix of n tokens is
prefilled ONCE; its keys, values, post-RoPE window queries and the attention inputs kvpress
needs are kept. Every (method, budget) then only needs:
  - a keep-plan: laproxd (LaProx variants and the baselines) or kvpress's own press `compress`
    called on the same per-layer inputs its forward hook would see (the hook compresses layer l
    after layer l's attention output is computed, so prefill is method-independent);
  - output fidelity, per layer, from the kept tensors (no model call);
  - one batched teacher-forced forward of the 128-token continuation over a copy of the prefix
    cache with the evicted (layer, KV head, position) masked out (laprox.hf.masked).
The needle task prefills each haystack once as well; the question's last token and the answer
are then teacher-forced over the compressed cache (greedy exact match = the argmax equals the
gold token at every answer position, the same as greedy decoding of the answer).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

# With 2 threads on 2 busy cores, OpenMP's default spin-waiting makes every parallel region
# wait for a descheduled thread (small ops ran 7x slower than with 1 thread); passive waiting
# avoids it. Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS = [32, 64, 128, 256, 512]
CONT = 128              # teacher-forced continuation tokens (the mode sets it)
WQ = 64                 # window query rows captured per layer (largest policy window)
FID_ROWS = 32           # window rows the fidelity metric uses (LaProx's window, kept by all)
HS_ROWS = 128           # last attention-input rows kept for kvpress (it reads the last 64)

# (name, kind, source); source "laprox": Policy options for laproxd; "kvpress": press factory.
LAPROX_METHODS = [
    ("LaProx", {}),
    ("LaProx global-raw", {"allocation": "global_raw"}),
    ("LaProx per-layer", {"allocation": "per_layer"}),
    ("LaProx uniform", {"allocation": "uniform"}),
    ("LaProx A*|V|", {"indicator": "attention_x_value"}),
    ("LaProx A", {"indicator": "attention"}),
    ("LaProx gqa=summed", {"gqa_value": "summed_projection"}),
    ("LaProx gqa=product", {"gqa_value": "mean_head_product"}),
    ("LaProx gqa=exact", {"gqa_value": "exact_block"}),
    ("StreamingLLM", {"kind": "streaming_llm"}),
    ("SnapKV", {"kind": "snapkv"}),
    ("PyramidKV", {"kind": "pyramidkv"}),
    ("AdaKV", {"kind": "adakv"}),
    ("CriticalKV", {"kind": "criticalkv"}),
    ("CriticalAdaKV", {"kind": "critical_adakv"}),
    ("CAKE", {"kind": "cake"}),
]
# Variants of LaProx that change what it shares with the SnapKV family, to find out why SnapKV
# and AdaKV beat it on KL from B = 128 (--investigate adds them; see RESULTS.md "Investigation").
INVESTIGATE_METHODS = [
    ("LaProx w=64", {"window": 64}),
    ("LaProx sinks=4", {"sinks": 4}),
    ("LaProx pool=5", {"pool_kernel": 5}),
    ("LaProx w=64 pool=5", {"window": 64, "pool_kernel": 5}),
    ("LaProx gqa=product w=64", {"gqa_value": "mean_head_product", "window": 64}),
    ("LaProx A w=64", {"indicator": "attention", "window": 64}),
    ("LaProx per-layer w=64", {"allocation": "per_layer", "window": 64}),
]
KVPRESS_METHODS = ["kvpress SnapKV", "kvpress AdaKV", "kvpress CriticalKV",
                   "kvpress StreamingLLM", "kvpress PyramidKV"]

# Candidate documents in order: (label, how to read it). Licences and man pages, all prose.
DOCUMENTS = [
    ("GPL-3", "file:/usr/share/common-licenses/GPL-3"),
    ("man bash", "man:bash"),
    ("MPL-2.0", "file:/usr/share/common-licenses/MPL-2.0"),
    ("man find", "man:find"),
    ("LGPL-2.1", "file:/usr/share/common-licenses/LGPL-2.1"),
    ("man ssh", "man:ssh"),
    ("GFDL-1.3", "file:/usr/share/common-licenses/GFDL-1.3"),
    ("man git", "man:git"),
    ("man systemd", "man:systemd"),
    ("MPL-1.1", "file:/usr/share/common-licenses/MPL-1.1"),
    ("man cmake", "man:cmake"),
    ("man tar", "man:tar"),
    ("GPL-2", "file:/usr/share/common-licenses/GPL-2"),
    ("man man", "man:man"),
    ("Apache-2.0", "file:/usr/share/common-licenses/Apache-2.0"),
    ("git changelog", "file:/usr/share/doc/git/changelog.gz"),
]

MODES = {
    # documents, their context lengths (cycled), continuation tokens, needle haystacks x depths,
    # needle context. --quick is a smoke run of every method and budget on little data.
    "quick": dict(docs=2, lengths=[2048], cont=32, needle_docs=1, depths=[0.3, 0.7],
                  needle_len=1024),
    "full": dict(docs=8, lengths=[2048, 3072, 4000], cont=128, needle_docs=2,
                 depths=[0.1, 0.35, 0.65, 0.9], needle_len=2048),
}


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def read_document(source: str) -> str:
    kind, _, arg = source.partition(":")
    if kind == "file":
        if not os.path.exists(arg):
            return ""
        opener = gzip.open if arg.endswith(".gz") else open
        with opener(arg, "rt", errors="replace") as f:
            text = f.read()
    else:
        env = dict(os.environ, MANWIDTH="80", MAN_KEEP_FORMATTING="", LC_ALL="C.UTF-8")
        try:
            text = subprocess.run(["man", "-P", "cat", arg], capture_output=True, text=True,
                                  env=env, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    text = re.sub(r"[ \t]+", " ", text)          # man's justification spaces
    text = re.sub(r"\n\s*\n\s*\n+", "\n\n", text)
    return text.strip()


def load_model(gguf: str):
    """The GGUF through transformers (dequantized to fp32). Converting takes over a minute on 2
    cores, so the converted model is saved beside the GGUF (hf/, safetensors) and reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(gguf))
    converted = os.path.join(folder, "hf")
    stamp = os.path.join(converted, "source.json")
    source = {"gguf": name, "size": os.path.getsize(gguf)}
    try:
        with open(stamp) as f:
            cached = json.load(f) == source
    except (OSError, ValueError):
        cached = False
    if cached:
        tok = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    else:
        log(f"== converting {name} (dequantized to fp32; cached in {converted})")
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model.save_pretrained(converted)
        tok.save_pretrained(converted)
        with open(stamp, "w") as f:
            json.dump(source, f)
    model.eval()
    return tok, model


# --------------------------------------------------------------------------------------------
# Prefill once
# --------------------------------------------------------------------------------------------

class Prefix:
    """Everything a method needs about one prefilled prefix."""

    def __init__(self, model, ids: torch.Tensor):
        import laprox.hf as lhf
        from transformers import DynamicCache
        self.n = ids.shape[1]
        modules = lhf.attention_modules(model)
        hs, pe = {}, {}

        def pre_hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            hs[module.layer_idx] = h[:, -HS_ROWS:].detach().clone()
            cos, sin = kwargs["position_embeddings"]
            pe[module.layer_idx] = (cos[:, -HS_ROWS:].clone(), sin[:, -HS_ROWS:].clone())

        handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
        cache = DynamicCache(config=model.config)
        try:
            with torch.no_grad(), lhf.capture_window_queries(model, WQ) as queries:
                out = model(ids, past_key_values=cache, use_cache=True)
        finally:
            for h in handles:
                h.remove()
        self.last_logits = out.logits[0, -1].float()
        L = len(modules)
        self.keys = [lhf.cache_layer_kv(cache, l)[0].detach().clone() for l in range(L)]
        self.values = [lhf.cache_layer_kv(cache, l)[1].detach().clone() for l in range(L)]
        self.queries = [queries[l].detach().clone() for l in range(L)]    # [1, H, WQ, d]
        self.hidden = hs
        self.pos_emb = pe
        self.modules = modules
        # numpy views for laproxd (float32, [Hkv, n, d] / [H, WQ, d])
        self.np_keys = [k[0].numpy() for k in self.keys]
        self.np_values = [v[0].numpy() for v in self.values]
        self.np_queries = [q[0].numpy() for q in self.queries]

    def cache(self, batch: int):
        """A fresh DynamicCache holding the prefix `batch` times."""
        from transformers import DynamicCache
        cache = DynamicCache()
        for l, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k.expand(batch, -1, -1, -1).contiguous(),
                         v.expand(batch, -1, -1, -1).contiguous(), l)
        return cache


# --------------------------------------------------------------------------------------------
# Keep masks
# --------------------------------------------------------------------------------------------

def laprox_masks(client, model_id: int, prefix: Prefix, options: Dict[str, Any],
                 budget: int) -> np.ndarray:
    plan = client.compute_keep_plan(model_id, prefix.np_keys, prefix.np_values,
                                    window_queries=prefix.np_queries, budget=budget,
                                    policy=dict(options))
    return plan.to_masks()                                           # bool [L, Hkv, n]


def kvpress_press(name: str, budget: int, n: int):
    from kvpress import (AdaKVPress, CriticalKVPress, PyramidKVPress, SnapKVPress,
                         StreamingLLMPress)
    # n_kept = int(n * (1 - cr)) = budget exactly (kvpress truncates the product).
    cr = 1.0 - (budget + 0.5) / n
    return {
        "kvpress SnapKV": lambda: SnapKVPress(compression_ratio=cr),
        "kvpress AdaKV": lambda: AdaKVPress(SnapKVPress(compression_ratio=cr)),
        "kvpress CriticalKV": lambda: CriticalKVPress(SnapKVPress(compression_ratio=cr)),
        "kvpress StreamingLLM": lambda: StreamingLLMPress(compression_ratio=cr),
        "kvpress PyramidKV": lambda: PyramidKVPress(compression_ratio=cr),
    }[name]()


def _rows_to_positions(keys: torch.Tensor, out: torch.Tensor) -> np.ndarray:
    """Positions [Hkv, k] of the rows of out [Hkv, k, d] in keys [Hkv, n, d], by exact bytes
    (RoPE makes every row of a head distinct)."""
    keys_np = np.ascontiguousarray(keys.numpy())
    out_np = np.ascontiguousarray(out.numpy())
    pos = np.empty(out_np.shape[:2], dtype=np.int64)
    for h in range(keys_np.shape[0]):
        index = {row.tobytes(): i for i, row in enumerate(keys_np[h])}
        try:
            pos[h] = [index[row.tobytes()] for row in out_np[h]]
        except KeyError:
            raise AssertionError("kvpress kept a row that is not in the prefix keys") from None
    return pos


def kvpress_masks(name: str, prefix: Prefix, budget: int) -> np.ndarray:
    press = kvpress_press(name, budget, prefix.n)
    L = len(prefix.keys)
    hkv = prefix.keys[0].shape[1]
    masks = np.zeros((L, hkv, prefix.n), dtype=bool)
    with torch.no_grad():
        for l, module in enumerate(prefix.modules):
            keys, values = prefix.keys[l], prefix.values[l]
            kwargs = {"position_embeddings": prefix.pos_emb[l], "hidden_states": prefix.hidden[l]}
            module.__dict__.pop("masked_key_indices", None)
            k_out, _ = press.compress(module, prefix.hidden[l], keys, values, None, kwargs)
            evicted = module.__dict__.pop("masked_key_indices", None)
            if evicted is not None:                                  # AdaKV: masks, same shape
                masks[l] = True
                _, heads, seqs = evicted
                masks[l][heads.numpy(), seqs.numpy()] = False
            else:
                pos = _rows_to_positions(keys[0], k_out[0])
                masks[l][np.arange(hkv)[:, None], pos] = True
    return masks


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

class Fidelity:
    """Per-layer window attention output sum_h A^h V W_O^h with all keys vs kept keys.

    exp(logits - row max) is computed once per layer; a keep mask then only zeroes columns, and
    the renormalised softmax is (E * keep) / sum(E * keep)."""

    def __init__(self, model, prefix: Prefix):
        self.layers = []
        for l, module in enumerate(prefix.modules):
            q = prefix.queries[l][0, :, -FID_ROWS:].float()               # [H, w, d]
            k, v = prefix.keys[l][0].float(), prefix.values[l][0].float()  # [Hkv, n, d]
            hkv, n, d = k.shape
            g = q.shape[0] // hkv
            q = q.reshape(hkv, g * FID_ROWS, d)
            logits = (q @ k.transpose(1, 2)) * float(module.scaling)     # [Hkv, G*w, n]
            rows = (torch.arange(FID_ROWS) + (n - FID_ROWS)).repeat(g).unsqueeze(1)
            logits.masked_fill_(torch.arange(n).unsqueeze(0) > rows, float("-inf"))
            e = torch.exp(logits - logits.amax(-1, keepdim=True))
            w_o = module.o_proj.weight.detach().float()                  # [D, H*d]
            full = self._out(e, v, w_o, g)
            self.layers.append((e, v, w_o, full, g))

    @staticmethod
    def _out(e, v, w_o, g):
        heads = (e @ v) / e.sum(-1, keepdim=True)                        # [Hkv, G*w, d]
        heads = heads.view(-1, FID_ROWS, heads.shape[-1])                # [H, w, d]
        return heads.transpose(0, 1).reshape(FID_ROWS, -1) @ w_o.T        # [w, D]

    def __call__(self, masks: np.ndarray) -> Tuple[float, float]:
        cos, rel = [], []
        for l, (e, v, w_o, full, g) in enumerate(self.layers):
            keep = torch.from_numpy(masks[l]).to(e.dtype).unsqueeze(1)    # [Hkv, 1, n]
            kept = self._out(e * keep, v, w_o, g)
            cos.append(F.cosine_similarity(kept.double(), full.double(), dim=-1).mean().item())
            rel.append(((kept - full).double().norm() / full.double().norm()).item())
        return float(np.mean(cos)), float(np.mean(rel))


def continuation_logits(model, prefix: Prefix, tokens: torch.Tensor,
                        masks: List[np.ndarray] | None) -> torch.Tensor:
    """Log-probs [B, T, V] of teacher-forcing `tokens` [T] over the prefix cache, one batch row
    per mask set (None: the full cache, batch 1)."""
    import laprox.hf as lhf
    batch = 1 if masks is None else len(masks)
    ids = tokens.unsqueeze(0).expand(batch, -1)
    pos = torch.arange(prefix.n, prefix.n + tokens.shape[0]).unsqueeze(0).expand(batch, -1)
    cache = prefix.cache(batch)
    with torch.no_grad():
        if masks is None:
            out = model(ids, past_key_values=cache, position_ids=pos, use_cache=True)
        else:
            stacked = np.stack(masks, axis=1)                            # [L, B, Hkv, n]
            with lhf.masked(model, [torch.from_numpy(m) for m in stacked]):
                out = model(ids, past_key_values=cache, position_ids=pos, use_cache=True)
    return torch.log_softmax(out.logits.float(), dim=-1)


# --------------------------------------------------------------------------------------------
# Main loop
# --------------------------------------------------------------------------------------------

def all_masks(client, model_id, prefix: Prefix, methods: List[str],
              bar=None) -> Dict[Tuple[str, int], Any]:
    options = dict(LAPROX_METHODS)
    out = {}
    for name in methods:
        for b in BUDGETS:
            if name in options:
                out[(name, b)] = laprox_masks(client, model_id, prefix, options[name], b)
            else:
                out[(name, b)] = kvpress_masks(name, prefix, b)
            if bar is not None:
                bar.update(1)
    return out


def unique_masks(masks: Dict[Tuple[str, int], np.ndarray]) -> Dict[str, List[Tuple[str, int]]]:
    """Configurations grouped by identical keep masks (digest -> [(method, budget)])."""
    import hashlib
    groups: Dict[str, List[Tuple[str, int]]] = {}
    for key, m in masks.items():
        groups.setdefault(hashlib.sha1(np.packbits(m).tobytes()).hexdigest(), []).append(key)
    return groups


def batched(items: List[Any], size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def main() -> int:
    global CONT, BUDGETS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--batch", type=int, default=8, help="mask sets per teacher-forced forward")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, help="override the mode's number of documents")
    ap.add_argument("--lengths", help="override the context lengths, e.g. 2048,3072")
    ap.add_argument("--needle-docs", type=int, help="override the needle haystacks (0: none)")
    ap.add_argument("--needle-len", type=int, help="override the needle context length")
    ap.add_argument("--needle-sources", help="comma-separated document labels to use as needle "
                    "haystacks (default: the documents after those measured)")
    ap.add_argument("--cont", type=int, help="override the continuation tokens")
    ap.add_argument("--methods", help="comma-separated substrings selecting methods (debug)")
    ap.add_argument("--budgets", help="comma-separated budgets (debug)")
    ap.add_argument("--investigate", action="store_true",
                    help="add the LaProx variants of INVESTIGATE_METHODS (window, sinks, pool)")
    args = ap.parse_args()
    mode_name = "quick" if args.quick else "full"
    mode = dict(MODES[mode_name])
    if args.docs is not None:
        mode["docs"] = args.docs
    if args.lengths:
        mode["lengths"] = [int(x) for x in args.lengths.split(",")]
    if args.needle_docs is not None:
        mode["needle_docs"] = args.needle_docs
    if args.needle_len:
        mode["needle_len"] = args.needle_len
    CONT = args.cont or mode["cont"]
    if args.budgets:
        BUDGETS = [int(x) for x in args.budgets.split(",")]
    custom = any(v is not None for v in (args.docs, args.lengths, args.needle_docs,
                                         args.needle_sources,
                                         args.needle_len, args.methods, args.budgets,
                                         args.cont, args.investigate or None))
    if custom:
        mode_name += "-custom"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = time.time()
    load_at_start = os.getloadavg()[0]

    import laprox
    import laprox.hf as lhf
    from tqdm import tqdm

    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok, model = load_model(args.gguf)
    client = laprox.Client(args.target, timeout=600)
    info = client.info()
    model_id = lhf.register_model(client, model, name="SmolLM2-135M-Instruct",
                                  prepare_cross_grams=True)
    geometry = lhf.geometry(model)
    if args.investigate:
        LAPROX_METHODS.extend(INVESTIGATE_METHODS)
    methods = [m for m, _ in LAPROX_METHODS] + KVPRESS_METHODS
    if args.methods:
        wanted = [w.strip().lower() for w in args.methods.split(",")]
        methods = [m for m in methods if any(w in m.lower() for w in wanted)]
    log(f"== {mode_name}: geometry {geometry}, laproxd {info.version} ({info.backend}), "
        f"{len(methods)} methods x {len(BUDGETS)} budgets")

    # Documents
    docs = []
    for label, source in DOCUMENTS:
        if len(docs) == mode["docs"]:
            break
        text = read_document(source)
        length = mode["lengths"][len(docs) % len(mode["lengths"])]
        ids = tok(text, return_tensors="pt").input_ids[0]
        if ids.shape[0] < length + CONT:
            log(f"   skip {label}: {ids.shape[0]} tokens < {length + CONT}")
            continue
        docs.append((label, source, ids[:length + CONT], length))
    if len(docs) < mode["docs"]:
        log(f"only {len(docs)} documents found (wanted {mode['docs']})")
    # Needle samples: haystacks from the documents after those used above
    needles = []
    rng = random.Random(1234)
    hay_sources = [d for d in DOCUMENTS if d[0] not in {x[0] for x in docs}] or DOCUMENTS
    if args.needle_sources:
        wanted = args.needle_sources.split(",")
        hay_sources = [d for d in DOCUMENTS if d[0] in wanted]
    for label, source in hay_sources:
        if len({x[0] for x in needles}) == mode["needle_docs"]:
            break
        words = read_document(source)
        hay = tok(words, return_tensors="pt").input_ids[0]
        if hay.shape[0] < mode["needle_len"]:
            continue
        for depth in mode["depths"]:
            key = str(rng.randint(10000, 99999))
            needles.append((label, depth, key, *needle_prompt(tok, hay, mode["needle_len"],
                                                              depth, key)))

    # progress units: a prefill, then per (method, budget) a keep-plan and a teacher-forced run
    total = (len(docs) + len(needles)) * (1 + 2 * len(methods) * len(BUDGETS))
    bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True, mininterval=2)
    res: Dict[str, Any] = {"fidelity_cos": {}, "fidelity_rel_l2": {}, "kl": {}, "top1": {},
                           "needle": {}, "needle_full": []}
    for key in ("fidelity_cos", "fidelity_rel_l2", "kl", "top1", "needle"):
        res[key] = {m: {b: [] for b in BUDGETS} for m in methods}
    timings = {"prefill": 0.0, "plans": 0.0, "fidelity": 0.0, "continuation": 0.0,
               "needles": 0.0}

    os.makedirs(args.out, exist_ok=True)
    import report
    suffix = report.suffix_for(mode_name)
    done = {"docs": 0, "needles": 0}

    def save(final: bool) -> None:
        """results.json, RESULTS.md and the plots of what is done so far (also after every
        document, so an interrupted run still leaves its tables)."""
        meta = {
            "mode": mode_name,
            "complete": final,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, "
                       f"torch threads {args.threads}, load average at start "
                       f"{load_at_start:.1f}",
            "versions": versions(info),
            "documents": [(label, source, n) for label, source, _, n in docs[:done["docs"]]],
            "needles": [(label, depth, int(p.shape[0]))
                        for label, depth, _, p, _ in needles[:done["needles"]]],
            "elapsed_s": time.time() - t_start,
            "timings_s": timings,
            "geometry": str(geometry),
            "cont": CONT,
        }
        with open(os.path.join(args.out, f"results{suffix}.json"), "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)
        report.write(res, meta, methods, BUDGETS, args.out, suffix)

    for label, source, ids, n in docs:
        bar.set_description(f"{label} n={n}")
        t0 = time.time()
        prefix = Prefix(model, ids[:n].unsqueeze(0))
        cont = ids[n:n + CONT]
        full = continuation_logits(model, prefix, cont, None)[0]        # [T, V]
        timings["prefill"] += time.time() - t0
        bar.update(1)
        t0 = time.time()
        masks = all_masks(client, model_id, prefix, methods, bar)
        timings["plans"] += time.time() - t0
        t0 = time.time()
        fid = Fidelity(model, prefix)
        for (m, b), mk in masks.items():
            c, r = fid(mk)
            res["fidelity_cos"][m][b].append(c)
            res["fidelity_rel_l2"][m][b].append(r)
        timings["fidelity"] += time.time() - t0
        t0 = time.time()
        groups = unique_masks(masks)        # identical plans (e.g. window-only) run once
        for chunk in batched(list(groups), args.batch):
            lp = continuation_logits(model, prefix, cont, [masks[groups[h][0]] for h in chunk])
            for i, h in enumerate(chunk):
                kl = (full.exp() * (full - lp[i])).sum(-1).mean().item()
                top1 = (lp[i].argmax(-1) == full.argmax(-1)).float().mean().item()
                for m, b in groups[h]:
                    res["kl"][m][b].append(kl)
                    res["top1"][m][b].append(top1)
                bar.update(len(groups[h]))
        timings["continuation"] += time.time() - t0
        del prefix, fid, masks
        done["docs"] += 1
        save(final=False)

    t_needles = time.time()
    for label, depth, key, prompt, tail in needles:
        bar.set_description(f"needle {label} depth {depth}")
        prefix = Prefix(model, prompt.unsqueeze(0))
        full = continuation_logits(model, prefix, tail, None)[0]
        answer = tail[1:]
        ok_full = bool((full[:-1].argmax(-1) == answer).all())
        res["needle_full"].append(ok_full)
        bar.update(1)
        t0 = time.time()
        masks = all_masks(client, model_id, prefix, methods, bar)
        timings["plans"] += time.time() - t0
        groups = unique_masks(masks)
        for chunk in batched(list(groups), args.batch * 2):
            lp = continuation_logits(model, prefix, tail, [masks[groups[h][0]] for h in chunk])
            for i, h in enumerate(chunk):
                ok = bool((lp[i][:-1].argmax(-1) == answer).all())
                for m, b in groups[h]:
                    res["needle"][m][b].append(ok)
                bar.update(len(groups[h]))
        del prefix, masks
        done["needles"] += 1
        timings["needles"] = time.time() - t_needles
        if done["needles"] % len(mode["depths"]) == 0:
            save(final=False)
    bar.close()

    save(final=True)
    elapsed = time.time() - t_start
    log(f"== done in {elapsed / 60:.1f} min: {os.path.join(args.out, f'RESULTS{suffix}.md')}")
    client.close()
    return 0


def needle_prompt(tok, hay: torch.Tensor, length: int, depth: float,
                  key: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(prefix ids, tail ids): the haystack cut to about `length` tokens with the passkey
    sentence at `depth`, then the question. The prefix ends before the question's last token;
    the tail is that token followed by the answer's tokens (the compressed cache sees the tail).
    """
    needle = tok(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
                 add_special_tokens=False).input_ids
    question = tok("\n\nWhat is the pass key? The pass key is", add_special_tokens=False).input_ids
    answer = tok(f" {key}", add_special_tokens=False).input_ids
    body = length - len(needle) - len(question)
    cut = int(body * depth)
    ids = hay[:cut].tolist() + needle + hay[cut:body].tolist() + question
    prompt = torch.tensor(ids[:-1])
    tail = torch.tensor([ids[-1]] + answer)
    return prompt, tail


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def versions(info) -> str:
    from importlib.metadata import version
    parts = [f"laproxd {info.version} ({info.backend})"]
    for pkg in ("torch", "transformers", "kvpress", "gguf", "numpy"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except Exception:
            pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
