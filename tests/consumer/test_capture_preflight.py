"""The pre-flight knows capture (consumer/served.py, consumer/capture/probe.py): a --capture run is
served only once one probe request that asks for hidden states comes back naming a file the
consumer reads, of the run's layer count, over the probe's own ids; otherwise the run is refused in
one line naming the vLLM flags to start with, before any item is taken, and the log, `producer
status` and the metrics say so. The probe's file goes either way, and a capture no request asked
for (an engine that captures every request, as vLLM's stock connector does) is removed by the
consumer at once.

Real redis-server, the stand-in over HTTP capturing as vLLM's connector does, real consumer
processes; the unasked capture in-process against the stand-in made to capture every request.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from genqueue.common.contracts import ExitCode
from genqueue.common.settings import RunSettings, Sampling
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.generate import Gate, Generator, RunContext
from genqueue.consumer.capture.features import CaptureKeeper
from genqueue.consumer.sim import capture as sim_capture
from genqueue.consumer.sim.server import SimConfig, SimServer
from tests.conftest import cli, free_port, http_text, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

pytestmark = pytest.mark.integration

CAPTURE = ("--capture", "hidden-states", "--capture-layers", "2,4", "--token-ids")
FLAGS = '"eagle_aux_hidden_state_layer_ids":[2,4]'


def _enqueue(tmp_path: Path, redis_url: str, run: str, n: int, *extra: str) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--max-tokens", "32", "--rejects", str(tmp_path / "rej.jsonl"), *extra, env={"REDIS_URL": redis_url})


def _consumer(tmp_path: Path, redis_url: str, sim: Sim, run: str, *extra: str) -> Proc:
    return Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--spool", str(tmp_path / "spool"),
                             "--shard-max-age", "0.5", *extra], tmp_path / f"consumer-{run}.log",
                env={"REDIS_URL": redis_url})


def _sent(record: Path) -> list[dict]:
    return [orjson.loads(line) for line in record.read_bytes().splitlines()] if record.exists() else []


def _item_requests(sent: list[dict]) -> list[dict]:
    """The requests that carried an item (the items' prompts say 'question N')."""
    return [b for b in sent if any("question" in str(m.get("content")) for m in b["messages"])]


def _burst(tmp_path: Path, redis_url: str, run: str, *sim_args: str) -> tuple[int, str]:
    """A --burst consumer of RUN against the stand-in started with SIM_ARGS: its exit code and log."""
    sim = Sim(tmp_path, "--mean-tokens", "10", *sim_args)
    try:
        c = _consumer(tmp_path, redis_url, sim, run, "--burst")
        return c.wait(60), c.output()
    finally:
        sim.stop()


def _refusal(log: str) -> str:
    lines = [line for line in log.splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1, log
    return lines[0]


def test_a_capture_run_on_an_engine_that_does_not_capture_is_refused_before_any_item(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "nocap", 12, *CAPTURE)
    jobs = conn.llen("rq:queue:genqueue.nocap")
    record = tmp_path / "sent.jsonl"
    sim = Sim(tmp_path, "--mean-tokens", "10", "--record-requests", str(record))  # no --capture-dir
    port = free_port()
    c = _consumer(tmp_path, redis_url, sim, "nocap", "--metrics-port", str(port))
    try:
        deadline = time.monotonic() + 60
        while "pre-flight failed" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = _refusal(c.output())
        assert "named no capture file in the probe's answer" in line, line
        assert "start vLLM with --speculative-config" in line and FLAGS in line and "--kv-transfer-config" in line
        assert "GenqueueHiddenStatesConnector" in line and "PYTHONPATH=" in line
        metric = 'genqueue_run_refused{run="nocap"} 1.0'
        deadline = time.monotonic() + 30
        while metric not in (http_text(f"http://127.0.0.1:{port}/metrics", timeout=2) or "") \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric in (http_text(f"http://127.0.0.1:{port}/metrics", timeout=2) or "")
        deadline = time.monotonic() + 30
        while True:
            status = orjson.loads(cli("producer", "status", "--run", "nocap", "--json",
                                      env={"REDIS_URL": redis_url}).stdout)
            hosts = list(status["hosts"].values())
            if (hosts and hosts[0]["refusing"]) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert hosts and hosts[0]["refusing"] == 1 and "named no capture file" in hosts[0]["reason"], hosts
    finally:
        c.kill()
        sim.stop()
    sent = _sent(record)
    asked = [b for b in sent if b.get("kv_transfer_params")]
    assert len(asked) == 1 and asked[0]["kv_transfer_params"] == {"include_output_tokens": True}, sent
    assert _item_requests(sent) == [], "no item reached the engine"
    assert conn.llen("rq:queue:genqueue.nocap") == jobs, "every job still waits in its queue"
    assert read_results(tmp_path / "out", "nocap") == []


@pytest.mark.parametrize(("engine", "said"), [
    (("--capture-layers", "2,4,6"), "captures 3 layers, the run asks for 2 (2,4)"),
    (("--capture-layers", "2,4", "--capture-wrong-ids", "1.0"), "the probe's captured hidden states are not its answer's"),
])
def test_an_engine_capturing_other_than_the_run_asks_is_refused_in_one_line(tmp_path, redis_url, conn, engine, said):
    _enqueue(tmp_path, redis_url, "other", 8, *CAPTURE)
    jobs = conn.llen("rq:queue:genqueue.other")
    caps = tmp_path / "caps"
    sim = Sim(tmp_path, "--mean-tokens", "10", "--capture-dir", str(caps), *engine)
    try:
        c = _consumer(tmp_path, redis_url, sim, "other", "--burst")
        code = c.wait(60)
    finally:
        sim.stop()
    log = c.output()
    assert code == ExitCode.PREFLIGHT, log
    line = _refusal(log)
    assert said in line and "start vLLM with --speculative-config" in line and FLAGS in line, line
    assert "Traceback" not in log
    assert list(caps.iterdir()) == [], "the probe's capture file is removed"
    assert conn.llen("rq:queue:genqueue.other") == jobs, "every job still waits in its queue"


def test_a_capture_run_passes_the_pre_flight_on_its_probe_and_leaves_no_file(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "cap", 8, *CAPTURE)
    caps, record = tmp_path / "caps", tmp_path / "sent.jsonl"
    code, log = _burst(tmp_path, redis_url, "cap", "--capture-dir", str(caps), "--capture-layers", "2,4",
                       "--record-requests", str(record))
    assert code == ExitCode.DONE, log
    assert "the engine captures the run's 2 layers" in log
    sent = _sent(record)
    probes = [b for b in sent if b.get("kv_transfer_params") and not _item_requests([b])]
    assert len(probes) == 1, "one capture probe"
    assert {r["key"] for r in read_results(tmp_path / "out", "cap")} == run_keys(conn, "cap")
    assert list(caps.iterdir()) == [], "no capture file is left: the probe's, nor any answer's"


def test_a_model_capture_cannot_serve_is_refused_in_one_line_before_the_probe(tmp_path, redis_url, conn):
    """The engine serves a model whose folder (vLLM's /v1/models `root`) is on this node: a layer
    id past its last layer (vLLM captures it as a copy of another, silently) is refused from its
    config.json before any request asks for hidden states."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 3}')
    _enqueue(tmp_path, redis_url, "deep", 4, *CAPTURE)
    record = tmp_path / "sent.jsonl"
    code, log = _burst(tmp_path, redis_url, "deep", "--model", str(model), "--capture-dir", str(tmp_path / "caps"),
                       "--capture-layers", "2,4", "--record-requests", str(record))
    assert code == ExitCode.PREFLIGHT, log
    line = _refusal(log)
    assert f"layer id 4 is past model {model}'s last layer (3 decoder layers" in line, line
    assert not [b for b in _sent(record) if b.get("kv_transfer_params")], "no request asked for hidden states"


def test_the_pre_flight_gives_a_capture_run_no_per_request_spec_advice(tmp_path, redis_url, conn):
    """A capturing engine counts drafts (extract_hidden_states holds the speculative slot) but runs
    no drafter: --per-request-spec-decode-metrics would record nothing worth having."""
    _enqueue(tmp_path, redis_url, "capspec", 4, *CAPTURE)
    code, log = _burst(tmp_path, redis_url, "capspec", "--capture-dir", str(tmp_path / "caps"), "--capture-layers",
                       "2,4", "--spec-tokens", "1", "--per-request-spec-decode-metrics", "none")
    assert code == ExitCode.DONE, log
    assert "--per-request-spec-decode-metrics" not in log
    assert "holds extract_hidden_states, not a drafter: no acceptance figures to record" in log


def test_a_capture_no_request_asked_for_is_removed_at_once(tmp_path, monkeypatch):
    """An engine whose connector captures every request (vLLM's stock one) names a file in every
    answer; a run without --capture, and the probes, asked for none: the consumer removes it."""
    every, save = sim_capture.captured_ids, sim_capture.save
    written: list[str] = []
    monkeypatch.setattr(sim_capture, "captured_ids",
                        lambda prompt, output, params: every(prompt, output, params if isinstance(params, dict) else {}))
    monkeypatch.setattr(sim_capture, "save", lambda *a: written.append(save(*a)) or written[-1])
    caps = tmp_path / "caps"

    async def go() -> list[str | None]:
        cfg = SimConfig(mean_tokens=10, seed=3, capture_dir=str(caps), capture_layers=(2, 4), hidden_size=16)
        async with SimServer(cfg) as sim, EndpointClient(sim.url) as client:
            gen = Generator(client, Gate(client), features=CaptureKeeper(lambda *a: None))  # type: ignore[arg-type,return-value]
            paths = []
            for token_ids in (False, True):
                ctx = RunContext("r", RunSettings(sampling=Sampling(max_tokens=32), token_ids=token_ids), "sim-model",
                                 {"host": "t"})
                for need_ids in (True, False):  # an answer, and the probe
                    turn = await gen.request(ctx, [{"role": "user", "content": f"hello {need_ids}"}], None,
                                             need_ids=need_ids)
                    paths.append(turn.capture_path)
            return paths

    assert asyncio.run(go()) == [None] * 4
    assert len(written) == 4, "the engine captured every request"
    assert list(caps.iterdir()) == [], "every unasked capture is removed"


def test_a_probe_capture_with_two_identical_layers_is_refused(tmp_path):
    """vLLM 0.32 started with one real layer id and one past the model's last (ids 1,6 of a 4-layer
    model) captures the real layer twice, silently: where the model's config is not on this node,
    the probe's capture tells it (no real model has two layers equal to the bit)."""
    from genqueue.common.capture import CaptureKind, CaptureSettings
    from genqueue.consumer.capture.probe import judge
    ids = list(range(5, 40))
    run = CaptureSettings(CaptureKind.HIDDEN_STATES, (1, 6))
    copied = sim_capture.save(sim_capture.CaptureConfig(tmp_path, (1, 1), 32), "copied", ids, digest=1)
    why = judge(run, "http://engine/v1", copied, ids)
    assert why is not None and "captured layers 1 and 6 identical over all 35 tokens" in why, why
    assert not Path(copied).exists(), "the probe's file is removed either way"
    distinct = sim_capture.save(sim_capture.CaptureConfig(tmp_path, (1, 6), 32), "distinct", ids, digest=1)
    assert judge(run, "http://engine/v1", distinct, ids) is None
