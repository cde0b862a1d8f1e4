#!/usr/bin/env python3
"""A laproxd that stops answering (SIGSTOP) under a running vLLM engine: the engine's steps wait
at most the plugin's plan deadline, every request is served with its full cache, and once
laproxd runs again (SIGCONT) the plugin compresses again.

    stopped.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct
               [--rounds 1] [--prompts 3] [--prompt-tokens 800]

One in-process engine (vLLM's loop and the plugin's hooks in this process) with the plugin's
default deadline (LAPROX_VLLM_DEADLINE_SECONDS unset: 2 s, plan_deadline(tokens) per call).
Every engine step is timed (InprocClient.get_output: schedule, forward, plan call, sampling).
After a warm-up round:
  running   `rounds` rounds of `prompts` requests of `prompt-tokens` tokens, 8 greedy tokens
            each, with laproxd answering: every sequence gets a plan;
  stopped   the same with laproxd stopped: the plan call returns at its deadline (the plugin's
            own clock: within CALL_SLACK_S after it), and no step takes longer than the
            slowest step of the running rounds plus the plan deadline, plus slack for a busy
            2-vCPU machine (STEP_SLACK_S and STEP_SLACK_RATIO of that step); before the plugin
            had deadlines, the step that called laproxd waited the client's 60 s. Every
            request gets its 8 tokens, no plan is made, the sequences are counted
            (laprox_vllm_timeouts_total for the call that ran into the deadline,
            laprox_vllm_not_ready_total for the later ones);
  resumed   SIGCONT: the plugin finds laproxd answering again (its health check, every
            PROBE_INTERVAL) and the next round's sequences all get plans.
Prints a table of step times per phase (prefill steps and decode steps apart). Exits 1 on the
first check that fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from laproxd_support import Laproxd, use_laproxd

# Scheduling noise allowed on 2 busy vCPUs: on top of the plan call's deadline, and on top of
# the step bound (a prefill step's own time moved by up to 40% between rounds here).
CALL_SLACK_S = 0.5
STEP_SLACK_S = 1.0
STEP_SLACK_RATIO = 0.5
RESUME_WAIT_S = 30.0  # how long the plugin may take to find laproxd answering again
MAX_TOKENS = 8


def check(condition: bool, message: str) -> None:
    print(("ok   " if condition else "FAIL ") + message, flush=True)
    if not condition:
        raise SystemExit(1)


def summary(name: str, steps: list, change: dict) -> str:
    parts = [f"{name:8s} {len(steps):3d} steps"]
    for kind in ("prefill", "decode"):
        seconds = [s for s, k in steps if k == kind]
        if seconds:
            parts.append(f"{kind} {len(seconds):2d}: median {statistics.median(seconds):7.3f} "
                         f"max {max(seconds):7.3f} s")
    prefills = [f"{s:.3f}" for s, k in steps if k == "prefill"]
    parts.append(f"prefill steps in order {', '.join(prefills)} s")
    parts.append(f"plan calls {change['calls']}: {change['call_seconds']:.3f} s; plans "
                 f"{change['plans']}, timeouts {change['timeouts']}, not ready "
                 f"{change['not_ready']}")
    return " | ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=800)
    args = ap.parse_args()

    use_laproxd(args.laproxd)
    server = Laproxd()
    try:
        os.environ.update(LAPROX_VLLM_TARGET=server.target, LAPROX_VLLM_BUDGET="128",
                          VLLM_ENABLE_V1_MULTIPROCESSING="0",
                          VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        os.environ.pop("LAPROX_VLLM_DEADLINE_SECONDS", None)  # the default is under test
        return run(args, server)
    finally:
        server.stop()


def run(args: argparse.Namespace, server: Laproxd) -> int:
    from vllm import LLM, SamplingParams
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import laprox.vllm
    from laprox.client import plan_deadline
    from laprox.vllm import _runner

    laprox.vllm.register()  # the plugin's hooks first: the timers below wrap them
    steps = []  # (seconds, "prefill" | "decode") of every engine step
    kind = {"step": "decode"}

    execute_model = GPUModelRunner.execute_model

    def timed_execute_model(self, scheduler_output, *a, **kw):
        tokens = scheduler_output.total_num_scheduled_tokens
        requests = len(scheduler_output.num_scheduled_tokens)
        kind["step"] = "prefill" if tokens > requests else "decode"
        return execute_model(self, scheduler_output, *a, **kw)

    get_output = InprocClient.get_output

    def timed_get_output(self):
        kind["step"] = "idle"
        started = time.perf_counter()
        try:
            return get_output(self)
        finally:
            if kind["step"] != "idle":
                steps.append((time.perf_counter() - started, kind["step"]))

    GPUModelRunner.execute_model = timed_execute_model
    InprocClient.get_output = timed_get_output

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, kv_transfer_config=laprox.vllm.kv_transfer_config())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    offset = [0]

    def round_() -> list:
        prompts = [{"prompt_token_ids": list(range(100 + offset[0] + i,
                                                   100 + offset[0] + i + args.prompt_tokens))}
                   for i in range(args.prompts)]
        offset[0] += 37
        return [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    def phase(rounds: int) -> tuple:
        """(steps, tokens per request, plan counters' change) of `rounds` rounds."""
        before = laprox.vllm.metrics()
        first = len(steps)
        tokens = []
        for _ in range(rounds):
            tokens += round_()
        after = laprox.vllm.metrics()
        change = {name: getattr(after, name) - getattr(before, name)
                  for name in ("plans", "failures", "timeouts", "not_ready")}
        change["calls"] = after.stage("call")[0] - before.stage("call")[0]
        change["call_seconds"] = after.stage("call")[1] - before.stage("call")[1]
        return steps[first:], tokens, change

    requests = args.rounds * args.prompts
    phase(1)  # warm-up
    running, tokens, running_change = phase(args.rounds)
    check(tokens == [MAX_TOKENS] * requests and running_change["plans"] == requests
          and running_change["failures"] == 0,
          f"laproxd running: {running_change['plans']} plans for {requests} requests, "
          f"{running_change['failures']} failures")

    with server.paused():
        stopped, tokens, stopped_change = phase(args.rounds)
        paused_at = time.monotonic()
    slowest = max(s for s, _ in running)
    deadline = plan_deadline(args.prompts * args.prompt_tokens, _runner.STATE.config.deadline)
    slack = STEP_SLACK_S + STEP_SLACK_RATIO * slowest
    bound = slowest + deadline + slack
    worst = max(s for s, _ in stopped)
    print(summary("running", running, running_change))
    print(summary("stopped", stopped, stopped_change))
    check(worst <= bound,
          f"laproxd stopped: the slowest engine step took {worst:.3f} s; bound {bound:.3f} s "
          f"(slowest step with laproxd running {slowest:.3f} s + plan deadline "
          f"{deadline:.3f} s + {slack:.3f} s)")
    calls, seconds = stopped_change["calls"], stopped_change["call_seconds"]
    check(calls >= 1 and deadline * calls <= seconds <= (deadline + CALL_SLACK_S) * calls,
          f"laproxd stopped: {calls} plan call(s) of {seconds:.3f} s in all, each ran into its "
          f"deadline of {deadline:.3f} s (+ at most {CALL_SLACK_S:g} s)")
    check(tokens == [MAX_TOKENS] * requests and stopped_change["plans"] == 0
          and stopped_change["timeouts"] >= 1
          and stopped_change["timeouts"] + stopped_change["not_ready"] == requests
          and stopped_change["failures"] == requests,
          f"laproxd stopped: every request served ({tokens}), {stopped_change['plans']} plans, "
          f"{stopped_change['timeouts']} sequences timed out, {stopped_change['not_ready']} "
          f"not ready, {stopped_change['failures']} failures")

    # SIGCONT: the connector thread's next health check answers and the link is published.
    while _runner.STATE.link is None and time.monotonic() < paused_at + RESUME_WAIT_S:
        time.sleep(0.05)
    ready = time.monotonic() - paused_at
    resumed, tokens, change = phase(1)
    print(summary("resumed", resumed, change))
    check(tokens == [MAX_TOKENS] * args.prompts and change["plans"] == args.prompts,
          f"after SIGCONT: the plugin was ready again {ready:.2f} s later, and the next "
          f"{args.prompts} requests got {change['plans']} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
