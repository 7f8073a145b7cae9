"""Coverage, computed by Redis: which enqueued items the export found no record of.

The export adds every key it wrote (dataset, truncated or errors file) to a temporary set;
its difference with the run's key set leaves the missing ones, in Redis, whatever their
number (common/keepers/exportsets.py). The missing file says which records they are: key, id, source
and position, tab-separated, read back from the jobs rq still holds (queued, started, failed,
finished); a key no job holds any more has its key alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import redis

from genqueue.common.keepers.exportsets import ExportSets, ScratchKeys, ScratchSet
from genqueue.common.keepers.rqaccess import JobPlace
from genqueue.common.keepers.rqjobs import ItemsOf, JobScan, read_jobs, scan_jobs

#: Bytes buffered before the coverage files are written: one write per 256 KB, not per line.
_WRITE_BUFFER = 256 * 1024


def coverage(conn: redis.Redis, run: str, seen_key: str, missing_key: str, missing_path: Path,
             scan: JobScan, items_of: ItemsOf | None = None) -> tuple[int, int, int]:
    """(enqueued, missing, unexpected) for RUN, with the missing file written to MISSING_PATH.
    Unexpected: keys with records that the run never enqueued (an older run of that name).
    Every job of the run is checked (its payload too when items are missing), the bad ones
    noted in SCAN. ITEMS_OF reads the items of jobs by reference (their packs)."""
    enqueued, seen, missing = ExportSets(conn, run, ScratchKeys(seen_key, missing_key)).coverage()
    with open(missing_path, "wb", buffering=_WRITE_BUFFER) as fh:
        if missing:
            _write_missing(conn, run, fh, missing_key, scan, items_of)
        else:  # nothing to look up in the jobs: check what rq needs to load them, cheaply
            scan_jobs(conn, run, scan=scan)
    return enqueued, missing, seen - (enqueued - missing)


def _write_missing(conn: redis.Redis, run: str, fh: IO[bytes], missing_key: str, scan: JobScan,
                   items_of: ItemsOf | None) -> None:
    """Items still in a job rq holds first, with their provenance (each taken out of the
    temporary set as it is written); then the keys no job holds."""
    for job in read_jobs(conn, run, list(JobPlace), scan=scan, items_of=items_of):
        items = job.items
        digests = [bytes.fromhex(it["key"]) for it in items]
        flags = ScratchSet(conn, missing_key).members(digests)
        found = [it for it, missing in zip(items, flags, strict=True) if missing]
        if not found:
            continue
        fh.writelines(missing_line(it["key"], it.get("id"), it.get("source"), it.get("index")) for it in found)
        ScratchSet(conn, missing_key).remove([bytes.fromhex(it["key"]) for it in found])
    fh.writelines(missing_line(d.hex(), None, None, None) for d in ScratchSet(conn, missing_key).each_member())


def missing_line(key: str, rid: object, source: object, index: object) -> bytes:
    """One line of the missing file: key, id, source, position; empty where unknown."""
    cols = [key, _cell(rid), _cell(source), "" if index is None else str(index)]
    return "\t".join(cols).encode() + b"\n"


def _cell(value: object) -> str:
    if value is None:
        return ""
    return str(value).replace("\t", " ").replace("\n", " ").replace("\r", " ")
