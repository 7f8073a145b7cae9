"""Faults with capture on, in both prompt modes: a consumer SIGKILLed mid-capture, a Redis loss,
an S3 outage (those three for each kind of row a run stores: hidden states, and --logprobs's
tables). Real redis-server, the stand-in over HTTP capturing as vLLM's connector does, real
consumer processes, a local output or SeaweedFS behind a TCP proxy the test cuts.

After each fault the run completes and its output holds, for every answer a finished record
keeps, a features reference that reads back from the run's feature shards with that answer's own
token ids (prompt and completion less the last); no row is named by two records, each row is its
own record's (its id is the record's key, and turn); and the items made twice are at most what
was in flight when the fault struck, counted as the fault tests without capture count it. A
--logprobs run's rows are held to the same, each read back with its answer's completion ids as
its sampled ids and the stand-in's tables."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.capture import CaptureDtype, CaptureKind, CaptureSettings
from genqueue.common.features import (
    FP8_ERROR,
    FeatureDtype,
    FeatureReader,
    ShardIndex,
    feature_store_for,
    read_row,
    scan,
    standin_features,
)
from genqueue.common.features.logprobs import LogprobsMode, LogprobsReader, read_table
from genqueue.common.features.names import SHARD_SUFFIX, index_name
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.keepers.rqaccess import SERIALIZER, queue_for
from genqueue.common.records import full_prompts
from genqueue.common.storage import LocalStore
from genqueue.consumer.capture.features import CaptureKeeper, manifest_for
from genqueue.consumer.shipping.features import FeatureSpool
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.sim.capture import CaptureConfig, save
from genqueue.consumer.sim.logprobs import standin_tables
from genqueue.producer.packitems import PackItems
from tests.conftest import (
    INLINE,
    Prompts,
    both_modes_reference_slow,
    cli,
    items_of_job,
    sharegpt,
    small_tmpfs,
    wait_for,
    write_jsonl,
)
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.doubles import item, result
from tests.netproxy import LatencyProxy, TcpProxy
from tests.s3server import S3Server, s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

LAYERS = (2, 4)
HIDDEN = 32
CAPTURE = ("--capture", "hidden-states", "--capture-layers", "2,4", "--token-ids")
PREFIX = "runs/capfaults"
CAPTURE_SETTINGS = CaptureSettings(CaptureKind.HIDDEN_STATES, LAYERS, CaptureDtype.FP8)
TABLES_K = 5
TABLES = ("--token-ids", "--logprobs", str(TABLES_K))


# --- the run, its engine and its consumers -------------------------------------------------
def enqueue(tmp_path: Path, redis_url: str, run: str, n: int, output: str, prompts: Prompts, *,
            env: dict[str, str] | None = None, capture: tuple[str, ...] = CAPTURE) -> dict[str, Any]:
    """N items (one to three user turns: regenerated turn by turn) of RUN, capturing (CAPTURE: the
    run's options, hidden states by default)."""
    data = tmp_path / f"{run}.jsonl"
    if not data.exists():
        write_jsonl(data, [sharegpt(i, turns=1 + i % 3) for i in range(n)])
    proc = cli("producer", "enqueue", str(data), "--run", run, "--output", output, "--batch-size", "8",
               "--max-tokens", "64", "--json", "--rejects", str(tmp_path / "rej.jsonl"), *capture, *prompts.args,
               env={"REDIS_URL": redis_url, **(env or {})})
    summary: dict[str, Any] = orjson.loads(proc.stdout)
    summary["stderr"] = proc.stderr
    return summary


def capturing_sim(tmp_path: Path, *args: str) -> Sim:
    return Sim(tmp_path, "--capture-dir", str(tmp_path / "caps"), "--capture-layers", "2,4", "--hidden-size",
               str(HIDDEN), "--slots", "32", "--step-time", "0.01", "--mean-tokens", "30", *args)


def tables_sim(tmp_path: Path, *args: str) -> Sim:
    """The stand-in as capturing_sim paces it, answering logprobs as vLLM does (its tables: the
    stand-in's, consumer/sim/logprobs.py)."""
    return Sim(tmp_path, "--slots", "32", "--step-time", "0.01", "--mean-tokens", "30", *args)


def consumer(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str, *extra: str, spool: str | Path | None = None,
             env: dict[str, str] | None = None) -> Proc:
    """A consumer of RUN on spool SPOOL (a path, or the name of one under TMP_PATH; NAME's own by
    default), logging to NAME.log."""
    where = spool if isinstance(spool, Path) else tmp_path / f"spool-{spool or name}"
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--shard-max-age", "0.5",
                             "--spool", str(where), "--pack-cache", str(tmp_path / "packs"), *extra],
                tmp_path / f"{name}.log", env={"REDIS_URL": redis_url, **(env or {})})


def snapshot_of(conn: redis.Redis, proc: Proc) -> dict[str, Any] | None:
    """PROC's live snapshot (by its pid), or None."""
    for k in conn.keys("genqueue:consumer:*"):
        raw = conn.get(k)
        s = orjson.loads(raw) if raw else {}
        if s.get("pid") == proc.p.pid and not s.get("exited"):
            return dict(s)
    return None


