#!/usr/bin/env python3
"""Quality of laprox keep-plans on a real model (SmolLM2-135M-Instruct) on the CPU.

Run through bench/quality/run.sh (venv, model, laproxd). Directly:

    evaluate.py --target unix:/tmp/sock --gguf PATH.gguf [--quick | --grid]

Two parts, both paired (every method sees the same prompts and the same prefill):
  - retrieval (tasks.py): single needle, multi-key with distractors, multi-value, multi-query,
    variable tracking, at n = 2K and 4K. The context ends with the question; it is prefilled
    once and compressed; the question's last token and the gold answer are then teacher-forced
    over the compressed cache (laprox.hf.masked): exact match (greedy) and the gold answer's
    log-probability;
  - language modelling on held-out text spans (tasks.make_documents): KL(full || compressed)
    and top-1 agreement over the continuation; per-layer output fidelity with the
    continuation's own queries (out of sample); and the eviction objective on the scoring
    window's queries (the paper's unrenormalised ||sum of dropped X|| and the renormalised
    output error).
`--grid` runs the dev grid of methods.grid_methods at one budget on prompts drawn with another
seed (GRID.md, grid.json); the default is chosen there, the full run reports it.

Models with sliding-window layers (Gemma 3, `--gguf` of its GGUF, `--model-name`): plans and
keep masks cover the full-attention layers only (laprox.hf.planned_layers), the sliding layers
attend over their window exactly as the model does (Prefix, teacher_forced), and the layer
metrics average over the planned layers.

Every laproxd method with an engine-compatible shape also runs as its BLOCKS_SHARED twin at
block size 16 (methods.BLOCKS, "… ·blocks16"); report.py sets each beside its RAGGED row. The
block table alone, on a subset of the full run (its first prompts and documents, the same
seeded ones), without the methods that have no twin:

    bench/quality/run.sh --blocks-only --prompts=64 --documents=12 --budgets=64,128,256,512 \
        --tag=blocks          # writes BLOCKS.md and blocks.json

The layer-share cap (policy max_layer_share) at LAYER_UNIFORM against the default RAGGED plan,
with the max / mean of the per-layer kept counts of every plan (methods.LAYERCAP):

    bench/quality/run.sh --layer-cap --prompts=48 --documents=8 --budgets=128,256,512 \
        --tag=layercap        # writes LAYERCAP.md and layercap.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

# With 2 threads on 2 busy cores, OpenMP's default spin-waiting makes every parallel region
# wait for a descheduled thread; passive waiting avoids it. Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import methods as M  # noqa: E402
import tasks as T    # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration", "vllm"))
from convert import gemma3_tokenizer  # noqa: E402  (also the vLLM tests' Gemma 3)

WQ = 32        # window query rows given to laproxd: the largest window of the run's methods
OBJ_ROWS = 32  # scoring-window rows of the objective check (w = 32: kept by every method)
HS_ROWS = 128  # last attention-input rows kept for kvpress (it reads the last 64)

MODES = {
    # test prompts per task (spread over the lengths), LM documents, continuation tokens
    "full": dict(plan={"single_needle": 20, "multi_key": 48, "multi_value": 16,
                       "multi_query": 20, "variable_tracking": 16},
                 lengths=[2048] * 5 + [4096], docs=24, doc_lengths=[2048], cont=32,
                 budgets=[64, 96, 128, 256, 512, 1024], seed=2026),
    "quick": dict(plan={"single_needle": 1, "multi_key": 2, "multi_value": 1, "multi_query": 1,
                        "variable_tracking": 1},
                  lengths=[2048, 4096], docs=2, doc_lengths=[2048], cont=32,
                  budgets=[64, 128, 1024], seed=2026),
    # the dev grid: another seed, fewer prompts, one budget
    "grid": dict(plan={"single_needle": 1, "multi_key": 12, "multi_value": 1, "multi_query": 1,
                       "variable_tracking": 1},
                 lengths=[2048], docs=2, doc_lengths=[2048], cont=32, budgets=[128], seed=7),
}


def add_harness_args(ap: argparse.ArgumentParser) -> None:
    """The options of the scripts that run the harness with a laproxd of their own
    (diagnose.py, prototype.py, joint.py): laproxd binary or target, model, threads, batch."""
    ap.add_argument("--laproxd", default=os.path.join(HERE, "..", "..", "build", "service",
                                                      "laproxd"))
    ap.add_argument("--target", default=None, help="a running laproxd (else --laproxd starts)")
    ap.add_argument("--gguf", default=os.path.join(HERE, "..", "..", "build", "quality-model",
                                                   "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="mask sets per teacher-forced forward")


def connect(args, name: str, **register: Any):
    """This checkout's laprox client (tests/python/support.py), the model of args.gguf on
    args.threads torch threads, a client of args.target and the model registered under `name`:
    (tok, model, client, model_id, laprox.hf)."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
    import support
    support.prepare_package()
    import laprox
    import laprox.hf as lhf
    torch.set_num_threads(args.threads)
    tok, model = load_model(args.gguf)
    client = laprox.Client(args.target, timeout=600)
    return tok, model, client, lhf.register_model(client, model, name=name, **register), lhf


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def gguf_architecture(gguf: str) -> str:
    """general.architecture of a GGUF file ("llama", "gemma3", ...)."""
    from gguf import GGUFReader
    field = GGUFReader(gguf).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def load_model(gguf: str):
    """The GGUF through transformers (dequantized to fp32), converted once and cached beside
    the GGUF (hf/, safetensors). Llama (SmolLM2) and Gemma 3 GGUFs; Gemma 3's tokenizer is
    repaired on the way (gemma3_tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(gguf))
    converted = os.path.join(folder, "hf")
    stamp = os.path.join(converted, "source.json")
    source = {"gguf": name, "size": os.path.getsize(gguf)}
    architecture = gguf_architecture(gguf)
    if architecture == "gemma3":
        source["tokenizer"] = "bpe from the GGUF's scores"
    try:
        with open(stamp) as f:
            cached = json.load(f) == source
    except (OSError, ValueError):
        cached = False
    if not cached:
        log(f"== converting {name} (dequantized to fp32; cached in {converted})")
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if architecture == "gemma3":
            tok = gemma3_tokenizer(tok, gguf)  # tests/integration/vllm/convert.py
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model.save_pretrained(converted)
        tok.save_pretrained(converted)
        with open(stamp, "w") as f:
            json.dump(source, f)
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    return tok, model


# --------------------------------------------------------------------------------------------
# Prefill once
# --------------------------------------------------------------------------------------------

class Prefix:
    """One prefill of `ids` [N] whose first n tokens are the compressed prefix: the prefix's
    keys and values, the window queries [n - WQ, n), the queries of the positions after n
    (`extra_queries`, for out-of-sample fidelity), the keys and values after n, and the
    attention inputs of [n - HS_ROWS, n) that kvpress's presses read.

    Per model layer l (lists of length L = every attention module): `keys[l]`, `values[l]`
    [1, Hkv, n_l, d] hold the prefix positions [key_start[l], n) — the whole prefix (start 0)
    for a full-attention layer; for a sliding-window layer (`windows[l]` = W, Gemma 3) the last
    W - 1 positions, all that a token fed at n or later can see (the model's sliding mask lets
    position q see the keys k with q - W < k <= q). They are taken from the prefill's own
    attention inputs, not from the sliding cache, which ends at N rather than n. Queries are
    kept for every layer. `planned` = laprox.hf.planned_layers(model), the full-attention
    layers; `np_keys`, `np_values`, `np_queries` (what laproxd plans with) are those layers
    only, in order, and keep masks are [len(planned), Hkv, n]."""

    def __init__(self, model, ids: torch.Tensor, n: int):
        import laprox.hf as lhf
        from transformers import DynamicCache
        self.n = n
        extra = ids.shape[0] - n
        modules = lhf.attention_modules(model)
        L = len(modules)
        self.planned = lhf.planned_layers(model)
        self.windows = [getattr(m, "sliding_window", None) for m in modules]
        check_attention(modules, self.planned)
        hs, pe = {}, {}

        def pre_hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            hs[module.layer_idx] = h[:, n - HS_ROWS:n].detach().clone()
            cos, sin = kwargs["position_embeddings"]
            pe[module.layer_idx] = (cos[:, n - HS_ROWS:n].clone(), sin[:, n - HS_ROWS:n].clone())

        handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
        cache = DynamicCache(config=model.config)
        # A sliding layer's cache keeps only its last W - 1 entries of the whole sequence; its
        # update() returns the states of every position, which the attention reads: keep those.
        states: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for l, w in enumerate(self.windows):
            if w is not None:
                layer = cache.layers[l]

                def update(k, v, cache_kwargs=None, _update=layer.update, _l=l):
                    k, v = _update(k, v, cache_kwargs)
                    states[_l] = (k, v)
                    return k, v
                layer.update = update
        try:
            with torch.no_grad(), lhf.capture_window_queries(model, WQ + extra) as queries:
                # logits of the last `extra` positions only (0 would mean all of them)
                out = model(ids.unsqueeze(0), past_key_values=cache, use_cache=True,
                            logits_to_keep=max(extra, 1))
        finally:
            for h in handles:
                h.remove()
        # log-probs of tokens n+1 .. N-1 given everything before (the continuation's targets)
        self.full_cont = torch.log_softmax(out.logits[0, :-1].float(), -1) if extra else None
        kv = [states[l] if w is not None else lhf.cache_layer_kv(cache, l)
              for l, w in enumerate(self.windows)]
        if any(k.shape[2] != ids.shape[0] for k, _ in kv):
            raise AssertionError(f"prefill states of {[k.shape[2] for k, _ in kv]} positions, "
                                 f"expected {ids.shape[0]} in every layer")
        self.key_start = [0 if w is None else max(0, n - (w - 1)) for w in self.windows]
        self.keys = [k[:, :, s:n].contiguous() for (k, _), s in zip(kv, self.key_start)]
        self.values = [v[:, :, s:n].contiguous() for (_, v), s in zip(kv, self.key_start)]
        self.extra_keys = [k[0, :, n:].contiguous() for k, _ in kv]
        self.extra_values = [v[0, :, n:].contiguous() for _, v in kv]
        self.queries = [queries[l][:, :, :WQ].contiguous() for l in range(L)]  # [1, H, WQ, d]
        self.extra_queries = [queries[l][0, :, WQ:] for l in range(L)]       # [H, extra, d]
        self.hidden, self.pos_emb, self.modules = hs, pe, modules
        self.np_keys = [self.keys[l][0].numpy() for l in self.planned]
        self.np_values = [self.values[l][0].numpy() for l in self.planned]
        self.np_queries = [self.queries[l][0].numpy() for l in self.planned]


def check_attention(modules, planned: List[int]) -> None:
    """What the shared-prefix attention models: scaled dot products (module.scaling), GQA, a
    causal mask, optionally a sliding window (module.sliding_window); no logit soft-capping
    (Gemma 2). The planned layers must be exactly those without a sliding window."""
    for module in modules:
        if getattr(module, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError(f"layer {module.layer_idx}: attention logit soft-capping "
                                      f"({module.attn_logit_softcapping}) is not modelled")
    full = [l for l, m in enumerate(modules) if getattr(m, "sliding_window", None) is None]
    if full != list(planned):
        raise AssertionError(f"planned layers {planned} are not the layers without a sliding "
                             f"window {full}")


SHARED_PREFIX = "laprox_eval_shared_prefix"


def _shared_prefix_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of the fed tokens (query, key, value: [B, H or Hkv, T, d], no cache) over the
    prefix, shared by every batch row ([1, Hkv, n_l, d], each row's evicted keys at -inf), and
    causally over the fed tokens themselves: no row holds a copy of the prefix. A sliding-window
    layer (window W) replicates the model's mask (transformers' sliding_window_overlay: position
    q sees the keys k with q - W < k <= q): its prefix keys start at position `start`, the fed
    tokens are at positions n, n + 1, ..."""
    keys, values, bias, window, start = module._eval_prefix
    b, heads, t, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, heads // hkv * t, d)           # query head h = kv * G + j
    scale = module.scaling if scaling is None else scaling
    on_prefix = (q @ keys.transpose(-1, -2)) * scale          # [B, Hkv, G*T, n]
    if bias is not None:
        on_prefix = on_prefix + bias                          # [B, Hkv, 1, n]
    on_fed = (q @ key.transpose(-1, -2)) * scale              # [B, Hkv, G*T, T]
    rows = (torch.arange(q.shape[2]) % t).unsqueeze(1)
    on_fed.masked_fill_(torch.arange(t).unsqueeze(0) > rows, float("-inf"))
    n = keys.shape[2]
    if window is not None:
        # distances in positions: fed row t is at n_prefix + t, prefix key j at start + j
        end = start + n                                       # the prefix length n_prefix
        far = (end + rows) - (start + torch.arange(n).unsqueeze(0)) >= window
        on_prefix = on_prefix.masked_fill(far, float("-inf"))
        on_fed.masked_fill_(rows - torch.arange(t).unsqueeze(0) >= window, float("-inf"))
    p = torch.softmax(torch.cat([on_prefix, on_fed], -1), -1)
    out = p[..., :n] @ values + p[..., n:] @ value            # [B, Hkv, G*T, d]
    return out.reshape(b, heads, t, d).transpose(1, 2).contiguous(), None


