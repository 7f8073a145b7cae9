"""A missing S3 bucket is the user's to fix, at export as at enqueue: one line naming the bucket
and what to do, exit 2, no traceback, nothing written. Against a real S3 server (SeaweedFS),
the CLI run as a user runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import redis

from genqueue.common.keepers.keeper import run_key
from tests import s3server
from tests.conftest import cli, sharegpt, write_jsonl
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixture

pytestmark = pytest.mark.integration

RUN = "gone"


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_export_of_a_run_whose_bucket_is_gone_is_a_users_error(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                                s3_server: S3Server) -> None:
    """Old: 'error: cannot list s3://b/gone/shards/: An error occurred (NoSuchBucket) when calling
    the ListObjectsV2 operation: The specified bucket does not exist', exit 1 (enqueue on a
    missing bucket: exit 2, naming the bucket and `aws s3 mb`). New: exit 2, one line naming
    the bucket, the server and what to do; nothing written, here or in Redis."""
    env = {**s3_server.env, "REDIS_URL": redis_url}
    client = s3_server.client()
    client.create_bucket(Bucket="soon-gone")
    data = write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(5)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", "s3://soon-gone/runs", "--rejects", os.devnull,
        env=env, cwd=tmp_path)
    for obj in client.list_objects_v2(Bucket="soon-gone").get("Contents", []):
        client.delete_object(Bucket="soon-gone", Key=obj["Key"])
    client.delete_bucket(Bucket="soon-gone")

    enq = one_line(cli("producer", "enqueue", str(data), "--run", "other", "--output", "s3://soon-gone/runs",
                       "--rejects", os.devnull, env=env, cwd=tmp_path, check=False), 2)
    assert "no such bucket" in enq and "aws s3 mb s3://soon-gone" in enq, enq

    files = sorted(os.listdir(tmp_path))
    keys = sorted(conn.scan_iter(run_key(RUN, "*")))
    err = one_line(cli("producer", "export", "--run", RUN, "-o", "ds.jsonl", env=env, cwd=tmp_path, check=False), 2)
    assert err == (f"error: cannot list s3://soon-gone/runs/{RUN}/shards/: no such bucket (NoSuchBucket: The "
                   "specified bucket does not exist); the run's output names bucket soon-gone, which the server at "
                   f"{s3_server.endpoint} does not have: name the server its consumers shipped to "
                   "(GENQUEUE_S3_ENDPOINT or AWS_ENDPOINT_URL), or create the bucket (aws s3 mb s3://soon-gone)\n")
    assert sorted(os.listdir(tmp_path)) == files
    assert sorted(conn.scan_iter(run_key(RUN, "*"))) == keys


def test_export_to_an_s3_url_says_it_writes_local_files(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                          s3_server: S3Server) -> None:
    """Old: `-o s3://missing-bucket/x.jsonl` was read as the local path ./s3:/missing-bucket/x.jsonl:
    'folder …/s3:/missing-bucket does not exist (create it: mkdir -p …/s3:/missing-bucket)', exit 2.
    New: exit 2, 'export writes local files, not URLs', and how to put the dataset in S3."""
    env = {**s3_server.env, "REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(5)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", s3_server.url("runs"), "--rejects", os.devnull,
        env=env, cwd=tmp_path)
    files = sorted(os.listdir(tmp_path))
    for option in ("-o", "--errors"):
        args = ["-o", "ds.jsonl", option, "s3://missing-bucket/x.jsonl"] if option != "-o" else \
            ["-o", "s3://missing-bucket/x.jsonl"]
        err = one_line(cli("producer", "export", "--run", RUN, *args, env=env, cwd=tmp_path, check=False), 2)
        named = "--output" if option == "-o" else option
        assert err == (f"error: {named} s3://missing-bucket/x.jsonl: export writes local files, not URLs: name a "
                       "path on this host; to put it in S3, export to a local file and copy it (aws s3 cp x.jsonl "
                       "s3://missing-bucket/x.jsonl)\n")
    assert sorted(os.listdir(tmp_path)) == files