def busy(conn: redis.Redis, proc: Proc, timeout: float = 60, *, shards: int = 2, in_flight: int = 8) -> dict[str, Any]:
    """PROC's snapshot once it has shipped SHARDS shards and keeps IN_FLIGHT requests in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.p.poll() is None:
        s = snapshot_of(conn, proc)
        if s is not None and s["shipping"]["shards"] >= shards and s["in_flight"] >= in_flight:
            return s
        time.sleep(0.05)
    raise AssertionError("the consumer never got busy:\n" + proc.output()[-3000:])


def sent_not_shipped(snap: dict[str, Any], run: str) -> int:
    """What a consumer had sent to the engine and not shipped: its requests in flight and the
    records in its spool not shipped yet (tests/consumer/test_redo_in_flight.py's count)."""
    return int(snap["in_flight"]) + int(snap["runs"].get(run, {}).get("shipping", {}).get("unshipped_records", 0))


def s3_records(s3: S3Server, run: str) -> list[dict[str, Any]]:
    client = s3.client()
    recs: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=f"{PREFIX}/{run}/shards/"):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(".jsonl"):
                body = client.get_object(Bucket=s3.bucket, Key=obj["Key"])["Body"].read()
                recs += [orjson.loads(x) for x in body.splitlines() if x.strip()]
    return recs


# --- what must hold after any fault ---------------------------------------------------------
def answers(rec: dict[str, Any]) -> list[tuple[dict[str, Any], list[int], str]]:
    """Every answer a result record keeps, with the whole prompt ids it was generated on and the
    feature row id it must name (the record's key; in regenerate, key:turn and .step after tool
    results)."""
    if "turns" in rec:
        rows = [f"{rec['key']}:{t['turn']}" + (f".{t['step']}" if t.get("step") else "") for t in rec["turns"]]
        return list(zip(rec["turns"], full_prompts(rec["turns"]), rows, strict=True))  # type: ignore[arg-type]
    return [(rec, rec["token_ids"]["prompt"], rec["key"])]


@dataclass
class Capture:
    """What check_capture found: the answers kept, the rows stored in the output (a redone
    answer's rows twice) and the rows no record names (an answer made and never shipped as a
    record, or shipped by another attempt)."""

    answers: int
    distinct: int  # the answers of one result an item: the rows a trainer gets
    stored: int
    unnamed: set[tuple[str, str]]  # (shard, row)


#: Checks one answer's row: (store, run, its index entry, the answer, its whole prompt ids).
RowCheck = Callable[[Any, str, Any, dict[str, Any], list[int]], None]


def check_rows(recs: list[dict[str, Any]], output: str, run: str, field: str, check_row: RowCheck) -> Capture:
    """Every answer of a result record has a reference in FIELD; each names a row of a shard in the
    run's output, which CHECK_ROW reads back as that answer's; no row is named by two records, each
    row id is its own record's key (and turn), and a row no record names is a copy of one a record
    names (an answer made twice)."""
    store = feature_store_for(output)
    entries = {shard: {e.row: e for e in store.get_index(run, shard).entries} for shard in store.list_shards(run)}
    named: dict[tuple[str, str], str] = {}
    kept = 0
    per_item: dict[str, int] = {}
    for rec in recs:
        if "error" in rec:
            assert field not in rec, f"an error record names {field}: {rec}"
            continue
        per_item.setdefault(rec["key"], len(answers(rec)))
        for ans, prompt, row_id in answers(rec):
            kept += 1
            assert field in ans, f"an answer of {rec['key']} kept without its {field}: {ans}"
            ref = ans[field]
            assert ref["row"] == row_id, f"{rec['key']}'s answer names row {ref['row']!r}, not its own {row_id!r}"
            where = (ref["shard"], ref["row"])
            assert where not in named, f"row {where} named by two records ({named[where]} and {rec['key']})"
            named[where] = rec["key"]
            assert ref["shard"] in entries, f"{rec['key']} names feature shard {ref['shard']}, not in the output"
            assert ref["row"] in entries[ref["shard"]], f"{rec['key']} names row {ref['row']}, not in {ref['shard']}"
            check_row(store, run, entries[ref["shard"]][ref["row"]], ans, prompt)
    stored = sum(len(rows) for rows in entries.values())
    unnamed = {(shard, row) for shard, rows in entries.items() for row in rows if (shard, row) not in named}
    assert {row for _, row in unnamed} <= {row for _, row in named}, "a row stored for an answer no record keeps"
    return Capture(answers=kept, distinct=sum(per_item.values()), stored=stored, unnamed=unnamed)


