"""Where a run's shards are read from: a local (or mounted) directory, or S3.

Both list `<output>/<run>/shards/*.jsonl` in name order (so the export is deterministic) with
each shard's size and, when its manifest is there, the sha256 and record count it promises.
A shard object is complete once it exists (a rename locally, an atomic PUT in S3); a missing
manifest only means its consumer died before writing it, and its records still count.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import orjson

from common.errors import GenqueueError, UserError

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

    def list(self) -> list[ShardInfo]: ...

    def open(self, shard: ShardInfo) -> Any: ...  # a context manager yielding a binary file


class LocalSource:
    """`<root>/<run>/shards/` on a local disk or a shared mount."""

    def __init__(self, root: str, run: str) -> None:
        self.dir = Path(root) / run / "shards"
        self.where = str(self.dir)

    def list(self) -> list[ShardInfo]:
        if not self.dir.is_dir():
            if not Path(self.dir).parent.parent.is_dir():
                raise UserError(f"the run's output directory {self.dir.parent.parent} does not exist")
            return []
        found = []
        for path in sorted(self.dir.glob("*.jsonl")):
            man = _read_manifest(path.with_name(path.name.removesuffix(".jsonl") + ".manifest.json"))
            found.append(ShardInfo(path.name, path.stat().st_size, *man))
        return found

    @contextmanager
    def open(self, shard: ShardInfo) -> Iterator[IO[bytes]]:
        with open(self.dir / shard.name, "rb", buffering=READ_BUFFER) as fh:
            yield fh


class S3Source:
    """s3://bucket/prefix/<run>/shards/: each shard is downloaded to a temporary file (the
    transfer manager's ranged, retried GETs), read, then deleted."""

    def __init__(self, url: str, run: str, *, tmpdir: str | None = None) -> None:
        from consumer.s3sink import S3Location, make_client

        self.loc = S3Location.parse(url)
        self.prefix = self.loc.key(run, "shards") + "/"
        self.where = self.loc.url(self.prefix)
        self.client = make_client(read_timeout=120)
        self.tmpdir = tmpdir

    def list(self) -> list[ShardInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        sizes: dict[str, int] = {}
        manifests: set[str] = set()
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
                        manifests.add(name)
            found = []
            for name in sorted(sizes):
                man_name = name.removesuffix(".jsonl") + ".manifest.json"
                sha, records = (None, None)
                if man_name in manifests:
                    body = self.client.get_object(Bucket=self.loc.bucket, Key=self.prefix + man_name)["Body"]
                    sha, records = _parse_manifest(body.read())
                found.append(ShardInfo(name, sizes[name], sha, records))
        except (BotoCoreError, ClientError) as e:
            raise SourceError(f"cannot list {self.where}: {e}") from None
        return found

    @contextmanager
    def open(self, shard: ShardInfo) -> Iterator[IO[bytes]]:
        from botocore.exceptions import BotoCoreError, ClientError

        fd, tmp = tempfile.mkstemp(prefix="gq-export-", suffix=".jsonl", dir=self.tmpdir)
        os.close(fd)
        try:
            try:
                self.client.download_file(self.loc.bucket, self.prefix + shard.name, tmp)
            except (BotoCoreError, ClientError) as e:
                raise SourceError(f"cannot read {self.where}{shard.name}: {e}") from None
            with open(tmp, "rb", buffering=READ_BUFFER) as fh:
                yield fh
        finally:
            os.unlink(tmp)


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
