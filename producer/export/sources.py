"""Reading a run's shards for the export, from whatever store its output names.

The store (genqueue.common.storage: a directory, or S3) lists `<output>/<run>/shards/` in name
order, so the export is deterministic, and opens each shard and its manifest. A shard object is
complete once it exists (a rename locally, an atomic PUT in S3); a missing manifest only means
its consumer died before writing it, and its records still count. The next shard is opened (for
S3: downloaded) while the current one is read.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import IO

from genqueue.common.records import ShardManifest
from genqueue.common.storage import ShardInfo, ShardStore, read_manifest, store_for


@dataclass(frozen=True, slots=True)
class OpenShard:
    """A listed shard, what its manifest promises (None: no manifest), and its open stream."""

    info: ShardInfo
    manifest: ShardManifest | None
    fh: IO[bytes]


class ShardSource:
    """The shards of one run in one store."""

    def __init__(self, store: ShardStore, run: str) -> None:
        self.store = store
        self.run = run
        self.where = store.location(run)

    def list_shards(self) -> list[ShardInfo]:
        return self.store.list_shards(self.run)

    def each(self, shards: list[ShardInfo]) -> Iterator[OpenShard]:
        """Each shard in order, open; its stream is valid until the next one is asked for. At
        most two are open at a time (for S3: two temporary files)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-get") as pool:
            ahead: collections.deque[Future[OpenShard]] = collections.deque()
            try:
                for i, shard in enumerate(shards):
                    if not ahead:
                        ahead.append(pool.submit(self._open, shard))
                    current = ahead.popleft().result()
                    if i + 1 < len(shards):
                        ahead.append(pool.submit(self._open, shards[i + 1]))
                    with current.fh:
                        yield current
            finally:
                for fut in ahead:  # stopped early (an error): drop the one opened ahead
                    with suppress(Exception):
                        fut.result().fh.close()

    def count_records(self, shards: list[ShardInfo]) -> int | None:
        """The records the shards hold by their manifests (fetched 8 at a time), or None when
        one has no readable manifest: a progress bar's total, not a check."""
        def records(shard: ShardInfo) -> int | None:
            try:
                man = read_manifest(self.store, self.run, shard)
            except Exception:  # noqa: BLE001 - only a progress total: the export reads shards anyway
                return None
            return None if man is None else int(man["records"])

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="export-count") as pool:
            counts = list(pool.map(records, shards))
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    def _open(self, shard: ShardInfo) -> OpenShard:
        manifest = read_manifest(self.store, self.run, shard)
        return OpenShard(shard, manifest, self.store.open(self.run, shard.name))


def source_for(output: str, run: str, *, tmpdir: str | None = None) -> ShardSource:
    """The shards of RUN, whose output setting is OUTPUT. TMPDIR holds S3 downloads."""
    return ShardSource(store_for(output, tmpdir=tmpdir), run)
