"""The output probe (ShardStore.probe): a real SeaweedFS and real filesystems, each cause named,
nothing left behind."""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path

import pytest

from genqueue.common.storage import LocalStore, OutputProbeError, ProbeCause, probe_output
from genqueue.common.storage.names import PROBE_PREFIX, probe_name
from genqueue.common.storage.s3 import S3Store
from tests import s3server
from tests.conftest import free_port, small_tmpfs
from tests.s3server import S3Server

s3_server, s3_env = s3server.s3_server, s3server.s3_env  # fixtures


def refused(output: str, run: str = "r") -> OutputProbeError:
    with pytest.raises(OutputProbeError) as info:
        probe_output(output, run)
    return info.value


def keys(s3: S3Server) -> list[str]:
    return sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=s3.bucket).get("Contents", []))


def test_probe_name_is_beside_run_json_outside_the_shards() -> None:
    assert probe_name("r", "1-ab") == f"r/{PROBE_PREFIX}1-ab" and "/shards/" not in probe_name("r", "x")
    with pytest.raises(ValueError):
        probe_name("r", "a/b")


def test_a_good_s3_output_passes_and_keeps_no_probe(s3_server: S3Server, s3_env: dict[str, str]) -> None:
    before = keys(s3_server)
    probe_output(s3_server.url("runs/p"), "good")
    assert keys(s3_server) == before


@pytest.mark.parametrize(("secret", "key_id", "code"), [
    ("wrong-secret", s3server.ACCESS_KEY, "SignatureDoesNotMatch"),
    (s3server.SECRET_KEY, "nobody", "InvalidAccessKeyId"),
])
def test_credentials_the_server_refuses(s3_server: S3Server, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                        secret: str, key_id: str, code: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    e = refused(s3_server.url("runs/p"))
    assert e.cause == ProbeCause.SIGNATURE_REFUSED and code in str(e)
    assert str(e).startswith(f"output {s3_server.url('runs/p')} cannot be written: signature refused")
    assert "AWS_SECRET_ACCESS_KEY" in str(e) and "\n" not in str(e)


def test_no_credentials_at_all(s3_server: S3Server, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    e = refused(s3_server.url("runs/p"))
    assert e.cause == ProbeCause.NO_CREDENTIALS and "AWS_ACCESS_KEY_ID" in str(e)


def test_a_bucket_that_does_not_exist(s3_server: S3Server, s3_env: dict[str, str]) -> None:
    e = refused("s3://no-such-bucket/p")
    assert e.cause == ProbeCause.NO_SUCH_BUCKET and "create bucket no-such-bucket" in str(e)


def test_credentials_that_may_only_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(tmp_path / "s3")
    ids = server.config.read_text().replace('"identities": [', '"identities": [{"name": "reader", "credentials": '
                                            '[{"accessKey": "reader", "secretKey": "reader-secret"}], '
                                            '"actions": ["Read", "List"]}, ')
    server.config.write_text(ids)
    server.start()
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "reader")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "reader-secret")
        e = refused(server.url("runs/p"))
        assert e.cause == ProbeCause.ACCESS_DENIED and "PutObject" in str(e)
    finally:
        server.stop(kill=True)


def test_an_endpoint_nobody_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}.items():
        monkeypatch.setenv(k, v)
    store = S3Store.from_url("s3://b/p")
    with pytest.raises(OutputProbeError) as info:
        store.probe("r")
    assert info.value.cause == ProbeCause.UNREACHABLE and "127.0.0.1" in str(info.value)


def test_a_local_output_passes_and_leaves_no_directory(tmp_path: Path) -> None:
    out = tmp_path / "not" / "yet"
    probe_output(str(out), "r")
    assert not (tmp_path / "not").exists(), "a missing output is not made by the probe"
    (out / "r").mkdir(parents=True)
    LocalStore(str(out)).probe("r")
    assert list((out / "r").iterdir()) == []


