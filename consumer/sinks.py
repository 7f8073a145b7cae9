"""Choosing where a run's shards go from its output setting."""

from __future__ import annotations

from genqueue.consumer.shards import LocalSink, Sink


def make_sink(output: str) -> Sink:
    """An S3 sink for s3://bucket/prefix, else a local (or shared-mount) directory."""
    if output.startswith("s3://"):
        from genqueue.consumer.s3sink import S3Sink

        return S3Sink.from_url(output)
    return LocalSink(output)
