"""The rule that a Redis command's socket timeout fits in one lease renewal, as a check: a
consumer started with a shorter lease says so in one line (consumer/config.py)."""

from __future__ import annotations

import logging

import pytest

from genqueue.common import defaults
from genqueue.consumer.config import ConsumerConfig, lease_too_short


def test_the_default_lease_and_timeout_pass() -> None:
    assert lease_too_short(defaults.LEASE_SECONDS, "redis://127.0.0.1:6379/0") is None


def test_a_lease_shorter_than_the_socket_timeout_allows_is_named() -> None:
    line = lease_too_short(5, "redis://127.0.0.1:6379/0")
    assert line is not None and "--lease 5 s" in line and "15 s" in line and "\n" not in line


def test_the_urls_own_socket_timeout_counts() -> None:
    assert lease_too_short(5, "redis://h:6379/0?socket_timeout=1") is None
    assert lease_too_short(30, "redis://h:6379/0?socket_timeout=20") is not None
    assert lease_too_short(5, "redis://h:6379/0?socket_timeout=nonsense") is not None  # the default then


def test_a_consumer_with_a_short_lease_warns_at_start(caplog: pytest.LogCaptureFixture) -> None:
    from genqueue.consumer.cli import run_cmd

    ctx = run_cmd.make_context("run", ["--endpoint", "http://127.0.0.1:9/v1", "--lease", "4"])
    with caplog.at_level(logging.WARNING, logger="genqueue.consumer.config"):
        ConsumerConfig.from_options(ctx.params)  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records if "--lease 4 s is shorter" in r.getMessage()]
    caplog.clear()
    ctx = run_cmd.make_context("run", ["--endpoint", "http://127.0.0.1:9/v1"])
    with caplog.at_level(logging.WARNING, logger="genqueue.consumer.config"):
        ConsumerConfig.from_options(ctx.params)  # type: ignore[arg-type]
    assert not caplog.records
