"""A run Redis does not hold: say whether its output holds its run.json, and how to get it back.

After Redis restarted empty, a run's settings still sit in `<output>/<run>/run.json`
(common/storage/runfile.py), and re-running `producer enqueue` on its inputs re-creates it
(producer/enqueue/runsetup.py). `producer status` and `producer export` name that file and print the
exact command, with the settings that make the same fingerprint (a command with other
settings is refused as a conflict) and the input sources run.json recorded.
"""

from __future__ import annotations

import shlex
import time

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.errors import RunNotFoundError
from genqueue.common.keepers.runs import not_found_line
from genqueue.common.redact import redact
from genqueue.common.settings import RunSettings
from genqueue.common.storage import StoreError, store_for
from genqueue.common.storage.runfile import RunFile, read_run_file, where


def run_gone(run: str, output: str, conn: redis.Redis) -> RunNotFoundError:
    """The error for RUN, which the Redis of CONN does not hold (named): with where its run.json
    is and the command that re-creates it when OUTPUT (the run's output location) holds one."""
    plain = not_found_line(conn, run)
    try:
        store = store_for(output)
        rf = read_run_file(store, run)
    except (StoreError, OSError, ValueError) as e:
        return RunNotFoundError(f"{plain}; its run.json could not be read at {redact(output)}: {e}")
    if rf is None:
        return RunNotFoundError(f"{plain}, and {redact(output)} holds no run.json of it (another output? "
                                "give it with --output or GENQUEUE_OUTPUT)")
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(rf.created_at))
    commands = " then ".join(f"`{c}`" for c in recreate_commands(rf))
    return RunNotFoundError(f"{plain}, but {where(store, run)} holds it (fingerprint {rf.fingerprint}, created "
                            f"{created}; Redis lost it): re-create it with {commands}")


def recreate_commands(rf: RunFile) -> list[str]:
    """The `producer enqueue` commands that re-create RF's run: one per recorded input source
    (`<input>` when none was recorded), with the flags that give its current settings."""
    flags = ["--run", rf.run, *settings_flags(rf.settings)]
    if rf.placement.shared_fs:
        flags.append("--shared-fs")
    sources = sorted(rf.sources) or ["<input>"]
    return [shlex.join(["producer", "enqueue", src, *flags]) for src in sources]


def settings_flags(s: RunSettings) -> list[str]:
    """`producer enqueue` flags that make settings S (those that differ from the defaults)."""
    base = RunSettings()
    out: list[str] = []
    if s.model is not None:
        out += ["--model", s.model]
    if s.multi_turn != base.multi_turn:
        out += ["--multi-turn", s.multi_turn.value]
    sp, bp = s.sampling, base.sampling
    for flag, mine, theirs in (("--temperature", sp.temperature, bp.temperature), ("--top-p", sp.top_p, bp.top_p),
                               ("--max-tokens", sp.max_tokens, bp.max_tokens), ("--seed", sp.seed, bp.seed)):
        if mine != theirs and mine is not None:
            out += [flag, str(mine)]
    if sp.extra:
        out += ["--sampling-json", orjson.dumps(sp.extra, option=orjson.OPT_SORT_KEYS).decode()]
    if s.max_prompt_chars != defaults.MAX_PROMPT_CHARS:
        out += ["--max-prompt-chars", str(s.max_prompt_chars)]
    if s.history_reasoning != base.history_reasoning:
        out += ["--history-reasoning", s.history_reasoning.value]
    if s.truncation != base.truncation:
        out += ["--truncation", s.truncation.value]
    if s.expect_reasoning:
        out.append("--expect-reasoning")
    if s.token_ids:
        out.append("--token-ids")
    if s.capture is not None:
        out += s.capture.options()
    return [*out, "--output", s.output]