def check_capture(recs: list[dict[str, Any]], output: str, run: str) -> Capture:
    """check_rows for hidden states: each answer's row (FeatureReader: one manifest, every shard of
    its capture) holds as token ids the answer's prompt ids and completion ids less the last, with
    the stand-in's features within fp8's bound."""
    manifest = FeatureReader(feature_store_for(output), run).manifest
    assert (manifest.layer_ids, manifest.dtype, manifest.hidden_size) == (LAYERS, FeatureDtype.FP8_E4M3, HIDDEN)

    def hidden_states(store: Any, run: str, entry: Any, ans: dict[str, Any], prompt: list[int]) -> None:
        ref = ans["features"]
        row = read_row(store.read_range(run, entry.shard), entry, capture=manifest.digest)
        expected = prompt + ans["token_ids"]["completion"][:-1]
        assert row.token_ids.tolist() == expected, f"row {ref['row']} of {ref['shard']} holds another answer's ids"
        assert (ref["tokens"], ref["layers"], ref["dtype"]) == (len(expected), list(LAYERS), "fp8")
        assert row.encoded.scales is not None
        assert FP8_ERROR.allows(standin_features(expected, LAYERS, HIDDEN), row.features(), row.encoded.scales)

    return check_rows(recs, output, run, "features", hidden_states)


def check_tables(recs: list[dict[str, Any]], output: str, run: str) -> Capture:
    """check_rows for --logprobs: each answer's row (its run's table manifest: K, raw
    log-probabilities) holds as sampled ids the answer's completion ids, K entries a token sorted
    descending, and the stand-in's top K and values within fp16."""
    manifest = LogprobsReader(feature_store_for(output), run).manifest
    assert (manifest.k, manifest.mode) == (TABLES_K, LogprobsMode.RAW_LOGPROBS), manifest

    def tables(store: Any, run: str, entry: Any, ans: dict[str, Any], prompt: list[int]) -> None:
        ref = ans["logprobs"]
        t = read_table(store.read_range(run, entry.shard), entry, capture=manifest.digest)
        ids = ans["token_ids"]["completion"]
        assert t.sampled_ids.tolist() == ids, f"row {ref['row']} of {ref['shard']} holds another answer's tables"
        assert (ref["tokens"], ref["k"], ref["dtype"]) == (len(ids), TABLES_K, "fp16")
        assert t.topk_ids.shape == (len(ids), TABLES_K)
        assert (np.diff(t.topk_logprobs, axis=1) <= 0).all()
        sampled, top_ids, top_lps = standin_tables(ids, TABLES_K)
        assert t.topk_ids.tolist() == top_ids
        assert np.allclose(t.topk_logprobs, top_lps, rtol=2.0**-11, atol=0)
        assert np.allclose(t.sampled_logprobs, sampled, rtol=2.0**-11, atol=0)

    return check_rows(recs, output, run, "logprobs", tables)


def made_twice(recs: list[dict[str, Any]], keys: set[str]) -> collections.Counter[str]:
    """Records beyond one an item, by item key (every item of KEYS has a record), of the items no
    end-of-run copy made: a copy (consumer/copies.py) of an item in flight elsewhere may ship beside
    it, fault or not (tests/consumer/test_rewind.py counts the same way)."""
    counts = collections.Counter(r["key"] for r in recs)
    assert keys <= set(counts), f"{len(keys - set(counts))} items without a record"
    copied = {r["key"] for r in recs if r.get("copy")}
    return collections.Counter({k: n - 1 for k, n in counts.items() if n > 1 and k not in copied})


def spooled(spool: Path) -> set[str]:
    """The item keys of the records in a spool (written, not shipped: shipped shards leave it)."""
    return {orjson.loads(line)["key"] for f in spool.rglob("*.jsonl*") if f.is_file()
            for line in f.read_bytes().splitlines() if line.strip() and line.startswith(b"{")}


def spooled_rows(spool: Path) -> set[str]:
    """The row ids of the feature rows in a spool (stored, not shipped: shipped shards leave it),
    read from the shards' bytes as the next consumer on the spool reads them."""
    return {e.row for f in spool.rglob("*" + SHARD_SUFFIX + "*") if f.is_file() and not f.name.endswith(".json")
            for e in scan(f).entries}


def row_item(row: str) -> str:
    """The item key of feature row ROW (key, or key:turn[.step])."""
    return row.split(":", 1)[0]


def capture_status(redis_url: str, run: str, section: str = "capture") -> dict[str, Any]:
    """SECTION of the run's `producer status --json` (its capture's, or its tables' "logprobs")."""
    st = orjson.loads(cli("producer", "status", "--run", run, "--json", env={"REDIS_URL": redis_url}).stdout)
    capture: dict[str, Any] = st[section]
    return capture


def output_counts(output: str, run: str) -> dict[str, int]:
    """What RUN's feature shards in the local OUTPUT hold: rows, tokens, the shards' files' bytes,
    and the bytes of their hidden-state rows (what a capture budget counts)."""
    store = feature_store_for(output)
    held = {"rows": 0, "tokens": 0, "bytes": 0, "captured": 0}
    for shard in store.list_shards(run):
        entries = store.get_index(run, shard).entries
        held["rows"] += len(entries)
        held["tokens"] += sum(e.tokens for e in entries)
        held["bytes"] += (Path(store.location(run)) / shard).stat().st_size
        held["captured"] += sum(e.length for e in entries if e.dtype is FeatureDtype.FP8_E4M3)
    return held


