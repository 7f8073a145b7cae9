"""Nothing the user owns is written over, and the export's small untruths (issue 46).

A run made by a real `producer enqueue` (real Redis, the CLI as a user runs it) whose results
are shipped by hand, one success record per queued item, as a consumer would: the export, the
card, the side files and the rejects file never replace a file the run reads, nor one genqueue
did not write unless `--overwrite`; a retry or reconcile whose input is not the run's is
refused; and the lines that said the wrong thing say what is wrong. Each test names the old
line and the new one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from genqueue.common.keepers.rqaccess import LIVE_PLACES
from genqueue.common.keepers.rqjobs import JobScan, read_jobs
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.export import cardplots
from genqueue.producer.export.command import export_command
from genqueue.producer.outfiles import MANIFEST, OUTPUT, probe
from tests import s3server
from tests.conftest import cli, sharegpt, write_jsonl
from tests.s3server import S3Server

s3_server, s3_env = s3server.s3_server, s3server.s3_env  # fixtures

pytestmark = pytest.mark.integration

RUN = "mydata"
N = 20


def enqueue(tmp: Path, redis_url: str, data: Path, *args: str, check: bool = True) -> Any:
    return cli("producer", "enqueue", str(data), "--run", RUN, "--output", str(tmp / "out"), "--rejects",
               os.devnull, *args, env={"REDIS_URL": redis_url}, cwd=tmp, check=check)


def export(tmp: Path, redis_url: str, *args: str, check: bool = False) -> Any:
    return cli("producer", "export", "--run", RUN, *args, env={"REDIS_URL": redis_url}, cwd=tmp, check=check)


def ship(tmp: Path, conn: redis.Redis, *, leave_out: int = 0) -> None:
    """One success record per queued item (but the last LEAVE_OUT), in one shard, as a consumer
    ships them."""
    scan = JobScan()
    items = [it for job in read_jobs(conn, RUN, LIVE_PLACES, scan=scan) for it in job.items]
    shards = tmp / "out" / RUN / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    recs = [{"key": it["key"], "index": it["index"], "turn": it["turn"], "run": RUN, "messages": it["messages"],
             "content": f"answer {it['index']}", "reasoning": None, "finish_reason": "stop", "outcome": "finished",
             "usage": {"prompt_tokens": 9, "completion_tokens": 5}, "attempt": 1, "timings": {"finished_at": 1.0}}
            for it in items[:len(items) - leave_out]]
    (shards / "w-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))


@pytest.fixture
def run(tmp_path: Path, redis_url: str, conn: redis.Redis) -> Path:
    """mydata.jsonl (20 records) enqueued as run `mydata`, every item shipped: the input's path."""
    data = write_jsonl(tmp_path / "mydata.jsonl", [sharegpt(i) for i in range(N)])
    enqueue(tmp_path, redis_url, data, "--prompts", "inline")
    ship(tmp_path, conn)
    return data


def written_beside(folder: Path, keep: set[str]) -> list[str]:
    """What is in FOLDER besides KEEP (the files a refused export must not have written)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


# --- 1. the run's own input ------------------------------------------------------------------
@pytest.mark.parametrize("named", ["as given", "relative ./", "through a symlink", "through ../"])
def test_export_onto_the_runs_input_is_refused_and_writes_nothing(run: Path, redis_url: str, named: str) -> None:
    """Old: `export -o mydata.jsonl` replaced the 20 input lines by 20 rows, exit 0. New: exit 2,
    'output file …/mydata.jsonl is the input run mydata was enqueued from: genqueue never writes
    over a file a run reads …', the input byte for byte as it was, and no side file."""
    tmp = run.parent
    before = run.read_bytes()
    target = {"as given": str(run), "relative ./": "./mydata.jsonl", "through ../": "../" + tmp.name + "/mydata.jsonl",
              "through a symlink": "link.jsonl"}[named]
    if named == "through a symlink":
        (tmp / "link.jsonl").symlink_to(run)
    files = set(os.listdir(tmp))
    proc = export(tmp, redis_url, "-o", target)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: output file "), proc.stderr
    named_as = "" if named != "through a symlink" else f" ({run})"  # the input's own name, when another
    assert f"is the input run mydata was enqueued from{named_as}: genqueue never writes over a file a run reads " \
        "(a retry or reconcile reads it again); write it elsewhere with --output" in proc.stderr, proc.stderr
    assert run.read_bytes() == before
    assert written_beside(tmp, files) == []  # no .errors, .truncated, .missing, card, picture


