#!/usr/bin/env python3
"""Cross-check laprox's baseline policies against NVIDIA kvpress itself.

Runs inside the virtual environment that run.sh builds (kvpress, transformers, torch pinned there).

For every prompt length:
  1. A small randomly initialised Llama model (no download, seeded) prefills a random prompt once
     per (press, compression ratio) with the kvpress press active.
  2. Every press's `compress` is wrapped (see `Recorder`) to record, per layer, what kvpress saw
     and what it decided:
       * keys / values exactly as kvpress received them from the cache, i.e. BEFORE compression
         ([Hkv, n, d], post-RoPE, model dtype);
       * the post-RoPE window queries of the last `window` positions, computed exactly the way
         SnapKVPress.compute_window_attention computes them (kvpress's own
         get_prerope_query_states + the model's rotate_half with the cos/sin the model handed to
         the layer) — identical bytes to what kvpress scores with;
       * o_proj.weight ([D, H*d]);
       * every torch.topk call kvpress makes inside `compress` (input scores, k, chosen indices),
         through a temporary patch of torch.topk / Tensor.topk. These are kvpress's own scores at
         every selection stage; they judge near-ties;
       * the kept positions per KV head, observed from kvpress's output, not recomputed:
           - ScorerPress family (StreamingLLM, SnapKV, PyramidKV, CriticalKV): `compress` returns
             the gathered keys/values; each returned (key, value) row is matched byte-for-byte to
             the row of the uncompressed cache it came from (rows are unique: RoPE makes every
             position's key distinct), which yields the kept positions;
           - AdaKV family (AdaKV, CriticalAdaKV): these do not shrink the cache; `compress` sets
             `module.masked_key_indices = (batch, head, position)` of the evicted entries, which
             kvpress's attention patch later hides from decoding. Kept = complement.
     Compression in layer l runs after layer l's attention output is computed, so prefill hidden
     states, keys and values of every layer are identical whatever the press: the script asserts
     that and writes ONE dump per prompt (all layers) in laprox-cli's safetensors format.
  3. laprox-cli plan DUMP --policy=P --numeric_mode=kvpress_compat --compression_ratio=CR --json
     (through laproxd on a private socket) returns laprox's kept positions per (layer, KV head).
  4. Per (layer, head): identical, equal up to near-ties, or differing. A position kept by one side
     only is a near-tie when, in at least one of kvpress's selection stages of that layer (a topk
     call), its kvpress score is within --tie_tol (1e-2) relative of the stage's threshold score
     (the score of the last selected element of that head — or of the layer for AdaKV-style
     cross-head selections), e.g. |s - s_thr| <= 1e-2 * |s_thr|.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

import kvpress
import transformers
from kvpress import (
    AdaKVPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
)
from kvpress.utils import get_prerope_query_states
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import rotate_half

# laprox policy name -> kvpress press at compression ratio cr (kvpress defaults everywhere).
PRESSES = {
    "streaming_llm": lambda cr: StreamingLLMPress(compression_ratio=cr),
    "snapkv": lambda cr: SnapKVPress(compression_ratio=cr),
    "pyramidkv": lambda cr: PyramidKVPress(compression_ratio=cr),
    "adakv": lambda cr: AdaKVPress(SnapKVPress(compression_ratio=cr)),
    "criticalkv": lambda cr: CriticalKVPress(SnapKVPress(compression_ratio=cr)),
    "critical_adakv": lambda cr: CriticalAdaKVPress(SnapKVPress(compression_ratio=cr)),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model


def build_model(args):
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max(args.lengths) + 64,
        rope_theta=10000.0,
        # Larger than Llama's 0.02 so that random attention is peaked rather than ~uniform:
        # with 0.02 the logits have std ~0.1 and nearly every SnapKV score is a near-tie.
        initializer_range=args.init_std,
        attn_implementation="sdpa",  # AdaKV-style presses refuse eager; sdpa returns no weights,
        # so SnapKV computes its own window attention (the path laprox reproduces).
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(DTYPES[args.dtype]).eval()
    return model


# ----------------------------------------------------------------------------- recording


class TopkLog(contextlib.AbstractContextManager):
    """Temporarily wraps torch.topk and Tensor.topk to record every call (kvpress scores)."""

    def __init__(self):
        self.calls = []

    def _wrap(self, orig):
        calls = self.calls

        def topk(input, k, dim=-1, largest=True, sorted=True, **kw):
            result = orig(input, k, dim=dim, largest=largest, sorted=sorted, **kw)
            dim_ = dim % input.dim()
            assert dim_ == input.dim() - 1, "kvpress topk along a non-last dim"
            calls.append(
                {
                    "scores": input.detach().to(torch.float64).reshape(-1, input.shape[-1]).clone(),
                    "shape": tuple(input.shape),
                    "k": int(k),
                    "largest": bool(largest),
                    "indices": result.indices.detach().reshape(-1, int(k)).clone(),
                }
            )
            return result

        return topk

    def __enter__(self):
        self._torch_topk = torch.topk
        self._had_tensor_attr = "topk" in torch.Tensor.__dict__
        self._tensor_topk = torch.Tensor.topk
        torch.topk = self._wrap(self._torch_topk)
        torch.Tensor.topk = self._wrap(self._tensor_topk)
        return self

    def __exit__(self, *exc):
        torch.topk = self._torch_topk
        if self._had_tensor_attr:
            torch.Tensor.topk = self._tensor_topk
        else:
            del torch.Tensor.topk
        return False


class Recorder:
    """Wraps press.compress; per layer stores inputs, topk calls and the kept positions."""

    def __init__(self, press, window):
        self.press = press
        self.window = window
        self.layers = {}
        self._orig = press.compress
        press.compress = self.compress  # instance attribute shadows the class method

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        assert keys.shape[0] == 1, "batch size 1 only"
        w = self.window
        with torch.no_grad():
            # Same computation as SnapKVPress.compute_window_attention (snapkv_press.py).
            q = get_prerope_query_states(module, hidden_states[:, -w:])
            cos, sin = kwargs["position_embeddings"]
            cos, sin = cos[:, -w:], sin[:, -w:]
            q = (q * cos.unsqueeze(1)) + (rotate_half(q) * sin.unsqueeze(1))
        rec = {
            "keys": keys[0].detach().clone(),
            "values": values[0].detach().clone(),
            "window_queries": q[0].detach().clone(),
            "o_proj": module.o_proj.weight.detach().clone(),
            "attentions_given": attentions is not None,
        }
        module.masked_key_indices = None
        with TopkLog() as topk_log:
            out_keys, out_values = self._orig(module, hidden_states, keys, values, attentions, kwargs)
        rec["topk"] = topk_log.calls
        hkv, n, _ = rec["keys"].shape
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:  # AdaKV family: evicted (batch, head, position), cache untouched
            _, heads, positions = masked
            keep = torch.ones(hkv, n, dtype=torch.bool)
            keep[heads.cpu(), positions.cpu()] = False
            rec["kept"] = [torch.nonzero(keep[h]).flatten().tolist() for h in range(hkv)]
            rec["method"] = "masked_key_indices"
        elif out_keys.shape[2] < n:  # ScorerPress family: map gathered rows back to positions
            rec["kept"] = [
                match_rows(rec["keys"][h], rec["values"][h], out_keys[0, h], out_values[0, h])
                for h in range(hkv)
            ]
            rec["method"] = "gathered rows"
        else:
            rec["kept"] = [list(range(n)) for _ in range(hkv)]
            rec["method"] = "uncompressed"
        self.layers[layer] = rec
        return out_keys, out_values


def match_rows(keys, values, out_keys, out_values):
    def row_bytes(k, v, i):
        return k[i].view(torch.uint8).numpy().tobytes() + v[i].view(torch.uint8).numpy().tobytes()

    index = {}
    for i in range(keys.shape[0]):
        b = row_bytes(keys, values, i)
        assert b not in index, f"duplicate key/value row at positions {index[b]} and {i}"
        index[b] = i
    kept = sorted(index[row_bytes(out_keys, out_values, j)] for j in range(out_keys.shape[0]))
    assert len(set(kept)) == len(kept)
    return kept


def run_press(model, input_ids, policy, cr, window):
    press = PRESSES[policy](cr)
    target = press
    recorder = Recorder(target, window)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    assert sorted(recorder.layers) == list(range(model.config.num_hidden_layers))
    return recorder.layers


# ----------------------------------------------------------------------------- near-ties


def stage_thresholds(policy, calls, n, hkv, first_stage_ratio=0.5):
    """For every kvpress topk call: (scores [R, m], per-row selected count, layout).

    The threshold of a row is the score of its last selected element. CriticalAdaKV selects the
    top max(budgets) per head and then uses only the first budget_h of them (criticalkv_press.py):
    its per-head counts come from the cross-head budget allocation (second topk call).
    """
    stages = []
    head_budgets = None
    for i, c in enumerate(calls):
        rows, m = c["scores"].shape
        counts = [c["k"]] * rows
        layout = "head" if m == n and rows == hkv else ("layer" if m == n * hkv else "?")
        if policy == "critical_adakv":
            if i == 1:  # budget allocation over all heads of the layer
                head_budgets = torch.bincount(c["indices"].flatten() // n, minlength=hkv)
            elif i == 2:  # stage 1: int(budget_h * first_stage_ratio)
                counts = (head_budgets * first_stage_ratio).to(torch.int64).tolist()
            elif i == 3:  # stage 2: budget_h
                counts = head_budgets.tolist()
        stages.append((c["scores"], counts, layout, c["largest"]))
    return stages


def tie_gap(stages, head, pos, n):
    """Smallest relative gap |s - s_thr| / |s_thr| of (head, pos) over kvpress's selection stages."""
    best = float("inf")
    for scores, counts, layout, largest in stages:
        if layout == "head":
            row, idx = head, pos
        elif layout == "layer":
            row, idx = 0, head * n + pos
        else:
            continue
        count = counts[row]
        if count <= 0:
            continue
        s = scores[row]
        thr = torch.sort(s, descending=largest).values[count - 1].item()
        x = s[idx].item()
        if x == thr:
            return 0.0
        if abs(thr) not in (0.0, float("inf")) and abs(x) != float("inf"):
            best = min(best, abs(x - thr) / abs(thr))
    return best