#: A budget the flush test's run never reaches (bytes).
FLUSH_BUDGET = 10**12


@dataclass(frozen=True)
class Kind:
    """A kind of row a run stores beside its records: its enqueue options, its engine, the field
    an answer names its row in, its check and its status section."""

    name: str
    options: tuple[str, ...]
    sim: Callable[..., Sim]
    field: str
    check: Callable[[list[dict[str, Any]], str, str], Capture]
    status: str

    def __str__(self) -> str:
        return self.name


HIDDEN_STATES = Kind("hidden-states", CAPTURE, capturing_sim, "features", check_capture, "capture")
LOGPROBS = Kind("logprobs", TABLES, tables_sim, "logprobs", check_tables, "logprobs")
# the tables' variants in the slow tier: the default suite keeps the hidden states' (the same spool, shipping
# and recovery paths; tests/consumer/test_logprobs_e2e.py runs a --logprobs run end to end there)
both_kinds = pytest.mark.parametrize("kind", [HIDDEN_STATES, pytest.param(LOGPROBS, marks=pytest.mark.slow)], ids=str)


# --- (a) a consumer killed mid-capture --------------------------------------------------------
@both_kinds
@both_modes_reference_slow  # 15-17 s each: inline in the default suite, by reference in the slow tier
def test_a_consumer_killed_mid_capture_costs_at_most_its_work_in_flight(tmp_path, redis_url, conn,
                                                                         prompts_mode: Prompts, kind: Kind) -> None:
    """A consumer is SIGKILLed while it captures (hidden states, or --logprobs's tables), with
    feature rows and records in its spool and requests in flight, while another serves the run:
    the other sweeps its jobs once their leases expire; a fresh consumer on the dead one's spool
    ships its feature shards and then its records. No record ships without its features or with
    another's, and what is made twice is at most what the dead one had sent and not shipped.

    planted (logprobs): a consumer that ships no leftover table shard of an earlier one leaves the
    dead one's shipped records naming rows not in the output"""
    run = "ckill"
    out = tmp_path / "out"
    enqueue(tmp_path, redis_url, run, 320, str(out), prompts_mode, capture=kind.options)
    sim = kind.sim(tmp_path)
    try:
        a = consumer(tmp_path, redis_url, sim, run, "a", "-c", "16", "--lease", "3", "--burst", "-vv")
        b = consumer(tmp_path, redis_url, sim, run, "b", "-c", "16", "--lease", "3", "--burst", "-vv")
        snap = busy(conn, a)
        a.signal(signal.SIGKILL)
        a.wait(10)
        in_flight = sent_not_shipped(snap, run)
        written = spooled(tmp_path / "spool-a")
        left = sorted(p.name for p in (tmp_path / "spool-a").rglob("*.gqfeat*"))
        rows_at_kill = spooled_rows(tmp_path / "spool-a")
        dead = str(snap["worker"])
        wait_for(lambda: (s := snapshot_of(conn, b)) is None or s["jobs"]["swept"] > 0, 30, "b to sweep a's jobs")
        fresh = consumer(tmp_path, redis_url, sim, run, "fresh", "--lease", "3", "--burst", "-vv", spool="a")
        assert fresh.wait(90) == 0, fresh.output()
        assert b.wait(90) == 0, b.output()
    finally:
        sim.stop()
    assert left, "the kill left no feature shard on the spool: it struck nothing mid-capture"
    assert "left in the spool by an earlier consumer" in fresh.output()
    recs = read_results(out, run)
    twice = made_twice(recs, run_keys(conn, run))
    beyond = sorted(set(twice) - written)
    found = kind.check(recs, str(out), run)
    capture = capture_status(redis_url, run, kind.status)
    leaked = sorted(p.name for p in (tmp_path / "caps").iterdir()) if kind is HIDDEN_STATES else []
    print(f"\nkilled mid-capture ({kind}, {prompts_mode}): sent and not shipped at the kill {in_flight} "
          f"({snap['in_flight']} requests, {len(written)} records in its spool, {len(left)} feature shard files); "
          f"items made twice {sum(twice.values())}, of items it had not made {len(beyond)}; answers {found.answers} ({found.distinct} of distinct items), "
          f"rows stored {found.stored} ({len(found.unnamed)} named by no record, {len(rows_at_kill)} rows in its spool "
          f"at the kill); status {capture}; "
          f"capture files left in the engine's folder {len(leaked)}")
    assert sum(twice.values()) <= in_flight, f"{sum(twice.values())} items made twice for {in_flight} in flight"
    assert not beyond, f"{len(beyond)} items made twice that the killed consumer had not made: {beyond[:5]}"
    # the rows stored twice are the dead one's work in flight: a row is durable before its record,
    # so an answer it had kept while its record was not yet shipped (in its spool, in memory, or a
    # conversation's earlier turn) is stored again by whoever makes the item again
    held = written | {row_item(row) for row in rows_at_kill} | {row_item(row) for shard, row in found.unnamed
                                                               if shard.startswith(dead + "-")}
    # ... and so is a copy's, sent at the end of the run, that lost to the item's own answer (or won)
    copied = set(re.findall(r"copy of item (\S+) sent", b.output() + fresh.output()))
    beyond_rows = sorted((shard, row) for shard, row in found.unnamed if row_item(row) not in held | copied)
    assert not beyond_rows, f"{len(beyond_rows)} rows stored twice of items the killed consumer held not: {beyond_rows[:5]}"
    # the distinct rows are exact; the rows written are counted as each feature shard ships, so a
    # kill between a shard's put and its count leaves that shard's rows out of them
    if kind is LOGPROBS:  # its status counts the rows written alone
        assert 0 < capture["rows"] <= found.stored, capture
        return
    assert capture["rows"] == found.distinct <= capture["rows_written"] <= found.stored, capture
    screen = " ".join(cli("producer", "status", "--run", run, env={"REDIS_URL": redis_url}).stdout.split())
    extra = capture["rows_written"] - found.distinct
    said = f" ({capture['rows_written']:,} written: {extra:,} redone or awaiting their results)" if extra else ""
    assert f"fp8; {found.distinct:,} rows{said}, " in screen, screen


