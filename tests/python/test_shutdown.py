"""SIGTERM keeps --shutdown_timeout, whatever is computing (issue 34, row 5): laproxd exits 0
within the timeout and a little more, removes its socket and the socket's lock file, and the
in-flight call gets an error instead of a plan. Before (main at 3c17d78): with a ~40 s plan in
flight and --shutdown_timeout=2s, exit status 1 after 12 s, the socket left behind; the lock
file was left behind on every exit, clean ones too.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Shutdown
"""

import os
import signal
import threading
import time
import unittest

import numpy as np

import support

support.prepare_package()

import grpc  # noqa: E402

import laprox  # noqa: E402

# A legal heavy plan: 32 layers x 2 KV heads (d = 8) reading the same keys and values, 131072
# tokens, a 4096-row window: about 27 s of two cores (tests/service/stall_test.cc).
L, HKV, D, N, W = 32, 2, 8, 131072, 4096


def cpu_seconds(pid):
    """User + system CPU time of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ShutdownTest(unittest.TestCase):
    @support.timing  # stops within the shutdown timeout plus 2 s of wall-clock time
    def test_sigterm_with_a_heavy_plan_in_flight_keeps_the_shutdown_timeout(self):
        server = support.Laproxd("--shutdown_timeout=2s", "--workers=1")
        lock = server.socket + ".lock"
        try:
            self.assertTrue(os.path.exists(lock))
            client = laprox.Client(server.target, timeout=120)
            rng = np.random.default_rng(34)
            keys = client.shared_array((HKV, N, D), "f32")
            values = client.shared_array((HKV, N, D), "f32")
            queries = client.shared_array((HKV, W, D), "f32")
            for a in (keys, values, queries):
                a.array[...] = rng.standard_normal(a.array.shape, dtype=np.float32)
            o_proj = np.full((L, D, HKV * D), 0.25, np.float32)
            model = client.register_model(
                "heavy", laprox.ModelGeometry(num_layers=L, num_heads=HKV, num_kv_heads=HKV,
                                              head_dim=D, hidden_size=D), o_proj)
            outcome = {}

            def plan():
                try:
                    outcome["plan"] = client.compute_keep_plan(
                        model, [keys] * L, [values] * L, window_queries=[queries] * L,
                        budget=8192, policy=dict(window=W))
                except laprox.LaproxError as e:
                    outcome["error"] = e.code

            caller = threading.Thread(target=plan)
            caller.start()
            # The plan is computing once laproxd has burnt a second of CPU on it.
            pid = server.process.pid
            start = cpu_seconds(pid)
            deadline = time.monotonic() + 60
            while cpu_seconds(pid) - start < 1.0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertTrue(caller.is_alive(), "the heavy plan ended before SIGTERM")
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            rc = server.process.wait(timeout=30)
            elapsed = time.monotonic() - signalled
            caller.join(timeout=30)
            self.assertEqual(rc, 0, server.log())
            self.assertLess(elapsed, 2.0 + 2.0, server.log())  # the timeout, then a prompt stop
            self.assertNotIn("plan", outcome)
            self.assertIn(outcome.get("error"),
                          (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE))
            self.assertFalse(os.path.exists(server.socket), "the socket was left behind")
            self.assertFalse(os.path.exists(lock), "the lock file was left behind")
            print(f"\nSIGTERM with a heavy plan in flight: exit {rc} after {elapsed:.2f} s "
                  f"(--shutdown_timeout=2s)")
        finally:
            server.stop()

    def test_clean_exit_removes_the_socket_and_its_lock_file(self):
        server = support.Laproxd()
        lock = server.socket + ".lock"
        try:
            with laprox.Client(server.target) as client:
                client.info()
            self.assertTrue(os.path.exists(lock))
            server.process.send_signal(signal.SIGTERM)
            self.assertEqual(server.process.wait(timeout=30), 0, server.log())
            self.assertFalse(os.path.exists(server.socket))
            self.assertFalse(os.path.exists(lock))
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
