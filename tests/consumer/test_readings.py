"""The table of engine readings (common.engineview.ENGINE_READINGS) is what the parse, the
consumer's gauges and status' engine line follow: held equal to EngineView, and each part shown
to follow a row it is given."""

from __future__ import annotations

import typing

import pytest

from genqueue.common.engineview import ENGINE_READINGS, EngineReading, EngineView, Exported, ReadingKind, Shown
from genqueue.consumer.engine import readings

#: EngineView's fields that are not readings of /metrics: derived from them, or the doctor's
DERIVED = {"metrics", "spec_decode", "spec_acceptance", "verdict", "advice", "numbers", "notes", "spec_verdict"}

TYPE_OF = {ReadingKind.GAUGE: float | None, ReadingKind.FRACTION: float | None, ReadingKind.COUNTER: float | None,
           ReadingKind.CONFIG_INT: int | None, ReadingKind.CONFIG_BOOL: bool | None}


def test_the_table_and_engine_view_hold_the_same_readings_with_the_same_types() -> None:
    hints = typing.get_type_hints(EngineView)
    keys = [r.key for r in ENGINE_READINGS]
    assert len(keys) == len(set(keys))
    assert set(hints) - DERIVED == set(keys)
    for r in ENGINE_READINGS:
        assert hints[r.key] == TYPE_OF[r.kind], r.key
        assert r.names and all(r.names), r.key


def test_the_parse_reads_every_row_by_its_first_name_present() -> None:
    text = "\n".join([
        'vllm:num_requests_running{engine="0"} 3', 'vllm:num_requests_running{engine="1"} 2',
        'vllm:gpu_cache_usage_perc{engine="0"} 0.25', 'vllm:gpu_cache_usage_perc{engine="1"} 0.5',
        'vllm:generation_tokens_total 40',
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",num_gpu_blocks="None"} 1.0'])
    v = readings.engine_view(text)
    # a gauge adds up over replicas, a fraction is the fullest, an older name is read too
    assert v["running"] == 5 and v["kv_cache_usage"] == 0.5 and v["generation_tokens"] == 40
    assert v["block_size"] == 16 and v["num_gpu_blocks"] is None and v["prefix_caching"] is False
    assert v["waiting"] is None and v["spec_decode"] is False and v["spec_acceptance"] is None
    # every reading has its key (None when the engine exports none), in EngineView's order
    assert set(v) == {"metrics", "spec_decode", "spec_acceptance", *(r.key for r in ENGINE_READINGS)}
    order = list(typing.get_type_hints(EngineView))
    assert list(v) == [k for k in order if k in v]


def test_a_reading_added_to_the_table_is_parsed_without_touching_the_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """What issue 32 asked: one row (and its EngineView field) is all the parse needs."""
    row = EngineReading("spec_per_pos", ("vllm:spec_decode_num_accepted_tokens_per_pos_total",), ReadingKind.COUNTER)
    monkeypatch.setattr(readings, "ENGINE_READINGS", (*ENGINE_READINGS, row))
    monkeypatch.setattr(readings, "_ORDER", (*readings._ORDER, "spec_per_pos"))  # its EngineView field, pretended
    text = ('vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3\n')
    assert readings.engine_view(text)["spec_per_pos"] == 10  # type: ignore[typeddict-item]


def test_status_shows_the_rows_the_table_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from genqueue.producer.status import core

    e = {"metrics": True, "running": 3.0, "waiting": 1.0, "kv_cache_usage": 0.8, "preemptions": 12.0,
         "spec_decode": False, "models": ["m"], "max_model_len": {"m": 512}}
    assert core.engine_text(e) == "engine 3/1  KV 80%  spec off  model m (max len 512)"  # type: ignore[arg-type]
    shown = EngineReading("preemptions", ("vllm:num_preemptions_total",), ReadingKind.COUNTER,
                          status=("preempted", Shown.COUNT))
    monkeypatch.setattr(core, "ENGINE_READINGS", (*ENGINE_READINGS, shown))
    assert core.engine_text(e) == "engine 3/1  KV 80%  preempted 12  spec off  model m (max len 512)"  # type: ignore[arg-type]
    assert core.engine_text({**e, "preemptions": None}).count("preempted -") == 1  # type: ignore[arg-type]
    # no /metrics read (yet): whether it speculates is unknown, not "off"
    assert "  spec -  " in core.engine_text({**e, "metrics": False})  # type: ignore[arg-type]


def test_the_consumer_exports_a_gauge_for_each_exported_row() -> None:
    from prometheus_client import REGISTRY

    from genqueue.consumer import metrics

    exported = {r.key: r.exported for r in ENGINE_READINGS if r.exported is not None}
    assert set(metrics.ENGINE_GAUGES) | set(metrics.ENGINE_READING_GAUGES) == set(exported)
    metrics.set_engine_gauges({"metrics": True, **{k: 2.0 for k in exported}})
    for key, ex in exported.items():
        assert isinstance(ex, Exported)
        assert REGISTRY.get_sample_value(ex.name) == 2.0, key
    metrics.set_engine_gauges({"metrics": False})
    for key, ex in exported.items():  # without a reading: 0, or no sample for those exported absent
        assert REGISTRY.get_sample_value(ex.name) == (None if ex.absent_without_reading else 0.0), key