# --- (b) a Redis loss ------------------------------------------------------------------------
@both_kinds
@both_modes_reference_slow  # 19-20 s each: inline in the default suite, by reference in the slow tier
def test_redis_flushed_mid_capture_comes_back_from_the_output(tmp_path, redis_url, conn,
                                                             prompts_mode: Prompts, kind: Kind) -> None:
    """Redis loses everything mid-run (FLUSHALL): the consumer keeps its records and feature rows
    (hidden states, or --logprobs's tables) in its spool while the run is gone, is stopped,
    `producer enqueue` (the same command) brings the run back from its output, and a consumer on
    the same spool ships what the first had kept, feature shards first, and finishes the run. Made
    twice: at most what was not shipped.

    planted (logprobs): a consumer that ships no leftover feature shard of an earlier one (the
    leftovers of a table capture passed over) leaves records naming rows not in the output"""
    run = "cflush"
    out = tmp_path / "out"
    # hidden states under a budget never reached: the budget's count is kept row by row on the spools
    options = kind.options + (("--capture-budget", str(FLUSH_BUDGET)) if kind is HIDDEN_STATES else ())
    first = enqueue(tmp_path, redis_url, run, 240, str(out), prompts_mode, capture=options)
    sim = kind.sim(tmp_path)
    try:
        c1 = consumer(tmp_path, redis_url, sim, run, "c1", "-c", "16", "--lease", "5", spool="one")
        wait_for(lambda: ItemTable(conn, run).counts().done >= 60, 60, "60 items shipped")
        conn.flushall()  # Redis lost everything: the run, its queue and jobs, the marks, the counters
        wait_for(lambda: "gone from Redis" in c1.output(), 60, "the consumer to notice")
        c1.signal(signal.SIGTERM)
        assert c1.wait(60) == 0, c1.output()
        left = sum(len(p.read_bytes().splitlines()) for p in (tmp_path / "spool-one").rglob("*.jsonl*"))
        features_left = list((tmp_path / "spool-one").rglob("*.gqfeat*"))
        s = enqueue(tmp_path, redis_url, run, 240, str(out), prompts_mode, capture=options)
        assert "was not in Redis: re-created from" in s["stderr"] and s["recreated_run"], s["stderr"]
        assert s["fingerprint"] == first["fingerprint"], (s["fingerprint"], first["fingerprint"])
        c2 = consumer(tmp_path, redis_url, sim, run, "c2", "-c", "16", "--lease", "5", "--burst", spool="one")
        assert c2.wait(90) == 0, c2.output()
    finally:
        sim.stop()
    assert features_left, "the consumer kept no feature rows in its spool while the run was gone"
    assert "left in the spool by an earlier consumer" in c2.output()
    recs = read_results(out, run)
    twice = made_twice(recs, run_keys(conn, run))
    found = kind.check(recs, str(out), run)
    capture = capture_status(redis_url, run, kind.status)
    print(f"\nFLUSHALL mid-capture ({kind}, {prompts_mode}): {s['already_done']} items done before it, {s['enqueued']} "
          f"queued again, {left} records left in the spool; items made twice {sum(twice.values())}; answers "
          f"{found.answers} ({found.distinct} of distinct items), rows stored {found.stored} ({len(found.unnamed)} named by no record); "
          f"status {capture}")
    assert sum(twice.values()) <= left + 16, "made twice beyond what was not shipped when Redis was lost"
    # rows named by no record are those of items in flight when Redis was lost (a row a turn: count items)
    assert len({row_item(row) for _, row in found.unnamed}) <= left + 16, found.unnamed
    # every counter Redis lost is rebuilt from the output's feature shards when the run comes back,
    # and the spool's leftovers, shipped after, are counted once: status is the output's
    held = output_counts(str(out), run)
    if kind is HIDDEN_STATES:
        assert capture["rows"] == found.distinct, capture
        assert (capture["rows_written"], capture["bytes"]) == (found.stored, held["bytes"]), (capture, held)
        # the budget's count too: rows counted on the spool before the loss, lost with it, come back
        assert capture["spent"] == held["captured"], (capture, held)
        assert capture["budget"] == FLUSH_BUDGET and not capture["budget_spent"], capture
    else:
        assert (capture["rows"], capture["rows_distinct"], capture["tokens"], capture["bytes"]) == \
            (found.stored, found.distinct, held["tokens"], held["bytes"]), (capture, held)


