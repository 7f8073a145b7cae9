"""What every store of result shards offers, and the shard records they pass around.

A store is where a run's output lives (a directory, a shared mount, an S3 prefix). The
consumer ships sealed shards to it; `producer export` lists and reads them back. Both go
through the same `ShardStore`, so what one writes the other reads by the same rule
(`names.py`).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Protocol, cast

import orjson

from genqueue.common.errors import GenqueueError, UserError
from genqueue.common.records import ShardManifest

log = logging.getLogger(__name__)


class StoreError(GenqueueError):
    """The output location cannot be listed or read (the export ends with this message)."""


class StoreRefusedError(StoreError, UserError):
    """The output cannot be read with this host's credentials (none, or refused): the user's to
    fix, so exit 2 as the enqueue's probe does; still a StoreError to those that ride it out."""


class OutputMissingError(UserError):
    """A local output directory that does not exist (yet): nothing was shipped there. A command
    that only looks for what is there (an enqueue making its run) takes it as empty; one that
    needs the output (an export) stops with this message."""


class PackNotFoundError(StoreError):
    """A pack a job names is not in the run's output (deleted, or another output than the one
    it was written to)."""


class ProbeCause(StrEnum):
    """Why a run's output failed its probe (`ShardStore.probe`): what the one line names."""

    NO_CREDENTIALS = "no credentials"
    ACCESS_DENIED = "access denied"
    SIGNATURE_REFUSED = "signature refused"
    NO_SUCH_BUCKET = "no such bucket"
    READ_ONLY = "read-only"
    MISSING_DIRECTORY = "missing directory"
    NOT_A_DIRECTORY = "not a directory"
    FULL = "no space left"
    UNREACHABLE = "endpoint unreachable"
    READ_BACK = "read back wrong"
    OTHER = "refused"


class OutputProbeError(UserError):
    """A run's output cannot be written and read back (the probe `producer enqueue` and every
    consumer's pre-flight run before anything is queued or generated): one line naming the
    output, the cause and the fix; exit 2 at enqueue, 4 at a --burst consumer's pre-flight."""

    def __init__(self, output: str, cause: ProbeCause, detail: str, fix: str) -> None:
        super().__init__(f"output {output} cannot be written: {cause.value} ({detail}); {fix}")
        self.output = output
        self.cause = cause
        self.detail = detail
        self.fix = fix


@dataclass(frozen=True, slots=True)
class SealedShard:
    """A spool file that is complete (flushed, fsynced) and ready to ship: what its manifest says."""

    run: str
    seq: int
    path: Path
    name: str
    records: int
    bytes: int
    sha256: str
    keys: int

    def manifest(self) -> ShardManifest:
        return {"run": self.run, "shard": self.name, "records": self.records, "keys": self.keys,
                "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard of a run as a store lists it. `manifest` names its manifest object when one was
    listed beside it; a shard without one is still complete (its consumer died before writing
    the manifest) and its records count."""

    name: str
    bytes: int
    manifest: str | None = None


class ShardStore(Protocol):
    """A run output location. `ship` is synchronous and slow: the consumer runs it in a thread."""

    def location(self, run: str) -> str:
        """Where RUN's shards are, for messages (a path, or an s3:// URL ending in '/')."""
        ...

    def ship(self, shard: SealedShard) -> str:
        """Copy SHARD in, verify it, then write its manifest; returns where it went. Raises on
        any failure (nothing is acked until this returns)."""
        ...

    def list_shards(self, run: str) -> list[ShardInfo]:
        """RUN's shards in name order (so an export is deterministic). Raises StoreError."""
        ...

    def open(self, run: str, name: str) -> IO[bytes]:
        """A binary stream of the object NAME (a shard or a manifest) of RUN. Raises StoreError."""
        ...

    def probe(self, run: str) -> None:
        """Prove RUN's output can be written and read back: one small probe object or file
        (names.probe_name) written, read, compared and removed, leaving nothing behind. Raises
        OutputProbeError naming the cause and the fix."""
        ...


class PackStore(Protocol):
    """Where a run's packs of prompts live (names.pack_name, common/packs.py). A pack
    is put once, whole, and read back whole or by byte range. Blocking: run it in a thread."""

    def pack_location(self, run: str, name: str) -> str:
        """Where RUN's pack NAME is, for messages (what a PackError names)."""
        ...

    def put_pack(self, run: str, name: str, data: bytes) -> str:
        """Store DATA as RUN's pack NAME, whole or not at all; returns where it went. Raises
        StoreError."""
        ...

    def get_pack(self, run: str, name: str) -> bytes:
        """The whole of RUN's pack NAME. Raises PackNotFoundError, StoreError."""
        ...

    def get_pack_range(self, run: str, name: str, start: int, end: int) -> bytes:
        """Bytes [START, END) of RUN's pack NAME (fewer when the pack is shorter: the pack's own
        checks name that). Raises PackNotFoundError, StoreError."""
        ...

    def get_pack_tail(self, run: str, name: str, length: int) -> tuple[bytes, int]:
        """The last LENGTH bytes of RUN's pack NAME (all of it when shorter) and its size: its
        footer and, mostly, its index in one read. Raises PackNotFoundError, StoreError."""
        ...


class OutputStore(ShardStore, PackStore, Protocol):
    """A run's output location as the producer uses it: its shards, its packs, and
    `<run>/run.json`, what is needed to re-create the run should Redis lose it
    (names.run_settings_name)."""

    def get_run_file(self, run: str) -> bytes | None:
        """The content of RUN's run.json, or None when there is none. Raises StoreError."""
        ...

    def put_run_file(self, run: str, data: bytes) -> str:
        """Replace RUN's run.json with DATA, whole or not at all; returns where it went. Raises
        StoreError."""
        ...


def probe_token() -> str:
    """A name part no other probe uses at the same time (names.probe_name)."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


def probe_body(token: str) -> bytes:
    """What a probe writes: its own token, so reading back another probe's bytes is caught."""
    return f"genqueue output probe {token}\n".encode()


def check_read_back(output: str, where: str, back: bytes, body: bytes, fix: str) -> None:
    """Raise the probe's READ_BACK error for OUTPUT when what WHERE (the probe's file or object)
    read back, BACK, is not the BODY written; FIX says what to check."""
    if back != body:
        raise OutputProbeError(output, ProbeCause.READ_BACK,
                               f"{where} read back {len(back)} bytes, not the {len(body)} written", fix)


def parse_manifest(raw: bytes) -> ShardManifest | None:
    """A manifest's content, or None (with a warning) when it is not one: a reader must still
    read the shard."""
    try:
        man = orjson.loads(raw)
    except orjson.JSONDecodeError:
        man = None
    if (not isinstance(man, dict) or not isinstance(man.get("sha256"), str)
            or not isinstance(man.get("records"), int)):
        log.warning("unreadable shard manifest ignored")
        return None
    return cast(ShardManifest, man)


def read_manifest(store: ShardStore, run: str, shard: ShardInfo) -> ShardManifest | None:
    """SHARD's manifest, or None when it has none (or an unreadable one)."""
    if shard.manifest is None:
        return None
    with store.open(run, shard.manifest) as fh:
        return parse_manifest(fh.read())
