"""--drafter as a run setting: a label that leaves the requests and the fingerprint of every run
made without it as they were, and is in the fingerprint when set (consumers re-read settings
only when the fingerprint changes, so a label outside it would not reach their records)."""

from __future__ import annotations

import pytest

from genqueue.common.errors import UserError
from genqueue.common.requests import RequestShape
from genqueue.common.settings import RunSettings, check_update
from tests.common.test_settings_token_ids import BEFORE


def test_unset_it_keeps_the_old_json_and_fingerprint() -> None:
    old = RunSettings.from_json(BEFORE)
    assert old.drafter is None and old.to_json() == BEFORE and old.fingerprint == "0caa1847b8503518"
    assert RunSettings().fingerprint == old.fingerprint


def test_set_it_is_another_fingerprint_and_the_same_requests() -> None:
    cand = RunSettings(drafter="eagle3-r2")
    assert b'"drafter":"eagle3-r2"' in cand.to_json()
    assert cand.fingerprint not in (RunSettings().fingerprint, RunSettings(drafter="eagle3-r1").fingerprint)
    assert RunSettings.from_json(cand.to_json()) == cand and cand.stored_shape_problem() is None
    assert cand.differences(RunSettings()) == ["drafter"]
    assert check_update(RunSettings(drafter="a"), cand) == ["drafter"]  # --update-settings may relabel a run
    assert RequestShape.of(cand, None) == RequestShape.of(RunSettings(), None)  # nothing of it is sent
    assert RunSettings(drafter=7).stored_shape_problem() == "drafter has the wrong type"  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["org/model@rev", "ngram:3", "EAGLE3_r2+mtp", "a"])
def test_names_a_user_writes_are_taken(name: str) -> None:
    assert RunSettings(drafter=name).drafter == name


@pytest.mark.parametrize("name", ["", " eagle", "-x", "a b", "tab\there", "x" * 201])
def test_other_names_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(UserError, match="invalid drafter name"):
        RunSettings(drafter=name)
