"""Shared set-up of the Python client tests: the laprox package with a freshly compiled
descriptor set, the real laproxd on a temporary Unix socket, random inputs and the float64
oracle.

The package is used from the source tree: client/python/laprox is copied into a temporary
directory and client/python/generate_stubs.py writes laprox/_gen there with the system protoc
(/usr/bin/protoc), so no PyPI package is needed. With
LAPROX_TEST_INSTALLED=1 the tests use whatever `laprox` is importable instead (e.g. a venv
where `pip install ./client/python` ran).
"""

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CLIENT_DIR = os.path.join(REPO, "client", "python")
sys.path.insert(0, os.path.join(REPO, "tests", "reference"))

import laprox_ref  # noqa: E402  (the float64 oracle)

_package_dir = None


def prepare_package():
    """Makes `import laprox` work (once per process); returns the directory put on sys.path."""
    global _package_dir
    if _package_dir is not None:
        return _package_dir
    if os.environ.get("LAPROX_TEST_INSTALLED") == "1":
        _package_dir = ""
        return _package_dir
    tmp = tempfile.mkdtemp(prefix="laprox-pytest-")
    atexit.register(shutil.rmtree, tmp, True)
    shutil.copytree(os.path.join(CLIENT_DIR, "laprox"), os.path.join(tmp, "laprox"),
                    ignore=shutil.ignore_patterns("_gen", "__pycache__"))
    subprocess.run([sys.executable, os.path.join(CLIENT_DIR, "generate_stubs.py"),
                    os.path.join(tmp, "laprox", "_gen"), "--protoc",
                    os.environ.get("LAPROX_TEST_PROTOC", "system")], check=True)
    sys.path.insert(0, tmp)
    _package_dir = tmp
    return tmp


def laproxd_path():
    path = os.environ.get("LAPROXD", os.path.join(REPO, "build", "service", "laproxd"))
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"laproxd not found at {path}: pass --laproxd or set LAPROXD")
    return path


class Laproxd:
    """The real laproxd binary on a temporary Unix socket (or `socket`), metrics off unless a
    flag says otherwise (a later flag wins)."""

    def __init__(self, *flags, socket=None):
        self.dir = tempfile.mkdtemp(prefix="laproxd-py-")
        self.socket = socket or os.path.join(self.dir, "laproxd.sock")
        self.target = "unix:" + self.socket
        self.log_path = os.path.join(self.dir, "log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [laproxd_path(), "--socket=" + self.socket, "--metrics_listen=",
                 "--backend=cpu", "--threads=2", *flags],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while "listening on" not in self.log():  # bounded wait for the server's own line
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("laproxd did not start:\n" + self.log())
            time.sleep(0.02)

    def log(self):
        with open(self.log_path) as fh:
            return fh.read()

    @contextlib.contextmanager
    def paused(self):
        """Within the block the server is stopped (SIGSTOP): its socket and connections stay
        open, calls wait unanswered until their deadline. SIGCONT when the block ends.

        A stop takes effect thread by thread, each when it next runs: on a loaded machine
        laproxd has answered a call 3 ms after kill() returned. The block begins once every
        thread of the process reads as stopped in /proc (or fails after 10 s)."""
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not self._stopped():
            if time.monotonic() > deadline:
                self.process.send_signal(signal.SIGCONT)
                raise RuntimeError(f"laproxd (pid {self.process.pid}) did not stop in 10 s")
            time.sleep(0.001)
        try:
            yield self
        finally:
            self.process.send_signal(signal.SIGCONT)

    def _stopped(self):
        """Whether every thread of the process is in state T (stopped) in /proc."""
        tasks = f"/proc/{self.process.pid}/task"
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "stat")) as fh:
                    # The state follows the command name's closing parenthesis.
                    if fh.read().rpartition(")")[2].split()[0] not in "tT":
                        return False
            except FileNotFoundError:  # a thread that ended
                continue
        return True

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def timing(test):
    """Marks a test whose assertion is a wall-clock bound (it can fail on a loaded machine
    without a bug): run_tests.py --timing=skip leaves it out, --timing=only runs only such
    tests (ctest's python_client and python_client_timing, the latter labelled timing)."""
    test.laprox_timing = True
    return test


