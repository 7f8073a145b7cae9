"""Every default lives once, in common/defaults.py, and each command builds one settings object.

Two halves. The source half reads the code (ast) and fails when a literal default comes back:
in a click option of `producer`, `consumer run` or `consumer launch`, or anywhere in
producer/, consumer/, common/ as a function's keyword default or a dataclass field's default
whose value is a defaults.py constant's. The command half parses real command lines with the
real click commands and builds each command's settings object from what click parsed: given
no options, each is the object its dataclass's own defaults make, so the option defaults and
the field defaults cannot drift apart.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import click
import pytest

from genqueue.common import defaults
from genqueue.common.errors import UserError
from genqueue.common.settings import SETTING_NAMES, RunSettings, Sampling, parse_concurrency
from genqueue.consumer.cli import main as consumer_main
from genqueue.consumer.config import ConsumerConfig, RunOptions
from genqueue.consumer.launch.plan import LaunchConfig, LaunchOptions
from genqueue.consumer.work import leases
from genqueue.producer.cli import SETTING_OPTIONS, EnqueueArgs, enqueue_options, run_settings, settings_given
from genqueue.producer.cli import main as producer_main
from genqueue.producer.enqueue.core import EnqueueOptions
from genqueue.producer.export.command import ExportArgs
from genqueue.producer.ingest.items import Origin

ROOT = Path(__file__).resolve().parents[2]
#: the modules that declare the click options of `producer` and of `consumer run` / `consumer launch`
COMMAND_MODULES = ("producer/cli.py", "consumer/cli.py", "consumer/launch/command.py")
#: option defaults that are no value of their own: unset, off, empty
NO_VALUE = (None, False, "")
#: values too common to mean a defaults.py constant when they are a default (a count, a flag),
#: unless the default's name is the constant's
TRIVIAL = {0, 1, -1, "", None}
#: defaults that equal a defaults.py constant by chance, each with its own meaning (name=value)
COINCIDENCES = {
    "window=60.0": "a rate or restart window (common/eta.py, consumer/guards/supervise.py), not a drain timeout",
    "window=10.0": "how long a repeated log line is folded (consumer/answer/client.py)",
    "connect_timeout=10.0": "a TCP connect to the engine, not a shard's age or a stop grace",
    "timeout=5.0": "one GET of the engine's /health or /v1/models, not a Redis timeout",
    "chunk=4096": "items per slice of the longest-first order, not a token count",
}


def constants() -> dict[str, object]:
    """defaults.py's constants by name, enums as their values (what a click option holds)."""
    return {name: getattr(value, "value", value) for name, value in vars(defaults).items()
            if name.isupper() and not name.startswith("_")}


def literal(node: ast.expr | None) -> tuple[bool, object]:
    """(True, value) when NODE is a literal: a constant, arithmetic on constants, Path("...")."""
    if node is None:
        return False, None
    if isinstance(node, ast.Constant):
        return True, node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path" \
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
        return True, str(node.args[0].value)
    if isinstance(node, ast.BinOp | ast.UnaryOp) and all(
            isinstance(n, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop)
            for n in ast.walk(node)):
        return True, eval(compile(ast.Expression(node), "<default>", "eval"))  # constants only
    return False, None