def teacher_forced(model, prefix: Prefix, tokens: torch.Tensor,
                   masks: List[Optional[np.ndarray]]) -> torch.Tensor:
    """Log-probs [B, T, V] of feeding `tokens` [T] at positions n, n+1, ... after the prefix, one
    batch row per mask set [L_planned, Hkv, n] (None: keep everything); mask i applies to model
    layer prefix.planned[i]. Sliding-window layers are never masked: they see their window."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(SHARED_PREFIX, _shared_prefix_attention)
    AttentionMaskInterface.register(SHARED_PREFIX, sdpa_mask)   # built, then not read
    batch, L = len(masks), len(prefix.planned)
    shapes = {m.shape for m in masks if m is not None}
    n_kv = prefix.keys[0].shape[1]
    if shapes - {(L, n_kv, prefix.n)}:
        raise ValueError(f"mask sets of shapes {shapes}, expected {(L, n_kv, prefix.n)}")
    keep = np.stack([np.ones((L, n_kv, prefix.n), bool) if m is None else m for m in masks], 1)
    biases: List[Optional[torch.Tensor]] = [None] * len(prefix.modules)
    for i, l in enumerate(prefix.planned):
        if not keep[i].all():
            bias = torch.zeros(keep[i].shape, dtype=torch.float32)
            bias.masked_fill_(torch.from_numpy(~keep[i]), float("-inf"))
            biases[l] = bias.unsqueeze(2)                          # [B, Hkv, 1, n]
    for l, module in enumerate(prefix.modules):
        module._eval_prefix = (prefix.keys[l], prefix.values[l], biases[l], prefix.windows[l],
                               prefix.key_start[l])
    ids = tokens.unsqueeze(0).expand(batch, -1)
    pos = torch.arange(prefix.n, prefix.n + tokens.shape[0]).unsqueeze(0).expand(batch, -1)
    previous = model.config._attn_implementation
    model.set_attn_implementation(SHARED_PREFIX)
    try:
        with torch.no_grad():
            out = model(ids, position_ids=pos, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for module in prefix.modules:
            module.__dict__.pop("_eval_prefix", None)
    return torch.log_softmax(out.logits.float(), dim=-1)


def check_full_row(prefix: Prefix, lp: torch.Tensor, what: str) -> None:
    """The keep-everything row of a teacher-forced batch must give the prefill's own log-probs
    (a check of the shared-prefix attention on every item)."""
    gap = float((lp - prefix.full_cont).abs().max())
    if not gap < 1e-3:
        raise AssertionError(f"{what}: the full-cache row differs from the prefill by {gap:.2e}")


# --------------------------------------------------------------------------------------------
# Keep masks
# --------------------------------------------------------------------------------------------

def kvpress_masks(name: str, prefix: Prefix, budgets: List[int]) -> Dict[int, np.ndarray]:
    """kvpress's own press: its `score` on the inputs its forward hook would see (the scores do
    not depend on the compression ratio), then, per budget, the selection of its `compress`
    (top n_kept = compute_n_kept(n, ratio) = budget scores per KV head), on the planned layers
    (prefix.planned: its masks are [L_planned, Hkv, n] like laproxd's; kvpress's
    get_prerope_query_states applies Gemma 3's q_norm; its 1/sqrt(head_dim) must be the
    model's scaling, as it is for Gemma 3)."""
    from kvpress import SnapKVPress
    from kvpress.presses.scorer_press import compute_n_kept
    press = {"SnapKV": SnapKVPress}[name]()
    L, hkv = len(prefix.planned), prefix.keys[0].shape[1]
    masks = {b: np.zeros((L, hkv, prefix.n), dtype=bool) for b in budgets}
    with torch.no_grad():
        for i, l in enumerate(prefix.planned):
            module = prefix.modules[l]
            if not math.isclose(float(module.scaling), module.head_dim ** -0.5, rel_tol=1e-6):
                raise NotImplementedError(f"layer {l}: kvpress scores with 1/sqrt(head_dim), "
                                          f"the model scales by {module.scaling}")
            kwargs = {"position_embeddings": prefix.pos_emb[l], "hidden_states": prefix.hidden[l]}
            scores = press.score(module, prefix.hidden[l], prefix.keys[l], prefix.values[l], None,
                                 kwargs)[0]                                  # [Hkv, n]
            for b in budgets:
                kept = compute_n_kept(prefix.n, 1.0 - (b + 0.5) / prefix.n)   # = b
                assert kept == b, (kept, b)
                index = scores.topk(kept, dim=-1).indices.numpy()
                masks[b][i][np.arange(hkv)[:, None], index] = True
    return masks


def keep_masks(client, model_id: int, prefix: Prefix, methods: List[M.Method],
               budgets: List[int]) -> Dict[Tuple[str, int], np.ndarray]:
    out = {}
    for name, options in methods:
        policy = {k: v for k, v in options.items() if k != "budgets"}
        runs = [b for b in budgets if b in options.get("budgets", budgets)]  # some run at fewer
        if "kvpress" in policy:
            for b, m in kvpress_masks(policy["kvpress"], prefix, runs).items():
                out[(name, b)] = m
            continue
        for b in runs:
            plan = client.compute_keep_plan(model_id, prefix.np_keys, prefix.np_values,
                                            window_queries=prefix.np_queries, budget=b,
                                            policy=policy)
            masks = plan.to_masks()
            if M.is_block_shaped(policy):
                check_block_masks(masks, plan, b, policy["block_size"], name)
            out[(name, b)] = masks
    return out


def check_block_masks(masks: np.ndarray, plan, budget: int, block_size: int, what: str) -> None:
    """A BLOCKS_SHARED plan's masks [L, Hkv, n], applied exactly like a ragged plan's, must keep
    the same positions in every (layer, KV head), and those positions must be the union of the
    whole blocks [b * bs, min((b + 1) * bs, n)) the plan names: floor(B / bs) of them when
    B < n (the forced blocks, at most 4 here: a sink block and 3 that the window can straddle,
    fit in every budget >= 64)."""
    n = masks.shape[-1]
    blocks = plan.blocks
    if blocks is None or blocks.units != 1 or blocks.block_size != block_size:
        raise AssertionError(f"{what}, B={budget}: not a BLOCKS_SHARED plan of block size "
                             f"{block_size}: {blocks}")
    shared = masks[0, 0]
    if not (masks == shared).all():
        raise AssertionError(f"{what}, B={budget}: the (layer, KV head) keep-sets differ")
    expected = np.zeros(n, dtype=bool)
    for b in blocks.kept(0):
        expected[b * block_size:min((b + 1) * block_size, n)] = True
    if not (shared == expected).all():
        raise AssertionError(f"{what}, B={budget}: the kept positions are not the union of the "
                             f"kept blocks {blocks.kept(0).tolist()}")
    nb = -(-n // block_size)
    want = nb if budget >= n else min(budget // block_size, nb)
    if (budget >= n or budget // block_size >= 4) and len(blocks.kept(0)) != want:
        raise AssertionError(f"{what}, B={budget}: {len(blocks.kept(0))} blocks kept, expected "
                             f"{want} (floor(B / {block_size}) of {nb})")


def unique(masks: Dict[Any, np.ndarray]) -> Dict[str, List[Any]]:
    """Configurations grouped by identical masks (digest -> keys): each group runs once."""
    groups: Dict[str, List[Any]] = {}
    for key, m in masks.items():
        groups.setdefault(hashlib.sha1(np.packbits(m).tobytes()).hexdigest(), []).append(key)
    return groups


def batched(items: List[Any], size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


# --------------------------------------------------------------------------------------------
# Layer-local metrics
# --------------------------------------------------------------------------------------------

class LayerOutputs:
    """Per layer, the attention output sum_h A^h V W_O^h of a set of query rows, with every key
    and with a keep mask: E = exp(logits - row max) is computed once; a mask then only zeroes
    columns of the prefix. Rows past the prefix (the continuation) also see the continuation's
    own keys, which are never evicted. Only the planned layers (prefix.planned, full attention:
    the layers a mask [L_planned, Hkv, n] applies to; `queries` is indexed by model layer):
    sliding-window layers are never masked, so their error would be 0 by construction."""

    def __init__(self, prefix: Prefix, queries: List[torch.Tensor], first_row: int):
        self.layers = []
        n = prefix.n
        for l in prefix.planned:
            module = prefix.modules[l]
            q = queries[l].float()                                       # [H, R, d]
            k, v = prefix.keys[l][0].float(), prefix.values[l][0].float()
            if first_row >= n:
                k = torch.cat([k, prefix.extra_keys[l].float()], 1)
                v = torch.cat([v, prefix.extra_values[l].float()], 1)
            hkv, total, d = k.shape
            R = q.shape[1]
            g = q.shape[0] // hkv
            q = q.reshape(hkv, g * R, d)
            logits = (q @ k.transpose(1, 2)) * float(module.scaling)     # [Hkv, G*R, total]
            rows = (torch.arange(R) + first_row).repeat(g).unsqueeze(1)
            logits.masked_fill_(torch.arange(total).unsqueeze(0) > rows, float("-inf"))
            e = torch.exp(logits - logits.amax(-1, keepdim=True))
            w_o = module.o_proj.weight.detach().float()                  # [D, H*d]
            self.layers.append((e, v, w_o, g, R, e.sum(-1, keepdim=True)))
        self.full_num = [e @ v for e, v, _, _, _, _ in self.layers]
        self.full = [self._project(num / s, w_o, R) for num, (_, _, w_o, _, R, s)
                     in zip(self.full_num, self.layers)]
        self.n = n

    @staticmethod
    def _project(heads, w_o, R):
        """[..., Hkv, G*R, d] head outputs -> [..., R, D] layer outputs."""
        lead = heads.shape[:-3]
        heads = heads.reshape(*lead, -1, R, heads.shape[-1])             # [..., H, R, d]
        return heads.transpose(-3, -2).reshape(*lead, R, -1) @ w_o.T      # [..., R, D]

    def metrics(self, masks: List[np.ndarray], chunk: int = 16) -> Dict[str, np.ndarray]:
        """Per mask set [L, Hkv, n], means over layers of: `cos`, `rel` (the output over the
        kept keys, softmax renormalised over them as attention does after eviction: cosine and
        relative L2 error against the full output) and `dropped` (the paper's objective,
        ||sum over the evicted entries of X|| / ||Y||, X with the full softmax)."""
        out = {k: np.zeros(len(masks)) for k in ("cos", "rel", "dropped")}
        for c0 in range(0, len(masks), chunk):
            stack = torch.from_numpy(np.stack(masks[c0:c0 + chunk])).float()  # [C, L, Hkv, n]
            for l, (e, v, w_o, g, R, s) in enumerate(self.layers):
                keep = torch.ones(stack.shape[0], e.shape[0], 1, e.shape[-1])
                keep[:, :, 0, :self.n] = stack[:, l]
                ek = e * keep                                            # [C, Hkv, G*R, total]
                full = self.full[l].double()
                kept_num = ek @ v                       # the dropped part is (E - E.keep) V
                kept = self._project(kept_num / ek.sum(-1, keepdim=True).clamp_min(1e-30),
                                     w_o, R)
                dropped = self._project((self.full_num[l] - kept_num) / s, w_o, R).double()
                sl = slice(c0, c0 + stack.shape[0])
                out["cos"][sl] += torch.nn.functional.cosine_similarity(
                    kept.double(), full, -1).mean(-1).numpy()
                out["rel"][sl] += ((kept.double() - full).flatten(1).norm(dim=1)
                                   / full.norm()).numpy()
                out["dropped"][sl] += (dropped.flatten(1).norm(dim=1) / full.norm()).numpy()
        return {k: v / len(self.layers) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Context:
    model: Any
    client: Any
    model_id: int
    methods: List[M.Method]       # the retrieval part's
    doc_methods: List[M.Method]   # the language-model part's
    budgets: List[int]
    batch: int
    timings: Dict[str, float]
    bar: Any


def _timed(ctx: Context, key: str, t0: float) -> None:
    ctx.timings[key] = ctx.timings.get(key, 0.0) + time.time() - t0


def forward_all(ctx: Context, prefix: Prefix, feed: torch.Tensor,
                masks: Dict[Tuple[str, int], np.ndarray]) -> Dict[Tuple[str, int], torch.Tensor]:
    """Log-probs [T, V] of the continuation under every configuration's masks: each distinct
    mask set runs once, ctx.batch per forward; the first batch also runs the full cache, which
    must reproduce the prefill (check_full_row)."""
    groups = unique(masks)
    sets: List[Any] = [None] + list(groups)
    out: Dict[Tuple[str, int], torch.Tensor] = {}
    for chunk in batched(sets, ctx.batch):
        lp = teacher_forced(ctx.model, prefix, feed,
                            [None if h is None else masks[groups[h][0]] for h in chunk])
        for i, h in enumerate(chunk):
            if h is None:
                check_full_row(prefix, lp[i], "teacher-forced forward")
                continue
            for key in groups[h]:
                out[key] = lp[i]
    return out


def span_stats(mask: np.ndarray, spans: List[Tuple[int, int]], window: int
               ) -> Tuple[float, float, float]:
    """Of one mask set [L, Hkv, n]: the gold facts' tokens kept (mean over (layer, KV head) of
    the fraction kept), the share of (layer, KV head) that keep every gold token, and the mean
    length of the kept runs before the window (kept tokens / runs, over the whole model)."""
    gold = np.concatenate([np.arange(a, b) for a, b in spans])
    kept_gold = mask[..., gold]
    body = mask[..., :mask.shape[-1] - window]
    runs = int(body[..., 0].sum() + (body[..., 1:] & ~body[..., :-1]).sum())
    return (float(kept_gold.mean()), float(kept_gold.all(-1).mean()),
            float(body.sum() / runs) if runs else 0.0)


def layer_share(mask: np.ndarray) -> float:
    """The longest layer's kept tokens over the mean layer's (window included) of a mask set
    [L, Hkv, n]: what a paged engine that holds blocks for the longest layer pays over the
    budget."""
    per_layer = mask.sum(axis=(1, 2))
    return float(per_layer.max() / per_layer.mean())


def kept_per_head(mask: np.ndarray) -> float:
    """Mean kept tokens per (layer, KV head) of a mask set [L, Hkv, n], window included (B for a
    ragged plan; a block plan can keep fewer)."""
    return float(mask.sum(-1).mean())


def run_prompt(ctx: Context, p: T.Prompt) -> Dict[str, Any]:
    """Exact match and gold log-prob of every (method, budget), and of the full cache."""
    t0 = time.time()
    # one prefill of the context and the tail: the tail's log-probs are the full cache's
    prefix = Prefix(ctx.model, torch.cat([p.context, p.tail]), p.context.shape[0])
    answer = p.answer
    index = torch.arange(answer.shape[0])

    def score(lp: torch.Tensor) -> Tuple[bool, float]:
        return bool((lp.argmax(-1) == answer).all()), float(lp[index, answer].sum())

    full_em, full_lp = score(prefix.full_cont)
    _timed(ctx, "prefill", t0)
    t0 = time.time()
    masks = keep_masks(ctx.client, ctx.model_id, prefix, ctx.methods, ctx.budgets)
    _timed(ctx, "plans", t0)
    t0 = time.time()
    res: Dict[str, Dict[Any, Any]] = {k: {} for k in ("em", "lp", "recall", "cover", "run",
                                                      "kept", "lshare")}
    for key, out in forward_all(ctx, prefix, p.tail[:-1], masks).items():
        res["em"][key], res["lp"][key] = score(out)
    for key, m in masks.items():
        res["recall"][key], res["cover"][key], res["run"][key] = span_stats(m, p.gold_spans,
                                                                            M.WINDOW)
        res["kept"][key] = kept_per_head(m)
        res["lshare"][key] = layer_share(m)
    _timed(ctx, "forward", t0)
    ctx.bar.update(1)
    return {"task": p.task, "source": p.source, "n": p.n, "depths": p.depths,
            "gold_spans": p.gold_spans, "answer_tokens": int(answer.shape[0]),
            "full_em": full_em, "full_lp": full_lp,
            **{k: _table(v, ctx.methods, ctx.budgets) for k, v in res.items()}}


def run_document(ctx: Context, d: T.Document) -> Dict[str, Any]:
    """KL and top-1 over the continuation; fidelity with the continuation's queries; the
    objective on the scoring window's queries."""
    t0 = time.time()
    prefix = Prefix(ctx.model, d.ids, d.n)
    full = prefix.full_cont                                              # [cont - 1, V]
    _timed(ctx, "prefill", t0)
    t0 = time.time()
    masks = keep_masks(ctx.client, ctx.model_id, prefix, ctx.doc_methods, ctx.budgets)
    _timed(ctx, "plans", t0)
    t0 = time.time()
    out_of_sample = LayerOutputs(prefix, prefix.extra_queries, d.n)
    window = LayerOutputs(prefix, [q[0, :, -OBJ_ROWS:] for q in prefix.queries], d.n - OBJ_ROWS)
    groups = unique(masks)
    sets = [masks[keys[0]] for keys in groups.values()]
    # the last set keeps everything: its errors must be 0 (a check of the metric code)
    sets.append(np.ones_like(sets[0]))
    oos, win = out_of_sample.metrics(sets), window.metrics(sets)
    for m in (oos, win):
        if not (m["rel"][-1] < 1e-5 and m["dropped"][-1] < 1e-5 and m["cos"][-1] > 1 - 1e-6):
            raise AssertionError(f"layer metrics of the full cache are not exact: {m}")
    res: Dict[str, Dict[Any, float]] = {k: {} for k in
                                        ("fid_cos", "fid_rel", "obj_dropped", "obj_renorm")}
    res["kept"] = {key: kept_per_head(m) for key, m in masks.items()}
    res["lshare"] = {key: layer_share(m) for key, m in masks.items()}
    for i, keys in enumerate(groups.values()):
        for key in keys:
            res["fid_cos"][key], res["fid_rel"][key] = oos["cos"][i], oos["rel"][i]
            res["obj_dropped"][key], res["obj_renorm"][key] = win["dropped"][i], win["rel"][i]
    _timed(ctx, "layer metrics", t0)
    t0 = time.time()
    res["kl"], res["top1"] = {}, {}
    top = full.argmax(-1)
    forwarded = {k: m for k, m in masks.items() if k[0] not in M.OBJECTIVE_ONLY}
    for key, lp in forward_all(ctx, prefix, d.ids[d.n:-1], forwarded).items():
        res["kl"][key] = float((full.exp() * (full - lp)).sum(-1).mean())
        res["top1"][key] = float((lp.argmax(-1) == top).float().mean())
    _timed(ctx, "forward", t0)
    ctx.bar.update(1)
    return {"source": d.source, "n": d.n,
            **{k: _table(v, ctx.doc_methods, ctx.budgets) for k, v in res.items()}}


def _table(values: Dict[Tuple[str, int], Any], methods: List[M.Method],
           budgets: List[int]) -> Dict[str, List[Any]]:
    """{method: [value per budget]} in budget order (None where the method did not run)."""
    return {name: [values.get((name, b)) for b in budgets] for name, _ in methods}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct",
                    help="the name registered with laproxd (a label)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of the full code path")
    ap.add_argument("--grid", action="store_true", help="the dev grid (GRID.md)")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--batch", type=int, default=8, help="mask sets per teacher-forced forward")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, help="at most this many prompts and documents (debug)")
    ap.add_argument("--exclude", help="comma-separated substrings of method names to leave out "
                    "(debug)")
    ap.add_argument("--blocks-only", action="store_true",
                    help="only the methods with a BLOCKS_SHARED twin, and their twins")
    ap.add_argument("--layer-cap", action="store_true",
                    help="only the default (RAGGED) and its LAYER_UNIFORM twins without and "
                    "with max_layer_share (methods.LAYERCAP)")
    ap.add_argument("--prompts", type=int, help="a subset of the mode's prompts: the first N of "
                    "its interleaved order (every task in proportion; the same seeded prompts)")
    ap.add_argument("--documents", type=int, help="the mode's first M documents")
    ap.add_argument("--budgets", help="comma-separated budgets instead of the mode's")
    ap.add_argument("--tag", help="write TAG.md and TAG.json (lower-case json) instead of the "
                    "mode's files")
    args = ap.parse_args()
    mode_name = "grid" if args.grid else "quick" if args.quick else "full"
    mode = dict(MODES[mode_name])
    if args.budgets:
        mode["budgets"] = sorted({int(b) for b in args.budgets.split(",") if b})
    global WQ
    WQ = 64 if args.grid else 32    # the grid has w = 64 rows
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    command = os.environ.get("LAPROX_QUALITY_COMMAND") or " ".join(
        ["bench/quality/run.sh"] + [a for a in sys.argv[1:]
                                    if not a.startswith(("--target", "--gguf"))])
    t_start, load_at_start = time.time(), os.getloadavg()[0]

    import laprox
    import laprox.hf as lhf
    import transformers
    from tqdm import tqdm
    import report
    import stats
    failures = stats.self_check()
    if failures:
        raise SystemExit(f"stats self-check failed: {failures}")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok, model = load_model(args.gguf)
    client = laprox.Client(args.target, timeout=600)
    info = client.info()
    model_id = lhf.register_model(client, model, name=args.model_name,
                                  prepare_cross_grams=True)
    methods = M.grid_methods() if args.grid else list(M.MAIN)
    doc_methods = methods if args.grid else methods + M.LM_ONLY
    if args.blocks_only:
        paired = set(M.BLOCK_PAIRS) | set(M.BLOCK_PAIRS.values())
        methods, doc_methods = ([m for m in ms if m[0] in paired] for ms in (methods, doc_methods))
    if args.layer_cap:
        methods = [m for m in methods if m[0] == M.DEFAULT] + M.LAYERCAP
        doc_methods = list(methods)
    if args.exclude:
        drop = [x for x in args.exclude.split(",") if x]
        methods, doc_methods = ([m for m in ms if m[0] == M.DEFAULT
                                 or not any(x in m[0] for x in drop)]
                                for ms in (methods, doc_methods))

    corpus = T.Corpus(tok, max(max(mode["lengths"]), max(mode["doc_lengths"]) + mode["cont"]))
    prompts = T.make_prompts(tok, corpus, mode["plan"], mode["lengths"], mode["seed"])
    docs = T.make_documents(corpus, mode["docs"], mode["doc_lengths"], mode["cont"],
                            mode["seed"])
    total_prompts, total_docs = len(prompts), len(docs)
    if args.limit:
        prompts, docs = prompts[:args.limit], docs[:args.limit]
    if args.prompts is not None and args.prompts < len(prompts):
        keep = set(interleaved(prompts)[:args.prompts])
        prompts = [p for i, p in enumerate(prompts) if i in keep]
    if args.documents is not None:
        docs = docs[:args.documents]
    subset = None
    if (len(prompts), len(docs)) != (total_prompts, total_docs) or args.budgets:
        subset = (f"a subset of the {mode_name} mode: {len(prompts)} of its {total_prompts} "
                  f"retrieval prompts (the first of each task, in proportion, unless --limit), "
                  f"{len(docs)} of its "
                  f"{total_docs} documents (the first), budgets "
                  f"{', '.join(map(str, mode['budgets']))} of "
                  f"{', '.join(map(str, MODES[mode_name]['budgets']))}")
    log(f"== {mode_name}: {len(prompts)} prompts, {len(docs)} documents, {len(methods)} methods "
        f"({len(doc_methods)} on documents) x {len(mode['budgets'])} budgets; "
        f"{len(corpus.texts)} haystack sources; laproxd "
        f"{info.version} ({info.backend})")
    bar = tqdm(total=len(prompts) + len(docs), unit="prompt", file=sys.stderr,
               dynamic_ncols=True, mininterval=5)
    ctx = Context(model, client, model_id, methods, doc_methods, mode["budgets"], args.batch, {},
                  bar)
    results: Dict[str, Any] = {"prompts": [], "documents": []}

    def save(complete: bool) -> None:
        meta = {
            "mode": mode_name, "complete": complete,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, torch "
                       f"threads {args.threads}, load average at start {load_at_start:.1f}",
            "versions": versions(info), "geometry": str(lhf.geometry(model)),
            "elapsed_s": time.time() - t_start, "timings_s": dict(ctx.timings),
            "budgets": mode["budgets"], "methods": doc_methods, "cont": mode["cont"],
            "seed": mode["seed"], "sources": [label for label, _ in corpus.texts],
            "command": command, "subset": subset, "tag": args.tag,
            "run_elapsed_s": (time.time() - float(os.environ["LAPROX_QUALITY_T0"])
                              if os.environ.get("LAPROX_QUALITY_T0") else None),
        }
        json_name = (f"{args.tag.lower()}.json" if args.tag
                     else report.file_name("results", mode_name, "json"))
        with open(os.path.join(args.out, json_name), "w") as f:
            json.dump({"meta": meta, **results}, f, separators=(",", ":"))
        report.write({"meta": meta, **results}, args.out)

    # Documents interleaved with the prompts (tasks interleaved too), so that a run stopped
    # early still has every part; saved every 10 items.
    items: List[Any] = [prompts[i] for i in interleaved(prompts)]
    step = max(1, len(items) // max(1, len(docs)))
    for j, d in enumerate(docs):
        items.insert(min(len(items), j * (step + 1)), d)
    for i, item in enumerate(items):
        if isinstance(item, T.Document):
            bar.set_description(f"LM {item.source} n={item.n}")
            results["documents"].append(run_document(ctx, item))
        else:
            bar.set_description(f"{item.task} {item.source} n={item.n}")
            results["prompts"].append(run_prompt(ctx, item))
        if i % 10 == 9:
            save(False)
    bar.close()
    save(True)
    log(f"== done in {(time.time() - t_start) / 60:.1f} min")
    client.close()
    return 0


def interleaved(prompts: List[T.Prompt]) -> List[int]:
    """The prompts' indices, tasks in turn: by each prompt's rank within its task over the
    task's count (so that any prefix has every task in proportion)."""
    return sorted(range(len(prompts)),
                  key=lambda i: (i - first_of(prompts, i)) / count_of(prompts, i))


def first_of(prompts: List[T.Prompt], i: int) -> int:
    return next(j for j, p in enumerate(prompts) if p.task == prompts[i].task)


def count_of(prompts: List[T.Prompt], i: int) -> int:
    return sum(p.task == prompts[i].task for p in prompts)


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
    return ", ".join(parts + [f"Python {platform.python_version()}"])


if __name__ == "__main__":
    sys.exit(main())
