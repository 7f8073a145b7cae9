"""Every key a keeper names, for a sample run, worker and item, byte for byte: the keys are what
Redis holds across an upgrade (a consumer of one version and a producer of another share them),
so a change to how keepers build them must leave each one as it is here."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import redis

from genqueue.common.keepers.checkpoints import checkpoint_key
from genqueue.common.keepers.claims import claim_key
from genqueue.common.keepers.exportsets import ExportSets
from genqueue.common.keepers.featurecounts import counted_key, pending_key
from genqueue.common.keepers.flights import Flights
from genqueue.common.keepers.hungry import Hungry
from genqueue.common.keepers.itemlayout import bucket_key, place_key
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.markstamps import MarkStamp, RebuildState
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.rqaccess import queue_name, refused_key
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import CONSUMERS, RUNS, consumer_key
from genqueue.common.keepers.runsources import RunSources
from genqueue.common.keepers.snapshots import Snapshots
from genqueue.common.keepers.spectally import SpecTallies

#: A connection that never connects: building a keeper sends nothing to Redis.
_CONN = redis.Redis(host="unused.invalid")

KEYS: dict[str, tuple[Callable[[], str], str]] = {
    "runs": (lambda: RUNS, "genqueue:runs"),
    "consumers": (lambda: CONSUMERS, "genqueue:consumers"),
    "consumer": (lambda: consumer_key("w1"), "genqueue:consumer:w1"),
    "run": (lambda: run_key("r1"), "genqueue:run:r1"),
    "stats": (lambda: run_key("r1", "stats"), "genqueue:run:r1:stats"),
    "lock": (lambda: RunLock.key("r1"), "genqueue:run:r1:lock"),
    "runlock": (lambda: RunLock(_CONN, "r1").key("r1"), "genqueue:run:r1:lock"),
    "claim": (lambda: claim_key("r1", "c1"), "genqueue:run:r1:claim:c1"),
    "itemtable": (lambda: ItemTable.key("r1"), "genqueue:run:r1:itemtable"),
    "bucket": (lambda: bucket_key("r1", 10), "genqueue:run:r1:items:a"),
    "place": (lambda: place_key("r1", 3), "genqueue:run:r1:pk:3"),
    "flights": (lambda: Flights.key("r1"), "genqueue:run:r1:flights"),
    "hedges": (lambda: Flights.hedges_key("r1"), "genqueue:run:r1:hedges"),
    "hungry": (lambda: Hungry.key("r1"), "genqueue:run:r1:hungry"),
    "packs": (lambda: PackTable.key("r1"), "genqueue:run:r1:packs"),
    "packs_seq": (lambda: PackTable.seq_key("r1"), "genqueue:run:r1:packs:seq"),
    "paused": (lambda: Pause.key("r1"), "genqueue:run:r1:paused"),
    "source_order": (lambda: RunSources.key("r1"), "genqueue:run:r1:source-order"),
    "reading": (lambda: RunSources.reading_key("r1"), "genqueue:run:r1:reading"),
    "rebuild": (lambda: RebuildState.key("r1"), "genqueue:run:r1:rebuild"),
    "marks_stamp": (lambda: MarkStamp.key("w1"), "genqueue:marks_stamp:w1"),
    "spec": (lambda: SpecTallies.key("r1"), "genqueue:run:r1:spec"),
    "spent": (lambda: Snapshots.spent_key("r1"), "genqueue:run:r1:spent"),
    "spent_pending": (lambda: pending_key("r1"), "genqueue:run:r1:spent_pending"),
    "features_counted": (lambda: counted_key("r1"), "genqueue:run:r1:features_counted"),
    "checkpoint": (lambda: checkpoint_key("r1", "ab" * 16), "genqueue:run:r1:ckpt:" + "ab" * 16),
    "refused": (lambda: refused_key(queue_name("r1")), "genqueue:refused:genqueue.r1"),
}


@pytest.mark.parametrize("name", sorted(KEYS))
def test_each_keeper_names_its_key_as_redis_holds_it(name: str) -> None:
    build, want = KEYS[name]
    assert build() == want


def test_an_exports_scratch_keys_are_two_sets_under_the_run() -> None:
    keys = ExportSets(_CONN, "r1").keys
    assert re.fullmatch(r"genqueue:run:r1:export:[0-9a-f]{32}:seen", keys.seen)
    assert keys.missing == keys.seen.removesuffix(":seen") + ":missing"
