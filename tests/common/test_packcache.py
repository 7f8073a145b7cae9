"""common/storage/packcache.py through PackReader, on real files and a real S3 (SeaweedFS): four
processes sharing one cache directory, the bound and its least-recently-used order, a cached
file gone bad fetched again and never served, the key that keeps runs and stores apart, and the
store's errors passing through as they do without the cache."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest

from genqueue.common import packs
from genqueue.common.contracts import Item
from genqueue.common.errors import PackCorruptError, PackError, PackRangeError
from genqueue.common.storage import LocalStore, PackNotFoundError, PackStore, StoreError, store_for
from genqueue.common.storage.packcache import PackCache, verify_pack
from genqueue.common.storage.packreader import PackReader
from tests import s3server
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

BLOCK = 8


def items(n: int, first: int = 0, tag: str = "") -> list[Item]:
    return [{"key": f"{tag}{i:030x}", "index": i,  # type: ignore[typeddict-item]
             "messages": [{"role": "user", "content": f"{tag} q{i} " * 30}]} for i in range(first, first + n)]


def pack_of(blocks: list[list[Item]]) -> bytes:
    w = packs.PackWriter()
    for b in blocks:
        w.add_block(b)
    return w.finish()


def put(store: PackStore, run: str, n: int, blocks: int = 4, tag: str = "") -> tuple[str, list[list[Item]]]:
    """Pack number N of RUN in STORE: BLOCKS blocks of BLOCK items; its name and blocks."""
    got = [items(BLOCK, 1000 * n + BLOCK * b, tag) for b in range(blocks)]
    name = f"w-{n:06d}.gqpack"
    store.put_pack(run, name, pack_of(got))
    return name, got


def cached(root: Path) -> list[Path]:
    """The packs in the cache ROOT (not temporary or lock files)."""
    return sorted(p for p in root.iterdir() if p.name.endswith(".gqpack") and not p.name.startswith(".")) \
        if root.exists() else []


@pytest.fixture(params=["local", "s3"])
def output(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    server: S3Server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    return server.url("p")


# --- four processes, one cache --------------------------------------------------------------
def _consume(output: str, root: str, jobs: list[tuple[str, int]], seed: int) -> tuple[dict[str, int], list[str]]:
    """One consumer: read every job of JOBS in its own shuffled order through the cache at ROOT;
    its counters and, per job, the keys it read (in JOBS' order)."""
    reader = PackReader(store_for, disk=PackCache(root))
    order = list(range(len(jobs)))
    random.Random(seed).shuffle(order)
    keys: dict[int, str] = {}
    for j in order:
        name, block = jobs[j]
        keys[j] = ",".join(str(i["key"]) for i in reader.block(output, "r", name, block))
    return reader.counts(), [keys[j] for j in range(len(jobs))]


def test_four_processes_read_every_block_through_one_cache(output: str, tmp_path: Path) -> None:
    store = store_for(output)
    expect: dict[tuple[str, int], str] = {}
    for n in range(1, 4):
        name, blocks = put(store, "r", n, blocks=8)
        expect |= {(name, b): ",".join(str(i["key"]) for i in blk) for b, blk in enumerate(blocks)}
    jobs = sorted(expect)
    root = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_consume, [(output, str(root), jobs, seed) for seed in range(4)])
    for counts, keys in results:
        assert keys == [expect[j] for j in jobs]  # every process read every block right
        assert counts["ranged_fetches"] == 0 and counts["cache_hits"] + counts["cache_misses"] == len(jobs)
        assert counts["whole_fetches"] == counts["cache_misses"] <= 3  # a pack at most once a process
    whole = sum(c["whole_fetches"] for c, _ in results)
    assert whole == 3  # one fetch a pack for the host: the others waited on its lock file
    assert sum(c["cache_hits"] for c, _ in results) == 4 * len(jobs) - whole  # the rest came from disk
    files = cached(root)
    assert len(files) == 3 and [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temp, no lock
    for f in files:
        verify_pack(f.read_bytes(), str(f))  # complete files only
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fifth consumer of the host: all from disk
        counts, keys = pool.apply(_consume, (output, str(root), jobs, 9))
    assert keys == [expect[j] for j in jobs] and counts["whole_fetches"] == 0 and counts["cache_hits"] == len(jobs)


def test_threads_of_one_process_fetch_a_pack_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1, blocks=16)
    reader = PackReader(lambda out: store, disk=PackCache(tmp_path / "cache"))
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: reader.block("out", "r", name, b), range(16)))
    assert got == blocks
    assert reader.counts()["whole_fetches"] == 1 and reader.counts()["cache_hits"] == 15


