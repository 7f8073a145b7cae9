"""The capture figures every screen shows (common/keepers/captured.py capture_figures), from one
read of a run's counters: the rows and bytes, the budget and whether it is spent, and the forecast
for the run (bytes shipped + bytes per row x rows per done item x items left). Pure: no Redis."""

from __future__ import annotations

from genqueue.common.capture import CaptureSettings, format_size, parse_capture
from genqueue.common.contracts import Mode
from genqueue.common.keepers.captured import SPENT, capture_figures
from genqueue.common.keepers.marks import Progress
from genqueue.common.keepers.markscript import SHIPPED_FEATURES, SHIPPED_TURNS
from genqueue.common.keepers.runs import FEATURE_BYTES, FEATURE_ROWS
from genqueue.common.settings import RunSettings
from genqueue.producer.status.screen import capture_rows


def _settings(capture: CaptureSettings | None, mode: Mode = Mode.FIRST) -> RunSettings:
    return RunSettings(token_ids=True, capture=capture, multi_turn=mode)


def test_a_run_without_capture_has_no_figures() -> None:
    assert capture_figures(_settings(None), Progress(10, 5, 0, 0, {})) is None


def test_the_forecast_is_what_shipped_plus_bytes_a_row_times_rows_an_item_times_items_left() -> None:
    capture = parse_capture("hidden-states", "2,16,29,32", None, 0.25)
    stats = {SHIPPED_FEATURES: 100, FEATURE_ROWS: 110, FEATURE_BYTES: 110 * 41_000_000, SPENT: 110 * 41_000_000}
    f = capture_figures(_settings(capture), Progress(4000, 400, 0, 0, stats))
    assert f is not None
    assert (f["rows"], f["rows_written"], f["rows_extra"], f["answers"], f["items_left"]) == (100, 110, 10, 400, 3600)
    assert f["bytes_per_row"] == 41_000_000 and f["rows_per_item"] == 0.25
    assert f["projected_bytes"] == 110 * 41_000_000 + 41_000_000 * 0.25 * 3600
    assert f["projected_kept"] == f["projected_bytes"] and f["budget"] is None and not f["budget_spent"]
    assert f["choice"] == ["share"] and f["chosen"] == "a share 0.25 of each source's items, drawn from each item's key"
    rows = dict(capture_rows(f))
    assert rows["  forecast"].startswith(f"{format_size(f['projected_bytes'])} for the run (41.0 MB a row x 0.25 rows")


def test_a_budget_is_shown_spent_once_reached_and_the_forecast_keeps_what_it_allows() -> None:
    capture = parse_capture("hidden-states", "2,4", None, None, None, "2TB")
    progress = Progress(1_000_000, 10_000, 0, 0, {SHIPPED_FEATURES: 10_000, FEATURE_ROWS: 10_000,
                                                  FEATURE_BYTES: 410 * 10**9, SPENT: 410 * 10**9})
    f = capture_figures(_settings(capture), progress)
    assert f is not None and not f["budget_spent"] and f["choice"] == ["budget"]
    assert f["projected_bytes"] == 41 * 10**12 and f["projected_kept"] == 2 * 10**12
    rows = dict(capture_rows(f))
    assert rows["  budget"] == "2.0 TB: 410.0 GB captured (20%)"
    assert rows["  forecast"].endswith("; the budget keeps 2.0 TB (5%)")
    spent = Progress(1_000_000, 60_000, 0, 0, {SHIPPED_FEATURES: 48_800, FEATURE_ROWS: 48_800,
                                               FEATURE_BYTES: 2_000_100_000_000, SPENT: 2_000_200_000_000})
    f = capture_figures(_settings(capture), spent)
    assert f is not None and f["budget_spent"] and f["projected_kept"] == 2_000_200_000_000
    assert dict(capture_rows(f))["  budget"].startswith("2.0 TB: budget spent (2.0 TB captured)")


def test_regenerate_counts_the_user_turns_answered_as_the_answers_generated() -> None:
    capture = parse_capture("hidden-states", "2,4", None)
    f = capture_figures(_settings(capture, Mode.REGENERATE),
                        Progress(10, 10, 0, 0, {SHIPPED_TURNS: 27, SHIPPED_FEATURES: 27, FEATURE_ROWS: 27,
                                                FEATURE_BYTES: 2700}))
    assert f is not None and (f["answers"], f["rows"], f["items_left"], f["projected_bytes"]) == (27, 27, 0, 2700)
    assert "  forecast" not in dict(capture_rows(f)), "a run over forecasts nothing"
    assert dict(capture_rows(f))["  chosen"] == "every answer: 27 rows of 27 answers generated"


def test_nothing_shipped_yet_forecasts_nothing() -> None:
    f = capture_figures(_settings(parse_capture("hidden-states", "2", None)), Progress(10, 0, 0, 0, {}))
    assert f is not None and f["projected_bytes"] is None and f["bytes_per_row"] is None
    assert dict(capture_rows(f))["  forecast"] == "none yet: no row shipped"


def test_a_capture_pass_shows_its_source_and_choice_and_the_bytes_its_rows_come_to() -> None:
    from genqueue.common.prefill import PrefillChoice, PrefillSettings
    from genqueue.producer.export.cardsection import _capture

    pf = PrefillSettings(source="gen", by=PrefillChoice.ACCEPTANCE, budget=2 * 10**12, hidden_size=5120,
                         rows=48_000, source_rows=1_000_000, tokens=96_000_000, bytes=1_967_000_000_000)
    settings = RunSettings(token_ids=True, capture=parse_capture("hidden-states", "2,16,29,32", None), prefill=pf)
    f = capture_figures(settings, Progress(48_000, 12_000, 0, 0, {SHIPPED_FEATURES: 12_000, FEATURE_ROWS: 12_000,
                                                                  FEATURE_BYTES: 491_000_000_000}))
    assert f is not None and f["capture_pass"] is not None
    assert f["choice"] == ["pass", "acceptance"] and f["budget"] == 2 * 10**12 and not f["budget_spent"]
    assert f["chosen"] == "a capture pass over run gen: 48,000 of its 1,000,000 rows, the drafter's worst first, within 2.0 TB"
    assert f["projected_bytes"] == 1_967_000_000_000, "a pass's bytes are known exactly from its rows' tokens"
    rows = dict(capture_rows(f))
    assert rows["  chosen"].endswith(": 12,000 rows captured of the 48,000 chosen (96,000,000 tokens, 2.0 TB of features)")
    assert rows["  budget"] == "2.0 TB: applied when the pass was enqueued"
    card = _capture(f)
    assert "| capture pass over run | gen |" in card and "| rows chosen of the source's | 48,000 of 1,000,000 |" in card
    assert "| chosen by | pass, acceptance |" in card and "| bytes the chosen rows come to | 2.0 TB (1,967,000,000,000 bytes) |" in card
