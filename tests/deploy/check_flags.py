#!/usr/bin/env python3
"""Checks that deploy/ uses only real laproxd and laprox-cli flags, and consistent ports.

Run (scripts/check-deploy.sh does, with the rendered overlays as extra files):

    /usr/bin/python3 tests/deploy/check_flags.py [--laproxd build/service/laproxd]
        [--laprox-cli build/client/laprox-cli] [--root .] [RENDERED.yaml ...]

The flags are read from the built programs' `--help` (absl format `--name (text); default: v;`),
falling back to `--helpfull` when `--help` lists none, so the test follows the code, not a copy.
What is checked, in every file under ROOT/deploy and in the extra files:
  - every LAPROXD_<NAME> (ConfigMap keys, env names, Dockerfile ENV, systemd Environment=) names
    a laproxd flag;
  - every --flag that follows `laproxd` or `laprox-cli` on a line, and every --flag in the
    command/args of a container named laproxd, is a flag of that program;
  - ports: metrics on 9464 and health on 9465 wherever they appear (--help default, LAPROXD_*
    values, container ports named metrics/health, gRPC probes, PodMonitor, Dockerfile EXPOSE);
  - the socket: LAPROXD_SOCKET and --target=unix:... name /run/laprox/laproxd.sock.
Extend it by adding a check function and calling it from main(). Exit status 1 lists every
problem found; it needs only the standard library and PyYAML (Debian's python3-yaml).
"""

import argparse
import pathlib
import re
import subprocess
import sys

import yaml

METRICS_PORT = 9464
HEALTH_PORT = 9465
SOCKET = "/run/laprox/laproxd.sock"
READINESS_SERVICE = "laprox.v1.Laprox"

FLAG_HELP = re.compile(r"--([A-Za-z0-9_]+) \((.*?)\);\s+default: (.*?);", re.S)
ENV_NAME = re.compile(r"\bLAPROXD_([A-Z0-9_]+)")
ENV_VALUE = re.compile(r"\bLAPROXD_([A-Z0-9_]+)\"?\s*[=:]\s*\"?([^\"\s,\\`]*)")
PROGRAM = re.compile(r"(?:^|(?<=[\s\"'\[/=]))(laproxd|laprox-cli)(?=[\s\"',]|$)")
CLI_FLAG = re.compile(r"(?<![\w-])--([A-Za-z][A-Za-z0-9_-]*)(?:=([^\s\"',\]]*))?")
COMMAND_END = re.compile(r"\||;|&&|\|\||#")
# absl's own flags, which --help does not list.
ABSL_BUILTIN = {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version",
                "only_check_args", "flagfile", "fromenv", "tryfromenv", "undefok"}


def read_flags(program):
    """Returns {flag: default} from `program --help` (or --helpfull when --help lists none)."""
    for option in ("--help", "--helpfull"):
        result = subprocess.run([program, option], capture_output=True, text=True, timeout=30)
        text = result.stdout + result.stderr
        flags = {m.group(1): m.group(3).strip().strip('"') for m in FLAG_HELP.finditer(text)}
        if flags:
            if option == "--helpfull":
                print(f"check_flags: {program} --help lists no flags; read --helpfull instead")
            return flags
    sys.exit(f"check_flags: {program} --help and --helpfull list no flags")


def is_flag(name, flags):
    # absl also takes --noNAME for booleans; accept it when NAME is a flag.
    return (name in flags or name in ABSL_BUILTIN or
            (name.startswith("no") and name[2:] in flags))


