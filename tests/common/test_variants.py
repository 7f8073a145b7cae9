"""Request variants: parsing --variant, the deterministic draw per key, and the run settings
that hold them (a run without variants keeps its fingerprint)."""

from __future__ import annotations

import collections
import hashlib
import math
import random
from pathlib import Path

import pytest

from genqueue.common.errors import UserError
from genqueue.common.settings import RunSettings, Sampling, check_variant_params
from genqueue.common.variants import Variant, check_variants, draw, key_fraction, merged, normalised, parse_variant
from tests.conftest import cli, sharegpt, write_jsonl

THINK = '{"chat_template_kwargs":{"enable_thinking":true}}'
NOTHINK = '{"chat_template_kwargs":{"enable_thinking":false}}'


def keys(n: int, seed: int = 0) -> list[str]:
    """N item keys as genqueue makes them (32 hex characters of a hash)."""
    rng = random.Random(seed)
    return [hashlib.blake2b(rng.randbytes(16), digest_size=16).hexdigest() for _ in range(n)]


def test_parse_name_json_and_weight() -> None:
    assert parse_variant(f"think={THINK}:0.7") == Variant("think", {"chat_template_kwargs": {"enable_thinking": True}},
                                                          0.7)
    assert parse_variant('hi={"reasoning_effort":"high"}') == Variant("hi", {"reasoning_effort": "high"}, 1.0)
    # colons inside the JSON are the JSON's; the weight follows its last brace
    assert parse_variant('s={"stop":["a:b"],"x":{"y":1}}:3') == Variant("s", {"stop": ["a:b"], "x": {"y": 1}}, 3.0)


@pytest.mark.parametrize(("text", "message"), [
    ("think", "NAME=JSON"),
    ("think={bad json}:1", "not valid JSON"),
    ("think=[1, 2]", "JSON object"),
    ("think={}:heavy", "weight must be a number"),
    ("think={}x", "unexpected 'x'"),
])
def test_bad_variant_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_variant(text)


@pytest.mark.parametrize(("variants", "message"), [
    ([Variant("a", {}, 1), Variant("a", {}, 2)], "given twice"),
    ([Variant("-a", {}, 1)], "name '-a'"),
    ([Variant("a b", {}, 1)], "name 'a b'"),
    ([Variant("a", {}, 0)], "weight must be a number > 0"),
    ([Variant("a", {}, -1)], "weight must be a number > 0"),
    ([Variant("a", {}, math.inf)], "weight must be a number > 0"),
    ([Variant("a", {}, math.nan)], "weight must be a number > 0"),
])
def test_bad_variants_are_refused(variants: list[Variant], message: str) -> None:
    with pytest.raises(UserError, match=message):
        check_variants(variants)


def test_weights_are_normalised_so_equal_mixes_are_one_recipe() -> None:
    a = normalised([Variant("think", {}, 7), Variant("nothink", {}, 3)])
    b = normalised([Variant("think", {}, 0.7), Variant("nothink", {}, 0.3)])
    assert [v.weight for v in a] == [0.7, 0.3] == [v.weight for v in b]
    assert RunSettings(variants=a).fingerprint == RunSettings(variants=b).fingerprint
    assert RunSettings(variants=a).fingerprint != RunSettings().fingerprint


def test_the_draw_matches_the_weights_on_10k_keys() -> None:
    mix = normalised([Variant("think", {}, 0.7), Variant("nothink", {}, 0.3)])
    counts = collections.Counter(v.name for k in keys(10_000) if (v := draw(k, mix)) is not None)
    assert sum(counts.values()) == 10_000
    # 0.3 of 10k has a standard deviation of 46: 2 points is over 4 of them
    assert abs(counts["think"] / 10_000 - 0.7) < 0.02 and abs(counts["nothink"] / 10_000 - 0.3) < 0.02
    three = normalised([Variant("low", {}, 1), Variant("medium", {}, 1), Variant("high", {}, 2)])
    counts = collections.Counter(v.name for k in keys(10_000, seed=1) if (v := draw(k, three)) is not None)
    assert [round(counts[n] / 10_000, 2) for n in ("low", "medium", "high")] == pytest.approx([0.25, 0.25, 0.5],
                                                                                               abs=0.02)


