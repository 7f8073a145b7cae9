"""producer/export/selection.py: weights and the lowest-acceptance share, pure."""

from __future__ import annotations

import math
import random

import pytest

from genqueue.common.errors import UserError
from genqueue.producer.export.selection import EPS, Keeper, cut, keep_lowest, weight, weight_scale, weights


def test_weights_are_higher_where_acceptance_is_lower_and_average_one() -> None:
    w = weights([0.2, 0.8, None, 0.5])
    assert w[2] == 1.0
    assert w[0] > w[3] > w[1] > 0
    assert (w[0] + w[1] + w[3]) / 3 == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx((0.8 + EPS) / (0.2 + EPS))


def test_weights_without_figures_are_all_one() -> None:
    assert weights([None, None]) == [1.0, 1.0]


def test_keep_lowest_keeps_the_share_in_row_order_and_drops_rows_without_figures() -> None:
    s = keep_lowest([0.9, None, 0.1, 0.5, 0.3], 0.5)
    assert s.kept == (2, 4)
    assert (s.with_figures, s.lowest, s.highest) == (4, 0.1, 0.3)
    assert keep_lowest([0.9, 0.1, 0.5], 1).kept == (0, 1, 2)
    assert keep_lowest([None], 0.5).to_dict() == {"selected": 0, "with_figures": 0, "rate_min": None,
                                                  "rate_max": None}


@pytest.mark.parametrize("share", [0, -0.1, 1.5])
def test_a_share_outside_zero_one_is_refused(share: float) -> None:
    with pytest.raises(UserError):
        keep_lowest([0.5], share)


def _reference(rates: list[float | None], share: float) -> tuple[int, ...]:
    """keep_lowest as first written: sort (rate, row) pairs, take the first ceil(share x n)."""
    scored = sorted((r, i) for i, r in enumerate(rates) if r is not None)
    return tuple(sorted(i for _, i in scored[:math.ceil(share * len(scored))]))


@pytest.mark.parametrize("seed", range(20))
def test_the_streamed_cut_keeps_exactly_the_rows_a_sort_keeps_ties_in_row_order(seed: int) -> None:
    rnd = random.Random(seed)
    rates = [None if rnd.random() < 0.2 else rnd.choice([0.1, 0.25, 0.5, 0.5, 0.75, rnd.random()])
             for _ in range(rnd.randint(0, 60))]
    share = rnd.choice([0.05, 0.3, 0.5, 0.99, 1.0])
    rule = cut(rates, share)
    keep = Keeper(rule)
    streamed = tuple(i for i, r in enumerate(rates) if keep(r))
    assert streamed == _reference(rates, share) == keep_lowest(rates, share).kept
    assert rule.kept == len(streamed) and rule.with_figures == sum(r is not None for r in rates)
    assert Keeper(None)(None) and Keeper(None)(0.9)


def test_weight_scale_and_weight_are_the_weights_one_at_a_time() -> None:
    rates = [0.2, None, 0.9]
    scale = weight_scale(rates)
    assert [weight(r, scale) for r in rates] == weights(rates)
    assert weight_scale([None]) == 1.0