def test_the_input_is_never_replaced_even_with_overwrite(run: Path, redis_url: str) -> None:
    """--overwrite lifts the refusal of a file genqueue did not write, never of the run's input."""
    before = run.read_bytes()
    proc = export(run.parent, redis_url, "-o", str(run), "--overwrite")
    assert proc.returncode == 2 and "is the input run mydata was enqueued from" in proc.stderr, proc.stderr
    assert run.read_bytes() == before


def test_a_side_file_named_as_the_input_is_refused(run: Path, redis_url: str) -> None:
    """Old: `--errors mydata.jsonl` put the errors file over the input. New: exit 2 naming it."""
    before = run.read_bytes()
    proc = export(run.parent, redis_url, "-o", "ds.jsonl", "--errors", "mydata.jsonl", "--overwrite")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: errors file {run} is the input run mydata was enqueued from")
    assert run.read_bytes() == before and not (run.parent / "ds.jsonl").exists()


def test_the_probe_opens_no_file_that_exists(tmp_path: Path) -> None:
    """Old: probe() opened its path 'wb', truncating a file of that name. New: the file is left
    as it was, and the place is probed under a fresh name."""
    mine = tmp_path / "ds.jsonl.tmp"
    mine.write_bytes(b"a user's bytes\n")
    probe(mine, OUTPUT, shown=tmp_path / "ds.jsonl")
    assert mine.read_bytes() == b"a user's bytes\n"
    assert sorted(os.listdir(tmp_path)) == ["ds.jsonl.tmp"]  # the fresh probe is gone again


# --- 2. a file genqueue did not write ----------------------------------------------------------
def test_a_users_file_is_refused_unless_overwrite(run: Path, redis_url: str) -> None:
    """Old: an existing ds.jsonl (anyone's) was replaced, exit 0. New: exit 2 'output file
    …/ds.jsonl exists and genqueue did not write it: pass --overwrite to replace it, or write it
    elsewhere with --output', nothing written; with --overwrite it is replaced."""
    tmp = run.parent
    mine = tmp / "ds.jsonl"
    mine.write_bytes(b'{"my": "curated data"}\n')
    files = set(os.listdir(tmp))
    proc = export(tmp, redis_url, "-o", "ds.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: output file {mine} exists and genqueue did not write it: pass --overwrite to "
                           "replace it, or write it elsewhere with --output\n")
    assert mine.read_bytes() == b'{"my": "curated data"}\n' and written_beside(tmp, files) == []
    assert export(tmp, redis_url, "-o", "ds.jsonl", "--overwrite").returncode == 0
    assert len(mine.read_bytes().splitlines()) == N


def test_a_users_side_file_refuses_the_whole_export(run: Path, redis_url: str) -> None:
    """A side file of the user's (here ds.missing.txt) refuses the export before the dataset or
    any other side file is written: no partial side file either."""
    tmp = run.parent
    (tmp / "ds.missing.txt").write_text("my notes\n")
    files = set(os.listdir(tmp))
    proc = export(tmp, redis_url, "-o", "ds.jsonl")
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: missing file {tmp / 'ds.missing.txt'} exists and "
                                                           "genqueue did not write it"), proc.stderr
    assert written_beside(tmp, files) == [] and (tmp / "ds.missing.txt").read_text() == "my notes\n"


def test_export_again_over_its_own_output_needs_no_overwrite(run: Path, redis_url: str) -> None:
    """Users re-export: a file genqueue wrote and nobody changed since is replaced without asking
    (the folder's manifest lists it); once changed, it is the user's."""
    tmp = run.parent
    assert export(tmp, redis_url, "-o", "ds.jsonl", "--format", "sharegpt").returncode == 0
    listed = orjson.loads((tmp / MANIFEST).read_bytes())["files"]
    assert {"ds.jsonl", "ds.errors.jsonl", "ds.truncated.jsonl", "ds.missing.txt", "ds.dataset_info.json"} <= set(listed)
    again = export(tmp, redis_url, "-o", "ds.jsonl", "--format", "sharegpt")
    assert again.returncode == 0, again.stderr
    with open(tmp / "ds.jsonl", "ab") as fh:  # the user adds a row of their own
        fh.write(b'{"conversations": []}\n')
    proc = export(tmp, redis_url, "-o", "ds.jsonl", "--format", "sharegpt")
    assert proc.returncode == 2 and f"output file {tmp / 'ds.jsonl'} was changed since genqueue wrote it: pass " \
        "--overwrite to replace it" in proc.stderr, proc.stderr


