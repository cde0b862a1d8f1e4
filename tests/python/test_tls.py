"""laproxd's TCP port (--listen) over real TLS on 127.0.0.1, with a CA and certificates made by
Debian's openssl at test time: a client that trusts the CA is served, a plaintext client or one
trusting another CA is not; with --tls_client_ca_file a client needs a certificate the CA
signed; plaintext is refused on a non-loopback address unless --allow_insecure_tcp.

Run:    /usr/bin/python3 tests/python/run_tests.py --laproxd build/service/laproxd -k Tls
"""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import support

support.prepare_package()

import grpc  # noqa: E402

import laprox  # noqa: E402


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
            "-subj", f"/CN={name}", cwd=directory)


def make_cert(directory, name, ca, extensions):
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
            cwd=directory)
    with open(os.path.join(directory, f"{name}.ext"), "w") as f:
        f.write(extensions + "\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
            cwd=directory)


@unittest.skipUnless(shutil.which("openssl"), "openssl is not installed")
class TlsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="laprox-tls-")
        make_ca(cls.dir, "ca")
        make_ca(cls.dir, "other-ca")
        make_cert(cls.dir, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                  "extendedKeyUsage=serverAuth")
        make_cert(cls.dir, "client", "ca", "extendedKeyUsage=clientAuth")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def serve(self, *flags):
        server = support.Laproxd("--listen=127.0.0.1:0", *flags)
        self.addCleanup(server.stop)
        port = re.search(r"tcp port (\d+) \((\w+)\)", server.log())
        self.assertIsNotNone(port, server.log())
        return f"127.0.0.1:{port.group(1)}", port.group(2)

    def info(self, target, credentials=None):
        with laprox.Client(target, timeout=5, credentials=credentials) as client:
            return client.info()

    def test_tls_serves_clients_that_trust_its_ca(self):
        target, kind = self.serve(f"--tls_cert_file={self.path('server.pem')}",
                                  f"--tls_key_file={self.path('server.key')}")
        self.assertEqual(kind, "TLS")
        info = self.info(target, laprox.tls_credentials(ca_file=self.path("ca.pem")))
        self.assertTrue(info.version)
        with self.assertRaises(laprox.LaproxError) as plaintext:
            self.info(target)
        self.assertEqual(plaintext.exception.code, grpc.StatusCode.UNAVAILABLE)
        with self.assertRaises(laprox.LaproxError) as untrusted:
            self.info(target, laprox.tls_credentials(ca_file=self.path("other-ca.pem")))
        self.assertEqual(untrusted.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_mutual_tls_needs_a_client_certificate_the_ca_signed(self):
        target, kind = self.serve(f"--tls_cert_file={self.path('server.pem')}",
                                  f"--tls_key_file={self.path('server.key')}",
                                  f"--tls_client_ca_file={self.path('ca.pem')}")
        self.assertEqual(kind, "mTLS")
        with self.assertRaises(laprox.LaproxError):
            self.info(target, laprox.tls_credentials(ca_file=self.path("ca.pem")))
        # a certificate from another CA is refused too
        make_cert(self.dir, "stranger", "other-ca", "extendedKeyUsage=clientAuth")
        with self.assertRaises(laprox.LaproxError):
            self.info(target, laprox.tls_credentials(ca_file=self.path("ca.pem"),
                                                     cert_file=self.path("stranger.pem"),
                                                     key_file=self.path("stranger.key")))
        info = self.info(target, laprox.tls_credentials(ca_file=self.path("ca.pem"),
                                                        cert_file=self.path("client.pem"),
                                                        key_file=self.path("client.key")))
        self.assertTrue(info.version)

    def test_cpp_client_over_mutual_tls(self):
        """laprox-cli (the C++ client) with --tls_ca_file/--tls_cert_file/--tls_key_file."""
        cli = os.path.join(os.path.dirname(os.path.dirname(support.laproxd_path())), "client",
                           "laprox-cli")
        if not os.path.exists(cli):
            self.skipTest(f"{cli} is not built")
        target, _ = self.serve(f"--tls_cert_file={self.path('server.pem')}",
                               f"--tls_key_file={self.path('server.key')}",
                               f"--tls_client_ca_file={self.path('ca.pem')}")
        flags = [f"--target={target}", f"--tls_ca_file={self.path('ca.pem')}"]
        client_cert = [f"--tls_cert_file={self.path('client.pem')}",
                       f"--tls_key_file={self.path('client.key')}"]
        ok = subprocess.run([cli, "info", *flags, *client_cert], capture_output=True, text=True,
                            timeout=30)
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("laproxd", ok.stdout)
        refused = subprocess.run([cli, "info", *flags], capture_output=True, text=True,
                                 timeout=30)
        self.assertNotEqual(refused.returncode, 0)

    def test_plaintext_only_on_loopback_unless_allowed(self):
        _, kind = self.serve()
        self.assertEqual(kind, "plaintext")
        run = subprocess.run([support.laproxd_path(), "--socket=", "--metrics_listen=",
                              "--backend=cpu", "--listen=0.0.0.0:0"],
                             capture_output=True, text=True, timeout=30)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("--listen=0.0.0.0:0 is not a loopback address", run.stderr)
        server = support.Laproxd("--listen=0.0.0.0:0", "--allow_insecure_tcp")
        self.addCleanup(server.stop)
        self.assertIn("(plaintext)", server.log())

    def test_bad_tls_flags_are_refused_naming_them(self):
        cases = [
            ([f"--tls_cert_file={self.path('server.pem')}"], "go together"),
            ([f"--tls_client_ca_file={self.path('ca.pem')}"], "--tls_client_ca_file needs TLS"),
            ([f"--tls_cert_file={self.path('missing.pem')}",
              f"--tls_key_file={self.path('server.key')}"], "missing.pem cannot be read"),
            ([f"--tls_cert_file={self.path('server.ext')}",
              f"--tls_key_file={self.path('server.key')}"], "holds no PEM block"),
        ]
        for flags, message in cases:
            run = subprocess.run([support.laproxd_path(), "--socket=", "--metrics_listen=",
                                  "--backend=cpu", "--listen=127.0.0.1:0", *flags],
                                 capture_output=True, text=True, timeout=30)
            self.assertNotEqual(run.returncode, 0, flags)
            self.assertIn(message, run.stderr, flags)


if __name__ == "__main__":
    unittest.main()
