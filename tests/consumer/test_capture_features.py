"""A --capture run's answers become feature rows (consumer/capture/features.py) that ship before
the records naming them (consumer/shipping/outbox.py, features.py), in-process on local disk:
the stand-in's own capture files, real feature shards, a local output store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from genqueue.common.capture import CaptureDtype, CaptureKind, CaptureSettings
from genqueue.common.contracts import ErrorClass
from genqueue.common.features import FP8_ERROR, FeatureReader, LocalFeatureStore, ShardIndex, standin_features
from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.records import FeatureRef, ResultRecord
from genqueue.common.storage import LocalStore
from genqueue.consumer.answer.faults import BadCaptureError, error_class
from genqueue.consumer.capture.features import CaptureKeeper
from genqueue.consumer.guards.breaker import signature
from genqueue.consumer.shipping.features import FeatureSpool
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.shipping.shards import LOCK_NAME
from genqueue.consumer.sim.capture import CaptureConfig, save
from tests.doubles import item, result

LAYERS = (2, 4)
HIDDEN = 16
CAPTURE = CaptureSettings(CaptureKind.HIDDEN_STATES, LAYERS, CaptureDtype.FP8)


def _file(tmp_path: Path, name: str, ids: list[int], *, layers: tuple[int, ...] = LAYERS, wrong: bool = False) -> str:
    cfg = CaptureConfig(tmp_path / "caps", layers, HIDDEN, wrong_ids=1.0 if wrong else 0.0)
    return save(cfg, name, ids, digest=7)


def _keep(keeper: CaptureKeeper, row: str, path: str, expected: list[int]) -> FeatureRef:
    return asyncio.run(keeper.keep("r", CAPTURE, "m", row, path, expected))


def test_a_capture_that_fits_its_answer_is_a_row_and_its_file_goes(tmp_path: Path) -> None:
    spool = FeatureSpool(str(tmp_path / "spool"), "w")
    keeper = CaptureKeeper(spool.append)
    ids = [5, 6, 7, 8, 9]
    path = _file(tmp_path, "a", ids)
    ref = _keep(keeper, "k1", path, ids)
    assert ref == {"shard": "w-000001.gqfeat", "row": "k1", "tokens": 5, "layers": [2, 4], "dtype": "fp8"}
    assert not Path(path).exists(), "the engine's file is removed once kept"
    sealed = spool.seal("r")
    assert sealed is not None and [e.row for e in sealed.index.entries] == ["k1"]
    assert spool.manifest_of("r", sealed.index.capture) is not None, "the manifest waits on the spool with its shard"
    keeper.close()


@pytest.mark.parametrize("how", ["wrong id", "one token short", "other layers"])
def test_a_capture_that_does_not_fit_is_refused_never_stored(tmp_path: Path, how: str) -> None:
    spool = FeatureSpool(str(tmp_path / "spool"), "w")
    keeper = CaptureKeeper(spool.append)
    ids = [5, 6, 7, 8, 9]
    path = {"wrong id": lambda: _file(tmp_path, "b", ids, wrong=True),
            "one token short": lambda: _file(tmp_path, "b", ids[:-1]),
            "other layers": lambda: _file(tmp_path, "b", ids, layers=(1, 2, 4))}[how]()
    with pytest.raises(BadCaptureError) as e:
        _keep(keeper, "k1", path, ids)
    assert not Path(path).exists(), "a refused capture's file is removed too"
    assert spool.rows("r") == 0 and spool.seal("r") is None, "nothing was stored"
    assert error_class(e.value) is ErrorClass.BAD_CAPTURE
    said = {"wrong id": "token 4 is id 10, the answer's is 9", "one token short": "4 token ids, the answer has 5",
            "other layers": "hold 3 layers; the run captures 2 (2,4)"}[how]
    assert said in str(e.value)
    keeper.close()


def test_the_breaker_sees_one_storm_in_misaligned_captures() -> None:
    """Two misalignments at different places say the same thing to the breaker (no file path in
    the message), so an engine misaligning every capture trips it."""
    def rec(msg: str) -> dict:
        return {"key": "k", "error": {"class": "bad_capture", "type": "BadCaptureError", "message": msg}}

    from genqueue.consumer.capture.features import first_difference

    a = "the captured hidden states are not the answer's: " + first_difference([1, 2, 3], [1, 2, 4])
    b = "the captured hidden states are not the answer's: " + first_difference([1, 9, 3, 4], [1, 8, 3, 4])
    assert signature(rec(a)) == signature(rec(b)) is not None  # type: ignore[arg-type]


def _outbox(tmp_path: Path, events: list[str]) -> Outbox:
    async def output_of(run: str) -> str | None:
        return str(tmp_path / "out")

    async def shipped(run: str, seq: int | None, marks: ShardMarks) -> None:
        # a record is stored only once the features it names are
        names = {p.name for p in (tmp_path / "out" / run / "features").glob("*.index.json")}
        events.append(f"shipped {seq} with {len(names)} feature index(es) stored")

    async def lost(run: str, seq: int) -> None:
        events.append(f"lost {seq}")

    async def no_run(run: str) -> None:
        events.append("no_run")

    async def features(run: str, index: ShardIndex) -> None:
        events.append(f"features {len(index.entries)}")

    return Outbox(str(tmp_path / "spool"), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30,
                  store_for=LocalStore, output_of=output_of, on_shipped=shipped, on_lost=lost, on_no_run=no_run,
                  on_features=features)


async def _answer(ob: Outbox, tmp_path: Path, i: int) -> ResultRecord:
    keeper = CaptureKeeper(ob.features.append)
    ids = [i, i + 1, i + 2]
    rec = result(item(i))
    rec["features"] = await keeper.keep("r", CAPTURE, "m", rec["key"], _file(tmp_path, f"c{i}", ids), ids)
    keeper.close()
    return rec


def test_the_features_ship_before_the_records_that_name_them_and_the_spool_is_left_empty(tmp_path: Path) -> None:
    async def scenario() -> None:
        events: list[str] = []
        ob = _outbox(tmp_path, events)
        rec = await _answer(ob, tmp_path, 1)
        ob.append("r", rec)
        ob.seal_due({"r"})
        assert [type(s).__name__ for s in ob.queue] == ["SealedFeatureShard", "SealedShard"]
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert events == ["features 1", "shipped 1 with 1 feature index(es) stored"]
        reader = FeatureReader(LocalFeatureStore(tmp_path / "out"), "r")
        row = reader.row(rec["key"])
        x = standin_features([1, 2, 3], LAYERS, HIDDEN)
        assert row.token_ids.tolist() == [1, 2, 3] and row.encoded.scales is not None
        assert FP8_ERROR.allows(x, row.features(), row.encoded.scales)
        left = [p for p in (tmp_path / "spool").rglob("*") if p.is_file() and p.name != LOCK_NAME]
        assert left == [], "a shipped capture leaves nothing on the spool (its manifest goes too)"
        ob.close()

    asyncio.run(scenario())


def test_a_record_naming_a_feature_shard_the_spool_lost_is_lost_too(tmp_path: Path) -> None:
    """Its jobs are redone rather than acked with features that never reached the output."""
    async def scenario() -> None:
        events: list[str] = []
        ob = _outbox(tmp_path, events)
        ob.append("r", await _answer(ob, tmp_path, 1))
        ob.seal_due({"r"})
        ob.queue[0].path.unlink()  # the spool loses the feature shard
        ob.append("r", result(item(2)))  # no features: ships
        ob.seal_due({"r"})
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert events == ["lost 1", "shipped 2 with 0 feature index(es) stored"]
        ob.close()

    asyncio.run(scenario())


def test_a_drain_seals_feature_rows_no_record_names_yet(tmp_path: Path) -> None:
    """Rows whose records never came (a conversation cut by the stop) still leave the spool."""
    async def scenario() -> None:
        events: list[str] = []
        ob = _outbox(tmp_path, events)
        await _answer(ob, tmp_path, 1)
        ob.seal_due(set(), force=True)
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert events == ["features 1"]
        ob.close()

    asyncio.run(scenario())
