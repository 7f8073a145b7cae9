"""Exported bytes of several git revisions, every format, side by side: did a change move a byte?

    python -m bench.export_bytes ca50e95 .  [--input samples/sample.jsonl] [--keep DIR]

Each revision (`.` is the working tree) is checked out in a temporary git worktree and runs the
demo pipeline with its own code (scripts/demo's steps): a private redis-server, `producer
enqueue` of the input (with --token-ids, so the tokens format has its ids), one `consumer run
--burst` against the stand-in vLLM, then `producer export` once per format (and once more with
`--rows conversation` for the formats that have row layouts). The stand-in answers a request
by its messages and seed alone, so two revisions that behave alike write the same records.

Every file an export writes (dataset, errors, truncated, missing, flagged) is hashed as written
(raw) and after normalising (norm): the fields that carry the moment or the machine of a run,
not its content, are dropped at any depth (VOLATILE), and in the text files (the dataset card)
a date and time (MOMENT: when the run was made). A revision matches the first when every
normalised hash does; the raw column says where only such fields differ.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.bench_revisions import _check_imports, _checkout, _entry
from bench.common import start_redis, start_sim, table

HERE = Path(__file__).resolve().parent.parent

#: (format, --rows or "" for the default, file suffix).
EXPORTS = [("openai", "", "jsonl"), ("sharegpt", "", "jsonl"), ("specforge", "", "jsonl"),
           ("batch", "", "jsonl"), ("parquet", "", "parquet"), ("tokens", "", "jsonl"),
           ("openai", "conversation", "jsonl"), ("sharegpt", "conversation", "jsonl"),
           ("specforge", "conversation", "jsonl"), ("parquet", "conversation", "parquet")]

#: Fields that say when, where or by which code a record was made, not what it holds (the files
#: manifest's mtime_ns and inode: when and where a file was written).
VOLATILE = frozenset({"created", "created_at", "finished_at", "started_at", "timings", "worker", "host",
                      "elapsed", "latency", "version", "request_id", "shard", "attempt", "mtime_ns", "inode"})


#: In the text files (the dataset card): when the run was made.
MOMENT = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(:\d{2})?( UTC)?")


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    if path.suffix == ".jsonl":
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    if path.suffix == ".json":  # the files manifest: one object
        return [orjson.loads(path.read_bytes())]
    try:
        text = path.read_text()  # the missing file, the dataset card
        return MOMENT.sub("<moment>", text).splitlines()
    except UnicodeDecodeError:  # a binary file (an image): its bytes, as they are
        return [path.read_bytes().hex()]


def digests(path: Path) -> tuple[str, str, int]:
    """(raw sha256, normalised sha256, rows) of one exported file."""
    raw = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    rows = _rows(path)
    norm = hashlib.sha256(b"\n".join(orjson.dumps(_normal(r), option=orjson.OPT_SORT_KEYS) for r in rows))
    return raw, norm.hexdigest()[:12], len(rows)


def pipeline(tree: Path, work: Path, data: Path, endpoint: str) -> dict[str, tuple[str, str, int]]:
    """Run the demo pipeline with TREE's code; every exported file's digests by name."""
    redis_proc, url = start_redis(work)
    env = {**os.environ, "REDIS_URL": url, "PYTHONPATH": str(tree)}

    def run(prog: str, *args: str) -> None:
        subprocess.run([*_entry(tree, prog), *args], env=env, cwd=tree, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    out = work / "out"
    try:
        run("producer", "enqueue", str(data), "--run", "demo", "--output", str(out), "--max-tokens", "512",
            "--token-ids", "--rejects", str(work / "rejects.jsonl"))
        run("consumer", "run", "--run", "demo", "--endpoint", endpoint, "--burst", "--spool", str(work / "spool"),
            "--shard-max-age", "2")
        found: dict[str, tuple[str, str, int]] = {}
        for fmt, rows, suffix in EXPORTS:
            name = f"{fmt}-{rows or 'default'}"
            dest = work / "export" / name / f"data.{suffix}"
            dest.parent.mkdir(parents=True)
            run("producer", "export", "--run", "demo", "--output", str(dest), "--format", fmt,
                *(["--rows", rows] if rows else []), "--allow-partial")
            for f in sorted(dest.parent.iterdir()):
                found[f"{name}/{f.name}"] = digests(f)
        return found
    finally:
        redis_proc.terminate()
        redis_proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs="+", help="git revisions; . is the working tree")
    ap.add_argument("--input", type=Path, default=HERE / "samples" / "sample.jsonl")
    ap.add_argument("--keep", type=Path, help="keep each revision's outputs under this directory")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gq-export-bytes-"))
    trees: dict[str, Path] = {}
    results: dict[str, dict[str, tuple[str, str, int]]] = {}
    sim = None
    try:
        sim, endpoint = start_sim(["--slots", "64", "--step-time", "0.002", "--mean-tokens", "120"])
        for n, rev in enumerate(args.revisions):
            trees[rev] = _checkout(rev, work)
            _check_imports(trees[rev])
            # one place for every revision: the output is part of a run's settings, so of its fingerprint
            place = work / "run"
            shutil.rmtree(place, ignore_errors=True)
            place.mkdir()
            results[rev] = pipeline(trees[rev], place, args.input.resolve(), endpoint)
            if args.keep is not None:
                shutil.copytree(place / "export", args.keep / f"{n}-{rev.replace('/', '_').replace('.', 'worktree')}",
                                dirs_exist_ok=True)
    finally:
        if sim is not None:
            sim.terminate()
        for tree in trees.values():
            if tree != HERE:
                subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)], check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    first = args.revisions[0]
    names = sorted(set().union(*(r.keys() for r in results.values())))
    header = ("file", "rows", *(f"{rev} raw / norm" for rev in args.revisions), "same")
    lines = [header]
    differ = 0
    for name in names:
        cells = [results[rev].get(name) for rev in args.revisions]
        base = results[first].get(name)
        same = all(c is not None and base is not None and c[1] == base[1] for c in cells)
        raw_same = all(c is not None and base is not None and c[0] == base[0] for c in cells)
        differ += not same
        lines.append((name, str(base[2] if base else "-"),
                      *(f"{c[0]} / {c[1]}" if c else "-" for c in cells),
                      "bytes" if raw_same else "normalised" if same else "NO"))
    print(table(lines))
    print(f"{len(names)} files; {differ} differ after normalising (dropped fields: {', '.join(sorted(VOLATILE))})")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
