"""The options `consumer run` and `consumer launch` share come from one declaration
(common/cli.py's CONSUMER_OPTIONS): both commands carry them as declared, and launch forwards
them to its consumers from that declaration, so a new shared option is written once."""

from __future__ import annotations

import click
import pytest

from genqueue.common.cli import CONSUMER_OPTIONS, ConsumerArgs, consumer_defaults, consumer_run_args, pick_consumer_args
from genqueue.consumer.cli import main as consumer_main
from genqueue.consumer.launch.plan import LaunchConfig
from tests.common.test_defaults_once import command, keys, parse


def shape(p: click.Parameter) -> tuple[object, ...]:
    assert isinstance(p, click.Option)
    return (p.name, tuple(p.opts), p.default, repr(p.type), p.help, p.is_flag, p.show_default, p.envvar)


@pytest.mark.parametrize("name", ["run", "launch"])
def test_each_command_carries_the_shared_options_as_declared(name: str) -> None:
    params = {p.name: p for p in command(consumer_main, name).params}
    declared = {p.name: p for p in CONSUMER_OPTIONS}
    assert set(declared) == keys(ConsumerArgs) == {"run_name", "concurrency", "lease", "drain_timeout", "burst"}
    for key, option in declared.items():
        assert shape(params[key]) == shape(option), key


def test_a_consumer_started_by_launch_gets_the_shared_options_launch_was_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    given = ["--run", "data", "-c", "auto", "--lease", "9", "--drain-timeout", "4.5", "--burst"]
    launch = parse(command(consumer_main, "launch"), ["--gpus", "0", "--engine", "simulate", *given], monkeypatch)
    cfg = LaunchConfig.from_options(launch, engine_cmd=lambda _: [])  # type: ignore[arg-type]
    forwarded = consumer_run_args(cfg.consumer)
    run = parse(command(consumer_main, "run"), forwarded, monkeypatch)
    assert pick_consumer_args(run) == cfg.consumer == ConsumerArgs(run_name="data", concurrency="auto", lease=9,
                                                               drain_timeout=4.5, burst=True)
    assert cfg.drain_timeout == 4.5


def test_shared_options_at_their_defaults_are_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    run = parse(command(consumer_main, "run"), [], monkeypatch)
    assert pick_consumer_args(run) == consumer_defaults()
    assert consumer_run_args(consumer_defaults()) == []
    assert LaunchConfig(gpus=[0]).consumer == consumer_defaults()
