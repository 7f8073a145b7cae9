"""Capture during generation, end to end (real redis-server, the stand-in over HTTP capturing as
vLLM's connector does, real consumer processes, a local output and SeaweedFS): every answer kept
has its features, each reads back with the record's own token ids and the stand-in's features
within fp8's bound, a consumer SIGKILLed mid-run leaves no record without its features and no
row shared or misattached, and a misaligned capture is an error record, never a row."""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

import orjson
import pytest

from genqueue.common.features import (
    FP8_ERROR,
    FeatureDtype,
    FeatureReader,
    feature_store_for,
    read_row,
    standin_features,
)
from genqueue.common.features.store import FeatureStore
from genqueue.common.records import full_prompts
from genqueue.consumer.capture import probe as capture_probe
from genqueue.consumer.capture.captured import read_capture
from genqueue.consumer.sim.capture import CaptureConfig, save
from genqueue.consumer.sim.text import request_digest
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.s3server import S3Server, s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

LAYERS = (2, 4)
HIDDEN = 32
CAPTURE = ("--capture", "hidden-states", "--capture-layers", "2,4", "--token-ids")


def _enqueue(tmp_path: Path, redis_url: str, run: str, n: int, output: str, env: dict[str, str] | None = None,
             max_tokens: int = 64) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", output, "--batch-size", "8", "--max-tokens",
        str(max_tokens), "--rejects", str(tmp_path / "rej.jsonl"), *CAPTURE, env={"REDIS_URL": redis_url, **(env or {})})


def _sim(tmp_path: Path, *args: str) -> Sim:
    return Sim(tmp_path, "--capture-dir", str(tmp_path / "caps"), "--capture-layers", "2,4", "--hidden-size",
               str(HIDDEN), *args)


def _consumer(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str, *extra: str,
              env: dict[str, str] | None = None) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5",
                             "--spool", str(tmp_path / "spool"), *extra], tmp_path / f"{name}.log",
                env={"REDIS_URL": redis_url, **(env or {})})


def answers(rec: dict) -> list[tuple[dict, list[int]]]:
    """Every answer a result record keeps (a regenerated turn, or the record itself), with the
    whole prompt ids it was generated on."""
    if "turns" in rec:
        return list(zip(rec["turns"], full_prompts(rec["turns"]), strict=True))  # type: ignore[arg-type]
    return [(rec, rec["token_ids"]["prompt"])]


def check_features(recs: list[dict], store: FeatureStore, run: str, seed: int = 0) -> int:
    """Each answer kept has a features reference; each reads back with its answer's ids (prompt and
    completion but the last) and the stand-in's features within fp8's bound; no row is named twice,
    and each row is its own record's (its id starts with the record's key). The rows checked."""
    manifest = FeatureReader(store, run).manifest
    assert (manifest.layer_ids, manifest.dtype, manifest.hidden_size) == (LAYERS, FeatureDtype.FP8_E4M3, HIDDEN)
    indexes: dict[str, dict] = {}
    named: set[tuple[str, str]] = set()
    for rec in recs:
        if "error" in rec:
            continue
        for ans, prompt in answers(rec):
            assert "features" in ans, f"an answer of {rec['key']} without its features: {ans}"
            ref = ans["features"]
            assert (ref["shard"], ref["row"]) not in named, f"row {ref} named by two records"
            named.add((ref["shard"], ref["row"]))
            assert ref["row"] == rec["key"] or ref["row"].startswith(rec["key"] + ":"), (ref, rec["key"])
            if ref["shard"] not in indexes:
                indexes[ref["shard"]] = {e.row: e for e in store.get_index(run, ref["shard"]).entries}
            row = read_row(store.read_range(run, ref["shard"]), indexes[ref["shard"]][ref["row"]],
                           capture=manifest.digest)
            expected = prompt + ans["token_ids"]["completion"][:-1]
            assert row.token_ids.tolist() == expected, f"row {ref['row']} holds another answer's ids"
            assert (ref["tokens"], ref["layers"], ref["dtype"]) == (len(expected), list(LAYERS), "fp8")
            assert row.encoded.scales is not None
            assert FP8_ERROR.allows(standin_features(expected, LAYERS, HIDDEN, seed), row.features(), row.encoded.scales)
    return len(named)


def _s3_records(s3: S3Server, prefix: str, run: str) -> list[dict]:
    client = s3.client()
    recs: list[dict] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=f"{prefix}/{run}/shards/"):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(".jsonl"):
                body = client.get_object(Bucket=s3.bucket, Key=obj["Key"])["Body"].read()
                recs += [orjson.loads(x) for x in body.splitlines() if x.strip()]
    return recs


def test_a_capture_run_to_a_local_output_keeps_every_answers_features(tmp_path, redis_url, conn):
    out = tmp_path / "out"
    _enqueue(tmp_path, redis_url, "cap", 30, str(out))
    sim = _sim(tmp_path, "--mean-tokens", "20")
    try:
        c = _consumer(tmp_path, redis_url, sim, "cap", "c")
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(out, "cap")
    assert {r["key"] for r in recs} == run_keys(conn, "cap") and not [r for r in recs if "error" in r]
    assert any(len(r.get("turns", [])) > 1 for r in recs), "some conversations are multi-turn"
    rows = check_features(recs, feature_store_for(str(out)), "cap")
    assert rows == sum(len(answers(r)) for r in recs) >= 50
    assert list((tmp_path / "caps").iterdir()) == [], "every capture file is removed once kept"
    status = cli("producer", "status", "--run", "cap", env={"REDIS_URL": redis_url}).stdout
    assert f"capture     on: hidden-states, layers 2,4, fp8; {rows} rows" in status, status