def compare(policy, layers_kvpress, plan, n, tol):
    """Per (layer, head): 'identical' | 'near' | 'differ', and the symmetric difference size."""
    out = []
    for l, rec in sorted(layers_kvpress.items()):
        hkv = len(rec["kept"])
        stages = None
        for h in range(hkv):
            a, b = set(rec["kept"][h]), set(plan["kept"][l][h])
            diff = sorted(a ^ b)
            if not diff:
                out.append({"layer": l, "head": h, "status": "identical", "diff": 0})
                continue
            if stages is None:
                stages = stage_thresholds(policy, rec["topk"], n, hkv)
            gaps = {p: tie_gap(stages, h, p, n) for p in diff}
            far = [p for p in diff if gaps[p] > tol]
            out.append(
                {
                    "layer": l,
                    "head": h,
                    "status": "near" if not far else "differ",
                    "diff": len(diff),
                    "kvpress_only": sorted(a - b)[:20],
                    "laprox_only": sorted(b - a)[:20],
                    "gaps": {str(p): round(g, 5) for p, g in sorted(gaps.items())[:40]},
                    "kvpress_count": len(a),
                    "laprox_count": len(b),
                    "far": far[:20],
                    "max_gap": max(gaps.values()),
                }
            )
    return out


# ----------------------------------------------------------------------------- dumps / laprox


