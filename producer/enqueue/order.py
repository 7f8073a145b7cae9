"""Longest first: hold a run's new items back, then enqueue them from the costliest down.

A run's makespan ends with its slowest items; started last, a few long reasoning traces keep
one GPU busy while the others idle. Started first, they overlap with the bulk. Items are
spilled to temporary files by cost class (about 20% apart), so memory stays flat whatever the
input size; within a class they keep input order.

The unit ordered is a record's items together (the turns of one conversation in `each` mode,
the samples of one prompt), at the sum of their costs: they share a prompt prefix, so they stay
side by side, in their own order, and land in one job (jobwriter.py), where one engine's
prefix cache serves them. Ordering turns apart would scatter a conversation over the run.

The files go to TMP_DIR (enqueue's --tmp-dir, else TMPDIR); a place that cannot take one block
is refused before anything is enqueued, and a write that fails later (a full disk) raises
WriteFailedError naming the directory.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import orjson

from genqueue.common.contracts import Item
from genqueue.producer.outfiles import HOLD, probe, write_failed

#: Cost classes of the longest-first order are this factor apart.
STEP = 1.2


def cost_class(cost: int) -> int:
    """The class of a cost estimate: 0 for 0-1, then one class per factor STEP."""
    return 0 if cost <= 1 else int(math.log(cost) / math.log(STEP)) + 1


class LongestFirst:
    """Spill items by cost class; read them back from the highest class down."""

    def __init__(self, tmp_dir: str | None = None) -> None:
        where = Path(tmp_dir or tempfile.gettempdir()).absolute()
        try:
            self.dir = Path(tempfile.mkdtemp(prefix="genqueue-order-", dir=where))
        except OSError as e:
            probe(where / "genqueue-order-probe", HOLD, shown=where)  # says why, exit 2
            raise write_failed(e, where, HOLD, room_in=where) from None
        try:
            probe(self.dir / "probe", HOLD, shown=where)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self._files: dict[int, IO[bytes]] = {}
        self.count = 0

    def add(self, item: Item, cost: int) -> None:
        self.add_group([item], cost)

    def add_group(self, items: list[Item], cost: int) -> None:
        """ITEMS (one record's, in their order) go out together, at COST (their sum)."""
        if not items:
            return
        cls = cost_class(cost)
        try:
            fh = self._files.get(cls)
            if fh is None:
                fh = self._files[cls] = open(self.dir / f"{cls:04d}.jsonl", "w+b")  # noqa: SIM115
            fh.write(orjson.dumps(items) + b"\n")
        except OSError as e:
            raise write_failed(e, self.dir, HOLD) from None
        self.count += len(items)

    def longest_first(self, chunk: int = 4096) -> Iterator[list[Item]]:
        """Lists of items, costliest class first (a group is never cut between two lists)."""
        # Every file is flushed before the first list is handed out: a full disk that shows
        # only now (with the buffers' last items) fails the enqueue before anything is queued.
        try:
            for fh in self._files.values():
                fh.flush()
        except OSError as e:
            raise write_failed(e, self.dir, HOLD) from None
        for cls in sorted(self._files, reverse=True):
            fh = self._files[cls]
            fh.seek(0)
            buf: list[Item] = []
            for line in fh:
                buf.extend(orjson.loads(line))
                if len(buf) >= chunk:
                    yield buf
                    buf = []
            if buf:
                yield buf

    def close(self) -> None:
        for fh in self._files.values():
            try:
                fh.close()
            except OSError:
                pass  # the files are removed; a failed flush was reported by longest_first
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
