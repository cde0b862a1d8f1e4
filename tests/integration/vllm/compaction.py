#!/usr/bin/env python3
"""Compaction in a real vLLM engine: a compressed sequence's evicted entries leave the KV cache
and its blocks go back to vLLM's pool (laprox.vllm, LAPROX_VLLM_MODE=compact), checked against
the masked engine (LAPROX_VLLM_MODE=mask) under the same plans.

    compaction.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct
                  [--prompts 3] [--budget 128] [--continuation 32]
                  [--checks parity,prefix,preempt,ample,pressure,levels,long,fence]

Each engine runs in a process of its own (the plugin's settings are read once per process),
with the same prompts (a needle question and 1-3K tokens of seeded text), policy
(POLICY: plan_shape LAYER_UNIFORM, max_layer_share 1.25, AVG pooling and one sink, the
compacting plugin's defaults)
and greedy sampling:
  parity   the compacting engine's greedy tokens equal the masked engine's and their log-probs
           agree within --logprob-tolerance; every planned sequence was compacted, blocks were
           released, and once every request ended the pool's free blocks are back at their
           count before the first request; laprox_vllm_kept_entries_total is the plans' kept
           entries and, with _evicted_entries_total, every prompt entry; the needle is
           answered alike; the layers planned are the model's full-attention ones (all of
           SmolLM2's; Gemma 3's every sixth, its sliding-window layers left to vLLM);
  prefix   prefix caching on, prefills cut into chunks of 256 tokens: request B is added while
           request A is half prefilled, so B's first blocks are A's (ref_cnt 2) when A is
           compacted; both decode as in the masked engine, B's prefix-cache hit is real, and
           A's shared blocks keep their prefix-cache hashes;
  preempt  a pool of --preempt-blocks blocks and more sequences than fit (twelve prompts of
           about 1,000 tokens): at least one compacted request is preempted, prefilled again, planned again
           and compacted again; every request's tokens equal those of the masked engine with a
           pool that preempts nothing, and the pool is whole at the end.
  ample    LAPROX_VLLM_TRIGGER=pressure with a pool that never runs short (the parity prompts):
           every sequence is planned and deferred, none compacted, no block released, and every
           request's tokens and log-probs equal those of vLLM without the plugin;
  pressure LAPROX_VLLM_TRIGGER=pressure with a pool of --pressure-blocks blocks and twelve
           sequences of about 1,000 tokens, more than it holds at once: some sequences are
           compacted, fewer than LAPROX_VLLM_TRIGGER=always compacts on the same engine, and
           none is preempted (compacted in time to make room); every
           plan ends compacted or spared (its sequence ended with its full cache), and the pool
           is whole at the end (the shortfall at each compaction is printed).
  levels   the pressure scenario with LAPROX_VLLM_PRESSURE_BUDGETS=2B,4B (B the budget): each
           sequence is planned at three budgets; some compactions are at a budget above B
           (laprox_vllm_above_floor_total), they keep more prompt entries per compaction than
           the pressure scenario's, none is preempted, every plan ends compacted or spared and
           the pool is whole at the end (a compaction order whose blocks do not fit the plan it
           names stops the engine: _compact.move).
  long     the ample scenario with LAPROX_VLLM_LONG_PROMPT=--long-prompt: the prompts at least
           that long are compacted at once (laprox_vllm_long_prompt_total), the others deferred
           and spared, and the pool is whole at the end.
  fence    in both modes, prefills cut into chunks of 256 tokens and request ids as given
           (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1; vLLM otherwise appends 8 random characters
           to each): request A is aborted half prefilled and its id given at once to a request
           of another prompt, which must decode as the same prompt does under a fresh id
           afterwards (tokens and log-probs): the reused id begins a generation of its own, and
           the first one's window queries are dropped (laprox_vllm_fenced_total), not planned
           with the second's; once they ended (one more short request tells the worker),
           nothing of them is left in the plugin's tables, worker or scheduler.
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from laproxd_support import Laproxd, use_laproxd
from laprox.vllm._state import COMPACT_LAPROX_SCORING, COMPACT_POLICY
from parity import prompt_text, draw_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
# The compacting plugin's default plan options, given to both engines so that the masking
# engine (whose default is the server's RAGGED plan) applies the very same plans.
POLICY = {**COMPACT_POLICY, **COMPACT_LAPROX_SCORING}


def prompts_for(args: argparse.Namespace):
    """The needle prompt, then --prompts seeded texts of 1-3K tokens; and the two prompts of
    the prefix check (one shared 1,024-token prefix, different tails)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rng = np.random.default_rng(args.seed)
    prompts = draw_prompts(tokenizer, rng, args.prompts)  # parity.py's: the same draws
    shared = [int(x) for x in tokenizer(prompt_text(rng, 1100))["input_ids"][:1024]]
    tails = [[int(x) for x in tokenizer(prompt_text(rng, 400))["input_ids"][:300]]
             for _ in range(2)]
    return tokenizer, prompts, [shared + tail for tail in tails]


def engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def completion(output) -> dict:
    c = output.outputs[0]
    return {"tokens": list(c.token_ids),
            "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]}


def twelve_sequences(engine: dict, prompts, blocks: int, tokens: int, result: dict,
                     noted) -> None:
    """Twelve sequences of about 1,000 tokens (prompts[1] cut short by 0 .. 11) with `tokens`
    greedy tokens each, on a pool of `blocks` blocks (vLLM's own size when 0): their
    completions, the free blocks before and after, and noted(request) of every preemption, in
    result."""
    from vllm import LLM, SamplingParams

    pool_size = {"num_gpu_blocks_override": blocks} if blocks else {}
    llm = LLM(enable_prefix_caching=False, **dict(engine, max_model_len=2432, **pool_size))
    scheduler = engine_core(llm).scheduler
    pool = scheduler.kv_cache_manager.block_pool
    result["free_before"] = pool.get_num_free_blocks()
    preempted: list = []
    original = type(scheduler)._preempt_request

    def preempt(self, request, *a, **k):
        preempted.append(noted(request))
        return original(self, request, *a, **k)

    type(scheduler)._preempt_request = preempt
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": prompts[1][:1000 - i]} for i in range(12)],
                           params)
    result["completions"] = [completion(o) for o in outputs]
    result["preempted"] = preempted
    result["free_after"] = pool.get_num_free_blocks()


