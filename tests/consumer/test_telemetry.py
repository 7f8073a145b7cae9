"""The consumer's per-run Prometheus gauges, from a snapshot's `runs` (no I/O)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from genqueue.common.snapshot import RunCounters
from genqueue.consumer.metrics import RUN_GAUGES, set_run_gauges


def value(name: str, run: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"run": run})


def counters(in_flight: int, shards: int) -> RunCounters:
    return {"in_flight": in_flight, "pending_items": 2, "held_jobs": 1,
            "shipping": {"shards": shards, "bytes": 10 * shards, "waiting_shards": 1, "unshipped_records": 7,
                         "last_upload_at": None, "oldest_waiting_at": None}}


def test_each_run_has_its_own_figures_and_a_run_no_longer_reported_loses_its_series() -> None:
    seen = set_run_gauges({"tg-a": counters(5, 3), "tg-b": counters(1, 0)}, set())
    assert seen == {"tg-a", "tg-b"}
    assert (value("genqueue_run_in_flight", "tg-a"), value("genqueue_run_in_flight", "tg-b")) == (5, 1)
    assert value("genqueue_run_shards_shipped", "tg-a") == 3 and value("genqueue_run_shipped_bytes", "tg-a") == 30
    assert value("genqueue_run_unshipped_records", "tg-a") == 7 and value("genqueue_run_held_jobs", "tg-b") == 1
    assert set_run_gauges({"tg-a": counters(0, 4)}, seen) == {"tg-a"}
    assert value("genqueue_run_in_flight", "tg-a") == 0 and value("genqueue_run_shards_shipped", "tg-a") == 4
    assert all(value(g._name, "tg-b") is None for g, _ in RUN_GAUGES)  # gone, not stuck at its last value


def test_a_run_with_no_figures_yet_is_at_zero() -> None:
    set_run_gauges({"tg-new": {"fingerprint": None}}, set())
    assert all(value(g._name, "tg-new") == 0 for g, _ in RUN_GAUGES)


def test_kv_cache_usage_has_no_sample_until_the_engine_gives_a_reading() -> None:
    """It read 0 (an idle cache) when the engine gave no KV reading at all."""
    from prometheus_client import generate_latest

    from genqueue.consumer.metrics import set_engine_gauges

    def kv() -> float | None:
        return REGISTRY.get_sample_value("genqueue_engine_kv_cache_usage")

    set_engine_gauges({"metrics": False})  # no /metrics on the engine
    assert kv() is None
    page = generate_latest(REGISTRY).decode()
    assert "genqueue_engine_kv_cache_usage" not in page  # an absent series, as Prometheus users expect
    set_engine_gauges({"metrics": True, "running": 3.0, "kv_cache_usage": None})  # /metrics, no KV gauge
    assert kv() is None and REGISTRY.get_sample_value("genqueue_engine_running") == 3
    set_engine_gauges({"metrics": True, "kv_cache_usage": 0.0})  # a real reading of 0 stays 0
    assert kv() == 0.0
    set_engine_gauges({"metrics": True, "kv_cache_usage": 0.42})
    assert kv() == 0.42
    set_engine_gauges({"metrics": False})  # the reading went away: so does the series
    assert kv() is None
