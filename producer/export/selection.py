"""Which rows the next training round should see more of: selection by acceptance.

Pure: each row is given as its acceptance rate (common.acceptance.record_rate), None for a row
whose answers carry no speculative-decoding figures.

weights: a row's sampling weight is (1 - rate + EPS), normalised so that the rows with figures
average 1: the lower the drafter's acceptance on a row, the more often a trainer samples it.
Rows without figures weigh 1 (no evidence either way).

keep_lowest: of the rows with figures, the SHARE (0 < SHARE <= 1, rounded up) with the lowest
rate are kept (ties broken by row order); rows without figures are dropped, since nothing says
the drafter is weak on them.

The export applies both to a stream of rows (core.py, `--weight-by-acceptance`,
`--keep-lowest-acceptance`): `cut` reads the rates once (a float per row) and gives the rule as
a threshold and a count of ties, which a `Keeper` applies row by row in the same order, keeping
exactly the rows keep_lowest keeps; `weight_scale` and `weight` give the weights one at a time.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from genqueue.common.errors import UserError

#: A row the drafter accepts wholly keeps this small sampling weight, never zero: the next round still sees it.
EPS = 0.05


def weights(rates: Sequence[float | None]) -> list[float]:
    """One sampling weight per row of RATES (see the module's docstring for the formula)."""
    scale = weight_scale(rates)
    return [weight(r, scale) for r in rates]


def weight_scale(rates: Iterable[float | None]) -> float:
    """The mean raw weight (1 - rate + EPS) of the rows of RATES with figures (1.0: none): each
    weight is divided by it, so that they average 1."""
    total, n = 0.0, 0
    for r in rates:
        if r is not None:
            total += 1 - r + EPS
            n += 1
    return total / n if n else 1.0


def weight(rate: float | None, scale: float) -> float:
    """The sampling weight of a row of RATE (None: no figures, weight 1) among rows of SCALE."""
    return 1.0 if rate is None else (1 - rate + EPS) / scale


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
    rule = cut(rates, share)
    keep = Keeper(rule)
    return Selection(kept=tuple(i for i, r in enumerate(rates) if keep(r)), with_figures=rule.with_figures,
                     lowest=rule.lowest, highest=rule.threshold)


@dataclass(frozen=True, slots=True)
class Cut:
    """keep_lowest's choice as a rule rows can be judged by one at a time, in row order: a row is
    kept when its rate is below THRESHOLD, or equal to it and among the first TIES such rows."""

    with_figures: int  # rows with figures
    kept: int  # rows the rule keeps
    threshold: float | None  # the highest rate kept (None: none kept)
    ties: int
    lowest: float | None  # the lowest rate kept


def cut(rates: Iterable[float | None], share: float) -> Cut:
    """The rule that keeps the SHARE of RATES' rows with figures whose acceptance is lowest."""
    check_share(share)
    ordered = sorted(r for r in rates if r is not None)
    n = math.ceil(share * len(ordered))
    if not n:
        return Cut(len(ordered), 0, None, 0, None)
    threshold = ordered[n - 1]
    return Cut(len(ordered), n, threshold, n - bisect_left(ordered, threshold), ordered[0])


class Keeper:
    """Applies a Cut to rows in row order (None: keeps every row): call it with each row's rate."""

    def __init__(self, rule: Cut | None) -> None:
        self.rule = rule
        self.ties = rule.ties if rule is not None else 0

    def __call__(self, rate: float | None) -> bool:
        rule = self.rule
        if rule is None:
            return True
        if rate is None or rule.threshold is None or rate > rule.threshold:
            return False
        if rate < rule.threshold:
            return True
        if self.ties:
            self.ties -= 1
            return True
        return False
