#!/usr/bin/env python3
"""The laprox.vllm plugin when things go wrong, and laproxd's budget-share metrics.

    bad_paths.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct

Five vLLM engines (one process each, the plugin reads its configuration once per process):
  metrics   a working laproxd with metrics: every prompt gets a plan, and laproxd's /metrics
            shows laprox_layer_budget_share for the model's name;
  down      LAPROX_VLLM_TARGET names no server: vLLM serves every prompt with its full cache,
            the plugin counts the failures (as not_ready: never registered) and logs one
            warning (its interval is 60 s);
  broken    the masked decode attention raises (a planted failure; LAPROX_VLLM_MODE=mask,
            the path that masks): the engine goes on with
            the kernel's rows, the tokens of the full cache, the sequences counted;
  late      laproxd starts only after the engine, and later restarts: the plugin registers the
            KV pool and the model again each time and plans resume;
  refused   laproxd refuses the plans (an invalid policy option): each request goes on
            uncompressed, counted.
Exits 1 on the first check that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from laproxd_support import Laproxd, use_laproxd

PROMPTS = 3


def child(mode: str, model: str) -> int:
    """One engine: generates for PROMPTS prompts and prints the plugin's counters as JSON."""
    import logging

    from vllm import LLM, SamplingParams

    import laprox.vllm

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("laprox.vllm").addHandler(Collect())
    laprox.vllm.register()
    from laprox.vllm import _connect, _runner

    _connect.RETRY_INTERVAL = 0.5  # the test waits for the retry
    if mode == "broken":
        def broken(*args, **kwargs):
            raise RuntimeError("planted failure of the masked decode attention")

        _runner._apply = broken
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, kv_transfer_config=laprox.vllm.kv_transfer_config())
    params = SamplingParams(max_tokens=8, temperature=0.0)

    ids = []

    def generate(offset: int) -> list:
        prompts = [{"prompt_token_ids": list(range(100 + i + offset, 900 + i + offset))}
                   for i in range(PROMPTS)]
        outputs = llm.generate(prompts, params)
        ids.append([list(o.outputs[0].token_ids) for o in outputs])
        return [len(o.outputs[0].token_ids) for o in outputs]

    tokens = generate(0)
    phases = []  # plans made by each later phase
    if mode == "late":
        # laproxd starts after the engine, then restarts: the plugin registers again each time.
        socket = os.environ["LAPROX_VLLM_TARGET"][len("unix:"):]
        for phase in range(2):
            server = Laproxd(socket=socket)
            time.sleep(1.0)  # past the plugin's RETRY_INTERVAL since its last attempt
            before = laprox.vllm.metrics().plans
            tokens += generate(1000 * (phase + 1))  # may fail once: NOT_FOUND after a restart
            time.sleep(1.0)
            tokens += generate(1000 * (phase + 1) + 500)
            phases.append(laprox.vllm.metrics().plans - before)
            server.stop()
            if os.path.exists(socket):
                os.unlink(socket)
    metrics = laprox.vllm.metrics()
    print("RESULT " + json.dumps({
        "tokens": tokens, "ids": ids[0], "plans": metrics.plans, "failures": metrics.failures,
        "not_ready": metrics.not_ready, "phases": phases, "warnings": [w for w in warnings if w.startswith("laprox:")]}))
    return 0


def run_child(mode: str, args: argparse.Namespace, env: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model,
                             "--laproxd", args.laproxd], env=env, capture_output=True,
                            text=True, timeout=600)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        print(result.stdout[-3000:], result.stderr[-3000:])
        raise SystemExit(f"FAIL {mode}: the vLLM engine exited {result.returncode}")
    return json.loads(line[len("RESULT "):])


def check(condition: bool, message: str) -> None:
    print(("ok   " if condition else "FAIL ") + message)
    if not condition:
        raise SystemExit(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model)

    use_laproxd(args.laproxd)
    base = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                LAPROX_VLLM_BUDGET="128", LAPROX_VLLM_MODEL="smollm2-vllm")
    tmp = tempfile.mkdtemp(prefix="laprox-vllm-bad-")
    server = Laproxd("--metrics_listen=127.0.0.1:0")
    socket = server.socket
    try:
        port = int(re.search(r"metrics on http port (\d+)", server.log()).group(1))

        result = run_child("metrics", args, dict(base, LAPROX_VLLM_TARGET=f"unix:{socket}"))
        check(result["plans"] == PROMPTS and result["failures"] == 0,
              f"working laproxd: {result['plans']} plans for {PROMPTS} prompts, "
              f"{result['failures']} failures")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        shares = [l for l in text.decode().splitlines()
                  if l.startswith("laprox_layer_budget_share") and "smollm2-vllm" in l]
        check(len(shares) > 0, f"laproxd's metrics: {len(shares)} laprox_layer_budget_share "
                               f"lines for model smollm2-vllm")

        result = run_child("down", args, dict(base, LAPROX_VLLM_TARGET=f"unix:{tmp}/absent"))
        check(result["tokens"] == [8] * PROMPTS,
              f"laproxd down: vLLM served {result['tokens']} tokens (8 each expected)")
        check(result["plans"] == 0 and result["failures"] >= 1
              and result["not_ready"] == result["failures"] and len(result["warnings"]) == 1,
              f"laproxd down: {result['plans']} plans, {result['failures']} failures counted "
              f"({result['not_ready']} not ready), {len(result['warnings'])} warning(s): "
              f"{result['warnings'][:1]}")

        down_ids = result["ids"]
        # The masked path (compaction reads no mask): LAPROX_VLLM_MODE=mask.
        result = run_child("broken", args, dict(base, LAPROX_VLLM_TARGET=f"unix:{socket}",
                                                LAPROX_VLLM_MODE="mask"))
        check(result["ids"] == down_ids and result["failures"] >= 1
              and len(result["warnings"]) == 1,
              f"masked decode failing in every step: the engine went on with the full cache "
              f"(the same tokens as with laproxd down: {result['ids'] == down_ids}), "
              f"{result['failures']} sequences counted, warning {result['warnings'][:1]}")

        late_socket = os.path.join(tmp, "late.sock")
        result = run_child("late", args, dict(base, LAPROX_VLLM_TARGET=f"unix:{late_socket}"))
        check(result["tokens"] == [8] * (5 * PROMPTS) and all(p >= PROMPTS for p in
                                                               result["phases"]),
              f"laproxd started after vLLM, then restarted: plans made per phase "
              f"{result['phases']} (at least {PROMPTS} each: registered again), "
              f"{result['failures']} sequences without a plan, every request served")

        result = run_child("refused", args, dict(
            base, LAPROX_VLLM_TARGET=f"unix:{socket}",
            LAPROX_VLLM_POLICY=json.dumps({"pool_kernel": -3})))
        check(result["tokens"] == [8] * PROMPTS and result["plans"] == 0
              and result["failures"] >= 1,
              f"refused plans: {result['tokens']} tokens, {result['plans']} plans, "
              f"{result['failures']} failures counted, warnings {result['warnings'][:1]}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
