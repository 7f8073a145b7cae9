"""The cost of a run: the input's estimate of output tokens (common/estimate.py),
GPU-hours spent and projected, and the same in money (producer/status/cost.py), and what enqueue
and status say of them."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.common.contracts import Item
from genqueue.common.estimate import estimated_tokens, output_chars
from genqueue.producer.status import WIDTH
from genqueue.producer.status.cost import consumer_hours, remaining_tokens, run_cost
from tests.conftest import cli, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim


def _item(turn: int | None) -> Item:
    return {"key": "0" * 32, "index": 0, "turn": turn, "messages": []}


def test_the_estimate_counts_the_answers_each_item_regenerates() -> None:
    answers = [400, 0, 80]
    assert output_chars(_item(None), answers) == 480  # regenerate: the whole conversation's
    assert output_chars(_item(2), answers) == 80  # each/first/last: its own turn's
    assert output_chars(_item(1), answers) == 0
    assert output_chars(_item(7), answers) == 0  # a turn past the answers: none
    assert estimated_tokens(4000, 10, 10) == 1000  # chars / 4
    assert estimated_tokens(4000, 20, 10) == 2000  # an item without an answer counts at the mean
    assert estimated_tokens(0, 10, 0) is None  # bare prompts: no estimate


T = 1.7e9  # seconds since the epoch, as snapshots hold them


def snap(start: float, seen: float, runs: dict[str, int], live: bool = True, **extra: Any) -> dict[str, Any]:
    """A consumer's snapshot: started START and last seen SEEN seconds after T."""
    return {"worker": "w", "started_at": T + start, "last_seen": T + seen, "live": live,
            "runs": {r: {"completion_tokens": t} for r, t in runs.items()}, **extra}


def test_gpu_hours_are_gpus_times_wall_time_split_between_runs_by_tokens() -> None:
    # one hour, one run: one GPU-hour; a consumer started before the run counts from the run's start
    assert consumer_hours(snap(0, 3600, {"a": 10}), "a", None) == pytest.approx(1.0)
    assert consumer_hours(snap(0, 3600, {"a": 10}), "a", T + 1800.0) == pytest.approx(0.5)
    # two runs: by their completion tokens; none yet: evenly
    assert consumer_hours(snap(0, 3600, {"a": 30, "b": 10}), "a", None) == pytest.approx(0.75)
    assert consumer_hours(snap(0, 3600, {"a": 0, "b": 0}), "a", None) == pytest.approx(0.5)
    assert consumer_hours({**snap(0, 3600, {"a": 1}), "started_at": None}, "a", None) == 0.0  # start unknown
    # a run that is over: the consumer's time on it ends at its last upload of the run, not its last report
    over = snap(0, 7200, {"a": 10})
    over["runs"]["a"]["shipping"] = {"last_upload_at": T + 3600}
    assert consumer_hours(over, "a", None, complete=True) == pytest.approx(1.0)
    assert consumer_hours(over, "a", None) == pytest.approx(2.0)
    # a consumer that says it fronts 4 GPUs (tensor parallel) counts 4
    assert consumer_hours(snap(0, 3600, {"a": 1}, gpus=4), "a", None) == pytest.approx(4.0)


def test_remaining_tokens_use_what_shipped_else_the_estimate() -> None:
    assert remaining_tokens(100, 100, 0, 5000, 9999)[0] == 0.0
    left, how = remaining_tokens(100, 0, 0, 0, 20_000)
    assert left == pytest.approx(20_000) and "estimate" in how
    left, how = remaining_tokens(100, 20, 5, 6000, 20_000)  # 300 tok per item done x 75 left
    assert left == pytest.approx(22_500) and "done so far" in how
    assert remaining_tokens(100, 0, 0, 0, None)[0] is None


def test_projected_is_spent_plus_the_rest_at_the_fleet_rate_and_money_is_hours_times_price() -> None:
    fleet = [snap(0, 3600, {"a": 1}), snap(1800, 3600, {"a": 1}), snap(0, 1800, {"a": 1}, live=False)]
    # spent 1 + 0.5 + 0.5 = 2 GPU-hours; 720,000 tokens left at 100 tok/s on 2 live GPUs: 4 more
    c = run_cost(fleet, "a", run_started_at=None, remaining=720_000.0, rate=100.0, price=2.5, estimate=10**6,
                 remaining_basis="x")
    assert c["gpu_hours_spent"] == pytest.approx(2.0) and c["live_gpus"] == 2
    assert c["gpu_hours_projected"] == pytest.approx(6.0)
    assert c["spent_money"] == pytest.approx(5.0) and c["projected_money"] == pytest.approx(15.0)
    assert "1 GPU per consumer assumed" in c["basis"]["gpu_hours_spent"]
    done = run_cost(fleet, "a", run_started_at=None, remaining=0.0, rate=None, price=None, estimate=None,
                    remaining_basis="nothing left")
    assert done["gpu_hours_projected"] == done["gpu_hours_spent"] and done["spent_money"] is None
    no_rate = run_cost(fleet, "a", run_started_at=None, remaining=5.0, rate=None, price=1.0, estimate=None,
                       remaining_basis="x")
    assert no_rate["gpu_hours_projected"] is None and no_rate["projected_money"] is None


