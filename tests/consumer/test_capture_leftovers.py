"""Capture files a killed consumer leaves on the engine's disk (consumer/capture/owner.py): every
request that asks for hidden states names its consumer's spool in its request id, which the
engine puts in the file's name; a consumer started again on that spool removes what the dead one
left once its capture probe shows it the engine's folder, and never another spool's files.

Real redis-server, the stand-in over HTTP naming its files as vLLM's connector does, real
consumer processes SIGKILLed mid-run."""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

import pytest

from genqueue.consumer.capture.owner import CaptureOwner, spool_tag
from tests.conftest import INLINE, wait_for
from tests.consumer.test_capture_faults import busy, capturing_sim, consumer, enqueue

pytestmark = pytest.mark.integration


def tagged(caps: Path, spool: Path) -> set[str]:
    """The files in CAPS of requests made by a consumer on SPOOL."""
    tag = f"-gq-{spool_tag(spool)}-"
    return {p.name for p in caps.iterdir() if tag in p.name} if caps.exists() else set()


@pytest.mark.slow  # 27 s: a SIGSTOP, a SIGKILL and a second consumer; the sweep itself is unit-tested below
def test_a_killed_consumers_capture_files_go_when_it_starts_again_and_no_one_elses(tmp_path, redis_url, conn):
    """Consumer a is frozen (SIGSTOP) with requests in flight: the engine finishes them, writes
    their files and sends the answers into a's socket, which no one reads; then a is SIGKILLed.
    A consumer started on a's spool removes those files; a file of spool b's (b is alive, serving
    the same run) stays."""
    run, caps = "left", tmp_path / "caps"
    enqueue(tmp_path, redis_url, run, 120, str(tmp_path / "out"), INLINE)
    sim = capturing_sim(tmp_path, "--step-time", "0.02")
    spool_a, spool_b = tmp_path / "spool-a", tmp_path / "spool-b"
    try:
        b = consumer(tmp_path, redis_url, sim, run, "b", "-c", "4", "--lease", "3", "--burst")
        a = consumer(tmp_path, redis_url, sim, run, "a", "-c", "16", "--lease", "3", "--burst")
        busy(conn, a, shards=1, in_flight=12)
        wait_for(lambda: "the engine captures the run's" in b.output(), 30, "b to pass its pre-flight")
        # a file of a request b asked for and has not read yet: none of a's spool to touch
        others = caps / f"chatcmpl-{CaptureOwner.of(spool_b).request_id()}-12345678.safetensors"
        others.write_bytes(b"b's")
        a.signal(signal.SIGSTOP)
        seen: list[set[str]] = []

        def settled() -> bool:
            seen.append(tagged(caps, spool_a))
            return len(seen) > 20 and bool(seen[-1]) and seen[-1] == seen[-20]
        wait_for(settled, 30, "the engine to finish the frozen consumer's requests")
        a.signal(signal.SIGKILL)
        a.wait(10)
        left = seen[-1]
        again = consumer(tmp_path, redis_url, sim, run, "again", "--lease", "3", "--burst", spool="a")
        assert again.wait(120) == 0, again.output()
        assert b.wait(120) == 0, b.output()
    finally:
        sim.stop()
    assert any(n.endswith(".safetensors") for n in left), left
    assert f"removed {len(left)} capture files an earlier consumer on this spool left in {caps}" in again.output()
    assert tagged(caps, spool_a) == set(), "a file of spool a's is still on the engine's disk"
    assert others.read_bytes() == b"b's", "another spool's file was touched"
    assert sorted(p.name for p in caps.iterdir()) == [others.name], "every answer's file is read and removed"


def test_a_sweep_leaves_this_process_and_a_file_still_written(tmp_path):
    caps = tmp_path / "caps"
    caps.mkdir()
    owner, earlier = CaptureOwner.of(tmp_path / "spool"), CaptureOwner(spool_tag(tmp_path / "spool"), "0ldp1d00")
    stranger = CaptureOwner.of(tmp_path / "other-spool")

    def plant(who: CaptureOwner, lock: bool = True) -> Path:
        path = caps / f"chatcmpl-{who.request_id()}-abcdef01.safetensors"
        path.write_bytes(b"x")
        if lock:
            path.with_name(path.name + ".lock").write_bytes(b"")
        return path

    mine, theirs, dead, writing = plant(owner), plant(stranger), plant(earlier), plant(earlier)
    orphan_lock = caps / f"chatcmpl-{earlier.request_id()}-abcdef02.safetensors.lock"
    orphan_lock.write_bytes(b"")
    fd = os.open(writing.with_name(writing.name + ".lock"), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the engine's connector, still writing
        assert owner.sweep(caps) == 1  # the dead one's file (and its lock), and the lock with no file
    finally:
        os.close(fd)
    assert mine.exists() and theirs.exists() and writing.exists() and not dead.exists() and not orphan_lock.exists()
    assert owner.sweep(caps) == 1  # the write is done: it goes next time
    assert not writing.exists() and mine.exists()
    assert owner.request_id().startswith(f"gq-{owner.spool}-{owner.process}-")
