"""A run's output in S3 (or any S3-compatible store: SeaweedFS, MinIO, Ceph RGW).

Object names follow `names.py` under the URL's prefix; a shard's manifest is written only after
the shard was uploaded and verified, so a manifest's presence means its shard is complete.
Credentials come from boto3's standard chain only. An S3-compatible endpoint comes from
`GENQUEUE_S3_ENDPOINT`, or from `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` (read by botocore);
with a custom endpoint, path-style addressing is used (what self-hosted stores expect).

Integrity: every upload carries `ChecksumAlgorithm=SHA256` (the server checks each part as it
arrives) and the whole file's sha256 as object metadata; after it, a HEAD must show the right
size and sha256, and the server's own checksum (whole-object, or COMPOSITE per part) must match.

`ship` raises on any failure; the consumer retries with backoff. A multipart upload a dead server
left open is aborted by `abort_stale_uploads`, which each store runs before its first upload until
one sweep has reached the server (in the shipping thread: never the event loop). Reading (`open`)
downloads to an anonymous temporary file with the transfer manager (ranged, retried GETs), so a
reader never holds a long-lived HTTP stream that a blip would break.

Packs are one PUT each (whole or not at all, checked by the server's SHA256) and are read whole,
by a byte range, or by their tail (`bytes=-n`, whose Content-Range gives the pack's size).
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import boto3
import orjson
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from s3transfer.utils import ChunksizeAdjuster

from genqueue.common import defaults
from genqueue.common.errors import GenqueueError, UserError
from genqueue.common.storage.base import (
    OutputProbeError,
    PackNotFoundError,
    ProbeCause,
    SealedShard,
    ShardInfo,
    StoreError,
    StoreRefusedError,
    check_read_back,
    probe_body,
    probe_token,
)
from genqueue.common.storage.names import (
    manifest_name,
    packs_prefix,
    parse_pack_name,
    parse_shard_name,
    probe_name,
    run_settings_name,
    shard_of_manifest,
    shards_prefix,
)

log = logging.getLogger(__name__)

#: Shards above this size go up as multipart uploads, in parts of MULTIPART_CHUNKSIZE.
MULTIPART_THRESHOLD = 16 * 1024 * 1024
#: Bytes per part: S3's 10,000 parts take an object to 160 GB, and a retried part resends 16 MiB at most.
MULTIPART_CHUNKSIZE = 16 * 1024 * 1024
#: Parallel part uploads of one shard (a consumer ships at most two shards at once).
S3_TRANSFER_CONCURRENCY = 4
#: Seconds to connect to S3: short, since the consumer retries a failed ship with backoff.
CONNECT_TIMEOUT = 5.0
#: Seconds without a byte from S3 before a request is retried: a healthy store answers in under a second.
READ_TIMEOUT = 60.0
#: botocore's attempts of one request before genqueue's backoff and spool take over: a blip absorbed, an outage seen.
BOTO_ATTEMPTS = 3

ENDPOINT_ENV = "GENQUEUE_S3_ENDPOINT"
ABORT_AFTER_ENV = "GENQUEUE_S3_ABORT_AFTER"


class ShipVerifyError(GenqueueError):
    """The object stored in S3 does not match the shard that was uploaded."""


@dataclass(frozen=True, slots=True)
class S3Location:
    """A bucket and a key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """s3://bucket[/prefix] -> S3Location; raises UserError on anything else."""
        if not url.startswith("s3://"):
            raise UserError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise UserError(f"S3 URL without a bucket: {url!r}")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        """The object key of PARTS under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


def endpoint_url() -> str | None:
    """The custom endpoint, if any: GENQUEUE_S3_ENDPOINT, else the AWS_ENDPOINT_URL variables."""
    return (os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


def make_client(*, connect_timeout: float = CONNECT_TIMEOUT, read_timeout: float = READ_TIMEOUT,
                attempts: int = BOTO_ATTEMPTS) -> Any:
    """A boto3 S3 client: standard credential chain, custom endpoint from the environment."""
    endpoint = endpoint_url()
    cfg = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                 retries={"total_max_attempts": attempts, "mode": "standard"},
                 s3={"addressing_style": "path"} if endpoint else None)
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=cfg)


def abort_stale_uploads(client: Any, loc: S3Location, older_than_s: float) -> int:
    """Abort every open multipart upload under LOC's prefix started more than OLDER_THAN_S
    seconds ago. Returns how many were aborted."""
    cutoff = time.time() - older_than_s
    prefix = loc.key() + "/" if loc.prefix else ""
    aborted = 0
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=loc.bucket, Prefix=prefix):
        for up in page.get("Uploads", []):
            initiated: datetime = up["Initiated"]
            if initiated.astimezone(UTC).timestamp() > cutoff:
                continue
            client.abort_multipart_upload(Bucket=loc.bucket, Key=up["Key"], UploadId=up["UploadId"])
            log.warning("aborted a stale multipart upload of %s (started %s)", loc.url(up["Key"]),
                        initiated.isoformat())
            aborted += 1
    return aborted


class S3Store:
    """Ships sealed shards to, and lists and reads them from, s3://bucket/prefix/<run>/shards/."""

    def __init__(self, loc: S3Location, *, client: Any = None, multipart_threshold: int = MULTIPART_THRESHOLD,
                 multipart_chunksize: int = MULTIPART_CHUNKSIZE, stale_after_s: float | None = None,
                 tmpdir: str | None = None) -> None:
        self.loc = loc
        self.tmpdir = tmpdir
        self._client = client
        self._lock = threading.Lock()
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=multipart_chunksize,
                                       max_concurrency=S3_TRANSFER_CONCURRENCY)
        if stale_after_s is None:
            raw = os.environ.get(ABORT_AFTER_ENV, "")
            try:
                stale_after_s = float(raw) if raw else defaults.S3_STALE_UPLOAD_SECONDS
            except ValueError:
                raise UserError(f"{ABORT_AFTER_ENV}={raw!r} is not a number of seconds") from None
        self.stale_after_s = stale_after_s
        self._swept = False
        self._sweep_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """A store for s3://bucket/prefix (the run's output setting)."""
        return cls(S3Location.parse(url), **kwargs)

    @property
    def client(self) -> Any:
        # Built on first use, in the shipping thread: creating a client costs ~0.1 s of CPU.
        with self._lock:
            if self._client is None:
                self._client = make_client()
            return self._client

    def location(self, run: str) -> str:
        return self.loc.url(self._prefix(run))

    def _prefix(self, run: str) -> str:
        return self.loc.key(shards_prefix(run)) + "/"

    def object_keys(self, shard: SealedShard) -> tuple[str, str]:
        """The keys of SHARD's data object and of its manifest."""
        prefix = self._prefix(shard.run)
        return prefix + shard.name, prefix + manifest_name(shard.name)

    # --- writing ---------------------------------------------------------------------
    def ship(self, shard: SealedShard) -> str:
        """Upload SHARD, verify it, then write its manifest. Raises on any failure."""
        self._sweep_once()
        key, man_key = self.object_keys(shard)
        t0 = time.monotonic()
        self.upload_verified(shard.path, key, size=shard.bytes, sha256=shard.sha256, what="the shard",
                             content_type="application/x-ndjson", metadata={"records": str(shard.records)})
        self.client.put_object(Bucket=self.loc.bucket, Key=man_key, Body=orjson.dumps(shard.manifest()),
                               ChecksumAlgorithm="SHA256", ContentType="application/json")
        log.debug("uploaded %s (%d bytes) in %.2f s", key, shard.bytes, time.monotonic() - t0)
        return self.loc.url(key)

    def upload_verified(self, path: Path, key: str, *, size: int, sha256: str, what: str, content_type: str,
                        metadata: dict[str, str]) -> None:
        """Upload the spool file PATH (SIZE bytes, SHA256) to KEY, the server checking each part
        (ChecksumAlgorithm SHA256) and keeping its sha256 as metadata beside METADATA, then
        verify it by a HEAD: size, sha256, and the server's own checksum against the file read
        again. Raises ShipVerifyError (naming WHAT it uploaded) or the client's error."""
        extra = {"ChecksumAlgorithm": "SHA256", "ContentType": content_type,
                 "Metadata": {"sha256": sha256, **metadata}}
        self.client.upload_file(str(path), self.loc.bucket, key, ExtraArgs=extra, Config=self.transfer)
        head = self.client.head_object(Bucket=self.loc.bucket, Key=key, ChecksumMode="ENABLED")
        stored_size, meta = head.get("ContentLength"), head.get("Metadata", {})
        if stored_size != size or meta.get("sha256") != sha256:
            raise ShipVerifyError(f"{self.loc.url(key)} holds {stored_size} bytes, sha256 {meta.get('sha256')}; "
                                  f"{what} has {size} bytes, sha256 {sha256}")
        stored = head.get("ChecksumSHA256")
        if stored:
            expected = self._expected_checksum(path, size, sha256, multipart="-" in stored)
            if stored != expected:
                raise ShipVerifyError(f"{self.loc.url(key)}: server checksum {stored} != {expected}")

    def _expected_checksum(self, path: Path, size: int, sha256: str, *, multipart: bool) -> str:
        """The SHA256 checksum S3 reports for the file: of the whole object, or (multipart) the
        sha256 of the parts' digests with a -<parts> suffix. Also re-checks the spool file."""
        whole = hashlib.sha256()
        chunk = ChunksizeAdjuster().adjust_chunksize(self.transfer.multipart_chunksize, size)
        parts: list[bytes] = []
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                whole.update(block)
                parts.append(hashlib.sha256(block).digest())
        if whole.hexdigest() != sha256:
            raise ShipVerifyError(f"spool file {path} changed since it was sealed")
        if not multipart:
            return base64.b64encode(whole.digest()).decode()
        composite = hashlib.sha256(b"".join(parts)).digest()
        return f"{base64.b64encode(composite).decode()}-{len(parts)}"

    def _sweep_once(self) -> None:
        with self._sweep_lock:
            if self._swept:
                return
            try:
                abort_stale_uploads(self.client, self.loc, self.stale_after_s)
                self._swept = True
            except ClientError as e:  # e.g. no permission to list uploads: do not ask again
                self._swept = True
                log.warning("could not abort stale multipart uploads under %s: %s",
                            self.loc.url(self.loc.key()), e)
            except Exception as e:  # noqa: BLE001 - server unreachable: the upload will say so; sweep next time
                log.warning("could not list stale multipart uploads under %s (%s: %s)",
                            self.loc.url(self.loc.key()), type(e).__name__, e)

    def probe(self, run: str) -> None:
        """PUT a probe object beside RUN's run.json, GET it back, DELETE it: credentials,
        bucket, endpoint and write permission, proven by the calls a consumer makes. A DELETE
        the credentials may not make is only warned about: shipping never deletes."""
        token = probe_token()
        key, body = self.loc.key(probe_name(run, token)), probe_body(token)
        client = self.client
        try:
            client.put_object(Bucket=self.loc.bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256")
            back = client.get_object(Bucket=self.loc.bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise self._probe_failed(e) from None
        try:
            client.delete_object(Bucket=self.loc.bucket, Key=key)
        except (BotoCoreError, ClientError) as e:
            log.warning("could not delete the probe object %s (%s): delete it by hand", self.loc.url(key), e)
        check_read_back(self.url, self.loc.url(key), back, body,
                        "check the endpoint (a proxy or gateway that does not keep what is written)")

    @property
    def url(self) -> str:
        """The output as the run names it, for messages."""
        return self.loc.url(self.loc.key())

    def _probe_failed(self, e: Exception) -> OutputProbeError:
        where = f" at {endpoint_url()}" if endpoint_url() else ""
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return OutputProbeError(self.url, ProbeCause.NO_CREDENTIALS, str(e),
                                    "give this host credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                    "AWS_PROFILE, or an instance role")
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
            return OutputProbeError(self.url, ProbeCause.UNREACHABLE, str(e),
                                    f"check the endpoint{where} is up and reachable from this host "
                                    f"({ENDPOINT_ENV} or AWS_ENDPOINT_URL names it)")
        if not isinstance(e, ClientError):
            return OutputProbeError(self.url, ProbeCause.OTHER, f"{type(e).__name__}: {e}",
                                    "check the endpoint and the credentials of this host")
        err = e.response.get("Error", {})
        code, msg = str(err.get("Code", "")), str(err.get("Message", "") or e)
        detail = f"{code}: {msg}" if code else msg
        if code == "NoSuchBucket":
            return OutputProbeError(self.url, ProbeCause.NO_SUCH_BUCKET, detail,
                                    f"create bucket {self.loc.bucket}{where} (aws s3 mb s3://{self.loc.bucket}), "
                                    "or enqueue the run with another --output")
        if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken",
                    "AuthorizationHeaderMalformed"):
            return OutputProbeError(self.url, ProbeCause.SIGNATURE_REFUSED, detail,
                                    f"give this host credentials the server{where} accepts (AWS_ACCESS_KEY_ID, "
                                    "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)")
        if code in ("AccessDenied", "AllAccessDisabled", "403", "Forbidden"):
            return OutputProbeError(self.url, ProbeCause.ACCESS_DENIED, detail,
                                    f"let these credentials PutObject, GetObject and DeleteObject under "
                                    f"{self.url}/, or use credentials that may")
        return OutputProbeError(self.url, ProbeCause.OTHER, detail, "check the endpoint and the credentials of this host")

    # --- reading ---------------------------------------------------------------------
    def list_shards(self, run: str) -> list[ShardInfo]:
        prefix = self._prefix(run)
        sizes: dict[str, int] = {}
        manifests: set[str] = set()
        foreign = 0
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.loc.bucket,
                                                                               Prefix=prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if parse_shard_name(name) is not None:
                        sizes[name] = int(obj["Size"])
                    elif shard_of_manifest(name) is not None:
                        manifests.add(name)
                    else:
                        foreign += 1
        except (BotoCoreError, ClientError) as e:
            refused = self._probe_failed(e)
            if refused.cause is ProbeCause.NO_SUCH_BUCKET:  # the user's to fix, as at the probe: 2
                where = f" at {endpoint_url()}" if endpoint_url() else ""
                raise StoreRefusedError(
                    f"cannot list {self.location(run)}: {refused.cause.value} ({refused.detail}); the run's "
                    f"output names bucket {self.loc.bucket}, which the server{where} does not have: name the "
                    f"server its consumers shipped to ({ENDPOINT_ENV} or AWS_ENDPOINT_URL), or create the bucket "
                    f"(aws s3 mb s3://{self.loc.bucket})") from None
            if refused.cause in (ProbeCause.NO_CREDENTIALS, ProbeCause.SIGNATURE_REFUSED):  # the user's to fix: 2
                raise StoreRefusedError(f"cannot list {self.location(run)}: {refused.cause.value} ({refused.detail}); "
                                f"{refused.fix}") from None
            raise StoreError(f"cannot list {self.location(run)}: {e}") from None
        if foreign:
            log.warning("%s: %d objects that are not shards were left out", self.location(run), foreign)
        return [ShardInfo(name, size, man if (man := manifest_name(name)) in manifests else None)
                for name, size in sorted(sizes.items())]

    def open(self, run: str, name: str) -> IO[bytes]:
        if shard_of_manifest(name) is not None:  # a few hundred bytes: one GET, held in memory
            try:
                body = self.client.get_object(Bucket=self.loc.bucket, Key=self._prefix(run) + name)["Body"]
                return io.BytesIO(body.read())
            except (BotoCoreError, ClientError) as e:
                raise StoreError(f"cannot read {self.location(run)}{name}: {e}") from None
        if parse_shard_name(name) is None:
            raise StoreError(f"not a shard or manifest name: {name!r}")
        # An anonymous file: gone when closed, or when the process dies, whatever happens.
        fh = tempfile.TemporaryFile(prefix=".gq-export-", dir=self.tmpdir)  # noqa: SIM115 - returned
        try:
            self.client.download_fileobj(self.loc.bucket, self._prefix(run) + name, fh, Config=self.transfer)
            fh.seek(0)
        except (BotoCoreError, ClientError) as e:
            fh.close()
            raise StoreError(f"cannot read {self.location(run)}{name}: {e}") from None
        except BaseException:
            fh.close()
            raise
        return fh

    # --- packs -------------------------------------------------------------------------
    def _pack_key(self, run: str, name: str) -> str:
        if parse_pack_name(name) is None:
            raise StoreError(f"not a pack name: {name!r}")
        return self.loc.key(packs_prefix(run), name)

    def pack_location(self, run: str, name: str) -> str:
        return self.loc.url(self._pack_key(run, name))

    def put_pack(self, run: str, name: str, data: bytes) -> str:
        key = self._pack_key(run, name)
        try:  # one PUT: the server checks the SHA256 and keeps the object whole or not at all
            self.client.put_object(Bucket=self.loc.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256",
                                   ContentType="application/octet-stream")
        except (BotoCoreError, ClientError) as e:
            raise StoreError(f"cannot write {self.loc.url(key)}: {e}") from None
        return self.loc.url(key)

    def _get(self, run: str, name: str, byte_range: str | None) -> tuple[bytes, dict[str, Any]]:
        key = self._pack_key(run, name)
        extra = {"Range": byte_range} if byte_range else {}
        try:
            resp = self.client.get_object(Bucket=self.loc.bucket, Key=key, **extra)
            return resp["Body"].read(), resp
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise PackNotFoundError(f"no pack {self.loc.url(key)}") from None
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None
        except BotoCoreError as e:
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None

    def get_pack(self, run: str, name: str) -> bytes:
        return self._get(run, name, None)[0]

    def get_pack_range(self, run: str, name: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"not a byte range: [{start}, {end})")
        if end == start:
            return b""
        return self._get(run, name, f"bytes={start}-{end - 1}")[0]

    def get_pack_tail(self, run: str, name: str, length: int) -> tuple[bytes, int]:
        body, resp = self._get(run, name, f"bytes=-{length}")
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        if not total.isdigit():  # a server that ignored the range sent the whole object
            return body[-length:], len(body)
        return body, int(total)

    # --- the run's settings ------------------------------------------------------------
    def get_run_file(self, run: str) -> bytes | None:
        key = self.loc.key(run_settings_name(run))
        try:
            body: bytes = self.client.get_object(Bucket=self.loc.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None
        except BotoCoreError as e:
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None
        return body

    def put_run_file(self, run: str, data: bytes) -> str:
        key = self.loc.key(run_settings_name(run))
        try:  # one PUT: S3 replaces an object whole or not at all
            self.client.put_object(Bucket=self.loc.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256",
                                   ContentType="application/json")
        except (BotoCoreError, ClientError) as e:
            raise StoreError(f"cannot write {self.loc.url(key)}: {e}") from None
        return self.loc.url(key)
