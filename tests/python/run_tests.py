#!/usr/bin/python3
"""Runs the Python client tests (what ctest's python_client does).

    /usr/bin/python3 tests/python/run_tests.py [--laproxd PATH] [--installed] [unittest args]

--laproxd: the server binary (default: $LAPROXD, else build/service/laproxd).
--installed: test the `laprox` importable by this interpreter (e.g. a venv after
  `pip install ./client/python`) instead of the source tree with freshly generated stubs.
Any further arguments go to unittest (e.g. -k region, -v).
"""

import argparse
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--laproxd", default=None)
    parser.add_argument("--installed", action="store_true")
    args, rest = parser.parse_known_args()
    if args.laproxd:
        os.environ["LAPROXD"] = os.path.abspath(args.laproxd)
    if args.installed:
        os.environ["LAPROX_TEST_INSTALLED"] = "1"
    sys.path.insert(0, HERE)
    program = unittest.main(module=None, argv=[sys.argv[0], "discover", "-s", HERE,
                                               "-t", HERE, "-p", "test_*.py", *rest],
                            exit=False)
    return 0 if program.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
