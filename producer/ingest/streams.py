"""The byte layer under the reader: decompression, a BOM, and one error for a broken stream.

Everything here reads in bounded pieces: memory stays flat whatever the file size or its
compression ratio.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import zstandard

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BOM = b"\xef\xbb\xbf"

#: A 1 KiB zstd piece decompresses to at most ~32 MiB, so memory stays bounded even for a billion blank lines.
_ZSTD_FEED = 1024


class StreamError(Exception):
    """The byte stream broke mid-way (truncated or corrupt compression, bad framing)."""


def decompressed_chunks(source: Any, compression: str, size: int) -> Iterator[bytes]:
    """Chunks of about ``size`` bytes of ``source`` decompressed ("gzip", "zstd" or "none").

    Raises StreamError when the stream breaks; chunks before the break were yielded.
    """
    if compression == "gzip":
        return _read_chunks(gzip.GzipFile(fileobj=source, mode="rb"), size)
    if compression == "zstd":
        return _zstd_chunks(source, size)
    return _read_chunks(source, size)


def describe_error(e: BaseException) -> str:
    """One line saying what went wrong, for an error message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_head(fh: BinaryIO) -> bytes:
    """The first four bytes (fewer at end of file), enough for every magic number."""
    head = b""
    while len(head) < 4:
        more = fh.read(4 - len(head))
        if not more:
            break
        head += more
    return head


class Prefixed:
    """A readable that replays the sniffed head bytes before the rest of the stream."""

    def __init__(self, head: bytes, fh: BinaryIO) -> None:
        self._head = head
        self._fh = fh

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._fh.read(size)
        head, self._head = self._head, b""
        if size is None or size < 0:
            return head + self._fh.read()
        if size <= len(head):
            self._head = head[size:]
            return head[:size]
        return head + self._fh.read(size - len(head))


def _read_chunks(stream: Any, size: int) -> Iterator[bytes]:
    while True:
        try:
            data = stream.read(size)
        except (OSError, EOFError, zlib.error) as e:
            raise StreamError(describe_error(e)) from e
        if not data:
            return
        yield data


def _zstd_chunks(source: Any, size: int) -> Iterator[bytes]:
    # decompressobj rather than stream_reader: only it tells (eof) whether the last frame
    # was complete, so a truncated .zst fails loudly instead of ending early in silence.
    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    in_frame = False
    out: list[bytes] = []
    out_len = 0
    for raw in _read_chunks(source, size):
        view = memoryview(raw)
        for offset in range(0, len(raw), _ZSTD_FEED):
            piece: Any = view[offset : offset + _ZSTD_FEED]
            while piece:
                try:
                    data = dobj.decompress(piece)
                except zstandard.ZstdError as e:
                    raise StreamError(f"corrupt zstd data: {describe_error(e)}") from e
                in_frame = True
                if data:
                    out.append(data)
                    out_len += len(data)
                if not dobj.eof:
                    break
                piece = dobj.unused_data
                dobj = dctx.decompressobj()
                in_frame = False
            if out_len >= size:
                yield b"".join(out)
                out, out_len = [], 0
    if out:
        yield b"".join(out)
    if in_frame:
        raise StreamError("zstd data ends early (truncated file?)")


def strip_bom(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The chunks, without a UTF-8 byte order mark at the very start."""
    it = iter(chunks)
    first = b""
    for chunk in it:
        first += chunk
        if len(first) >= len(_BOM):
            break
    first = first.removeprefix(_BOM)
    if first:
        yield first
    yield from it
