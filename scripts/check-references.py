#!/usr/bin/env python3
"""Fails when a comment or document names a repository file that does not exist.

    scripts/check-references.py            # the whole tree; exit 1 naming each dangling one
    scripts/check-references.py FILE...    # only these files (still resolved against the tree)
    scripts/check-references.py --selftest # planted references must be caught, others not

What counts as a reference to a repository file (everything else is left alone):
  - a path with a directory component and a known extension (`kernels/cuda/select.h`,
    `bench/RESULTS.md`, `laprox/vllm/DESIGN.md`), or a path of one of the tree's folders
    ending in `/` (`tests/gpu/`);
  - a bare document name: upper-case Markdown names the tree has or documents are cited by
    (`DESIGN.md`, `STYLE.md`, `RESULTS.md`, `SEMANTICS.md`);
  - a bare C++/CUDA/proto file name (`work.h`, `select_kernels.cu`).
A path resolves when it exists from the repository root or from the citing file's folder, or
when it is the tail of exactly one path of the tree (include-style `laprox/kernels/policy.h`).
A bare document resolves in the citing file's folder or one above it, in a folder the same line
names (`tests/crosscheck/kvpress/`: ... its `RESULTS.md`), or as the only file of that name;
not the last for LOCAL_ONLY names (`DESIGN.md`: the project's is docs/design.md, the vLLM
plugin's is its own). A bare source name must be the name of some file of the tree.
`docs/design.md §N` (or `section N`), after any Markdown file, must name a heading `## N. ...`
of that file. In a Markdown file, a link `[text](path#anchor)` to a repository file must resolve
from the citing file's folder (as a reader's browser resolves it), and its anchor (also
`(#anchor)` within the file) must be a heading's GitHub anchor in the file it names.
Not references: URLs (and the text of a Markdown link to one), absolute paths
(`/run/laprox/...`), `~/` and `$VAR/` paths, placeholders (`OUT_DIR/...`, `TAG.md`), build trees
(`build/...`, `build-asan/...`), generated protobuf files (`*.pb.h`, `*_pb2.py`), globs and
templates (`*`, `{l}`, `<...>`), `#include` lines (the compiler checks those), paths of other
projects that do not resolve here (EXTERNAL below), and files that are not text. The tree is
the tracked files plus new files git does not ignore.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = "scripts/check-references.py"  # its own examples are not references

# Extensions of files a reference may name.
EXTS = ("md", "h", "cc", "cu", "cuh", "py", "sh", "proto", "txt", "json", "yaml", "yml",
        "cmake", "toml", "png", "in", "env", "service", "sysusers", "cfg")
# Bare names checked: the project's own languages (notes cite other projects' Python files bare).
SOURCE_EXTS = ("h", "cc", "cu", "cuh", "proto")
# Tracked files that are scanned: text with comments or prose.
SCAN_EXTS = (".h", ".cc", ".cu", ".cuh", ".py", ".sh", ".md", ".proto", ".txt", ".cmake", ".in",
             ".yaml", ".yml", ".toml", ".env", ".service", ".sysusers")
SCAN_NAMES = (".ci/run", ".clang-format", ".clang-tidy")
SKIP_PREFIXES = ("tests/fuzz/corpus/",
                 "docs/audit/2026-")  # dated records, with other trees' abbreviated paths
# First components of other projects' paths (vLLM, transformers, torch, kvpress, gRPC, system
# folders) as notes cite them; a path that resolves in this tree is still checked as ours.
EXTERNAL = {"vllm", "transformers", "torch", "kvpress", "grpc", "grpcpp", "absl", "google",
            "gtest", "benchmark", "prometheus", "cub", "cuda", "site-packages", "dist-packages",
            "usr", "etc", "proc", "sys", "dev", "run", "tmp", "var", "opt", "lib", "presses"}
# Bare document names that several documents of this tree share in meaning (the project's design,
# docs/design.md, and the vLLM plugin's notes, client/python/laprox/vllm/DESIGN.md): bare, they
# name only the file in the citing folder or one above it.
LOCAL_ONLY = {"DESIGN.md"}
# Document names checked when bare: every upper-case Markdown name of the tree, and names that
# documents elsewhere are cited by.
KNOWN_DOCS = {"DESIGN.md", "STYLE.md", "CONTRIBUTING.md", "README.md", "RESULTS.md"}

PATH_RE = re.compile(
    r"(?<![\w/.$~{}@:%*<\-])"                      # not inside a URL, absolute path or variable
    r"((?:\.\./|\./)*[A-Za-z0-9_][\w.+\-]*(?:/[\w.+\-]+)+"  # dir/.../name
    r"(?:\.(?:" + "|".join(EXTS) + r")\b|/))"     # known extension, or a folder
    r"(?![\w/{}*<-])")
BARE_DOC_RE = re.compile(r"(?<![\w/.\-])([A-Z][A-Z0-9_]*\.md)\b(?![\w/-])")
FOLDER_RE = re.compile(r"(?<![\w/.$~])([\w.\-]+(?:/[\w.\-]+)*)/")
PLACEHOLDER_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")  # OUT_DIR/, LOGDIR/: a name to fill in
BARE_SRC_RE = re.compile(
    r"(?<![\w/.\-$*}>])([a-z_][a-z0-9_]*\.(?:" + "|".join(SOURCE_EXTS) + r"))\b(?![\w/(-])")
SECTION_RE = re.compile(r"^`?,?\s*(?:section|§)\s*(\d+)")
GENERATED_RE = re.compile(r"(\.pb\.(h|cc)|_pb2(_grpc)?\.py|\.grpc\.pb\.(h|cc))$")
URL_LINK_RE = re.compile(r"\[[^\]]*\]\((?:https?|ftp|mailto):[^)]*\)")
MD_LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
INCLUDE_RE = re.compile(r"^\s*#\s*include\b")


def tracked():
    # Tracked files and new ones not ignored: what a commit of the tree would hold.
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], check=True,
                         capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


class Tree:
    def __init__(self, files):
        self.files = set(files)
        self.dirs = set()
        self.basenames = set()
        self.known_docs = set(KNOWN_DOCS)
        self.tails = {}
        for f in files:
            parts = f.split("/")
            self.basenames.add(parts[-1])
            if re.match(r"^[A-Z][A-Z0-9_]*\.md$", parts[-1]):
                self.known_docs.add(parts[-1])
            for i in range(1, len(parts)):
                self.dirs.add("/".join(parts[:i]))
                self.tails.setdefault("/".join(parts[i:]), set()).add(f)

    def exists(self, path):
        path = os.path.normpath(path)
        return path in self.files or path in self.dirs or path == "."

    def resolve(self, token, citing_dir):
        """The tracked path `token` names, or None."""
        folder = token.endswith("/")
        token = token.rstrip("/")
        for base in ("", citing_dir):
            candidate = os.path.normpath(os.path.join(base, token))
            if candidate in self.files or (candidate in self.dirs):
                return candidate
        if not folder and not token.startswith("."):
            matches = self.tails.get(token, set())
            if len(matches) == 1:
                return next(iter(matches))
        return None


CONTINUATION = [None]  # the line after the one being checked


def headings(path, cache={}):
    if path not in cache:
        numbers = set()
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for line in f:
                m = re.match(r"#+\s+(\d+)\.", line)
                if m:
                    numbers.add(m.group(1))
        cache[path] = numbers
    return cache[path]


def anchor_of(heading):
    """GitHub's anchor of a Markdown heading's text: lower case, punctuation dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(lines):
    """The anchors of the headings among `lines` (outside code fences); a repeated heading gets
    -1, -2, ... as GitHub numbers them."""
    found, seen, fenced = set(), {}, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#+\s+(.*?)\s*#*\s*$", line)
        if m:
            base = anchor_of(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def file_anchors(path, cache={}):
    if path not in cache:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            cache[path] = anchors(f.readlines())
    return cache[path]


def check_md_links(tree, path, lines, line, where, problems):
    """A Markdown file's links to repository files: the file, and the heading an anchor names."""
    citing_dir = os.path.dirname(path)
    for m in MD_LINK_RE.finditer(line):
        link = m.group(1)
        if re.match(r"^[a-z]+:", link):
            continue  # a URL
        target, _, anchor = link.partition("#")
        if target:
            resolved = os.path.normpath(os.path.join(citing_dir, target))
            if not tree.exists(resolved):
                problems.append(f"{where}: link {link}: {resolved} is not in the repository")
                continue
        else:
            resolved = path
        if anchor and resolved.endswith(".md"):
            known = anchors(lines) if resolved == path else file_anchors(resolved)
            if anchor not in known:
                problems.append(f"{where}: link {link}: {resolved} has no heading with anchor "
                                f"#{anchor}")


def check_section(tree, target, rest, where, problems, token):
    if not rest.strip() and CONTINUATION[0] is not None:  # "docs/design.md\n// §2"
        rest = re.sub(r"^\s*(?://+|#+|\*|--)?\s*", "", CONTINUATION[0])
    m = SECTION_RE.match(rest)
    if m and target.endswith(".md") and m.group(1) not in headings(target):
        problems.append(f"{where}: {token} section {m.group(1)}: no heading '## {m.group(1)}.' "
                        f"in {target}")


def check_file(tree, path, problems):
    try:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = f.readlines()
    except (UnicodeDecodeError, FileNotFoundError):
        return
    check_lines(tree, path, lines, problems)


def check_lines(tree, path, lines, problems):
    citing_dir = os.path.dirname(path)
    for number, line in enumerate(lines, 1):
        CONTINUATION[0] = lines[number] if number < len(lines) else None
        if INCLUDE_RE.match(line):
            continue
        where = f"{path}:{number}"
        if path.endswith(".md"):
            check_md_links(tree, path, lines, line, where, problems)
        line = URL_LINK_RE.sub("", line)  # [text](https://...): the text names the URL's file
        for m in PATH_RE.finditer(line):
            token = m.group(1)
            first = token.split("/")[0]
            if (first.startswith("build") or first.startswith(".venv")
                    or PLACEHOLDER_RE.match(first) or GENERATED_RE.search(token)):
                continue
            folder = token.endswith("/")
            if folder and not tree.exists(first):
                continue  # only folders of this repository's own tree are checked
            target = tree.resolve(token, citing_dir)
            if target is None and first in EXTERNAL:
                continue  # another project's file (`vllm/v1/...`), cited as such
            if target is None:
                problems.append(f"{where}: {token} does not exist in the repository")
            else:
                check_section(tree, target, line[m.end():], where, problems, token)
        line_folders = None
        for m in BARE_DOC_RE.finditer(line):
            token = m.group(1)
            if token not in tree.known_docs:
                continue  # TAG.md, NAME.md: a name to fill in, not a file
            target = None
            folder = citing_dir
            while True:  # the citing folder, then the folders above it
                candidate = os.path.join(folder, token) if folder else token
                if candidate in tree.files:
                    target = candidate
                    break
                if not folder:
                    break
                folder = os.path.dirname(folder)
            if target is None:  # a folder the same line names ("`tests/x/`: ... its RESULTS.md")
                if line_folders is None:
                    line_folders = [f.group(1) for f in FOLDER_RE.finditer(line)]
                for folder in line_folders:
                    resolved = tree.resolve(folder + "/", citing_dir)
                    if resolved is not None and os.path.join(resolved, token) in tree.files:
                        target = os.path.join(resolved, token)
                        break
            if target is None and token not in LOCAL_ONLY:
                matches = tree.tails.get(token, set())
                if len(matches) == 1:
                    target = next(iter(matches))
            if target is None:
                problems.append(f"{where}: {token} does not name one file of the repository "
                                f"from {citing_dir or 'the root'} (write its path)")
            else:
                check_section(tree, target, line[m.end():], where, problems, token)
        for m in BARE_SRC_RE.finditer(line):
            token = m.group(1)
            if token not in tree.basenames and not GENERATED_RE.search(token):
                problems.append(f"{where}: {token}: no tracked file has this name")


# --selftest: planted references in a file that is not on disk, as if it were kernels/cpu/x.cc.
# Each line ends with the number of problems it must raise.
SELFTEST = """\
// A dangling path: kernels/cuda/no_such_file.h (1)
// A bare design reference from kernels/: DESIGN.md section 2 (1)
// A section that does not exist: docs/design.md §99 (1)
// A moved file: kernels/tensor_view.cc:40 (1)
// A bare header no file has: no_such_header.h (1)
// Resolving: docs/design.md §5, tests/reference/SEMANTICS.md, laprox/kernels/policy.h (0)
// Resolving: window.h, bench/, SEMANTICS.md "Scores", `tests/crosscheck/kvpress/`: RESULTS.md (0)
// Not references: https://github.com/x/y/blob/main/a/b.h /run/laprox/laproxd.sock (0)
// Not references: build/tests/x.h, $OUT/a/b.json, OUT_DIR/source.json, vllm/v1/x.py (0)
// Not references: laprox/v1/laprox.pb.h, tests/fuzz/<name>_fuzzer.cc, layers.{l}/keys.h (0)
"""
# The same for Markdown links, as if in docs/x.md (which has the heading "# Here").
SELFTEST_MD = """\
# Here
A link to no file: [a](no_such_file.md) (1)
An anchor the file lacks: [a](design.md#no-such-heading) (1)
A link from the wrong folder: [a](docs/design.md) (1)
An anchor this file lacks: [a](#not-here) (1)
Resolving: [a](design.md#1-layout-and-dependency-direction), [b](../README.md), [c](#here) (0)
Not checked: [a](https://example.com/x.md#y), [b](mailto:a@b) (0)
"""


def selftest(tree):
    failed = False
    md_lines = SELFTEST_MD.splitlines()
    cases = [("kernels/cpu/x.cc", [line]) for line in SELFTEST.splitlines()]
    cases += [("docs/x.md", [md_lines[0], line]) for line in md_lines[1:]]
    for number, (path, lines) in enumerate(cases, 1):
        problems = []
        check_lines(tree, path, lines, problems)
        line = lines[-1]
        want = int(re.search(r"\((\d+)\)$", line).group(1))
        if len(problems) != want:
            failed = True
            print(f"selftest case {number}: {len(problems)} problems, expected {want}: {line}")
            for p in problems:
                print(f"  {p}")
    print("references selftest:", "FAILED" if failed else "every planted reference caught")
    return 1 if failed else 0


def main(argv):
    files = tracked()
    tree = Tree(files)
    if argv == ["--selftest"]:
        return selftest(tree)
    if argv:
        scan = [os.path.relpath(os.path.abspath(a), ROOT) for a in argv]
    else:
        scan = [f for f in files
                if (f.endswith(SCAN_EXTS) or f in SCAN_NAMES or "/Dockerfile" in f)
                and not f.startswith(SKIP_PREFIXES) and f != SELF]
    problems = []
    for path in scan:
        check_file(tree, path, problems)
    for p in problems:
        print(p)
    if problems:
        print(f"references: {len(problems)} dangling in {len(scan)} files", file=sys.stderr)
        return 1
    print(f"references: {len(scan)} files, every repository path they name exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
