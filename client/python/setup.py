"""Build hook of the laprox package: the protobuf descriptor set is compiled, never committed.

build_py runs generate_stubs.py into <build>/laprox/_gen (into the source tree for editable
installs: the descriptor set and the gRPC service config) from ../../proto (a checkout) or ./proto (an sdist, which sdist copies them into).
laprox/_proto.py builds the messages and gRPC stubs from it at import time.
"""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate_stubs  # noqa: E402


class BuildPyWithDescriptors(build_py):
    """build_py that also writes laprox/_gen/descriptors.binpb."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            outdir = os.path.join(HERE, "laprox", "_gen")
        else:
            outdir = os.path.join(self.build_lib, "laprox", "_gen")
        compiler = generate_stubs.generate(outdir)
        print(f"laprox: compiled the descriptor set with {compiler} into {outdir}")

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        for name in (generate_stubs.DESCRIPTOR_SET, generate_stubs.SERVICE_CONFIG):
            built = os.path.join(self.build_lib, "laprox", "_gen", name)
            if os.path.isfile(built):
                outputs.append(built)
        return outputs


class SdistWithProtos(sdist):
    """sdist that carries the .proto files and the service config (they live outside this
    directory)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = generate_stubs.find_proto_root()
        for proto in generate_stubs.PROTOS + (generate_stubs.SERVICE_CONFIG_SOURCE,):
            target = os.path.join(base_dir, "proto", proto)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(root, proto), target)


setup(cmdclass={"build_py": BuildPyWithDescriptors, "sdist": SdistWithProtos})