def test_a_capture_run_to_s3_keeps_every_answers_features(tmp_path, redis_url, conn, s3_server, s3_env):
    prefix = "runs/capture"
    _enqueue(tmp_path, redis_url, "caps3", 30, s3_server.url(prefix), env=s3_server.env)
    sim = _sim(tmp_path, "--mean-tokens", "20")
    try:
        c = _consumer(tmp_path, redis_url, sim, "caps3", "c", env={**s3_server.env, "GENQUEUE_S3_ABORT_AFTER": "0"})
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    recs = _s3_records(s3_server, prefix, "caps3")
    assert {r["key"] for r in recs} == run_keys(conn, "caps3") and not [r for r in recs if "error" in r]
    assert check_features(recs, feature_store_for(s3_server.url(prefix)), "caps3") == \
        sum(len(answers(r)) for r in recs)


def test_a_consumer_killed_mid_capture_leaves_no_record_without_its_features(tmp_path, redis_url, conn):
    out = tmp_path / "out"
    _enqueue(tmp_path, redis_url, "kill", 160, str(out))
    sim = _sim(tmp_path, "--mean-tokens", "30", "--step-time", "0.01", "--slots", "32")
    try:
        first = _consumer(tmp_path, redis_url, sim, "kill", "first", "-c", "16", "--lease", "3")
        deadline = time.monotonic() + 30
        busy = False
        while time.monotonic() < deadline and not busy:  # kill it once something shipped, with work in flight
            snaps = [orjson.loads(conn.get(k)) for k in conn.keys("genqueue:consumer:*")]
            busy = any(not s.get("exited") and s["shipping"]["shards"] >= 2 and s["in_flight"] >= 8 for s in snaps)
            time.sleep(0.05)
        assert busy, "the consumer never got busy:\n" + first.output()
        first.signal(signal.SIGKILL)
        first.wait(10)
        left = [p.name for p in (tmp_path / "spool").rglob("*.gqfeat*")]
        second = _consumer(tmp_path, redis_url, sim, "kill", "second", "--lease", "3")
        assert second.wait(60) == 0, second.output()
    finally:
        sim.stop()
    assert left, "the kill left feature shards on the spool"
    assert "left in the spool by an earlier consumer" in second.output()
    recs = read_results(out, "kill")
    assert run_keys(conn, "kill") <= {r["key"] for r in recs} and not [r for r in recs if "error" in r]
    by_worker = collections.Counter(r["consumer"]["worker"] for r in recs)
    assert len(by_worker) == 2, f"both consumers' records shipped: {by_worker}"
    check_features(recs, feature_store_for(str(out)), "kill")


def _seed_whose_probe_is_aligned(tmp_path: Path, share: float) -> int:
    """A stand-in seed whose capture of the pre-flight's probe is right: the pre-flight refuses an
    engine that misaligns its probe, and this test is about the answers'."""
    for seed in range(100):
        digest = request_digest(seed, capture_probe.MESSAGES, None)
        path = save(CaptureConfig(tmp_path / "draws", LAYERS, 8, seed, share), str(seed), [1, 2, 3], digest)
        if read_capture(path).token_ids.tolist() == [1, 2, 3]:
            return seed
    raise AssertionError("no seed in 100 draws an aligned probe")


def test_a_capture_whose_ids_are_not_the_answers_is_an_error_record_never_a_row(tmp_path, redis_url, conn):
    out = tmp_path / "out"
    _enqueue(tmp_path, redis_url, "bad", 30, str(out))
    seed = _seed_whose_probe_is_aligned(tmp_path, 0.3)
    sim = _sim(tmp_path, "--mean-tokens", "20", "--capture-wrong-ids", "0.3", "--seed", str(seed))
    try:
        c = _consumer(tmp_path, redis_url, sim, "bad", "c")
        c.wait(60)
    finally:
        sim.stop()
    recs = read_results(out, "bad")
    assert {r["key"] for r in recs} == run_keys(conn, "bad")
    errors = [r["error"] for r in recs if "error" in r]
    stopped = [r["stopped"]["error"] for r in recs if "error" in r.get("stopped", {})]
    assert errors and {e["class"] for e in errors + stopped} == {"bad_capture"}, (errors, stopped)
    assert all("features" not in r for r in recs if "error" in r)
    assert "the captured hidden states are not the answer's: token" in errors[0]["message"]
    check_features(recs, feature_store_for(str(out)), "bad", seed)  # what was kept is right
    assert list((tmp_path / "caps").iterdir()) == [], "a refused capture's file is removed too"
    print(f"{len(errors)} error records and {len(stopped)} conversations stopped by a misaligned capture")


@pytest.mark.parametrize(("args", "said"), [
    (("--capture", "hidden-states", "--capture-layers", "2,4"), "--capture needs --token-ids"),
    (("--capture-layers", "2,4", "--token-ids"), "--capture-layers needs --capture hidden-states"),
    (("--capture", "hidden-states", "--token-ids"), "--capture hidden-states needs --capture-layers"),
    (("--capture", "hidden-states", "--capture-layers", "2,x", "--token-ids"), "'x' in '2,x' is not a layer id"),
    (("--capture", "hidden-states", "--capture-layers", "-1,2", "--token-ids"), "layer id -1 is negative"),
    (("--capture", "hidden-states", "--capture-layers", "2", "--token-ids", "--drafter", "d1"),
     "--capture cannot go with --drafter"),
])
def test_a_capture_the_engine_cannot_make_is_refused_in_one_line(tmp_path, redis_url, args, said):
    data = write_jsonl(tmp_path / "x.jsonl", [sharegpt(0)])
    p = cli("producer", "enqueue", str(data), "--run", "x", "--output", str(tmp_path / "out"), *args,
            env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
