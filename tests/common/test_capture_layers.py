"""`--capture-layers` read as ids, presets and drafter configs (common/capture_layers.py): the
layers a drafter's trainer needs, numbered as vLLM's extract_hidden_states captures them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genqueue.common.capture import parse_capture
from genqueue.common.capture_layers import dflash_target_layers, resolve_layers
from genqueue.common.errors import UserError


@pytest.mark.parametrize(("spec", "ids"), [
    ("2,16,29", (2, 16, 29)),
    (" 29, 2 ,2,16 ", (2, 16, 29)),
    ("eagle3:32", (2, 16, 29, 32)),  # speculators' launch_vllm default for a 32-layer target
    ("eagle3:64", (2, 32, 61, 64)),
    ("eagle3:36,0", (0, 2, 18, 33, 36)),
    # z-lab's build_target_layer_ids(36, 5) = [1, 9, 17, 25, 33] (DeepSpec's Qwen3-4B config), +1 for vLLM
    ("dflash:36:5", (2, 10, 18, 26, 34)),
    ("dflash:32:1", (17,)),
])
def test_specs(spec: str, ids: tuple[int, ...]) -> None:
    assert resolve_layers(spec) == ids


def test_dflash_matches_its_reference_spacing() -> None:
    # build_target_layer_ids(28, 3): start 1, end 25, span 24: [1, 13, 25]
    assert dflash_target_layers(28, 3) == [1, 13, 25]
    assert dflash_target_layers(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize(("config", "ids"), [
    ({"eagle_aux_hidden_state_layer_ids": [1, 17, 29]}, (1, 17, 29)),
    ({"dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}, (2, 10, 18, 26, 34)),
    ({"dspark_target_layer_ids": [3, 7]}, (4, 8)),
    ({"dspark_target_layer_ids": [3, 7], "model_type": "deepseek_v41"}, (3, 7)),
    ({"target_layer_ids": [0, 5]}, (1, 6)),
    ({"eagle_config": {"layer_ids": [4, 8]}}, (4, 8)),
    # the first key vLLM reads wins, as in get_eagle3_aux_layers_from_config
    ({"eagle_aux_hidden_state_layer_ids": [2], "dflash_config": {"target_layer_ids": [9]}}, (2,)),
])
def test_drafter_configs(tmp_path: Path, config: dict[str, object], ids: tuple[int, ...]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_layers(str(tmp_path)) == ids  # the folder
    assert resolve_layers(str(tmp_path / "config.json")) == ids  # the file
    assert resolve_layers(f"{tmp_path / 'config.json'},40") == tuple(sorted({*ids, 40}))  # and the last layer


@pytest.mark.parametrize(("spec", "says"), [
    ("2,x", "'x' in '2,x' is not a layer id, eagle3:L, dflash:L:N"),
    ("eagle3", "'eagle3' is not eagle3:L"),
    ("eagle3:0", "is not eagle3:L"),
    ("eagle3:3", "a target of 4 layers or more"),
    ("dflash:32", "is not dflash:L:N"),
    ("dflash:4:3", "L of 5 or more"),
    (",", "names no layer"),
    ("/nowhere/config.json", "no drafter config there"),
])
def test_mistakes_are_one_line(spec: str, says: str) -> None:
    with pytest.raises(UserError) as e:
        resolve_layers(spec)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_config_without_layers_or_garbled(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UserError, match="names no layers"):
        resolve_layers(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(UserError, match="not a readable JSON config"):
        resolve_layers(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": ["2"]}))
    with pytest.raises(UserError, match="not a list of integers"):
        resolve_layers(str(tmp_path))


def test_parse_capture_takes_a_spec_and_still_refuses_negative_ids() -> None:
    settings = parse_capture("hidden-states", "eagle3:32", None)
    assert settings is not None and settings.layers == (2, 16, 29, 32)
    with pytest.raises(UserError, match="negative"):
        parse_capture("hidden-states", "-1,2", None)
