"""Jobs by reference: what reading their items from the run's packs can come to.

A job by reference names a pack of its run by number and a block of it (rqaccess.PackRef);
intake.py reads the block through the run's output store (PackReader) and checks its items
like inline ones.
- A pack that is not there or does not read, or a number the run's pack table lacks, is the
  job's fault (PackUnreadable): it fails for good with the reason `pack_unreadable: ...`
  (JOB_FAILURE_PACK), and `rq requeue` runs it again once the pack is back.
- A store that cannot be reached now (StoreError) is no fault of the job: it goes back to its
  queue without spending a retry, and the run is in a pack outage (PackOutages): the consumer's
  `packs_unreachable` pause reason says since when and why, and the run's queue is asked again
  after the store backoff, longer with each failed read in a row. The first pack read ends it;
  so does the run leaving the served runs, or its queue found empty.
- A pack's number turns into its name by the run's pack table once per run and number, kept
  (PackNames): a name never changes once written. Only a rewind gives a number out again,
  under another writer's name: the job's writer tag tells a kept name from before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from genqueue.common.backoff import store_backoff
from genqueue.consumer.answer.generate import RunContext

#: The reason a job by reference whose pack cannot be read fails with (module docstring).
JOB_FAILURE_PACK = "pack_unreadable"


class PackUnreadable(Exception):
    """A job by reference whose items cannot be read: its pack is not there, does not read, or
    its number is not in the run's pack table."""


@dataclass
class PackOutage:
    """A run whose packs the output store cannot serve now: its last pack read raised StoreError."""

    since: float  # time.time() of the first failed read
    began: float  # time.monotonic() of it
    error: str  # the last failure, redacted
    failures: int = 0  # failed reads in a row
    retry_in: float = 0.0  # seconds before the run's queue is asked again (store_backoff)


class PackOutages:
    """The runs in a pack outage here (the `packs_unreachable` pause reason), per run."""

    def __init__(self) -> None:
        self.runs: dict[str, PackOutage] = {}

    def failed(self, run: str, error: str) -> PackOutage:
        """A read of RUN's packs failed now with ERROR; its outage (new or longer)."""
        outage = self.runs.get(run)
        if outage is None:
            outage = self.runs[run] = PackOutage(time.time(), time.monotonic(), error)
        outage.error = error
        outage.failures += 1
        outage.retry_in = store_backoff(outage.failures)
        return outage

    def end(self, run: str) -> PackOutage | None:
        """RUN's outage is over (a pack read, or nothing left to read): the outage it ended, if any."""
        return self.runs.pop(run, None)

    def reason(self) -> str | None:
        """The pause reason's text, or None with every run's packs readable."""
        if not self.runs:
            return None
        return "; ".join(
            f"run {run}: packs unreachable since {datetime.fromtimestamp(o.since, UTC):%Y-%m-%d %H:%M:%S} UTC "
            f"({o.failures} failed read{'s' if o.failures != 1 else ''} in a row): {o.error}"
            for run, o in sorted(self.runs.items()))


class PackNames:
    """Pack number -> name per run, as the run's pack table has them (PackTable.name_of): a name
    never changes once written, so each is asked once a run; a number the table lacks is not kept
    (its next job asks again). Kept per served context: a run re-created, resumed or with new
    settings is served under a new one, and asks again."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[RunContext, dict[int, str]]] = {}
        self.table_reads = 0  # HGETs of a pack table: what the cache saves

    def known(self, ctx: RunContext, number: int) -> str | None:
        kept = self._runs.get(ctx.run)
        return kept[1].get(number) if kept is not None and kept[0] is ctx else None

    def keep(self, ctx: RunContext, number: int, name: str) -> None:
        kept = self._runs.get(ctx.run)
        if kept is None or kept[0] is not ctx:
            kept = self._runs[ctx.run] = (ctx, {})
        kept[1][number] = name

    def keep_only(self, runs: set[str]) -> None:
        """Forget the runs not in RUNS (no longer served here)."""
        for run in set(self._runs) - runs:
            del self._runs[run]
