"""One rule for where laproxd listens by default (proto/endpoint/laprox/v1/endpoint.h), checked on the
three programs that apply it: laproxd --socket=auto, laprox-cli (the C++ client's
DefaultTarget(), its --target default) and the Python client's default_target(). For each
environment the three must name the same socket, the one the rule gives; where laproxd can start
there, both clients reach it without being told where.

The rule differs for root and for other users, so as root the cases run twice: as root, and as
the user nobody (uid 65534) through setpriv(1) (util-linux, in every Debian). Not subprocess's
`user=`: that makes Python fork() this process, which holds gRPC threads from the earlier tests,
and gRPC 1.51's fork handlers (Debian 12's python3-grpcio) can then hang the fork or abort the
process (an abort in gRPC's thread pool failed CI once; 2 hangs in 5 runs of 300 such forks beside
two threads making calls, none in 3 runs of 1000 through setpriv). As another user they run once,
as that user. The C++ side needs laprox-cli: $LAPROX_CLI, else build/client/laprox-cli beside
build/service/laproxd.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import support

NOBODY = 65534


def cli_path():
    path = os.environ.get("LAPROX_CLI") or os.path.join(
        os.path.dirname(os.path.dirname(support.laproxd_path())), "client", "laprox-cli")
    return path if os.access(path, os.X_OK) else None


def expected(uid, xdg):
    """The rule, written out again here from endpoint.h (the three programs must agree with it,
    not only with each other)."""
    if uid != 0 and xdg is not None and xdg.startswith("/"):
        return xdg.rstrip("/") + "/laprox/laproxd.sock"
    return "/run/laprox/laproxd.sock"


class DefaultTargetContractTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.package = support.prepare_package()
        cls.cli = cli_path()
        if cls.cli is None:
            raise unittest.SkipTest("laprox-cli not built (set LAPROX_CLI)")
        cls.tmp = tempfile.mkdtemp(prefix="laprox-target-")
        os.chmod(cls.tmp, 0o755)  # nobody's XDG_RUNTIME_DIR lives below it
        if cls.package:  # the package's copy in a 0700 temporary directory: nobody imports it too
            os.chmod(cls.package, 0o755)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def users(self):
        """Who runs the cases: this user; as root, nobody too when nobody can run the binaries
        and import the package (a checkout under a private directory cannot)."""
        if os.geteuid() != 0:
            return [os.geteuid()]
        probe = self.run_as(NOBODY, [sys.executable, "-c", "import laprox"],
                            self.environment(NOBODY, None))
        for path in (support.laproxd_path(), self.cli):
            if probe.returncode != 0 or not os.access(path, os.X_OK) or self.run_as(
                    NOBODY, [path, "--help"], self.environment(NOBODY, None)).returncode not in (0, 1):
                print(f"\n{__name__}: nobody cannot run {path} or import laprox: root cases only",
                      file=sys.stderr)
                return [0]
        return [0, NOBODY]

    def environment(self, uid, xdg):
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        if xdg is not None:
            env["XDG_RUNTIME_DIR"] = xdg
        if self.package:
            env["PYTHONPATH"] = self.package
        return env

    @staticmethod
    def as_user(uid, argv):
        """argv run as uid (real and effective, groups unchanged, as `user=` would), by
        exec'ing setpriv: subprocess then starts it without running fork handlers here."""
        if uid == os.geteuid():
            return argv
        return ["setpriv", f"--reuid={uid}", "--", *argv]

    def run_as(self, uid, argv, env, **kwargs):
        return subprocess.run(self.as_user(uid, argv), env=env, capture_output=True, text=True,
                              timeout=60, **kwargs)

    def python_target(self, uid, env):
        out = self.run_as(uid, [sys.executable, "-c",
                                "from laprox.client import default_target; print(default_target())"],
                          env)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.strip()

    def cli_target(self, uid, env):
        out = self.run_as(uid, [self.cli, "--helpfull"], env)
        found = re.search(r'--target .*?default: "([^"]*)"', out.stdout + out.stderr, re.S)
        self.assertIsNotNone(found, out.stdout[-2000:])
        return found.group(1)

    def start_server(self, uid, env):
        """laproxd --socket=auto: (the socket it serves, the process) when it starts, or (the path
        its error names, None) when it cannot."""
        process = subprocess.Popen(
            self.as_user(uid, [support.laproxd_path(), "--socket=auto", "--metrics_listen=",
                               "--backend=cpu", "--lease_seconds=0"]),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = process.stdout.readline()  # the "listening on" line, or the error
        found = re.search(r"listening on unix:(\S+)", line)
        if found:
            return found.group(1), process
        process.wait(timeout=30)
        rest = line + process.stdout.read()
        process.stdout.close()
        found = re.search(r"--socket=auto is (\S+?):", rest)
        self.assertIsNotNone(found, f"laproxd neither started nor named its socket: {rest}")
        return found.group(1), None

    def stop(self, process):
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        process.stdout.close()

    def test_server_and_both_clients_resolve_alike(self):
        users = self.users()
        print(f"\n{__name__}: cases as uid {users}", file=sys.stderr)
        for uid in users:
            xdg_dir = os.path.join(self.tmp, f"run-{uid}")
            os.makedirs(xdg_dir, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(xdg_dir, uid, -1)
            os.chmod(xdg_dir, 0o700)
            cases = {"absolute": xdg_dir, "trailing slashes": xdg_dir + "//",
                     "relative": "run/user", "empty": "", "unset": None}
            for case, xdg in cases.items():
                with self.subTest(uid=uid, case=case):
                    env = self.environment(uid, xdg)
                    want = expected(uid, xdg)
                    self.assertEqual(self.python_target(uid, env), "unix:" + want)
                    self.assertEqual(self.cli_target(uid, env), "unix:" + want)
                    # As root, laproxd would create /run/laprox on this machine (and a laproxd
                    # of the machine may live there): not started then.
                    if uid == 0 and want.startswith("/run/laprox/"):
                        continue
                    socket, process = self.start_server(uid, env)
                    self.assertEqual(socket, want)
                    if process is None:
                        continue
                    try:
                        # Both clients find it without --target.
                        info = self.run_as(uid, [self.cli, "info"], env)
                        self.assertEqual(info.returncode, 0, info.stderr)
                        self.assertIn("laproxd", info.stdout)
                        out = self.run_as(uid, [sys.executable, "-c",
                                                "import laprox\n"
                                                "with laprox.Client() as c:\n"
                                                "    print(c.info().version)"], env)
                        self.assertEqual(out.returncode, 0, out.stderr)
                    finally:
                        self.stop(process)


if __name__ == "__main__":
    unittest.main()
