#!/usr/bin/python3
"""stall_benchmark: what a heavy client costs everyone else (issue 34), against real laproxd
binaries over a Unix socket, with the Python client. Three measurements per binary:

  after-deadline  a legal heavy plan (32 layers x 2 KV heads, d = 8, 131072 tokens, a 4096-row
                  window: ~27 s of two cores) with a deadline of 100, 200 or 500 ms; laproxd's
                  CPU time (utime + stime, /proc) from the DEADLINE_EXCEEDED reply until it stops
                  growing (no 2 ms gained in 100 ms; at most 60 s).
  small-latency   while two attacker threads each send the heavy plan with a 1 s deadline, again
                  as soon as it ends, another client sends small plans (3 layers x 2 KV heads,
                  d = 16, n = 300) one after another with a 5 s deadline: latency p50 / p99 and
                  the calls that failed (deadline missed, or refused: the queue was full).
  shutdown        SIGTERM with --shutdown_timeout=2s while the heavy plan computes: seconds to
                  exit, exit status, whether the socket and its lock file are left.

    /usr/bin/python3 bench/stall_benchmark.py NAME=PATH/TO/laproxd[:EXTRA,FLAGS] ...

e.g.  before=/work/old/build/service/laproxd  after=build/service/laproxd
      one-queue=build/service/laproxd:--heavy_request_work=9223372036854775807
Every server runs with --workers=2 --threads=2 (laproxd's defaults). Results go to stdout as a
table; bench/RESULTS.md ("Stalls") has the runs.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
import support  # noqa: E402

support.prepare_package()

import laprox  # noqa: E402

L, HKV, D, N, W = 32, 2, 8, 131072, 4096
SMALL = dict(L=3, H=6, Hkv=2, d=16, D=48)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Heavy:
    """The heavy plan's inputs in shared memory and its model, on one client."""

    def __init__(self, client):
        self.client = client
        rng = np.random.default_rng(34)
        self.arrays = [client.shared_array(s, "f32") for s in
                       ((HKV, N, D), (HKV, N, D), (HKV, W, D))]
        for a in self.arrays:
            a.array[...] = rng.standard_normal(a.array.shape, dtype=np.float32)
        o_proj = np.full((L, D, HKV * D), 0.25, np.float32)
        self.model = client.register_model(
            "heavy", laprox.ModelGeometry(num_layers=L, num_heads=HKV, num_kv_heads=HKV,
                                          head_dim=D, hidden_size=D), o_proj)

    def plan(self, timeout):
        keys, values, queries = self.arrays
        return self.client.compute_keep_plan(self.model, [keys] * L, [values] * L,
                                             window_queries=[queries] * L, budget=8192,
                                             policy=dict(window=W), timeout=timeout)


class Small:
    def __init__(self, client):
        self.client = client
        case = support.make_case(n=300, wq=32, geometry=SMALL)
        g = SMALL
        self.model = client.register_model(
            "small", laprox.ModelGeometry(num_layers=g["L"], num_heads=g["H"],
                                          num_kv_heads=g["Hkv"], head_dim=g["d"],
                                          hidden_size=g["D"]), case["o_proj"])
        self.case = case

    def plan(self, timeout):
        c = self.case
        return self.client.compute_keep_plan(self.model, c["keys"], c["values"],
                                             window_queries=c["queries"], budget=64,
                                             timeout=timeout)


def after_deadline(server, heavy, deadline_s, trials):
    pid = server.process.pid
    out = []
    for _ in range(trials):
        try:
            heavy.plan(timeout=deadline_s)
            raise RuntimeError("the heavy plan finished within its deadline")
        except laprox.LaproxError as e:
            if e.code.name != "DEADLINE_EXCEEDED":
                raise
        at_reply = cpu_seconds(pid)
        last, end = at_reply, time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.1)
            now = cpu_seconds(pid)
            if now - last < 0.002:
                break
            last = now
        out.append(last - at_reply)
    return out


def small_latency(server, small, calls):
    stop = threading.Event()
    # Two attackers, each a client of its own (a client stages one call at a time).
    heavies = [Heavy(laprox.Client(server.target, timeout=120)) for _ in range(2)]

    def attack(heavy):
        while not stop.is_set():
            try:
                heavy.plan(timeout=1)
            except laprox.LaproxError:
                pass

    attackers = [threading.Thread(target=attack, args=(h,)) for h in heavies]
    for a in attackers:
        a.start()
    time.sleep(2)  # a few deadlines have passed
    latencies, missed = [], 0
    for _ in range(calls):
        t0 = time.monotonic()
        try:
            small.plan(timeout=5)
        except laprox.LaproxError as e:
            if e.code.name not in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"):
                raise
            missed += 1
        latencies.append(time.monotonic() - t0)
    stop.set()
    for a in attackers:
        a.join()
    return latencies, missed


def shutdown(path, extra):
    server = support.Laproxd("--shutdown_timeout=2s", *extra)
    lock = server.socket + ".lock"
    client = laprox.Client(server.target, timeout=120)
    heavy = Heavy(client)
    caller = threading.Thread(target=lambda: _ignore(heavy.plan, 120))
    caller.start()
    pid = server.process.pid
    start = cpu_seconds(pid)
    while cpu_seconds(pid) - start < 1.0:
        time.sleep(0.05)
    t0 = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    rc = server.process.wait(timeout=60)
    elapsed = time.monotonic() - t0
    caller.join(timeout=60)
    left = [p for p in (server.socket, lock) if os.path.exists(p)]
    server.stop()
    return elapsed, rc, left


def _ignore(fn, *args):
    try:
        fn(*args)
    except laprox.LaproxError:
        pass


def main():
    for spec in sys.argv[1:]:
        name, rest = spec.split("=", 1)
        path, _, flags = rest.partition(":")
        extra = [f for f in flags.split(",") if f]
        os.environ["LAPROXD"] = os.path.abspath(path)
        server = support.Laproxd("--workers=2", *extra)
        try:
            client = laprox.Client(server.target, timeout=120)
            other = laprox.Client(server.target, timeout=120)
            heavy, small = Heavy(client), Small(other)
            small.plan(5)  # warm
            for deadline in (0.1, 0.2, 0.5):
                cpu = after_deadline(server, heavy, deadline, trials=2)
                print(f"{name}: CPU after a {deadline * 1000:.0f} ms deadline: "
                      f"{' / '.join(f'{c * 1000:.0f}' for c in cpu)} ms", flush=True)
            latencies, missed = small_latency(server, small, calls=40)
            q = np.percentile(np.array(latencies) * 1000, [50, 99])
            print(f"{name}: small plans beside heavy ones: p50 {q[0]:.0f} ms, p99 {q[1]:.0f} ms, "
                  f"{missed}/{len(latencies)} failed", flush=True)
        finally:
            server.stop()
        elapsed, rc, left = shutdown(path, ["--workers=2", *extra])
        print(f"{name}: SIGTERM (--shutdown_timeout=2s) with the heavy plan in flight: exit {rc} "
              f"after {elapsed:.2f} s, left behind: {', '.join(left) or 'nothing'}", flush=True)


if __name__ == "__main__":
    main()
