"""Clients of laproxd are isolated by uid (issue 13): a second local user, run with setpriv,
cannot list, use, write or unregister the first user's regions and models, cannot make laproxd
map a shared-memory object it does not own, and a user not in --allowed_uids/--allowed_gids is
refused outright. --shared_models lets the second user compute with the first one's model, but
not unregister it.

Needs root (to run the second client as uid 65534 and 65533 with setpriv); skipped otherwise.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Isolation
"""

import json
import os
import re
import shutil
import subprocess
import sys
import unittest
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOWED_UID = 65534   # nobody: let in with --allowed_uids
REFUSED_UID = 65533   # not let in

GEOMETRY = dict(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, hidden_size=2,
                softmax_scale=0.7)
N, WQ = 16, 4


def requests():
    """The proto modules of the laprox package (importable by root and by the child)."""
    from laprox._proto import laprox_pb2, laprox_pb2_grpc
    return laprox_pb2, laprox_pb2_grpc


def inline(pb, array):
    a = np.ascontiguousarray(array, np.float32)
    return pb.TensorRef(inline_bytes=a.tobytes(), dtype=pb.DTYPE_F32, shape=list(a.shape))


def in_region(pb, region_id, shape):
    return pb.TensorRef(region=pb.RegionSlice(region_id=region_id), dtype=pb.DTYPE_F32,
                        shape=list(shape))


def register_model(pb, stub, name):
    return stub.RegisterModel(pb.RegisterModelRequest(
        name=name, geometry=pb.ModelGeometry(**GEOMETRY),
        o_proj=[inline(pb, np.eye(2))])).model_id


def keep_plan(pb, stub, model_id, keys=None, destination=None, decode=False):
    """A keep-plan call of one layer; `decode`: a decode re-plan of N entries at positions
    100 .. 100 + N - 1 (it holds no session: the model and regions it names are what
    isolates it)."""
    rng = np.random.default_rng(3)
    layer = pb.LayerInputs(
        keys=keys if keys is not None else inline(pb, rng.standard_normal((1, N, 2))),
        values=inline(pb, rng.standard_normal((1, N, 2))),
        window_queries=inline(pb, rng.standard_normal((1, WQ, 2))))
    outputs = pb.OutputOptions()
    if destination is not None:
        outputs.destination.CopyFrom(pb.OutputDestination(region_id=destination, counts_offset=0))
    cache = pb.DecodeCache(layers=[pb.DecodeCacheLayer(entries=N, positions=range(100, 100 + N))])
    return stub.ComputeKeepMask(pb.ComputeKeepMaskRequest(
        model_id=model_id, n=N, layers=[layer], policy=pb.Policy(window=WQ),
        budget=pb.Budget(tokens_per_head=8), outputs=outputs, cache=cache if decode else None))


def make_shm(name, mode):
    path = "/dev/shm/" + name
    with open(path, "wb") as f:
        f.write(np.random.default_rng(1).standard_normal(1024).astype(np.float32).tobytes())
    os.chmod(path, mode)
    return path


def code_of(fn):
    import grpc
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def child(target, first):
    """What the second user tries, as a dict of attempt -> status code name."""
    import grpc
    pb, pbg = requests()
    stub = pbg.LaproxStub(grpc.insecure_channel(target))
    out = {"info": code_of(lambda: stub.GetServerInfo(pb.GetServerInfoRequest()))}
    if out["info"] != "OK":
        out["list"] = code_of(lambda: stub.ListRegions(pb.ListRegionsRequest()))
        return out
    out["listed"] = [r.region_id for r in stub.ListRegions(pb.ListRegionsRequest()).regions]
    out["use_model"] = code_of(lambda: keep_plan(pb, stub, first["model"]))
    out["decode_use_model"] = code_of(lambda: keep_plan(pb, stub, first["model"], decode=True))
    own_model = register_model(pb, stub, "second")
    out["own_model"] = code_of(lambda: keep_plan(pb, stub, own_model))
    out["decode_own_model"] = code_of(lambda: keep_plan(pb, stub, own_model, decode=True))
    out["decode_read_region"] = code_of(lambda: keep_plan(
        pb, stub, own_model, keys=in_region(pb, first["region"], (1, N, 2)), decode=True))
    out["read_region"] = code_of(lambda: keep_plan(
        pb, stub, own_model, keys=in_region(pb, first["region"], (1, N, 2))))
    out["write_region"] = code_of(lambda: keep_plan(pb, stub, own_model,
                                                    destination=first["region"]))
    out["unregister_region"] = code_of(lambda: stub.UnregisterRegion(
        pb.UnregisterRegionRequest(region_id=first["region"])))
    out["unregister_model"] = code_of(lambda: stub.UnregisterModel(
        pb.UnregisterModelRequest(model_id=first["model"])))
    for writable in (False, True):
        out[f"map_foreign_{writable}"] = code_of(lambda: stub.RegisterRegion(
            pb.RegisterRegionRequest(shm=pb.ShmRegion(name=first["shm"], byte_size=4096),
                                     writable=writable)))
    mine = f"laprox-iso-second-{os.getpid()}"
    make_shm(mine, 0o600)
    read_only = f"laprox-iso-second-ro-{os.getpid()}"
    make_shm(read_only, 0o400)
    try:
        own = stub.RegisterRegion(pb.RegisterRegionRequest(
            shm=pb.ShmRegion(name=mine, byte_size=4096), writable=True)).region_id
        out["own_region_listed"] = [r.region_id for r in stub.ListRegions(
            pb.ListRegionsRequest()).regions] == [own]
        out["own_read_only_writable"] = code_of(lambda: stub.RegisterRegion(
            pb.RegisterRegionRequest(shm=pb.ShmRegion(name=read_only, byte_size=4096),
                                     writable=True)))
        out["write_own_region"] = code_of(lambda: keep_plan(pb, stub, own_model,
                                                            destination=own))
    finally:
        os.unlink("/dev/shm/" + mine)
        os.unlink("/dev/shm/" + read_only)
    return out


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    sys.path.insert(0, os.environ["LAPROX_PACKAGE_DIR"])
    print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))))
    sys.exit(0)

