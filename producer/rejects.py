"""Rejected records: the exception that carries a reason, and the file that lists them.

Reasons are the stable names of `contracts.RejectReason`: a user greps a rejects file for them,
and `producer status` sums them per run.
"""

from __future__ import annotations

from typing import IO

import orjson

from genqueue.common.contracts import RejectReason
from genqueue.common.errors import GenqueueError

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

    The file is created at the first reject only, so a clean input leaves no empty file behind.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: IO[bytes] | None = None

    @property
    def written(self) -> bool:
        return self._fh is not None

    def write(self, index: int, line: int | None, snippet: bytes, reason: RejectReason, detail: str = "") -> None:
        if self._fh is None:
            self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        row = {
            "index": index,
            "line": line,
            "reason": reason.value,
            "detail": detail[:DETAIL_CHARS],
            "snippet": snippet.decode("utf-8", "replace"),
        }
        self._fh.write(orjson.dumps(row) + b"\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
