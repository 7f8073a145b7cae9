"""--capture as a run setting: absent from the stored settings of a run without it (its
fingerprint is the one it had), a recipe of its own when set, refused where no engine can make
it, fixed for the run's life, and asked for only by the answers' requests."""

from __future__ import annotations

import pytest

from genqueue.common.capture import CaptureDtype, CaptureKind, CaptureSettings, parse_capture
from genqueue.common.errors import UserError
from genqueue.common.requests import CAPTURE_FIELDS, RequestShape
from genqueue.common.settings import RunSettings, check_update
from genqueue.producer.rungone import settings_flags

CAPTURE = CaptureSettings(CaptureKind.HIDDEN_STATES, (16, 2, 29), CaptureDtype.BF16)


def test_unset_it_keeps_the_fingerprint_set_it_is_another_recipe_that_round_trips() -> None:
    assert RunSettings().fingerprint == "0caa1847b8503518"
    on = RunSettings(token_ids=True, capture=CAPTURE)
    assert on.capture is not None and on.capture.layers == (2, 16, 29), "kept sorted, as vLLM stores them"
    assert b'"capture":{"dtype":"bf16","layers":[2,16,29],"what":"hidden-states"}' in on.to_json()
    back = RunSettings.from_json(on.to_json())
    assert back == on and back.fingerprint == on.fingerprint != RunSettings(token_ids=True).fingerprint
    assert back.stored_shape_problem() is None
    assert RunSettings(token_ids=True, capture="x").stored_shape_problem() == "capture has the wrong type"  # type: ignore[arg-type]


def test_it_needs_token_ids_excludes_a_drafter_and_cannot_change_on_a_live_run() -> None:
    with pytest.raises(UserError, match="--capture needs --token-ids"):
        RunSettings(capture=CAPTURE)
    with pytest.raises(UserError, match="--capture cannot go with --drafter"):
        RunSettings(token_ids=True, capture=CAPTURE, drafter="eagle3")
    with pytest.raises(UserError, match="--update-settings cannot change capture"):
        check_update(RunSettings(token_ids=True), RunSettings(token_ids=True, capture=CAPTURE))
    other = CaptureSettings(CaptureKind.HIDDEN_STATES, (2, 16, 29), CaptureDtype.FP8)
    with pytest.raises(UserError, match="--update-settings cannot change capture"):
        check_update(RunSettings(token_ids=True, capture=CAPTURE), RunSettings(token_ids=True, capture=other))


def test_the_options_parse_to_one_capture() -> None:
    assert parse_capture(None, None, None) is None
    assert parse_capture("hidden-states", "4, 2,4", None) == CaptureSettings(CaptureKind.HIDDEN_STATES, (2, 4))
    with pytest.raises(UserError, match="--capture-dtype needs --capture"):
        parse_capture(None, None, "bf16")
    with pytest.raises(UserError, match="unknown --capture-dtype 'fp16'"):
        parse_capture("hidden-states", "2", "fp16")


def test_only_an_answer_asks_for_its_hidden_states_and_the_run_can_be_made_again() -> None:
    on = RunSettings(token_ids=True, capture=CAPTURE)
    shape = RequestShape.of(on)
    assert "kv_transfer_params" not in shape.fields(), "what a Batch line is checked against is unchanged"
    assert "kv_transfer_params" not in shape.body("m", []), "the pre-flight's probe asks for none"
    assert shape.body("m", [], capture=True)["kv_transfer_params"] == CAPTURE_FIELDS["kv_transfer_params"]
    assert "kv_transfer_params" not in RequestShape.of(RunSettings()).body("m", [], capture=True)
    flags = settings_flags(on)
    assert flags[flags.index("--capture"):flags.index("--capture") + 6] == [
        "--capture", "hidden-states", "--capture-layers", "2,16,29", "--capture-dtype", "bf16"]
