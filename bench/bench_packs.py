"""Pack formats for prompts by reference (issue 34): size, write speed, and the cost of one job's range.

    python -m bench.bench_packs --items 16384

Builds N items as the producer enqueues them (regenerate mode: a system prompt on some, then
1-4 user turns, 1-4 KB of text in all, with key, index, turn and provenance) from real prose
and code (the docstrings of Python's standard library, cut into paragraphs and drawn at
random), then writes them as one pack in each candidate format:

- genqueue's pack (common/packs.py): a zstd frame per block of items, an index at the end;
- Parquet (pyarrow), one row group per block, a key column and the item's JSON, zstd;
- Arrow IPC file (pyarrow), one record batch per block, the same columns, zstd buffers.

For each: the pack's size against the items' JSON, the time to write it, and the cost of
reading one job's range (32 items, block-aligned, as the producer cuts jobs): from the pack
held in memory with its index already parsed (a consumer's cache), from a file opened for
the read (footer, index, then the block), and the bytes that file read took, which is what a
ranged GET of the pack fetches (against the whole pack). Every read decodes to the items'
dicts, which is what the consumer needs. Prints one table; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import statistics
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import ipc

from bench.common import table
from genqueue.common import packs
from genqueue.common.storage.packreader import TAIL_BYTES

SYSTEM = "You are a careful assistant. Answer precisely and show your reasoning when it helps."


def corpus() -> list[str]:
    """Sentences of the standard library's docstrings (tests left out): English prose mixed with
    code, about 2 MB of it."""
    rx = re.compile(r'"""(.*?)"""', re.DOTALL)
    sentences: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages"} & set(path.parts):
            continue
        for doc in rx.findall(path.read_text(errors="replace")):
            sentences += [s.strip() for s in re.split(r"(?<=[.!?:])\s+", doc) if len(s.strip()) > 20]
    return sentences


def make_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """N items of 1-4 KB of text each, as producer/ingest/items.py makes them in regenerate mode.
    Each turn strings sentences of the corpus together with one word in six swapped for a random
    word of it: every conversation is its own, as in a real dataset, and no block (however
    large) finds whole paragraphs repeated from the corpus, which would flatter large blocks."""
    rng = random.Random(seed)
    sentences = corpus()
    words = [w for s in sentences[::7] for w in s.split()]
    items = []
    for i in range(n):
        target = rng.randint(1000, 4000)
        turns = rng.randint(1, 4)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}] if i % 5 == 0 else []
        for t in range(turns):
            parts: list[str] = []
            size = 0
            while size < target // turns:
                ws = [w if rng.random() > 1 / 6 else rng.choice(words) for w in rng.choice(sentences).split()]
                parts.append(" ".join(ws))
                size += len(parts[-1]) + 1
            msgs.append({"role": "user", "content": f"{' '.join(parts)[: target // turns]} ({i}.{t})"})
        items.append({"key": rng.getrandbits(128).to_bytes(16).hex(), "index": i, "turn": None, "messages": msgs,
                      "id": f"rec-{i}", "source": "/data/sharegpt-part-0001.jsonl", "source_seq": 0})
    return items


class CountingFile(io.RawIOBase):
    """A file that counts the bytes read from it: what a ranged GET would fetch."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "rb")  # noqa: SIM115 - closed with this object
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.fh.seek(pos, whence)

    def tell(self) -> int:
        return self.fh.tell()

    def readinto(self, b: Any) -> int:
        n = self.fh.readinto(b)
        self.read_bytes += n or 0
        return n or 0

    def read(self, size: int = -1) -> bytes:
        data = self.fh.read(size)
        self.read_bytes += len(data)
        return data

    def close(self) -> None:
        self.fh.close()
        super().close()


# --- the candidates: write, read from memory (index kept), read from a file ----------------------
class Format:
    name: str

    def write(self, items: list[dict[str, Any]]) -> bytes: ...

    def open_memory(self, data: bytes) -> Any: ...

    def read_memory(self, handle: Any, block: int) -> list[dict[str, Any]]: ...

    def open_file(self, fh: CountingFile, size: int) -> Any: ...

    def read_file(self, handle: Any, block: int) -> list[dict[str, Any]]: ...


