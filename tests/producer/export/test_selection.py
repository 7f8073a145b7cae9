"""producer/export/selection.py: weights and the lowest-acceptance share, pure."""

from __future__ import annotations

import pytest

from genqueue.common.errors import UserError
from genqueue.producer.export.selection import EPS, keep_lowest, weights


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
