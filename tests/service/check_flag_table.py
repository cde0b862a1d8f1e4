#!/usr/bin/env python3
"""The flag table of docs/daemon.md against the laproxd binary (its `--help`): every flag
a row names exists, with the default the row says, and every laproxd flag is named somewhere in
docs/daemon.md. Exit 1 naming each difference.

    check_flag_table.py PATH/TO/laproxd [--doc docs/daemon.md]
    check_flag_table.py --selftest PATH/TO/laproxd   # planted differences must be caught

A row is `| `--a` / `--b` | default_a / default_b | meaning |` (one default per flag, or one for
all). Defaults are compared after spelling them as laproxd prints them: `none` is "", `2^20` is
1048576, `256 MiB` is 268435456, `2^31 − 1` is 2147483647, and `0 = what it means` is 0.
"""

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# laproxd's flags and defaults as tests/deploy/check_flags.py reads them off `--help`.
sys.path.insert(0, os.path.join(REPO, "tests", "deploy"))
from check_flags import read_flags  # noqa: E402


def spelled(value):
    """A default as the table writes it, spelled as laproxd prints it."""
    value = value.strip().strip("`").strip()
    if " = " in value:  # "0 = the backend's (...)": the value, then what it means
        value = value.split(" = ", 1)[0]
    if value == "none":
        return ""
    if m := re.fullmatch(r"2\^(\d+)(?:\s*[−-]\s*(\d+))?", value):
        return str(2 ** int(m.group(1)) - int(m.group(2) or 0))
    if m := re.fullmatch(r"(\d+) (KiB|MiB|GiB)", value):
        return str(int(m.group(1)) << {"KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)])
    return value


def table_rows(text):
    """[(line number, [flag names], [defaults as written])] of the flag table's rows."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        names = re.findall(r"`--(\w+)`", cells[0])
        defaults = cells[1].split(" / ") if len(names) > 1 else [cells[1]]
        if len(defaults) == 1:  # one default for every flag of the row
            defaults = defaults * len(names)
        rows.append((number, names, defaults))
    return rows


def check(text, flags, doc):
    problems = []
    for number, names, defaults in table_rows(text):
        if len(defaults) != len(names):
            problems.append(f"{doc}:{number}: {len(names)} flags but {len(defaults)} defaults")
            continue
        for name, default in zip(names, defaults):
            if name not in flags:
                problems.append(f"{doc}:{number}: --{name} is not a laproxd flag")
            elif spelled(default) != flags[name]:
                problems.append(f"{doc}:{number}: --{name} defaults to {flags[name]!r} in "
                                f"laproxd, the table says {default!r}")
    for name in sorted(flags):
        if f"--{name}" not in text:
            problems.append(f"{doc}: laproxd's --{name} is not documented")
    return problems


def selftest(flags, text, doc):
    rows = table_rows(text)
    number, names, defaults = rows[0]
    lines = text.splitlines()
    planted = {
        "a default changed": lines[number - 1].replace(defaults[0], "`wrong`", 1),
        "a flag renamed": lines[number - 1].replace(f"`--{names[0]}`", "`--no_such_flag`", 1),
    }
    failed = False
    for what, line in planted.items():
        edited = "\n".join(lines[:number - 1] + [line] + lines[number:])
        if not check(edited, flags, doc):
            print(f"selftest: {what} was not caught")
            failed = True
    # A flag the document no longer names.
    name = sorted(flags)[0]
    if not check(text.replace(f"--{name}", "--gone"), flags, doc):
        print(f"selftest: --{name} dropped from the document was not caught")
        failed = True
    print("flag table selftest:", "FAILED" if failed else "every planted difference caught")
    return 1 if failed else 0


def main(argv):
    selftesting = "--selftest" in argv
    argv = [a for a in argv if a != "--selftest"]
    doc = "docs/daemon.md"
    if "--doc" in argv:
        doc = argv[argv.index("--doc") + 1]
    flags = read_flags(argv[0])  # exits naming the program when it lists no flags
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        text = f.read()
    if selftesting:
        return selftest(flags, text, doc)
    problems = check(text, flags, doc)
    for p in problems:
        print(p)
    print(f"flag table: {len(table_rows(text))} rows, {len(flags)} laproxd flags, "
          f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