def child(args: argparse.Namespace, scenario: str, out_path: str) -> int:
    """One engine: runs `scenario` and writes what it saw to out_path (JSON)."""
    from vllm import LLM, SamplingParams

    import laprox.vllm
    from laprox.vllm import _compact, _runner

    laprox.vllm.register()
    _, prompts, pair = prompts_for(args)
    greedy = SamplingParams(max_tokens=args.continuation, temperature=0.0, logprobs=1)
    engine = dict(model=args.model, dtype="float32", enforce_eager=True, max_model_len=4096,
                  seed=0, kv_transfer_config=laprox.vllm.kv_transfer_config())
    result: dict = {}
    if scenario in ("parity", "mask", "ample"):
        llm = LLM(enable_prefix_caching=False, **engine)
        pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
        result["free_before"] = pool.get_num_free_blocks()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts + pair], greedy)
        result["completions"] = [completion(o) for o in outputs]
        result["free_after"] = pool.get_num_free_blocks()
        result["kept"] = [[int(c) for c in plan.counts.max(axis=1)]
                          for plan in laprox.vllm.plans().values()]
        result["prompt_tokens"] = sum(len(p) for p in prompts + pair)
        result["prompt_lengths"] = [len(p) for p in prompts + pair]
    elif scenario == "prefix":
        llm = LLM(enable_prefix_caching=True, enable_chunked_prefill=True,
                  max_num_batched_tokens=256, **engine)
        core = engine_core(llm)
        manager = core.scheduler.kv_cache_manager
        pool = manager.block_pool
        result["free_before"] = pool.get_num_free_blocks()
        seen: dict = {"shared_at_compaction": 0}
        decide = _compact.decide

        def watching(scheduler, req_id, found, *a, **k):
            blocks = manager.coordinator.single_type_managers[0].req_to_blocks.get(req_id, [])
            shared = [b for b in blocks if b.ref_cnt > 1]
            seen["shared_at_compaction"] += len(shared)
            seen.setdefault("shared_blocks", []).extend(b.block_id for b in shared)
            released = decide(scheduler, req_id, found, *a, **k)
            seen["hashed_after"] = sum(pool.blocks[i].block_hash is not None
                                       for i in seen.get("shared_blocks", []))
            return released

        _compact.decide = watching
        engine_ = llm.llm_engine
        engine_.add_request("A", {"prompt_token_ids": pair[0]}, greedy)
        finished: dict = {}
        steps = 0
        while engine_.has_unfinished_requests() or steps == 0:
            for output in engine_.step():
                if output.finished:
                    finished[output.request_id] = output
            steps += 1
            if steps == 2:  # A has 512 of its 1,324 positions: four full, cached blocks
                engine_.add_request("B", {"prompt_token_ids": pair[1]}, greedy)
        result["completions"] = [completion(finished["A"]), completion(finished["B"])]
        result["cached_tokens_B"] = int(finished["B"].num_cached_tokens or 0)
        result.update(seen)
        result["free_after"] = pool.get_num_free_blocks()
    elif scenario == "fence":
        llm = LLM(enable_prefix_caching=False, enable_chunked_prefill=True,
                  max_num_batched_tokens=256, **engine)
        engine_ = llm.llm_engine
        finished = {}

        def run(req_id, prompt, abort_after=0):
            engine_.add_request(req_id, {"prompt_token_ids": prompt}, greedy)
            steps = 0
            while engine_.has_unfinished_requests():
                for output in engine_.step():
                    if output.finished:
                        finished[output.request_id] = completion(output)
                steps += 1
                if steps == abort_after:  # A has 512 of its positions
                    engine_.abort_request([req_id])
                    return

        run("A", pair[0], abort_after=2)
        run("A", prompts[1])  # the same id, another prompt, at once
        reused = finished.pop("A")
        run("fresh", prompts[1])
        result["completions"] = [reused, finished["fresh"]]
        # The worker hears that a request ended on the next step's SchedulerOutput.
        run("last", prompts[1][:200])
        tables = {f"worker.{name}": getattr(_runner.STATE, name) for name in (
            "prefills", "compressed", "pending", "ready", "compacted", "generations")}
        tables.update({f"scheduler.{name}": getattr(_compact.SCHED, name) for name in (
            "drops", "pending", "held", "deferred", "generations", "layouts")})
        result["left"] = {name: list(table) for name, table in tables.items()
                          if set(table) - {"last"}}
    elif scenario == "pressure":
        decisions: list = []
        relieve = _compact.relieve

        def watching(scheduler_):
            manager = _compact._manager(scheduler_)
            short = _compact.shortfall(scheduler_, manager)
            compacted = relieve(scheduler_)
            if compacted:
                decisions.append([short, compacted, len(scheduler_.waiting)])
            return compacted

        _compact.relieve = watching
        twelve_sequences(engine, prompts, args.pressure_blocks, args.pressure_tokens, result,
                         lambda request: request.request_id)
        result["decisions"] = decisions
    elif scenario == "preempt":
        # A small pool (none for the reference run) and twelve sequences of 1,000 tokens:
        # compacted, all of them run at once, and their decodes outgrow the pool.
        twelve_sequences(engine, prompts, args.preempt_blocks, args.preempt_tokens, result,
                         lambda request: [request.request_id,
                                          request.request_id in _compact.SCHED.drops])
    result["metrics"] = {name: getattr(laprox.vllm.metrics(), name)
                         for name in ("plans", "failures", "compactions", "blocks_released",
                                      "deferred", "spared", "evicted_entries", "kept_entries",
                                      "above_floor", "long_prompt", "fenced")}
    geometry = _runner.STATE.geometry
    result["geometry"] = geometry and [geometry.num_layers, geometry.num_kv_heads]
    # The layers a hybrid model plans: its full-attention ones (Gemma 3: layer_types).
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.model)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    result["full_attention_layers"] = [i for i, t in enumerate(types) if t == "full_attention"]
    result["planned_layers"] = _runner.STATE.layer_ids
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def run_child(args: argparse.Namespace, scenario: str, target: str, mode: str,
              trigger: str = "always", **extra: str) -> dict:
    """One engine in a process of its own; mode "vanilla": without the plugin."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, LAPROX_VLLM_TARGET=target, LAPROX_VLLM_BUDGET=str(args.budget),
               LAPROX_VLLM_MODE=mode, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               LAPROX_VLLM_POLICY=json.dumps(POLICY), LAPROX_VLLM_TRIGGER=trigger,
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **extra)
    if mode == "vanilla":
        del env["LAPROX_VLLM_TARGET"]
    command = [sys.executable, __file__, "--child", scenario, "--out", out] + args.passthrough
    if scenario == "preempt" and mode == "mask":
        command += ["--preempt-blocks", "0"]  # the reference: nothing preempted
    settings = "".join(f", {k}={v}" for k, v in extra.items())
    print(f"== {scenario} ({mode}, trigger {trigger}{settings})", flush=True)
    subprocess.run(command, env=env, check=True)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    print(f"   {json.dumps({k: v for k, v in result.items() if k != 'completions'})}")
    return result


def same_decode(name: str, got: list, want: list, tolerance: float,
                tokens_only: frozenset = frozenset()) -> bool:
    """Greedy tokens equal, and log-probs within `tolerance` except for the sequences of
    tokens_only (whose log-probs are reported)."""
    ok = True
    for i, (a, b) in enumerate(zip(got, want)):
        n = len(b["tokens"])
        same = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), n)
        diff = max((abs(x - y) for x, y in zip(a["logprobs"][:same], b["logprobs"][:same])),
                   default=0.0)
        good = same == n == len(a["tokens"]) and (diff <= tolerance or i in tokens_only)
        ok = ok and good
        print(f"   {name} {i}: {same} of {n} greedy tokens equal, largest |log-prob "
              f"difference| {diff:.2e}{' (tokens only)' if i in tokens_only else ''}"
              f"{'' if good else ' <- FAIL'}")
    return ok and len(got) == len(want)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logprob-tolerance", type=float, default=1e-3)
    ap.add_argument("--checks",
                    default="parity,prefix,preempt,ample,pressure,levels,long,fence")
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--preempt-blocks", type=int, default=40)
    ap.add_argument("--preempt-tokens", type=int, default=300)
    ap.add_argument("--pressure-blocks", type=int, default=90)
    ap.add_argument("--pressure-tokens", type=int, default=100)
    ap.add_argument("--child")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        return child(args, args.child, args.out)
    args.passthrough = ["--model", args.model, "--prompts", str(args.prompts),
                        "--budget", str(args.budget), "--continuation", str(args.continuation),
                        "--seed", str(args.seed), "--preempt-blocks", str(args.preempt_blocks),
                        "--preempt-tokens", str(args.preempt_tokens),
                        "--pressure-blocks", str(args.pressure_blocks),
                        "--pressure-tokens", str(args.pressure_tokens)]
    checks = args.checks.split(",")
    use_laproxd(args.laproxd)
    server = Laproxd()
    ok = True
    try:
        sequences = args.prompts + 1 + 2
        if "ample" in checks:
            got = run_child(args, "ample", server.target, "compact", trigger="pressure")
            vanilla = run_child(args, "ample", server.target, "vanilla")
            m = got["metrics"]
            good = (m["plans"] == m["deferred"] == m["spared"] == sequences
                    and m["compactions"] == m["blocks_released"] == m["failures"] == 0
                    and got["free_after"] == got["free_before"])
            print(f"   trigger pressure, a pool with room: {m['plans']} plans ({sequences} "
                  f"sequences), {m['deferred']} deferred, {m['spared']} spared, "
                  f"{m['compactions']} compactions, {m['blocks_released']} blocks released"
                  f"{'' if good else ' <- FAIL'}")
            ok = same_decode("ample", got["completions"], vanilla["completions"],
                             args.logprob_tolerance) and good and ok
        floor = None
        if "pressure" in checks:
            got = floor = run_child(args, "pressure", server.target, "compact",
                                    trigger="pressure")
            always = run_child(args, "pressure", server.target, "compact")
            m, a = got["metrics"], always["metrics"]
            good = (0 < m["compactions"] < a["compactions"] and m["failures"] == 0
                    and not got["preempted"]
                    and m["plans"] == m["compactions"] + m["spared"]
                    and got["free_after"] == got["free_before"])
            print(f"   trigger pressure, {args.pressure_blocks} blocks: {m['compactions']} "
                  f"compactions of {m['plans']} plans ([shortfall, compacted, waiting] "
                  f"{got['decisions']}), {m['spared']} spared, {len(got['preempted'])} "
                  f"preemptions; trigger always: {a['compactions']} compactions of {a['plans']} "
                  f"plans, {len(always['preempted'])} preemptions; free blocks "
                  f"{got['free_before']} before, {got['free_after']} after"
                  f"{'' if good else ' <- FAIL'}")
            ok = good and ok
        if "levels" in checks:
            budgets = f"{2 * args.budget},{4 * args.budget}"
            got = run_child(args, "pressure", server.target, "compact", trigger="pressure",
                            LAPROX_VLLM_PRESSURE_BUDGETS=budgets)
            floor = floor or run_child(args, "pressure", server.target, "compact",
                                       trigger="pressure")
            m, f = got["metrics"], floor["metrics"]

            def per_compaction(metrics):
                return metrics["kept_entries"] / max(metrics["compactions"], 1)

            good = (m["above_floor"] >= 1 and m["failures"] == 0 and not got["preempted"]
                    and m["plans"] == m["compactions"] + m["spared"]
                    and per_compaction(m) > per_compaction(f)
                    and got["free_after"] == got["free_before"])
            print(f"   LAPROX_VLLM_PRESSURE_BUDGETS={budgets}: {m['compactions']} compactions "
                  f"({m['above_floor']} above the budget; [shortfall, compacted, waiting] "
                  f"{got['decisions']}), {per_compaction(m):.0f} prompt entries kept per "
                  f"compaction against {per_compaction(f):.0f} at the budget alone, "
                  f"{m['evicted_entries']} entries evicted against {f['evicted_entries']}, "
                  f"{m['spared']} spared, {len(got['preempted'])} preemptions; free blocks "
                  f"{got['free_before']} before, {got['free_after']} after"
                  f"{'' if good else ' <- FAIL'}")
            ok = good and ok
        if "long" in checks:
            got = run_child(args, "ample", server.target, "compact", trigger="pressure",
                            LAPROX_VLLM_LONG_PROMPT=str(args.long_prompt))
            m, lengths = got["metrics"], got["prompt_lengths"]
            long = sum(n >= args.long_prompt for n in lengths)
            good = (0 < long < len(lengths) and m["plans"] == len(lengths)
                    and m["long_prompt"] == m["compactions"] == long
                    and m["deferred"] == m["spared"] == len(lengths) - long
                    and m["failures"] == 0 and got["free_after"] == got["free_before"])
            print(f"   LAPROX_VLLM_LONG_PROMPT={args.long_prompt}, prompts of {lengths} tokens: "
                  f"{m['long_prompt']} compacted at once, {m['compactions']} compactions in "
                  f"all, {m['deferred']} deferred, {m['spared']} spared; free blocks "
                  f"{got['free_before']} before, {got['free_after']} after"
                  f"{'' if good else ' <- FAIL'}")
            ok = good and ok
        if "fence" in checks:
            for mode in ("compact", "mask"):
                got = run_child(args, "fence", server.target, mode,
                                VLLM_DISABLE_REQUEST_ID_RANDOMIZATION="1")
                m = got["metrics"]
                good = (m["fenced"] >= 1 and m["plans"] == 3 and not got["left"]
                        and m["compactions"] == (3 if mode == "compact" else 0))
                print(f"   {mode}: request A aborted half prefilled, its id reused at once: "
                      f"{m['fenced']} fenced, {m['plans']} plans, {m['compactions']} "
                      f"compactions; left in the plugin's tables at the end: "
                      f"{got['left'] or 'nothing'}{'' if good else ' <- FAIL'}")
                ok = same_decode(f"fence ({mode}, reused id against a fresh one)",
                                 got["completions"][:1], got["completions"][1:],
                                 args.logprob_tolerance) and good and ok
        if not {"parity", "prefix", "preempt"} & set(checks):
            checks = []  # the masked engine is their reference only
        else:
            masked = run_child(args, "mask", server.target, "mask")
        if "parity" in checks:
            got = run_child(args, "parity", server.target, "compact")
            m = got["metrics"]
            # Every prompt entry of every layer and KV head is either kept or evicted, and the
            # kept ones are the plans' (padded) per-layer counts.
            layers, heads = got["geometry"]
            kept = heads * sum(sum(k) for k in got["kept"])
            good = (m["compactions"] == m["plans"] == sequences and m["blocks_released"] > 0
                    and got["planned_layers"] == got["full_attention_layers"]
                    and got["free_after"] == got["free_before"] and m["kept_entries"] == kept
                    and m["kept_entries"] + m["evicted_entries"]
                    == layers * heads * got["prompt_tokens"])
            print(f"   planned layers {got['planned_layers']} (full attention: "
                  f"{got['full_attention_layers']}); "
                  f"compactions {m['compactions']} of {m['plans']} plans ({sequences} "
                  f"sequences), {m['blocks_released']} blocks released, free blocks "
                  f"{got['free_before']} before, {got['free_after']} after; entries kept "
                  f"{m['kept_entries']} (the plans: {kept}), evicted {m['evicted_entries']}, "
                  f"of {layers * heads * got['prompt_tokens']}{'' if good else ' <- FAIL'}")
            ok = same_decode("parity", got["completions"], masked["completions"],
                             args.logprob_tolerance) and good and ok
        if "prefix" in checks:
            got = run_child(args, "prefix", server.target, "compact")
            good = (got["cached_tokens_B"] >= 512 and got["shared_at_compaction"] > 0
                    and got["hashed_after"] == len(got["shared_blocks"])
                    and got["free_after"] == got["free_before"]
                    and got["metrics"]["compactions"] == 2)
            print(f"   B's prefix-cache hit {got['cached_tokens_B']} tokens; shared blocks when "
                  f"compacted {got['shared_at_compaction']}, still hashed after "
                  f"{got['hashed_after']}; free blocks {got['free_before']} before, "
                  f"{got['free_after']} after{'' if good else ' <- FAIL'}")
            ok = same_decode("prefix", got["completions"], masked["completions"][-2:],
                             args.logprob_tolerance) and good and ok
        if "preempt" in checks:
            got = run_child(args, "preempt", server.target, "compact")
            reference = run_child(args, "preempt", server.target, "mask")
            compacted_preempted = [r for r, compacted in got["preempted"] if compacted]
            # A compacted request that is preempted is planned and compacted again.
            good = (bool(compacted_preempted) and got["free_after"] == got["free_before"]
                    and got["metrics"]["compactions"] >= len(got["completions"]) + 1)
            print(f"   preempted {got['preempted']} (compacted ones: {compacted_preempted}); "
                  f"compactions {got['metrics']['compactions']} for "
                  f"{len(got['completions'])} requests; free blocks {got['free_before']} "
                  f"before, {got['free_after']} after{'' if good else ' <- FAIL'}")
            # vLLM recomputes a preempted request by prefilling its prompt and generated tokens
            # with full attention: the generated tokens' entries are then those of the full
            # cache, not those computed under the plan, so only its tokens must be the same.
            recomputed = frozenset(int(r.split("-")[0]) for r, _ in got["preempted"])
            ok = same_decode("preempt", got["completions"], reference["completions"],
                             args.logprob_tolerance, recomputed) and good and ok
    finally:
        server.stop()
    print("compaction: all checks passed" if ok else "compaction: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
