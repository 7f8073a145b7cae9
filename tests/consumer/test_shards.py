"""The consumer's spool: writing, sealing by size, leftovers of dead consumers, the spool lock."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from genqueue.common.storage import LocalStore
from genqueue.consumer.shipping.shards import ShardWriter, SpoolBusyError, leftover_shards, lock_spool, release_spool


def test_seal_and_ship(tmp_path: Path) -> None:
    w = ShardWriter(str(tmp_path / "spool"), "r1", "w1", max_bytes=10**9, max_age=3600)
    assert w.seal() is None
    assert w.append({"key": "a", "v": 1}) == 1
    assert w.append({"key": "b", "v": 2}) == 1
    shard = w.seal()
    assert shard is not None and shard.records == 2 and shard.keys == 2 and shard.path.exists()
    assert w.append({"key": "c"}) == 2  # a new shard after sealing
    dest = LocalStore(str(tmp_path / "out")).ship(shard)
    lines = [orjson.loads(x) for x in Path(dest).read_bytes().splitlines()]
    assert [x["key"] for x in lines] == ["a", "b"]
    man = orjson.loads((tmp_path / "out" / "r1" / "shards" / "w1-000001.manifest.json").read_bytes())
    assert man["records"] == 2 and man["sha256"] == shard.sha256


def test_due_by_size(tmp_path: Path) -> None:
    w = ShardWriter(str(tmp_path), "r", "w", max_bytes=50, max_age=3600)
    w.append({"key": "k", "pad": "x" * 10})
    assert not w.due()
    w.append({"key": "k2", "pad": "x" * 40})
    assert w.due()


def test_leftovers_of_dead_workers_only(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    dead = ShardWriter(str(spool), "r", "deadw", max_bytes=10**9, max_age=3600)
    dead.append({"key": "a"})
    dead.flush()
    assert dead._path is not None
    with open(dead._path, "ab") as fh:
        fh.write(b'{"key": "torn')  # a crash in mid-line
    alive = ShardWriter(str(spool), "r", "alivew", max_bytes=10**9, max_age=3600)
    alive.append({"key": "b"})
    alive.flush()
    sealed = ShardWriter(str(spool), "r", "alivew2", max_bytes=10**9, max_age=3600)
    sealed.append({"key": "c"})
    sealed.seal()
    found = leftover_shards(str(spool), lambda w: w == "deadw")
    names = sorted(s.name for s in found)
    assert names == ["deadw-000001.jsonl"]  # a live worker's sealed shard is its own to ship
    torn = next(s for s in found if s.name.startswith("deadw"))
    assert torn.records == 1 and torn.path.read_bytes() == b'{"key":"a"}\n'
    assert (spool / "r" / "alivew-000001.jsonl.open").exists()


def test_a_spool_is_held_by_one_live_process(tmp_path: Path) -> None:
    code = ("import sys, time; sys.path.insert(0, '.');"
            "from genqueue.consumer.shipping.shards import lock_spool; h = lock_spool(sys.argv[1]); print('ok', flush=True);"
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ok"
    with pytest.raises(SpoolBusyError, match="in use by pid"):
        lock_spool(str(tmp_path))
    holder.kill()  # a SIGKILLed holder releases it
    holder.wait()
    assert lock_spool(str(tmp_path)) is not None


def test_sealed_shards_of_a_live_worker_are_not_leftovers(tmp_path: Path) -> None:
    w = ShardWriter(str(tmp_path), "r", "alive", max_bytes=10**9, max_age=3600)
    w.append({"key": "a"})
    w.seal()
    assert leftover_shards(str(tmp_path), lambda name: False) == []
    assert len(leftover_shards(str(tmp_path), lambda name: True)) == 1


def test_leftovers_leave_files_that_are_not_shards_alone(tmp_path: Path) -> None:
    (tmp_path / "r" / "sealed").mkdir(parents=True)
    (tmp_path / "r" / "sealed" / "notes.txt").write_text("mine")
    (tmp_path / "r" / "junk.jsonl.open").write_text("torn")
    assert leftover_shards(str(tmp_path), lambda name: True) == []
    assert (tmp_path / "r" / "junk.jsonl.open").read_text() == "torn"


def test_a_write_that_fails_loses_nothing_and_is_retried_whole(tmp_path: Path, monkeypatch) -> None:
    import os as _os

    w = ShardWriter(str(tmp_path), "r", "w", max_bytes=10**9, max_age=3600)
    w.append({"key": "a"})
    w.flush()
    w.append({"key": "b"})
    real_write = _os.write
    calls = {"n": 0}

    def full_disk(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # half a line lands, then the disk is full
            real_write(fd, bytes(data)[:3])
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(_os, "write", full_disk)
    try:
        w.seal()
        raise AssertionError("the full disk must raise")
    except OSError as e:
        assert e.errno == 28
    shard = w.seal()  # space again: the shard is written whole, nothing torn, nothing twice
    assert shard is not None and shard.records == 2
    assert shard.path.read_bytes() == b'{"key":"a"}\n{"key":"b"}\n'
    assert shard.sha256 == hashlib.sha256(shard.path.read_bytes()).hexdigest()  # each line hashed once


def test_the_checksum_is_the_files_whatever_the_flushes(tmp_path: Path) -> None:
    """The sha256 is fed at flush time, a chunk at a time: it must still be the file's, for a
    shard flushed never, once per line, or now and then, and start over for the next shard."""
    w = ShardWriter(str(tmp_path), "r", "w", max_bytes=10**9, max_age=3600)
    for flush_every in (0, 1, 3):
        for i in range(7):
            w.append({"key": f"k{i}", "pad": "x" * 3000 * i})  # over hashlib's 2 KB GIL threshold too
            if flush_every and i % flush_every == 0:
                w.flush()
                w.flush()  # nothing new: nothing hashed twice
        shard = w.seal()
        assert shard is not None and shard.records == 7
        assert shard.sha256 == hashlib.sha256(shard.path.read_bytes()).hexdigest()


# --- letting go of the spool at exit -----------------------------------------------------------
def test_a_spool_with_nothing_to_ship_is_removed_at_exit(tmp_path: Path) -> None:
    """A start that failed (endpoint never up, pre-flight refused) left genqueue-spool/<port> empty."""
    spool = tmp_path / "genqueue-spool" / "8000"
    lock = lock_spool(str(spool))
    ShardWriter(str(spool), "r", "w", max_bytes=10**9, max_age=3600)  # a run's folders, never written
    assert release_spool(str(spool), lock) is True
    assert not spool.exists() and (tmp_path / "genqueue-spool").is_dir()  # only this consumer's folder
    assert lock.closed
    assert lock_spool(str(spool)) is not None  # the next start takes it afresh


@pytest.mark.parametrize("sealed", [True, False])
def test_a_spool_with_a_shard_in_it_is_kept_whole(tmp_path: Path, sealed: bool) -> None:
    spool = tmp_path / "spool"
    lock = lock_spool(str(spool))
    w = ShardWriter(str(spool), "r", "w", max_bytes=10**9, max_age=3600)
    w.append({"key": "a"})
    if sealed:
        w.seal()
    else:
        w.flush()  # an open shard (a hard stop): the next start seals and ships it
    ShardWriter(str(spool), "empty", "w", max_bytes=10**9, max_age=3600)
    assert release_spool(str(spool), lock) is False
    assert lock.closed
    assert (spool / ".lock").exists() and (spool / "empty" / "sealed").is_dir()
    shard = spool / "r" / ("sealed/w-000001.jsonl" if sealed else "w-000001.jsonl.open")
    assert shard.read_bytes() == b'{"key":"a"}\n'


def test_a_spool_with_a_foreign_file_or_link_is_kept(tmp_path: Path) -> None:
    for name, make in (("note", lambda p: p.write_text("mine")), ("link", lambda p: p.symlink_to(tmp_path))):
        spool = tmp_path / f"spool-{name}"
        lock = lock_spool(str(spool))
        (spool / "r").mkdir()
        make(spool / "r" / name)
        assert release_spool(str(spool), lock) is False
        assert (spool / "r" / name).exists() or (spool / "r" / name).is_symlink()
