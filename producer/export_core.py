"""The export engine: every shard of a run in, one deduplicated dataset out, in bounded memory.

Pass 1 streams every shard line once, converts it to the output format, and appends it with a
small binary header (key digest, index, turn, tie-break fields) to one of K partition files
chosen by the record's `index` range. Every record of one key shares one index, so all copies
of an item land in the same partition. Pass 2 takes the partitions in index order: one at a
time in memory, keeps one record per key, sorts by (index, turn, key) and appends to the
output (successes) or the errors file (keys that only have error records). K is sized so a
partition holds about `partition_bytes` of shard data: memory stays flat as the run grows.

Which copy of a duplicated item is kept (deterministic, whatever order shards are read in):
a success record beats an error record; then the lowest `attempt`; then the earliest
`timings.finished_at`; then the first in shard-name order, then line order.

Coverage is computed by Redis, not in client memory: the exported keys are SADDed in batches
to a temporary set, and SDIFFSTORE against the run's key set yields the missing items.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import redis

from genqueue.common.contracts import ErrorClass, error_info
from genqueue.common.rqaccess import failed_jobs
from genqueue.common.runs import RunStore, run_key
from genqueue.common.storage import ShardInfo
from genqueue.producer.export_formats import CONVERTERS
from genqueue.producer.export_sources import OpenShard, ShardSource

log = logging.getLogger(__name__)

#: Shard bytes per partition: pass 2 holds about this much (plus a small index) in memory.
PARTITION_BYTES = 64 * 1024 * 1024
MAX_PARTITIONS = 512
SADD_BATCH = 10_000
TEMP_KEY_TTL = 24 * 3600
WRITE_BUFFER = 256 * 1024

# key digest, index, turn (-1: none), is_error, attempt, finished_at, shard ordinal, line, and the
# length of the blob that follows: the output line, or the raw line of an error record.
_HEADER = struct.Struct("<16sqiBIdIII")


@dataclass
class ExportResult:
    """What an export did: the coverage numbers, and where everything was written."""

    run: str
    format: str
    output: str
    errors_path: str
    missing_path: str
    source: str
    shards: int = 0
    records_read: int = 0
    enqueued: int = 0
    exported: int = 0
    failed: int = 0
    missing: int = 0
    duplicates_removed: int = 0
    failed_jobs: int = 0
    unexpected: int = 0
    bad_lines: int = 0
    bad_shards: int = 0
    seconds: float = 0.0
    failed_by_class: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_writer(path: Path) -> IO[bytes]:
    """A binary writer for PATH, compressed by its suffix: .gz (gzip), .zst (zstd), else plain."""
    name = path.name.removesuffix(".tmp")
    if name.endswith(".gz"):
        import gzip

        # Level 1: ~160 MB/s against ~75 at 3 for nearly the same size; .zst is better at both.
        return gzip.open(path, "wb", compresslevel=1)  # type: ignore[return-value]
    if name.endswith((".zst", ".zstd")):
        import zstandard

        fh = open(path, "wb")  # noqa: SIM115 - closed with the stream writer
        writer: IO[bytes] = zstandard.ZstdCompressor(level=3).stream_writer(fh, closefd=True)
        return writer
    return open(path, "wb", buffering=WRITE_BUFFER)


class Exporter:
    """Exports one run from SOURCE to OUTPUT in FMT; see the module docstring."""

    def __init__(self, conn: redis.Redis, run: str, source: ShardSource, *, fmt: str, output: Path,
                 errors_path: Path, missing_path: Path, workdir: Path,
                 partition_bytes: int = PARTITION_BYTES) -> None:
        self.conn = conn
        self.run = run
        self.source = source
        self.convert: Callable[[dict[str, Any]], dict[str, Any]] = CONVERTERS[fmt]
        self.paths = {"output": output, "errors": errors_path, "missing": missing_path}
        self.workdir = workdir
        self.partition_bytes = partition_bytes
        self.result = ExportResult(run, fmt, str(output), str(errors_path), str(missing_path), source.where)

    def export(self) -> ExportResult:
        """Run both passes and the coverage check; the three files appear only on success."""
        t0 = time.monotonic()
        shards = self.source.list_shards()
        self.result.shards = len(shards)
        tmp = Path(tempfile.mkdtemp(prefix=".gq-export-", dir=self.workdir))
        seen_key = run_key(self.run, f"export:{uuid.uuid4().hex}:seen")
        missing_key = seen_key.removesuffix(":seen") + ":missing"
        finals = {k: p.with_name(p.name + ".tmp") for k, p in self.paths.items()}
        try:
            parts = self._partition(shards, tmp)
            with open_writer(finals["output"]) as out, open_writer(finals["errors"]) as errs:
                for i, part in enumerate(parts):
                    self._reduce(part, out, errs, seen_key)
                    part.unlink()
                    log.info("partition %d/%d done", i + 1, len(parts))
                self._failed_jobs(errs, seen_key)
            self._coverage(seen_key, missing_key, finals["missing"])
            for k, p in self.paths.items():
                os.replace(finals[k], p)
        finally:
            self.conn.delete(seen_key, missing_key)
            shutil.rmtree(tmp, ignore_errors=True)
            for p in finals.values():
                p.unlink(missing_ok=True)
        self.result.seconds = round(time.monotonic() - t0, 3)
        return self.result

    # --- pass 1 --------------------------------------------------------------------
    def _partitions_for(self, shards: list[ShardInfo]) -> tuple[int, int]:
        total = sum(s.bytes for s in shards)
        k = max(1, min(MAX_PARTITIONS, math.ceil(total / self.partition_bytes)))
        bound = self._index_bound()
        return k, max(1, math.ceil(bound / k))

    def _index_bound(self) -> int:
        """An upper bound of `index`: the largest source's record count (indexes are 0-based
        per source), else the number of items. Larger indexes go to the last partition."""
        store = RunStore(self.conn)
        records = [int(s.get("records", 0)) for s in store.sources(self.run).values()]
        return max([*records, store.item_count(self.run), 1])

    def _partition(self, shards: list[ShardInfo], tmp: Path) -> list[Path]:
        k, span = self._partitions_for(shards)
        paths = [tmp / f"part-{i:04d}" for i in range(k)]
        files = [open(p, "wb", buffering=WRITE_BUFFER) for p in paths]  # noqa: SIM115
        log.info("reading %d shards from %s into %d partitions of %d indexes", len(shards),
                 self.source.where, k, span)
        try:
            for ordinal, shard in enumerate(self.source.each(shards)):
                self._split(shard, ordinal, files, span)
        finally:
            for f in files:
                f.close()
        return paths

    def _split(self, shard: OpenShard, ordinal: int, files: Sequence[IO[bytes]], span: int) -> None:
        last = len(files) - 1
        convert = self.convert
        pack = _HEADER.pack
        loads, dumps = orjson.loads, orjson.dumps
        digest = hashlib.sha256()
        size = records = bad = blank = 0
        for lineno, line in enumerate(shard.fh):
            digest.update(line)
            size += len(line)
            records += 1
            try:
                rec = loads(line)
                key = bytes.fromhex(rec["key"])
                if len(key) != 16:
                    raise ValueError("key is not 16 bytes")
                index = int(rec["index"])
                turn = rec.get("turn")
                is_error = "error" in rec
                blob = (line if line.endswith(b"\n") else line + b"\n") if is_error else dumps(convert(rec)) + b"\n"
                header = pack(key, index, -1 if turn is None else int(turn), is_error,
                              int(rec.get("attempt") or 0),
                              float((rec.get("timings") or {}).get("finished_at") or math.inf), ordinal, lineno,
                              len(blob))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, struct.error):
                if line.strip():
                    bad += 1
                else:
                    blank += 1
                continue
            f = files[min(max(index, 0) // span, last)]
            f.write(header)
            f.write(blob)
        self.result.records_read += records - bad - blank
        self.result.bad_lines += bad
        name, man = shard.info.name, shard.manifest
        if bad:
            log.warning("%s: %d unreadable lines skipped", name, bad)
        if man is not None and (man["sha256"] != digest.hexdigest() or size != shard.info.bytes
                                or man["records"] != records):
            self.result.bad_shards += 1
            log.warning("%s does not match its manifest (sha256, size or record count): read anyway", name)

    # --- pass 2 --------------------------------------------------------------------
    def _reduce(self, part: Path, out: IO[bytes], errs: IO[bytes], seen_key: str) -> None:
        data = part.read_bytes()
        view = memoryview(data)
        unpack = _HEADER.unpack_from
        hsize = _HEADER.size
        best: dict[bytes, tuple[tuple[int, int, float, int, int], int, int, int, int]] = {}
        pos = n = 0
        end_all = len(data)
        while pos < end_all:
            key, index, turn, is_error, attempt, finished, ordinal, lineno, blen = unpack(data, pos)
            start = pos + hsize
            pos = start + blen
            n += 1
            rank = (is_error, attempt, finished, ordinal, lineno)
            cur = best.get(key)
            if cur is None or rank < cur[0]:
                best[key] = (rank, index, turn, start, pos)
        self.result.duplicates_removed += n - len(best)
        batch: list[bytes] = []
        for key, (rank, _i, _t, start, stop) in sorted(best.items(), key=lambda kv: (kv[1][1], kv[1][2], kv[0])):
            if rank[0]:
                errs.write(view[start:stop])
                self.result.failed += 1
                self._count_failure(bytes(view[start:stop]))
            else:
                out.write(view[start:stop])
                self.result.exported += 1
            batch.append(key)
            if len(batch) >= SADD_BATCH:
                self._sadd(seen_key, batch)
                batch = []
        if batch:
            self._sadd(seen_key, batch)
        view.release()

    def _count_failure(self, line: bytes) -> None:
        try:
            cls = str(orjson.loads(line)["error"]["class"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            cls = "unknown"
        by = self.result.failed_by_class
        by[cls] = by.get(cls, 0) + 1

    def _sadd(self, seen_key: str, digests: list[bytes]) -> None:
        with self.conn.pipeline(transaction=False) as p:
            p.sadd(seen_key, *digests)
            p.expire(seen_key, TEMP_KEY_TTL)
            p.execute()

    def _failed_jobs(self, errs: IO[bytes], seen_key: str) -> None:
        """Items of jobs that rq gave up on (their retries spent: abandoned by consumer after
        consumer) and that no shard holds are permanently failed, not missing: each gets an
        error record with rq's reason. `rq requeue` brings them back; a later export sees them."""
        for job in failed_jobs(self.conn, self.run):
            digests = [bytes.fromhex(it["key"]) for it in job.items]
            present = self.conn.smismember(seen_key, digests) if digests else []
            lost = [it for it, seen in zip(job.items, present, strict=True) if not seen]
            for it in lost:
                errs.write(orjson.dumps({
                    "key": it["key"], "index": it["index"], "turn": it.get("turn"), "run": self.run,
                    "messages": it["messages"],
                    "error": error_info(ErrorClass.JOB_FAILED, "rq", f"job {job.id} failed in rq: {job.reason}"),
                }) + b"\n")
            if lost:
                self._sadd(seen_key, [bytes.fromhex(it["key"]) for it in lost])
                self.result.failed += len(lost)
                self.result.failed_jobs += 1
                by = self.result.failed_by_class
                by[ErrorClass.JOB_FAILED.value] = by.get(ErrorClass.JOB_FAILED.value, 0) + len(lost)

    # --- coverage ------------------------------------------------------------------
    def _coverage(self, seen_key: str, missing_key: str, missing_path: Path) -> None:
        keys = run_key(self.run, "keys")
        r = self.result
        r.enqueued = int(self.conn.scard(keys))
        seen = int(self.conn.scard(seen_key))
        r.missing = int(self.conn.sdiffstore(missing_key, [keys, seen_key]))
        self.conn.expire(missing_key, TEMP_KEY_TTL)
        # seen - (enqueued - missing) = keys with records that the run never enqueued.
        r.unexpected = seen - (r.enqueued - r.missing)
        with open(missing_path, "wb", buffering=WRITE_BUFFER) as fh:
            fh.writelines(digest.hex().encode() + b"\n" for digest in self.conn.sscan_iter(missing_key, count=SADD_BATCH))
        if r.unexpected:
            log.warning("%d keys in the shards were never enqueued in run %s (an older run of the same "
                        "name?); they are exported too", r.unexpected, self.run)
