"""The Enqueuer: one input's records through the enqueue's phases, a chunk of records at a time.

Each record is converted and counted (convert.py), its flags kept in the Tally (summary.py);
every CHUNK converted records, their items are settled (settle.py: done, new, queued,
failed or lost, in one Redis round trip) and the whole slices of what is to be queued handed to
the writers (slices.py) while the input is read on. Once the input is read, what longest-first
ordering held back is written, longest first, then the rest. An input that breaks part way
(InputError) still lands what came before the break. `close` waits for the slices in flight;
`fill` puts the counts into the Summary.
"""

from __future__ import annotations

from collections.abc import Iterator

from genqueue.common import defaults
from genqueue.common.contracts import Item
from genqueue.common.errors import InputError
from genqueue.common.settings import RunSettings
from genqueue.producer.enqueue.convert import Converter
from genqueue.producer.enqueue.jobwriter import JobWriter
from genqueue.producer.enqueue.order import LongestFirst
from genqueue.producer.enqueue.reconcile import QueueView
from genqueue.producer.enqueue.settle import Settler
from genqueue.producer.enqueue.slices import Slices
from genqueue.producer.enqueue.summary import Flag, Summary, Tally
from genqueue.producer.ingest.items import Origin
from genqueue.producer.ingest.reader import RawRecord
from genqueue.producer.ingest.rejects import RejectsWriter

#: Records examined per Redis round trip for the already-enqueued check.
CHUNK = 4096


class Enqueuer:
    """Turns records into jobs. With writer=None (dry run) nothing touches Redis. VIEW: a queue
    view taken already, under the run's lock, which is held since."""

    def __init__(
        self,
        run: str,
        settings: RunSettings,
        writer: JobWriter | None,
        *,
        batch_size: int = defaults.BATCH_SIZE,
        rejects: RejectsWriter | None = None,
        order: LongestFirst | None = None,
        origin: Origin | None = None,
        retry_failed: bool = False,
        view: QueueView | None = None,
    ) -> None:
        self.tally = Tally()
        self.converter = Converter(settings, self.tally, origin=origin or Origin(), rejects=rejects,
                                   costs=order is not None)
        self.slices = Slices(writer, self.tally, batch_size=batch_size, retry_failed=retry_failed)
        self.settler = Settler(run, settings.output, writer, self.slices, self.tally, order=order,
                               retry_failed=retry_failed, view=view)

    def process(self, records: Iterator[RawRecord]) -> None:
        chunk: list[tuple[int, list[Item]]] = []
        try:
            for rec in records:
                self.tally.read(rec.index)
                items = self.converter.convert(rec)
                if items is None:
                    continue
                self.tally.flags[rec.index] = Flag.CONVERTED
                chunk.append((rec.index, items))
                if len(chunk) >= CHUNK:
                    self._settle(chunk)
                    chunk = []
        except InputError:
            # The input broke part way (a truncated archive): what came before it still lands.
            self._settle(chunk)
            self.settler.drain()
            raise
        self._settle(chunk)
        self.settler.drain()

    def _settle(self, chunk: list[tuple[int, list[Item]]]) -> None:
        """Settle a chunk's items, then write the whole slices of what is to be queued."""
        if not chunk:
            return
        self.settler.settle(chunk, self.converter.estimates)
        self.converter.estimates.clear()
        self.slices.write(final=False)

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the slices in flight; the first error among them is raised here. ABANDON (the
        reading stopped on an error or Ctrl-C): slices not yet claimed are not (Slices.close)."""
        self.slices.close(abandon=abandon)

    def fill(self, summary: Summary) -> None:
        """Put the counts into SUMMARY: each converted record's bucket from its flags."""
        self.tally.fill(summary)
        summary.queue_view = self.settler.queue_view