import support  # noqa: E402

support.prepare_package()

import grpc  # noqa: E402


def open_to_others(top):
    """Lets the second user read the package and reach the socket (the test's temp dirs are
    0700)."""
    for root, dirs, files in os.walk(top):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


@unittest.skipUnless(os.geteuid() == 0 and shutil.which("setpriv"),
                     "needs root and setpriv to run a second client under another uid")
class IsolationTest(unittest.TestCase):

    def setUp(self):
        self.pb, pbg = requests()
        open_to_others(support.prepare_package())
        self.shm = f"laprox-iso-first-{os.getpid()}"
        make_shm(self.shm, 0o600)                       # root's, private
        self.addCleanup(os.unlink, "/dev/shm/" + self.shm)
        self.pbg = pbg

    def serve(self, *flags):
        server = support.Laproxd("--socket_mode=0666", f"--allowed_uids={ALLOWED_UID}", *flags)
        self.addCleanup(server.stop)
        os.chmod(server.dir, 0o755)
        stub = self.pbg.LaproxStub(grpc.insecure_channel(server.target))
        pb = self.pb
        region = stub.RegisterRegion(pb.RegisterRegionRequest(
            shm=pb.ShmRegion(name=self.shm, byte_size=4096), writable=True)).region_id
        model = register_model(pb, stub, "first")
        return server, stub, dict(region=region, model=model, shm=self.shm)

    def as_user(self, uid, server, first):
        result = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
             os.path.abspath(__file__), "--child", server.target, json.dumps(first)],
            env=dict(os.environ, LAPROX_PACKAGE_DIR=support.prepare_package()),
            capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)

    def test_a_second_user_cannot_touch_the_first_ones_regions_and_models(self):
        server, stub, first = self.serve()
        seen = self.as_user(ALLOWED_UID, server, first)
        self.assertEqual(seen["info"], "OK")
        self.assertEqual(seen["listed"], [])
        for attempt in ("use_model", "read_region", "write_region", "unregister_region",
                        "unregister_model", "decode_use_model", "decode_read_region"):
            self.assertEqual(seen[attempt], "NOT_FOUND", attempt)
        self.assertEqual(seen["decode_own_model"], "OK")
        self.assertEqual(seen["map_foreign_False"], "PERMISSION_DENIED")
        self.assertEqual(seen["map_foreign_True"], "PERMISSION_DENIED")
        self.assertEqual(seen["own_model"], "OK")
        self.assertTrue(seen["own_region_listed"])
        self.assertEqual(seen["own_read_only_writable"], "PERMISSION_DENIED")
        self.assertEqual(seen["write_own_region"], "OK")
        # The first user's region and model are intact, and only its own are listed to it.
        pb = self.pb
        self.assertEqual([r.region_id for r in stub.ListRegions(pb.ListRegionsRequest()).regions],
                         [first["region"]])
        plan = keep_plan(pb, stub, first["model"], destination=first["region"])
        self.assertEqual(plan.n, N)

    def test_a_user_not_allowed_is_refused_and_counted(self):
        server, _, first = self.serve("--metrics_listen=127.0.0.1:0")
        seen = self.as_user(REFUSED_UID, server, first)
        self.assertEqual(seen, {"info": "PERMISSION_DENIED", "list": "PERMISSION_DENIED"})
        port = re.search(r"metrics on http port (\d+)", server.log()).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        self.assertIn("\nlaprox_denied_calls_total 2\n", text)

    def test_shared_models_are_usable_but_not_removable_by_others(self):
        server, stub, first = self.serve("--shared_models")
        seen = self.as_user(ALLOWED_UID, server, first)
        self.assertEqual(seen["use_model"], "OK")
        self.assertEqual(seen["unregister_model"], "NOT_FOUND")
        self.assertEqual(seen["read_region"], "NOT_FOUND")     # regions stay private


if __name__ == "__main__":
    unittest.main()
