"""A run's output in a directory: local disk, or a mount every node shares.

Shipping copies the spool file to a temporary name, fsyncs it, renames it into place, then
does the same for its manifest and fsyncs the directory: a shard name that exists is a
complete shard, and a manifest that exists vouches for a shard already in place.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import IO

import orjson

from genqueue.common.storage.base import (
    OutputMissingError,
    OutputProbeError,
    PackNotFoundError,
    ProbeCause,
    SealedShard,
    ShardInfo,
    StoreError,
    check_read_back,
    probe_body,
    probe_token,
)
from genqueue.common.storage.names import (
    manifest_name,
    packs_prefix,
    parse_pack_name,
    parse_shard_name,
    probe_name,
    run_settings_name,
    shard_of_manifest,
    shards_prefix,
)

log = logging.getLogger(__name__)

#: Tries of a local output's probe: consumers starting together probe one directory, and a probe's directory
#: made and removed by another can vanish under it; a real fault fails every try.
OUTPUT_PROBE_TRIES = 3

#: Bytes read at a time from a local shard: one syscall per MiB, small beside an export's partitions.
READ_BUFFER = 1 << 20


class LocalStore:
    """`<root>/<run>/shards/` in a directory."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def shards_dir(self, run: str) -> Path:
        return self.root / shards_prefix(run)

    def location(self, run: str) -> str:
        return str(self.shards_dir(run))

    def ship(self, shard: SealedShard) -> str:
        dest_dir = self.shards_dir(shard.run)
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / shard.name
        tmp = dest_dir / f".{shard.name}.tmp"
        shutil.copyfile(shard.path, tmp)
        fsync_file(tmp)
        os.replace(tmp, dest)
        man = dest_dir / manifest_name(shard.name)
        man_tmp = dest_dir / f".{man.name}.tmp"
        man_tmp.write_bytes(orjson.dumps(shard.manifest()))
        fsync_file(man_tmp)
        os.replace(man_tmp, man)
        fsync_dir(dest_dir)
        return str(dest)

    def list_shards(self, run: str) -> list[ShardInfo]:
        d = self.shards_dir(run)
        if not d.is_dir():
            if not self.root.is_dir():
                raise OutputMissingError(f"the run's output directory {self.root} does not exist")
            return []
        shards: dict[str, int] = {}
        manifests: set[str] = set()
        foreign = 0
        try:
            for entry in os.scandir(d):
                if not entry.is_file() or entry.name.startswith("."):
                    continue  # temporary files of a ship in progress
                if parse_shard_name(entry.name) is not None:
                    shards[entry.name] = entry.stat().st_size
                elif shard_of_manifest(entry.name) is not None:
                    manifests.add(entry.name)
                else:
                    foreign += 1
        except OSError as e:
            raise StoreError(f"cannot list {d}: {e.strerror}") from None
        if foreign:
            log.warning("%s: %d files that are not shards were left out", d, foreign)
        return [ShardInfo(name, size, man if (man := manifest_name(name)) in manifests else None)
                for name, size in sorted(shards.items())]

    def open(self, run: str, name: str) -> IO[bytes]:
        if parse_shard_name(name) is None and shard_of_manifest(name) is None:
            raise StoreError(f"not a shard or manifest name: {name!r}")
        path = self.shards_dir(run) / name
        try:
            return open(path, "rb", buffering=READ_BUFFER)
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def get_run_file(self, run: str) -> bytes | None:
        path = self.root / run_settings_name(run)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def put_run_file(self, run: str, data: bytes) -> str:
        return _put_whole(self.root / run_settings_name(run), data)

    # --- packs -----------------------------------------------------------------------
    def _pack_path(self, run: str, name: str) -> Path:
        if parse_pack_name(name) is None:
            raise StoreError(f"not a pack name: {name!r}")
        return self.root / packs_prefix(run) / name

    def pack_location(self, run: str, name: str) -> str:
        return str(self._pack_path(run, name))

    def put_pack(self, run: str, name: str, data: bytes) -> str:
        """Written to a temporary name, fsynced, renamed into place: a pack name that exists is
        a whole pack."""
        return _put_whole(self._pack_path(run, name), data)

    def get_pack(self, run: str, name: str) -> bytes:
        path = self._pack_path(run, name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise PackNotFoundError(f"no pack {path}") from None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def get_pack_range(self, run: str, name: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"not a byte range: [{start}, {end})")
        path = self._pack_path(run, name)
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                return fh.read(end - start)
        except FileNotFoundError:
            raise PackNotFoundError(f"no pack {path}") from None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def get_pack_tail(self, run: str, name: str, length: int) -> tuple[bytes, int]:
        path = self._pack_path(run, name)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                fh.seek(max(size - length, 0))
                return fh.read(), size
        except FileNotFoundError:
            raise PackNotFoundError(f"no pack {path}") from None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def probe(self, run: str) -> None:
        """Write a probe file where RUN's output goes, read it back, remove it. Directories it
        had to make are removed again: a command that may be a mistake leaves no directory
        behind (the consumer makes them when it ships its first shard). Consumers starting
        together probe the same place at once: a directory another probe made (or removed)
        under this one is no fault, and the probe is tried again (OUTPUT_PROBE_TRIES)."""
        for attempt in range(1, OUTPUT_PROBE_TRIES + 1):
            try:
                back, body, path = self._probe_once(run)
            except FileNotFoundError as e:  # another probe removed a directory it had made
                if attempt == OUTPUT_PROBE_TRIES:
                    raise self._probe_failed(e) from None
                continue
            except OSError as e:
                raise self._probe_failed(e) from None
            check_read_back(str(self.root), str(path), back, body,
                            "check the filesystem (a cache or mount that does not keep what is written), or "
                            "enqueue the run with another --output")
            return

    def _probe_once(self, run: str) -> tuple[bytes, bytes, Path]:
        """One probe: (what was read back, what was written, the probe file's path)."""
        token = probe_token()
        path = self.root / probe_name(run, token)
        body = probe_body(token)
        made: list[Path] = []
        try:
            for d in reversed([path.parent, *path.parent.parents]):
                if not d.is_dir():
                    try:
                        d.mkdir()
                    except FileExistsError:
                        if not d.is_dir():
                            raise
                        continue  # another probe (or a consumer) made it meanwhile: not ours to remove
                    made.append(d)
            with open(path, "xb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            back = path.read_bytes()
            path.unlink()
            return back, body, path
        finally:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # never written: the first error is the one reported
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:
                    pass  # a consumer shipped into it, or another probe writes there: it stays

    def _file_in_the_way(self) -> Path | None:
        """The output's path, or the nearest existing folder above it, when it is not a directory."""
        for d in [self.root, *self.root.parents]:
            if d.exists() or d.is_symlink():
                return None if d.is_dir() else d
        return None

    def _probe_failed(self, e: OSError) -> OutputProbeError:
        detail = f"{e.filename or self.root}: {e.strerror or e}"
        other = "or enqueue the run with another --output"
        if e.errno == errno.EROFS:
            return OutputProbeError(str(self.root), ProbeCause.READ_ONLY, detail,
                                    f"mount it read-write, {other}")
        if e.errno in (errno.EACCES, errno.EPERM):
            return OutputProbeError(str(self.root), ProbeCause.ACCESS_DENIED, detail,
                                    f"give the user this runs as write access there, {other}")
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST) and (blocker := self._file_in_the_way()):
            return OutputProbeError(str(self.root), ProbeCause.NOT_A_DIRECTORY, f"{blocker} is a file",
                                    "the output is a directory the run's results go into: name a directory, not "
                                    f"a file, {other}")
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST):
            return OutputProbeError(str(self.root), ProbeCause.MISSING_DIRECTORY, detail,
                                    f"create the directory (or mount the share it is on), {other}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OutputProbeError(str(self.root), ProbeCause.FULL, detail, f"free space there, {other}")
        return OutputProbeError(str(self.root), ProbeCause.OTHER, detail, f"fix the path, {other}")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename in it survives a power cut (best effort: not every
    filesystem lets a directory be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_whole(path: Path, data: bytes) -> str:
    """DATA written to a temporary name beside PATH, fsynced, renamed into place (a name that
    exists holds the whole file); StoreError, in one line, when it cannot be."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        for attempt in range(1, OUTPUT_PROBE_TRIES + 1):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.write_bytes(data)
                break
            except FileNotFoundError:  # another command's probe removed the directory it had made
                if attempt == OUTPUT_PROBE_TRIES:
                    raise
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):  # its directory may be what failed (not one, unreadable)
            tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write {path}: {e.strerror}") from None
    return str(path)
