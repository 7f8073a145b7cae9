"""A full disk is one `error:` line for every file the producer writes, on a real small disk.

Each test mounts a 2 MiB tmpfs (root only: skipped with the reason otherwise), points one
writer at it and checks: exit 1, one line naming the file, the bytes written and the option
that moves it; nothing partial left under any name; what came before still consistent.
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from tests.conftest import cli, small_tmpfs, write_jsonl
from tests.producer.export.test_export import RUN, error, key, success, write_shard

pytestmark = pytest.mark.integration

DISK = "2m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of the test's own, unmounted after it."""
    with small_tmpfs(tmp_path / "small", DISK) as mnt:
        yield mnt


def fill(disk: Path) -> None:
    """Write DISK full."""
    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(bytes(1 << 16))
                fh.flush()
        except OSError:
            pass


def one_error_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def blob(n: int) -> str:
    """N characters that compress poorly, as a dataset of real answers does."""
    return base64.b64encode(os.urandom(n * 3 // 4)).decode()


# --- export ------------------------------------------------------------------------------------
N = 4500  # items; a third each: dataset, errors file, truncated file: about 6 MB each
MISSING = 70_000  # enqueued keys with no record: a missing file of about 2.6 MB


@pytest.fixture
def big_run(tmp_path: Path, conn: redis.Redis) -> Path:
    """A run whose every export file is larger than the small disk; returns its output."""
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out)))
    recs: list[dict[str, Any]] = []
    for i in range(N):
        if i % 3 == 1:
            recs.append(error(i, message=blob(3000)))
            continue
        rec = success(i, tag=blob(3000))
        if i % 3 == 2:
            rec["outcome"] = "cut_in_thinking"
        recs.append(rec)
    write_shard(out, "w1-000001.jsonl", recs)
    ItemTable(conn, RUN).change([bytes.fromhex(key(i)) for i in range(N)], add=IN_RUN)
    ItemTable(conn, RUN).change([os.urandom(16) for _ in range(MISSING)], add=IN_RUN)
    return out


def export(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("producer", "export", "--run", RUN, "--allow-partial", *args, env={"REDIS_URL": redis_url},
               check=False)


@pytest.mark.parametrize("name", ["ds.jsonl", "ds.jsonl.gz", "ds.jsonl.zst", "ds.parquet"])
def test_export_dataset_to_a_full_disk(big_run: Path, small_disk: Path, tmp_path: Path, redis_url: str,
                                       name: str) -> None:
    side = tmp_path / "side"
    side.mkdir()
    proc = export(redis_url, "--output", str(small_disk / name), "--tmp-dir", str(tmp_path),
                  "--errors", str(side / "e.jsonl"), "--truncated", str(side / "t.jsonl"),
                  "--missing", str(side / "m.txt"))
    line = one_error_line(proc, 1, f"output file {small_disk}/.gq-tmp-", f"-{name}: no space left on device: wrote ",
                          " bytes) before the disk filled", f"free in {small_disk}", "--output")
    assert "MB (" in line
    assert sorted(os.listdir(small_disk)) == [] and sorted(os.listdir(side)) == []  # nothing partial, anywhere
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".gq-export-")]  # partitions removed


@pytest.mark.parametrize(("option", "what"), [("--errors", "errors file"), ("--truncated", "truncated file"),
                                              ("--missing", "missing file")])
def test_export_side_files_to_a_full_disk(big_run: Path, small_disk: Path, tmp_path: Path, redis_url: str,
                                          option: str, what: str) -> None:
    ds = tmp_path / "ds.jsonl"
    target = small_disk / "side.txt"
    proc = export(redis_url, "--output", str(ds), option, str(target))
    one_error_line(proc, 1, f"{what} {small_disk}/.gq-tmp-", f"-{target.name}: no space left on device: wrote ",
                   option)
    assert os.listdir(small_disk) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("ds.", ".gq-export-"))]


def test_export_tmp_partitions_on_a_full_disk(big_run: Path, small_disk: Path, tmp_path: Path, redis_url: str) -> None:
    ds = tmp_path / "ds.jsonl"
    proc = export(redis_url, "--output", str(ds), "--tmp-dir", str(small_disk), "--partition-mb", "1")
    one_error_line(proc, 1, f"temporary partition files {small_disk}/.gq-export-", "before the disk filled",
                   "(it needs about ", "--tmp-dir")
    assert os.listdir(small_disk) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith("ds.")]
    # the same export with room works
    assert export(redis_url, "--output", str(ds), "--tmp-dir", str(tmp_path)).returncode == 0, "with room"
    assert ds.read_bytes().count(b"\n") == N // 3


def test_export_to_a_disk_full_already_is_refused_up_front(big_run: Path, small_disk: Path, tmp_path: Path,
                                                           redis_url: str) -> None:
    fill(small_disk)
    proc = export(redis_url, "--output", str(small_disk / "ds.jsonl"), "--tmp-dir", str(tmp_path))
    one_error_line(proc, 2, f"cannot write output file {small_disk / 'ds.jsonl'}: No space left on device",
                   "--output")
    proc = export(redis_url, "--output", str(tmp_path / "ds.jsonl"), "--tmp-dir", str(small_disk))
    one_error_line(proc, 2, f"cannot write temporary partition files {small_disk}: No space left", "--tmp-dir")
    assert os.listdir(small_disk) == ["filler"]