# --- (c) an S3 outage ------------------------------------------------------------------------
def acked_have_features(conn: redis.Redis, s3: S3Server, run: str, output: str, field: str = "features") -> int:
    """Every item of every job rq calls finished has a record in S3, and every feature row those
    records name (in FIELD: hidden states, or "logprobs" tables) is in S3 (its shard's index lists
    it). The finished set is read first, and the feature shards stored right after it: a job in it
    was acked before either listing, so its rows were stored before the feature listing too (read
    late, after the records, it would let a shard stored just after its jobs were acked pass).
    Returns the jobs checked."""
    finished = queue_for(run, conn).finished_job_registry.get_job_ids()
    store = feature_store_for(output)
    stored = set(store.list_shards(run))
    recs = s3_records(s3, run)
    by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in recs:
        by_key[r["key"]].append(r)
    packs = PackItems(conn, run, output)
    keys = {it["key"] for jid in finished
            for it in items_of_job(conn, run, output, Job.fetch(jid, connection=conn, serializer=SERIALIZER), packs)}
    missing = keys - set(by_key)
    assert not missing, f"{len(missing)} items of acked jobs are not in S3"
    indexes: dict[str, set[str]] = {}
    for key in keys:
        for rec in by_key[key]:
            for ans, _, _ in ([] if "error" in rec else answers(rec)):
                assert field in ans, f"an acked answer of {key} without its {field}"
                shard = ans[field]["shard"]
                assert shard in stored, f"{key} was acked before its feature shard {shard} was stored"
                if shard not in indexes:
                    indexes[shard] = {e.row for e in store.get_index(run, shard).entries}
                assert ans[field]["row"] in indexes[shard]
    return len(finished)


@both_kinds
@both_modes_reference_slow  # 20 s each: inline in the default suite, by reference in the slow tier
def test_s3_cut_mid_capture_ships_features_before_results_once_back(tmp_path, redis_url, conn, s3_server: S3Server,  # noqa: F811
                                                                    s3_env, prompts_mode: Prompts, kind: Kind) -> None:  # noqa: F811
    """The network to S3 is cut mid-run (a proxy that passes nothing), then restored: while it is
    out no job is acked and feature shards (hidden states, or --logprobs's tables) wait on the
    spool with the records; once it is back they ship, every acked job's records and the feature
    rows they name are in S3, and nothing is made twice beyond what was in flight.

    planted (logprobs): an outbox that queues a run's result shard before its feature shard acks
    jobs whose table rows are not in S3 yet"""
    run = "cs3"
    output = s3_server.url(PREFIX)
    enqueue(tmp_path, redis_url, run, 240, output, prompts_mode, env=s3_server.env, capture=kind.options)
    # every reply from S3 late by a round trip to a store far away, so a result shard stored before
    # the feature shard its records name would leave its jobs acked without their features long
    # enough for the checks below to see it
    slow = LatencyProxy(s3_server.ports["s3.port"], 0.05)
    proxy = TcpProxy(slow.port)
    env = {**s3_server.env, "AWS_ENDPOINT_URL": f"http://{proxy.url_host_port}", "GENQUEUE_S3_ABORT_AFTER": "0"}
    sim = kind.sim(tmp_path)
    q = queue_for(run, conn)
    try:
        c = consumer(tmp_path, redis_url, sim, run, "c", "-c", "16", "--lease", "5", "--burst", "--shard-max-age", "1.5",
                     env=env)
        snap = busy(conn, c, shards=2)
        assert acked_have_features(conn, s3_server, run, output, kind.field) >= 1
        proxy.blackhole()
        in_flight = sent_not_shipped(snap, run)
        time.sleep(1.0)  # a put that finished just before the cut may still be acked now
        acked_at_cut = conn.zcard(q.finished_job_registry.key)
        sealed = tmp_path / "spool-c" / run
        waiting_features = waiting_results = False
        until = time.monotonic() + 6  # past a lease: the consumer keeps its leases meanwhile
        while time.monotonic() < until:
            assert conn.zcard(q.finished_job_registry.key) == acked_at_cut, "a job was acked while S3 was cut off"
            waiting_features |= any((sealed / "features" / "sealed").glob("*.gqfeat"))
            waiting_results |= any((sealed / "sealed").glob("*.jsonl"))
            assert c.p.poll() is None, "the consumer gave up while S3 was cut off"
            time.sleep(0.2)
        assert waiting_features and waiting_results, "nothing sealed waited while S3 was cut off: the cut proved nothing"
        proxy.forward(cut=True)
        while c.p.poll() is None:
            acked_have_features(conn, s3_server, run, output, kind.field)
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
        proxy.close()
        slow.close()
    assert acked_have_features(conn, s3_server, run, output, kind.field) == q.finished_job_registry.count
    assert q.failed_job_registry.count == 0
    recs = s3_records(s3_server, run)
    twice = made_twice(recs, run_keys(conn, run))
    found = kind.check(recs, output, run)
    capture = capture_status(redis_url, run, kind.status)
    print(f"\nS3 cut mid-capture ({kind}, {prompts_mode}): {acked_at_cut} jobs acked at the cut, {in_flight} sent and not "
          f"shipped; items made twice {sum(twice.values())}; answers {found.answers}, rows stored {found.stored} "
          f"({len(found.unnamed)} named by no record); status {capture}")
    assert sum(twice.values()) <= in_flight
    assert len({row_item(row) for _, row in found.unnamed}) <= in_flight, found.unnamed  # items: a row a turn
    if kind is HIDDEN_STATES:
        assert (capture["rows"], capture["rows_written"]) == (found.distinct, found.stored), capture
    else:  # every row shipped counted once, a redone answer's too
        assert capture["rows"] == found.stored, capture


