#!/usr/bin/python3
"""metrics_benchmark: what wide models cost laproxd's metrics (issue 34, rows 3 and 4), against
real laproxd binaries with the Python client and a real HTTP scrape.

  scrape      register MODELS models of 128 layers x 128 KV heads (d = 1), one plan each, then
              GET /metrics: body bytes, series lines and seconds (median of 5 scrapes).
  unregister  a 256 x 256 model after one plan: seconds UnregisterModel takes, while another
              client's RegisterModel runs beside it.

    /usr/bin/python3 bench/metrics_benchmark.py [--models 1,16,64] NAME=PATH/TO/laproxd ...

Results go to stdout; bench/RESULTS.md ("Metrics at the cap") has the runs.
"""

import argparse
import os
import re
import statistics
import sys
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
import support  # noqa: E402

support.prepare_package()

import laprox  # noqa: E402


def wide_model(client, name, layers, heads):
    o_proj = np.full((layers, 1, heads), 0.5, np.float32)
    return client.register_model(name, laprox.ModelGeometry(num_layers=layers, num_heads=heads,
                                                            num_kv_heads=heads, head_dim=1,
                                                            hidden_size=1), o_proj)


def wide_plan(client, model, layers, heads, n=4, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((layers, heads, n, 1)).astype(np.float32)
    values = rng.standard_normal((layers, heads, n, 1)).astype(np.float32)
    queries = rng.standard_normal((layers, heads, 1, 1)).astype(np.float32)
    return client.compute_keep_plan(model, keys, values, window_queries=queries, budget=2,
                                    policy=dict(window=1))


def scrape(port):
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600) as r:
        body = r.read()
    return time.monotonic() - t0, body


def metrics_port(server):
    m = re.search(r"metrics on http port (\d+)", server.log())
    return int(m.group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="1,16,64")
    parser.add_argument("servers", nargs="+")
    args = parser.parse_args()
    for spec in args.servers:
        name, path = spec.split("=", 1)
        os.environ["LAPROXD"] = os.path.abspath(path)
        for count in (int(c) for c in args.models.split(",")):
            server = support.Laproxd("--metrics_listen=127.0.0.1:0", "--max_models=100")
            try:
                client = laprox.Client(server.target, timeout=600)
                for i in range(count):
                    model = wide_model(client, f"wide{i}", 128, 128)
                    wide_plan(client, model, 128, 128, seed=i)
                port = metrics_port(server)
                times, body = [], b""
                for _ in range(5):
                    seconds, body = scrape(port)
                    times.append(seconds)
                lines = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
                print(f"{name}: {count} models of 128 x 128: scrape {len(body) / 1e6:.2f} MB, "
                      f"{lines} series lines, {statistics.median(times) * 1e3:.0f} ms "
                      f"(median of 5)", flush=True)
            finally:
                server.stop()
        server = support.Laproxd("--metrics_listen=127.0.0.1:0")
        try:
            client = laprox.Client(server.target, timeout=600)
            other = laprox.Client(server.target, timeout=600)
            model = wide_model(client, "wide", 256, 256)
            wide_plan(client, model, 256, 256)
            beside = {}

            def register():
                t0 = time.monotonic()
                wide_model(other, "beside", 2, 2)
                beside["seconds"] = time.monotonic() - t0

            t0 = time.monotonic()
            thread = threading.Thread(target=register)
            thread.start()
            client.unregister_model(model)
            seconds = time.monotonic() - t0
            thread.join()
            print(f"{name}: UnregisterModel of a 256 x 256 model after a plan: {seconds * 1e3:.1f} ms; "
                  f"another client's RegisterModel beside it: {beside['seconds'] * 1e3:.1f} ms",
                  flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
