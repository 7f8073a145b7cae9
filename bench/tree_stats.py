"""The tree's shape at a git revision: files and lines per folder, and consumer/'s import picture.

    python -m bench.tree_stats 03b84dd HEAD

Read from git (`git ls-tree`, `git show`), no checkout. One definition for every revision:
- files and lines: the .py files of each folder (not its subfolders), their lines;
- consumer/'s import picture: the units are consumer/'s top-level modules (its __init__.py and
  __main__.py, the `python -m` shim, left out) and each of its folders (a wing) as one unit; an arrow is an import, anywhere in a module
  (in a function, under TYPE_CHECKING), from one unit to another; floors are the longest path
  of arrows (a unit importing no other unit is on floor 1, circles counted as one unit); arrows
  on a circle are the arrows between two units of one strongly connected set.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PACKAGE = "consumer"
SHIMS = ("__init__.py", "__main__.py")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, check=True).stdout


def python_files(rev: str) -> dict[str, str]:
    """Every .py file of REV (symlinks left out) with its text."""
    out = {}
    for line in _git("ls-tree", "-r", rev).splitlines():
        meta, path = line.split("\t", 1)
        mode = meta.split()[0]
        if path.endswith(".py") and mode != "120000":
            out[path] = _git("show", f"{rev}:{path}")
    return out


def per_folder(files: dict[str, str]) -> dict[str, tuple[int, int]]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path, text in files.items():
        folder = str(Path(path).parent)
        counts[folder][0] += 1
        counts[folder][1] += len(text.splitlines())
    return {k: (v[0], v[1]) for k, v in sorted(counts.items())}


def _unit_of(dotted: str) -> str | None:
    """The consumer unit a dotted module name (genqueue.consumer.x.y or consumer.x.y) is in."""
    parts = dotted.split(".")
    if parts[0] == "genqueue":
        parts = parts[1:]
    if len(parts) < 2 or parts[0] != PACKAGE:
        return None
    return parts[1]


def import_picture(files: dict[str, str]) -> tuple[set[str], set[tuple[str, str]]]:
    """consumer/'s units and the arrows between them."""
    units: set[str] = set()
    for path in files:
        p = Path(path)
        if p.parts[0] != PACKAGE or len(p.parts) < 2 or p.parts[1] in SHIMS:
            continue
        units.add(p.parts[1].removesuffix(".py"))
    arrows: set[tuple[str, str]] = set()
    for path, text in files.items():
        p = Path(path)
        if p.parts[0] != PACKAGE or len(p.parts) < 2 or p.parts[1] in SHIMS:
            continue
        me = p.parts[1].removesuffix(".py")
        package = ".".join(p.parts[:-1])  # for relative imports
        for node in ast.walk(ast.parse(text)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                u = _unit_of(t)
                if u is not None and u in units and u != me:
                    arrows.add((me, u))
    return units, arrows


def _components(units: set[str], arrows: set[tuple[str, str]]) -> dict[str, int]:
    """Each unit's strongly connected set (Tarjan)."""
    out_of: dict[str, list[str]] = defaultdict(list)
    for a, b in arrows:
        out_of[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comp: dict[str, int] = {}
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in out_of[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            n = len(set(comp.values()))
            while True:
                w = stack.pop()
                on.discard(w)
                comp[w] = n
                if w == v:
                    break

    for v in sorted(units):
        if v not in index:
            visit(v)
    return comp


def floors(units: set[str], arrows: set[tuple[str, str]]) -> tuple[int, int]:
    """(floors, arrows on a circle)."""
    comp = _components(units, arrows)
    on_circle = sum(1 for a, b in arrows if comp[a] == comp[b])
    down: dict[int, set[int]] = defaultdict(set)
    for a, b in arrows:
        if comp[a] != comp[b]:
            down[comp[a]].add(comp[b])
    memo: dict[int, int] = {}

    def floor(c: int) -> int:
        if c not in memo:
            memo[c] = 1 + max((floor(d) for d in down[c]), default=0)
        return memo[c]

    return max((floor(c) for c in set(comp.values())), default=0), on_circle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs="+")
    args = ap.parse_args()
    for rev in args.revisions:
        files = python_files(rev)
        print(f"== {rev} ({_git('rev-parse', '--short', rev).strip()})")
        for folder, (n, lines) in per_folder(files).items():
            print(f"  {folder:32} {n:4} files {lines:7,} lines")
        units, arrows = import_picture(files)
        f, circle = floors(units, arrows)
        print(f"  consumer/ import picture: {len(units)} units, {len(arrows)} arrows, {f} floors, "
              f"{circle} arrows on a circle")
        print(f"  units: {', '.join(sorted(units))}")


if __name__ == "__main__":
    main()
