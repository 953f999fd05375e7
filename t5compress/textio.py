"""Reading the user's text (files, stdin, command-line arguments) as UTF-8, in one place.

A byte sequence that is not UTF-8 is a one-line DataError naming the source, the line and the byte offset, never a
UnicodeDecodeError traceback, nor (for arguments, which Python decodes with surrogateescape) a lone surrogate that
a tokenizer later fails on. A UTF-8 byte order mark at the start is dropped, as `utf-8-sig` does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from t5compress.errors import DataError

BOM = b"\xef\xbb\xbf"
STDIN = "<stdin>"
MAX_LINE = 64 << 20  # bytes in one line of text: far more than any model reads as one input


def _bounded(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of `stream`, each read up to MAX_LINE + 1 bytes (so an endless one stops there)."""
    while raw := stream.readline(MAX_LINE + 1):
        yield raw


def decode(data: bytes, where: str, offset: int = 0) -> str:
    """`data` as UTF-8 text; `offset`: where `data` starts in its source, so the error gives the source's offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {offset + e.start})"
                        ) from None


def _open(path: Path, what: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise DataError(f"{what} '{path}' is a directory, not a file") from None
    except OSError as e:
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e))
        raise DataError(f"cannot read {what} '{path}': {why}") from None


def numbered_lines(raw_lines: Iterable[bytes] | BinaryIO, name: str) -> Iterator[tuple[int, str]]:
    """(line number, text without its line ending) of a byte stream, every line decoded as UTF-8; a line longer than
    MAX_LINE is a DataError (what a file without line breaks, such as /dev/zero, would otherwise become: memory
    exhausted by one line)."""
    offset = 0
    for lineno, raw in enumerate(_bounded(raw_lines) if hasattr(raw_lines, "readline") else raw_lines, 1):
        if len(raw) > MAX_LINE:
            raise DataError(f"{name}:{lineno}: a line longer than {MAX_LINE >> 20} MB; give text, one input per line")
        skip = len(BOM) if lineno == 1 and raw.startswith(BOM) else 0
        yield lineno, decode(raw[skip:], f"{name}:{lineno}", offset + skip).rstrip("\r\n")
        offset += len(raw)


def read_lines(path: str | os.PathLike, what: str = "file") -> Iterator[tuple[int, str]]:
    """(line number, text) of a file, or of stdin for '-'; errors name `what` and the path."""
    if str(path) == "-":
        stdin = getattr(sys.stdin, "buffer", None)  # bytes; a replaced sys.stdin may be text only
        raw = stdin if stdin is not None else (line.encode("utf-8", "surrogateescape") for line in sys.stdin)
        yield from numbered_lines(raw, STDIN)
        return
    with _open(Path(path), what) as f:
        yield from numbered_lines(f, str(path))


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A whole file as UTF-8 text (a leading BOM dropped)."""
    with _open(Path(path), what) as f:
        data = f.read()
    skip = len(BOM) if data.startswith(BOM) else 0
    return decode(data[skip:], str(path), skip)


def check_text(value: str, where: str) -> str:
    """`value` if UTF-8 can encode it; a lone surrogate (what a JSON escape like \\udcff or undecodable bytes become)
    is a DataError, where a tokenizer would raise a TypeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: not text: {value[e.start]!r} at character {e.start} is a lone surrogate") from None
    return value


def argument(value: str, where: str) -> str:
    """A command-line argument as it was typed: undecodable bytes (surrogate escapes) are a DataError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        try:
            data = os.fsencode(value)  # the bytes that were typed
        except UnicodeEncodeError:
            data = value.encode("utf-8", "surrogatepass")
        return decode(data, where)
    return value
