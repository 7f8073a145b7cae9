"""Which rows the next training round should see more of: selection by acceptance (issue 33).

Pure: each row is given as its acceptance rate (common.acceptance.record_rate), None for a row
whose answers carry no speculative-decoding figures.

weights: a row's sampling weight is (1 - rate + EPS), normalised so that the rows with figures
average 1: the lower the drafter's acceptance on a row, the more often a trainer samples it.
Rows without figures weigh 1 (no evidence either way).

keep_lowest: of the rows with figures, the SHARE (0 < SHARE <= 1, rounded up) with the lowest
rate are kept (ties broken by row order); rows without figures are dropped, since nothing says
the drafter is weak on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from genqueue.common import defaults
from genqueue.common.errors import UserError

EPS = defaults.SELECTION_WEIGHT_FLOOR


def weights(rates: Sequence[float | None]) -> list[float]:
    """One sampling weight per row of RATES (see the module's docstring for the formula)."""
    raw = [1 - r + EPS for r in rates if r is not None]
    mean = sum(raw) / len(raw) if raw else 1.0
    return [1.0 if r is None else (1 - r + EPS) / mean for r in rates]


def check_share(share: float) -> float:
    if not 0 < share <= 1:
        raise UserError(f"--keep-lowest-acceptance takes a share in (0, 1], not {share}")
    return share


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows keep_lowest kept: their indices in row order, and the acceptance range kept."""

    kept: tuple[int, ...]
    with_figures: int
    lowest: float | None
    highest: float | None

    def to_dict(self) -> dict[str, object]:
        return {"selected": len(self.kept), "with_figures": self.with_figures,
                "rate_min": self.lowest, "rate_max": self.highest}


def keep_lowest(rates: Sequence[float | None], share: float) -> Selection:
    """The SHARE of RATES' rows with figures whose acceptance is lowest."""
    check_share(share)
    scored = sorted((r, i) for i, r in enumerate(rates) if r is not None)
    n = math.ceil(share * len(scored))
    chosen = scored[:n]
    return Selection(kept=tuple(sorted(i for _, i in chosen)), with_figures=len(scored),
                     lowest=chosen[0][0] if chosen else None, highest=chosen[-1][0] if chosen else None)
