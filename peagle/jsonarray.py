"""Reading a top-level JSON array from a text file one element at a time, for files too large to load whole and for
files cut off mid-element (ShareGPT V3's is): both the benchmark prompt sets and the training data read them."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TextIO

CHUNK_CHARS = 1 << 20


class NotAJSONArrayError(ValueError):
    """The text does not open with `[` (after whitespace)."""


def opens_json_array(f: TextIO) -> bool:
    """Whether the text from `f`'s position on opens a JSON array (rather than, say, JSON lines); `f` is left where
    it was."""
    start = f.tell()
    char = f.read(1)
    while char and char.isspace():
        char = f.read(1)
    f.seek(start)
    return char == "["


def iter_json_array(f: TextIO, chunk_chars: int = CHUNK_CHARS) -> Iterator[Any]:
    """The elements of the JSON array that `f` holds, one at a time, reading `chunk_chars` characters at a time (so
    memory stays near one chunk plus the largest element). A truncated last element (the file ends mid-record) is
    dropped silently: everything complete before it is yielded. NotAJSONArrayError when `f` holds no array."""
    buf = f.read(chunk_chars)
    pos = _skip(buf, 0)
    while pos == len(buf):  # an empty file, or leading whitespace as long as a chunk
        buf = f.read(chunk_chars)
        if not buf:
            break
        pos = _skip(buf, 0)
    if buf[pos:pos + 1] != "[":
        raise NotAJSONArrayError(f"{getattr(f, 'name', 'the file')}: not a JSON array")
    decoder = json.JSONDecoder()
    pos, eof = pos + 1, False
    while True:
        pos = _skip(buf, pos, ",")
        if buf[pos:pos + 1] == "]":
            return
        decoded = _decode(decoder, buf, pos)
        # an element that reaches the end of what was read may go on in the next chunk (a number: 12|34)
        if decoded is None or (decoded[1] == len(buf) and not eof):
            if eof:
                return  # the truncated tail
            more = f.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        element, pos = decoded
        yield element
        if pos > chunk_chars:  # drop what was decoded, so the buffer does not grow with the file
            buf, pos = buf[pos:], 0


def _decode(decoder: json.JSONDecoder, buf: str, pos: int) -> tuple[Any, int] | None:
    """The element that starts at `pos` and the position after it, or None when no complete element starts there."""
    try:
        return decoder.raw_decode(buf, pos)
    except json.JSONDecodeError:
        return None


def _skip(buf: str, pos: int, also: str = "") -> int:
    """The first position at or after `pos` that is neither whitespace nor one of `also`."""
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in also):
        pos += 1
    return pos
