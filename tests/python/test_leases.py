"""What a client registers dies with it (issue 13, leases): a client process killed with SIGKILL
has its region and model reclaimed by laproxd within --lease_seconds, the shared-memory mapping
leaves laproxd's /proc/PID/maps, the freed --max_regions slot serves a new registration, the
reclaim is counted in the metrics, and a live client that stays idle past the lease keeps what
it registered.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Lease
"""

import os
import re
import subprocess
import sys
import time
import unittest
import urllib.request

import numpy as np

if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    # The client that will be killed: registers an object of its own and a model, says so,
    # and waits.
    sys.path.insert(0, sys.argv[3])
    import grpc
    from laprox._proto import laprox_pb2 as pb, laprox_pb2_grpc as pbg
    stub = pbg.LaproxStub(grpc.insecure_channel(sys.argv[2]))
    name = f"laprox-lease-child-{os.getpid()}"
    with open("/dev/shm/" + name, "wb") as f:
        f.write(bytes(1 << 20))
    region = stub.RegisterRegion(pb.RegisterRegionRequest(
        shm=pb.ShmRegion(name=name, byte_size=1 << 20))).region_id
    os.unlink("/dev/shm/" + name)          # only laproxd's mapping keeps it alive now
    eye = np.eye(2, dtype=np.float32)
    model = stub.RegisterModel(pb.RegisterModelRequest(
        name="doomed", geometry=pb.ModelGeometry(num_layers=1, num_heads=1, num_kv_heads=1,
                                                 head_dim=2, hidden_size=2, softmax_scale=0.7),
        o_proj=[pb.TensorRef(inline_bytes=eye.tobytes(), dtype=pb.DTYPE_F32, shape=[2, 2])]))
    print(f"ready {name} {region} {model.model_id}", flush=True)
    time.sleep(600)
    sys.exit(0)

import support  # noqa: E402

support.prepare_package()

import grpc  # noqa: E402

from laprox._proto import laprox_pb2 as pb, laprox_pb2_grpc as pbg  # noqa: E402

LEASE = 2


def mapped(pid, name):
    with open(f"/proc/{pid}/maps") as f:
        return name in f.read()


def metric(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class LeaseTest(unittest.TestCase):

    @support.timing  # reclaimed within the lease of wall-clock time
    def test_a_killed_client_is_reclaimed_and_a_live_idle_one_is_not(self):
        server = support.Laproxd(f"--lease_seconds={LEASE}", "--max_regions=2",
                                 "--metrics_listen=127.0.0.1:0")
        self.addCleanup(server.stop)
        stub = pbg.LaproxStub(grpc.insecure_channel(server.target))
        mine = f"laprox-lease-parent-{os.getpid()}"
        with open("/dev/shm/" + mine, "wb") as f:
            f.write(bytes(4096))
        self.addCleanup(os.unlink, "/dev/shm/" + mine)
        spec = pb.RegisterRegionRequest(shm=pb.ShmRegion(name=mine, byte_size=4096))
        kept = stub.RegisterRegion(spec).region_id

        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                  server.target, support.prepare_package()],
                                 stdout=subprocess.PIPE, text=True)
        self.addCleanup(child.stdout.close)
        self.addCleanup(child.wait)
        self.addCleanup(child.kill)
        line = child.stdout.readline().split()
        self.assertEqual(line[0], "ready", line)
        name, region = line[1], int(line[2])
        laproxd = server.process.pid
        self.assertTrue(mapped(laproxd, name))
        listed = [r.region_id for r in stub.ListRegions(pb.ListRegionsRequest()).regions]
        self.assertEqual(listed, [kept, region])        # one uid: both are visible to root
        # Full: the child's region holds the second slot.
        self.assertEqual(
            support_code(lambda: stub.RegisterRegion(spec)), grpc.StatusCode.RESOURCE_EXHAUSTED)

        child.kill()
        child.wait()
        killed = time.monotonic()
        while mapped(laproxd, name) and time.monotonic() - killed < LEASE + 3:
            time.sleep(0.05)
        elapsed = time.monotonic() - killed
        print(f"\nreclaimed {elapsed:.2f} s after SIGKILL", file=sys.stderr)
        self.assertFalse(mapped(laproxd, name), "the killed client's object is still mapped")
        self.assertLess(elapsed, LEASE)
        listed = [r.region_id for r in stub.ListRegions(pb.ListRegionsRequest()).regions]
        self.assertEqual(listed, [kept])
        second = stub.RegisterRegion(spec).region_id      # the freed slot serves a new client
        stub.UnregisterRegion(pb.UnregisterRegionRequest(region_id=second))

        port = re.search(r"metrics on http port (\d+)", server.log()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        self.assertEqual(metric(text, "laprox_reclaimed_regions_total"), 1)
        self.assertEqual(metric(text, "laprox_reclaimed_region_bytes_total"), 1 << 20)
        self.assertEqual(metric(text, "laprox_reclaimed_models_total"), 1)

        # This client stayed alive and idle for longer than the lease: nothing of it went.
        time.sleep(max(0.0, LEASE + 0.5 - (time.monotonic() - killed)))
        listed = [r.region_id for r in stub.ListRegions(pb.ListRegionsRequest()).regions]
        self.assertEqual(listed, [kept])


def support_code(fn):
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


if __name__ == "__main__":
    unittest.main()
