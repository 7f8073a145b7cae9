"""Keep secrets out of everything genqueue prints, logs or stores: one function, one set of rules.

Userinfo in any URL (`redis://:pw@host`, `s3://key:secret@bucket`) becomes `***`, and so does the
value of a URL query parameter whose name says it is secret (password, token, key, secret,
signature, credential: `?X-Amz-Signature=...`, `?password=...`). Applied to whole texts (error
messages, log lines), not only to URLs, since drivers quote the URL they failed on.
"""

from __future__ import annotations

import re

MASK = "***"

# Userinfo: "user@", or "user:password@" where the password may hold raw "/" and "@" (AWS secret
# keys hold "/"): it runs to the last "@" before white space, "?" or "#". A path holding "@" is
# masked too when the authority has a ":" (a port), which costs a log reader nothing.
_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?:[^\s/?#@:]*:[^\s?#]*|[^\s/?#:]*)@", re.IGNORECASE)
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&][^=&#\s]*(?:secret|token|key|passw(?:or)?d|pwd|signature|credential)[^=&#\s]*)=[^&#\s]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """TEXT with every credential in a URL replaced by ***; safe to print, log or store."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['name']}={MASK}", text)
