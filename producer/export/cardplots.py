"""The dataset card's pictures (card.py): histograms of the token lengths per generation and a
bar chart of generations per conversation, drawn with matplotlib's Agg backend (no display).

matplotlib is the optional extra `genqueue[card]`: without it `available()` is False and the
card holds the tables alone, with one line saying how to get the pictures.
"""

from __future__ import annotations

import array
import importlib.util
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from genqueue.producer.export.tempnames import sweep_dead, temp_beside

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


class RowStats(Protocol):
    """What the pictures read of card.RowStats."""

    generations: int
    summed_generations: int
    conversations: int
    prompt: array.array[int]
    thinking: array.array[int]
    answer: array.array[int]
    completion: array.array[int]
    gens_per_conversation: Counter[int]

__all__ = ["KINDS", "available", "draw", "picture"]

#: Histogram bins per panel.
BINS = 40
#: Lengths whose largest is this many times their smallest get a log axis (a linear one would fill two bars).
LOG_SPAN = 25
PANEL_INCHES = (4.2, 3.2)
#: Dots per inch of the card's histograms: sharp on the Hub's page at ~700 px wide, a few tens of KB each.
DPI = 110
#: One colour per quantity, the same in every card (prompt, thinking, answer, thinking + answer).
COLOURS = {"prompt": "#4C72B0", "thinking": "#DD8452", "answer": "#55A868", "thinking + answer": "#8172B3"}


def picture(folder: Path, name: str, kind: str) -> Path:
    """Where draw puts the picture KIND ("lengths" or "generations") of the export NAME."""
    return folder / f"{name}.{kind}.png"


#: The pictures draw may make, by kind.
KINDS = ("lengths", "generations")


def available() -> bool:
    """matplotlib is installed (`pip install 'genqueue[card]'`)."""
    return importlib.util.find_spec("matplotlib") is not None


def draw(stats: RowStats, folder: Path, name: str) -> dict[str, Path]:
    """The PNGs of STATS in FOLDER, named <NAME>.lengths.png and <NAME>.generations.png (only
    those with something to show): {"lengths": path, "generations": path}."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # no pyplot: no global state, nothing left open
    from matplotlib.ticker import MaxNLocator

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    panels = [(label, values) for label, values in (("prompt", stats.prompt), ("thinking", stats.thinking),
                                                    ("answer", stats.answer)) if values]
    if len(stats.thinking) < len(stats.completion):  # thinking unknown for some: their generated total too
        panels.append(("thinking + answer", stats.completion))
    if panels:
        cols = 2 if len(panels) == 4 else len(panels)  # four panels read best as a square
        grid = (-(-len(panels) // cols), cols)
        fig = Figure(figsize=(PANEL_INCHES[0] * grid[1], PANEL_INCHES[1] * grid[0] + 0.4), dpi=DPI,
                     layout="constrained")
        for i, (label, values) in enumerate(panels):
            _histogram(fig.add_subplot(grid[0], grid[1], i + 1), label, values)
        shown = stats.generations - stats.summed_generations
        apart = (f";\n{stats.summed_generations:,} more in rows of several answers, whose usage is their sum, "
                 "are not shown") if stats.summed_generations else ""
        fig.suptitle(f"Token lengths per generation ({shown:,} generations{apart})")
        out["lengths"] = _save(fig, picture(folder, name, "lengths"))
    if stats.gens_per_conversation:
        counts = sorted(stats.gens_per_conversation.items())
        fig = Figure(figsize=(max(PANEL_INCHES[0], 0.5 * len(counts) + 2), PANEL_INCHES[1]), dpi=DPI,
                     layout="constrained")
        ax = fig.add_subplot(1, 1, 1)
        bars = ax.bar([str(k) for k, _ in counts], [v for _, v in counts], color="#4C72B0")
        ax.bar_label(bars, labels=[f"{v:,}" for _, v in counts], fontsize=8)
        ax.set_xlabel("generations in the conversation")
        ax.set_ylabel("conversations")
        ax.set_title(f"Generations per conversation\n({stats.conversations:,} conversations)", fontsize=10)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(y=0.15)
        out["generations"] = _save(fig, picture(folder, name, "generations"))
    return out


def _histogram(ax: Axes, label: str, values: array.array[int]) -> None:
    """One quantity's lengths. Token lengths run long-tailed (tens to tens of thousands): over a
    range of LOG_SPAN or more the axis is log-scaled with bins of equal ratio, so the rows fill
    many bars instead of two; zero lengths have no place on it and are counted in the title."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ordered = sorted(values)
    n = len(ordered)
    median, p90 = ordered[(n - 1) // 2], ordered[min(n - 1, -(-90 * n // 100) - 1)]
    positive = [v for v in ordered if v > 0]
    zeros = n - len(positive)
    log = len(positive) > 1 and positive[-1] >= LOG_SPAN * positive[0]
    if log:
        bins: object = np.geomspace(positive[0], positive[-1] * 1.0001, BINS + 1)
        ax.hist(positive, bins=bins, color=COLOURS[label], edgecolor="white", linewidth=0.5)  # type: ignore[arg-type]
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, numticks=6))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        shown = positive if zeros and positive else ordered
        ax.hist(shown, bins=min(BINS, max(1, len(set(shown)))), color=COLOURS[label], edgecolor="white",
                linewidth=0.5)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_count(x)))
    ax.axvline(max(median, 1) if log else median, color="black", linestyle="--", linewidth=1,
               label=f"median {median:,}")
    ax.axvline(max(p90, 1) if log else p90, color="black", linestyle=":", linewidth=1, label=f"p90 {p90:,}")
    ax.set_title(f"{label} ({n:,}" + (f"; {zeros:,} with 0 tokens, not drawn" if zeros and positive else "") + ")")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens (log scale)" if log else "tokens")
    ax.set_ylabel("generations")
    ax.margins(y=0.2)  # room for the legend above the tallest bar
    ax.legend(fontsize=8, frameon=False, loc="upper right")


def short_count(x: float) -> str:
    """A tick's count in a few characters: 800, 1.5k, 12k, 1.2M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:.3g}M"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.3g}k"
    return f"{x:.3g}"


def _save(fig: Figure, path: Path) -> Path:
    sweep_dead([path])
    tmp = temp_beside(path)
    try:
        with open(tmp, "wb") as fh:
            fig.savefig(fh, format="png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