class GenqueuePack(Format):
    def __init__(self, block_items: int, level: int) -> None:
        self.block_items, self.level = block_items, level
        self.name = f"zstd frame per block (packs.py), {block_items}/block, level {level}"

    def write(self, items: list[dict[str, Any]]) -> bytes:
        return packs.write_pack(items, block_items=self.block_items, level=self.level)  # type: ignore[arg-type]

    def open_memory(self, data: bytes) -> Any:
        return data, packs.read_index(data, "bench")

    def read_memory(self, handle: Any, block: int) -> list[dict[str, Any]]:
        data, index = handle
        return packs.read_items(data, block * JOB, JOB, "bench", index=index)  # type: ignore[return-value]

    def open_file(self, fh: CountingFile, size: int) -> Any:
        fh.seek(max(size - TAIL, 0))
        got = packs.index_from_tail(fh.read(), size, "bench")
        if isinstance(got, packs.Footer):
            fh.seek(got.index_offset)
            got = packs.parse_index(fh.read(got.index_length), got, "bench")
        return fh, got

    def read_file(self, handle: Any, block: int) -> list[dict[str, Any]]:
        fh, index = handle
        lo, hi = index.span(block * JOB, JOB, "bench")
        fh.seek(lo)
        return packs.read_span(fh.read(hi - lo), lo, index, block * JOB, JOB, "bench")  # type: ignore[return-value]


def _table(items: list[dict[str, Any]]) -> pa.Table:
    return pa.table({"key": pa.array([it["key"] for it in items], pa.string()),
                     "item": pa.array([orjson.dumps(it) for it in items], pa.binary())})


def _decode(t: pa.Table | pa.RecordBatch) -> list[dict[str, Any]]:
    return [orjson.loads(b) for b in t.column("item").to_pylist()]