# --- a spool disk that fills up mid-capture ------------------------------------------------------
@pytest.mark.slow  # 22 s, and root only: the in-process tests below hold the same rules in the default suite
def test_a_full_spool_disk_pauses_a_capture_and_loses_no_row(tmp_path, redis_url, conn) -> None:
    """The spool's disk fills up while answers are captured (a real size-limited filesystem: a
    tmpfs the test mounts, which needs root): a feature row the disk refuses is a pause, as a
    result's is: admission pauses, the answer waits with its capture and its lease, and once space
    comes back the run completes, every answer with its features and no item an error.

    old: the row's OSError ended its item as an `internal` error record (its capture file
         removed), and admission went on"""
    run = "cfull"
    out = tmp_path / "out"
    enqueue(tmp_path, redis_url, run, 120, str(out), INLINE)
    with small_tmpfs(tmp_path / "spoolfs", "1m") as fs:
        filler = fs / "filler"
        with open(filler, "wb") as fh:  # leave about 64 KiB: a few rows and shards, then the disk is full
            st = os.statvfs(fs)
            fh.write(b"\0" * (st.f_bavail * st.f_frsize - 64 * 1024))
        sim = capturing_sim(tmp_path)
        try:
            c = consumer(tmp_path, redis_url, sim, run, "c", "-c", "16", "--lease", "3", "--burst", spool=fs / "spool")
            paused = None
            deadline = time.monotonic() + 60
            while paused is None and time.monotonic() < deadline and c.p.poll() is None:
                s = snapshot_of(conn, c)
                paused = (s or {}).get("paused", {}).get("spool_disk")
                time.sleep(0.1)
            assert paused is not None, "the consumer never reported the full disk:\n" + c.output()[-3000:]
            time.sleep(1.5 * 3)  # past a lease: the paused consumer keeps its leases and its answers wait
            assert c.p.poll() is None and conn.zcard(f"rq:failed:genqueue.{run}") == 0
            waiting = len(list((tmp_path / "caps").iterdir()))
            filler.unlink()  # space comes back: the consumer resumes by itself
            assert c.wait(90) == 0, c.output()
        finally:
            sim.stop()
    log = c.output()
    recs = read_results(out, run)
    errors = [r["error"] for r in recs if "error" in r]
    print(f"\nfull spool disk mid-capture: paused ({paused}); {waiting} capture files waiting in the pause; "
          f"{len(errors)} error records")
    assert "spool disk full" in paused
    assert not errors, f"items ended in errors while the disk was full: {errors[:3]}"
    assert "unexpected" not in log, log
    assert made_twice(recs, run_keys(conn, run)) == collections.Counter()
    found = check_capture(recs, str(out), run)
    assert found.distinct == found.answers == found.stored
    assert list((tmp_path / "caps").iterdir()) == [], "every capture file is removed once kept"


# --- the same, in-process: a row the disk refuses waits, a seal the disk refuses keeps its rows ------
def _capture_file(tmp_path: Path, name: str, ids: list[int]) -> str:
    return save(CaptureConfig(tmp_path / "caps", LAYERS, HIDDEN), name, ids, digest=7)