def write_dump(path, layers, config):
    tensors = {}
    for l, rec in layers.items():
        for name in ("keys", "values", "window_queries", "o_proj"):
            tensors[f"layers.{l}.{name}"] = rec[name].contiguous()
    geometry = {
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
    }
    save_file(tensors, path, metadata={"laprox.geometry": json.dumps(geometry)})


def cli_has_policy(cli):
    r = subprocess.run([cli, "--helpfull"], capture_output=True, text=True)
    return "policy" in (r.stdout + r.stderr)


def laprox_plan(cli, target, dump, policy, cr, extra):
    cmd = [cli, "plan", dump, f"--target={target}", "--json", f"--compression_ratio={cr!r}"]
    if policy is not None:
        cmd += [f"--policy={policy}", "--numeric_mode=kvpress_compat"]
    cmd += extra
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"{' '.join(cmd)}\n  -> exit {r.returncode}: {r.stderr.strip()[:500]}"
    return json.loads(r.stdout), None


def check_laprox_plan_shape(plan, n, cr, window, num_layers, hkv):
    """Sanity of the LAPROX plan on a dump (the path that exists before the baselines do)."""
    problems = []
    if len(plan["kept"]) != num_layers or any(len(k) != hkv for k in plan["kept"]):
        problems.append("kept is not [layers][kv_heads]")
    total = 0
    for l in range(len(plan["kept"])):
        for h in range(len(plan["kept"][l])):
            pos = plan["kept"][l][h]
            total += len(pos)
            if pos != sorted(set(pos)) or (pos and (pos[0] < 0 or pos[-1] >= n)):
                problems.append(f"({l},{h}) positions not ascending/unique/in range")
            if not set(range(n - window, n)) <= set(pos):
                problems.append(f"({l},{h}) window not kept")
            if plan["counts"][l][h] != len(pos):
                problems.append(f"({l},{h}) count != len(kept)")
    expected = num_layers * hkv * int((1.0 - cr) * n)
    if total != expected:
        problems.append(f"total kept {total} != L*Hkv*int((1-cr)*n) = {expected}")
    return problems


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", required=True, help="laprox-cli binary")
    ap.add_argument("--target", required=True, help="laproxd address, e.g. unix:/tmp/x.sock")
    ap.add_argument("--out", required=True, help="folder for dumps and results")
    ap.add_argument("--lengths", default="320,1000,3000")
    ap.add_argument("--ratios", default="0.5,0.8,0.9")
    ap.add_argument("--policies", default=",".join(PRESSES))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--init_std", type=float, default=0.1)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--window", type=int, default=64, help="window queries in the dump (SnapKV w)")
    ap.add_argument("--tie_tol", type=float, default=1e-2)
    ap.add_argument("--cli_extra", default="", help="extra laprox-cli flags, space separated")
    ap.add_argument("--force_policy", action="store_true", help="pass --policy even if --help lacks it")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    extra = args.cli_extra.split()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    have_policy = args.force_policy or cli_has_policy(args.cli)
    log(f"kvpress {_dist_version('kvpress')}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}; "
        f"laprox-cli --policy: {'present' if have_policy else 'ABSENT'}")

    model = build_model(args)
    config = model.config
    hkv = config.num_key_value_heads

    results = []  # one row per (length, policy, cr)
    laprox_path = []  # LAPROX sanity when the baselines are absent
    for n in args.lengths:
        # Seeded per length, so that any subset of --lengths reproduces the same prompts.
        gen = torch.Generator().manual_seed(args.seed + n)
        input_ids = torch.randint(0, args.vocab, (1, n), generator=gen)
        dump = os.path.join(args.out, f"dump_n{n}.safetensors")
        reference = None
        for policy in policies:
            for cr in args.ratios:
                t0 = time.time()
                layers = run_press(model, input_ids, policy, cr, args.window)
                if reference is None:
                    reference = layers
                    write_dump(dump, layers, config)
                    if not have_policy:
                        for r in args.ratios:
                            plan, err = laprox_plan(args.cli, args.target, dump, None, r,
                                                    [f"--window={args.window}"] + extra)
                            problems = [err] if err else check_laprox_plan_shape(
                                plan, n, r, args.window, config.num_hidden_layers, hkv)
                            laprox_path.append({"n": n, "cr": r, "problems": problems})
                            log(f"n={n} cr={r} laprox (LAPROX policy) plan: "
                                f"{'OK' if not problems else problems}")
                else:
                    for l in layers:  # prefill is press-independent: same dump for every press
                        for name in ("keys", "values", "window_queries"):
                            assert torch.equal(layers[l][name], reference[l][name]), (
                                f"{policy} cr={cr}: layer {l} {name} differ from the first press")
                row = {
                    "n": n,
                    "policy": policy,
                    "cr": cr,
                    "kvpress_counts": [[len(k) for k in layers[l]["kept"]] for l in sorted(layers)],
                    "method": layers[0]["method"],
                }
                with open(os.path.join(args.out, f"kvpress_n{n}_{policy}_{cr}.json"), "w") as f:
                    json.dump({"kept": [layers[l]["kept"] for l in sorted(layers)],
                               "method": row["method"]}, f)
                if have_policy:
                    plan, err = laprox_plan(args.cli, args.target, dump, policy, cr, extra)
                    if err:
                        row["error"] = err
                    else:
                        row["laprox_counts"] = plan["counts"]
                        row["heads"] = compare(policy, layers, plan, n, args.tie_tol)
                results.append(row)
                summary = ""
                if "heads" in row:
                    st = [h["status"] for h in row["heads"]]
                    summary = (f"identical {st.count('identical')} near {st.count('near')} "
                               f"differ {st.count('differ')}")
                elif "error" in row:
                    summary = "laprox error: " + row["error"].splitlines()[-1]
                log(f"n={n} {policy} cr={cr}: kvpress kept per (layer, head) "
                    f"{row['kvpress_counts']} [{row['method']}] {summary} ({time.time() - t0:.1f}s)")

    # ------------------------------------------------------------------ table
    lines = []
    if have_policy:
        lines.append(f"{'policy':15s} {'cr':>4s} | {'identical':>9s} {'near-ties':>9s} "
                     f"{'differ':>6s} {'max diff':>8s} {'max gap':>8s} | errors")
        for policy in policies:
            for cr in args.ratios:
                rows = [r for r in results if r["policy"] == policy and r["cr"] == cr]
                heads = [h for r in rows for h in r.get("heads", [])]
                errors = sum(1 for r in rows if "error" in r)
                st = [h["status"] for h in heads]
                lines.append(
                    f"{policy:15s} {cr:4.2f} | {st.count('identical'):9d} {st.count('near'):9d} "
                    f"{st.count('differ'):6d} {max([h['diff'] for h in heads], default=0):8d} "
                    f"{max([h.get('max_gap', 0.0) for h in heads], default=0.0):8.4f} | {errors}")
        lines.append(f"(heads summed over n in {args.lengths}, {config.num_hidden_layers} layers x "
                     f"{hkv} KV heads each; max diff = largest symmetric difference of one head's "
                     f"kept sets; max gap = largest relative score gap of a position kept by one side only, "
                     f"to kvpress's threshold; near-tie tolerance {args.tie_tol} relative)")
        for r in results:
            for h in r.get("heads", []):
                if h["status"] == "differ":
                    lines.append(f"  DIFFER n={r['n']} {r['policy']} cr={r['cr']} layer {h['layer']} "
                                 f"head {h['head']}: kvpress {h['kvpress_count']} laprox "
                                 f"{h['laprox_count']} kept; kvpress only {h['kvpress_only']} "
                                 f"laprox only {h['laprox_only']}; relative gaps {h['gaps']}")
            if "error" in r:
                lines.append(f"  ERROR n={r['n']} {r['policy']} cr={r['cr']}: {r['error']}")
    else:
        lines.append("laprox-cli has no --policy flag: baseline comparison SKIPPED.")
        lines.append("kvpress side recorded for every (n, policy, cr); dumps written; "
                     "LAPROX-policy plans on the same dumps:")
        for p in laprox_path:
            lines.append(f"  n={p['n']} cr={p['cr']}: {'OK' if not p['problems'] else p['problems']}")
    table = "\n".join(lines)
    print(table)

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()} "
                   f"{os.cpu_count()} cpus",
        "python": platform.python_version(),
        "kvpress": _dist_version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "seed": args.seed,
        "init_std": args.init_std,
        "lengths": args.lengths,
        "ratios": args.ratios,
        "have_policy": have_policy,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "laprox_path": laprox_path, "table": table},
                  f, indent=1)
    if not have_policy:
        return 3 if any(p["problems"] for p in laprox_path) else 2
    bad = any("error" in r or any(h["status"] == "differ" for h in r.get("heads", []))
              for r in results)
    return 1 if bad else 0


def _dist_version(name):
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
