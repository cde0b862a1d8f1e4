#!/usr/bin/env python3
"""Compiles the .proto files of the laprox package into its descriptor set.

    generate_stubs.py OUTDIR [--proto-root DIR] [--protoc {auto,grpc_tools,system}]

writes into OUTDIR (normally <package>/laprox/_gen) two files: DESCRIPTOR_SET, the serialized
google.protobuf.FileDescriptorSet of proto/laprox/v1/laprox.proto and
proto/grpc/health/v1/health.proto (protoc --descriptor_set_out --include_imports), and
SERVICE_CONFIG, a copy of proto/laprox/v1/service_config.json (the gRPC service config every
client's channel uses: retries; the C++ client compiles in the same file). laprox._proto
builds the message classes and gRPC stubs from it at import time, so no generated Python code
is involved: descriptor bytes do not depend on protoc's version nor on the protobuf runtime's,
and any protoc works with any supported runtime.

The file is never committed: setup.py runs this at build time, the tests run it into a
temporary directory. The .proto files are compiled under their canonical names
("laprox/v1/laprox.proto"), the names the C++ code and server reflection use.

Compilers, in the order tried with --protoc=auto (the default):
  grpc_tools   grpcio-tools' bundled protoc (the build requirement in pyproject.toml);
  system       protoc on the PATH (Debian: /usr/bin/protoc, package protobuf-compiler), for
               offline builds and CI.

The proto root is found as --proto-root, else ./proto beside this script (an sdist), else
../../proto (the repository checkout).
"""

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# The .proto files under the proto root, in the order they are compiled.
PROTOS = ("laprox/v1/laprox.proto", "grpc/health/v1/health.proto")

# The files written into OUTDIR; laprox/_proto.py reads them.
DESCRIPTOR_SET = "descriptors.binpb"
SERVICE_CONFIG = "service_config.json"
# Copied from the proto root as they are (to SERVICE_CONFIG), and carried by an sdist.
SERVICE_CONFIG_SOURCE = "laprox/v1/service_config.json"


def find_proto_root(explicit=None):
    """The directory holding laprox/v1/laprox.proto."""
    candidates = [explicit] if explicit else [os.path.join(HERE, "proto"),
                                               os.path.join(HERE, "..", "..", "proto")]
    for root in candidates:
        if root and all(os.path.isfile(os.path.join(root, p))
                        for p in PROTOS + (SERVICE_CONFIG_SOURCE,)):
            return os.path.abspath(root)
    raise FileNotFoundError(
        "laprox: cannot find the .proto files (looked in %s); pass --proto-root"
        % ", ".join(c for c in candidates if c))


# grpcio-tools' compiled protoc, called directly: grpc_tools.protoc of some versions imports
# pkg_resources, which setuptools >= 81 no longer ships.
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
    return None if protoc is None else [protoc]


def protoc_command(which="auto"):
    """The protoc invocation prefix for `which` (auto, grpc_tools or system)."""
    tried = {"grpc_tools": _grpc_tools_command, "system": _system_command}
    order = ["grpc_tools", "system"] if which == "auto" else [which]
    for name in order:
        command = tried[name]()
        if command is not None:
            return name, command
    raise RuntimeError(
        "laprox: no protoc found: install grpcio-tools (pip) or protobuf-compiler "
        "(Debian: /usr/bin/protoc)")


def generate(outdir, proto_root=None, which="auto", verbose=False):
    """Writes OUTDIR/DESCRIPTOR_SET and OUTDIR/SERVICE_CONFIG (creating `outdir` if needed);
    returns the compiler used ("grpc_tools" or "system")."""
    root = find_proto_root(proto_root)
    name, command = protoc_command(which)
    os.makedirs(outdir, exist_ok=True)
    args = command + ["-I" + root, "--include_imports",
                      "--descriptor_set_out=" + os.path.join(outdir, DESCRIPTOR_SET)]
    args += [os.path.join(root, p) for p in PROTOS]
    if verbose:
        print("laprox: " + " ".join(args), file=sys.stderr)
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError("laprox: protoc failed (%s):\n%s" % (name, result.stderr))
    shutil.copyfile(os.path.join(root, SERVICE_CONFIG_SOURCE), os.path.join(outdir, SERVICE_CONFIG))
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
        print("laprox: descriptor set written with %s into %s" % (name, args.outdir),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