class Checker:
    def __init__(self, laproxd_flags, cli_flags):
        self.flags = {"laproxd": laproxd_flags, "laprox-cli": cli_flags}
        self.problems = []
        self.seen = {"env": 0, "cli": 0, "ports": 0}

    def fail(self, where, message):
        self.problems.append(f"{where}: {message}")

    # LAPROXD_* names and values, anywhere in the text.
    def check_env_names(self, where, text):
        for match in ENV_NAME.finditer(text):
            name = match.group(1).lower()
            self.seen["env"] += 1
            if not name:
                continue
            if name not in self.flags["laproxd"]:
                self.fail(where, f"LAPROXD_{match.group(1)} is not a laproxd flag (--{name})")
        for match in ENV_VALUE.finditer(text):
            self.check_value(where, match.group(1).lower(), match.group(2))

    def check_value(self, where, flag, value):
        if flag == "metrics_listen":
            self.check_port(where, f"{flag}={value}", value, METRICS_PORT)
        elif flag == "health_listen":
            self.check_port(where, f"{flag}={value}", value, HEALTH_PORT)
        elif flag == "socket" and value != SOCKET:
            self.fail(where, f"socket {value!r} is not {SOCKET} (the path the mounts share)")
        elif flag == "target" and value.startswith("unix:") and value != f"unix:{SOCKET}":
            self.fail(where, f"--target={value} is not unix:{SOCKET}")

    def check_port(self, where, what, address, expected):
        self.seen["ports"] += 1
        if address and not address.endswith(f":{expected}"):
            self.fail(where, f"{what}: port is not {expected}")

    # `laproxd --flag ...` and `laprox-cli cmd --flag ...` on one line.
    def check_command_lines(self, where, text):
        for number, line in enumerate(text.splitlines(), 1):
            for match in PROGRAM.finditer(line):
                program = match.group(1)
                rest = line[match.end():]
                end = COMMAND_END.search(rest)
                rest = rest[: end.start()] if end else rest
                following = PROGRAM.search(rest)  # the next program's flags are its own
                rest = rest[: following.start()] if following else rest
                for flag in CLI_FLAG.finditer(rest):
                    self.check_cli_flag(f"{where}:{number}", program, flag.group(1), flag.group(2))

    def check_cli_flag(self, where, program, name, value):
        self.seen["cli"] += 1
        if not is_flag(name, self.flags[program]):
            self.fail(where, f"--{name} is not a {program} flag")
        elif value is not None:
            self.check_value(where, name, value)

    # Kubernetes objects: containers, probes, PodMonitors.
    def check_yaml(self, where, text):
        try:
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as error:
            self.fail(where, f"not YAML: {error}")
            return
        for document in documents:
            for container in find_containers(document):
                if container.get("name") == "laproxd":
                    self.check_laproxd_container(where, container)
            if isinstance(document, dict) and document.get("kind") in ("PodMonitor",
                                                                       "ServiceMonitor"):
                for endpoint in (document.get("spec", {}).get("podMetricsEndpoints", []) +
                                 document.get("spec", {}).get("endpoints", [])):
                    if endpoint.get("port") != "metrics":
                        self.fail(where, f"{document['kind']} scrapes port "
                                  f"{endpoint.get('port')!r}, not the container port 'metrics'")

    def check_laproxd_container(self, where, container):
        where = f"{where} (container laproxd)"
        tokens = [str(t) for t in (container.get("command") or []) + (container.get("args") or [])]
        program = "laprox-cli" if tokens and tokens[0].endswith("laprox-cli") else "laproxd"
        for token in tokens:
            for flag in CLI_FLAG.finditer(token):
                if token.startswith("--"):
                    self.check_cli_flag(where, program, flag.group(1), flag.group(2))
        for env in container.get("env") or []:
            name = env.get("name", "")
            if name.startswith("LAPROXD_") and "value" in env:
                self.check_value(where, name[len("LAPROXD_"):].lower(), str(env["value"]))
        # A patch fragment (no image) may leave out ports and probes; a whole container may not.
        complete = "image" in container
        ports = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
        for name, expected in (("metrics", METRICS_PORT), ("health", HEALTH_PORT)):
            self.seen["ports"] += 1
            if (complete or name in ports) and ports.get(name) != expected:
                self.fail(where, f"container port {name!r} is {ports.get(name)}, not {expected}")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container.get(kind)
            if probe is None:
                if complete and kind != "startupProbe":
                    self.fail(where, f"no {kind}")
                continue
            grpc = probe.get("grpc")
            if grpc is None:
                self.fail(where, f"{kind} is not a gRPC probe")
                continue
            self.seen["ports"] += 1
            if grpc.get("port") not in (HEALTH_PORT, "health"):
                self.fail(where, f"{kind} probes port {grpc.get('port')}, not {HEALTH_PORT}")
            service = grpc.get("service") or ""
            expected = READINESS_SERVICE if kind == "readinessProbe" else ""
            if service != expected:
                self.fail(where, f"{kind} asks for service {service!r}, not {expected!r}")

    def check_dockerfile(self, where, text):
        exposed = set()
        for line in text.splitlines():
            if line.strip().upper().startswith("EXPOSE "):
                exposed.update(int(p.split("/")[0]) for p in line.split()[1:])
        if exposed != {METRICS_PORT, HEALTH_PORT}:
            self.fail(where, f"EXPOSE {sorted(exposed)}, not [{METRICS_PORT}, {HEALTH_PORT}]")

    def check_file(self, path, display):
        text = path.read_text(encoding="utf-8")
        self.check_env_names(display, text)
        self.check_command_lines(display, text)
        if path.suffix in (".yaml", ".yml"):
            self.check_yaml(display, text)
        if path.name.startswith("Dockerfile"):
            self.check_dockerfile(display, text)

    def check_help_defaults(self):
        flags = self.flags["laproxd"]
        for flag in ("socket", "metrics_listen", "health_listen", "backend"):
            if flag not in flags:
                self.fail("laproxd --help", f"no --{flag} (deploy/ relies on it)")
        if "metrics_listen" in flags:
            self.check_port("laproxd --help", "default --metrics_listen",
                            flags["metrics_listen"], METRICS_PORT)
        if "target" not in self.flags["laprox-cli"]:
            self.fail("laprox-cli --help", "no --target (the image HEALTHCHECK relies on it)")


