"""The items of a run's jobs by reference, for the producer's readers of jobs (the reconcile):
the pack table read once, each pack's index once, a ranged read per job (issue 34).

A pack that cannot be read now is no reason to guess: the reconcile needs every live job's
items, or it would take them for lost and queue them twice. So it stops with one line naming
the pack (UserError), and the same command runs again once the pack or the store is back.
"""

from __future__ import annotations

import redis

from genqueue.common.contracts import Item
from genqueue.common.errors import PackError, UserError
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import PackRef
from genqueue.common.storage import StoreError, store_for
from genqueue.common.storage.packreader import PackReader


class PackItems:
    """RUN's jobs by reference read from its packs at OUTPUT (the run's output store)."""

    def __init__(self, conn: redis.Redis, run: str, output: str, *, reader: PackReader | None = None) -> None:
        self.run = run
        self.output = output
        self._table = PackTable(conn, run)
        self._names: dict[int, str] | None = None
        self._reader = reader if reader is not None else PackReader(store_for)

    def items_of(self, ref: PackRef) -> list[Item]:
        """The items of block REF.block of pack REF.pack. UserError when they cannot be read."""
        if self._names is None or ref.pack not in self._names:
            self._names = self._table.names()  # once, and again for a pack queued since
        name = self._names.get(ref.pack)
        if name is None:
            raise UserError(f"run {self.run}: a job names pack number {ref.pack}, which the run's pack table does not "
                            "name; nothing more was queued")
        try:
            return self._reader.block(self.output, self.run, name, ref.block)
        except (PackError, StoreError) as e:
            raise UserError(f"run {self.run}: the items of a job by reference cannot be read ({e}); nothing more was "
                            "queued: run the same command again once the pack can be read") from None
