"""One redaction rule for every message, log line and stored value."""

from __future__ import annotations

import logging

import pytest

from genqueue.common.cli import RedactingFormatter
from genqueue.common.keepers.redisconn import redact_url
from genqueue.common.redact import redact


@pytest.mark.parametrize(("text", "expected"), [
    ("redis://:hunter2@h:6379/0", "redis://***@h:6379/0"),
    ("rediss://user:pw@h/1?ssl_ca_certs=/ca.pem", "rediss://***@h/1?ssl_ca_certs=/ca.pem"),
    ("s3://AKIA1:se/cret@bucket/p", "s3://***@bucket/p"),  # userinfo ends at the authority's last '@'
    ("redis://:p@ss@h:1/0", "redis://***@h:1/0"),
    ("cannot reach redis://u:x@a:1 and mail me at me@example.com", "cannot reach redis://***@a:1 and mail me at me@example.com"),
    ("https://h/o?X-Amz-Signature=abc&X-Amz-Date=1&X-Amz-Security-Token=tok",
     "https://h/o?X-Amz-Signature=***&X-Amz-Date=1&X-Amz-Security-Token=***"),
    ("http://h/?password=x&user=bob&api_key=k#frag", "http://h/?password=***&user=bob&api_key=***#frag"),
    ("redis://h:6379", "redis://h:6379"),
    ("s3://bucket/runs@v2", "s3://bucket/runs@v2"),  # an "@" in a path is no userinfo
    ("item key=0123abcd finished", "item key=0123abcd finished"),  # not a URL query: left alone
])
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected


def test_old_name_is_the_same_function() -> None:
    assert redact_url is redact


def test_log_lines_are_redacted() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "connecting to %s", ("redis://:pw@h:1/0",), None)
    line = RedactingFormatter("%(message)s").format(record)
    assert line == "connecting to redis://***@h:1/0"
