"""Frame records out of byte chunks: JSONL lines, or the elements of one JSON array.

Pure byte framing, no parsing (that is the JSON parser's job, one record at a time), and
memory bounded by one record: a record past ``max_bytes`` keeps only its size and first
bytes while the rest streams past. The array splitter tracks only what decides where an
element ends: nesting depth, whether it is inside a string, and a pending backslash
escape, which may straddle a chunk boundary. Regexes jump straight to the next token that
matters (a whole string is one token), so long strings and blank-line runs cost C time,
not a Python step per byte.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

log = logging.getLogger(__name__)

NON_SPACE = re.compile(rb"\S")
# A whole string in one match (the unrolled-loop form: linear, no catastrophic backtracking),
# else one structural byte; a bare quote is a string still open at the end of the chunk.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},"]', re.DOTALL)
# Below depth 1 commas do not matter: skipping them saves a Python step per comma.
_NESTED_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}"]', re.DOTALL)
_IN_STRING = re.compile(rb'["\\]')
_QUOTE, _BACKSLASH, _COMMA = 0x22, 0x5C, 0x2C
_OPENERS = (0x5B, 0x7B)
#: Bytes of a bad input line quoted in its reject reason: enough to find it, short enough for one terminal line.
SNIPPET_BYTES = 300
"""How much of a raw record is kept for the rejects file."""


def split_array(
    chunks: Iterable[bytes], max_bytes: int
) -> Iterator[tuple[bytes | None, int, bytes]]:
    """Yield ``(raw, size, snippet)`` for each element of the array in ``chunks``.

    ``raw`` is the element's whitespace-stripped bytes, or None when it is longer than
    ``max_bytes`` (only its size and first bytes are kept then, so memory stays bounded).
    Empty elements (``[]``, a trailing comma) are skipped. An array cut short yields its
    unfinished last element, which will not parse. Raises ValueError when the input does not
    start with ``[`` or has anything but whitespace after the closing bracket.
    """
    depth = 0  # 0 until the opening bracket, then 1 inside the top-level array
    in_string = False
    skip = 0  # a backslash ended the previous chunk: skip the escaped byte
    parts: list[bytes] = []
    size = 0
    snippet = b""  # kept once an element is too large to keep whole
    done = False
    for chunk in chunks:
        n = len(chunk)
        if done:
            if NON_SPACE.search(chunk):
                raise ValueError("unexpected data after the top-level array")
            continue
        pos = 0
        if depth == 0:
            m = NON_SPACE.search(chunk)
            if m is None:
                continue
            if chunk[m.start()] != _OPENERS[0]:
                raise ValueError("not a JSON array")
            depth, pos = 1, m.start() + 1
        seg = pos  # where the current element's bytes start in this chunk
        pos += skip
        skip = 0
        while pos < n:
            if in_string:
                m = _IN_STRING.search(chunk, pos)
                if m is None:
                    break
                i = m.start()
                if chunk[i] == _BACKSLASH:
                    if i + 1 >= n:
                        skip = 1
                        break
                    pos = i + 2
                else:
                    in_string = False
                    pos = i + 1
                continue
            m = (_TOKEN if depth == 1 else _NESTED_TOKEN).search(chunk, pos)
            if m is None:
                break
            i = m.start()
            c = chunk[i]
            pos = m.end()
            if c == _QUOTE:
                in_string = pos - i == 1
            elif c in _OPENERS:
                depth += 1
            elif c == _COMMA:
                if depth == 1:
                    element = _finish(parts, size, snippet, chunk[seg:i], max_bytes)
                    if element is not None:
                        yield element
                    parts, size, snippet, seg = [], 0, b"", pos
            else:
                depth -= 1
                if depth == 0:
                    element = _finish(parts, size, snippet, chunk[seg:i], max_bytes)
                    if element is not None:
                        yield element
                    parts, size, snippet = [], 0, b""
                    done = True
                    if NON_SPACE.search(chunk, pos):
                        raise ValueError("unexpected data after the top-level array")
                    break
        if done:
            continue
        tail = chunk[seg:]
        if not parts and not snippet:
            tail = tail.lstrip()  # leading whitespace is no part of the element
            if not tail:
                continue
        size += len(tail)
        if snippet:
            continue
        parts.append(tail)
        if size > max_bytes:
            snippet = _head(parts)
            parts = []
    if not done and depth > 0:
        log.warning("the JSON array is not closed: the input looks truncated")
        element = _finish(parts, size, snippet, b"", max_bytes)
        if element is not None:
            yield element


def split_lines(
    chunks: Iterable[bytes], max_bytes: int
) -> Iterator[tuple[int, bytes | None, int, bytes]]:
    """Yield ``(line, raw, size, snippet)`` for each non-blank line of JSONL ``chunks``.

    ``line`` is the 1-based physical line number; ``raw`` the line without its newline and
    surrounding whitespace (a CRLF's ``\\r`` included), or None when the line is longer than
    ``max_bytes``: then the rest of it is skipped as it streams past, keeping only its first
    bytes and size. Blank and whitespace-only lines are skipped in C, in bulk.
    """
    line = 1  # physical line of the next byte
    parts: list[bytes] = []  # the unfinished line carried from earlier chunks
    part_len = 0
    part_line = 0
    carrying = False
    overflow = False  # the carried line passed max_bytes: only its head and size are kept
    snippet = b""
    for chunk in chunks:
        pos = 0
        if carrying:
            newline = chunk.find(b"\n")
            end = len(chunk) if newline < 0 else newline
            part_len += end
            if not overflow:
                parts.append(chunk[:end])
                if part_len > max_bytes:
                    overflow, snippet, parts = True, _head(parts), []
            if newline < 0:
                continue
            if overflow:
                yield part_line, None, part_len, snippet
            else:
                yield _line(part_line, b"".join(parts))
            line += 1
            pos = newline + 1
            carrying, overflow, parts = False, False, []
        while True:
            # Jumping to the next non-blank byte in C keeps blank-line runs cheap.
            m = NON_SPACE.search(chunk, pos)
            if m is None:
                line += chunk.count(b"\n", pos)
                break
            start = m.start()
            line += chunk.count(b"\n", pos, start)
            newline = chunk.find(b"\n", start)
            if newline < 0:
                piece = chunk[start:]
                carrying, part_line, part_len = True, line, len(piece)
                if part_len > max_bytes:
                    overflow, snippet, parts = True, piece[:SNIPPET_BYTES], []
                else:
                    overflow, parts = False, [piece]
                break
            if newline - start > max_bytes:
                yield line, None, newline - start, chunk[start : start + SNIPPET_BYTES]
            else:
                yield _line(line, chunk[start:newline])
            line += 1
            pos = newline + 1
    if carrying:
        if overflow:
            yield part_line, None, part_len, snippet
        else:
            yield _line(part_line, b"".join(parts))


def _line(line: int, data: bytes) -> tuple[int, bytes, int, bytes]:
    raw = data.rstrip()
    return line, raw, len(raw), raw[:SNIPPET_BYTES]


def _head(parts: list[bytes]) -> bytes:
    head = b""
    for part in parts:
        head += part[: SNIPPET_BYTES - len(head)]
        if len(head) >= SNIPPET_BYTES:
            break
    return head


def _finish(
    parts: list[bytes], size: int, snippet: bytes, last: bytes, max_bytes: int
) -> tuple[bytes | None, int, bytes] | None:
    if snippet:
        return None, size + len(last), snippet
    parts.append(last)
    raw = b"".join(parts).strip()
    if not raw:
        return None
    if len(raw) > max_bytes:
        return None, len(raw), raw[:SNIPPET_BYTES]
    return raw, len(raw), raw[:SNIPPET_BYTES]
