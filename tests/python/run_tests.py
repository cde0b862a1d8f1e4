#!/usr/bin/python3
"""Runs the Python client tests (what ctest's python_client does).

    /usr/bin/python3 tests/python/run_tests.py [--laproxd PATH] [--installed]
        [--timing all|skip|only] [unittest args]

--laproxd: the server binary (default: $LAPROXD, else build/service/laproxd).
--installed: test the `laprox` importable by this interpreter (e.g. a venv after
  `pip install ./client/python`) instead of the source tree with freshly generated stubs.
--timing: skip (or run only) the tests marked support.timing, whose assertions are wall-clock
  bounds (default all).
Any further arguments go to unittest (e.g. -k region, -v).
"""

import argparse
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def is_timing(test):
    """Whether a test (method or class) carries support.timing's mark."""
    method = getattr(test, getattr(test, "_testMethodName", ""), None)
    return bool(getattr(type(test), "laprox_timing", False)
                or getattr(method, "laprox_timing", False))


class TimingLoader(unittest.TestLoader):
    """Discovers as unittest does, then keeps the tests `keep` accepts (modules that failed to
    import are kept: they report their error)."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def discover(self, *args, **kwargs):
        return self._filter(super().discover(*args, **kwargs))

    def _filter(self, suite):
        kept = unittest.TestSuite()
        for test in suite:
            if isinstance(test, unittest.TestSuite):
                kept.addTest(self._filter(test))
            elif type(test).__name__ == "_FailedTest" or self.keep(test):
                kept.addTest(test)
        return kept


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--laproxd", default=None)
    parser.add_argument("--installed", action="store_true")
    parser.add_argument("--timing", choices=("all", "skip", "only"), default="all")
    args, rest = parser.parse_known_args()
    if args.laproxd:
        os.environ["LAPROXD"] = os.path.abspath(args.laproxd)
    if args.installed:
        os.environ["LAPROX_TEST_INSTALLED"] = "1"
    sys.path.insert(0, HERE)
    keep = {"all": lambda test: True, "skip": lambda test: not is_timing(test),
            "only": is_timing}[args.timing]
    program = unittest.main(module=None, argv=[sys.argv[0], "discover", "-s", HERE,
                                               "-t", HERE, "-p", "test_*.py", *rest],
                            testLoader=TimingLoader(keep), exit=False)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
