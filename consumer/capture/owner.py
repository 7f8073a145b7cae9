"""Whose capture file is whose, on the engine's disk.

The engine writes one file per request into its shared_storage_path and the consumer that asked
removes it once read; a consumer killed with requests in flight leaves theirs for good. So every
request that asks for hidden states carries a request id naming its consumer, which vLLM puts
in the file's name (`chatcmpl-<request id>-<8 hex>.safetensors`):

    gq-<spool tag>-<process tag>-<random>

The spool tag is this node's spool's (a hash of the host and the spool's real path): a consumer
started again on a spool, or one taking a dead consumer's spool over, finds what its
predecessors left. The spool's flock (consumer/shipping/shards.py) lets one live consumer hold a
spool at a time, so files of this spool tag but another process tag are a dead consumer's and
are removed; another spool's files, a live consumer's or not, are never touched.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: What every genqueue request id starts with (vLLM puts `chatcmpl-` or `cmpl-` before it).
PREFIX = "gq-"
SUFFIXES = (".safetensors", ".safetensors.lock")


def spool_tag(spool: str | os.PathLike[str], host: str | None = None) -> str:
    """The tag of the consumer on SPOOL on HOST (this host): the same for every process on it."""
    where = f"{host or socket.gethostname()}:{os.path.realpath(spool)}"
    return hashlib.sha256(where.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class CaptureOwner:
    """This process's name on the capture files its requests make."""

    spool: str  # the spool tag (spool_tag)
    process: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @classmethod
    def of(cls, spool: str | os.PathLike[str]) -> CaptureOwner:
        return cls(spool_tag(spool))

    def request_id(self) -> str:
        """A fresh request id for one request that asks for its hidden states."""
        return f"{PREFIX}{self.spool}-{self.process}-{uuid.uuid4().hex[:12]}"

    def leftovers(self, folder: Path) -> list[Path]:
        """The capture files (and their locks) in FOLDER that an earlier consumer on this spool left."""
        mine, now = f"{PREFIX}{self.spool}-", f"{PREFIX}{self.spool}-{self.process}-"
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return sorted(folder / n for n in names
                      if n.endswith(SUFFIXES) and mine in n and now not in n)

    def sweep(self, folder: Path) -> int:
        """Remove leftovers() from FOLDER; how many captures went (a file and its lock count
        once). A file whose lock a writer still holds (the engine finishing a dead consumer's
        request) is left for the next sweep; a lock with no file beside it goes too."""
        removed = 0
        for path in self.leftovers(folder):
            data = path.with_name(path.name.removesuffix(".lock"))
            if _being_written(data):
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("could not remove the capture file %s an earlier consumer left: %s", path, e)
                continue
            if path == data:
                removed += 1
        return removed


def _being_written(path: Path) -> bool:
    """Whether the engine's connector holds PATH's lock (it does until the file is whole)."""
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
