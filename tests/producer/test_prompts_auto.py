"""`producer enqueue --prompts auto` (the default; issue 34): a run is queued by reference from
--prompts-reference-from items of the input's estimate, inline below it or when the input's size
is not known; a run keeps the mode an earlier enqueue gave it (in Redis, or in its run.json when
Redis lost it); --prompts inline|reference wins; the summary and --json say which and why.
Real redis-server, the real command."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common import defaults
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.producer.enqueue import memplan
from tests.conftest import cli, sharegpt, write_jsonl

pytestmark = pytest.mark.integration

Summary = dict[str, Any]


def enqueue(tmp_path: Path, redis_url: str, data: Path | str, run: str, *args: str, as_json: bool = True,
            input: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
               "--max-tokens", "32", "--rejects", str(tmp_path / f"{run}.rejects.jsonl"), *args,
               *(("--json",) if as_json else ()), env={"REDIS_URL": redis_url}, input=input)


def summary(tmp_path: Path, redis_url: str, data: Path | str, run: str, *args: str) -> Summary:
    out: Summary = orjson.loads(enqueue(tmp_path, redis_url, data, run, *args).stdout)
    return out


def by_reference_jobs(conn: redis.Redis, run: str) -> tuple[int, int]:
    """RUN's queued jobs: (by reference: no argument, a pack in meta; inline: the items as argument)."""
    q = queue_for(run, conn)
    jobs = [q.fetch_job(i) for i in q.job_ids]
    ref = sum(1 for j in jobs if j is not None and not j.args and "pack" in j.meta)
    inline = sum(1 for j in jobs if j is not None and len(j.args) == 1 and "pack" not in j.meta)
    assert ref + inline == len(jobs)
    return ref, inline


def test_a_small_run_is_inline_and_the_summary_says_why(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "small.jsonl", [sharegpt(i) for i in range(40)])
    proc = enqueue(tmp_path, redis_url, data, "small", as_json=False)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("prompts"))
    assert f"inline (auto: ~40 items < {defaults.PROMPTS_REFERENCE_FROM:,}; in the jobs, in Redis)" in row, row
    assert by_reference_jobs(conn, "small") == (0, 5) and PackTable(conn, "small").count() == 0
    s = orjson.loads(conn.hget("genqueue:run:small:sources", str(data.resolve())) or b"{}")
    assert s["prompts"] == "inline" and s["prompts_choice"] == {
        "asked": "auto", "reason": "size", "estimated_items": 40,
        "reference_from": defaults.PROMPTS_REFERENCE_FROM,
        "why": f"auto: ~40 items < {defaults.PROMPTS_REFERENCE_FROM:,}"}


def test_a_large_run_is_by_reference(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """From the threshold on, by reference: packs written, jobs naming them; a dry run says the
    same choice. An input larger than the records looked at is estimated from its size."""
    data = write_jsonl(tmp_path / "large.jsonl", [sharegpt(i) for i in range(48)])
    dry = summary(tmp_path, redis_url, data, "large", "--prompts-reference-from", "48", "--dry-run")
    assert dry["prompts"] == "reference" and dry["packs"] == 0
    s = summary(tmp_path, redis_url, data, "large", "--prompts-reference-from", "48")
    assert s["prompts"] == "reference" and s["packs"] == 1 and s["items"] == 48
    assert s["prompts_choice"] == {"asked": "auto", "reason": "size", "estimated_items": 48, "reference_from": 48,
                                   "why": "auto: ~48 items >= 48"}
    assert by_reference_jobs(conn, "large") == (6, 0) and PackTable(conn, "large").count() == 1
    proc = enqueue(tmp_path, redis_url, data, "large-table", "--prompts-reference-from", "48", as_json=False)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("prompts"))
    assert "reference (auto: ~48 items >= 48; 1 pack(s) written to the run's output" in row, row

    # more records than memplan looks at: the rest is estimated from the file's size
    n = memplan.SAMPLE_RECORDS + 1500
    big = write_jsonl(tmp_path / "big.jsonl", [sharegpt(i) for i in range(n)])
    est = summary(tmp_path, redis_url, big, "big", "--dry-run")["prompts_choice"]["estimated_items"]
    assert est != n and abs(est - n) < n * 0.05, est  # estimated, not counted
    s = summary(tmp_path, redis_url, big, "big", "--prompts-reference-from", str(int(n * 0.9)))
    assert s["prompts"] == "reference" and s["prompts_choice"]["reason"] == "size" and s["items"] == n
    s = summary(tmp_path, redis_url, big, "big-inline", "--prompts-reference-from", str(int(n * 1.1)))
    assert s["prompts"] == "inline" and s["prompts_choice"]["reason"] == "size" and s["packs"] == 0


