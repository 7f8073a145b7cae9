"""Where a run's shards are read from: a local (or mounted) directory, or S3.

Both list `<output>/<run>/shards/*.jsonl` in name order (so the export is deterministic) with
each shard's size and, when its manifest is there, the sha256 and record count it promises
(S3: known once the shard is opened, as the manifest is fetched with it).
A shard object is complete once it exists (a rename locally, an atomic PUT in S3); a missing
manifest only means its consumer died before writing it, and its records still count.
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Protocol

import orjson

from genqueue.common.errors import GenqueueError, UserError

log = logging.getLogger(__name__)

READ_BUFFER = 1 << 20


class SourceError(GenqueueError):
    """The run's output location cannot be listed or read."""


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard of a run's output, as listed."""

    name: str
    bytes: int
    sha256: str | None = None
    records: int | None = None


class ShardSource(Protocol):
    """Lists and opens the shards of one run."""

    where: str

    def list_shards(self) -> list[ShardInfo]: ...

    def each(self, shards: list[ShardInfo]) -> Iterator[tuple[ShardInfo, IO[bytes]]]:
        """Each shard in order with an open binary file, valid until the next one is asked for."""
        ...


class LocalSource:
    """`<root>/<run>/shards/` on a local disk or a shared mount."""

    def __init__(self, root: str, run: str) -> None:
        self.dir = Path(root) / run / "shards"
        self.where = str(self.dir)

    def list_shards(self) -> list[ShardInfo]:
        if not self.dir.is_dir():
            if not Path(self.dir).parent.parent.is_dir():
                raise UserError(f"the run's output directory {self.dir.parent.parent} does not exist")
            return []
        found = []
        for path in sorted(self.dir.glob("*.jsonl")):
            man = _read_manifest(path.with_name(path.name.removesuffix(".jsonl") + ".manifest.json"))
            found.append(ShardInfo(path.name, path.stat().st_size, *man))
        return found

    def each(self, shards: list[ShardInfo]) -> Iterator[tuple[ShardInfo, IO[bytes]]]:
        for shard in shards:
            with open(self.dir / shard.name, "rb", buffering=READ_BUFFER) as fh:
                yield shard, fh


class S3Source:
    """s3://bucket/prefix/<run>/shards/: each shard is downloaded to a temporary file (the
    transfer manager's ranged, retried GETs), read, then deleted; the next one downloads
    while the current one is read."""

    def __init__(self, url: str, run: str, *, tmpdir: str | None = None) -> None:
        from genqueue.consumer.s3sink import S3Location, make_client

        self.loc = S3Location.parse(url)
        self.prefix = self.loc.key(run, "shards") + "/"
        self.where = self.loc.url(self.prefix)
        self.client = make_client(read_timeout=120)
        self.tmpdir = tmpdir
        self._manifests: set[str] = set()

    def list_shards(self) -> list[ShardInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        sizes: dict[str, int] = {}
        self._manifests.clear()
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.loc.bucket,
                                                                               Prefix=self.prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(self.prefix):]
                    if "/" in name:
                        continue
                    if name.endswith(".jsonl"):
                        sizes[name] = int(obj["Size"])
                    elif name.endswith(".manifest.json"):
                        self._manifests.add(name)
        except (BotoCoreError, ClientError) as e:
            raise SourceError(f"cannot list {self.where}: {e}") from None
        return [ShardInfo(name, sizes[name]) for name in sorted(sizes)]

    def each(self, shards: list[ShardInfo]) -> Iterator[tuple[ShardInfo, IO[bytes]]]:
        # The next shard (and its manifest) downloads while this one is read: at most two
        # temporary files exist at a time.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-get") as pool:
            ahead: collections.deque[Future[tuple[ShardInfo, str]]] = collections.deque()
            try:
                for i, shard in enumerate(shards):
                    if not ahead:
                        ahead.append(pool.submit(self._download, shard))
                    described, path = ahead.popleft().result()
                    if i + 1 < len(shards):
                        ahead.append(pool.submit(self._download, shards[i + 1]))
                    try:
                        with open(path, "rb", buffering=READ_BUFFER) as fh:
                            yield described, fh
                    finally:
                        os.unlink(path)
            finally:
                for fut in ahead:  # stopped early (an error): drop the prefetched file
                    with suppress(Exception):
                        os.unlink(fut.result()[1])

    def _download(self, shard: ShardInfo) -> tuple[ShardInfo, str]:
        """The shard with what its manifest says, and the temporary file holding it."""
        from botocore.exceptions import BotoCoreError, ClientError

        man_name = shard.name.removesuffix(".jsonl") + ".manifest.json"
        fd, tmp = tempfile.mkstemp(prefix=".gq-export-", suffix=".jsonl", dir=self.tmpdir)
        os.close(fd)
        try:
            if man_name in self._manifests:
                raw = self.client.get_object(Bucket=self.loc.bucket, Key=self.prefix + man_name)["Body"].read()
                sha256, records = _parse_manifest(raw)
                shard = replace(shard, sha256=sha256, records=records)
            self.client.download_file(self.loc.bucket, self.prefix + shard.name, tmp)
        except (BotoCoreError, ClientError) as e:
            os.unlink(tmp)
            raise SourceError(f"cannot read {self.where}{shard.name}: {e}") from None
        return shard, tmp


def source_for(output: str, run: str, *, tmpdir: str | None = None) -> ShardSource:
    """The shard source of a run whose output setting is OUTPUT."""
    if output.startswith("s3://"):
        return S3Source(output, run, tmpdir=tmpdir)
    return LocalSource(output, run)


def _read_manifest(path: Path) -> tuple[str | None, int | None]:
    try:
        return _parse_manifest(path.read_bytes())
    except OSError:
        return None, None


def _parse_manifest(raw: bytes) -> tuple[str | None, int | None]:
    try:
        man = orjson.loads(raw)
        return man.get("sha256"), man.get("records")
    except (orjson.JSONDecodeError, AttributeError):
        log.warning("unreadable shard manifest ignored")
        return None, None
