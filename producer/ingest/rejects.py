"""Rejected records: the exception that carries a reason, and the file that lists them.

Reasons are the stable names of `contracts.RejectReason`: a user greps a rejects file for them,
and `producer status` sums them per run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

import orjson

from genqueue.common.contracts import RejectReason
from genqueue.common.errors import GenqueueError, WriteFailedError
from genqueue.producer.outfiles import REJECTS, probe, record_written, write_failed

REJECT_REASONS: tuple[RejectReason, ...] = tuple(RejectReason)
"""Every reason a record can be rejected for."""

#: Characters of a reject's detail kept in the rejects file.
DETAIL_CHARS = 200


class Rejected(GenqueueError):
    """A record that cannot become work items, with the reason and a detail for the rejects file."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


class RejectsWriter:
    """Writes one JSON line per rejected record: position, reason, detail, and its first bytes
    (the snippet the reader kept, at most splitter.SNIPPET_BYTES).

    `open` is called before anything is enqueued: it creates `<path>.<pid>.partial` and writes one
    block there (outfiles.probe), so a read-only, missing or full place is refused up front
    (exit 2) rather than after jobs were queued. Lines go to the .partial file; `close` renames
    it to PATH when there was a reject, and removes it when there was none (a clean input leaves
    no empty file, and an earlier rejects file of that name stays). A write that fails later
    raises WriteFailedError (exit 1); `discard` then removes the .partial file. A PATH that is
    not a regular file (/dev/null, a pipe) is written as it is: renaming onto it would replace
    the device. A rejects file in place is listed as genqueue's (outfiles.record_written): the
    enqueue refuses to replace any other file of that name (enqueue/core.py).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.special = os.path.exists(path) and not os.path.isfile(path)
        # one per process: producers racing on one run may name the same rejects file
        self.partial = Path(path if self.special else f"{path}.{os.getpid()}.partial")
        self._fh: IO[bytes] | None = None
        self.count = 0
        self.placed = False
        self._done = False

    @property
    def written(self) -> bool:
        """PATH holds this invocation's rejects (closed and renamed into place)."""
        return self.placed

    def open(self) -> RejectsWriter:
        if self.special:
            try:
                self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
            except OSError as e:
                raise write_failed(e, self.partial, REJECTS) from None
        else:
            self._fh = probe(self.partial, REJECTS, keep=True, shown=Path(self.path))
        return self

    def write(self, index: int, line: int | None, snippet: bytes, reason: RejectReason, detail: str = "") -> None:
        if self._fh is None:
            self.open()
        assert self._fh is not None
        row = {
            "index": index,
            "line": line,
            "reason": reason.value,
            "detail": detail[:DETAIL_CHARS],
            "snippet": snippet.decode("utf-8", "replace"),
        }
        try:
            self._fh.write(orjson.dumps(row) + b"\n")
        except OSError as e:
            raise self._failed(e) from None
        self.count += 1

    def close(self) -> None:
        """Put the file in place (or remove it: no rejects)."""
        if self._fh is None:
            return
        try:
            self._fh.close()
        except OSError as e:
            raise self._failed(e) from None
        self._fh = None
        self._done = True
        if self.special:
            self.placed = self.count > 0
        elif self.count:
            os.replace(self.partial, self.path)
            self.placed = True
            record_written([Path(self.path).absolute()])  # genqueue's: the next enqueue may replace it
        else:
            self.partial.unlink(missing_ok=True)

    def discard(self) -> None:
        """After a failure: remove the .partial file, raising nothing (nothing once closed)."""
        if self._done:
            return
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass  # the failure being handled is the one reported
            self._fh = None
        if not self.special:
            self.partial.unlink(missing_ok=True)

    def _failed(self, e: OSError) -> WriteFailedError:
        err = write_failed(e, self.partial, REJECTS)
        self.discard()
        return err
