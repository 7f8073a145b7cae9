"""Hostile input through the real CLI: bounded memory, a clear verdict, no crash."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import BIN

GOOD = b'{"conversations":[{"from":"human","value":"still here"}]}\n'


def producer_dry(args: list[str], stdin_cmd: str | None = None) -> tuple[dict[str, Any], int, str]:
    """Run `producer enqueue --dry-run --json`; returns (summary, peak RSS in MB, stderr)."""
    cmd = [str(BIN / "producer"), "enqueue", *args, "--dry-run", "--json"]
    if stdin_cmd:
        feeder = subprocess.Popen(["bash", "-c", stdin_cmd], stdout=subprocess.PIPE)
        proc = subprocess.Popen(cmd, stdin=feeder.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        feeder.stdout.close()  # type: ignore[union-attr]
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Peak RSS from /proc's VmHWM (this process image only): getrusage's ru_maxrss would also
    # count the moment after fork, when the child still mirrors the whole pytest process.
    peak_kb = 0
    status_file = f"/proc/{proc.pid}/status"
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))  # type: ignore[union-attr]
    out: list[bytes] = []
    reader.start()
    while proc.poll() is None:
        try:
            with open(status_file) as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        peak_kb = max(peak_kb, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    reader.join()
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert proc.returncode == 0, err.decode()
    return orjson.loads(out[0]), peak_kb // 1024, err.decode()


def test_a_one_gigabyte_record_is_rejected_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    block = b"a" * (1 << 20)
    with open(path, "wb") as fh:
        fh.write(b'{"conversations":[{"from":"human","value":"')
        fh.writelines(block for _ in range(1024))
        fh.write(b'"}]}\n' + GOOD)
    s, rss, _ = producer_dry([str(path), "--rejects", str(tmp_path / "r")])
    path.unlink()
    assert s["rejected_by_reason"] == {"record_too_large": 1} and s["enqueued"] == 1
    assert rss < 400, f"peak RSS {rss} MB for a 1 GB record"


@pytest.mark.slow
def test_a_billion_blank_lines_stream_through(tmp_path: Path) -> None:
    feed = f"head -c 1000000000 /dev/zero | tr '\\0' '\\n'; printf '%s' '{GOOD.decode().strip()}'"
    s, rss, _ = producer_dry(["-", "--run", "blank", "--rejects", str(tmp_path / "r")], stdin_cmd=feed)
    assert s["records"] == 1 and s["enqueued"] == 1
    assert rss < 200, f"peak RSS {rss} MB for a billion blank lines"


def test_deep_nesting_and_non_utf8_are_rejected_with_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "nasty.jsonl"
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000 + b"\n" + b'{"conversations":[{"from":"human","value":"\xff\xfe"}]}\n'
                     + b"\xc3\x28 not utf-8 at all\n" + GOOD)
    s, _, err = producer_dry([str(path), "--rejects", str(tmp_path / "r")])
    assert s["records"] == 4 and s["enqueued"] == 1 and "Traceback" not in err
    assert s["rejected_by_reason"] == {"invalid_json": 2, "invalid_unicode": 1} or \
        s["rejected_by_reason"] == {"invalid_json": 1, "invalid_unicode": 2}


def test_binary_garbage_file_does_not_crash(tmp_path: Path) -> None:
    path = tmp_path / "garbage.jsonl"
    # a good record first: an input that starts with garbage is refused (tests/producer/ingest/test_input_check.py)
    path.write_bytes(GOOD + b"\n" + os.urandom(300_000) + b"\n" + GOOD)
    s, _, err = producer_dry([str(path), "--rejects", str(tmp_path / "r")])
    assert s["enqueued"] == 1 and s["records"] == s["enqueued"] + s["rejected"] + s["duplicates"]
    assert "Traceback" not in err