def test_a_local_output_that_is_or_is_under_a_file_says_so(tmp_path: Path) -> None:
    """Was 'missing directory (…/f: File exists)'; now 'not a directory (…/f is a file)'."""
    (tmp_path / "f").write_text("x")
    for output in (tmp_path / "f" / "out", tmp_path / "f"):
        e = refused(str(output))
        assert e.cause == ProbeCause.NOT_A_DIRECTORY and f"not a directory ({tmp_path / 'f'} is a file)" in str(e)
        assert "File exists" not in str(e) and "name a directory, not a file" in str(e)


def test_a_read_only_local_output(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "ro", "1m") as mnt:
        (mnt / "out").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        e = refused(str(mnt / "out"))
        assert e.cause == ProbeCause.READ_ONLY and "mount it read-write" in str(e)
        e = refused(str(mnt / "new" / "out"))  # a missing directory it cannot make: read-only too
        assert e.cause == ProbeCause.READ_ONLY


def test_a_full_local_output(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "full", "64k") as mnt:
        (mnt / "fill").write_bytes(bytes(64 * 1024))
        e = refused(str(mnt))
        assert e.cause == ProbeCause.FULL


def test_a_local_output_that_reads_back_other_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache or mount that does not keep what is written: the probe's one line names the file
    and both sizes (the wording local and S3 share: storage.base.check_read_back)."""
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: b"other" if p.name.startswith(PROBE_PREFIX) else real(p))
    (tmp_path / "out" / "r").mkdir(parents=True)
    with pytest.raises(OutputProbeError) as info:
        LocalStore(str(tmp_path / "out")).probe("r")
    e = info.value
    assert e.cause == ProbeCause.READ_BACK and list((tmp_path / "out" / "r").iterdir()) == []
    assert re.fullmatch(rf"output {re.escape(str(tmp_path / 'out'))} cannot be written: read back wrong "
                        rf"\({re.escape(str(tmp_path / 'out' / 'r'))}/{re.escape(PROBE_PREFIX)}\S+ read back 5 bytes, not the "
                        r"\d+ written\); check the filesystem \(a cache or mount that does not keep what is written\), "
                        r"or enqueue the run with another --output", str(e)), str(e)


def test_an_s3_output_that_reads_back_other_bytes(s3_server: S3Server, s3_env: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy or gateway that does not keep what is written: named, and no probe left behind."""
    url = s3_server.url("runs/rb")
    store = S3Store.from_url(url)
    monkeypatch.setattr(store.client, "get_object", lambda **_: {"Body": io.BytesIO(b"other")})
    before = keys(s3_server)
    with pytest.raises(OutputProbeError) as info:
        store.probe("r")
    e = info.value
    assert e.cause == ProbeCause.READ_BACK and keys(s3_server) == before
    assert re.fullmatch(rf"output {re.escape(url)} cannot be written: read back wrong \({re.escape(url)}/r/"
                        rf"{re.escape(PROBE_PREFIX)}\S+ read back 5 bytes, not the \d+ written\); check the endpoint "
                        r"\(a proxy or gateway that does not keep what is written\)", str(e)), str(e)


def test_consumers_probing_one_new_local_output_at_once_all_pass(tmp_path: Path) -> None:
    """Consumers started together run their pre-flights at the same moment: each probe makes the
    missing directories, and removes those it made. One probe's mkdir losing the race, or its
    directory removed under it by another, is no fault of the output (it refused a starting
    consumer in CI with 'missing directory (…/out: File exists)')."""
    import threading

    errors: list[BaseException] = []
    for round_ in range(20):
        out = tmp_path / f"r{round_}" / "deep" / "out"
        start = threading.Barrier(6)

        def one(out: Path = out, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                for _ in range(5):
                    LocalStore(str(out)).probe("r")
            except BaseException as e:  # noqa: BLE001 (the test reports every failure)
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [], f"round {round_}"
        # (a directory another probe wrote in while its maker removed it may stay: consumers
        # starting together ship into it anyway)
