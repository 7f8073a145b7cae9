"""The reconcile's pure parts: a record's bucket, which settings may change, run.json's form."""

from __future__ import annotations

import pytest

from genqueue.common.contracts import RejectReason
from genqueue.common.errors import UserError
from genqueue.common.settings import RunSettings, Sampling, check_update, fingerprint_entry
from genqueue.common.storage import StoreError
from genqueue.common.storage.runfile import RunFile
from genqueue.producer.enqueue.enqueuer import Enqueuer
from genqueue.producer.enqueue.summary import Flag, Summary, bucket


def test_a_record_takes_the_bucket_of_its_most_pressing_item() -> None:
    c = Flag.CONVERTED
    assert bucket(c) == "duplicates"
    assert bucket(c | Flag.DONE) == "already_done"
    assert bucket(c | Flag.DONE | Flag.FAILED) == "already_failed"
    assert bucket(c | Flag.DONE | Flag.FAILED | Flag.QUEUED) == "already_queued"
    assert bucket(c | Flag.QUEUED | Flag.RETRIED) == "retried_failed"
    assert bucket(c | Flag.RETRIED | Flag.NEW | Flag.DONE) == "enqueued"


def test_fill_counts_every_converted_record_once() -> None:
    e = Enqueuer("r", RunSettings(), None)
    e.tally.flags = bytearray([Flag.CONVERTED | f for f in (Flag.NEW, Flag.DONE, Flag.FAILED, Flag.QUEUED, 0,
                                                            Flag.RETRIED | Flag.DONE)] + [0])  # the last: rejected
    e.tally.counts["records"] = 7
    e.tally.reasons[RejectReason.INVALID_JSON] = 1
    s = Summary(run="r", source="-", fingerprint="f", dry_run=True)
    e.fill(s)
    buckets = (s.enqueued, s.retried_failed, s.already_queued, s.already_failed, s.already_done, s.duplicates,
               s.rejected)
    assert buckets == (1, 1, 1, 1, 1, 1, 1) and sum(buckets) == s.records
    assert s.already_enqueued == 3


def test_update_settings_may_change_the_recipe_not_the_items_or_their_place() -> None:
    old = RunSettings(output="/out")
    assert check_update(old, RunSettings(output="/out", sampling=Sampling(max_tokens=64), model="m")) == [
        "model", "sampling.max_tokens"]
    with pytest.raises(UserError, match="multi_turn"):
        check_update(old, RunSettings(output="/out", multi_turn="first"))
    with pytest.raises(UserError, match="output"):
        check_update(old, RunSettings(output="/elsewhere"))


def test_run_file_round_trip_and_a_foreign_file() -> None:
    s = RunSettings(output="/out", sampling=Sampling(max_tokens=77))
    rf = RunFile("r", s, 1.5, "0.1.0", [fingerprint_entry(s, 1.5)], {"/a.jsonl": {"records": 3}})
    back = RunFile.from_json(rf.to_json(), "/out/r/run.json")
    assert (back.settings, back.fingerprint, back.created_at, back.fingerprints, back.sources) == (
        s, s.fingerprint, 1.5, rf.fingerprints, rf.sources)
    with pytest.raises(StoreError, match="/out/r/run.json is not a genqueue run file"):
        RunFile.from_json(b'{"hello": 1}', "/out/r/run.json")
    with pytest.raises(StoreError):
        RunFile.from_json(b"not json", "/out/r/run.json")
