#!/usr/bin/env bash
# Runs of four or more consecutive lines that stand both in a Rust file under one directory
# and in a Rust file under another (default trainer/src and py/src): what the built-in
# trainer and the Python package still write twice.
#
#   scripts/shared-runs.sh [--rev REV] [--min N] [DIR_A DIR_B]
#
# Lines are compared whitespace-trimmed; blank lines, lines of nothing but brackets and
# separators (`}`, `});`, `)`, `],` ...), `use` items (all their lines) and comment-only
# lines (`//`, `///`, `//!`, and block comments) are passed over, so a run may span them.
# A run is maximal: it cannot be extended at either end in both files. With --rev the
# files are read from `git show REV:path` (the tree at REV), not the work tree, so a
# before and after can be compared:
#
#   scripts/shared-runs.sh --rev 7f9fb00
#   scripts/shared-runs.sh            # the work tree
#
# Prints each run (both places, with their first and last line numbers in the file, the
# run's length in counted lines and its first line), then a total: how many runs, their
# counted lines summed, and the distinct places on each side (a block written once on one
# side and three times on the other is three runs). Exits 0.
#
# The tool library's `duplicates` (`duplicates --repo DIR --min-lines 4 --most 200`) finds
# the same pairs and more (also runs alike but for names), but only over a work tree, one
# row per pair of files with the longest run named and the others counted (`+N more runs`),
# and within either directory as well as across; this script lists every cross run, and
# reads a revision directly.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exec python3 - "$@" <<'PY'
import re
import subprocess
import sys

args = sys.argv[1:]
rev = None
min_run = 4
dirs = []
while args:
    a = args.pop(0)
    if a == "--rev":
        rev = args.pop(0)
    elif a == "--min":
        min_run = int(args.pop(0))
    elif a in ("-h", "--help"):
        print("usage: scripts/shared-runs.sh [--rev REV] [--min N] [DIR_A DIR_B]")
        sys.exit(0)
    else:
        dirs.append(a.rstrip("/"))
if not dirs:
    dirs = ["trainer/src", "py/src"]
if len(dirs) != 2:
    sys.exit("shared-runs: give two directories (default trainer/src py/src)")


def git(*cmd):
    return subprocess.run(["git", *cmd], check=True, capture_output=True, text=True).stdout


def files(d):
    if rev:
        names = git("ls-tree", "-r", "--name-only", rev, "--", d).split()
    else:
        names = git("ls-files", "--cached", "--others", "--exclude-standard", "--", d).split()
    return sorted(n for n in names if n.endswith(".rs"))


def read(path):
    if rev:
        return git("show", f"{rev}:{path}")
    with open(path, encoding="utf-8") as f:
        return f.read()


BRACKETS = re.compile(r"^[{}()\[\];,]*$")
USE = re.compile(r"^(pub(\([^)]*\))?\s+)?use\s")


def counted(text):
    """(line number, trimmed line) of the lines that count."""
    out = []
    in_block = 0
    in_use = False
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if in_block:
            in_block += line.count("/*") - line.count("*/")
            continue
        if line.startswith("/*"):
            in_block = line.count("/*") - line.count("*/")
            continue
        if in_use:
            in_use = not line.endswith(";")
            continue
        if USE.match(line):
            in_use = not line.endswith(";")
            continue
        if not line or line.startswith("//") or BRACKETS.match(line):
            continue
        out.append((no, line))
    return out


sides = [{p: counted(read(p)) for p in files(d)} for d in dirs]
runs = []
for pa, la in sides[0].items():
    for pb, lb in sides[1].items():
        where = {}
        for j, (_, t) in enumerate(lb):
            where.setdefault(t, []).append(j)
        for i, (_, t) in enumerate(la):
            for j in where.get(t, ()):
                # Only a run's first line starts one: the pair before it must differ.
                if i and j and la[i - 1][1] == lb[j - 1][1]:
                    continue
                n = 0
                while i + n < len(la) and j + n < len(lb) and la[i + n][1] == lb[j + n][1]:
                    n += 1
                if n >= min_run:
                    runs.append((pa, la[i][0], la[i + n - 1][0], pb, lb[j][0], lb[j + n - 1][0], n, t))

src = f"at {rev}" if rev else "in the work tree"
print(f"runs of {min_run}+ counted lines shared by {dirs[0]} and {dirs[1]} ({src}):")
for pa, a0, a1, pb, b0, b1, n, first in runs:
    print(f"  {pa}:{a0}-{a1} ~ {pb}:{b0}-{b1} ({n} lines): {first[:100]}")
lines = sum(r[6] for r in runs)
places_a = len({r[:3] for r in runs})
places_b = len({r[3:6] for r in runs})
print(f"total: {len(runs)} runs, {lines} counted lines in all "
      f"({places_a} places in {dirs[0]}, {places_b} in {dirs[1]})")
PY
