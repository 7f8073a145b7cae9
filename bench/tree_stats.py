"""The tree's shape at a git revision: files and lines per folder, and the import picture of
every package and wing.

    python -m bench.tree_stats r3-before HEAD

Read from git (`git ls-tree`, `git show`), no checkout. One definition for every revision:
- files and lines: the .py files of each folder (not its subfolders), their lines;
- an import picture of a folder (a package: common, consumer, producer; or a wing: a folder
  directly under a package): its units (rooms) are its top-level modules (its __init__.py and
  __main__.py, the `python -m` shim, left out) and each of its folders as one unit; an arrow is
  an import, anywhere in a module (in a function, under TYPE_CHECKING), from one unit to
  another; floors are the longest path of arrows (a unit importing no other unit is on floor 1,
  circles counted as one unit); a circle is a strongly connected set of more than one unit, and
  arrows on a circle are the arrows between two units of one such set;
- per package and wing: its modules over 500 lines, and its module docstrings' lengths in lines
  (the longest, and how many are over 20).
consumer/'s picture is also printed in the form the earlier reports used.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "consumer", "producer")
PACKAGE = "consumer"  # the package the earlier reports drew
SHIMS = ("__init__.py", "__main__.py")
#: A module past this many lines, a docstring past this many: what tests/test_tree_rules.py holds.
MAX_LINES = 500
MAX_DOC_LINES = 20


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
        folder = str(PurePosixPath(path).parent)
        counts[folder][0] += 1
        counts[folder][1] += len(text.splitlines())
    return {k: (v[0], v[1]) for k, v in sorted(counts.items())}


def _unit_of(dotted: str, folder: tuple[str, ...]) -> str | None:
    """The unit of FOLDER (path parts, e.g. ("consumer",) or ("consumer", "work")) a dotted module
    name (genqueue.consumer.x.y or consumer.x.y) is in, or None outside FOLDER."""
    parts = dotted.split(".")
    if parts[0] == "genqueue":
        parts = parts[1:]
    n = len(folder)
    if len(parts) <= n or tuple(parts[:n]) != folder:
        return None
    return parts[n]


def _imports(path: str, text: str) -> list[str]:
    """Every module name PATH's text imports (relative imports made absolute; `from X import Y`
    also gives X.Y, Y may be a module)."""
    p = PurePosixPath(path)
    package = ".".join(p.parts[:-1])  # for relative imports
    found: list[str] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            found += [base] + [f"{base}.{a.name}" for a in node.names]
    return found


def import_picture(files: dict[str, str], folder: tuple[str, ...] = (PACKAGE,)) -> tuple[set[str], set[tuple[str, str]]]:
    """FOLDER's units and the arrows between them (consumer/'s by default)."""
    n = len(folder)
    mine = {path: text for path, text in files.items()
            if PurePosixPath(path).parts[:n] == folder and len(PurePosixPath(path).parts) > n
            and not (len(PurePosixPath(path).parts) == n + 1 and PurePosixPath(path).parts[n] in SHIMS)}
    units = {PurePosixPath(path).parts[n].removesuffix(".py") for path in mine}
    arrows: set[tuple[str, str]] = set()
    for path, text in mine.items():
        me = PurePosixPath(path).parts[n].removesuffix(".py")
        for t in _imports(path, text):
            u = _unit_of(t, folder)
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


def circles(units: set[str], arrows: set[tuple[str, str]]) -> int:
    """The strongly connected sets of more than one unit."""
    sizes: dict[int, int] = defaultdict(int)
    for c in _components(units, arrows).values():
        sizes[c] += 1
    return sum(1 for s in sizes.values() if s > 1)


def docstring_lines(text: str) -> int:
    """The module docstring's length in lines (0: none), as tests/test_tree_rules.py counts it."""
    doc = ast.get_docstring(ast.parse(text), clean=False)
    return len(doc.splitlines()) if doc else 0


@dataclass(frozen=True, slots=True)
class Shape:
    """One folder's picture and its modules' sizes."""

    folder: str
    units: int
    arrows: int
    floors: int
    circles: int
    on_circle: int
    modules: int
    over_lines: tuple[tuple[str, int], ...]  # (path, lines) past MAX_LINES, longest first
    doc_max: int
    doc_over: int


def shape(files: dict[str, str], folder: tuple[str, ...]) -> Shape:
    units, arrows = import_picture(files, folder)
    f, on_circle = floors(units, arrows)
    n = len(folder)
    modules = {p: t for p, t in files.items() if PurePosixPath(p).parts[:n] == folder}
    over = sorted(((p, len(t.splitlines())) for p, t in modules.items() if len(t.splitlines()) > MAX_LINES),
                  key=lambda pl: (-pl[1], pl[0]))
    docs = [docstring_lines(t) for t in modules.values()]
    return Shape("/".join(folder), len(units), len(arrows), f, circles(units, arrows), on_circle, len(modules),
                 tuple(over), max(docs, default=0), sum(1 for d in docs if d > MAX_DOC_LINES))


def wings(files: dict[str, str], package: str) -> list[str]:
    """PACKAGE's wings: its folders holding an __init__.py."""
    return sorted({PurePosixPath(p).parts[1] for p in files
                   if PurePosixPath(p).parts[0] == package and len(PurePosixPath(p).parts) == 3
                   and PurePosixPath(p).name == "__init__.py"})


HEADER = (f"    {'folder':24} {'rooms':>5} {'arrows':>6} {'floors':>6} {'circles':>7} {'on one':>6}  "
          f"{'modules':>7} {'>' + str(MAX_LINES):>5}  {'doc max':>7} {'>' + str(MAX_DOC_LINES):>4}")


def _row(s: Shape, indent: str) -> str:
    """One folder's line under HEADER: its picture (arrows on a circle under `on one`), then its
    modules, those over MAX_LINES, its longest docstring and its docstrings over MAX_DOC_LINES."""
    name = indent + s.folder + "/"
    return (f"    {name:24} {s.units:5} {s.arrows:6} {s.floors:6} {s.circles:7} {s.on_circle:6}  "
            f"{s.modules:7} {len(s.over_lines):5}  {s.doc_max:7} {s.doc_over:4}")


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
        print("  packages and their wings (a wing is one room of its package):")
        print(HEADER)
        over: list[tuple[str, int]] = []
        for package in PACKAGES:
            top = shape(files, (package,))
            over += top.over_lines
            print(_row(top, ""))
            for wing in wings(files, package):
                print(_row(shape(files, (package, wing)), "  "))
        print(f"  modules over {MAX_LINES} lines ({len(over)}): "
              + ", ".join(f"{p} {n}" for p, n in sorted(over, key=lambda pl: (-pl[1], pl[0]))))


if __name__ == "__main__":
    main()
