"""One slice is written (claim, pack PUT, transaction) while the next is read and converted, and
what a write that fails leaves: the counts hold only slices that landed, a failed slice's claim
is given back, and the same command again queues the rest. Against a real Redis; the store is the
real local one, wrapped where a test needs a PUT to wait or to fail at a given pack."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.common.settings import RunSettings
from genqueue.common.storage import StoreError, store_for
from genqueue.producer.enqueue import enqueuer, slices
from genqueue.producer.enqueue.enqueuer import Enqueuer
from genqueue.producer.enqueue.jobwriter import JobWriter
from genqueue.producer.enqueue.summary import Flag
from genqueue.producer.ingest.reader import RawRecord, iter_records
from tests.conftest import BIN, cli, sharegpt, write_jsonl

pytestmark = pytest.mark.integration

SLICE = slices.SLICE_ITEMS  # one pack a slice
CHUNK = enqueuer.CHUNK  # records read between two looks at Redis


class Store:
    """The run's real local store; its Nth put_pack (1-based) can wait on GATE first, or fail."""

    def __init__(self, root: Path, *, fail_at: int = 0, gate: Any = None) -> None:
        self.real = store_for(str(root))
        self.fail_at, self.gate, self.puts = fail_at, gate, 0

    def put_pack(self, run: str, name: str, data: bytes) -> str:
        self.puts += 1
        if self.gate is not None:
            self.gate(self.puts)
        if self.puts == self.fail_at:
            raise StoreError(f"cannot write pack {name}: the test's store refused it")
        return str(self.real.put_pack(run, name, data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def enqueuer(conn: redis.Redis, tmp_path: Path, store: Store, run: str = "ov") -> Enqueuer:
    writer = JobWriter(run, conn, batch_size=128, pack_store=store)  # type: ignore[arg-type]
    return Enqueuer(run, RunSettings(output=str(tmp_path / "out")), writer, batch_size=128)


def jobs_items(conn: redis.Redis, run: str) -> int:
    """The items the run's queued jobs name (meta.items)."""
    return sum(int(job.meta["items"]) for job in queue_for(run, conn).jobs)


def test_the_input_is_read_on_while_a_chunks_slices_are_written(tmp_path: Path, conn: redis.Redis) -> None:
    """The first chunk's packs (4 slices) may not be PUT until the reader has read the whole
    second chunk: it gets there only if the reading does not wait for the writes (before, each
    PUT was in line with the reading: this test timed out on its first pack)."""
    n = 3 * CHUNK + 10
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(n)])
    seen = [0]
    past = threading.Condition()

    def gate(k: int) -> None:
        with past:
            if k <= CHUNK // SLICE and not past.wait_for(lambda: seen[0] >= 2 * CHUNK, timeout=20):
                raise AssertionError(f"pack {k}'s PUT waited for a reader that waited for it")

    def read() -> Iterator[RawRecord]:
        for rec in iter_records(str(data)):
            with past:
                seen[0] += 1
                past.notify_all()
            yield rec

    e = enqueuer(conn, tmp_path, Store(tmp_path / "out", gate=gate))
    try:
        e.process(read())
    finally:
        e.close()
    assert e.tally.counts["items"] == n == jobs_items(conn, "ov")
    assert ItemTable(conn, "ov").counts().in_run == n


def test_a_failed_pack_counts_nothing_of_its_slice_or_after_it_and_gives_their_claims_back(
        tmp_path: Path, conn: redis.Redis) -> None:
    """The third PUT to start fails (which slice's it is depends on the writers' race): the
    slices before that one are queued and counted, it and every slice after it are given back
    (claimed, never queued), and the counts hold exactly what landed."""
    n = 2 * CHUNK
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(n)])
    e = enqueuer(conn, tmp_path, Store(tmp_path / "out", fail_at=3))
    with pytest.raises(StoreError, match="refused it"):
        try:
            e.process(iter_records(str(data)))
        finally:
            e.close()
    landed = e.tally.counts["items"]
    assert landed == jobs_items(conn, "ov") == ItemTable(conn, "ov").counts().in_run
    assert landed % SLICE == 0 and landed < (slices.WRITERS + 1) * SLICE
    assert not list(conn.scan_iter(match="genqueue:run:ov:claim:*"))
    # the slices queued are the first ones handed out: the first records of the input
    assert [i for i, f in enumerate(e.tally.flags) if f & Flag.NEW] == list(range(landed))
    again = enqueuer(conn, tmp_path, Store(tmp_path / "out"))
    try:
        again.process(iter_records(str(data)))
    finally:
        again.close()
    assert again.tally.counts["items"] == n - landed and jobs_items(conn, "ov") == n


def test_a_store_that_refuses_the_packs_is_one_line_and_the_same_command_queues_them(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """A real local output whose packs folder is a file: every PUT fails; the enqueue says so in
    one line and exits 1, leaves no item claimed and no job; once the folder can be made, the same
    command queues every record."""
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(3000)])
    out = tmp_path / "out"
    (out / "pf").mkdir(parents=True)
    (out / "pf" / "packs").write_text("not a folder")
    args = ("producer", "enqueue", str(data), "--run", "pf", "--output", str(out), "--prompts", "reference")
    bad = cli(*args, env={"REDIS_URL": redis_url}, check=False)
    assert bad.returncode == 1, bad.stderr
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "packs" in errors[0] and "Traceback" not in bad.stderr
    assert ItemTable(conn, "pf").counts().in_run == 0 and queue_for("pf", conn).count == 0
    (out / "pf" / "packs").unlink()
    ok = cli(*args, "--json", env={"REDIS_URL": redis_url})
    s = orjson.loads(ok.stdout)
    assert s["enqueued"] == 3000 and s["items"] == 3000 == jobs_items(conn, "pf")


def test_ctrl_c_leaves_every_claimed_item_in_a_job_or_given_back(tmp_path: Path, redis_url: str,
                                                                  conn: redis.Redis) -> None:
    """Ctrl-C while slices are in the writer's thread: the command waits for them (their jobs land
    or their claims are given back), exits 130, and the same command queues exactly the rest."""
    n = 40_000
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(n)])
    args = [str(BIN / "producer"), "enqueue", str(data), "--run", "cc", "--output", str(tmp_path / "out"),
            "--prompts", "reference"]
    proc = subprocess.Popen(args, env={**os.environ, "REDIS_URL": redis_url}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while queue_for("cc", conn).count == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the enqueue ended before the signal")  # a fast machine: nothing to interrupt
    assert proc.returncode == 130 and "Traceback" not in err, err
    queued = jobs_items(conn, "cc")
    assert 0 < queued < n and ItemTable(conn, "cc").counts().in_run == queued
    assert not list(conn.scan_iter(match="genqueue:run:cc:claim:*"))
    again = orjson.loads(cli("producer", *args[1:], "--json", env={"REDIS_URL": redis_url}).stdout)
    assert again["enqueued"] == n - queued and again["already_enqueued"] == queued
    assert jobs_items(conn, "cc") == n