@pytest.mark.parametrize("holder", ["dead", "alive"])
def test_a_lock_of_a_dead_process_is_taken_over_and_a_live_one_waited_for_a_while(tmp_path: Path,
                                                                                  holder: str) -> None:
    import subprocess
    import sys

    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1)
    disk = PackCache(tmp_path / "cache", lock_wait=1.0)
    path = disk.path(store, "r", name)
    path.parent.mkdir()
    if holder == "dead":
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        pid = int(gone.stdout)
    else:
        pid = os.getpid()
    (path.parent / f".lock-{path.name}").write_text(str(pid))
    reader = PackReader(lambda out: store, disk=disk)
    t0 = time.monotonic()
    assert reader.block("out", "r", name, 1) == blocks[1]
    took = time.monotonic() - t0
    assert (took < 0.5) if holder == "dead" else (took >= 1.0)  # never a deadlock
    assert reader.counts()["whole_fetches"] == 1 and cached(path.parent) == [path]


# --- the bound ------------------------------------------------------------------------------
def test_the_cache_stays_under_its_bound_least_recently_used_out(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    names = [put(store, "r", n)[0] for n in range(1, 5)]
    size = len(store.get_pack("r", names[0]))
    root = tmp_path / "cache"
    disk = PackCache(root, max_bytes=int(2.5 * size))  # two packs fit, not three
    reader = PackReader(lambda out: store, disk=disk)

    def read(n: int) -> None:
        reader.block("out", "r", names[n], 0)
        time.sleep(0.05)  # file times are coarse (a few ms): keep the order unambiguous

    def kept() -> set[str]:
        return {p.name.split("-", 1)[1] for p in cached(root)}

    read(0)
    read(1)
    assert kept() == {names[0], names[1]}
    read(0)  # touched: now 1 is the least recently used
    read(2)
    assert kept() == {names[0], names[2]} and disk.size() <= disk.max_bytes and disk.evicted == 1
    read(3)
    assert kept() == {names[2], names[3]} and disk.evicted == 2
    before = reader.counts()
    read(1)  # evicted: fetched again
    assert reader.counts()["whole_fetches"] == before["whole_fetches"] + 1


def test_a_pack_larger_than_the_cache_is_read_from_memory_and_not_kept(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1)
    reader = PackReader(lambda out: store, disk=PackCache(tmp_path / "cache", max_bytes=100))
    assert reader.block("out", "r", name, 2) == blocks[2]
    assert cached(tmp_path / "cache") == []


def test_a_temporary_file_of_a_dead_fetch_is_swept(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    names = [put(store, "r", n)[0] for n in range(1, 3)]
    root = tmp_path / "cache"
    root.mkdir()
    old, fresh = root / ".tmp-999999-dead-w-000009.gqpack", root / ".tmp-999998-live-w-000008.gqpack"
    old.write_bytes(b"half a pack")
    fresh.write_bytes(b"a pack being written")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    reader = PackReader(lambda out: store, disk=PackCache(root, temp_age=600))
    reader.block("out", "r", names[0], 0)
    assert not old.exists() and fresh.exists()


def test_no_cache_is_no_bound() -> None:
    with pytest.raises(ValueError, match="keeps nothing"):
        PackCache("/nonexistent", max_bytes=0)


# --- never serve a bad file -------------------------------------------------------------
@pytest.mark.parametrize("damage", ["block", "footer", "cut"])
def test_a_cached_file_gone_bad_is_removed_and_fetched_again(tmp_path: Path, damage: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1)
    root = tmp_path / "cache"
    PackReader(lambda out: store, disk=PackCache(root)).block("out", "r", name, 0)  # another consumer's fetch
    (path,) = cached(root)
    raw = bytearray(path.read_bytes())
    if damage == "block":
        raw[packs.HEADER.size + 5] ^= 0xFF  # inside block 0
    elif damage == "footer":
        raw[-3] ^= 0xFF  # the magic
    else:
        del raw[len(raw) // 2:]
    path.write_bytes(bytes(raw))
    reader = PackReader(lambda out: store, disk=PackCache(root))
    with caplog.at_level(logging.WARNING, "genqueue.common.storage.packreader"):
        assert reader.block("out", "r", name, 0) == blocks[0]
    assert "does not read" in caplog.text
    assert reader.counts()["whole_fetches"] == 1 and reader.counts()["cache_misses"] == 1
    assert verify_pack(path.read_bytes(), str(path)).items == 4 * BLOCK  # whole again
    assert reader.block("out", "r", name, 3) == blocks[3] and reader.counts()["cache_hits"] == 1


def test_a_block_gone_bad_after_its_index_was_read_is_fetched_again(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1)
    root = tmp_path / "cache"
    reader = PackReader(lambda out: store, disk=PackCache(root))
    assert reader.block("out", "r", name, 0) == blocks[0]  # index now in memory
    (path,) = cached(root)
    entry = verify_pack(path.read_bytes(), str(path)).blocks[2]
    raw = bytearray(path.read_bytes())
    raw[entry.offset + 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert reader.block("out", "r", name, 2) == blocks[2]
    assert reader.counts()["whole_fetches"] == 2


def test_a_block_bad_in_the_store_fails_its_job_only_as_without_the_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    data = bytearray(pack_of([items(4), items(4, 4)]))
    data[packs.HEADER.size + 5] ^= 0xFF  # in block 0
    store.put_pack("r", "w-000001.gqpack", bytes(data))
    reader = PackReader(lambda out: store, disk=PackCache(tmp_path / "cache"))
    assert reader.block("out", "r", "w-000001.gqpack", 1) == items(4, 4)  # the other block reads
    with pytest.raises(PackCorruptError):
        reader.block("out", "r", "w-000001.gqpack", 0)  # from the cached file, then fetched again: still bad
    assert len(cached(tmp_path / "cache")) == 1  # the pack stays: its other blocks are good
    assert reader.block("out", "r", "w-000001.gqpack", 1) == items(4, 4)
    frame_bad = bytearray(pack_of([items(4)]))
    frame_bad[-3] ^= 0xFF  # in the footer: nothing of it reads, nothing kept
    store.put_pack("r", "w-000002.gqpack", bytes(frame_bad))
    with pytest.raises(PackError):
        reader.block("out", "r", "w-000002.gqpack", 0)
    assert len(cached(tmp_path / "cache")) == 1
    name, _ = put(store, "r", 2)
    with pytest.raises(PackRangeError, match="block 4 asked"):
        reader.block("out", "r", name, 4)
    with pytest.raises(PackRangeError):  # from the cached file too, which stays
        reader.block("out", "r", name, 9)
    assert len(cached(tmp_path / "cache")) == 2


# --- the key ----------------------------------------------------------------------------
def test_runs_and_stores_with_the_same_pack_name_never_share_a_file(tmp_path: Path) -> None:
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    got = {("a", "r1"): put(a, "r1", 1, tag="a1")[1], ("a", "r2"): put(a, "r2", 1, tag="a2")[1],
           ("b", "r1"): put(b, "r1", 1, tag="b1")[1]}
    reader = PackReader(lambda out: a if out == "a" else b, disk=PackCache(tmp_path / "cache"))
    for (out, run), blocks in got.items():
        assert reader.block(out, run, "w-000001.gqpack", 1) == blocks[1]
    fresh = PackReader(lambda out: a if out == "a" else b, disk=PackCache(tmp_path / "cache"))
    for (out, run), blocks in got.items():  # from disk now
        assert fresh.block(out, run, "w-000001.gqpack", 2) == blocks[2]
    assert len(cached(tmp_path / "cache")) == 3 and fresh.counts()["cache_hits"] == 3


# --- the store's errors -----------------------------------------------------------------
def test_a_pack_not_in_the_store_and_a_store_that_cannot_read(output: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    store = store_for(output)
    reader = PackReader(store_for, disk=PackCache(tmp_path / "cache"))
    with pytest.raises(PackNotFoundError):
        reader.block(output, "r", "w-000009.gqpack", 0)
    name, _ = put(store, "r", 1)
    if output.startswith("s3://"):
        request.getfixturevalue("s3_server").stop()
    else:  # a pack the directory holds but cannot read (a directory in its place)
        path = Path(store.pack_location("r", name))
        path.unlink()
        path.mkdir()
    with pytest.raises(StoreError) as e:
        reader.block(output, "r", name, 0)
    assert not isinstance(e.value, PackNotFoundError)  # the job goes back; it does not fail
    assert cached(tmp_path / "cache") == []


def test_a_cache_that_cannot_be_written_still_serves_the_block(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path / "out")
    name, blocks = put(store, "r", 1)
    (tmp_path / "file").write_text("not a directory")
    reader = PackReader(lambda out: store, disk=PackCache(tmp_path / "file" / "cache"))
    with caplog.at_level(logging.WARNING, "genqueue.common.storage.packcache"):
        assert reader.block("out", "r", name, 1) == blocks[1]
        assert reader.block("out", "r", name, 2) == blocks[2]
    assert caplog.text.count("cannot be written") == 1
