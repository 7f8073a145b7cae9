"""The card's length histograms (producer/export/cardplots.py) drawn for real with matplotlib's Agg
backend: tick labels that do not run into each other, and token lengths spread over a log axis so
that the rows fill many bars, not two."""

from __future__ import annotations

import array
import itertools
import random
from typing import Any

import pytest

from genqueue.producer.export import cardplots
from genqueue.producer.export.cardplots import PANEL_INCHES


def _panel(values: list[int]) -> Any:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=PANEL_INCHES, dpi=cardplots.DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cardplots._histogram(ax, "answer", array.array("q", values))
    fig.canvas.draw()
    return fig, ax


def _labels_apart(fig: Any, ax: Any) -> list[str]:
    """The x tick labels shown, after checking that no two of them overlap on the drawn figure."""
    renderer = fig.canvas.get_renderer()
    shown = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, hi), max(lo, hi)
    extents = [(t.get_window_extent(renderer), t.get_text()) for t in shown if lo <= t.get_position()[0] <= hi]
    boxes = sorted((box.x0, box.x1, text) for box, text in extents)
    for (_, right, a), (left, _, b) in itertools.pairwise(boxes):
        assert right <= left, f"tick labels {a!r} and {b!r} overlap: {[x[2] for x in boxes]}"
    return [x[2] for x in boxes]


def test_long_tailed_lengths_have_readable_ticks_and_fill_many_bars_not_two() -> None:
    # was: x labels "1200160020002400…" running into each other, and a linear axis that put
    # nearly every row in two bars; now: a log axis of short labels ("100", "1k", "10k"), many bars
    rng = random.Random(7)
    values = [max(1, int(rng.lognormvariate(5.5, 1.2))) for _ in range(5000)] + [60_000]
    fig, ax = _panel(values)
    labels = _labels_apart(fig, ax)
    assert len(labels) >= 3 and all(len(x) <= 4 for x in labels), labels
    heights = [p.get_height() for p in ax.patches]
    assert sum(heights) == len(values)
    assert max(heights) < 0.25 * len(values), "nearly every row in a few bars"
    assert sum(h > 0 for h in heights) >= 15, heights


def test_narrow_lengths_stay_linear_with_labels_apart() -> None:
    rng = random.Random(3)
    values = [rng.randint(1200, 2600) for _ in range(800)]
    fig, ax = _panel(values)
    labels = _labels_apart(fig, ax)
    assert len(labels) >= 3, labels
    assert sum(p.get_height() for p in ax.patches) == len(values)


def test_zero_lengths_are_counted_in_the_title_not_lost() -> None:
    values = [0] * 30 + [10 * i for i in range(1, 400)]
    fig, ax = _panel(values)
    _labels_apart(fig, ax)
    assert "30" in ax.get_title() and sum(p.get_height() for p in ax.patches) == len(values) - 30
