#!/usr/bin/env python3
"""Generates the protobuf and gRPC Python modules of the laprox package.

    generate_stubs.py OUTDIR [--proto-root DIR] [--protoc {auto,grpc_tools,system}]

writes into OUTDIR (normally <package>/laprox/_gen):

    __init__.py
    laprox_pb2.py, laprox_pb2_grpc.py   from proto/laprox/v1/laprox.proto
    health_pb2.py, health_pb2_grpc.py   from proto/grpc/health/v1/health.proto

The modules are never committed: setup.py runs this at build time, the tests run it into a
temporary directory. The .proto files are compiled under their canonical names
("laprox/v1/laprox.proto"), so the descriptors are the same ones the C++ code and server
reflection use; only the import lines protoc writes ("from laprox.v1 import laprox_pb2") are
rewritten to relative imports, because the Python package `laprox` owns that top-level name.

Compilers, in the order tried with --protoc=auto (the default):
  grpc_tools   grpcio-tools' bundled protoc (the build requirement in pyproject.toml);
  system       protoc on the PATH (Debian: /usr/bin/protoc 3.21) with
               --plugin=protoc-gen-grpc_python=grpc_python_plugin (Debian:
               /usr/bin/grpc_python_plugin), for offline builds and CI.
Both produce code for the protobuf 4.21 runtime.

The proto root is found as --proto-root, else ./proto beside this script (an sdist), else
../../proto (the repository checkout).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (proto file under the proto root, module stem in OUTDIR)
PROTOS = (
    ("laprox/v1/laprox.proto", "laprox"),
    ("grpc/health/v1/health.proto", "health"),
)

INIT = '''"""Generated protobuf/gRPC modules of laprox (generate_stubs.py); do not edit."""
'''


def find_proto_root(explicit=None):
    """The directory holding laprox/v1/laprox.proto."""
    candidates = [explicit] if explicit else [os.path.join(HERE, "proto"),
                                               os.path.join(HERE, "..", "..", "proto")]
    for root in candidates:
        if root and all(os.path.isfile(os.path.join(root, p)) for p, _ in PROTOS):
            return os.path.abspath(root)
    raise FileNotFoundError(
        "laprox: cannot find the .proto files (looked in %s); pass --proto-root"
        % ", ".join(c for c in candidates if c))


# grpcio-tools' compiled protoc (the grpc_python generator is built in). Called directly:
# grpc_tools.protoc of 1.51 imports pkg_resources, which setuptools >= 81 no longer ships.
_GRPC_TOOLS_MAIN = ("import sys; from grpc_tools import _protoc_compiler; "
                    "sys.exit(_protoc_compiler.run_main([a.encode() for a in sys.argv]))")


def _grpc_tools_command():
    try:
        import grpc_tools
        from grpc_tools import _protoc_compiler  # noqa: F401
    except ImportError:
        return None
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    return [sys.executable, "-c", _GRPC_TOOLS_MAIN, "-I" + include]


def _system_command():
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        return None
    return [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]


def protoc_command(which="auto"):
    """The protoc invocation prefix for `which` (auto, grpc_tools or system)."""
    tried = {"grpc_tools": _grpc_tools_command, "system": _system_command}
    order = ["grpc_tools", "system"] if which == "auto" else [which]
    for name in order:
        command = tried[name]()
        if command is not None:
            return name, command
    raise RuntimeError(
        "laprox: no protoc found: install grpcio-tools (pip) or protobuf-compiler and "
        "protobuf-compiler-grpc (Debian: /usr/bin/protoc, /usr/bin/grpc_python_plugin)")


# protoc writes absolute imports of the other generated modules, e.g.
#   from laprox.v1 import laprox_pb2 as laprox_dot_v1_dot_laprox__pb2
_IMPORT = re.compile(r"^from (laprox\.v1|grpc\.health\.v1) import (\w+_pb2)( as \w+)$", re.M)


def generate(outdir, proto_root=None, which="auto", verbose=False):
    """Writes the generated modules into `outdir` (created if needed); returns the compiler
    used ("grpc_tools" or "system")."""
    root = find_proto_root(proto_root)
    name, command = protoc_command(which)
    os.makedirs(outdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="laprox-stubs-") as tmp:
        args = command + ["-I" + root, "--python_out=" + tmp, "--grpc_python_out=" + tmp]
        args += [os.path.join(root, p) for p, _ in PROTOS]
        if verbose:
            print("laprox: " + " ".join(args), file=sys.stderr)
        result = subprocess.run(args, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError("laprox: protoc failed (%s):\n%s" % (name, result.stderr))
        for proto, stem in PROTOS:
            base = os.path.join(tmp, os.path.dirname(proto), os.path.basename(proto)[:-6])
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                with open(base + suffix) as fh:
                    text = fh.read()
                text = _IMPORT.sub(lambda m: "from . import %s%s" % (m.group(2), m.group(3)),
                                   text)
                with open(os.path.join(outdir, stem + suffix), "w") as fh:
                    fh.write(text)
    with open(os.path.join(outdir, "__init__.py"), "w") as fh:
        fh.write(INIT)
    return name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--proto-root", default=None)
    parser.add_argument("--protoc", choices=("auto", "grpc_tools", "system"), default="auto")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    try:
        name = generate(args.outdir, args.proto_root, args.protoc, args.verbose)
    except (RuntimeError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 1
    if args.verbose:
        print("laprox: stubs generated with %s into %s" % (name, args.outdir), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
