"""The items of a run's jobs by reference, for the producer's readers of jobs (the reconcile):
the pack table read once, each pack's index once, a ranged read per job.

A pack that cannot be read now is no reason to guess: the reconcile needs every live job's
items, or it would take them for lost and queue them twice. So it stops with one line naming
the pack (UserError), and the same command runs again once the pack or the store is back.
Export can go on without them (Unreadable.NOTE): the job is noted among the entries it could
not read (JobItemsUnreadableError, caught by common/keepers/rqjobs.py) and its items stay missing.
"""

from __future__ import annotations

from enum import StrEnum

import redis

from genqueue.common.contracts import Item
from genqueue.common.errors import JobItemsUnreadableError, PackError, UserError
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import PackRef
from genqueue.common.storage import StoreError, store_for
from genqueue.common.storage.packreader import PackReader


class Unreadable(StrEnum):
    """What a reader of jobs does with a job whose items cannot be read."""

    STOP = "stop"  # the reconcile: one line (UserError), nothing more queued
    NOTE = "note"  # export: the job noted as unreadable, its items missing


class PackItems:
    """RUN's jobs by reference read from its packs at OUTPUT (the run's output store)."""

    def __init__(self, conn: redis.Redis, run: str, output: str, *, reader: PackReader | None = None,
                 unreadable: Unreadable = Unreadable.STOP) -> None:
        self.run = run
        self.unreadable = unreadable
        self.output = output
        self._table = PackTable(conn, run)
        self._names: dict[int, str] | None = None
        self._reader = reader if reader is not None else PackReader(store_for)

    def items_of(self, ref: PackRef) -> list[Item]:
        """The items of block REF.block of pack REF.pack. When they cannot be read: UserError
        (Unreadable.STOP) or JobItemsUnreadableError (Unreadable.NOTE)."""
        if self._names is None or ref.pack not in self._names or not ref.names(self._names[ref.pack]):
            self._names = self._table.names()  # once, and again for a pack queued (or numbered again) since
        name = self._names.get(ref.pack)
        if name is not None and not ref.names(name):
            why = f"pack number {ref.pack} of writer {ref.writer} is {name} in the run's pack table"
            if self.unreadable is Unreadable.NOTE:
                raise JobItemsUnreadableError(why)
            raise UserError(f"run {self.run}: a job names {why}; nothing more was queued")
        if name is None:
            if self.unreadable is Unreadable.NOTE:
                raise JobItemsUnreadableError(f"pack number {ref.pack} is not in the run's pack table")
            raise UserError(f"run {self.run}: a job names pack number {ref.pack}, which the run's pack table does not "
                            "name; nothing more was queued")
        try:
            return self._reader.block(self.output, self.run, name, ref.block)
        except (PackError, StoreError) as e:
            if self.unreadable is Unreadable.NOTE:
                raise JobItemsUnreadableError(f"its items cannot be read ({e})") from None
            raise UserError(f"run {self.run}: the items of a job by reference cannot be read ({e}); nothing more was "
                            "queued: run the same command again once the pack can be read") from None
