"""A run's records, read for the drafter report: from a run's output (`<output>/<run>`, a
directory or s3://bucket/prefix/run), or from the output a run named in Redis is shipped to.

Every shard under `<output>/<run>/shards/` is read in name order (the store lists them so), each
line once; a line that is no JSON record is counted, not fatal. Nothing else is read: the
report is the records' alone, so it is the same before and after Redis forgets the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import redis

from genqueue.common.errors import UserError
from genqueue.common.settings import check_run_name
from genqueue.common.storage import store_for
from genqueue.producer.drafter.compare import RunAnswers


@dataclass(frozen=True, slots=True)
class RunOutput:
    """Where one run's records are: the output setting and the run's name under it."""

    output: str
    run: str

    @property
    def where(self) -> str:
        return f"{self.output.rstrip('/')}/{self.run}"


def is_location(text: str) -> bool:
    """Whether TEXT names a run's output rather than a run: a run name holds no '/'
    (check_run_name), so `./eval-b` is a directory and `eval-b` a run in Redis."""
    return "/" in text or os.sep in text


def parse_location(text: str) -> RunOutput:
    """The output and run of a run's output location `<output>/<run>` (a directory, or
    s3://bucket/prefix/run); UserError for one whose last part is no run name."""
    if text.startswith("s3://"):
        head, _, run = text.rstrip("/").rpartition("/")
        if head in ("s3:/", "s3:") or not run:
            raise UserError(f"{text}: name a run's output, s3://bucket[/prefix]/<run>")
        output = head
    else:
        path = os.path.abspath(text)
        output, run = os.path.dirname(path), os.path.basename(path)
        if not os.path.isdir(path):
            raise UserError(f"no such output: {text} is not a directory (name a run's output, <output>/<run>)")
    try:
        check_run_name(run)
    except UserError:
        raise UserError(f"{text}: its last part {run!r} is no run name (name a run's output, <output>/<run>)") from None
    return RunOutput(output, run)


def resolve(text: str, conn: Callable[[], redis.Redis]) -> RunOutput:
    """The records' place TEXT names: a run's output location, or a run whose output Redis
    holds (CONN is called only then)."""
    if is_location(text):
        return parse_location(text)
    from genqueue.common.keepers.runs import RunStore

    info = RunStore(conn()).require(check_run_name(text))
    return RunOutput(info.settings.output, info.name)


def read_answers(where: RunOutput) -> RunAnswers:
    """The answers of every record shipped under WHERE; UserError when it holds none."""
    store = store_for(where.output)
    shards = store.list_shards(where.run)
    if not shards:
        raise UserError(f"no records under {where.where}: no shards in {store.location(where.run)}")
    out = RunAnswers()
    for shard in shards:
        with store.open(where.run, shard.name) as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    out.bad += 1
                    continue
                if isinstance(rec, dict):
                    out.add(rec)
                else:
                    out.bad += 1
    if not out.records:
        raise UserError(f"no records under {where.where}: its {len(shards)} shards hold none")
    return out
