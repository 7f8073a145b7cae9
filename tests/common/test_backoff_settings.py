import random

import pytest

from genqueue.common import backoff
from genqueue.common.backoff import compute_backoff, store_backoff
from genqueue.common.errors import UserError
from genqueue.common.keepers.redisconn import redact_url
from genqueue.common.settings import RunSettings, Sampling, check_run_name, run_name_from_path


def test_backoff_bounded_and_growing() -> None:
    rng = random.Random(1)
    for attempt in range(10):
        assert 0 <= compute_backoff(attempt, base=0.5, cap=8, rng=rng) <= min(8, 0.5 * 2**attempt)
    with pytest.raises(ValueError):
        compute_backoff(-1)


def test_the_store_backoff_doubles_from_its_base_to_its_cap() -> None:
    """Shipping and the intake's pack outage wait alike: after N failures in a row, at most
    base * 2**(N-1), never above the cap, which the doublings reach."""
    rng = random.Random(2)
    base, cap = backoff.STORE_BACKOFF_BASE, backoff.STORE_BACKOFF_CAP
    for n in range(1, 12):
        waits = [store_backoff(n, rng=rng) for _ in range(200)]
        ceiling = min(cap, base * 2 ** min(n - 1, backoff.STORE_BACKOFF_DOUBLINGS))
        assert 0 <= min(waits) and max(waits) <= ceiling and max(waits) > ceiling / 2
    assert base * 2 ** backoff.STORE_BACKOFF_DOUBLINGS >= cap


def test_fingerprint_changes_with_recipe_only() -> None:
    a = RunSettings()
    assert a.fingerprint == RunSettings().fingerprint
    b = RunSettings(sampling=Sampling(temperature=0.1))
    assert a.fingerprint != b.fingerprint
    assert b.differences(a) == ["sampling.temperature"]
    assert RunSettings.from_json(b.to_json()) == b


def test_bad_settings_are_user_errors() -> None:
    with pytest.raises(UserError):
        RunSettings(multi_turn="sideways")  # type: ignore[arg-type]
    with pytest.raises(UserError):
        check_run_name("../etc")


def test_run_names() -> None:
    assert run_name_from_path("/data/sharegpt_v3.json.gz") == "sharegpt_v3"
    assert run_name_from_path("data.jsonl") == "data"
    assert run_name_from_path("-") == "stdin"


def test_redact() -> None:
    assert redact_url("redis://:hunter2@h:6379/0") == "redis://***@h:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://***@h/1"
    assert redact_url("redis://h:6379") == "redis://h:6379"
