#!/usr/bin/env python3
"""Starts the built laproxd the way deploy/ configures it and asks its health services.

Run (scripts/check-deploy.sh does; Debian's python3 with python3-yaml and python3-grpcio):

    /usr/bin/python3 tests/deploy/check_health.py [--laproxd B] [--laprox-cli B] CONFIG...

Each CONFIG is an env file (LAPROXD_<FLAG>=value lines) or a rendered YAML file whose
ConfigMap laproxd-flags* holds the variables. For each, laproxd runs with exactly those
variables in its environment (no flags on the command line), except that the socket moves to
a temporary directory, metrics are off and the health port is 127.0.0.1:0: the test is
hermetic (no fixed ports) and needs no GPU. Then:
  - laproxd accepts every value (it exits 1 on a value a flag does not take);
  - grpc.health.v1 on the Unix socket and on the health port: service "" is SERVING;
    "laprox.v1.Laprox" is NOT_SERVING (no model registered), which is what keeps the pod's
    readiness probe from passing before the engine registered its model;
  - the health port serves nothing but health (GetServerInfo and grpc.reflection there are
    UNIMPLEMENTED);
  - `laprox-cli health --target=unix:SOCKET` (the image HEALTHCHECK) exits 0, and non-zero
    once laproxd stopped, when laprox-cli has the health command;
  - SIGTERM stops laproxd with exit status 0.
Extend it by adding a step to check_config(); each failure is printed and the exit status is 1.
"""

import argparse
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import yaml

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING, NOT_SERVING = 1, 2
READINESS_SERVICE = "laprox.v1.Laprox"
# Called with one empty message: a served method answers (reflection: an error message in an
# OK stream), one that is not there UNIMPLEMENTED.
NOT_ON_THE_HEALTH_PORT = ("/laprox.v1.Laprox/GetServerInfo",
                          "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                          "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
START_TIMEOUT_S = 20


def read_config(path):
    """Returns the LAPROXD_* variables of an env file or of a rendered laproxd-flags ConfigMap."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    if path.endswith((".yaml", ".yml")):
        for document in yaml.safe_load_all(text):
            if (isinstance(document, dict) and document.get("kind") == "ConfigMap" and
                    document["metadata"]["name"].startswith("laproxd-flags")):
                return {k: str(v) for k, v in document.get("data", {}).items()}
        raise ValueError(f"{path}: no ConfigMap laproxd-flags")
    variables = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            variables[name] = value
    return variables


def encode_request(service):
    # grpc.health.v1.HealthCheckRequest: field 1 (string service).
    data = service.encode()
    return b"\x0a" + bytes([len(data)]) + data if data else b""


def decode_status(response):
    # grpc.health.v1.HealthCheckResponse: field 1 (enum status); absent means UNKNOWN (0).
    return response[1] if len(response) >= 2 and response[0] == 0x08 else 0


def health(target, service):
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary(HEALTH_CHECK)
        return decode_status(check(encode_request(service), timeout=5))


def call_code(target, method):
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(method)(b"", timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()


def cli_has_health(laprox_cli):
    result = subprocess.run([laprox_cli, "--helpfull"], capture_output=True, text=True)
    usage = (result.stdout + result.stderr).splitlines()[0]
    return re.search(r"\bhealth\b", usage) is not None


def wait_for_start(process):
    """Reads laproxd's stdout up to its `listening on` line; returns that line."""
    deadline = time.monotonic() + START_TIMEOUT_S
    output = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = process.stdout.readline()
        if not line:
            break
        output += line
        if "listening on" in line:
            return line
    try:
        code = process.wait(timeout=5)
        errors = process.stderr.read()
    except subprocess.TimeoutExpired:
        code, errors = "none yet", ""
    raise RuntimeError(f"laproxd did not start (exit status {code}): {output}{errors}".strip())


def check_config(name, variables, laproxd, laprox_cli, with_cli, fail):
    with tempfile.TemporaryDirectory(prefix="laprox-deploy-") as directory:
        socket = os.path.join(directory, "laproxd.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAPROXD_")}
        env.update(variables)
        env.update(LAPROXD_SOCKET=socket, LAPROXD_METRICS_LISTEN="",
                   LAPROXD_HEALTH_LISTEN="127.0.0.1:0", LAPROXD_LISTEN="")
        process = subprocess.Popen([laproxd], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        started = False
        try:
            line = wait_for_start(process)
            started = True
            port = re.search(r"health on tcp port (\d+)", line)
            if port is None:
                fail(name, f"laproxd printed no health port: {line.strip()}")
                return
            unix, tcp = f"unix:{socket}", f"127.0.0.1:{port.group(1)}"
            for target in (unix, tcp):
                if (status := health(target, "")) != SERVING:
                    fail(name, f"{target}: liveness (service \"\") is {status}, not SERVING")
                if (status := health(target, READINESS_SERVICE)) != NOT_SERVING:
                    fail(name, f"{target}: readiness without a model is {status}, "
                         "not NOT_SERVING")
            for method in NOT_ON_THE_HEALTH_PORT:
                code = call_code(tcp, method)
                if code != grpc.StatusCode.UNIMPLEMENTED:
                    fail(name, f"the health port answers {method} with {code}, "
                         "not UNIMPLEMENTED")
            if with_cli:
                cli = subprocess.run([laprox_cli, "health", f"--target={unix}"],
                                     capture_output=True, text=True, timeout=30)
                if cli.returncode != 0:
                    fail(name, f"laprox-cli health exits {cli.returncode} while SERVING: "
                         f"{cli.stdout}{cli.stderr}")
        except RuntimeError as error:
            fail(name, str(error))
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
                fail(name, "laproxd did not stop within 30 s of SIGTERM")
        if code != 0 and started:
            fail(name, f"laproxd exited {code} after SIGTERM")
        if with_cli:
            cli = subprocess.run([laprox_cli, "health", f"--target=unix:{socket}"],
                                 capture_output=True, text=True, timeout=60)
            if cli.returncode == 0:
                fail(name, "laprox-cli health exits 0 with laproxd stopped")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--laproxd", default="build/service/laproxd")
    parser.add_argument("--laprox-cli", default="build/client/laprox-cli")
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()

    problems = []
    with_cli = cli_has_health(args.laprox_cli)
    for config in args.configs:
        check_config(config, read_config(config), args.laproxd, args.laprox_cli, with_cli,
                     lambda where, message: problems.append(f"{where}: {message}"))
    if problems:
        print("\n".join(f"check_health: FAIL {p}" for p in problems), file=sys.stderr)
        return 1
    cli_note = ("laprox-cli health (the HEALTHCHECK) agrees" if with_cli else
                "laprox-cli has no health command yet: the image HEALTHCHECK is untested")
    print(f"check_health: {len(args.configs)} configurations start; liveness SERVING, "
          f"readiness NOT_SERVING without a model, health port serves only health; {cli_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
