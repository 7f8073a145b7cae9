"""One order for a run fed from several inputs: source place, then position in the source.

The export partitions records by their place in that order. Each source's records take the
range after those of the sources enqueued before it (its record count from the run's source
summaries); a position past its source's count stays at the end of its range, so the order
of partitions is the order of the dataset whatever the counts say. Runs made before sources
had places have one range, indexed by position as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from genqueue.common.keepers.runs import RunStore
from genqueue.common.keepers.runsources import RunSources


@dataclass(frozen=True, slots=True)
class Layout:
    total: int
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)  # place -> (first, count)

    def position(self, place: int, index: int) -> int:
        """The record's position in the whole run (0 .. total-1 for known sources)."""
        if not self.ranges:
            return max(index, 0)
        span = self.ranges.get(place)
        if span is None:  # a place the run does not list: after everything it does
            return self.total
        first, count = span
        return first + min(max(index, 0), count - 1)


def layout_for(conn: redis.Redis, run: str) -> Layout:
    store = RunStore(conn)
    summaries = store.sources(run)
    items = store.item_count(run)
    places = RunSources(conn, run).places()
    if not places:
        records = [int(s.get("records", 0)) for s in summaries.values()]
        return Layout(max([*records, items, 1]))
    ranges: dict[int, tuple[int, int]] = {}
    total = 0
    for source, place in sorted(places.items(), key=lambda kv: kv[1]):
        summary = summaries.get(source)
        count = int(summary.get("records", 0)) if summary else items
        ranges[place] = (total, max(count, 1))
        total += max(count, 1)
    return Layout(total, ranges)