def test_the_draw_is_a_function_of_the_key_and_the_weights_only() -> None:
    mix = normalised([Variant("think", {"a": 1}, 0.7), Variant("nothink", {"a": 2}, 0.3)])
    ks = keys(2000)
    first = [draw(k, mix) for k in ks]
    assert [draw(k, mix) for k in reversed(ks)] == first[::-1]  # no state between draws
    # other fields in the variants change no one's draw
    edited = (Variant("think", {"b": 3}, 0.7), Variant("nothink", {}, 0.3))
    assert [getattr(draw(k, edited), "name", None) for k in ks] == [getattr(v, "name", None) for v in first]
    assert draw(ks[0], ()) is None
    assert all(0 <= key_fraction(k) < 1 for k in ks)
    # weights as given or as stored (normalised) draw alike
    raw = (Variant("think", {}, 7), Variant("nothink", {}, 3))
    assert [getattr(draw(k, raw), "name", None) for k in ks] == [getattr(v, "name", None) for v in first]


def test_merged_keeps_the_object_keys_the_variant_does_not_set() -> None:
    base = {"temperature": 0.6, "chat_template_kwargs": {"enable_thinking": True, "custom": 1}}
    assert merged(base, {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.7}) == {
        "temperature": 0.7, "chat_template_kwargs": {"enable_thinking": False, "custom": 1}}
    assert base["chat_template_kwargs"] == {"enable_thinking": True, "custom": 1}  # not changed in place


def test_settings_with_variants_round_trip_and_draw() -> None:
    mix = normalised([parse_variant(f"think={THINK}:0.7"), parse_variant(f"nothink={NOTHINK}:0.3")])
    s = RunSettings(sampling=Sampling(extra={"top_k": 20}), variants=mix)
    back = RunSettings.from_json(s.to_json())
    assert back == s and back.fingerprint == s.fingerprint and back.stored_shape_problem() is None
    assert RunSettings().differences(s) == ["sampling.extra", "variants"]
    key = keys(1)[0]
    v = s.variant_of(key)
    assert v is not None and v == draw(key, mix)
    assert s.request_params(v) == {**s.request_params(), "chat_template_kwargs": v.params["chat_template_kwargs"]}
    assert "variants" not in RunSettings().to_dict()  # absent, as it was before variants existed


@pytest.mark.parametrize("raw", [
    b'{"variants": "think"}',
    b'{"variants": [{"name": "a", "params": [], "weight": 1}]}',
    b'{"variants": [{"name": "a", "params": {}, "weight": "1"}]}',
    b'{"variants": [{"name": "a", "params": {}}]}',
])
def test_stored_variants_of_the_wrong_shape_are_named(raw: bytes) -> None:
    assert RunSettings.from_json(raw).stored_shape_problem() == "variants has the wrong type"


def test_variant_fields_are_checked_like_sampling_json() -> None:
    sampling = Sampling()
    with pytest.raises(UserError, match="--variant v may not set 'model'"):
        check_variant_params(sampling, (Variant("v", {"model": "m"}),))
    with pytest.raises(UserError, match="--variant hot: temperature must be a number >= 0"):
        check_variant_params(sampling, (Variant("hot", {"temperature": -1}),))
    assert check_variant_params(sampling, (Variant("v", {"reasoning_effort": "low", "made_up": 1}),)) == [
        "--variant v: unknown request field 'made_up', sent as given (the server may refuse it)"]


@pytest.mark.parametrize(("args", "message"), [
    (["--variant", "think"], "NAME=JSON"),
    (["--variant", "think={oops}"], "not valid JSON"),
    (["--variant", f"think={THINK}:0", "--variant", f"nothink={NOTHINK}"], "weight must be a number > 0"),
    (["--variant", f"a={THINK}", "--variant", f"a={NOTHINK}"], "given twice"),
    (["--variant", 'a={"stream":true}'], "may not set 'stream'"),
])
def test_the_cli_refuses_a_bad_variant_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(1)])
    proc = cli("producer", "enqueue", str(data), "--dry-run", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
