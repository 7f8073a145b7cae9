"""A status screen as blocks of lines, each with a rank, so that `producer status --watch` can fit
its frame to a terminal's height (pure, no I/O).

A frame taller than the terminal is not drawn whole (the terminal would scroll its top away or
crop it): the blocks are kept by rank, the headline (the run, any PAUSED, FAILED or STALLED line,
progress with its ETA) first, then coverage, then failures and alarms, then the rest of the
rows, then the consumers, then speculation; what is kept is drawn in the screen's own order, and
a last line says how many lines were left out and which command shows them all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum


class Rank(IntEnum):
    """Which blocks a frame too tall for its terminal keeps first (the lowest)."""

    HEADLINE = 0  # the run, PAUSED / FAILED / STALLED, progress and its ETA
    COVERAGE = 1  # where the items are, and their outcomes
    FAILURES = 2  # failed items and jobs, rows in red, drift, malformed or refused jobs, warnings
    DETAIL = 3  # the rest of the rows: input, settings, shipping, speed, tokens, hosts...
    CONSUMERS = 4
    SPECULATION = 5


@dataclass(frozen=True, slots=True)
class Block:
    """Lines of a screen kept or left out together (a row and its wrapped lines, a consumer and
    the lines under it)."""

    rank: Rank
    lines: tuple[str, ...]


def joined(blocks: Sequence[Block]) -> str:
    """BLOCKS as one text: the whole screen, as `producer status` prints it."""
    return "\n".join(line for b in blocks for line in b.lines)


def fit_height(blocks: Sequence[Block], rows: int, columns: int, command: str) -> str:
    """BLOCKS in at most ROWS terminal rows of COLUMNS columns: all of them when they fit; else
    those that fit, by rank (then in order), in the screen's order, and a last line saying how
    many lines were left out and that COMMAND shows them all."""
    from rich.cells import cell_len  # --watch's only: `producer status` prints without rich

    def height(line: str) -> int:  # the rows a line takes: a line wider than the terminal wraps there
        return max(1, math.ceil(cell_len(_ANSI.sub("", line)) / max(columns, 1)))

    heights = [sum(height(x) for x in b.lines) for b in blocks]
    if sum(heights) <= rows:
        return joined(blocks)
    total = sum(len(b.lines) for b in blocks)
    budget = rows - sum(height(x) for x in _note(total, command, columns))  # the note's rows, at its longest
    keep: set[int] = set()
    used = 0
    for i in sorted(range(len(blocks)), key=lambda i: (blocks[i].rank, i)):
        if used + heights[i] > budget:
            break  # what ranks lower waits for a taller terminal, even when a small block would fit
        keep.add(i)
        used += heights[i]
    kept = [line for i, b in enumerate(blocks) if i in keep for line in b.lines]
    return "\n".join([*kept, *_note(total - len(kept), command, columns)])


def _note(left: int, command: str, columns: int) -> list[str]:
    """The frame's last line(s): how many lines were left out and what shows them."""
    head = f"... {left:,} line{'s' if left != 1 else ''} left out to fit the terminal:"
    text = f"{head} `{command}` shows all"
    return [text] if len(text) <= columns else [head, f"    `{command}` shows all"]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