def find_containers(node):
    """Yields every dict in a `containers` or `initContainers` list, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from find_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from find_containers(item)


TEXT_SUFFIXES = {".yaml", ".yml", ".md", ".env", ".service", ".sh", ".json", ".sysusers", ""}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--laproxd", default="build/service/laproxd")
    parser.add_argument("--laprox-cli", default="build/client/laprox-cli")
    parser.add_argument("--root", default=".", help="the tree whose deploy/ is checked")
    parser.add_argument("rendered", nargs="*", help="more YAML files (rendered overlays)")
    args = parser.parse_args()

    for program in (args.laproxd, args.laprox_cli):
        if not pathlib.Path(program).is_file():
            sys.exit(f"check_flags: {program} is missing: build first (scripts/test.sh)")
    checker = Checker(read_flags(args.laproxd), read_flags(args.laprox_cli))
    checker.check_help_defaults()

    root = pathlib.Path(args.root)
    files = sorted(p for p in (root / "deploy").rglob("*")
                   if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name.startswith("Dockerfile"))
                   and p.name != "laprox-dashboard.json")
    for path in files:
        checker.check_file(path, str(path.relative_to(root)))
    for rendered in args.rendered:
        checker.check_file(pathlib.Path(rendered), rendered)

    print(f"check_flags: {len(files) + len(args.rendered)} files, "
          f"{checker.seen['env']} LAPROXD_* uses, {checker.seen['cli']} command-line flags, "
          f"{checker.seen['ports']} port checks against laproxd's "
          f"{len(checker.flags['laproxd'])} flags")
    if checker.problems:
        print("\n".join(f"check_flags: FAIL {p}" for p in checker.problems), file=sys.stderr)
        return 1
    print("check_flags: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