def test_a_row_the_spool_disk_refuses_waits_with_its_capture_until_the_disk_takes_it(tmp_path: Path) -> None:
    """The spool's disk refuses a row (here its run's folder is a file, as a disk refuses any
    write): FeatureSpool says so (disk_error, which pauses the outbox's admission), the answer
    waits with its capture file, and once the disk takes rows again it is stored and its file goes.

    old: the OSError left `keep` (the item's record an `internal` error) and the file was removed"""
    spool_dir = tmp_path / "spool"

    async def nothing_ships_here(*args: object) -> None:
        raise AssertionError(args)

    outbox = Outbox(str(spool_dir), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30, store_for=LocalStore,
                    output_of=nothing_ships_here, on_shipped=nothing_ships_here, on_lost=nothing_ships_here,
                    on_no_run=nothing_ships_here)
    spool = outbox.features
    keeper = CaptureKeeper(spool.append)
    ids = [5, 6, 7, 8, 9]
    path = _capture_file(tmp_path, "a", ids)
    (spool_dir / "r").mkdir(parents=True)
    (spool_dir / "r" / "features").write_bytes(b"")  # the run's feature folder cannot be made

    async def go() -> tuple[object, str | None, bool, bool]:
        task = asyncio.create_task(keeper.keep("r", CAPTURE_SETTINGS, "m", "k1", path, ids))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if spool.disk_error is not None:
                break
        refused, paused, kept = spool.disk_error, outbox.full(), Path(path).exists()
        (spool_dir / "r" / "features").unlink()  # the disk takes writes again
        ref = await asyncio.wait_for(task, 10)
        return ref, refused, paused, kept

    ref, refused, paused, kept = asyncio.run(go())
    keeper.close()
    assert refused is not None and "spool disk error" in refused, refused
    assert paused and kept, "admission pauses while the disk refuses rows, and the capture waits"
    assert ref == {"shard": "w-000001.gqfeat", "row": "k1", "tokens": 5, "layers": [2, 4], "dtype": "fp8"}
    assert spool.disk_error is None and outbox.disk_error is None and not outbox.full()
    assert not Path(path).exists(), "the engine's file is removed once kept"


def test_a_feature_shard_seal_the_disk_refuses_keeps_its_rows_and_is_done_again(tmp_path: Path) -> None:
    """Sealing moves the shard and then writes its index; when the disk refuses the index (here a
    folder where its file goes), the seal raises and is called again: the shard keeps its rows and
    any appended meanwhile, and the second seal puts them all in its index.

    old: the first seal forgot the shard's rows before writing the index: the shard sat in sealed/
         without an index, never shipped, while the records naming its rows shipped and were acked"""
    spool = FeatureSpool(str(tmp_path / "spool"), "w")
    manifest = manifest_for(CAPTURE_SETTINGS, "m", HIDDEN)
    hidden = standin_features([1, 2, 3], LAYERS, HIDDEN)
    spool.append("r", manifest, "k1", [1, 2, 3], hidden)
    sealed_dir = tmp_path / "spool" / "r" / "features" / "sealed"
    planted = sealed_dir / f".{index_name('w-000001.gqfeat')}.tmp"
    planted.mkdir(parents=True)
    with pytest.raises(OSError):
        spool.seal("r")
    spool.append("r", manifest, "k2", [1, 2, 3], hidden)
    planted.rmdir()
    shard = spool.seal("r")
    assert shard is not None and [e.row for e in shard.index.entries] == ["k1", "k2"]
    assert shard.path == sealed_dir / "w-000001.gqfeat" and shard.index_path.exists()
    assert [e.row for e in scan(shard.path).entries] == ["k1", "k2"]
    assert spool.seal("r") is None


def test_a_flush_returns_once_what_shipped_is_counted_and_marked(tmp_path: Path) -> None:
    """A consumer's last flush (at its exit) waits for the shipper to finish with the last shard it
    took: a feature shard's rows counted, a result shard's items marked and its jobs acked.

    old: flush returned once the queue was empty, with that work still pending: a consumer whose
         last shard was a feature shard (the rows of answers its stop cut, or a dead consumer's
         leftover) exited without counting its rows, and one whose last was a result shard could
         exit before marking its items done"""
    events: list[str] = []

    async def slowly(what: str) -> None:
        await asyncio.sleep(0.3)  # a Redis round trip on a loaded host
        events.append(what)

    async def output_of(run: str) -> str:
        return str(tmp_path / "out")

    async def shipped(run: str, seq: int | None, marks: ShardMarks) -> None:
        await slowly(f"marked {seq}")

    async def features(run: str, index: ShardIndex) -> None:
        await slowly(f"counted {len(index.entries)}")

    async def never(*args: object) -> None:
        raise AssertionError(args)

    async def scenario() -> None:
        ob = Outbox(str(tmp_path / "spool"), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30,
                    store_for=LocalStore, output_of=output_of, on_shipped=shipped, on_lost=never, on_no_run=never,
                    on_features=features)
        keeper = CaptureKeeper(ob.features.append)
        ids = [1, 2, 3]
        rec = result(item(1))
        rec["features"] = await keeper.keep("r", CAPTURE_SETTINGS, "m", rec["key"], _capture_file(tmp_path, "c1", ids), ids)
        task = asyncio.create_task(ob.shipper())
        ob.seal_due(set(), force=True)  # rows no record names yet: a feature shard alone
        assert await ob.flush(10)
        assert events == ["counted 1"]
        await keeper.keep("r", CAPTURE_SETTINGS, "m", "k2", _capture_file(tmp_path, "c2", ids), ids)
        ob.append("r", rec)
        ob.seal_due(set(), force=True)
        assert await ob.flush(10)
        assert events == ["counted 1", "counted 1", "marked 1"]
        task.cancel()
        keeper.close()
        ob.close()

    asyncio.run(scenario())