def test_the_flag_given_wins(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "given.jsonl", [sharegpt(i) for i in range(16)])
    s = summary(tmp_path, redis_url, data, "given-ref", "--prompts", "reference")
    assert s["prompts"] == "reference" and s["prompts_choice"]["reason"] == "given" and s["packs"] == 1
    assert s["prompts_choice"]["why"] == "--prompts reference"
    s = summary(tmp_path, redis_url, data, "given-inline", "--prompts", "inline", "--prompts-reference-from", "1")
    assert s["prompts"] == "inline" and s["prompts_choice"]["reason"] == "given" and s["packs"] == 0
    assert by_reference_jobs(conn, "given-ref") == (2, 0) and by_reference_jobs(conn, "given-inline") == (0, 2)
    # given on a run of the other mode: the modes mix, as they did before auto
    write_jsonl(data, [sharegpt(i) for i in range(24)])
    s = summary(tmp_path, redis_url, data, "given-ref", "--prompts", "inline")
    assert (s["prompts"], s["enqueued"], s["already_queued"]) == ("inline", 8, 16)
    assert by_reference_jobs(conn, "given-ref") == (2, 1)


def test_a_run_keeps_its_mode_across_enqueues(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """auto on a run that has a mode keeps it whatever the input's size: a run by reference
    grown by a small file stays by reference, an inline one grown past the threshold stays
    inline; and a run Redis lost keeps the mode its run.json holds."""
    data = write_jsonl(tmp_path / "keep.jsonl", [sharegpt(i) for i in range(16)])
    assert summary(tmp_path, redis_url, data, "keep", "--prompts", "reference")["prompts"] == "reference"
    write_jsonl(data, [sharegpt(i) for i in range(24)])
    s = summary(tmp_path, redis_url, data, "keep")  # 24 items, far below the threshold
    assert (s["prompts"], s["enqueued"], s["packs"]) == ("reference", 8, 1)
    assert s["prompts_choice"]["reason"] == "run" and "by reference" in s["prompts_choice"]["why"]
    assert by_reference_jobs(conn, "keep") == (3, 0)

    small = write_jsonl(tmp_path / "stay.jsonl", [sharegpt(i) for i in range(8)])
    assert summary(tmp_path, redis_url, small, "stay")["prompts"] == "inline"
    other = write_jsonl(tmp_path / "stay2.jsonl", [sharegpt(100 + i) for i in range(16)])
    s = summary(tmp_path, redis_url, other, "stay", "--prompts-reference-from", "1")
    assert (s["prompts"], s["prompts_choice"]["reason"], s["packs"]) == ("inline", "run", 0)
    assert by_reference_jobs(conn, "stay") == (0, 3)

    # Redis loses everything: the run is re-created from run.json, by reference as it was
    conn.flushall()
    s = summary(tmp_path, redis_url, data, "keep")
    assert s["recreated_run"] and s["prompts"] == "reference" and s["prompts_choice"]["reason"] == "run"
    assert s["enqueued"] == 24 and by_reference_jobs(conn, "keep") == (3, 0)
    s = summary(tmp_path, redis_url, small, "stay", "--prompts-reference-from", "1")
    assert s["recreated_run"] and (s["prompts"], s["prompts_choice"]["reason"]) == ("inline", "run")


def test_an_input_of_unknown_size_is_inline_unless_told(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """A compressed file or stdin longer than the records looked at has no size to scale by:
    inline, whatever the threshold; one read whole (a short stdin) is counted."""
    n = memplan.SAMPLE_RECORDS + 200
    raw = b"".join(orjson.dumps(sharegpt(i)) + b"\n" for i in range(n))
    gz = tmp_path / "big.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    s = summary(tmp_path, redis_url, gz, "gz", "--prompts-reference-from", "1", "--dry-run")
    assert s["prompts"] == "inline" and s["prompts_choice"]["reason"] == "size_unknown"
    assert s["prompts_choice"]["estimated_items"] == memplan.SAMPLE_RECORDS
    assert "inline unless --prompts reference" in s["prompts_choice"]["why"]
    short = b"".join(orjson.dumps(sharegpt(i)) + b"\n" for i in range(20))
    s = orjson.loads(enqueue(tmp_path, redis_url, "-", "stdin", "--prompts-reference-from", "20", input=short).stdout)
    assert (s["prompts"], s["prompts_choice"]["reason"], s["prompts_choice"]["estimated_items"]) == \
        ("reference", "size", 20)
    assert by_reference_jobs(conn, "stdin") == (3, 0)


def test_a_threshold_that_is_not_a_count_is_refused(tmp_path: Path, redis_url: str) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [sharegpt(0)])
    proc = cli("producer", "enqueue", str(data), "--prompts-reference-from", "0", env={"REDIS_URL": redis_url},
               check=False)
    assert proc.returncode == 2 and "--prompts-reference-from" in proc.stderr and "Traceback" not in proc.stderr


def test_a_run_fed_in_parts_is_sized_and_chosen_by_the_items_expected(tmp_path: Path, redis_url: str,
                                                                       conn: redis.Redis) -> None:
    """--expect-items N on a run's first enqueue: the item table gets the buckets of a run of N
    items (its entries stay in Redis's compact hashes as the later parts land), and auto chooses
    by N, so a 10M-item run fed a 100k file at a time is by reference from its first part. On a
    run that has a table already, a note says it changed nothing."""
    from genqueue.common.keepers.items import ItemTable, buckets_for

    part = write_jsonl(tmp_path / "part-1.jsonl", [sharegpt(i) for i in range(16)])
    s = summary(tmp_path, redis_url, part, "parts", "--expect-items", "300000")
    assert (s["prompts"], s["packs"], s["items"]) == ("reference", 1, 16)
    assert s["prompts_choice"]["reason"] == "expected" and s["prompts_choice"]["expected_items"] == 300_000
    assert "expected to hold 300,000 items (--expect-items) >=" in s["prompts_choice"]["why"]
    assert ItemTable(conn, "parts").buckets() == buckets_for(300_000) > buckets_for(16)
    # below the threshold, auto stays inline; the table is sized all the same
    s = summary(tmp_path, redis_url, part, "parts-small", "--expect-items", "100000")
    assert (s["prompts"], s["prompts_choice"]["reason"]) == ("inline", "expected")
    assert ItemTable(conn, "parts-small").buckets() == buckets_for(100_000)
    # a later part: the run's mode and table are kept; a larger expectation is told it comes late
    more = write_jsonl(tmp_path / "part-2.jsonl", [sharegpt(100 + i) for i in range(16)])
    proc = enqueue(tmp_path, redis_url, more, "parts", "--expect-items", "50000000")
    assert orjson.loads(proc.stdout)["prompts"] == "reference"
    assert "--expect-items 50,000,000 does not change its item table" in proc.stderr, proc.stderr
    assert ItemTable(conn, "parts").buckets() == buckets_for(300_000)
    # without it: this input's size decides
    s = summary(tmp_path, redis_url, part, "parts-none")
    assert (s["prompts"], s["prompts_choice"]["reason"]) == ("inline", "size") and "expected_items" not in s["prompts_choice"]
    assert ItemTable(conn, "parts-none").buckets() == buckets_for(16)


def test_jobs_by_reference_grow_with_the_run_and_the_summary_says_why(tmp_path: Path, redis_url: str,
                                                                       conn: redis.Redis) -> None:
    """Without --batch-size: inline jobs of BATCH_SIZE; by reference BATCH_SIZE_REFERENCE, doubled
    up to BATCH_SIZE_REFERENCE_MAX while the run (here as --expect-items says) keeps
    JOBS_PER_RUN_MIN jobs or more; the jobs rq holds are of that size, the summary row and --json
    say it and why, and --batch-size wins."""
    n = defaults.BATCH_SIZE_REFERENCE_MAX + 300
    data = write_jsonl(tmp_path / "grow.jsonl", [{"id": f"g{i}", "conversations": [
        {"from": "human", "value": f"question {i}"}]} for i in range(n)])

    def run(name: str, *args: str) -> tuple[Summary, list[int]]:
        proc = cli("producer", "enqueue", str(data), "--run", name, "--output", str(tmp_path / "out"), "--json",
                   *args, env={"REDIS_URL": redis_url})
        assert proc.returncode == 0, proc.stderr
        q = queue_for(name, conn)
        jobs = [q.fetch_job(i) for i in q.job_ids]
        return orjson.loads(proc.stdout), [int(j.meta["items"]) for j in jobs if j is not None]

    base, most = defaults.BATCH_SIZE_REFERENCE, defaults.BATCH_SIZE_REFERENCE_MAX
    s, sizes = run("g-inline", "--prompts", "inline")
    assert s["batch_size"] == defaults.BATCH_SIZE and s["batch_choice"]["reason"] == "inline"
    assert max(sizes) == defaults.BATCH_SIZE and sum(sizes) == n
    s, sizes = run("g-ref", "--prompts", "reference")
    assert (s["batch_size"], s["batch_choice"]["reason"], s["batch_choice"]["items"]) == (base, "reference", n)
    assert max(sizes) == base and sum(sizes) == n
    # a run expected to make 2 * JOBS_PER_RUN_MIN jobs of twice the size, or more: the largest allowed
    expected = most * defaults.JOBS_PER_RUN_MIN
    s, sizes = run("g-big", "--prompts", "reference", "--expect-items", str(expected))
    assert (s["batch_size"], s["batch_choice"]["reason"]) == (most, "run_size")
    assert sizes == [most, n - most], sizes
    assert s["batch_choice"]["why"] == (f"by reference, ~{expected:,} items: the largest job that leaves "
                                        f"{defaults.JOBS_PER_RUN_MIN:,} jobs or more")
    # one short of it: the size below
    s, _ = run("g-mid", "--prompts", "reference", "--expect-items", str(expected - 1))
    assert s["batch_size"] == most // 2
    # --batch-size wins, and the screen's jobs row says it
    proc = cli("producer", "enqueue", str(data), "--run", "g-given", "--output", str(tmp_path / "out"),
               "--prompts", "reference", "--expect-items", str(expected), "--batch-size", "100",
               env={"REDIS_URL": redis_url})
    row = next(line for line in proc.stdout.splitlines() if line.startswith("jobs"))
    assert row.split()[1:] == [f"{-(-n // 100)}", "(100", "items", "a", "job", "at", "most:", "--batch-size",
                               "100)"], row