def is_click_option(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr == "option" and isinstance(f.value, ast.Name) \
        and f.value.id == "click"


def literal_option_defaults(source: str) -> list[str]:
    """`--name = value` for every click option in SOURCE whose default is a literal value."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and is_click_option(node):
            for kw in node.keywords:
                is_lit, value = literal(kw.value) if kw.arg == "default" else (False, None)
                if is_lit and value not in NO_VALUE:
                    name = next((a.value for a in node.args if isinstance(a, ast.Constant)), "?")
                    found.append(f"{name} = {value!r}")
    return found


def literal_defaults(source: str) -> list[tuple[int, str, str, object]]:
    """(line, where, name, value) for each keyword default of a function and each field default
    of a class body in SOURCE that is a literal."""
    found: list[tuple[int, str, str, object]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
                     *((arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None)]
            for arg, default in pairs:
                is_lit, value = literal(default)
                if is_lit:
                    found.append((default.lineno, f"{node.name}({arg.arg}=)", arg.arg, value))
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    is_lit, value = literal(stmt.value)
                    if is_lit:
                        found.append((stmt.lineno, f"{node.name}.{stmt.target.id}", stmt.target.id, value))
    return found


def scanned_modules() -> list[Path]:
    """producer/, consumer/ and common/ but defaults.py itself and the stand-in vLLM (consumer/sim:
    its defaults are vLLM's own, such as port 8000 and 256 slots, and it may import nothing)."""
    return sorted(p for pkg in ("producer", "consumer", "common") for p in (ROOT / pkg).rglob("*.py")
                  if p != ROOT / "common" / "defaults.py" and "sim" not in p.relative_to(ROOT).parts)


def same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


# --- the source half ----------------------------------------------------------------------

@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_no_click_option_of_the_commands_has_a_literal_default(module: str) -> None:
    found = literal_option_defaults((ROOT / module).read_text())
    assert not found, f"{module}: options whose default is written out instead of a defaults.py constant: {found}"


def repeats(name: str, value: object, constant: str, constant_value: object) -> bool:
    """Whether a default NAME = VALUE repeats defaults.CONSTANT: the same value, and one that is
    not trivial or whose name is the constant's, and not a known coincidence."""
    if not same(value, constant_value) or f"{name}={value!r}" in COINCIDENCES:
        return False
    trivial = isinstance(value, bool) or value in TRIVIAL
    return not trivial or name == constant.lower()


def test_no_default_repeats_a_defaults_constant() -> None:
    found = [f"{path.relative_to(ROOT)}:{line} {where} = {value!r} (defaults.{constant})"
             for path in scanned_modules() for line, where, name, value in literal_defaults(path.read_text())
             for constant, v in constants().items() if repeats(name, value, constant, v)]
    assert not found, "literal defaults that repeat a defaults.py constant:\n" + "\n".join(found)


def test_the_source_checks_find_what_they_look_for() -> None:
    """The scanners see a literal default in every shape this tree has written one."""
    src = ('@click.option("--request-timeout", type=float, default=1800.0)\n'
           '@click.option("--log-dir", default=Path("./genqueue-logs"))\n'
           '@click.option("--lease", default=defaults.LEASE_SECONDS)\n'
           '@click.option("--run", default=None)\n'
           'def f(x: int, *, max_record_bytes: int = 64 * 1024 * 1024, t: float = defaults.DRAIN_TIMEOUT): ...\n'
           'class C:\n    spool: str = "./genqueue-spool"\n    n: int = defaults.BATCH_SIZE\n')
    assert literal_option_defaults(src) == ["--request-timeout = 1800.0", "--log-dir = './genqueue-logs'"]
    assert [(w, v) for _, w, _, v in literal_defaults(src)] == [("f(max_record_bytes=)", 64 * 1024 * 1024),
                                                               ("C.spool", "./genqueue-spool")]
    assert repeats("max_record_bytes", 64 * 1024 * 1024, "MAX_RECORD_BYTES", defaults.MAX_RECORD_BYTES)
    assert repeats("samples", 1, "SAMPLES", defaults.SAMPLES)  # trivial, but named as the constant
    assert not repeats("n", 1, "SAMPLES", defaults.SAMPLES)
    assert not repeats("request_timeout", 1800, "REQUEST_TIMEOUT", defaults.REQUEST_TIMEOUT)  # an int: not 1800.0
    assert not repeats("connect_timeout", 10.0, "SHARD_MAX_AGE", defaults.SHARD_MAX_AGE)  # a known coincidence
    assert any(p.name == "worker.py" for p in scanned_modules())


# --- the command half ---------------------------------------------------------------------

def command(group: click.Group, name: str) -> click.Command:
    return group.commands[name]


def parse(cmd: click.Command, args: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What click hands CMD's function for ARGS, with none of its options' variables set."""
    for param in cmd.params:
        for var in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or []):
            monkeypatch.delenv(var, raising=False)
    # under its group's context, as the CLI makes it: click caches a command's help option from
    # the first context that asks, and docs/cli.md must see the `-h` the group gives
    group = next(g for g in (producer_main, consumer_main) if cmd in g.commands.values())
    parent = click.Context(group, info_name=group.name, **group.context_settings)
    with cmd.make_context(cmd.name or "cmd", args, parent=parent) as ctx:
        return dict(ctx.params)


def keys(typed: type) -> set[str]:
    return set(typed.__annotations__)


@pytest.mark.parametrize(("group", "name", "typed", "own"), [
    (producer_main, "enqueue", EnqueueArgs, {"path", "as_json", "redis_url"}),
    (consumer_main, "run", RunOptions, {"verbose", "quiet"}),
    (consumer_main, "launch", LaunchOptions, {"verbose"}),
    (producer_main, "export", ExportArgs, {"as_json", "redis_url"}),
], ids=["producer enqueue", "consumer run", "consumer launch", "producer export"])
def test_every_option_reaches_the_settings_builder(group: click.Group, name: str, typed: type,
                                                   own: set[str]) -> None:
    """The typed options of each command name every option it has, and only those: an option
    added to the command but not to them would reach no setting."""
    params = {p.name for p in command(group, name).params}
    assert keys(typed) == params - own


def test_consumer_run_builds_its_config_with_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    opts: RunOptions = parse(command(consumer_main, "run"), ["--gpu", "3"], monkeypatch)
    cfg = ConsumerConfig.from_options(opts)
    assert cfg == ConsumerConfig(endpoint=f"http://127.0.0.1:{defaults.ENGINE_PORT + 3}/v1",
                                 redis_url=defaults.REDIS_URL, gpu=3, auto_concurrency=True,
                                 spool=f"{defaults.SPOOL_ROOT}/gpu3")
    assert (cfg.request_timeout, cfg.max_attempts, cfg.endpoint_wait) == (1800.0, 6, 1800.0)  # as they were


def test_consumer_run_builds_its_config_from_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--endpoint", "http://h:9000/v1", "--run", "data", "-c", "64", "--max-concurrency", "99", "--burst",
            "--spool", "sp", "--shared-fs", "--lease", "7", "--drain-timeout", "3", "--request-timeout", "40",
            "--max-attempts", "2", "--shard-max-bytes", "1000", "--shard-max-age", "4", "--spool-limit", "5000",
            "--endpoint-wait", "9", "--metrics-port", "9100", "--engine-gpus", "4", "-u", "redis://r:1/2"]
    opts: RunOptions = parse(command(consumer_main, "run"), args, monkeypatch)
    assert ConsumerConfig.from_options(opts) == ConsumerConfig(
        endpoint="http://h:9000/v1", redis_url="redis://r:1/2", run="data", concurrency=64, auto_concurrency=False,
        max_concurrency=99, burst=True, spool="sp", lease=7, drain_timeout=3.0, request_timeout=40.0,
        max_attempts=2, shard_max_bytes=1000, shard_max_age=4.0, spool_limit=5000, metrics_port=9100,
        endpoint_wait=9.0, shared_fs=True, gpus=4)
    endpoint_only: RunOptions = parse(command(consumer_main, "run"), ["--endpoint", "http://h:9000/v1"],
                                      monkeypatch)
    assert ConsumerConfig.from_options(endpoint_only).spool == f"{defaults.SPOOL_ROOT}/9000"


@pytest.mark.parametrize(("args", "message"), [
    ([], "give --endpoint URL or --gpu N"),
    (["--endpoint", "ftp://h/v1"], "--endpoint must be an http(s) URL"),
    (["--gpu", "0", "--run", "no/slash"], "invalid run name"),
    (["--gpu", "0", "-c", "many"], "--concurrency takes a number or auto, not 'many'"),
    (["--gpu", "0", "-c", "0"], "--concurrency takes a number or auto, not '0': it must be at least 1"),
])
def test_consumer_run_refuses_a_mistake_while_building(args: list[str], message: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    opts: RunOptions = parse(command(consumer_main, "run"), args, monkeypatch)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConsumerConfig.from_options(opts)


def no_engine(vllm_cmd: str | None) -> list[str]:
    raise AssertionError("--engine simulate needs no engine command")


def test_consumer_launch_builds_its_config_with_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    opts: LaunchOptions = parse(command(consumer_main, "launch"), ["--gpus", "0-1", "--engine", "simulate"],
                                monkeypatch)
    cfg = LaunchConfig.from_options(opts, engine_cmd=no_engine)
    assert cfg == LaunchConfig(gpus=[0, 1], engine="simulate", redis_url=defaults.REDIS_URL)
    assert (cfg.base_port, cfg.log_dir, cfg.spool_root) == (8000, Path("genqueue-logs"), Path("genqueue-spool"))


def test_consumer_launch_resolves_the_engine_command_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str | None] = []

    def engine_cmd(vllm_cmd: str | None) -> list[str]:
        asked.append(vllm_cmd)
        return ["/opt/v/bin/vllm", "serve"]

    opts: LaunchOptions = parse(command(consumer_main, "launch"),
                                ["--gpus", "0-3", "--gpus-per-engine", "2", "--model", "/m", "-c", "auto",
                                 "--", "--seed", "1"], monkeypatch)
    cfg = LaunchConfig.from_options(opts, engine_cmd=engine_cmd)
    assert asked == [None]
    assert (cfg.vllm_cmd, cfg.gpus_per_engine, cfg.consumer["concurrency"], cfg.engine_args) == \
        ("/opt/v/bin/vllm serve", 2, "auto", ["--seed", "1"])


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0"], "--model is required with --engine vllm"),
    (["--gpus", "0-2", "--engine", "simulate", "--gpus-per-engine", "2"], "--gpus: 3 GPU"),
    (["--gpus", "0", "--engine", "simulate", "-c", "many"], "--concurrency takes a number or auto, not 'many'"),
    (["--gpus", "0", "--engine", "simulate", "-c", "0"], "--concurrency takes a number or auto, not '0': it must"),
    (["--gpus", "0", "--engine", "simulate", "--", "-tp", "2"], "engine argument -tp is launch's to set"),
])
def test_consumer_launch_refuses_a_mistake_while_building(args: list[str], message: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    opts: LaunchOptions = parse(command(consumer_main, "launch"), args, monkeypatch)
    with pytest.raises(UserError, match=message):
        LaunchConfig.from_options(opts, engine_cmd=no_engine)


@pytest.mark.parametrize("text", ["auto", " AUTO ", "64", "1"])
def test_consumer_run_and_launch_take_the_same_concurrency(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One parser for --concurrency: what launch accepts and hands its consumers, run accepts."""
    launched: LaunchOptions = parse(command(consumer_main, "launch"), ["--gpus", "0", "--engine", "simulate",
                                                                       "-c", text], monkeypatch)
    passed = LaunchConfig.from_options(launched, engine_cmd=no_engine).consumer["concurrency"]
    assert passed is not None
    run: RunOptions = parse(command(consumer_main, "run"), ["--gpu", "0", "-c", passed],
                            monkeypatch)
    cfg = ConsumerConfig.from_options(run)
    fixed = parse_concurrency(text)
    expected = (True, defaults.CONCURRENCY) if fixed is None else (False, fixed)
    assert (cfg.auto_concurrency, cfg.concurrency) == expected


def test_producer_enqueue_builds_the_run_settings_and_options_with_the_dataclass_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    opts: EnqueueArgs = parse(command(producer_main, "enqueue"), ["data.jsonl"], monkeypatch)
    assert run_settings(opts) == (RunSettings(output=os.path.abspath(defaults.OUTPUT)), [])
    assert enqueue_options(opts, "data") == EnqueueOptions(rejects_path="data.rejects.jsonl", origin=Origin())
    dry: EnqueueArgs = parse(command(producer_main, "enqueue"), ["data.jsonl", "--dry-run"],
                             monkeypatch)
    assert enqueue_options(dry, "data").rejects_path is None


def test_producer_enqueue_builds_from_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["data.jsonl", "--multi-turn", "last", "--batch-size", "5", "--model", "m", "--temperature", "0",
            "--top-p", "0.5", "--max-tokens", "9", "--seed", "3", "--sampling-json", '{"top_k": 2, "zz": 1}',
            "--max-prompt-chars", "10", "--max-record-bytes", "11", "--history-reasoning", "keep",
            "--truncation", "error", "--expect-reasoning", "--output", "s3://b/p", "--shared-fs",
            "--rejects", "r.jsonl", "--id-field", "key", "--samples", "2", "--longest-first", "--tmp-dir", "t",
            "--retry-failed", "--update-settings", "--priority", "-4", "--no-output-check"]
    opts: EnqueueArgs = parse(command(producer_main, "enqueue"), args, monkeypatch)
    settings, warnings = run_settings(opts)
    assert settings == RunSettings(model="m", multi_turn="last", output="s3://b/p", max_prompt_chars=10,
                                   history_reasoning="keep", truncation="error", expect_reasoning=True,
                                   sampling=Sampling(temperature=0.0, top_p=0.5, max_tokens=9, seed=3,
                                                     extra={"top_k": 2, "zz": 1}))
    assert len(warnings) == 1 and "'zz'" in warnings[0]
    assert enqueue_options(opts, "data") == EnqueueOptions(
        batch_size=5, rejects_path="r.jsonl", max_record_bytes=11, longest_first=True, tmp_dir="t",
        origin=Origin(id_field="key", samples=2), retry_failed=True, update_settings=True, shared_fs=True,
        priority=-4, output_check=False)


def test_an_option_of_both_consumer_run_and_consumer_launch_is_declared_once() -> None:
    """What launch passes to every consumer it starts is one declaration (common/cli.py's
    consumer_options), so the two cannot drift apart in type, default or meaning."""
    def declared(rel: str) -> set[str]:
        return set(re.findall(r'click\.option\(\s*"(--[a-z-]+)"', (ROOT / rel).read_text()))
    run, launch = command(consumer_main, "run"), command(consumer_main, "launch")
    both = {o for p in run.params for o in p.opts} & {o for p in launch.params for o in p.opts}
    shared = declared("common/cli.py")
    assert {"--run", "--concurrency", "--lease", "--drain-timeout", "--burst"} <= shared
    assert both - {"--redis-url", "-u", "-v", "--verbose", "-c"} == shared - {"--redis-url"}
    assert not declared("consumer/cli.py") & declared("consumer/launch/command.py")
    for name in shared - {"--redis-url"}:
        a = next(p for p in run.params if name in p.opts)
        b = next(p for p in launch.params if name in p.opts)
        assert (repr(a.type), a.default, a.help) == (repr(b.type), b.default, b.help), name


def test_producer_enqueue_names_the_settings_its_command_line_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing run keeps its own value of each setting the command line leaves out
    (runsetup.prepare): every setting has its option, and a value given is given even at the
    option's default."""
    cmd = command(producer_main, "enqueue")
    assert set(SETTING_OPTIONS.values()) == SETTING_NAMES
    assert set(SETTING_OPTIONS) <= {p.name for p in cmd.params}
    parse(cmd, ["data.jsonl"], monkeypatch)  # clears the options' variables

    def given(*args: str) -> frozenset[str]:
        parent = click.Context(producer_main, info_name="producer", **producer_main.context_settings)
        with cmd.make_context("enqueue", ["data.jsonl", *args], parent=parent) as ctx:
            return settings_given(ctx)

    assert given() == frozenset()
    assert given("--batch-size", "3", "--retry-failed", "--update-settings") == frozenset()
    assert given("--max-tokens", str(defaults.MAX_TOKENS), "--no-token-ids", "--variant", "a={}") == {
        "sampling.max_tokens", "token_ids", "variants"}
    monkeypatch.setenv("GENQUEUE_OUTPUT", "s3://b/p")
    with cmd.make_context("enqueue", ["data.jsonl"], parent=click.Context(producer_main)) as ctx:
        assert settings_given(ctx) == {"output"}


def test_the_lease_ratios_follow_the_lease() -> None:
    assert leases.renew_every(30) == 10.0 and leases.sweep_every(30) == 15.0  # as they were: /3, /2
    assert leases.renew_every(1) == leases.LEASE_RENEW_FLOOR and leases.sweep_every(1) == leases.LEASE_SWEEP_FLOOR


def test_the_default_lease_leaves_room_for_a_hung_redis_command() -> None:
    """REDIS_SOCKET_TIMEOUT < lease / 3: a hung command surfaces within one renewal period."""
    assert defaults.LEASE_SECONDS > leases.shortest_lease()
    assert defaults.REDIS_SOCKET_TIMEOUT < leases.renew_every(defaults.LEASE_SECONDS)
    assert leases.shortest_lease(5.0) == 15.0