class ParquetPack(Format):
    def __init__(self, block_items: int) -> None:
        self.block_items = block_items
        self.name = f"Parquet, row group of {block_items}, zstd"

    def write(self, items: list[dict[str, Any]]) -> bytes:
        sink = io.BytesIO()
        pq.write_table(_table(items), sink, row_group_size=self.block_items, compression="zstd",
                       use_dictionary=False, write_statistics=False)
        return sink.getvalue()

    def open_memory(self, data: bytes) -> Any:
        return pq.ParquetFile(pa.BufferReader(data))

    def read_memory(self, handle: Any, block: int) -> list[dict[str, Any]]:
        return self._rows(handle, block)

    def _rows(self, pf: Any, block: int) -> list[dict[str, Any]]:
        per = self.block_items
        first = block * JOB // per
        rows = pf.read_row_groups(list(range(first, (block * JOB + JOB - 1) // per + 1)), columns=["item"])
        return _decode(rows.slice(block * JOB - first * per, JOB))

    def open_file(self, fh: CountingFile, size: int) -> Any:
        return pq.ParquetFile(pa.PythonFile(fh, mode="r"), pre_buffer=False)

    def read_file(self, handle: Any, block: int) -> list[dict[str, Any]]:
        return self._rows(handle, block)


class ArrowPack(Format):
    def __init__(self, block_items: int) -> None:
        self.block_items = block_items
        self.name = f"Arrow IPC file, batch of {block_items}, zstd"

    def write(self, items: list[dict[str, Any]]) -> bytes:
        t = _table(items)
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, t.schema, options=ipc.IpcWriteOptions(compression="zstd")) as w:
            for b in t.to_batches(max_chunksize=self.block_items):
                w.write_batch(b)
        return bytes(sink.getvalue())

    def open_memory(self, data: bytes) -> Any:
        return ipc.open_file(pa.BufferReader(data))

    def read_memory(self, handle: Any, block: int) -> list[dict[str, Any]]:
        return self._rows(handle, block)

    def _rows(self, r: Any, block: int) -> list[dict[str, Any]]:
        per = self.block_items
        first, last = block * JOB // per, (block * JOB + JOB - 1) // per
        t = pa.Table.from_batches([r.get_batch(i) for i in range(first, last + 1)])
        return _decode(t.slice(block * JOB - first * per, JOB))

    def open_file(self, fh: CountingFile, size: int) -> Any:
        return ipc.open_file(pa.PythonFile(fh, mode="r"))

    def read_file(self, handle: Any, block: int) -> list[dict[str, Any]]:
        return self._rows(handle, block)


JOB = 32
TAIL = TAIL_BYTES


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The median seconds of REPEAT calls of FN, and its last result."""
    times = []
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=16384)
    ap.add_argument("--reads", type=int, default=200, help="job ranges read per format")
    args = ap.parse_args()
    t0 = time.perf_counter()
    items = make_items(args.items)
    raw = sum(len(orjson.dumps(it)) for it in items)
    text = sum(len(m["content"]) for it in items for m in it["messages"])
    print(f"built {args.items:,} items ({raw / 1e6:.1f} MB of JSON, {text / args.items:,.0f} characters of text "
          f"per item) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    formats: list[Format] = [GenqueuePack(32, 3), GenqueuePack(32, 1), GenqueuePack(32, 9), GenqueuePack(128, 3),
                             GenqueuePack(512, 3), ParquetPack(32), ParquetPack(1024), ArrowPack(32), ArrowPack(1024)]
    rng = random.Random(1)
    jobs = [rng.randrange(args.items // JOB) for _ in range(args.reads)]
    rows = [("format", "pack MB", "JSON/pack", "write s", "items/s written", "memory us",
             "file, cold us", "cold bytes", "file, warm us", "warm bytes", "warm/pack")]
    # today's reference: what rq stores per job, the items' JSON compressed by zlib at level 1
    # (common/keepers/rqaccess.py _FastZlib), a job of 32 at a time; size and write only
    zlib_s, zsize = timed(lambda: sum(len(zlib.compress(orjson.dumps(items[i:i + JOB]), 1))
                                      for i in range(0, len(items), JOB)), 3)
    rows.append(("today: rq job payloads, zlib level 1 per 32 items", f"{zsize / 1e6:.2f}", f"{raw / zsize:.2f}",
                 f"{zlib_s:.2f}", f"{args.items / zlib_s:,.0f}", "-", "-", "-", "-", "-", "-"))
    with tempfile.TemporaryDirectory(prefix="gq-bench-packs-") as tmp:
        for fmt in formats:
            write_s, data = timed(lambda f=fmt: f.write(items), 3)  # type: ignore[misc]
            handle = fmt.open_memory(data)
            for b in jobs[:3]:  # every candidate reads back exactly what was written
                assert fmt.read_memory(handle, b) == items[b * JOB:b * JOB + JOB], fmt.name
            mem_s = statistics.median(timed(lambda f=fmt, b=b, h=handle: f.read_memory(h, b), 1)[0]  # type: ignore[misc]
                                      for b in jobs)
            path = Path(tmp) / "pack"
            path.write_bytes(data)
            cold_s, cold_b, warm_s, warm_b = [], [], [], []
            for b in jobs:
                fh = CountingFile(path)
                t1 = time.perf_counter()
                handle_f = fmt.open_file(fh, len(data))
                got = fmt.read_file(handle_f, b)
                cold_s.append(time.perf_counter() - t1)
                cold_b.append(fh.read_bytes)
                b2 = jobs[(jobs.index(b) + 1) % len(jobs)]
                fh.read_bytes = 0
                t1 = time.perf_counter()
                got2 = fmt.read_file(handle_f, b2)  # a further range of a pack whose index is held
                warm_s.append(time.perf_counter() - t1)
                warm_b.append(fh.read_bytes)
                fh.close()
                if b == jobs[0]:
                    assert got == items[b * JOB:b * JOB + JOB], fmt.name
                    assert got2 == items[b2 * JOB:b2 * JOB + JOB], fmt.name
            med = statistics.median
            rows.append((fmt.name, f"{len(data) / 1e6:.2f}", f"{raw / len(data):.2f}", f"{write_s:.2f}",
                         f"{args.items / write_s:,.0f}", f"{mem_s * 1e6:,.0f}",
                         f"{med(cold_s) * 1e6:,.0f}", f"{med(cold_b):,.0f}", f"{med(warm_s) * 1e6:,.0f}",
                         f"{med(warm_b):,.0f}", f"{med(warm_b) / len(data):.2%}"))
            print(f"  {fmt.name}: done", file=sys.stderr)
    print(f"{args.items:,} items, {raw / 1e6:.1f} MB of JSON ({raw / args.items:,.0f} B/item), jobs of {JOB} items "
          f"(block-aligned); median of {args.reads} ranges")
    print(table(rows))


if __name__ == "__main__":
    main()