# --- enqueue -----------------------------------------------------------------------------------
GOOD = 5000


def mixed_input(path: Path) -> Path:
    """GOOD records, then 8000 lines that are not JSON (3 MB of rejects)."""
    good: list[object] = [{"id": f"g{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(GOOD)]
    write_jsonl(path, good)
    with open(path, "ab") as fh:
        fh.writelines(f"not json {i} {blob(290)}\n".encode() for i in range(8000))
    return path


def enqueue(redis_url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli("producer", "enqueue", *args, env={"REDIS_URL": redis_url, **(env or {})}, check=False)


def queued_items(conn: redis.Redis, run: str) -> int:
    """Items in the run's rq jobs (each job's payload lists its items)."""
    from genqueue.common.keepers.rqaccess import JobPlace
    from genqueue.common.keepers.rqjobs import JobScan, read_jobs

    return sum(len(job.items) for job in read_jobs(conn, run, tuple(JobPlace), scan=JobScan()))


def test_enqueue_rejects_file_on_a_full_disk(small_disk: Path, tmp_path: Path, redis_url: str,
                                             conn: redis.Redis) -> None:
    data = mixed_input(tmp_path / "mixed.jsonl")
    rej = small_disk / "r.jsonl"
    args = (str(data), "--run", "mixed", "--output", str(tmp_path / "out"), "--json")
    line = one_error_line(enqueue(redis_url, *args, "--rejects", str(rej)), 1,
                          f"rejects file {rej}.", ".partial: no space left on device: wrote ", "--rejects",
                          "items were queued before it and stay queued")
    assert os.listdir(small_disk) == []  # no rejects file that looks complete, no .partial
    before = queued_items(conn, "mixed")
    assert f"{before:,} items were queued" in line and 0 < before < GOOD
    # the same command with room queues the rest, and each item once
    proc = enqueue(redis_url, *args, "--rejects", str(tmp_path / "r.jsonl"))
    assert proc.returncode == 0, proc.stderr
    s = orjson.loads(proc.stdout)
    assert (s["enqueued"], s["already_queued"], s["rejected"]) == (GOOD - before, before, 8000)
    assert queued_items(conn, "mixed") == GOOD


def test_enqueue_rejects_to_a_disk_full_already_creates_no_run(small_disk: Path, tmp_path: Path, redis_url: str,
                                                               conn: redis.Redis) -> None:
    data = mixed_input(tmp_path / "mixed.jsonl")
    fill(small_disk)
    proc = enqueue(redis_url, str(data), "--run", "mixed", "--rejects", str(small_disk / "r.jsonl"))
    one_error_line(proc, 2, f"cannot write rejects file {small_disk / 'r.jsonl'}: No space left on device",
                   "--rejects")
    assert conn.dbsize() == 0 and os.listdir(small_disk) == ["filler"]


@pytest.mark.parametrize("how", ["--tmp-dir", "TMPDIR"])
def test_longest_first_holding_files_on_a_full_disk(small_disk: Path, tmp_path: Path, redis_url: str,
                                                    conn: redis.Redis, how: str) -> None:
    records: list[object] = [{"id": f"g{i}", "messages": [{"role": "user", "content": f"q{i} {blob(800)}"},
                                            {"role": "assistant", "content": "x" * (i % 50)}]} for i in range(3000)]
    data = write_jsonl(tmp_path / "long.jsonl", records)
    args = [str(data), "--run", "long", "--longest-first", "--rejects", str(tmp_path / "r.jsonl"), "--json"]
    opt, env = (["--tmp-dir", str(small_disk)], None) if how == "--tmp-dir" else ([], {"TMPDIR": str(small_disk)})
    one_error_line(enqueue(redis_url, *args, *opt, env=env), 1,
                   f"--longest-first holding files {small_disk}/genqueue-order-", "before the disk filled",
                   "--tmp-dir (or TMPDIR)", "nothing was queued")
    assert os.listdir(small_disk) == [] and queued_items(conn, "long") == 0
    proc = enqueue(redis_url, *args, "--tmp-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["enqueued"] == 3000 and queued_items(conn, "long") == 3000


def test_enqueue_into_a_full_local_output_creates_no_run(small_disk: Path, tmp_path: Path, redis_url: str,
                                                         conn: redis.Redis) -> None:
    """run.json (and this host's shards) go to a local output that exists: a full one is refused."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    fill(small_disk)
    proc = enqueue(redis_url, str(data), "--output", str(small_disk), "--rejects", str(tmp_path / "r.jsonl"))
    one_error_line(proc, 2, f"cannot write output directory {small_disk}: No space left on device", "--output")
    assert conn.dbsize() == 0 and os.listdir(small_disk) == ["filler"]