def module_laproxd(namespace):
    """setUpModule and tearDownModule of a test module whose tests share one laproxd, as its
    global SERVER: `setUpModule, tearDownModule = support.module_laproxd(globals())`."""

    def set_up():
        namespace["SERVER"] = Laproxd()

    def tear_down():
        if namespace.get("SERVER") is not None:
            namespace["SERVER"].stop()

    return set_up, tear_down


def shm_names(prefix):
    """Names in /dev/shm starting with `prefix`."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))


# --- inputs and the oracle ----------------------------------------------------------------------

GEOMETRY = dict(L=3, H=4, Hkv=2, d=16, D=48)
SEED = 20260514


def make_case(n=256, wq=16, seed=SEED, geometry=GEOMETRY):
    """Random float32 inputs in the oracle's layout: geometry dict, o_proj [L, D, H*d],
    keys/values [L, Hkv, n, d], queries [L, H, wq, d]."""
    L, H, Hkv, d, D = (geometry[k] for k in ("L", "H", "Hkv", "d", "D"))
    rng = np.random.default_rng(seed)
    # Per-token value scales spread the scores apart (no near-ties at float32 precision).
    keys = rng.standard_normal((L, Hkv, n, d)).astype(np.float32)
    values = (rng.standard_normal((L, Hkv, n, d)) *
              rng.uniform(0.2, 3.0, (L, Hkv, n, 1))).astype(np.float32)
    queries = rng.standard_normal((L, H, wq, d)).astype(np.float32)
    o_proj = (rng.standard_normal((L, D, H * d)) / np.sqrt(D)).astype(np.float32)
    return dict(keys=keys, values=values, queries=queries, o_proj=o_proj, n=n)


def oracle(case, policy, keys=None, values=None, queries=None, o_proj=None):
    """laprox_ref.keep_plan on the case (tensors as float64; overrides for rounded inputs)."""
    g = GEOMETRY
    geometry = dict(g, scale=1.0 / np.sqrt(g["d"]))
    keys = case["keys"] if keys is None else keys
    values = case["values"] if values is None else values
    queries = case["queries"] if queries is None else queries
    o_proj = case["o_proj"] if o_proj is None else o_proj
    layers = [dict(keys=np.asarray(keys[l], np.float64), values=np.asarray(values[l], np.float64),
                   queries=np.asarray(queries[l], np.float64),
                   o_proj=np.asarray(o_proj[l], np.float64)) for l in range(g["L"])]
    return laprox_ref.keep_plan(geometry, policy, layers, case["n"])


def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def kept_differences(kept, ref, tie_rtol=1e-5):
    """Messages for kept-set differences beyond swaps among near-ties (oracle scores within
    tie_rtol); [] when the sets agree."""
    only_server = np.argwhere(kept & ~ref["kept"])
    only_ref = np.argwhere(ref["kept"] & ~kept)
    if not len(only_server) and not len(only_ref):
        return []
    if len(only_server) != len(only_ref):
        return [f"{len(only_server)} positions kept only by laproxd, {len(only_ref)} only by "
                f"the oracle (first: {only_server[:3].tolist()} / {only_ref[:3].tolist()})"]
    scores = ref["scores"]
    a = sorted(scores[tuple(i)] for i in only_server)
    b = sorted(scores[tuple(i)] for i in only_ref)
    for x, y in zip(a, b):
        if not (np.isfinite(x) and np.isfinite(y)) or \
                abs(x - y) > tie_rtol * max(abs(x), abs(y), 1e-300):
            return [f"kept sets differ beyond near-ties: scores {x:.9g} vs {y:.9g} "
                    f"(positions {only_server[:3].tolist()} / {only_ref[:3].tolist()})"]
    return []
