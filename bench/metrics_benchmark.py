#!/usr/bin/python3
"""metrics_benchmark: what wide models cost laproxd's metrics (issue 34, rows 3 and 4), against
real laproxd binaries with the Python client and a real HTTP scrape.

  ordinary    one model of Llama-3.1-8B's 32 layers x 8 KV heads (d = 1), one plan, then
              GET /metrics: body bytes, series lines and seconds (median of 5 scrapes).
  scrape      the same with MODELS models of 128 layers x 128 KV heads; --long-names gives
              them names of 128 characters (the longest laproxd accepts: the largest body).
  slow        with --slow-clients N, after the last scrape case: N clients send GET /metrics
              and never read (4 KiB receive buffers): laproxd's RSS, then how long a normal
              scrape and a RegisterModel take meanwhile.
  unregister  a 256 x 256 model after one plan: seconds UnregisterModel takes, while another
              client's RegisterModel runs beside it.

    /usr/bin/python3 bench/metrics_benchmark.py [--models 1,16,64] [--long-names] \
        [--slow-clients N] NAME=PATH/TO/laproxd[:--flag=value...] ...

Results go to stdout; bench/RESULTS.md ("Metrics at the cap") has the runs.
"""

import argparse
import os
import re
import socket
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


def measure(name, what, port):
    times, body = [], b""
    for _ in range(5):
        seconds, body = scrape(port)
        times.append(seconds)
    lines = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(f"{name}: {what}: scrape {len(body) / 1e6:.2f} MB, {lines} series lines, "
          f"{statistics.median(times) * 1e3:.0f} ms (median of 5)", flush=True)


def rss_mb(pid):
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def slow_clients(name, count, server, client, port):
    before = rss_mb(server.process.pid)
    clients = []
    for _ in range(count):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: laproxd\r\n\r\n")
        clients.append(s)
    try:
        time.sleep(5)  # let laproxd render what it will
        held = rss_mb(server.process.pid)
        t0 = time.monotonic()
        wide_model(client, "beside-slow", 2, 2)
        register = time.monotonic() - t0
        seconds, body = scrape(port)
        print(f"{name}: {count} clients that never read: RSS {before:.0f} -> {held:.0f} MB; "
              f"RegisterModel meanwhile {register * 1e3:.1f} ms; a normal scrape "
              f"{len(body) / 1e6:.2f} MB after {seconds:.1f} s", flush=True)
    finally:
        for s in clients:
            s.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="1,16,64")
    parser.add_argument("--long-names", action="store_true")
    parser.add_argument("--slow-clients", type=int, default=0)
    parser.add_argument("servers", nargs="+")
    args = parser.parse_args()
    for spec in args.servers:
        name, rest = spec.split("=", 1)
        path, *flags = rest.split(":")
        os.environ["LAPROXD"] = os.path.abspath(path)
        server = support.Laproxd("--metrics_listen=127.0.0.1:0", *flags)
        try:
            client = laprox.Client(server.target, timeout=600)
            model = wide_model(client, "llama-3.1-8b", 32, 8)
            wide_plan(client, model, 32, 8)
            measure(name, "1 model of 32 x 8", metrics_port(server))
        finally:
            server.stop()
        counts = [int(c) for c in args.models.split(",")]
        for count in counts:
            server = support.Laproxd("--metrics_listen=127.0.0.1:0", "--max_models=100", *flags)
            try:
                client = laprox.Client(server.target, timeout=600)
                for i in range(count):
                    label = f"{i:03d}" + "w" * 125 if args.long_names else f"wide{i}"
                    model = wide_model(client, label, 128, 128)
                    wide_plan(client, model, 128, 128, seed=i)
                measure(name, f"{count} models of 128 x 128"
                        + (" named with 128 characters" if args.long_names else ""),
                        metrics_port(server))
                if args.slow_clients and count == counts[-1]:
                    slow_clients(name, args.slow_clients, server, client, metrics_port(server))
            finally:
                server.stop()
        server = support.Laproxd("--metrics_listen=127.0.0.1:0", *flags)
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