@pytest.mark.slow
@pytest.mark.integration
def test_enqueue_estimates_and_status_costs_a_running_run(tmp_path: Path, redis_url: str) -> None:
    # 199 answers of 400 characters (100 tokens each) and one bare prompt (counted at the mean)
    recs: list[object] = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                           {"from": "gpt", "value": "x" * 400}]}
                          for i in range(199)]
    recs.append({"id": "bare", "conversations": [{"from": "human", "value": "no answer here"}]})
    data = write_jsonl(tmp_path / "cost.jsonl", recs)
    env = {"REDIS_URL": redis_url}
    out = cli("producer", "enqueue", str(data), "--run", "cost", "--output", str(tmp_path / "out"), "--batch-size",
              "4", "--max-tokens", "64", "--rejects", str(tmp_path / "rej"), "--json", env=env).stdout
    assert orjson.loads(out)["estimated_output_tokens"] == 20_000
    dry = cli("producer", "enqueue", str(data), "--run", "cost2", "--dry-run", env=env).stdout
    assert "estimated output" in dry and "20,000 tokens" in dry

    def status(*args: str, price: str | None = "2.5") -> dict[str, Any]:
        e = {**env, "GENQUEUE_GPU_HOUR_PRICE": price} if price else env
        return orjson.loads(cli("producer", "status", "--run", "cost", "--json", *args, env=e).stdout)

    before = status()["cost"]
    assert before["estimated_output_tokens"] == 20_000 and before["gpu_hours_spent"] == 0.0
    sim = Sim(tmp_path, "--slots", "4", "--step-time", "0.01", "--mean-tokens", "20")
    c = Proc("consumer", ["run", "--run", "cost", "--endpoint", sim.url, "--shard-max-age", "1", "--concurrency", "4",
                          "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env={**env, "GENQUEUE_ENGINE_GPUS": "2"})
    try:
        first: dict[str, Any] = {}

        def shipping() -> bool:
            r = status()
            first.update(r)
            return r["items_done"] > 0 and r["eta_assumes_completion_tokens_per_s"] and r["items_done"] < r["items"]

        wait_for(shipping, 60, "a first shard shipped, the run not done")
        time.sleep(2.5)
        second = status()
        a, b = first["cost"], second["cost"]
        assert b["gpu_hours_spent"] > a["gpu_hours_spent"] > 0
        for k in (a, b):  # the consumer says its engine has 2 GPUs (GENQUEUE_ENGINE_GPUS = --engine-gpus 2)
            assert k["live_gpus"] == 2 and "assumed" not in k["basis"]["gpu_hours_spent"]
            assert k["price"] == 2.5 and k["estimated_output_tokens"] == 20_000
            assert k["spent_money"] == pytest.approx(k["gpu_hours_spent"] * 2.5)
            if k["gpu_hours_projected"] is not None:
                assert k["gpu_hours_projected"] >= k["gpu_hours_spent"]
                assert k["projected_money"] == pytest.approx(k["gpu_hours_projected"] * 2.5)
        assert a["gpu_hours_projected"] is not None
        # the human screen: the estimate against reality, and the cost, within 100 columns
        text = cli("producer", "status", "--run", "cost", "--gpu-hour-price", "3", env=env).stdout
        rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
        assert "20,000 tokens" in rows["estimate"] and "GPU-hours" in rows["cost"] and "projected" in rows["cost"]
        assert rows["money"].endswith("projected at 3 a GPU-hour")
        assert all(len(line) <= WIDTH for line in text.splitlines())
        assert status(price=None)["cost"]["spent_money"] is None
        # once the run is over its spend stops growing, and nothing more is projected
        wait_for(lambda: status()["items_done"] == 200, 60, "the run done")
        time.sleep(3)  # the consumer reports its last upload within a report's interval (2 s)
        ended = status()["cost"]
        time.sleep(2.5)
        later = status()["cost"]
        assert later["gpu_hours_spent"] == pytest.approx(ended["gpu_hours_spent"])
        assert ended["gpu_hours_spent"] > b["gpu_hours_spent"]
        assert later["gpu_hours_projected"] == later["gpu_hours_spent"]
        # enqueue again, every item done: the input is not read, and the estimate recorded stands
        again = orjson.loads(cli("producer", "enqueue", str(data), "--run", "cost", "--output", str(tmp_path / "out"),
                                 "--batch-size", "4", "--max-tokens", "64", "--rejects", str(tmp_path / "rej"),
                                 "--json", env=env).stdout)
        assert again["input_unchanged"] and again["estimated_output_tokens"] == 20_000
        assert status()["cost"]["estimated_output_tokens"] == 20_000
    finally:
        c.signal(signal.SIGTERM)
        c.wait(60)
        sim.stop()
