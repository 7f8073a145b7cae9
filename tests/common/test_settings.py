"""Run settings: typed names with the same JSON and fingerprint as before, and checks that refuse
what no server accepts before anything is written."""

from __future__ import annotations

import hashlib
import math

import pytest

from genqueue.common.contracts import HistoryReasoning, Mode, Truncation
from genqueue.common.errors import UserError
from genqueue.common.settings import RESERVED_FIELDS, RunSettings, Sampling, check_output

# Settings JSON as genqueue stored it in Redis before the names were enums, with the fingerprints
# that version printed (and that every result of those runs carries).
STORED = [
    ((b'{"expect_reasoning":false,"history_reasoning":"drop","max_prompt_chars":262144,"model":null,'
      b'"multi_turn":"regenerate","output":"./genqueue-out","sampling":{"extra":{},"max_tokens":4096,'
      b'"seed":null,"temperature":0.6,"top_p":0.95},"truncation":"keep"}'), "0caa1847b8503518"),
    ((b'{"expect_reasoning":true,"history_reasoning":"keep","max_prompt_chars":99,"model":"m",'
      b'"multi_turn":"each","output":"s3://b/p","sampling":{"extra":{"top_k":20},"max_tokens":7,"seed":3,'
      b'"temperature":0.0,"top_p":1.0},"truncation":"error"}'), "ca8a27832a748e70"),
]


@pytest.mark.parametrize(("raw", "fingerprint"), STORED)
def test_stored_settings_round_trip_to_the_same_fingerprint(raw: bytes, fingerprint: str) -> None:
    s = RunSettings.from_json(raw)
    assert isinstance(s.multi_turn, Mode) and isinstance(s.truncation, Truncation)
    assert isinstance(s.history_reasoning, HistoryReasoning)
    assert s.to_json() == raw
    assert s.fingerprint == fingerprint == hashlib.blake2b(raw, digest_size=8).hexdigest()


def test_plain_strings_become_the_enums_and_compare_equal() -> None:
    a = RunSettings(multi_turn="each", truncation="retry", history_reasoning="keep")  # type: ignore[arg-type]
    b = RunSettings(multi_turn=Mode.EACH, truncation=Truncation.RETRY, history_reasoning=HistoryReasoning.KEEP)
    assert a == b and a.fingerprint == b.fingerprint and a.multi_turn is Mode.EACH
    assert RunSettings().multi_turn is Mode.REGENERATE
    with pytest.raises(UserError, match="--truncation 'sometimes'"):
        RunSettings(truncation="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize(("sampling", "message"), [
    (Sampling(temperature=-0.1), "temperature"),
    (Sampling(temperature=math.nan), "temperature"),
    (Sampling(top_p=0.0), "top_p"),
    (Sampling(top_p=1.5), "top_p"),
    (Sampling(max_tokens=0), "max_tokens"),
    (Sampling(seed=1.5), "seed"),  # type: ignore[arg-type]
    (Sampling(extra={"temperature": "hot"}), "temperature"),  # --sampling-json overrides the options
    (Sampling(extra={"max_tokens": True}), "max_tokens"),
    (Sampling(extra={"seed": "7"}), "seed"),
    (Sampling(extra={"max_completion_tokens": 0}), "max_completion_tokens"),
])
def test_bad_sampling_values_are_refused(sampling: Sampling, message: str) -> None:
    with pytest.raises(UserError, match=message):
        sampling.check()


@pytest.mark.parametrize("name", sorted(RESERVED_FIELDS))
def test_sampling_json_may_not_override_what_genqueue_sets(name: str) -> None:
    with pytest.raises(UserError, match=f"may not set '{name}'"):
        Sampling(extra={name: 1}).check()


def test_good_sampling_passes_and_unknown_fields_are_named() -> None:
    assert Sampling(temperature=0, top_p=1, max_tokens=1, seed=0).check() == []
    assert Sampling(temperature=None, top_p=None).check() == []
    warnings = Sampling(extra={"top_k": 20, "min_p": 0.0, "topk": 20, "chat_template_kwargs": {}}).check()
    assert len(warnings) == 1 and "'topk'" in warnings[0]


@pytest.mark.parametrize("url", [
    "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/prefix",
    "s3://AKIAEXAMPLE:wJalrXUtnFEMI/K7MDENG/bPx@bucket/prefix",  # AWS secret keys hold "/"
    "s3://AKIAEXAMPLE@bucket/prefix",
    "https://user:pass@host/path",
    "s3://bucket/prefix?X-Amz-Signature=abc123",
])
def test_output_urls_with_credentials_are_refused(url: str) -> None:
    with pytest.raises(UserError) as info:
        RunSettings(output=url)
    text = str(info.value)
    assert "AWS_ACCESS_KEY_ID" in text and "AWS_PROFILE" in text and "~/.aws/credentials" in text
    for secret in ("wJalrXUtnFEMI", "AKIAEXAMPLE", "pass", "abc123"):
        assert secret not in text


def test_output_without_credentials_passes() -> None:
    for url in ("s3://bucket/prefix", "/data/out", "./genqueue-out", "s3://bucket", "s3://bucket/runs@v2"):
        assert check_output(url) == url
