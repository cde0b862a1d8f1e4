#!/usr/bin/env python3
"""Counts the documents quote from the tests, against the tests themselves: the size of the
oracle comparison grid (compare_test.build_grid()) wherever a document says "N-case grid".
Exit 1 naming each document line whose number is not the count.

    check_doc_counts.py              # README.md, CONTRIBUTING.md, docs/, tests/reference/
    check_doc_counts.py --selftest   # a planted false count must be caught
"""

import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import compare_test  # noqa: E402

GRID_RE = re.compile(r"(\d[\d,]*)-case (?:grid|comparison)")


def documents():
    paths = ["README.md", "CONTRIBUTING.md"]
    paths += glob.glob("docs/**/*.md", root_dir=REPO, recursive=True)
    paths += glob.glob("tests/reference/*.md", root_dir=REPO)
    return sorted(paths)


def check(path, text, grid):
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in GRID_RE.finditer(line):
            quoted = int(m.group(1).replace(",", ""))
            if quoted != grid:
                problems.append(f"{path}:{number}: says a {m.group(0)}; compare_test.py builds "
                                f"{grid} cases")
    return problems


def main(argv):
    grid = len(compare_test.build_grid())
    if argv == ["--selftest"]:
        planted = f"the backend is compared with the oracle on a {grid + 1}-case grid"
        caught = check("planted", planted, grid)
        kept = check("kept", f"on a {grid:,}-case grid", grid)
        ok = len(caught) == 1 and not kept
        print("doc counts selftest:", "every planted count caught" if ok else "FAILED")
        return 0 if ok else 1
    problems, quoted = [], 0
    for path in documents():
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read()
        quoted += len(GRID_RE.findall(text))
        problems += check(path, text, grid)
    for p in problems:
        print(p)
    print(f"doc counts: the grid has {grid} cases; {quoted} quotes of it, {len(problems)} wrong")
    return 1 if problems or quoted == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
