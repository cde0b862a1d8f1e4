"""What the vLLM integration scripts share: the laproxd of the Python client tests
(tests/python/support.py: the binary on a Unix socket, started once it says it listens)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

from support import Laproxd  # noqa: E402,F401


def use_laproxd(path: str) -> None:
    """Makes Laproxd() start the binary at `path` (the scripts' --laproxd)."""
    os.environ["LAPROXD"] = os.path.abspath(path)