def test_a_users_dataset_info_and_picture_are_refused(run: Path, redis_url: str) -> None:
    """The format's side file (LLaMA-Factory's entry) and the card's pictures are files too."""
    tmp = run.parent
    info = tmp / "ds.dataset_info.json"
    info.write_text('{"mine": {}}\n')
    proc = export(tmp, redis_url, "-o", "ds.jsonl", "--format", "sharegpt")
    assert proc.returncode == 2 and f"side file {info} exists and genqueue did not write it" in proc.stderr
    info.unlink()
    if not cardplots.available():
        return
    picture = tmp / "ds.lengths.png"
    picture.write_bytes(b"my picture")
    proc = export(tmp, redis_url, "-o", "ds.jsonl")
    assert proc.returncode == 2 and f"card picture {picture} exists and genqueue did not write it" in proc.stderr
    assert picture.read_bytes() == b"my picture" and not (tmp / "ds.jsonl").exists()
    assert export(tmp, redis_url, "-o", "ds.jsonl", "--no-card").returncode == 0  # no card, no picture


def test_the_rejects_file_never_replaces_the_input_nor_a_users_file(tmp_path: Path, redis_url: str,
                                                                     conn: redis.Redis) -> None:
    """Old: `--rejects mydata.jsonl` replaced the input with the rejects. New: exit 2 naming it,
    nothing queued; a rejects file genqueue wrote is replaced by the next enqueue."""
    data = write_jsonl(tmp_path / "mydata.jsonl", [sharegpt(i) for i in range(5)] + ["not an object"])
    before = data.read_bytes()
    env = {"REDIS_URL": redis_url}
    proc = cli("producer", "enqueue", "mydata.jsonl", "--rejects", "mydata.jsonl", env=env, cwd=tmp_path,
               check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: rejects file {data} is the input of this "
                                                           "enqueue: genqueue never writes over"), proc.stderr
    assert data.read_bytes() == before and RunStore(conn).get(RUN) is None
    mine = tmp_path / "notes.jsonl"
    mine.write_text("mine\n")
    proc = cli("producer", "enqueue", "mydata.jsonl", "--rejects", "notes.jsonl", env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and f"rejects file {mine} exists and genqueue did not write it: remove it, or " \
        "write it elsewhere with --rejects" in proc.stderr, proc.stderr
    assert mine.read_text() == "mine\n"
    cli("producer", "enqueue", "mydata.jsonl", "--rejects", "r.jsonl", env=env, cwd=tmp_path)
    cli("producer", "enqueue", "mydata.jsonl", "--rejects", "r.jsonl", env=env, cwd=tmp_path)  # its own: replaced
    assert len((tmp_path / "r.jsonl").read_bytes().splitlines()) == 1


# --- 3. a retry or reconcile of another file -----------------------------------------------------
def test_a_retry_of_the_export_written_over_the_input_is_refused(run: Path, redis_url: str,
                                                                 conn: redis.Redis) -> None:
    """Old: `enqueue mydata.jsonl --run R --retry-failed`, the file now an export's rows, read them
    as input ('records read 921, enqueued 370': the run grew). New: exit 2, 'mydata.jsonl is not
    the input run mydata was made from: its first 20 records are not those the run read from this
    path …', nothing read or queued, the run's record of its input unchanged."""
    tmp = run.parent
    assert export(tmp, redis_url, "-o", "ds.jsonl").returncode == 0
    run.write_bytes((tmp / "ds.jsonl").read_bytes())  # the export, where the input was (by hand now)
    recorded = RunStore(conn).sources(RUN)
    items = RunStore(conn).item_count(RUN)
    for args in (("--retry-failed",), ()):  # the retry, and the plain reconcile
        proc = enqueue(tmp, redis_url, run, *args, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
            f"error: {run} is not the input run mydata was made from: its first 20 records are not those the run "
            "read from this path"), proc.stderr
        assert "nothing was read or queued" in proc.stderr and proc.stdout == ""
    assert RunStore(conn).sources(RUN) == recorded and RunStore(conn).item_count(RUN) == items


def test_a_grown_input_and_a_copy_are_still_the_runs(run: Path, redis_url: str, conn: redis.Redis) -> None:
    """The refusal is of another file only: the input grown at its end is reconciled (its new
    records queued), a copy of it may be retried, a file the run never read may not."""
    tmp = run.parent
    write_jsonl(run, [sharegpt(i) for i in range(N + 5)])
    grown = orjson.loads(enqueue(tmp, redis_url, run, "--json").stdout)
    assert (grown["records"], grown["enqueued"]) == (N + 5, 5)
    copy = tmp / "copy.jsonl"
    copy.write_bytes(run.read_bytes())
    assert enqueue(tmp, redis_url, copy, "--retry-failed", check=False).returncode == 0
    other = write_jsonl(tmp / "other.jsonl", [sharegpt(100 + i) for i in range(3)])
    proc = enqueue(tmp, redis_url, other, "--retry-failed", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"error: --retry-failed queues again what failed of run mydata's inputs, and {other} is none of them"), \
        proc.stderr
    assert orjson.loads(enqueue(tmp, redis_url, other, "--json").stdout)["enqueued"] == 3  # a new input: added


# --- 4, 5, 6: what the error lines say --------------------------------------------------------------
def test_an_output_that_is_a_file_says_so(tmp_path: Path, redis_url: str) -> None:
    """Old: 'output …/afile cannot be written: missing directory (…/afile: File exists)'. New:
    'not a directory (…/afile is a file); the output is a directory the run's results go into:
    name a directory, not a file, …', exit 2."""
    data = write_jsonl(tmp_path / "in.jsonl", [sharegpt(0)])
    (tmp_path / "afile").write_text("x")
    proc = cli("producer", "enqueue", str(data), "--output", "afile", "--rejects", os.devnull,
               env={"REDIS_URL": redis_url}, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: output {tmp_path / 'afile'} cannot be written: not a directory "
                                  f"({tmp_path / 'afile'} is a file); the output is a directory"), proc.stderr
    assert "File exists" not in proc.stderr and "missing directory" not in proc.stderr


def test_export_into_a_missing_folder_names_the_folder_not_the_free_space(run: Path, redis_url: str) -> None:
    """Old: 'cannot write output file …/nope/ds.jsonl: No such file or directory (83.7 GB … free
    in …)'. New: 'folder …/nope does not exist (create it: mkdir -p …/nope)', exit 2."""
    tmp = run.parent
    proc = export(tmp, redis_url, "-o", "nope/ds.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: cannot write output file {tmp / 'nope' / 'ds.jsonl'}: folder {tmp / 'nope'} "
                           f"does not exist (create it: mkdir -p {tmp / 'nope'}); write it elsewhere with --output\n")
    assert "free in" not in proc.stderr


def test_export_without_s3_credentials_exits_2_as_enqueue_does(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                               s3_server: S3Server, s3_env: dict[str, str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Old: 'error: cannot list s3://…: Unable to locate credentials', exit 1 (enqueue's probe:
    exit 2). New: exit 2, one line naming the cause and the fix."""
    RunStore(conn).create_or_check(RUN, RunSettings(output=s3_server.url("runs")))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(export_command, ["--run", RUN, "-o", str(tmp_path / "ds.jsonl")],
                             env={"REDIS_URL": redis_url})
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1 and res.output.startswith(
        f"error: cannot list s3://{s3_server.bucket}/runs/{RUN}/shards/: no credentials ("), res.output
    assert "AWS_ACCESS_KEY_ID" in res.output


# --- 7. the card of an incomplete export ----------------------------------------------------------
def test_the_card_of_an_incomplete_export_says_so(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    """Old: an export that exits 1 with items missing wrote a card that looked complete. New: the
    card's section begins '> **Incomplete export.** 3 of the run's 20 enqueued items have no
    record …'; a complete export's card has no such line."""
    data = write_jsonl(tmp_path / "mydata.jsonl", [sharegpt(i) for i in range(N)])
    enqueue(tmp_path, redis_url, data, "--prompts", "inline")
    ship(tmp_path, conn, leave_out=3)
    proc = export(tmp_path, redis_url, "-o", "ds.jsonl")
    assert proc.returncode == 1 and "3 enqueued items have no record" in proc.stderr, proc.stderr
    card = (tmp_path / "README.md").read_text()
    assert ("> **Incomplete export.** 3 of the run's 20 enqueued items have no record (listed in the missing file), "
            "and 0 failed for good: the run was not done when this dataset was exported.") in card, card
    ship(tmp_path, conn)
    assert export(tmp_path, redis_url, "-o", "ds.jsonl").returncode == 0
    assert "Incomplete" not in (tmp_path / "README.md").read_text()
