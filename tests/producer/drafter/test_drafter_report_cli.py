"""`producer drafter-report` as a user runs it, on hand-made shards: a run's output named as a
directory or as s3:// (a real SeaweedFS) gives the same report; a line that is no record is
counted, not fatal; names that are no run's output are refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.common.errors import UserError
from genqueue.common.storage.names import shard_name, shards_prefix
from genqueue.producer.drafter.reading import RunOutput, is_location, parse_location
from tests.conftest import cli
from tests.producer.drafter.test_compare import held_out
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

NO_REDIS = "redis://127.0.0.1:1/0"


def write_run(out: Path, run: str, recs: list[dict[str, Any]], tail: bytes = b"") -> Path:
    shards = out / shards_prefix(run)
    shards.mkdir(parents=True)
    half = len(recs) // 2
    for seq, part in ((1, recs[:half]), (2, recs[half:])):
        (shards / shard_name("w", seq)).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in part) + tail)
    return out / run


def report(*args: str, env: dict[str, str] | None = None) -> Any:
    return orjson.loads(cli("producer", "drafter-report", *args, "--json",
                            env={"REDIS_URL": NO_REDIS, **(env or {})}).stdout)


def test_a_line_that_is_no_record_is_counted_and_the_rest_reported(tmp_path: Path) -> None:
    cand = write_run(tmp_path / "out", "eval-b", held_out("eval-b", "new", 24, 12), tail=b"{not json\n[1]\n\n")
    r = report(str(cand))
    assert r["candidate"]["bad_lines"] == 4 and r["candidate"]["items_answered"] == 60  # 2 shards x 2 lines


def test_an_s3_output_gives_the_report_a_directory_gives(tmp_path: Path, s3_server: S3Server) -> None:  # noqa: F811
    cand = write_run(tmp_path / "out", "eval-b", held_out("eval-b", "new", 24, 12))
    base = write_run(tmp_path / "out", "eval-a", held_out("eval-a", "old", 18, 18))
    s3 = s3_server.client()
    for f in sorted(cand.glob("shards/*")):
        s3.put_object(Bucket=s3_server.bucket, Key=f"evals/eval-b/shards/{f.name}", Body=f.read_bytes())
    from_dir = report(str(cand), "--against", str(base))
    from_s3 = report(s3_server.url("evals/eval-b"), "--against", str(base), env=s3_server.env)
    assert from_s3 == from_dir and from_dir["items_compared"] == 60
    missing = cli("producer", "drafter-report", s3_server.url("evals/nothing"), check=False,
                  env={"REDIS_URL": NO_REDIS, **s3_server.env})
    assert missing.returncode == 2 and missing.stderr.startswith("error: no records under"), missing.stderr


def test_locations_and_names() -> None:
    assert is_location("./eval-b") and is_location("/o/eval-b") and is_location("s3://b/p/eval-b")
    assert not is_location("eval-b")
    assert parse_location("s3://bucket/a/b/eval-b/") == RunOutput("s3://bucket/a/b", "eval-b")
    assert parse_location("s3://bucket/eval-b") == RunOutput("s3://bucket", "eval-b")
    for bad in ("s3://bucket", "s3://bucket/", "s3://bucket/a/no run"):
        with pytest.raises(UserError, match="name a run's output"):
            parse_location(bad)
    with pytest.raises(UserError, match="no such output"):
        parse_location("/nonexistent/eval-b")


def test_runs_with_no_items_in_common_say_so_and_exit_2_not_no_figures(tmp_path: Path) -> None:
    # was: "the candidate's records carry no speculative-decoding figures" (it runs at 60%), exit 0
    # now: "error: no items in common: eval-b answered 60 items (acceptance 60.0% over 60 answers); ..."
    cand = write_run(tmp_path / "out", "eval-b", held_out("eval-b", "new", 18, 18))
    other = [{**r, "key": "other-" + r["key"]} for r in held_out("eval-a", "old", 12, 12)]
    base = write_run(tmp_path / "out", "eval-a", other)
    got = cli("producer", "drafter-report", str(cand), "--against", str(base), check=False,
              env={"REDIS_URL": NO_REDIS})
    assert got.returncode == 2 and got.stdout == "", (got.returncode, got.stdout)
    line = got.stderr.strip()
    assert "carries no speculative-decoding figures" not in got.stderr and len(line.splitlines()) == 1, line
    assert line.startswith("error: no items in common: eval-b answered 60 items (acceptance 60.0% over 60 answers); "
                           "eval-a answered 60 items (acceptance 40.0% over 60 answers)"), line
